"""The held-out rule: a suite may not share a prompt with the training data.

A prompt's digest is ``json_sha256`` (canonical JSON, ``sha256:`` prefixed) of its messages
reduced to ``[{"role", "content"}]``, content as one string: a list of content parts is
flattened by joining the texts of its text parts (``{"type": "text", "text": ...}`` or plain
strings) in order, as SFT ingestion does; null or absent content is ``""``; ``name``,
``tool_calls`` and every other member are ignored. A suite example's prompt is its
``messages``. A training row's prompts:

* ``sft``   every prefix of the conversation that ends just before an assistant turn
            (every assistant turn is supervised, so each of those contexts is trained on;
            for the usual single-turn row that is the messages before the answer). A row
            without an assistant turn contributes its whole conversation.
* ``grpo``  each group's ``messages`` (inline ``groups`` / ``agentic_groups``, or one group
            per non-blank line of ``dataset_path``).
* ``opd``   each prompt's ``messages`` (inline ``prompts``, or every row after the manifest
            line of a pre-scored ``dataset_path``).

Rows that are not objects with a list of messages (or lines that do not parse) are passed
over: the trainer's own admission refuses or skips them, so they are never trained on.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kiln.documents.digests import json_sha256
from kiln.errors import RequestError

__all__ = ["overlapping_examples", "prompt_digest", "training_prompt_digests"]


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
        return "".join(texts)
    return str(content)


def prompt_digest(messages: list[dict[str, Any]]) -> str:
    """``sha256:`` digest of ``[{"role", "content"}]`` with content flattened to one string."""
    reduced = [
        {"role": m.get("role"), "content": _content_text(m.get("content"))} if isinstance(m, dict) else m
        for m in messages
    ]
    return json_sha256(reduced)


def _messages(row: Any) -> list[Any] | None:
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        return row["messages"]
    return None


def _jsonl_rows(path_value: Any, *, skip_first: bool = False) -> Iterator[Any]:
    """The parsed non-blank lines of a JSONL file (unparsable ones skipped), streamed."""
    path = Path(str(path_value))
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise RequestError(
            f"cannot read dataset_path {str(path)!r} to check the evaluation suite's held-out rule: "
            f"{exc.strerror or exc}",
            code="training_invalid_request",
            hint="point dataset_path at a readable JSONL file on the server",
        ) from None
    first = skip_first
    with handle:
        for line in handle:
            if not line.strip():
                continue
            if first:
                first = False
                continue
            try:
                yield json.loads(line)
            except (ValueError, RecursionError):
                continue


def _sft_prompts(messages: list[Any]) -> Iterator[list[Any]]:
    turns = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    if not turns:
        yield messages
    for i in turns:
        yield messages[:i]


def _rows(kind: str, request: dict[str, Any]) -> Iterable[Any]:
    path = request.get("dataset_path")
    if kind == "sft":
        yield from request.get("examples") or ()
    elif kind == "grpo":
        yield from request.get("groups") or ()
        yield from request.get("agentic_groups") or ()
    elif kind == "opd":
        yield from request.get("prompts") or ()
    else:
        raise ValueError(f"unknown training kind {kind!r} (sft, grpo or opd)")
    if path:
        yield from _jsonl_rows(path, skip_first=kind == "opd")  # a pre-scored OPD file opens with its manifest


def training_prompt_digests(kind: str, request: dict[str, Any]) -> set[str]:
    """The prompt digests of a ``sft`` / ``grpo`` / ``opd`` training request's rows (inline and file)."""
    digests: set[str] = set()
    for row in _rows(kind, request):
        messages = _messages(row)
        if messages is None:
            continue
        if kind == "sft":
            digests.update(prompt_digest(prompt) for prompt in _sft_prompts(messages))
        else:
            digests.add(prompt_digest(messages))
    return digests


def overlapping_examples(suite: dict[str, Any], digests: set[str]) -> list[str]:
    """Ids of the suite's examples whose prompt digest is in ``digests``, in suite order."""
    return [example["id"] for example in suite["examples"] if prompt_digest(example["messages"]) in digests]
