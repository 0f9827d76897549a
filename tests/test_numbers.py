"""One canonical spelling per number, decided by the schema position it sits in (docs/contracts.md, "Numbers").

An integral float at an integer position is the int, an int at a number position is the float, a number equal to a
``const``/``enum`` member is that member, and positions without a type keep what they hold. Both layers -- the
problem listing and the strict loader -- judge the canonical value, and every writer writes it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest
from _server import wait_for

from kiln import contracts
from kiln.errors import ContractError, IntegrityError

SFT = {
    "examples": [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}],
    "config": {"epochs": 3.0},
}
SUITE = {
    "schema": "kiln.eval-suite.v1",
    "name": "spelt",
    "scorer": {"kind": "contains"},
    "generation": {"temperature": 0, "seed": 0, "max_tokens": 16},
    "examples": [{"id": "q1", "messages": [{"role": "user", "content": "Say hi."}], "expected": "hi"}],
}


def _suite(**generation: object) -> dict:
    suite = copy.deepcopy(SUITE)
    suite["generation"].update(generation)
    return suite


def test_an_integral_float_at_an_integer_position_is_accepted_by_both_layers_and_loads_as_the_int():
    assert contracts.problems("SftRequest", SFT) == []
    epochs = contracts.load("SftRequest", SFT).config.epochs
    assert (epochs, type(epochs)) == (3, int)


def test_integer_positions_hold_ints_whatever_the_spelling():
    for spelt in (16.0, 1.6e1):
        assert contracts.canonical("EvalSuite", _suite(max_tokens=spelt)) == _suite(max_tokens=16)
    seed = contracts.canonical("EvalSuite", _suite(seed=-0.0))["generation"]["seed"]
    assert (seed, type(seed)) == (0, int)
    assert contracts.canonical("EvalSuite", _suite(seed=1e3))["generation"]["seed"] == 1000


def test_a_non_integral_float_at_an_integer_position_stays_and_is_refused():
    suite = _suite(max_tokens=16.5)
    assert contracts.canonical("EvalSuite", suite)["generation"]["max_tokens"] == 16.5
    assert [(p.code, p.pointer) for p in contracts.problems("EvalSuite", suite)] == [
        ("wrong_type", "/generation/max_tokens")
    ]
    with pytest.raises(ContractError) as info:
        contracts.load("EvalSuite", suite)
    assert (info.value.code, info.value.pointer) == ("wrong_type", "/generation/max_tokens")


def test_number_positions_hold_floats_and_keep_a_negative_zero():
    post = contracts.canonical("PostEval", {"suite": "s", "min_accuracy": 1})
    assert (post["min_accuracy"], type(post["min_accuracy"])) == (1.0, float)
    body = {**SFT, "config": {"lora_alpha": 16, "learning_rate": 1}}
    config = contracts.canonical("SftRequest", body)["config"]
    assert [type(config[k]) for k in ("lora_alpha", "learning_rate")] == [float, float]
    kept = contracts.canonical("PostEval", {"suite": "s", "min_accuracy": -0.0})["min_accuracy"]
    assert str(kept) == "-0.0"


def test_a_number_equal_to_a_constant_is_the_constant():
    suite = contracts.canonical("EvalSuite", _suite(temperature=0.0))
    assert (suite["generation"]["temperature"], type(suite["generation"]["temperature"])) == (0, int)
    assert contracts.canonical("EvalSuite", _suite(temperature=-0.0))["generation"]["temperature"] == 0
    assert contracts.problems("EvalSuite", _suite(temperature=0.0)) == []


def test_the_first_union_branch_that_validates_decides():
    seeded = contracts.canonical("SftRequest", {**SFT, "config": {"seed": 7.0}})["config"]["seed"]
    assert (seeded, type(seeded)) == (7, int)
    assert contracts.canonical("SftRequest", {**SFT, "config": {"seed": "7"}})["config"]["seed"] == "7"
    prompt = {"model": "m", "prompt": [1.0, 2.0]}
    assert contracts.canonical("CompletionRequest", prompt)["prompt"] == [1, 2]
    assert all(type(t) is int for t in contracts.canonical("CompletionRequest", prompt)["prompt"])


def test_positions_without_a_type_keep_exactly_what_they_hold():
    content = [{"type": "text", "n": 1.0, "m": 2}]
    body = {"examples": [{"messages": [{"role": "user", "content": content}]}]}
    kept = contracts.canonical("SftRequest", body)["examples"][0]["messages"][0]["content"]
    assert kept == content
    assert [type(kept[0]["n"]), type(kept[0]["m"])] == [float, int]


def test_canonical_never_changes_the_value_it_is_given():
    suite = _suite(max_tokens=16.0)
    before = json.dumps(suite)
    contracts.canonical("EvalSuite", suite)
    contracts.load("EvalSuite", suite)
    assert json.dumps(suite) == before


def test_an_integer_beyond_the_float_range_at_a_number_position_is_refused_by_both_layers():
    body = {"suite": "s", "min_accuracy": 2**1024}
    found = contracts.problems("PostEval", body)
    assert [(p.code, p.pointer) for p in found] == [("out_of_range", "/min_accuracy")]
    with pytest.raises(ContractError) as info:
        contracts.load("PostEval", body)
    assert (info.value.code, info.value.pointer) == ("out_of_range", "/min_accuracy")


def test_large_integers_at_an_integer_position_are_exact_in_both_layers():
    for big in (2**53 + 1, 2**63, 2**64 - 1):
        suite = _suite(seed=big)
        assert contracts.problems("EvalSuite", suite) == []
        assert contracts.load("EvalSuite", suite).generation.seed == big
    for beyond in (2**64, 2**70, -1, -(2**63)):
        with pytest.raises(ContractError) as info:
            contracts.load("EvalSuite", _suite(seed=beyond))
        assert (info.value.code, info.value.pointer) == ("out_of_range", "/generation/seed")


def test_writers_write_the_canonical_form(tmp_path):
    path = contracts.write("EvalSuite", tmp_path / "suite.json", _suite(max_tokens=16.0, temperature=0.0))
    assert path.read_bytes() == contracts.render("EvalSuite", SUITE)
    assert b'"max_tokens":16,' in path.read_bytes()


# --------------------------------------------------------------------------------------- the HTTP app


@pytest.fixture
def http(tmp_path, tiny_model_dir, monkeypatch):
    """An in-process server on the tiny model whose queue runs in its own thread."""
    from fastapi.testclient import TestClient

    from kiln.host.config import resolve_settings
    from kiln.server._app import build_server, create_app

    home = tmp_path / "home"
    monkeypatch.setenv("KILN_HOME", str(home))
    settings = resolve_settings(
        {"paths.home": str(home), "model.path": str(tiny_model_dir), "training.worker": "thread"}
    )
    with TestClient(create_app(build_server(settings))) as client:
        client.home = home
        yield client


def test_a_suite_spelt_with_integral_floats_registers_as_its_canonical_form_and_evaluates(http):
    answer = http.post("/v1/eval/suites", json=_suite(max_tokens=16.0, temperature=0.0))
    assert answer.status_code == 200, answer.text
    entry = answer.json()
    same = http.post("/v1/eval/suites", json=SUITE)
    assert same.status_code == 200, same.text
    assert same.json() == entry  # the same suite: the same entry, no conflict
    stored = (http.home / "eval-suites" / "spelt.json").read_bytes()
    assert stored == contracts.render("EvalSuite", SUITE)
    assert entry["suite_sha256"] == "sha256:" + hashlib.sha256(stored).hexdigest()
    submitted = http.post("/v1/eval/jobs", json={"suite": "spelt"})
    assert submitted.status_code == 200, submitted.text
    job_id = submitted.json()["job_id"]
    detail = wait_for(
        lambda: (d := http.get(f"/v1/eval/jobs/{job_id}").json())["state"] in ("completed", "failed") and d
    )
    assert detail["state"] == "completed", detail.get("error")
    assert detail["result"]["suite_sha256"] == entry["suite_sha256"]


def test_a_stored_suite_file_that_is_not_canonical_is_refused(tmp_path):
    from kiln.evals import SuiteRegistry

    registry = SuiteRegistry(tmp_path)
    registry.register(SUITE)
    data = json.dumps(_suite(max_tokens=16.0), sort_keys=True, separators=(",", ":")).encode()
    registry.path("spelt").write_bytes(data)
    entry = json.loads(registry.entry_path("spelt").read_text(encoding="utf-8"))
    entry["suite_sha256"] = "sha256:" + hashlib.sha256(data).hexdigest()
    registry.entry_path("spelt").write_text(json.dumps(entry), encoding="utf-8")
    with pytest.raises(IntegrityError) as info:
        registry.get("spelt")
    assert (info.value.code, info.value.pointer) == ("digest_mismatch", "/suite_sha256")
    assert "not the canonical JSON" in info.value.message


def test_a_gate_verdict_records_an_integer_floor_as_the_number_it_is():
    from kiln.evals import gate_verdict

    verdict = gate_verdict(
        post_eval={"suite": "spelt", "data_scope": "held_out", "min_accuracy": 1, "include_baseline": True},
        suite_entry={"name": "spelt", "suite_sha256": "sha256:" + "1" * 64},
        candidate=None,
        baseline=None,
        candidate_job_id=None,
        baseline_job_id=None,
        auto_load=True,
        error="evaluation failed",
    )
    assert (verdict["min_accuracy"], type(verdict["min_accuracy"])) == (1.0, float)


def test_generation_requests_take_integral_floats_where_the_schema_says_integer(http):
    model = http.get("/v1/models").json()["data"][0]["id"]
    spelt = {"max_tokens": 2.0, "n": 1.0, "seed": 3.0, "temperature": 0, "top_p": 1}
    chat = http.post(
        "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "Hi"}], **spelt}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json() == http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": 3},
    ).json() | {"id": chat.json()["id"], "created": chat.json()["created"]}
    completion = http.post(
        "/v1/completions", json={"model": model, "prompt": [1.0, 5.0, 7.0], "logprobs": 1.0, **spelt}
    )
    assert completion.status_code == 200, completion.text
    assert len(completion.json()["choices"][0]["logprobs"]["tokens"]) == 2


def test_a_request_log_line_spelling_an_integer_as_a_float_is_not_canonical(tmp_path):
    from kiln.artifacts.replay_log import load_replay_log, load_replay_record
    from kiln.documents.jsonio import canonical_json

    cases = json.loads((Path(__file__).parent.parent / "conformance" / "cases" / "examples.json").read_text("utf-8"))
    record = next(c["instance"] for c in cases if c["type"] == "ReplayRequestRecord")
    spelt = {**record, "seed": 7.0, "schema_version": 1.0}
    assert canonical_json(load_replay_record(spelt)) == canonical_json(record)
    log = tmp_path / "replay.jsonl"
    log.write_bytes(canonical_json(record) + b"\n")
    assert [line.record for line in load_replay_log(log)] == [record]
    log.write_bytes(canonical_json(spelt) + b"\n")
    with pytest.raises(ContractError, match="not the canonical JSON of its record"):
        load_replay_log(log)
