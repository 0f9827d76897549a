"""Evaluation documents: suites (``kiln.eval-suite.v1``), results (``kiln.eval-result.v1``),
the ``post_eval`` gate request and its verdict (``paired_wilson_v1``).

The Wilson score interval is part of the result contract (its bounds are recomputed by
``eval-result.counts``), so it is defined here, once: for k correct of n at z =
1.959963984540054 (95%), centre (k + z²/2) / (n + z²) and half-width
z·sqrt(k(n−k)/n + z²/4) / (n + z²).

Rules: ``eval.scorer-fields``, ``eval-suite.unique-ids``, ``eval-target.kind``,
``eval-result.counts``, ``post-eval.diagnostic-scope``, ``gate-verdict.counts``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from kiln.documents import pipeline
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

Z95 = 1.959963984540054
TOLERANCE = 1e-9

# the reference's spellings of ``PostEval.data_scope``, accepted on input; Kiln records the canonical one
DATA_SCOPE_SPELLINGS = {"held-out": "held_out", "train-set-eval": "train_set_eval"}

__all__ = [
    "DATA_SCOPE_SPELLINGS",
    "Z95",
    "canonical_data_scope",
    "load_eval_result",
    "load_eval_suite",
    "scorer_regex",
    "wilson_interval",
]


def canonical_data_scope(value: str) -> str:
    """``held_out`` or ``train_set_eval`` for either spelling (the reference hyphenates: ``held-out``)."""
    return DATA_SCOPE_SPELLINGS.get(value, value)


def wilson_interval(correct: int, total: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``correct`` successes in ``total`` trials, clamped to [0, 1]."""
    if total <= 0:
        return 0.0, 1.0
    z2 = z * z
    centre = (correct + z2 / 2) / (total + z2)
    half = z * math.sqrt(correct * (total - correct) / total + z2 / 4) / (total + z2)
    return max(0.0, centre - half), min(1.0, centre + half)


_ECMA_NAMED_GROUP = re.compile(r"(?<!\\)\(\?<(?![=!])")


def scorer_regex(pattern: str) -> re.Pattern[str]:
    """A ``regex`` scorer's pattern compiled as it runs: Python's ``re``, with ECMA-262's named group ``(?<name>...)``
    read as Python's ``(?P<name>...)`` (the schema checks the pattern as ECMA-262; the scorer runs Python)."""
    return re.compile(_ECMA_NAMED_GROUP.sub("(?P<", pattern))


@semantic_rule("EvalScorer", "eval.scorer-fields")
def _scorer_fields(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    kind = doc["kind"]
    for key, owner in (("pattern", "regex"), ("field", "json_field")):
        present = key in doc
        if present != (kind == owner):
            yield Problem(
                "inconsistent_fields",
                ptr(at, key),
                f"a {kind} scorer {'has no' if present else 'needs a'} {key}"
                + ("" if present else f" (only {owner} scorers take one)" if kind != owner else ""),
            )
    if kind == "regex" and "pattern" in doc:
        try:
            scorer_regex(doc["pattern"])
        except re.error as exc:
            yield Problem("inconsistent_fields", ptr(at, "pattern"), f"pattern does not compile: {exc}")


@semantic_rule("EvalSuite", "eval-suite.unique-ids")
def _unique_ids(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    seen: set[str] = set()
    for i, example in enumerate(doc["examples"]):
        if example["id"] in seen:
            yield Problem("inconsistent_fields", ptr(at, "examples", i, "id"), f"example id {example['id']!r} repeats")
        seen.add(example["id"])


@semantic_rule("EvalTarget", "eval-target.kind")
def _target_kind(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    adapter = doc["kind"] == "adapter"
    for key in ("adapter", "adapter_manifest_sha256"):
        if (doc[key] is not None) != adapter:
            yield Problem(
                "inconsistent_fields",
                ptr(at, key),
                f"{key} must be {'set' if adapter else 'null'} for a {doc['kind']} target",
            )


@semantic_rule("EvalResult", "eval-result.counts")
def _result_counts(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    n, k = doc["example_count"], doc["correct"]
    if n != len(doc["examples"]):
        yield Problem("inconsistent_fields", ptr(at, "example_count"), f"{n} but {len(doc['examples'])} examples")
        return
    scored = sum(e["score"] for e in doc["examples"])
    if k != scored:
        yield Problem("inconsistent_fields", ptr(at, "correct"), f"{k} but the examples score {scored}")
        return
    if abs(doc["accuracy"] - k / n) > TOLERANCE:
        yield Problem("inconsistent_fields", ptr(at, "accuracy"), f"{doc['accuracy']} != {k}/{n}")
    lower, upper = wilson_interval(k, n)
    for key, want in (("wilson_lower", lower), ("wilson_upper", upper)):
        if abs(doc[key] - want) > TOLERANCE:
            yield Problem("inconsistent_fields", ptr(at, key), f"{doc[key]} but the 95% Wilson bound is {want}")


@semantic_rule("PostEval", "post-eval.diagnostic-scope")
def _diagnostic_scope(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if canonical_data_scope(doc.get("data_scope", "")) == "train_set_eval" and doc.get("min_accuracy") is not None:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "min_accuracy"),
            "a train_set_eval gate is diagnostic and cannot set min_accuracy (use held_out)",
        )


@semantic_rule("GateVerdict", "gate-verdict.counts")
def _verdict_counts(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    total = doc["improvements"] + doc["regressions"] + doc["ties"]
    if doc["paired_examples"] != total:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "paired_examples"),
            f"{doc['paired_examples']} but improvements + regressions + ties = {total}",
        )


def load_eval_suite(source: pipeline.Source) -> Any:
    return pipeline.load("EvalSuite", source)


def load_eval_result(source: pipeline.Source) -> Any:
    return pipeline.load("EvalResult", source)
