"""The promotion gate end to end on a live server with the tiny model.

A tiny SFT run that learns to answer every question with "Kiln." passes a held-out suite
and is promoted; a run that learns "Nope." regresses against the adapter active before it,
which stays active; with a floor it is demoted and renamed; a suite of ten examples ends
inconclusive; a suite that shares a prompt with the training data is refused before
queueing. Every body validates against the schemas."""

from __future__ import annotations

import pytest
from _server import ServerProcess, wait_for

from kiln import contracts

TRAIN_WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "maple",
    "tiger",
    "lemon",
    "piano",
    "candle",
    "forest",
    "silver",
    "rocket",
    "garden",
    "violet",
    "summer",
    "meadow",
    "harbor",
    "copper",
    "winter",
    "planet",
]
SUITE_WORDS = [
    "bridge",
    "ocean",
    "pencil",
    "mirror",
    "sunset",
    "falcon",
    "valley",
    "castle",
    "orchard",
    "glacier",
    "lantern",
    "compass",
    "island",
    "thunder",
    "marble",
    "feather",
    "canyon",
    "velvet",
    "crystal",
    "saddle",
    "beacon",
    "walnut",
    "prairie",
    "sapphire",
]


def _examples(answer: str) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"Tell me about the {w}."}, {"role": "assistant", "content": answer}]}
        for w in TRAIN_WORDS
    ]


def _suite(name: str, words: list[str], *, prompt: str = "Describe the {}.") -> dict:
    return {
        "schema": "kiln.eval-suite.v1",
        "name": name,
        "scorer": {"kind": "contains"},
        "generation": {"temperature": 0, "seed": 0, "max_tokens": 4},
        "examples": [
            {"id": w, "messages": [{"role": "user", "content": prompt.format(w)}], "expected": "Kiln."} for w in words
        ],
    }


