"""``kiln eval``: parser wiring, printing and the paired comparison, against a stubbed SDK client.

No server runs: ``kiln_contracts.client.KilnClient`` is replaced by a fake that answers with
schema-valid bodies and records every call.
"""

from __future__ import annotations

import json
from typing import ClassVar

import kiln_contracts.client
import pytest
from kiln_contracts.client import KilnApiError

import kiln.cli._evals as cli_evals
from kiln import contracts
from kiln.artifacts.evals import wilson_interval
from kiln.cli import build_parser, main
from kiln.evals import generation_sha256, suite_sha256

GENERATION = {"temperature": 0, "seed": 7, "max_tokens": 16}
SUITE = {
    "schema": "kiln.eval-suite.v1",
    "name": "arith",
    "scorer": {"kind": "exact_match"},
    "generation": GENERATION,
    "examples": [{"id": f"q{i}", "messages": [{"role": "user", "content": f"{i}+{i}?"}], "expected": str(2 * i)}
                 for i in range(20)],
}  # fmt: skip
ENTRY = {
    "name": "arith",
    "suite_sha256": suite_sha256(SUITE),
    "generation_sha256": generation_sha256(GENERATION),
    "example_count": 20,
    "registered_at": "2025-01-01T00:00:00Z",
}
BASE = "sha256:" + "b" * 64


def _result(scores, adapter=None, suite_sha=ENTRY["suite_sha256"]):
    n, k = len(scores), sum(scores)
    lower, upper = wilson_interval(k, n)
    target = {"kind": "base", "adapter": None, "adapter_manifest_sha256": None, "base_model_sha256": BASE}
    if adapter:
        target = {**target, "kind": "adapter", "adapter": adapter, "adapter_manifest_sha256": "sha256:" + "a" * 64}
    return {
        "schema": "kiln.eval-result.v1",
        "suite": "arith",
        "suite_sha256": suite_sha,
        "generation_sha256": ENTRY["generation_sha256"],
        "target": target,
        "examples": [{"id": f"q{i}", "score": s, "output": "x", "expected": "y"} for i, s in enumerate(scores)],
        "example_count": n,
        "correct": k,
        "accuracy": k / n,
        "wilson_lower": lower,
        "wilson_upper": upper,
        "created_at": "2025-01-01T00:00:00Z",
    }


def _job(job_id, state="completed", result=None, adapter=None, **extra):
    detail = {
        "job_id": job_id,
        "state": state,
        "suite": "arith",
        "adapter": adapter,
        "role": "standalone",
        "linked_training_job_id": None,
        "submitted_unix_ms": 1,
        "result": result,
        **extra,
    }
    assert contracts.problems("EvalJobDetail", detail) == []
    return detail


# 10 improvements, 2 regressions, 8 ties: candidate 14/20, baseline 6/20
CANDIDATE = _result([1] * 10 + [0] * 2 + [1] * 4 + [0] * 4, adapter="bot")
BASELINE = _result([0] * 10 + [1] * 2 + [1] * 4 + [0] * 4)


class FakeClient:
    """Stands in for ``KilnClient``: canned answers per method, every call recorded."""

    instances: ClassVar[list[FakeClient]] = []
    answers: ClassVar[dict[str, object]] = {}

    def __init__(self, url, *, api_key=None, timeout=None):
        self.url, self.api_key, self.timeout = url, api_key, timeout
        self.calls: list[tuple[str, tuple]] = []
        FakeClient.instances.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        if name not in FakeClient.answers:
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, args))
            answer = FakeClient.answers[name]
            if callable(answer):
                answer = answer(*args)
            if isinstance(answer, Exception):
                raise answer
            return answer

        return call


@pytest.fixture(autouse=True)
def fake(monkeypatch):
    monkeypatch.delenv("KILN_URL", raising=False)
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    monkeypatch.setattr(kiln_contracts.client, "KilnClient", FakeClient)
    monkeypatch.setattr(cli_evals, "POLL_S", 0)
    FakeClient.instances = []
    FakeClient.answers = {}
    return FakeClient


def _run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _calls(fake):
    return [call for client in fake.instances for call in client.calls]


