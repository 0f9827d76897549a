"""Build valid pre-scored off-policy distillation files (``kiln.off-policy-distillation-manifest.v1``
line, then one ``OffPolicyDistillationRow`` per response) for tests and benches.

``make_off_policy_file(tokenizer, path, prompts_and_responses, *, scorer)`` tokenizes every
response with the admission's own code path (``kiln.data.opd.tokenize_response``) and asks
``scorer(prefix_ids, action_ids, k) -> (ids [A][k], logprobs [A][k])`` for the teacher's top-K
at each action target (``prefix_ids`` is the teacher's prefix: ``teacher_extra_messages`` +
``messages`` with a generation prompt). Each position's candidates are written most likely
first. ``ranked_scorer`` is a deterministic stand-in teacher; a real one can be plugged in, and
``off_policy_teacher`` builds such a file from a real teacher and registers it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from kiln.data.opd import tokenize_response

Scorer = Callable[[Sequence[int], Sequence[int], int], tuple[Sequence[Sequence[int]], Sequence[Sequence[float]]]]


def tokenizer_vocab_sha256(tokenizer: Any) -> str:
    """Raw hex digest of the tokenizer's ``tokenizer.json`` (what the manifest records)."""
    return hashlib.sha256((Path(tokenizer.name_or_path) / "tokenizer.json").read_bytes()).hexdigest()


def ranked_scorer(vocab_size: int) -> Scorer:
    """A deterministic teacher: the target first, then the next ids, log-probabilities falling."""

    def score(prefix_ids: Sequence[int], action_ids: Sequence[int], k: int):
        ids = [[(target + j) % vocab_size for j in range(k)] for target in action_ids]
        logprobs = [[math.log(0.5) - j - 0.01 * (len(prefix_ids) % 7) for j in range(k)] for _ in action_ids]
        return ids, logprobs

    return score


def make_off_policy_file(
    tokenizer: Any,
    path: str | Path,
    prompts_and_responses: Iterable[tuple[list[dict[str, Any]], str] | dict[str, Any]],
    *,
    scorer: Scorer,
    top_k: int = 4,
    vocab_size: int | None = None,
    vocab_sha256: str | None = None,
    fixture_id: str = "test-fixture",
    row_count: int | None = None,
) -> dict[str, Any]:
    """Write the file at ``path`` and return its manifest. Items are ``(messages, response)`` or
    row dicts ``{"messages", "response"[, "teacher_extra_messages"]}``; ``row_count`` overrides
    the true count (to build a mismatching file)."""
    vocab_size = len(tokenizer) if vocab_size is None else vocab_size
    rows = []
    for item in prompts_and_responses:
        row = dict(item) if isinstance(item, dict) else {"messages": item[0], "response": item[1]}
        _, action_ids = tokenize_response(tokenizer, row["messages"], row["response"])
        prefix, _ = tokenize_response(tokenizer, row.get("teacher_extra_messages", []) + row["messages"], "")
        ids, logprobs = scorer(prefix, action_ids, top_k) if action_ids else ([], [])
        if len(ids) != len(action_ids) or len(logprobs) != len(action_ids):
            raise ValueError(f"the scorer returned {len(ids)} positions for {len(action_ids)} action targets")
        row["teacher_tokens"] = [
            {
                "token_id": target,
                "top_logprobs": [
                    {"token_id": int(i), "logprob": float(lp)}
                    for i, lp in sorted(zip(ids_at, lps_at, strict=True), key=lambda pair: -pair[1])
                ],
            }
            for target, ids_at, lps_at in zip(action_ids, ids, logprobs, strict=True)
        ]
        rows.append(row)
    manifest = {
        "schema": "kiln.off-policy-distillation-manifest.v1",
        "fixture_id": fixture_id,
        "tokenizer_vocab_sha256": vocab_sha256 or tokenizer_vocab_sha256(tokenizer),
        "vocab_size": vocab_size,
        "top_k": top_k,
        "row_count": len(rows) if row_count is None else row_count,
    }
    lines = [json.dumps(manifest), *(json.dumps(row) for row in rows)]
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return manifest


def off_policy_teacher(tmp_path: Path, student_dir: Path, teacher_dir: Path, responses: Sequence[tuple[str, str]]):
    """A pre-scored file of ``(prompt, response)`` rows whose scores come from the real teacher at ``teacher_dir``,
    registered as the fixture teacher ``scored``; returns ``(file, teachers root)``."""
    from kiln.model import load_base_model
    from kiln.teachers import TeacherRegistry, top_k_logprobs

    teacher = load_base_model(teacher_dir)
    student = load_base_model(student_dir)

    def scorer(prefix, action, k):
        ids, logprobs = top_k_logprobs(teacher.model, list(prefix) + list(action), len(prefix), k)
        return ids.tolist(), logprobs.tolist()

    path = tmp_path / "scored.jsonl"
    make_off_policy_file(
        student.tokenizer,
        path,
        [([{"role": "user", "content": prompt}], response) for prompt, response in responses],
        scorer=scorer,
        top_k=16,
        vocab_size=int(student.model.config.vocab_size),
        vocab_sha256=tokenizer_vocab_sha256(student.tokenizer),
        fixture_id="tutor-scored",
    )
    root = tmp_path / "teachers-fixture"
    TeacherRegistry(root).add({"alias": "scored", "kind": "fixture", "model_id": "tutor-scored"}, fixture_file=path)
    return path, root
