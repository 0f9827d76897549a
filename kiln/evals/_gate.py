"""The promotion gate, policy ``paired_wilson_v1``: may a freshly trained adapter go live?

The candidate (the new adapter) and the baseline (the adapter active before training, else
the base model) are evaluated on the same suite with the same pinned generation settings;
their results are paired by example id. Constants: ``ALPHA`` = 0.05, ``MIN_PAIRED`` = 20.

Statistics
    Wilson 95% interval of the candidate's accuracy (``kiln.artifacts.evals.wilson_interval``).
    Per pair: an *improvement* when the candidate scores 1 and the baseline 0, a
    *regression* when the reverse, a *tie* otherwise. Ties count as paired examples but
    are left out of the sign test: over n = improvements + regressions,
    p = min(1, 2 · P[X ≤ min(improvements, regressions)]) with X ~ Binomial(n, 1/2),
    computed exactly; p = 1 when n = 0.

Outcome, the first rule that applies
    1. ``error``         an evaluation failed (``error`` given), the candidate has no result,
                         or the results do not belong to the suite (digests differ).
    2. ``demoted``       ``min_accuracy`` is set and the candidate's Wilson UPPER bound is
                         below it: even the optimistic bound misses the floor.
    3. ``inconclusive``  ``data_scope`` is ``train_set_eval`` (diagnostic only), or there is
                         no baseline (``include_baseline`` false), or fewer than 20 pairs.
    4. p < α and improvements > regressions:
                         if ``min_accuracy`` is null or the Wilson LOWER bound ≥ it,
                         ``promoted`` when ``auto_load`` is true, else ``kept``;
                         otherwise ``inconclusive`` (better, but not provably above the floor).
    5. ``regression``    p < α and regressions > improvements.
    6. ``inconclusive``  otherwise (no significant difference).

``gate_verdict`` returns the strict ``GateVerdict`` with every member filled (null where
it does not apply) and a one-sentence ``reason`` carrying the numbers.
"""

from __future__ import annotations

from fractions import Fraction
from math import comb
from typing import Any

from kiln import contracts
from kiln.errors import ContractError

__all__ = ["ALPHA", "MIN_PAIRED", "POLICY", "gate_verdict", "paired_counts", "sign_test_p_value"]

POLICY = "paired_wilson_v1"
ALPHA = 0.05
MIN_PAIRED = 20
VERDICT = "GateVerdict"


def sign_test_p_value(improvements: int, regressions: int) -> float:
    """Two-sided exact binomial sign test at p = 1/2 over the non-tied pairs."""
    if improvements < 0 or regressions < 0:
        raise ValueError("improvements and regressions are counts (≥ 0)")
    n = improvements + regressions
    if n == 0:
        return 1.0
    tail = Fraction(sum(comb(n, k) for k in range(min(improvements, regressions) + 1)), 2**n)
    return float(min(Fraction(1), 2 * tail))


def paired_counts(candidate: dict[str, Any], baseline: dict[str, Any]) -> tuple[int, int, int, int]:
    """``(paired, improvements, regressions, ties)`` of two ``EvalResult``s, paired by example id.

    Results of different suites or generation settings (``suite_sha256``,
    ``generation_sha256``) cannot be paired (``ValueError``).
    """
    for key in ("suite_sha256", "generation_sha256"):
        if candidate[key] != baseline[key]:
            raise ValueError(f"results of different {key} cannot be paired ({candidate[key]} vs {baseline[key]})")
    base = {example["id"]: example["score"] for example in baseline["examples"]}
    improvements = regressions = ties = 0
    for example in candidate["examples"]:
        if example["id"] not in base:
            continue
        before, after = base[example["id"]], example["score"]
        if after > before:
            improvements += 1
        elif after < before:
            regressions += 1
        else:
            ties += 1
    return improvements + regressions + ties, improvements, regressions, ties


def _interval(result: dict[str, Any]) -> str:
    return (
        f"accuracy {result['accuracy']:.3f} ({result['correct']}/{result['example_count']}, "
        f"95% Wilson {result['wilson_lower']:.3f}–{result['wilson_upper']:.3f})"
    )


def _pairs(paired: int, improvements: int, regressions: int, ties: int) -> str:
    return f"{improvements} improvements, {regressions} regressions and {ties} ties over {paired} paired examples"