# ----------------------------------------------------------------------------- wiring


@pytest.mark.parametrize(
    ("argv", "func", "values"),
    [
        (["eval", "suites", "add", "s.json"], cli_evals.cmd_suites_add, {"file": "s.json"}),
        (["eval", "suites", "list", "--json"], cli_evals.cmd_suites_list, {"json": True}),
        (["eval", "suites", "remove", "arith"], cli_evals.cmd_suites_remove, {"name": "arith"}),
        (
            ["eval", "run", "--suite", "arith", "--adapter", "bot", "--wait"],
            cli_evals.cmd_run,
            {"suite": "arith", "adapter": "bot", "wait": True},
        ),
        (["eval", "run", "--suite", "arith"], cli_evals.cmd_run, {"adapter": None, "wait": False}),
        (["eval", "status"], cli_evals.cmd_status, {"job_id": None}),
        (["eval", "status", "--job-id", "e1", "--url", "http://h:1"], cli_evals.cmd_status, {"job_id": "e1"}),
        (["eval", "cancel", "e1"], cli_evals.cmd_cancel, {"job_id": "e1"}),
        (["eval", "compare", "e1", "e2", "--json"], cli_evals.cmd_compare, {"job_a": "e1", "job_b": "e2"}),
    ],
)
def test_every_eval_command_is_wired_to_its_handler(argv, func, values):
    args = build_parser().parse_args(argv)
    assert args.func is func
    for key, value in values.items():
        assert getattr(args, key) == value
    for option in ("url", "api_key", "json"):
        assert hasattr(args, option)


def test_a_run_needs_a_suite(capsys):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["eval", "run"])
    assert caught.value.code == 2
    assert "--suite" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["eval"], ["eval", "suites"]])
def test_a_bare_group_prints_its_help(capsys, argv):
    code, out, _ = _run(capsys, *argv)
    assert code == 2
    assert "VERB" in out


# ----------------------------------------------------------------------------- suites


def test_suites_add_sends_the_file_and_prints_the_entry(capsys, tmp_path, fake, monkeypatch):
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(SUITE), encoding="utf-8")
    fake.answers["register_eval_suite"] = ENTRY
    monkeypatch.setenv("KILN_URL", "http://kiln.test:9")
    monkeypatch.setenv("KILN_API_KEY", "k")
    code, out, err = _run(capsys, "eval", "suites", "add", path)
    assert code == 0, err
    assert _calls(fake) == [("register_eval_suite", (SUITE,))]
    assert (fake.instances[0].url, fake.instances[0].api_key) == ("http://kiln.test:9", "k")
    assert "✓ registered suite arith (20 examples" in out
    assert ENTRY["suite_sha256"] in out
    code, out, _ = _run(capsys, "eval", "suites", "add", path, "--json", "--url", "http://other:1")
    assert json.loads(out) == ENTRY
    assert fake.instances[-1].url == "http://other:1"


def test_suites_add_refuses_an_invalid_file_before_sending(capsys, tmp_path, fake):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**SUITE, "scorer": {"kind": "regex"}}), encoding="utf-8")
    code, _, err = _run(capsys, "eval", "suites", "add", path)
    assert code == 2
    assert "not a valid evaluation suite" in err
    assert "/scorer/pattern" in err
    (tmp_path / "broken.json").write_text("{", encoding="utf-8")
    code, _, err = _run(capsys, "eval", "suites", "add", tmp_path / "broken.json")
    assert code == 2
    assert "invalid_json" in err
    assert fake.instances == []


def test_suites_list_prints_a_table_or_the_body(capsys, fake):
    fake.answers["list_eval_suites"] = {"suites": [ENTRY]}
    code, out, _ = _run(capsys, "eval", "suites", "list")
    assert code == 0
    header, row = out.splitlines()
    assert header.split()[:2] == ["NAME", "EXAMPLES"]
    assert row.split()[:2] == ["arith", "20"]
    _, out, _ = _run(capsys, "eval", "suites", "list", "--json")
    assert json.loads(out) == {"suites": [ENTRY]}
    fake.answers["list_eval_suites"] = {"suites": []}
    _, out, _ = _run(capsys, "eval", "suites", "list")
    assert "no evaluation suites registered on http://localhost:8420" in out


