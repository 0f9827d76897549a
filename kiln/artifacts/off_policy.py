"""Pre-scored off-policy distillation files and the teacher scoring protocol bodies.

* ``OffPolicyDistillationManifestV1`` (``kiln.off-policy-distillation-manifest.v1``): the
  first line of a pre-scored JSONL file: fixture id, the tokenizer vocabulary the ids are
  in, vocabulary size, top-K per position and the number of rows.
* ``OffPolicyDistillationRow``: prompt, response, and the teacher's top-K log-probabilities
  on every action target. Within a position the ids are distinct and the log-probabilities
  non-increasing (``off-policy-row.top-logprobs``, checked here); alignment with the
  student's tokenisation needs the tokenizer and is checked at admission
  (``kiln.data.opd``).
* ``CompletionResponse`` (``POST /v1/completions``, the vLLM prompt-logprobs layout): one
  entry per prompt token, the first null (``completion.prompt-logprobs``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kiln.documents import pipeline
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

MANIFEST = "OffPolicyDistillationManifestV1"
ROW = "OffPolicyDistillationRow"
MANIFEST_SCHEMA = "kiln.off-policy-distillation-manifest.v1"

__all__ = ["MANIFEST", "MANIFEST_SCHEMA", "ROW", "load_off_policy_manifest", "load_off_policy_row"]


@semantic_rule(ROW, "off-policy-row.top-logprobs")
def _top_logprobs(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    for i, token in enumerate(doc["teacher_tokens"]):
        seen: set[int] = set()
        previous = None
        for j, entry in enumerate(token["top_logprobs"]):
            if entry["token_id"] in seen:
                yield Problem(
                    "inconsistent_fields",
                    ptr(at, "teacher_tokens", i, "top_logprobs", j, "token_id"),
                    f"token id {entry['token_id']} appears twice among the top log-probabilities of position {i}",
                )
            seen.add(entry["token_id"])
            if previous is not None and entry["logprob"] > previous:
                yield Problem(
                    "inconsistent_fields",
                    ptr(at, "teacher_tokens", i, "top_logprobs", j, "logprob"),
                    f"top log-probabilities of position {i} are not ordered most likely first: "
                    f"{entry['logprob']} follows {previous}",
                )
            previous = entry["logprob"]


@semantic_rule("CompletionResponse", "completion.prompt-logprobs")
def _prompt_logprobs(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    usage = doc["usage"]
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "usage", "total_tokens"),
            f"total_tokens {usage['total_tokens']} != prompt_tokens {usage['prompt_tokens']} + "
            f"completion_tokens {usage['completion_tokens']}",
        )
    for c, choice in enumerate(doc["choices"]):
        scores = choice["prompt_logprobs"]
        if scores is None:
            continue
        where = ptr(at, "choices", c, "prompt_logprobs")
        if len(scores) != usage["prompt_tokens"]:
            yield Problem(
                "inconsistent_fields",
                where,
                f"{len(scores)} prompt positions scored but usage.prompt_tokens is {usage['prompt_tokens']}",
            )
        for i, entry in enumerate(scores):
            if (entry is None) != (i == 0):
                yield Problem(
                    "inconsistent_fields",
                    ptr(where, i),
                    "the first prompt position has no scores (null) and every later one has"
                    if i == 0
                    else f"prompt position {i} has no scores; only the first may be null",
                )


def load_off_policy_manifest(source: pipeline.Source) -> Any:
    return pipeline.load(MANIFEST, source)


def load_off_policy_row(source: pipeline.Source) -> Any:
    return pipeline.load(ROW, source)