CONFIG = {"epochs": 1, "learning_rate": 0.03, "optimizer": {"kind": "adam_w"}, "seed": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    with ServerProcess(tmp_path_factory.mktemp("gate-home"), tiny_model_dir) as running:
        with running.client() as client:
            for suite in (_suite("held-out", SUITE_WORDS), _suite("small", SUITE_WORDS[:10])):
                response = client.post("/v1/eval/suites", json=suite)
                assert response.status_code == 200, response.text
                contracts.load("EvalSuiteEntry", response.json())
        yield running


def _train(client, name: str, answer: str, post_eval: dict) -> dict:
    body = {"examples": _examples(answer), "config": {**CONFIG, "output_name": name}, "post_eval": post_eval}
    submitted = client.post("/v1/train/sft", json=body)
    assert submitted.status_code == 200, submitted.text
    job_id = submitted.json()["job_id"]

    def done():
        detail = client.get(f"/v1/train/jobs/{job_id}").json()
        return detail if detail["state"] in ("completed", "failed") else None

    detail = wait_for(done, timeout=600, interval=0.25)
    contracts.load("TrainingJobDetail", detail)
    assert detail["state"] == "completed", detail.get("error")
    return detail


def _active(client) -> str | None:
    return client.get("/health").json()["active_adapter"]


def _linked(client, detail: dict) -> list[dict]:
    jobs = [client.get(f"/v1/eval/jobs/{i}").json() for i in detail["linked_eval_job_ids"]]
    for job in jobs:
        contracts.load("EvalJobDetail", job)
        assert job["linked_training_job_id"] == detail["job_id"]
    return jobs


def test_a_run_that_learns_the_task_is_promoted_and_a_regressing_one_is_not(server):
    with server.client() as client:
        good = _train(client, "good", "Kiln.", {"suite": "held-out", "min_accuracy": 0.5})
        verdict = good["post_eval_verdict"]
        contracts.load("GateVerdict", verdict)
        assert good["gate_outcome"] == "promoted", verdict["reason"]
        assert verdict["paired_examples"] == 24
        assert verdict["improvements"] > 20
        assert verdict["regressions"] == 0
        assert verdict["sign_test_p_value"] < 0.05
        assert verdict["candidate_wilson_lower"] >= 0.5
        assert verdict["baseline"]["kind"] == "base"
        baseline, candidate = _linked(client, good)
        assert (baseline["role"], candidate["role"]) == ("baseline", "candidate")
        assert baseline["result"]["target"]["kind"] == "base"
        assert candidate["result"]["target"]["adapter"] == "good"
        assert _active(client) == "good"

        bad = _train(client, "bad", "Nope.", {"suite": "held-out"})
        verdict = bad["post_eval_verdict"]
        assert bad["gate_outcome"] == "regression", verdict["reason"]
        assert verdict["baseline"]["adapter"] == "good"  # compared with the adapter active before training
        assert verdict["regressions"] > 20
        assert _active(client) == "good"  # the previous adapter stays active
        assert bad["adapter_path"] is not None  # trained, not promoted

        floored = _train(client, "worse", "Nope.", {"suite": "held-out", "min_accuracy": 0.5})
        assert floored["gate_outcome"] == "demoted", floored["post_eval_verdict"]["reason"]
        names = {a["name"] for a in client.get("/v1/adapters").json()["available"]}
        assert "worse.failed" in names
        assert "worse" not in names
        assert _active(client) == "good"


def test_too_few_paired_examples_end_inconclusive(server):
    with server.client() as client:
        # the reference's spelling of the scope; the verdict records Kiln's
        detail = _train(client, "small-gate", "Kiln.", {"suite": "small", "data_scope": "held-out"})
        assert detail["gate_outcome"] == "inconclusive"
        assert detail["post_eval_verdict"]["data_scope"] == "held_out"
        assert detail["post_eval_verdict"]["paired_examples"] == 10
        assert _active(client) != "small-gate"


def test_a_suite_that_overlaps_the_training_data_is_refused_at_submission(server):
    with server.client() as client:
        leaky = _suite("leaky", ["apple", *SUITE_WORDS[:3]], prompt="Tell me about the {}.")
        assert client.post("/v1/eval/suites", json=leaky).status_code == 200
        before = len(client.get("/v1/train/status").json())
        body = {
            "examples": _examples("Kiln."),
            "config": {**CONFIG, "output_name": "leak"},
            "post_eval": {"suite": "leaky"},
        }
        refused = client.post("/v1/train/sft", json=body)
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "training_invalid_request"
        assert "'apple'" in error["message"]
        assert error["pointer"] == "/post_eval/suite"
        spelled = client.post("/v1/train/sft", json={**body, "post_eval": {"suite": "leaky", "data_scope": "held-out"}})
        assert spelled.status_code == 400  # the reference's spelling is the same held-out check
        assert "'apple'" in spelled.json()["error"]["message"]
        assert len(client.get("/v1/train/status").json()) == before
        missing = client.post("/v1/train/sft", json={**body, "post_eval": {"suite": "nope"}})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "eval_suite_not_found"
        diagnostic = client.post(
            "/v1/train/sft",
            json={**body, "post_eval": {"suite": "leaky", "data_scope": "train_set_eval", "min_accuracy": 0.5}},
        )
        assert diagnostic.status_code == 400
        hyphenated = {"suite": "leaky", "data_scope": "train-set-eval", "min_accuracy": 0.5}
        assert client.post("/v1/train/sft", json={**body, "post_eval": hyphenated}).status_code == 400


def test_a_standalone_evaluation_job_reports_accuracy_and_its_wilson_interval(server):
    with server.client() as client:
        submitted = client.post("/v1/eval/jobs", json={"suite": "small"})
        assert submitted.status_code == 200, submitted.text
        job_id = submitted.json()["job_id"]
        detail = wait_for(
            lambda: (d := client.get(f"/v1/eval/jobs/{job_id}").json())["state"] in ("completed", "failed") and d,
            timeout=300,
        )
        contracts.load("EvalJobDetail", detail)
        result = detail["result"]
        assert detail["state"] == "completed"
        assert result["example_count"] == 10
        assert result["target"]["kind"] == "base"
        assert 0.0 <= result["wilson_lower"] <= result["accuracy"] <= result["wilson_upper"] <= 1.0
        listed = client.get("/v1/eval/jobs").json()
        assert job_id in {j["job_id"] for j in listed}
        assert job_id not in {j["job_id"] for j in client.get("/v1/train/status").json()}
        assert client.get(f"/v1/train/jobs/{job_id}").status_code == 404
        in_use = client.delete("/v1/eval/suites/small")
        assert in_use.status_code == 200
        assert client.post("/v1/eval/jobs", json={"suite": "small"}).status_code == 404


def test_the_readme_gate_walkthrough(server, capsys, tmp_path, monkeypatch):
    """The README's promotion-gate commands, against the live server: register the example suite,
    submit the example gated request, read the outcome, compare the two sides, run one evaluation."""
    import json
    from pathlib import Path

    from kiln.cli import main

    root = Path(__file__).resolve().parent.parent
    monkeypatch.setenv("KILN_URL", server.url)
    assert main(["eval", "suites", "add", str(root / "examples" / "eval_suite.json")]) == 0
    assert main(["eval", "suites", "add", str(root / "examples" / "eval_suite.json")]) == 0  # a no-op
    capsys.readouterr()
    with server.client() as client:
        body = json.loads((root / "examples" / "gated_sft_request.json").read_text(encoding="utf-8"))
        submitted = client.post("/v1/train/sft", json=body)
        assert submitted.status_code == 200, submitted.text
        job_id = submitted.json()["job_id"]
        # the verdict is recorded while the job still runs (the gate is part of it): wait for the job's end
        detail = wait_for(
            lambda: (d := client.get(f"/v1/train/jobs/{job_id}").json())["state"] in ("completed", "failed") and d,
            timeout=600,
        )
    assert detail["state"] == "completed", detail.get("error")
    assert detail["post_eval_verdict"]
    # seven examples: fewer than 20 pairs, so the gate cannot promote (or the floor demotes)
    assert detail["gate_outcome"] in ("inconclusive", "demoted")
    assert main(["train", "status", "--job-id", job_id]) == 0
    out = capsys.readouterr().out
    assert f"Gate: {detail['gate_outcome']} -- " in out
    baseline, candidate = detail["linked_eval_job_ids"]
    assert main(["eval", "status", "--job-id", candidate]) == 0
    assert "Wilson" in capsys.readouterr().out
    assert main(["eval", "compare", baseline, candidate]) == 0
    assert "p" in capsys.readouterr().out
    assert main(["eval", "run", "--suite", "acme-support-heldout", "--wait", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["result"]
    path = tmp_path / "result.json"
    path.write_text(json.dumps(result), encoding="utf-8")
    assert contracts.validate_path(path).valid
