"""The evaluation engine (``kiln.evals``): statistics against hand-computed values, every gate
outcome, the scorers, the suite registry, the held-out rule and a run with a fake generator.

No model is loaded: generation is a dictionary lookup.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest

import kiln.evals
from kiln import contracts
from kiln.artifacts.evals import Z95, wilson_interval
from kiln.documents.digests import json_sha256
from kiln.errors import ConflictError, ContractError, IntegrityError, NotFoundError, RequestError
from kiln.evals import (
    EvalCancelled,
    SuiteRegistry,
    gate_verdict,
    generation_sha256,
    overlapping_examples,
    paired_counts,
    prompt_digest,
    run_suite,
    score,
    sign_test_p_value,
    suite_sha256,
    suites_root,
    training_prompt_digests,
)

GENERATION = {"temperature": 0, "seed": 7, "max_tokens": 16}
BASE = "sha256:" + "b" * 64
MANIFEST = "sha256:" + "a" * 64


def _suite(n=3, name="arith", **extra):
    suite = {
        "schema": "kiln.eval-suite.v1",
        "name": name,
        "scorer": {"kind": "normalized_exact_match"},
        "generation": GENERATION,
        "examples": [
            {"id": f"q{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "expected": str(2 * i)}
            for i in range(n)
        ],
    }
    suite.update(extra)
    return suite


def _entry(suite):
    return {
        "name": suite["name"],
        "suite_sha256": suite_sha256(suite),
        "generation_sha256": generation_sha256(suite["generation"]),
        "example_count": len(suite["examples"]),
        "registered_at": "2025-01-01T00:00:00Z",
    }


def _target(adapter=None):
    if adapter is None:
        return {"kind": "base", "adapter": None, "adapter_manifest_sha256": None, "base_model_sha256": BASE}
    return {"kind": "adapter", "adapter": adapter, "adapter_manifest_sha256": MANIFEST, "base_model_sha256": BASE}


def _result(scores, *, suite_sha=None, generation_sha=None, adapter=None, ids=None):
    """A valid ``EvalResult`` with these per-example scores (ids ``q0``, ``q1``, ... unless given)."""
    ids = ids or [f"q{i}" for i in range(len(scores))]
    n, k = len(scores), sum(scores)
    lower, upper = wilson_interval(k, n)
    result = {
        "schema": "kiln.eval-result.v1",
        "suite": "arith",
        "suite_sha256": suite_sha or "sha256:" + "1" * 64,
        "generation_sha256": generation_sha or "sha256:" + "2" * 64,
        "target": _target(adapter),
        "examples": [
            {"id": i, "score": s, "output": str(s), "expected": "1"} for i, s in zip(ids, scores, strict=True)
        ],
        "example_count": n,
        "correct": k,
        "accuracy": k / n,
        "wilson_lower": lower,
        "wilson_upper": upper,
        "created_at": "2025-01-01T00:00:00Z",
    }
    assert contracts.problems("EvalResult", result) == []
    return result


SUITE_ENTRY = {
    "name": "arith",
    "suite_sha256": "sha256:" + "1" * 64,
    "generation_sha256": "sha256:" + "2" * 64,
    "example_count": 40,
    "registered_at": "2025-01-01T00:00:00Z",
}


def _verdict(candidate, baseline, *, auto_load=True, error=None, **post_eval):
    return gate_verdict(
        post_eval={"suite": "arith", **post_eval},
        suite_entry=SUITE_ENTRY,
        candidate=candidate,
        baseline=baseline,
        candidate_job_id=None if candidate is None else "eval-cand",
        baseline_job_id=None if baseline is None else "eval-base",
        auto_load=auto_load,
        error=error,
    )


def _pairs(improvements, regressions, ties_correct=0, ties_wrong=0):
    """(candidate, baseline) results with exactly these per-example changes."""
    cand = [1] * improvements + [0] * regressions + [1] * ties_correct + [0] * ties_wrong
    base = [0] * improvements + [1] * regressions + [1] * ties_correct + [0] * ties_wrong
    return _result(cand, adapter="new-bot"), _result(base)


# ----------------------------------------------------------------------------- the public surface


def test_the_evals_package_exports_exactly_its_declared_names():
    assert sorted(kiln.evals.__all__) == [
        "ALPHA", "EvalCancelled", "MIN_PAIRED", "POLICY", "SuiteRegistry", "gate_verdict", "generation_sha256",
        "normalize", "overlapping_examples", "paired_counts", "prompt_digest", "run_suite", "score",
        "sign_test_p_value", "suite_sha256", "suites_root", "training_prompt_digests",
    ]  # fmt: skip
    for name in kiln.evals.__all__:
        assert hasattr(kiln.evals, name)
    assert (kiln.evals.POLICY, kiln.evals.ALPHA, kiln.evals.MIN_PAIRED) == ("paired_wilson_v1", 0.05, 20)


# ----------------------------------------------------------------------------- Wilson interval


def test_wilson_bounds_match_the_hand_computed_values():
    # z = 1.959963984540054, z² = 3.841458820694124; centre (k + z²/2)/(n + z²), half z·sqrt(k(n−k)/n + z²/4)/(n + z²)
    z2 = Z95 * Z95
    # 0/20: centre = half = (z²/2)/(20 + z²), so lower 0 and upper z²/(20 + z²) = 3.8414588/23.8414588
    lower, upper = wilson_interval(0, 20)
    assert lower == pytest.approx(0.0, abs=1e-15)
    assert upper == pytest.approx(z2 / (20 + z2), abs=1e-15)
    assert upper == pytest.approx(0.161125158, abs=1e-9)
    # 20/20: the mirror image: lower 20/(20 + z²) = 20/23.8414588, upper 1
    lower, upper = wilson_interval(20, 20)
    assert lower == pytest.approx(20 / (20 + z2), abs=1e-15)
    assert lower == pytest.approx(0.838874842, abs=1e-9)
    assert upper == 1.0
    # 10/20: centre 0.5; half = z·sqrt(5 + 0.9603647)/23.8414588 = 1.959964·2.4413858/23.8414588 = 0.2007020
    lower, upper = wilson_interval(10, 20)
    assert (lower, upper) == pytest.approx((0.299298008, 0.700701992), abs=1e-9)
    # 18/24: centre (18 + 1.9207294)/27.8414588 = 0.7155060; half = z·sqrt(4.5 + 0.9603647)/27.8414588 = 0.1645004
    lower, upper = wilson_interval(18, 24)
    assert (lower, upper) == pytest.approx((0.551005560, 0.880006338), abs=1e-9)
    assert (lower + upper) / 2 == pytest.approx((18 + z2 / 2) / (24 + z2), abs=1e-15)


# ----------------------------------------------------------------------------- sign test


@pytest.mark.parametrize(
    ("improvements", "regressions", "expected"),
    [
        (10, 0, 2 / 1024),  # 2·C(10,0)/2¹⁰
        (0, 10, 2 / 1024),  # symmetric
        (5, 5, 1.0),  # 2·(1+10+45+120+210+252)/1024 = 1276/1024 > 1, clamped
        (8, 2, 2 * 56 / 1024),  # 2·(1+10+45)/1024 = 0.109375
        (0, 0, 1.0),  # no non-tied pair
        (15, 5, 2 * 21700 / 2**20),  # 2·(1+20+190+1140+4845+15504)/2²⁰ = 0.0413894653...
        (1, 0, 1.0),  # 2·1/2 = 1
        (6, 0, 2 / 64),  # 0.03125: six wins in a row are already significant
        (5, 0, 2 / 32),  # 0.0625: five are not
    ],
)
def test_sign_test_p_values_match_the_exact_binomial(improvements, regressions, expected):
    assert sign_test_p_value(improvements, regressions) == pytest.approx(expected, rel=1e-15)


def test_the_sign_test_refuses_negative_counts():
    with pytest.raises(ValueError, match="counts"):
        sign_test_p_value(-1, 3)


def test_ties_count_as_paired_but_not_in_the_sign_test():
    candidate, baseline = _pairs(10, 0, ties_correct=7, ties_wrong=3)
    assert paired_counts(candidate, baseline) == (20, 10, 0, 10)
    verdict = _verdict(candidate, baseline)
    assert (verdict["paired_examples"], verdict["improvements"], verdict["regressions"], verdict["ties"]) == (
        20,
        10,
        0,
        10,
    )
    assert verdict["sign_test_p_value"] == pytest.approx(2 / 1024)  # n = 10, not 20


def test_pairs_are_matched_by_example_id_not_position():
    candidate = _result([1, 0, 1], ids=["c", "b", "a"])
    baseline = _result([0, 0, 1, 1], ids=["a", "b", "c", "d"])
    # a: 1 vs 0 improvement; b: 0 vs 0 tie; c: 1 vs 1 tie; d only in the baseline
    assert paired_counts(candidate, baseline) == (3, 1, 0, 2)


@pytest.mark.parametrize("key", ["suite_sha256", "generation_sha256"])
def test_results_of_different_digests_are_not_paired(key):
    candidate = _result([1, 1])
    baseline = _result([0, 0], **{"suite_sha" if key == "suite_sha256" else "generation_sha": "sha256:" + "9" * 64})
    with pytest.raises(ValueError, match=key):
        paired_counts(candidate, baseline)


# ----------------------------------------------------------------------------- the gate


def _check(verdict, outcome, *words):
    assert contracts.problems("GateVerdict", verdict) == []
    assert verdict["outcome"] == outcome, verdict["reason"]
    assert verdict["policy"] == "paired_wilson_v1"
    assert (verdict["alpha"], verdict["min_paired_examples"]) == (0.05, 20)
    reason = verdict["reason"]
    assert reason[0].isupper(), reason
    assert reason.endswith("."), reason
    assert ". " not in reason, reason  # one sentence
    for word in words:
        assert word in reason
    return verdict


def test_a_significant_improvement_is_promoted_with_auto_load():
    candidate, baseline = _pairs(18, 0, ties_wrong=2)  # 18/20 vs 0/20, p = 2/2¹⁸
    verdict = _check(_verdict(candidate, baseline, min_accuracy=0.5), "promoted", "18 improvements", "activated")
    assert verdict["sign_test_p_value"] == pytest.approx(2 / 2**18)
    assert verdict["candidate_accuracy"] == 0.9
    assert verdict["candidate_wilson_lower"] == pytest.approx(wilson_interval(18, 20)[0])
    assert verdict["baseline_accuracy"] == 0.0
    assert verdict["baseline"] == baseline["target"]
    assert (verdict["candidate_eval_job_id"], verdict["baseline_eval_job_id"]) == ("eval-cand", "eval-base")
    assert (verdict["suite"], verdict["suite_sha256"], verdict["data_scope"]) == (
        "arith",
        SUITE_ENTRY["suite_sha256"],
        "held_out",
    )
    assert verdict["min_accuracy"] == 0.5


def test_the_same_evidence_without_auto_load_is_kept():
    candidate, baseline = _pairs(18, 0, ties_wrong=2)
    _check(_verdict(candidate, baseline, auto_load=False), "kept", "auto_load is false")


def test_a_significant_regression_is_a_regression():
    candidate, baseline = _pairs(0, 10, ties_correct=5, ties_wrong=5)  # p = 2/1024
    verdict = _check(_verdict(candidate, baseline), "regression", "10 regressions", "significantly worse")
    assert verdict["sign_test_p_value"] == pytest.approx(2 / 1024)


def test_a_candidate_whose_wilson_upper_bound_misses_the_floor_is_demoted():
    # 5/20: Wilson upper 0.4718 < 0.9; demotion comes before every other rule (even a strong improvement)
    candidate, baseline = _pairs(5, 0, ties_wrong=15)
    verdict = _check(_verdict(candidate, baseline, min_accuracy=0.9), "demoted", "upper bound", "0.9")
    assert verdict["candidate_wilson_upper"] < 0.9


def test_demotion_needs_no_baseline():
    candidate = _result([0] * 20, adapter="new-bot")
    verdict = _check(_verdict(candidate, None, include_baseline=False, min_accuracy=0.5), "demoted")
    assert verdict["baseline"] is None
    assert verdict["sign_test_p_value"] is None


def test_an_improvement_below_the_floor_is_inconclusive():
    # 12/20 against 0/20: p = 2/4096, but Wilson 12/20 = [0.387, 0.781]: upper ≥ 0.5 > lower
    candidate, baseline = _pairs(12, 0, ties_wrong=8)
    _check(_verdict(candidate, baseline, min_accuracy=0.5), "inconclusive", "lower bound below the floor")


def test_fewer_than_twenty_pairs_is_inconclusive_even_when_significant():
    candidate, baseline = _pairs(19, 0)
    verdict = _check(_verdict(candidate, baseline), "inconclusive", "Only 19 paired examples", "at least 20")
    assert verdict["sign_test_p_value"] == pytest.approx(2 / 2**19)


def test_a_train_set_eval_is_diagnostic_and_never_promotes():
    candidate, baseline = _pairs(20, 0)
    _check(_verdict(candidate, baseline, data_scope="train_set_eval"), "inconclusive", "diagnostic")


def test_without_a_baseline_the_gate_is_inconclusive():
    candidate = _result([1] * 20, adapter="new-bot")
    verdict = _check(_verdict(candidate, None, include_baseline=False), "inconclusive", "no baseline")
    assert verdict["paired_examples"] == 0
    assert verdict["sign_test_p_value"] is None
    assert verdict["baseline_accuracy"] is None
    assert verdict["baseline_eval_job_id"] is None


def test_no_significant_difference_is_inconclusive():
    candidate, baseline = _pairs(5, 5, ties_correct=10)
    verdict = _check(_verdict(candidate, baseline), "inconclusive", "not significantly different")
    assert verdict["sign_test_p_value"] == 1.0


def test_all_ties_leave_the_p_value_null():
    candidate, baseline = _pairs(0, 0, ties_correct=20)
    verdict = _check(_verdict(candidate, baseline), "inconclusive", "All 20 paired examples tie")
    assert verdict["sign_test_p_value"] is None


def test_a_failed_evaluation_is_an_error_whatever_the_evidence():
    candidate, baseline = _pairs(20, 0)
    verdict = _check(_verdict(candidate, baseline, error="baseline evaluation ran out of memory"), "error", "memory")
    assert verdict["candidate_accuracy"] == 1.0  # the evidence there is, is still reported


def test_a_missing_candidate_result_is_an_error():
    verdict = _check(_verdict(None, _result([0] * 20)), "error", "no result")
    assert verdict["candidate_accuracy"] is None
    assert verdict["candidate_eval_job_id"] is None


def test_results_that_do_not_belong_to_the_suite_are_an_error():
    candidate = _result([1] * 20, suite_sha="sha256:" + "9" * 64)
    _check(_verdict(candidate, _result([0] * 20)), "error", "suite_sha256")
    candidate = _result([1] * 20)
    baseline = _result([0] * 20, generation_sha="sha256:" + "9" * 64)
    _check(_verdict(candidate, baseline), "error", "cannot be paired")


# ----------------------------------------------------------------------------- scorers


@pytest.mark.parametrize(
    ("scorer", "output", "expected", "want"),
    [
        ({"kind": "exact_match"}, "Paris", "Paris", 1),
        ({"kind": "exact_match"}, "paris", "Paris", 0),
        ({"kind": "exact_match"}, "Paris ", "Paris", 0),
        ({"kind": "normalized_exact_match"}, "  PARIS! ", "paris", 1),  # trim, casefold, trailing punctuation
        ({"kind": "normalized_exact_match"}, "Ｐａｒｉｓ", "Paris", 1),  # NFKC: full-width letters
        ({"kind": "normalized_exact_match"}, "STRASSE", "Straße", 1),  # case folding, not lower()
        ({"kind": "normalized_exact_match"}, "new \t\n york", "New York.", 1),  # whitespace runs collapse
        ({"kind": "normalized_exact_match"}, "It is 42 ?!", "it is 42", 1),  # trailing whitespace and punctuation
        ({"kind": "normalized_exact_match"}, "U.S.A", "USA", 0),  # only trailing punctuation goes
        ({"kind": "normalized_exact_match"}, "¿42", "42", 0),  # leading punctuation stays
        ({"kind": "normalized_exact_match"}, "42", "4 2", 0),
        ({"kind": "contains"}, "The answer is 42.", "42", 1),
        ({"kind": "contains"}, "i love NEW   york!", "New York", 1),
        ({"kind": "contains"}, "The answer is 4 2.", "42", 0),
        ({"kind": "regex", "pattern": r"\b42\b"}, "it is 42", "ignored", 1),
        ({"kind": "regex", "pattern": r"\b42\b"}, "it is 420", "42", 0),
        ({"kind": "regex", "pattern": r"^\d+$"}, "x 42", "42", 0),  # re.search honours anchors
        ({"kind": "json_field", "field": "answer.value"}, '{"answer": {"value": 42}}', "42", 1),
        ({"kind": "json_field", "field": "a"}, '{"a": "yes"}', "yes", 1),  # the string itself
        ({"kind": "json_field", "field": "a"}, '{"a": "yes"}', '"yes"', 1),  # or its canonical JSON text
        ({"kind": "json_field", "field": "a"}, '{"a": "Yes"}', "yes", 0),
        ({"kind": "json_field", "field": "x"}, '{"x": {"b": 2, "a": 1}}', '{"a":1,"b":2}', 1),  # canonical
        ({"kind": "json_field", "field": "items.1.name"}, '{"items": [{"name": "a"}, {"name": "b"}]}', "b", 1),
        ({"kind": "json_field", "field": "ok"}, '{"ok": true}', "true", 1),
        ({"kind": "json_field", "field": "answer.value"}, '{"answer": {"val": 42}}', "42", 0),  # a miss
        ({"kind": "json_field", "field": "items.5"}, '{"items": [1]}', "1", 0),  # index out of range
        ({"kind": "json_field", "field": "a"}, "The answer is {a: 1}", "1", 0),  # not JSON
        ({"kind": "json_field", "field": "a"}, '{"a": 1, "a": 2}', "2", 0),  # duplicate keys: not strict JSON
    ],
)
def test_each_scorer_accepts_exactly_what_its_kind_says(scorer, output, expected, want):
    assert contracts.problems("EvalSuite", _suite(scorer=scorer)) == []
    assert score(scorer, output, expected) == want


def test_an_unknown_scorer_kind_is_refused():
    with pytest.raises(ValueError, match="closed set"):
        score({"kind": "fuzzy"}, "a", "a")


# ----------------------------------------------------------------------------- the registry


def test_suites_live_under_the_kiln_home(tmp_path):
    assert suites_root(tmp_path) == tmp_path / "eval-suites"


def test_a_suite_registers_once_and_identical_content_is_a_no_op(tmp_path):
    registry = SuiteRegistry(tmp_path / "suites")
    suite = _suite()
    entry = registry.register(suite)
    assert contracts.problems("EvalSuiteEntry", entry) == []
    assert entry["suite_sha256"] == json_sha256(suite) == suite_sha256(suite)
    assert entry["generation_sha256"] == json_sha256(GENERATION)
    assert entry["example_count"] == 3
    assert registry.register(json.loads(json.dumps(suite))) == entry  # same content: the same entry
    assert registry.path("arith").read_bytes() == contracts.render("EvalSuite", suite)  # canonical bytes
    assert registry.get("arith") == (suite, entry)


def test_the_same_name_with_other_content_conflicts(tmp_path):
    registry = SuiteRegistry(tmp_path)
    registry.register(_suite())
    with pytest.raises(ConflictError) as caught:
        registry.register(_suite(description="changed"))
    assert caught.value.code == "eval_suite_conflict"
    assert registry.get("arith")[0] == _suite()


def test_the_registry_lists_by_name_and_removes(tmp_path):
    registry = SuiteRegistry(tmp_path)
    assert registry.list() == []
    entries = {name: registry.register(_suite(name=name)) for name in ("zeta", "alpha", "mid")}
    assert [e["name"] for e in registry.list()] == ["alpha", "mid", "zeta"]
    answer = registry.remove("mid")
    assert answer == {"deleted": "mid", "suite_sha256": entries["mid"]["suite_sha256"]}
    assert [e["name"] for e in registry.list()] == ["alpha", "zeta"]
    with pytest.raises(NotFoundError) as caught:
        registry.get("mid")
    assert caught.value.code == "eval_suite_not_found"
    with pytest.raises(NotFoundError):
        registry.remove("mid")
    registry.register(_suite(name="mid", description="new content under a freed name"))


@pytest.mark.parametrize("name", ["missing", "../etc", ".hidden", "a/b", ""])
def test_unknown_or_unsafe_names_are_not_found(tmp_path, name):
    registry = SuiteRegistry(tmp_path)
    registry.register(_suite())
    for call in (registry.get, registry.remove):
        with pytest.raises(NotFoundError) as caught:
            call(name)
        assert caught.value.code == "eval_suite_not_found"


def test_a_tampered_suite_file_is_refused(tmp_path):
    registry = SuiteRegistry(tmp_path)
    registry.register(_suite())
    changed = _suite()
    changed["examples"][0]["expected"] = "anything"
    registry.path("arith").write_bytes(contracts.render("EvalSuite", changed))
    with pytest.raises(IntegrityError) as caught:
        registry.get("arith")
    assert caught.value.code == "digest_mismatch"
    assert "suite_sha256" in str(caught.value)
    for tampered in (json.dumps(_suite(), indent=2), "{ not json"):  # any byte counts, checked before parsing
        registry.path("arith").write_text(tampered, encoding="utf-8")
        with pytest.raises(IntegrityError):
            registry.get("arith")


def test_a_tampered_entry_is_refused(tmp_path):
    registry = SuiteRegistry(tmp_path)
    entry = registry.register(_suite())
    entry_path = registry.entry_path("arith")
    entry_path.write_text(json.dumps({**entry, "example_count": 4}), encoding="utf-8")
    with pytest.raises(IntegrityError, match="example"):
        registry.get("arith")


def test_an_invalid_suite_is_refused_with_every_problem(tmp_path):
    registry = SuiteRegistry(tmp_path)
    bad = _suite(scorer={"kind": "regex"})  # the schema states the scorer's fields
    del bad["examples"][1]["expected"]
    with pytest.raises(ContractError) as caught:
        registry.register(bad)
    pointers = {p.pointer for p in caught.value.problems}
    assert pointers == {"/scorer/pattern", "/examples/1/expected"}
    twice = _suite()  # a rule no schema states: every example id once
    twice["examples"][1]["id"] = twice["examples"][0]["id"]
    twice["examples"][2]["id"] = twice["examples"][0]["id"]
    with pytest.raises(ContractError) as caught:
        registry.register(twice)
    assert {p.pointer for p in caught.value.problems} == {"/examples/1/id", "/examples/2/id"}
    assert registry.list() == []


def test_a_name_that_is_not_path_safe_is_refused_by_the_schema(tmp_path):
    registry = SuiteRegistry(tmp_path)
    with pytest.raises(ContractError) as caught:
        registry.register(_suite(name="../escape"))
    assert caught.value.problems[0].pointer == "/name"
    with pytest.raises(ContractError) as caught:
        registry.register(_suite(name="bell\x07"))  # the schema refuses control characters, as a file name must
    assert caught.value.code == "unsafe_path"
    assert registry.list() == []


def test_a_suite_name_at_the_bound_registers_and_one_byte_more_is_refused(tmp_path):
    registry = SuiteRegistry(tmp_path)
    fits = "s" * 250
    assert registry.register(_suite(name=fits))["name"] == fits
    assert registry.path(fits).is_file()
    with pytest.raises(ContractError) as caught:
        registry.register(_suite(name="é" * 126))  # 126 characters, 252 bytes
    assert caught.value.code == "unsafe_path"
    assert "is not path-safe: it is 252 bytes" in caught.value.message
    with pytest.raises(NotFoundError):
        registry.get("é" * 126)


def test_a_registration_that_crashed_before_its_entry_is_completed_or_removed(tmp_path):
    registry = SuiteRegistry(tmp_path)
    suite = _suite()
    registry.register(suite)
    registry.entry_path("arith").unlink()  # as if the process died between the two writes
    assert registry.list() == []
    with pytest.raises(NotFoundError):
        registry.get("arith")
    entry = registry.register(suite)  # the same content completes it
    assert registry.get("arith") == (suite, entry)
    registry.entry_path("arith").unlink()
    assert registry.remove("arith")["suite_sha256"] == suite_sha256(suite)
    assert not registry.path("arith").exists()


# ----------------------------------------------------------------------------- prompt digests


def test_a_prompt_digest_is_the_canonical_json_of_roles_and_content():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    assert prompt_digest(messages) == json_sha256(messages)
    parts = [
        {"role": "system", "content": [{"type": "text", "text": "Be "}, "brief."]},
        {"role": "user", "content": "2 + 2?", "name": "ann", "tool_calls": None},
    ]
    assert prompt_digest(parts) == prompt_digest(messages)  # parts flattened, other members ignored
    assert prompt_digest([{"role": "user", "content": None}]) == prompt_digest([{"role": "user", "content": ""}])
    assert prompt_digest([{"role": "user", "content": "2 + 2? "}]) != prompt_digest([messages[1]])


def _conversation(question, answer="ok"):
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _overlap_suite():
    return _suite(
        examples=[
            {"id": "seen", "messages": [{"role": "user", "content": "What is 1 + 1?"}], "expected": "2"},
            {"id": "fresh", "messages": [{"role": "user", "content": "What is 9 + 9?"}], "expected": "18"},
            {"id": "file", "messages": [{"role": "user", "content": "From the file"}], "expected": "x"},
        ]
    )


def test_sft_prompts_are_the_messages_before_each_assistant_turn(tmp_path):
    suite = _overlap_suite()
    inline = {"examples": [_conversation("What is 1 + 1?", "2"), _conversation("Unrelated")]}
    assert overlapping_examples(suite, training_prompt_digests("sft", inline)) == ["seen"]
    # multi-turn: the context before the first answer is trained on too
    multi = {
        "examples": [
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "What is 9 + 9?"}]},
                    {"role": "assistant", "content": "18"},
                    {"role": "user", "content": "And 1 + 1?"},
                    {"role": "assistant", "content": "2"},
                ]
            }
        ]
    }
    assert overlapping_examples(suite, training_prompt_digests("sft", multi)) == ["fresh"]
    path = _jsonl(tmp_path / "sft.jsonl", [_conversation("From the file")])
    (tmp_path / "sft.jsonl").write_text("\n  \n" + (tmp_path / "sft.jsonl").read_text() + "\n", encoding="utf-8")
    assert overlapping_examples(suite, training_prompt_digests("sft", {"dataset_path": path})) == ["file"]
    # a system prompt makes it another prompt
    system = {
        "examples": [{"messages": [{"role": "system", "content": "s"}, *_conversation("What is 1 + 1?")["messages"]]}]
    }
    assert overlapping_examples(suite, training_prompt_digests("sft", system)) == []


def test_grpo_prompts_are_each_groups_messages(tmp_path):
    suite = _overlap_suite()

    def group(question):
        return {"messages": [{"role": "user", "content": question}], "completions": [{"text": "a", "reward": 1.0}]}

    assert overlapping_examples(suite, training_prompt_digests("grpo", {"groups": [group("What is 1 + 1?")]})) == [
        "seen"
    ]
    assert overlapping_examples(
        suite, training_prompt_digests("grpo", {"agentic_groups": [group("What is 9 + 9?")]})
    ) == ["fresh"]
    path = _jsonl(tmp_path / "groups.jsonl", [group("nothing"), group("From the file")])
    assert overlapping_examples(suite, training_prompt_digests("grpo", {"dataset_path": path})) == ["file"]


def test_opd_prompts_and_pre_scored_rows_after_the_manifest(tmp_path):
    suite = _overlap_suite()
    prompts = {"prompts": [{"messages": [{"role": "user", "content": "What is 9 + 9?"}]}]}
    assert overlapping_examples(suite, training_prompt_digests("opd", prompts)) == ["fresh"]
    manifest = {"schema": "kiln.off-policy-distillation-manifest.v1", "messages": [{"role": "user", "content": "x"}]}
    rows = [
        manifest,  # the manifest line is not a row, whatever it holds
        {"messages": [{"role": "user", "content": "From the file"}], "response": "x", "teacher_tokens": []},
        {"messages": [{"role": "user", "content": "What is 1 + 1?"}], "response": "2", "teacher_tokens": []},
    ]
    digests = training_prompt_digests("opd", {"dataset_path": _jsonl(tmp_path / "scored.jsonl", rows)})
    assert overlapping_examples(suite, digests) == ["seen", "file"]
    assert prompt_digest(manifest["messages"]) not in digests


def test_rows_that_cannot_be_trained_are_passed_over(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('not json\n{"no": "messages"}\n[1, 2]\n' + json.dumps(_conversation("q")) + "\n", encoding="utf-8")
    assert training_prompt_digests("sft", {"dataset_path": str(path)}) == {
        prompt_digest([{"role": "user", "content": "q"}])
    }


def test_an_unreadable_dataset_path_is_a_request_error(tmp_path):
    with pytest.raises(RequestError) as caught:
        training_prompt_digests("sft", {"dataset_path": str(tmp_path / "absent.jsonl")})
    assert caught.value.code == "training_invalid_request"
    with pytest.raises(ValueError, match="unknown training kind"):
        training_prompt_digests("dpo", {})


# ----------------------------------------------------------------------------- running a suite


def _answers(suite, wrong=()):
    """A deterministic fake generator: the expected answer (with noise the scorer normalises away), except ``wrong``."""
    by_prompt = {json.dumps(e["messages"]): (e["id"], e["expected"]) for e in suite["examples"]}
    calls = []

    def generate(messages, generation):
        assert generation == suite["generation"]
        example_id, expected = by_prompt[json.dumps(messages)]
        calls.append(example_id)
        return "no idea" if example_id in wrong else f"  {expected}. "

    return generate, calls


def test_run_suite_scores_every_example_in_order_into_a_valid_result(tmp_path):
    suite = _suite(5)
    suite["examples"][4]["scorer"] = {"kind": "exact_match"}  # per-example scorer: the padded output fails it
    generate, calls = _answers(suite, wrong={"q1"})
    seen = []
    result = run_suite(
        suite, _entry(suite), generate, target=_target("bot"), progress=lambda done, total: seen.append((done, total))
    )
    assert contracts.problems("EvalResult", result) == []
    assert calls == ["q0", "q1", "q2", "q3", "q4"]
    assert seen == [(1, 5), (2, 5), (3, 5), (4, 5), (5, 5)]
    assert [e["score"] for e in result["examples"]] == [1, 0, 1, 1, 0]
    assert [e["id"] for e in result["examples"]] == ["q0", "q1", "q2", "q3", "q4"]
    assert result["examples"][1] == {"id": "q1", "score": 0, "output": "no idea", "expected": "2"}
    assert (result["correct"], result["example_count"], result["accuracy"]) == (3, 5, 0.6)
    assert (result["wilson_lower"], result["wilson_upper"]) == wilson_interval(3, 5)
    assert (result["suite_sha256"], result["generation_sha256"]) == (suite_sha256(suite), json_sha256(GENERATION))
    assert result["target"] == _target("bot")
    written = contracts.write("EvalResult", tmp_path / "result.json", result)
    report = contracts.validate_path(written)
    assert (report.valid, report.type) == (True, "EvalResult")


def test_a_cancel_stops_between_examples(tmp_path):
    suite = _suite(5)
    generate, calls = _answers(suite)
    cancel = threading.Event()

    def progress(done, total):
        if done == 2:
            cancel.set()

    with pytest.raises(EvalCancelled) as caught:
        run_suite(suite, _entry(suite), generate, target=_target(), cancel=cancel, progress=progress)
    assert calls == ["q0", "q1"]
    assert (caught.value.done, caught.value.total) == (2, 5)
    cancel.set()
    with pytest.raises(EvalCancelled):
        run_suite(suite, _entry(suite), generate, target=_target(), cancel=cancel)
    assert calls == ["q0", "q1"]  # a set event stops before the first example


def test_run_suite_refuses_an_entry_of_other_content():
    suite = _suite()
    entry = _entry(_suite(description="other"))
    with pytest.raises(IntegrityError):
        run_suite(suite, entry, lambda m, g: "x", target=_target())


def test_run_suite_refuses_a_target_that_breaks_its_contract():
    suite = _suite()
    bad_target = {**_target(), "adapter": "bot"}  # a base target names no adapter
    with pytest.raises(ContractError) as caught:
        run_suite(suite, _entry(suite), lambda m, g: "x", target=bad_target)
    assert caught.value.problems[0].pointer == "/target/adapter"


def test_wilson_helper_and_the_result_rule_agree_on_the_edges():
    for k, n in ((0, 1), (1, 1), (0, 20), (20, 20), (7, 9)):
        lower, upper = wilson_interval(k, n)
        assert 0.0 <= lower <= k / n <= upper <= 1.0
        assert math.isfinite(lower)
        assert math.isfinite(upper)


# ----------------------------------------------------------------------------- the docs


def test_the_documented_suite_and_gate_are_valid_and_register(tmp_path):
    text = (Path(__file__).parent.parent / "docs" / "evals.md").read_text(encoding="utf-8")
    blocks = [block.split("```", 1)[0] for block in text.split("```json\n")[1:]]
    suite = json.loads(blocks[0])
    assert contracts.problems("EvalSuite", suite) == []
    entry = SuiteRegistry(tmp_path).register(suite)
    assert entry["example_count"] == 4
    post_eval = json.loads("{" + blocks[1].strip() + "}")["post_eval"]
    assert contracts.problems("PostEval", post_eval) == []
    assert score(suite["examples"][2]["scorer"], '{"plan": {"name": "pro"}}', "pro") == 1
    assert score(suite["examples"][3]["scorer"], "Ticket #123 is open.", "") == 1