def test_suites_remove_names_what_went(capsys, fake):
    fake.answers["delete_eval_suite"] = {"deleted": "arith", "suite_sha256": ENTRY["suite_sha256"]}
    code, out, _ = _run(capsys, "eval", "suites", "remove", "arith")
    assert code == 0
    assert _calls(fake) == [("delete_eval_suite", ("arith",))]
    assert out.startswith("✓ removed suite arith")


def test_server_errors_are_one_line_with_the_code(capsys, fake):
    fake.answers["delete_eval_suite"] = KilnApiError(
        404, "eval_suite_not_found", "no evaluation suite 'x' is registered", hint="kiln eval suites list"
    )
    code, out, err = _run(capsys, "eval", "suites", "remove", "x")
    assert code == 1
    assert "error [eval_suite_not_found]: no evaluation suite 'x' is registered" in err
    assert "hint: kiln eval suites list" in err
    code, out, _ = _run(capsys, "eval", "suites", "remove", "x", "--json")
    assert code == 1
    assert json.loads(out)["error"]["code"] == "eval_suite_not_found"


# ----------------------------------------------------------------------------- jobs


def test_run_submits_and_prints_the_job(capsys, fake):
    fake.answers["submit_eval_job"] = {"job_id": "eval-1", "state": "queued", "message": "queued"}
    code, out, _ = _run(capsys, "eval", "run", "--suite", "arith", "--adapter", "bot")
    assert code == 0
    assert _calls(fake) == [("submit_eval_job", ({"suite": "arith", "adapter": "bot"},))]
    assert "Job ID: eval-1" in out
    assert "kiln eval status --job-id eval-1" in out
    _run(capsys, "eval", "run", "--suite", "arith")
    assert _calls(fake)[-1] == ("submit_eval_job", ({"suite": "arith"},))


def test_run_wait_polls_until_the_result_and_prints_accuracy_with_wilson(capsys, fake):
    fake.answers["submit_eval_job"] = {"job_id": "eval-1", "state": "queued", "message": "queued"}
    states = iter(
        [_job("eval-1", "queued"), _job("eval-1", "running"), _job("eval-1", result=CANDIDATE, adapter="bot")]
    )
    fake.answers["get_eval_job"] = lambda job_id: next(states)
    code, out, err = _run(capsys, "eval", "run", "--suite", "arith", "--adapter", "bot", "--wait")
    assert code == 0, err
    assert [name for name, _ in _calls(fake)] == ["submit_eval_job"] + ["get_eval_job"] * 3
    lower, upper = wilson_interval(14, 20)
    assert f"Accuracy: 0.700 (14/20; 95% Wilson [{lower:.3f}, {upper:.3f}])" in out


def test_run_wait_reports_a_failed_evaluation(capsys, fake):
    fake.answers["submit_eval_job"] = {"job_id": "eval-1", "state": "queued", "message": "queued"}
    fake.answers["get_eval_job"] = _job("eval-1", "failed", error="adapter 'bot' vanished")
    code, _, err = _run(capsys, "eval", "run", "--suite", "arith", "--wait")
    assert code == 1
    assert "✗ evaluation eval-1 failed: adapter 'bot' vanished" in err
    code, out, _ = _run(capsys, "eval", "run", "--suite", "arith", "--wait", "--json")
    assert code == 1
    assert json.loads(out)["state"] == "failed"


def test_status_lists_jobs_or_shows_one(capsys, fake):
    jobs = [_job("eval-1", result=CANDIDATE, adapter="bot"), _job("eval-2", "running")]
    fake.answers["list_eval_jobs"] = jobs
    code, out, _ = _run(capsys, "eval", "status")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split()[:5] == ["eval-1", "completed", "standalone", "arith", "0.700"]
    assert lines[2].split()[:5] == ["eval-2", "running", "standalone", "arith", "-"]
    assert lines[2].endswith("base model")
    fake.answers["get_eval_job"] = _job("eval-1", result=CANDIDATE, adapter="bot", linked_training_job_id="job-9")
    _, out, _ = _run(capsys, "eval", "status", "--job-id", "eval-1")
    assert "Target: adapter bot" in out
    assert "Training job: job-9" in out
    assert "Accuracy: 0.700 (14/20" in out
    _, out, _ = _run(capsys, "eval", "status", "--json")
    assert [j["job_id"] for j in json.loads(out)] == ["eval-1", "eval-2"]


