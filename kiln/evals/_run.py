"""One evaluation: every example of a suite through a generator and its scorer → an ``EvalResult``.

The generator is the caller's (the server renders the chat template and decodes greedily
with the suite's pinned settings); this module owns the order, the scoring, the counts,
the Wilson interval and the strict validation of the result. Cancellation is cooperative:
a set ``cancel`` event stops the run before the next example (``EvalCancelled``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kiln import contracts
from kiln.artifacts.evals import wilson_interval
from kiln.errors import ContractError, IntegrityError, Problem
from kiln.evals._registry import SUITE, generation_sha256, suite_sha256
from kiln.evals._scoring import score

__all__ = ["RESULT", "RESULT_SCHEMA", "EvalCancelled", "run_suite"]

RESULT = "EvalResult"
RESULT_SCHEMA = "kiln.eval-result.v1"

Generate = Callable[[list[dict[str, Any]], dict[str, Any]], str]


class EvalCancelled(Exception):  # noqa: N818 - the name says what happened, like KeyboardInterrupt
    """The cancel event was set: the evaluation stopped between examples, after ``done`` of them."""

    def __init__(self, done: int | None = None, total: int | None = None):
        where = "" if done is None else f" after {done} of {total} examples"
        super().__init__(f"evaluation cancelled{where}")
        self.done = done
        self.total = total


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _check_entry(suite: dict[str, Any], entry: dict[str, Any]) -> None:
    found = [
        Problem("digest_mismatch", f"/{key}", f"the entry records {entry[key]} but the suite gives {actual}")
        for key, actual in (
            ("suite_sha256", suite_sha256(suite)),
            ("generation_sha256", generation_sha256(suite["generation"])),
        )
        if entry[key] != actual
    ]
    if found:
        raise IntegrityError(found, document=f"evaluation suite {suite['name']!r}")


def run_suite(
    suite: dict[str, Any],
    entry: dict[str, Any],
    generate: Generate,
    *,
    target: dict[str, Any],
    cancel: threading.Event | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Generate and score every example in suite order; the validated ``EvalResult``.

    ``generate(messages, suite["generation"])`` returns the output text; ``target`` is the
    ``EvalTarget`` evaluated; ``progress(done, total)`` is called after each example.
    """
    suite = contracts.canonical(SUITE, suite)  # the registry's form: its digests, its pinned settings as ints
    _check_entry(suite, entry)
    examples = suite["examples"]
    total = len(examples)
    scored = []
    for done, example in enumerate(examples):
        if cancel is not None and cancel.is_set():
            raise EvalCancelled(done, total)
        output = generate(example["messages"], suite["generation"])
        if not isinstance(output, str):
            raise TypeError(f"generate returned {type(output).__name__} for example {example['id']!r}, not text")
        value = score(example.get("scorer") or suite["scorer"], output, example["expected"])
        scored.append({"id": example["id"], "score": value, "output": output, "expected": example["expected"]})
        if progress is not None:
            progress(done + 1, total)
    correct = sum(item["score"] for item in scored)
    lower, upper = wilson_interval(correct, total)
    result = {
        "schema": RESULT_SCHEMA,
        "suite": suite["name"],
        "suite_sha256": entry["suite_sha256"],
        "generation_sha256": entry["generation_sha256"],
        "target": target,
        "examples": scored,
        "example_count": total,
        "correct": correct,
        "accuracy": correct / total,
        "wilson_lower": lower,
        "wilson_upper": upper,
        "created_at": _now(),
    }
    problems = contracts.problems(RESULT, result)
    if problems:
        raise ContractError(problems, document=RESULT)
    return result
