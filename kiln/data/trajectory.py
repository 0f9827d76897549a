"""Trajectories: a conversation followed by role-tagged segments, tokenized with one label per
token -- what GRPO's groups and OPD's prompts and pre-scored responses share (spec/40 "GRPO",
"OPD"). No model forward pass happens here.

Items
    A group, a prompt or a file line is an *item*. ``inline_value`` makes an inline item the
    plain JSON a file line parses to (non-finite numbers refused, canonical JSON round trip);
    ``parse_line`` parses one JSONL line strictly (``kiln.documents.jsonio.parse_json``: UTF-8, no
    duplicate keys, no NaN/Infinity, and no number that overflows a 64-bit float).
    ``check_item`` validates an item as the only element of a request's list against that
    request's schema (the pointer mapped back into the item); ``normalised_messages``
    normalises its chat messages as SFT does (``kiln.data.chat``). Every refusal is an
    ``ItemError``: what is wrong and the JSON pointer inside the item; the caller names the
    item (group 2, prompt 1, line 4) and where it came from. ``describe_problems`` words
    a list of schema problems for those refusals.

Segments
    ``segments(rollout)``: the ``trajectory`` list (role per segment, ``tool_call_id`` passed
    through; a missing ``kind`` is ``action`` for ``assistant``, ``observation`` for ``tool``
    and ``context`` otherwise; ``warning_prefix_len`` kept for observations, at most the
    content's length), or plain ``text`` as one assistant ``action`` segment.

Labels (``TrajectoryTokenizer``; any Hugging Face chat template that is prefix-stable)
    ``completion(messages, segments, prompt)`` renders the conversation ``F = messages +
    segments`` once (no generation prompt); it must start with the prompt ``G =
    render(messages, add_generation_prompt=True)`` and with every turn prefix used. Spans of
    ``F`` come from renders, never from searching the text: ``action`` with role ``assistant``
    -- ``[len(render(m[:k], gen)), len(render(m[:k+1])))``, what SFT supervises (content through
    the closing end-of-turn token and its newline; the header is no action); ``action`` with
    another role -- its content through the end of its turn; ``observation`` -- exactly its
    content, whose first ``warning_prefix_len`` characters are a warning span; ``context`` --
    nothing. Content positions come from a placeholder render (``ChatTemplate.locate``).
    ``F`` is cut at the end of ``G`` and at every span boundary (the warning boundary always,
    so ids never depend on the warning filter) and tokenized by ``ChatTemplate.encode``, so a
    token lies in exactly one span: ``PROMPT``, ``ACTION``, ``OBSERVATION``, ``WARNING``, or
    else ``CONTEXT``. A completion needs an action segment and, once tokenized, an action token.

    ``prefix(messages, segments)`` tokenizes ``render(messages + segments, add_generation_prompt
    =True)``, what a student continues, labelling only observation and warning tokens.
    ``observations(labels)`` is the observation mask of labels: warning tokens are left out
    (and counted) under ``warning_filter``, and are observation tokens without it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from kiln.contracts import problems
from kiln.data.chat import ChatTemplate, InvalidRowError, normalise_message
from kiln.documents.jsonio import canonical_json, parse_json
from kiln.errors import ContractError, KilnError, Problem, RequestError

__all__ = [
    "ACTION",
    "CONTEXT",
    "OBSERVATION",
    "PROMPT",
    "WARNING",
    "ItemError",
    "Segment",
    "TrajectoryTokenizer",
    "check_item",
    "describe_problems",
    "inline_value",
    "normalised_messages",
    "parse_line",
    "segments",
]

PROMPT, CONTEXT, ACTION, OBSERVATION, WARNING = range(5)
_MAX_PROBLEM_CHARS = 300
_POINTER_WORDS = {"completions": "completion", "rollouts": "completion", "trajectory": "segment", "messages": "message"}

Span = tuple[int, int, int]


class ItemError(Exception):
    """Why one item (a group, a prompt, a file line) is refused: what is wrong, and the JSON
    pointer of the bad value inside the item (empty for the item as a whole)."""

    def __init__(self, detail: str, pointer: str = "", *, reason: str = "data_schema_error"):
        super().__init__(detail)
        self.detail = detail
        self.pointer = pointer
        self.reason = reason  # the receipt category a dry run records (kiln.errors.TrainingDataError)


# --- items ------------------------------------------------------------------------------


def inline_value(value: Any) -> Any:
    """An inline item as the plain JSON a file line would parse to."""
    _require_finite(value)
    try:
        return parse_json(canonical_json(value), limit=2**62)
    except (TypeError, ValueError) as exc:
        raise ItemError(f"not representable as JSON: {exc}") from None
    except KilnError as exc:
        raise ItemError(exc.message) from None


def parse_line(line: bytes) -> Any:
    """One JSONL line, strictly parsed; non-finite numbers refused."""
    try:
        value = parse_json(line, limit=max(len(line), 1))
    except ContractError as exc:
        raise ItemError(exc.problems[0].message) from None
    _require_finite(value)
    return value


def _require_finite(value: Any) -> None:
    pointer = _non_finite(value, "")
    if pointer is not None:
        raise ItemError(f"{_describe_pointer(pointer)}: not a finite number (NaN and infinities are refused)", pointer)


def _non_finite(value: Any, pointer: str) -> str | None:
    if isinstance(value, float):
        return None if math.isfinite(value) else pointer
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _non_finite(item, f"{pointer}/{str(key).replace('~', '~0').replace('/', '~1')}")
        if found is not None:
            return found
    return None


def check_item(document: str, key: str, item: Any, *, whole: str, **body: Any) -> None:
    """Validate ``item`` as the only element of the ``key`` list of a ``document`` request
    (``body``: other fields that request needs); refuse the first problem inside the item."""
    found = [p for p in problems(document, {**body, key: [item]}) if p.pointer.startswith(f"/{key}")]
    if found:
        pointer = found[0].pointer.removeprefix(f"/{key}/0")
        raise ItemError(f"{_describe_pointer(pointer, whole)}: {describe_problems(found)}", pointer)


def _describe_pointer(pointer: str, whole: str = "the group") -> str:
    """``/completions/1/trajectory/0/kind`` → ``completion 2, segment 1, kind`` (1-based);
    ``whole`` names the empty pointer."""
    parts = pointer.split("/")[1:]
    words: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        if part in _POINTER_WORDS and i + 1 < len(parts) and parts[i + 1].isdigit():
            words.append(f"{_POINTER_WORDS[part]} {int(parts[i + 1]) + 1}")
            i += 2
        else:
            words.append(part)
            i += 1
    return ", ".join(words) or whole


def describe_problems(found: list[Problem]) -> str:
    """The first problem's code and message (a long one cut in the middle) and how many more."""
    first, message = found[0], found[0].message
    if len(message) > _MAX_PROBLEM_CHARS:  # keep both ends: the value comes first, the rule last
        half = _MAX_PROBLEM_CHARS // 2
        message = f"{message[:half]} ... {message[-half:]}"
    more = f" (and {len(found) - 1} more problems)" if len(found) > 1 else ""
    return f"{first.code}: {message}{more}"