def test_cancel_reports_what_happened(capsys, fake):
    fake.answers["cancel_eval_job"] = _job("eval-2", "running")
    code, out, _ = _run(capsys, "eval", "cancel", "eval-2")
    assert code == 0
    assert "cancellation requested" in out
    fake.answers["cancel_eval_job"] = _job("eval-2", "failed", error="cancelled")
    _, out, _ = _run(capsys, "eval", "cancel", "eval-2")
    assert "is failed" in out


# ----------------------------------------------------------------------------- compare


def test_comparison_pairs_the_results_and_runs_the_sign_test():
    report = cli_evals.comparison(_job("a", result=CANDIDATE, adapter="bot"), _job("b", result=BASELINE))
    assert (report["paired_examples"], report["improvements"], report["regressions"], report["ties"]) == (20, 10, 2, 8)
    # n = 12, min = 2: 2·(1 + 12 + 66)/2¹² = 158/4096
    assert report["sign_test_p_value"] == pytest.approx(158 / 4096)
    assert (report["a"]["accuracy"], report["b"]["accuracy"]) == (0.7, 0.3)
    assert report["a"]["target"]["adapter"] == "bot"
    assert report["suite_sha256"] == ENTRY["suite_sha256"]


def test_compare_prints_counts_p_value_and_both_intervals(capsys, fake):
    jobs = {"eval-a": _job("eval-a", result=CANDIDATE, adapter="bot"), "eval-b": _job("eval-b", result=BASELINE)}
    fake.answers["get_eval_job"] = lambda job_id: jobs[job_id]
    code, out, err = _run(capsys, "eval", "compare", "eval-a", "eval-b")
    assert code == 0, err
    assert "A: eval-a (adapter bot): accuracy 0.700 (14/20; 95% Wilson" in out
    assert "B: eval-b (base model): accuracy 0.300 (6/20; 95% Wilson" in out
    assert "Paired examples: 20 (A better: 10, A worse: 2, ties: 8)" in out
    assert f"p = {158 / 4096:.4g}" in out
    assert "Verdict: A is significantly better than B" in out
    code, out, _ = _run(capsys, "eval", "compare", "eval-b", "eval-a", "--json")
    report = json.loads(out)
    assert (report["improvements"], report["regressions"]) == (2, 10)
    assert report["a"]["job_id"] == "eval-b"


def test_compare_refuses_results_that_cannot_be_paired(capsys, fake):
    other = _result([1] * 20, suite_sha="sha256:" + "9" * 64)
    jobs = {
        "eval-a": _job("eval-a", result=CANDIDATE, adapter="bot"),
        "eval-x": _job("eval-x", result=other),
        "eval-q": _job("eval-q", "queued"),
    }
    fake.answers["get_eval_job"] = lambda job_id: jobs[job_id]
    code, _, err = _run(capsys, "eval", "compare", "eval-a", "eval-x")
    assert code == 1
    assert "cannot compare eval-a with eval-x" in err
    assert "suite_sha256" in err
    code, _, err = _run(capsys, "eval", "compare", "eval-a", "eval-q")
    assert code == 1
    assert "eval-q has no result (state queued)" in err


def test_compare_says_when_there_are_too_few_pairs(capsys, fake):
    small_a, small_b = _result([1] * 6), _result([0] * 6)
    jobs = {"a": _job("a", result=small_a), "b": _job("b", result=small_b)}
    fake.answers["get_eval_job"] = lambda job_id: jobs[job_id]
    _, out, _ = _run(capsys, "eval", "compare", "a", "b")
    assert "too few pairs for the gate: 6 < 20" in out