def _decide(
    *,
    post_eval: dict[str, Any],
    suite_entry: dict[str, Any],
    candidate: dict[str, Any] | None,
    baseline: dict[str, Any] | None,
    counts: tuple[int, int, int, int],
    mismatch: str | None,
    p: float | None,
    auto_load: bool,
    error: str | None,
) -> tuple[str, str]:
    """(outcome, reason) by the policy's rules, in order."""
    min_accuracy = post_eval.get("min_accuracy")
    if error is not None:
        return "error", f"the gate could not decide because an evaluation failed: {error}"
    if candidate is None:
        return "error", "the gate could not decide because the candidate evaluation produced no result"
    if mismatch is not None:
        return "error", f"the gate could not decide because {mismatch}"
    if min_accuracy is not None and candidate["wilson_upper"] < min_accuracy:
        return "demoted", (
            f"the candidate's {_interval(candidate)} has a Wilson upper bound below the floor min_accuracy "
            f"{min_accuracy}, so it cannot meet it"
        )
    if post_eval.get("data_scope") == "train_set_eval":
        return "inconclusive", (
            f"the suite was evaluated as train_set_eval, which is diagnostic only and never promotes "
            f"(candidate {_interval(candidate)})"
        )
    if baseline is None:
        return "inconclusive", (
            f"there is no baseline (include_baseline is false), so no improvement can be shown "
            f"(candidate {_interval(candidate)})"
        )
    paired, improvements, regressions, ties = counts
    if paired < MIN_PAIRED:
        return "inconclusive", (
            f"only {paired} paired examples were evaluated and at least {MIN_PAIRED} are needed "
            f"({improvements} improvements, {regressions} regressions, {ties} ties)"
        )
    if p is None:
        return "inconclusive", f"all {paired} paired examples tie, so the candidate is not shown to differ"
    test = f"sign test p = {p:.4g}"
    if p < ALPHA and improvements > regressions:
        floor_met = min_accuracy is None or candidate["wilson_lower"] >= min_accuracy
        floor = "no accuracy floor is set" if min_accuracy is None else f"the floor min_accuracy is {min_accuracy}"
        if not floor_met:
            return "inconclusive", (
                f"the candidate improved significantly ({_pairs(*counts)}, {test} < {ALPHA}) but its "
                f"{_interval(candidate)} has a Wilson lower bound below the floor min_accuracy {min_accuracy}"
            )
        if auto_load:
            return "promoted", (
                f"the candidate improved significantly ({_pairs(*counts)}, {test} < {ALPHA}) with "
                f"{_interval(candidate)} and {floor}, so it is activated"
            )
        return "kept", (
            f"the candidate improved significantly ({_pairs(*counts)}, {test} < {ALPHA}) with "
            f"{_interval(candidate)} and {floor}, but auto_load is false, so it was kept without activation"
        )
    if p < ALPHA and regressions > improvements:
        return "regression", (
            f"the candidate is significantly worse than the baseline ({_pairs(*counts)}, {test} < {ALPHA}), "
            f"so the previous adapter stays active"
        )
    return "inconclusive", f"the candidate is not significantly different from the baseline ({_pairs(*counts)}, {test})"


def gate_verdict(
    *,
    post_eval: dict[str, Any],
    suite_entry: dict[str, Any],
    candidate: dict[str, Any] | None,
    baseline: dict[str, Any] | None,
    candidate_job_id: str | None,
    baseline_job_id: str | None,
    auto_load: bool,
    error: str | None = None,
) -> dict[str, Any]:
    """The validated ``GateVerdict`` of one gate (``post_eval`` is the request's ``PostEval``)."""
    counts = (0, 0, 0, 0)
    mismatch = None
    p = None
    if candidate is not None:
        for key in ("suite_sha256", "generation_sha256"):
            if key in suite_entry and candidate[key] != suite_entry[key]:
                mismatch = f"the candidate result's {key} {candidate[key]} is not the suite's {suite_entry[key]}"
                break
    if candidate is not None and baseline is not None and mismatch is None:
        try:
            counts = paired_counts(candidate, baseline)
        except ValueError as exc:
            mismatch = f"the baseline cannot be compared with the candidate: {exc}"
    if baseline is not None and counts[1] + counts[2] > 0:
        p = sign_test_p_value(counts[1], counts[2])
    outcome, reason = _decide(
        post_eval=post_eval,
        suite_entry=suite_entry,
        candidate=candidate,
        baseline=baseline,
        counts=counts,
        mismatch=mismatch,
        p=p,
        auto_load=auto_load,
        error=error,
    )
    verdict = {
        "policy": POLICY,
        "outcome": outcome,
        "reason": reason[0].upper() + reason[1:] + ".",
        "suite": post_eval["suite"],
        "suite_sha256": suite_entry["suite_sha256"],
        "data_scope": post_eval.get("data_scope") or "held_out",
        "candidate_eval_job_id": candidate_job_id,
        "baseline_eval_job_id": baseline_job_id,
        "baseline": None if baseline is None else baseline["target"],
        "paired_examples": counts[0],
        "improvements": counts[1],
        "regressions": counts[2],
        "ties": counts[3],
        "sign_test_p_value": p,
        "alpha": ALPHA,
        "min_paired_examples": MIN_PAIRED,
        "candidate_accuracy": None if candidate is None else candidate["accuracy"],
        "candidate_wilson_lower": None if candidate is None else candidate["wilson_lower"],
        "candidate_wilson_upper": None if candidate is None else candidate["wilson_upper"],
        "baseline_accuracy": None if baseline is None else baseline["accuracy"],
        "min_accuracy": post_eval.get("min_accuracy"),
    }
    problems = contracts.problems(VERDICT, verdict)
    if problems:
        raise ContractError(problems, document=VERDICT)
    return contracts.canonical(VERDICT, verdict)  # `min_accuracy: 1` from the request is recorded as 1.0