def normalised_messages(raw: list[Any], key: str = "messages", *, named: bool = False) -> list[dict[str, Any]]:
    """``raw`` normalised as SFT normalises messages; a bad message is refused at ``/<key>/<i>``
    (its detail led by ``key`` when ``named``)."""
    out = []
    for number, message in enumerate(raw, start=1):
        try:
            out.append(normalise_message(number, message))
        except InvalidRowError as bad:
            raise ItemError(f"{key}: {bad.detail}" if named else bad.detail, f"/{key}/{number - 1}") from None
    return out


# --- segments ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Segment:
    """One turn after the messages: who wrote it, its text and what it is to the trainer."""

    role: str
    content: str
    kind: str
    warning_prefix_len: int
    tool_call_id: str | None

    def message(self) -> dict[str, Any]:
        """The segment as the chat message the template renders."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def segments(rollout: dict[str, Any]) -> list[Segment]:
    """The segments of a schema-valid rollout: its ``trajectory``, or its ``text`` as one action."""
    if "trajectory" not in rollout:
        return [Segment("assistant", rollout["text"], "action", 0, None)]
    out = []
    for number, raw in enumerate(rollout["trajectory"]):
        role, content = raw["role"], raw["content"]
        default = "action" if role == "assistant" else "observation" if role == "tool" else "context"
        kind = raw.get("kind", default)
        prefix = raw.get("warning_prefix_len", 0)
        if not role:
            raise ItemError(f"segment {number + 1}: role is empty", f"/trajectory/{number}/role")
        if kind == "observation" and prefix > len(content):
            raise ItemError(
                f"segment {number + 1}: warning_prefix_len {prefix} is longer than its content "
                f"({len(content)} characters)",
                f"/trajectory/{number}/warning_prefix_len",
            )
        prefix = prefix if kind == "observation" else 0
        out.append(Segment(role, content, kind, prefix, raw.get("tool_call_id")))
    return out


# --- labels -----------------------------------------------------------------------------


class TrajectoryTokenizer:
    """Tokenizes a conversation and its segments with one label per token."""

    def __init__(self, tokenizer: Any, warning_filter: bool):
        if not isinstance(warning_filter, bool):
            raise RequestError(
                f"warning_filter must be a boolean, got {warning_filter!r}",
                code="training_invalid_request",
                hint="warning_filter is true (the default) or false",
            )
        self.template = ChatTemplate(tokenizer)
        self.warning_filter = warning_filter

    def prompt(self, messages: list[dict[str, Any]]) -> str:
        """``render(messages, add_generation_prompt=True)``: what every completion continues."""
        with _template_refusals():
            return self.template.render(messages, generation=True)

    def completion(
        self, messages: list[dict[str, Any]], segments: list[Segment], prompt: str, *, from_text: bool = False
    ) -> tuple[tuple[int, ...], list[int]]:
        """Ids of ``messages + segments`` and a label per id; ``prompt`` is ``prompt(messages)``.
        ``from_text``: the segment is a rollout's plain ``text`` (refusals point at no segment)."""
        if not any(segment.kind == "action" for segment in segments):
            raise ItemError(
                "zero_action_tokens: the trajectory has no action segment; every completion needs at least one "
                "token written by the policy",
                "/trajectory",
                reason="zero_action_tokens",
            )
        with _template_refusals():
            input_ids, labels = self._completion(messages, segments, prompt, from_text)
        if ACTION not in labels[1:]:
            raise ItemError(
                "zero_action_tokens: no action token after tokenisation; every completion needs at least one "
                "token written by the policy",
                reason="zero_action_tokens",
            )
        return input_ids, labels

    def prefix(self, messages: list[dict[str, Any]], segments: list[Segment]) -> tuple[tuple[int, ...], list[int]]:
        """Ids of ``render(messages + segments, add_generation_prompt=True)`` and a label per id:
        ``OBSERVATION`` and ``WARNING`` for the observation segments' content, else ``CONTEXT``."""
        conversation = messages + [segment.message() for segment in segments]
        with _template_refusals():
            full = self.template.render(conversation)
            prompt = self.template.render(conversation, generation=True)
            if not prompt.startswith(full):
                raise ItemError(
                    "tokenization_error: the chat template's generation prompt does not extend the rendered "
                    "conversation, so the student's rollout cannot be appended to it"
                )
            observed = [i for i, segment in enumerate(segments) if segment.kind == "observation"]
            contents, data = self._contents(conversation, len(messages), segments, full, observed)
            spans = [span for i in observed for span in _observation(segments[i], full, *contents[i])]
            return self.template.encode(prompt, [span for span in spans if span[0] < span[1]], data, CONTEXT)

    def observations(self, labels: list[int]) -> tuple[tuple[bool, ...], int]:
        """The observation mask of ``labels`` and how many warning tokens the filter left out."""
        observed = (OBSERVATION,) if self.warning_filter else (OBSERVATION, WARNING)
        return tuple(label in observed for label in labels), labels.count(WARNING) if self.warning_filter else 0

    def _completion(
        self, messages: list[dict[str, Any]], segments: list[Segment], prompt: str, from_text: bool
    ) -> tuple[tuple[int, ...], list[int]]:
        n = len(messages)
        conversation = messages + [segment.message() for segment in segments]
        render = self.template.prefixes(conversation, {(n, True): prompt})
        full = render(len(conversation))
        if not full.startswith(prompt):
            first = segments[0].role
            raise ItemError(
                "tokenization_error: the completion does not continue the prompt's generation prompt"
                + (
                    f" (its first segment has role {first!r}; a trajectory starts with an assistant segment)"
                    if first != "assistant"
                    else ""
                ),
                "" if from_text else "/trajectory/0",
            )
        slotted = [
            i
            for i, segment in enumerate(segments)
            if segment.kind == "observation" or (segment.kind == "action" and segment.role != "assistant")
        ]
        contents, data = self._contents(conversation, n, segments, full, slotted)
        spans: list[Span] = []
        for i, segment in enumerate(segments):
            k = n + i
            before, through = render(k), render(k + 1)
            for text in (before, through):
                if not full.startswith(text):
                    raise _unstable(i, from_text)
            if segment.kind == "action" and segment.role == "assistant":
                header = render(k, True)
                if not full.startswith(header):
                    raise _unstable(i, from_text)
                start = len(header)
                if start == len(before) or start > len(through):
                    raise ItemError(
                        f"tokenization_error: the chat template's generation prompt does not match the header of "
                        f"assistant segment {i + 1}",
                        _segment_pointer(i, from_text),
                    )
                spans.append((start, len(through), ACTION))
            elif segment.kind in ("action", "observation"):
                start, end = contents[i]
                if start < len(before) or end > len(through):
                    raise _unstable(i, from_text)
                if segment.kind == "action":
                    spans.append((start, len(through), ACTION))
                else:
                    spans.extend(_observation(segment, full, start, end))
        spans = [span for span in spans if span[0] < span[1]]
        if any(a[1] > b[0] for a, b in itertools.pairwise(spans)) or (spans and spans[0][0] < len(prompt)):
            raise ItemError("tokenization_error: segment spans overlap in the rendered conversation")
        return self.template.encode(full, [(0, len(prompt), PROMPT), *spans], data, CONTEXT)

    def _contents(
        self, conversation: list[dict[str, Any]], n: int, segments: list[Segment], full: str, slotted: list[int]
    ) -> tuple[dict[int, tuple[int, int]], list[tuple[int, int]]]:
        """The content span of each ``slotted`` segment (it must appear exactly once), and the
        spans of message strings spelling a special token."""
        located = self.template.locate(conversation, full, {n + i for i in slotted})
        if located is None:
            raise ItemError(
                "tokenization_error: the chat template does not insert segment content or text spelling a special "
                "token verbatim, so it cannot be kept apart from the template's own text"
            )
        found, data = located
        contents = {}
        for i in slotted:
            if len(found[n + i]) != 1:
                raise ItemError(
                    f"tokenization_error: the chat template renders segment {i + 1}'s content "
                    f"{len(found[n + i])} times; it must appear exactly once",
                    f"/trajectory/{i}",
                )
            contents[i] = found[n + i][0]
        return contents, data


@contextlib.contextmanager
def _template_refusals() -> Iterator[None]:
    """A chat template's or tokenizer's refusal, as an ``ItemError`` that names its reason."""
    try:
        yield
    except InvalidRowError as bad:
        raise ItemError(f"{bad.reason}: {bad.detail}") from None


def _segment_pointer(i: int, from_text: bool) -> str:
    return "" if from_text else f"/trajectory/{i}"


def _unstable(i: int, from_text: bool) -> ItemError:
    where = "the completion" if from_text else f"segment {i + 1}"
    return ItemError(
        f"tokenization_error: the chat template renders the conversation up to {where} differently from the "
        "whole conversation, so its tokens cannot be told apart",
        _segment_pointer(i, from_text),
    )


def _observation(segment: Segment, full: str, start: int, end: int) -> list[Span]:
    """An observation's inserted content ``full[start:end]``: its warning banner, then the rest."""
    cut = _banner_end(segment.content, full[start:end], segment.warning_prefix_len) + start
    return [(start, cut, WARNING), (cut, end, OBSERVATION)]


def _banner_end(content: str, inserted: str, prefix: int) -> int:
    """Characters of the inserted text that cover the content's first ``prefix`` characters."""
    if prefix == 0 or inserted == content:
        return prefix
    if inserted == content.strip():
        lead = len(content) - len(content.lstrip())
        return min(max(prefix - lead, 0), len(inserted))
    for ascii_only in (False, True):
        if inserted == json.dumps(content, ensure_ascii=ascii_only)[1:-1]:
            return len(json.dumps(content[:prefix], ensure_ascii=ascii_only)[1:-1])
    raise ItemError("tokenization_error: cannot place the warning prefix in the rendered content")
