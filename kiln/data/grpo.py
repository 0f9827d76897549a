"""GRPO ingestion: scored groups, inline or from a pinned JSONL file → tokenized completions
with action and observation masks (spec/40 "GRPO"). No model forward pass happens here.

API
    ``read_groups(*, tokenizer, groups=None, agentic_groups=None, dataset_path=None,
    warning_filter=True, behavior_policy="no_importance_correction") -> GrpoIngestion``
        Exactly one source: inline ``groups`` (or its alias ``agentic_groups``) or a JSONL
        ``dataset_path``. Every group is checked and tokenized; the first bad one is refused.
    ``iter_dataset_groups(*, tokenizer, dataset_path, ..., expected_sha256=None)``
        The streamed pass over a JSONL file, one ``(GrpoGroup, GrpoSourcePosition)`` at a
        time (what a training pass reads; ``read_groups`` collects it). With
        ``expected_sha256`` the bytes read are compared with the pin once the file ends.
    ``dataset_sha256(path) -> str`` and ``check_unchanged(path, expected_sha256)``
        Pin a file (``sha256:`` digest of its bytes, streamed) and re-check it; a changed or
        vanished file is refused with ``RequestError`` (``training_invalid_request``) naming it.
    ``GrpoIngestion`` carries the groups, the receipt's ``training_data`` (``source``
    ``inline_grpo_groups`` | ``jsonl_grpo_groups``, or ``jsonl_grpo_groups_dry_run`` via
    ``training_data(dry_run=True)``; ``path``; ``sha256``), the checkpoint ``route``
    (``inline`` | ``jsonl``), per-group stream positions and ``GrpoCounts`` (whose
    ``token_counts()`` has the receipt's ``token_counts`` layout).

Groups
    A group is one inline list item or one non-blank line of the file (blank = only ASCII
    whitespace; blank lines are not groups but are counted and hashed as consumed lines).
    Lines are parsed strictly (``kiln._jsonio.parse_json``: UTF-8, no duplicate keys, no
    NaN/Infinity). Inline groups are checked for non-finite numbers, serialised to canonical
    JSON and parsed back, so both routes see the same plain JSON values. Each group is then
    validated as an ``AgenticGroup``: it is not a contract entry point, so the group is
    wrapped as ``{"groups": [group]}`` and validated against ``GrpoRequest`` (the pointer is
    mapped back). ``completions`` and its alias ``rollouts`` are checked first (exactly one)
    so that mistake gets a plain message. Message roles follow SFT (``system``, ``user``,
    ``assistant``, ``tool``; SFT's message normalisation is reused). Refusals are
    ``RequestError`` (``training_invalid_request``) naming the group (1-based), for files
    also the 1-based physical line and the file, then the completion, segment or message
    (1-based) and the problem; ``pointer`` holds the JSON pointer (``/groups/<i>/...`` inline,
    within the line's object for files). Also refused: a number that is not a finite 64-bit
    float anywhere in a group (``1e400`` parses to infinity), a ``warning_prefix_len`` longer
    than its observation, a trajectory that does not start with an assistant segment, and a
    completion without an action token (``zero_action_tokens`` in the message; a trajectory
    without an action segment is refused before rendering).

Digests
    ``GrpoGroup.row_sha256`` is ``json_sha256`` of the group as parsed (canonical JSON,
    spec/20), so the same group has the same digest inline and streamed. The inline source
    digest is ``json_sha256`` of the list of groups as sent (the serialized effective input);
    the streamed one is the file's bytes, hashed in the same pass that parses them. Per
    group on the JSONL route, ``GrpoSourcePosition`` gives the checkpoint cursor after that
    group: ``source_byte_offset`` (just after its line), ``source_lines_consumed`` (physical
    lines, blanks included) and ``consumed_lines_sha256`` (``json_sha256`` of the list of
    ``sha256:`` digests of those lines, each line hashed exactly as read, newline included).

Rendering and masks (any Hugging Face chat template that is prefix-stable)
    1. The prompt is ``G = render(messages, add_generation_prompt=True)``. A completion is the
       conversation ``messages + segments``; plain ``text`` is one assistant ``action``
       segment, a ``trajectory`` gives the segments (role per segment, ``tool_call_id``
       passed through; ``text`` is then ignored). A missing ``kind`` is ``action`` for
       ``assistant``, ``observation`` for ``tool`` and ``context`` otherwise. The whole
       conversation ``F`` is rendered once (no generation prompt) and must start with ``G``
       (so a trajectory starts with an assistant segment) and with every turn prefix used.
    2. Spans of ``F`` (from renders, never from searching the text):
       ``action`` with role ``assistant`` — ``[len(render(m[:k], gen)), len(render(m[:k+1])))``:
       what SFT supervises, the content through the closing end-of-turn token and its
       newline; the header is not an action. ``action`` with another role — its content
       through the end of its turn. ``observation`` — exactly its content; the first
       ``warning_prefix_len`` characters are a warning span (at most the content's length).
       ``context`` — nothing. Content positions come from a render in which those contents
       (and any string spelling a special token) are unique placeholders, aligned against
       ``F`` as SFT does (inserted verbatim, stripped or JSON-escaped).
    3. ``F`` is cut at the end of ``G`` and at every span boundary (the warning boundary
       always, so ids never depend on ``warning_filter``); pieces are tokenized like SFT
       (template pieces normally, data pieces with ``split_special_tokens``, no added
       special tokens) and concatenated: a token belongs to exactly one span by construction.
    4. Masks are aligned with next-token targets (``input_ids[1:]``, the causal shift):
       ``action_mask[t]`` is true when ``input_ids[t + 1]`` is an action token;
       ``observation_mask[t]`` when it is an observation token, warning tokens excluded when
       ``warning_filter`` is on (they are then counted in ``warning_tokens``). Every
       completion of a group has the same prompt ids (``input_ids[:prompt_tokens]``).

Recorded behaviour log-probabilities
    From ``provenance.action_tokens[*].behavior_logprob`` (rollout-provenance v1 layout),
    one per action target in order, and only when that list matches the tokenized action
    tokens (same count, same ``token_id``s). With ``behavior_policy="recorded"`` a missing or
    misaligned provenance refuses the completion; otherwise ``recorded_logprobs`` is None.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln._jsonio import canonical_json, parse_json
from kiln.contracts import problems
from kiln.data.sft import (
    _InvalidRowError,
    _json_type,
    _match_skeleton,
    _normalise_message,
    _RowTokenizer,
    _template_errors,
)
from kiln.digests import json_sha256, prefixed, raw_hex, stream_sha256
from kiln.errors import KilnError, RequestError

__all__ = [
    "BEHAVIOR_POLICIES",
    "GRPO_SOURCES",
    "SEGMENT_KINDS",
    "GrpoCompletion",
    "GrpoCounts",
    "GrpoGroup",
    "GrpoIngestion",
    "GrpoSourcePosition",
    "check_unchanged",
    "dataset_sha256",
    "iter_dataset_groups",
    "read_groups",
]

GRPO_SOURCES = ("inline_grpo_groups", "jsonl_grpo_groups", "jsonl_grpo_groups_dry_run")
SEGMENT_KINDS = ("context", "action", "observation")
BEHAVIOR_POLICIES = ("no_importance_correction", "recorded")
_ROLLOUT_PROVENANCE = "kiln.rollout-provenance.v1"
_ASCII_WS = b" \t\n\r\x0b\x0c"
_MAX_PROBLEM_CHARS = 300
_PROMPT, _CONTEXT, _ACTION, _OBSERVATION, _WARNING = range(5)


@dataclass(frozen=True)
class GrpoCompletion:
    """One tokenized completion. Masks have ``len(input_ids) - 1`` entries (next-token targets)."""

    index: int
    reward: float
    input_ids: tuple[int, ...]
    action_mask: tuple[bool, ...]
    observation_mask: tuple[bool, ...]
    recorded_logprobs: tuple[float, ...] | None
    action_tokens: int
    observation_tokens: int
    warning_tokens: int
    provenance: dict[str, Any] | None = field(default=None, hash=False)


@dataclass(frozen=True)
class GrpoGroup:
    """One group: its 0-based source index, digest, shared prompt length and completions."""

    index: int
    row_sha256: str
    prompt_tokens: int
    completions: tuple[GrpoCompletion, ...]


@dataclass(frozen=True)
class GrpoSourcePosition:
    """The streamed-source cursor just after one group's line (checkpoint ``auxiliary_state``)."""

    line_number: int
    source_byte_offset: int
    source_lines_consumed: int
    consumed_lines_sha256: str


@dataclass(frozen=True)
class GrpoCounts:
    """Totals over every group read. ``context_tokens`` counts, per completion, the tokens of
    its whole sequence (prompt included) that are neither action nor observation tokens."""

    groups: int = 0
    completions: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    action_tokens: int = 0
    observation_tokens: int = 0
    warning_tokens_filtered: int = 0
    context_tokens: int = 0

    def token_counts(self) -> dict[str, int]:
        """The receipt's ``token_counts`` (and the loop state's) layout."""
        return {
            "action_tokens": self.action_tokens,
            "env_tokens": self.observation_tokens,
            "env_tokens_before_warning_filter": self.observation_tokens + self.warning_tokens_filtered,
            "env_tokens_after_warning_filter": self.observation_tokens,
            "warning_tokens_filtered": self.warning_tokens_filtered,
            "context_tokens": self.context_tokens,
        }


@dataclass(frozen=True)
class GrpoIngestion:
    """Every group in source order, where it came from and what it adds up to."""

    groups: tuple[GrpoGroup, ...]
    source: str
    route: str
    path: str | None
    source_sha256: str
    positions: tuple[GrpoSourcePosition, ...]
    counts: GrpoCounts

    def training_data(self, *, dry_run: bool = False) -> dict[str, Any]:
        """The receipt's ``training_data`` block."""
        source = self.source
        if dry_run:
            if self.route != "jsonl":
                raise RequestError(
                    "a GRPO dry run needs dataset_path; inline groups cannot be dry-run",
                    code="training_invalid_request",
                    hint="point dataset_path at the JSONL file, or drop dry_run",
                )
            source = "jsonl_grpo_groups_dry_run"
        return {"source": source, "path": self.path, "sha256": self.source_sha256}


class _GroupError(Exception):
    """Internal: why one group is refused (never escapes this module)."""

    def __init__(self, detail: str, pointer: str = ""):
        super().__init__(detail)
        self.detail = detail
        self.pointer = pointer


# --- entry points -----------------------------------------------------------------------


def read_groups(
    *,
    tokenizer: Any,
    groups: Sequence[Any] | None = None,
    agentic_groups: Sequence[Any] | None = None,
    dataset_path: str | os.PathLike[str] | None = None,
    warning_filter: bool = True,
    behavior_policy: str = "no_importance_correction",
) -> GrpoIngestion:
    """Validate and tokenize every group of exactly one source; refuse the first bad group."""
    given = [name for name, value in (("groups", groups), ("agentic_groups", agentic_groups)) if value is not None]
    if dataset_path is not None:
        given.append("dataset_path")
    if len(given) != 1:
        raise RequestError(
            "give exactly one of groups, agentic_groups or dataset_path"
            + (f" (got {', '.join(given)})" if given else ""),
            code="training_invalid_request",
            hint="send the groups inline as groups (agentic_groups is another name for it), "
            "or point dataset_path at a JSONL file with one group per line",
        )
    if dataset_path is not None:
        path = _dataset_file(dataset_path)
        read: list[GrpoGroup] = []
        positions: list[GrpoSourcePosition] = []
        hasher = hashlib.sha256()
        renderer = _GroupTokenizer(tokenizer, warning_filter, behavior_policy)
        for group, position in _file_groups(path, renderer, hasher):
            read.append(group)
            positions.append(position)
        return _ingestion(read, "jsonl_grpo_groups", "jsonl", str(path), prefixed(hasher.hexdigest()), positions)

    name = given[0]
    values = groups if groups is not None else agentic_groups
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Sequence):
        raise RequestError(
            f"{name} must be a list of groups, got {type(values).__name__}",
            code="training_invalid_request",
            hint=f'send {name} as [{{"messages": [...], "completions": [{{"text": ..., "reward": ...}}]}}, ...]',
        )
    if not values:
        raise RequestError(
            f"{name} is empty; a GRPO job needs at least one group",
            code="training_invalid_request",
            hint="send at least one group of scored completions",
        )
    renderer = _GroupTokenizer(tokenizer, warning_filter, behavior_policy)
    parsed: list[Any] = []
    read = []
    for index, value in enumerate(values):
        try:
            plain = _inline_value(value)
            parsed.append(plain)
            read.append(renderer.group(index, plain))
        except _GroupError as bad:
            raise RequestError(
                f"group {index + 1} is invalid: {bad.detail}",
                code="training_invalid_request",
                hint=f"fix group {index + 1} of {name}; every group needs messages and 1 to 1024 scored "
                "completions, each with at least one action token",
                pointer=f"/{name}/{index}{bad.pointer}",
            ) from None
    return _ingestion(read, "inline_grpo_groups", "inline", None, json_sha256(parsed), [])


def iter_dataset_groups(
    *,
    tokenizer: Any,
    dataset_path: str | os.PathLike[str],
    warning_filter: bool = True,
    behavior_policy: str = "no_importance_correction",
    expected_sha256: str | None = None,
) -> Iterator[tuple[GrpoGroup, GrpoSourcePosition]]:
    """Stream the groups of a JSONL file with their cursor; with ``expected_sha256``, refuse the
    file (after its last line) when the bytes read differ from the pin."""
    path = _dataset_file(dataset_path)
    renderer = _GroupTokenizer(tokenizer, warning_filter, behavior_policy)

    def stream() -> Iterator[tuple[GrpoGroup, GrpoSourcePosition]]:
        hasher = hashlib.sha256()
        yield from _file_groups(path, renderer, hasher)
        if expected_sha256 is not None:
            _require_digest(path, expected_sha256, hasher.hexdigest(), "while it was read")

    return stream()


def dataset_sha256(path: str | os.PathLike[str]) -> str:
    """``sha256:`` digest of a file's bytes, read in chunks (the pin of a streamed dataset)."""
    target = Path(os.path.abspath(os.fspath(path)))
    try:
        with target.open("rb") as fh:
            digest, _ = stream_sha256(fh)
    except OSError as exc:
        raise RequestError(
            f"cannot read dataset_path {str(target)!r}: {exc.strerror or exc}",
            code="training_invalid_request",
            hint="check that the file exists and is readable by the Kiln process",
        ) from None
    return prefixed(digest)


def check_unchanged(path: str | os.PathLike[str], expected_sha256: str) -> None:
    """Refuse when the file's bytes no longer hash to the pinned digest (or it cannot be read)."""
    target = Path(os.path.abspath(os.fspath(path)))
    _require_digest(target, expected_sha256, raw_hex(dataset_sha256(target)), "since it was pinned")


def _require_digest(path: Path, expected: str, actual_hex: str, when: str) -> None:
    if raw_hex(expected) != actual_hex:
        raise RequestError(
            f"dataset_path {str(path)!r} changed {when}: pinned {prefixed(raw_hex(expected))}, "
            f"now {prefixed(actual_hex)}",
            code="training_invalid_request",
            hint="a streamed GRPO file must not change between admission and training; "
            "restore its bytes, or submit the job again to pin the new file",
        )


def _ingestion(
    groups: list[GrpoGroup],
    source: str,
    route: str,
    path: str | None,
    digest: str,
    positions: list[GrpoSourcePosition],
) -> GrpoIngestion:
    totals = dict.fromkeys(GrpoCounts.__dataclass_fields__, 0)
    for group in groups:
        totals["groups"] += 1
        totals["prompt_tokens"] += group.prompt_tokens
        for completion in group.completions:
            before = completion.observation_tokens + completion.warning_tokens
            totals["completions"] += 1
            totals["completion_tokens"] += len(completion.input_ids) - group.prompt_tokens
            totals["action_tokens"] += completion.action_tokens
            totals["observation_tokens"] += completion.observation_tokens
            totals["warning_tokens_filtered"] += completion.warning_tokens
            totals["context_tokens"] += len(completion.input_ids) - completion.action_tokens - before
    return GrpoIngestion(tuple(groups), source, route, path, digest, tuple(positions), GrpoCounts(**totals))


# --- sources ----------------------------------------------------------------------------


def _dataset_file(dataset_path: str | os.PathLike[str]) -> Path:
    if not isinstance(dataset_path, (str, os.PathLike)) or not os.fspath(dataset_path):
        raise RequestError(
            f"dataset_path must be a non-empty path, got {dataset_path!r}",
            code="training_invalid_request",
            hint="point dataset_path at a JSONL file with one group per line",
        )
    path = Path(os.path.abspath(os.fspath(dataset_path)))
    if not path.is_file():
        raise RequestError(
            f"dataset_path {str(path)!r} is not a readable file",
            code="training_invalid_request",
            hint="point dataset_path at a JSONL file with one group per line",
        )
    return path


def _file_groups(path: Path, renderer: _GroupTokenizer, hasher: Any) -> Iterator[tuple[GrpoGroup, GrpoSourcePosition]]:
    """Groups of a JSONL file with their cursor; ``hasher`` sees every byte read."""
    consumed = hashlib.sha256(b"[")  # canonical JSON of the list of line digests, built incrementally
    offset = lines = index = 0
    with contextlib.closing(_file_lines(path)) as physical:
        for line in physical:
            hasher.update(line)
            consumed.update(b'"' if lines == 0 else b',"')
            consumed.update(prefixed(hashlib.sha256(line).hexdigest()).encode("ascii") + b'"')
            offset += len(line)
            lines += 1
            if not line.strip(_ASCII_WS):
                continue
            try:
                group = renderer.group(index, _parse_line(line))
            except _GroupError as bad:
                raise RequestError(
                    f"line {lines} (group {index + 1}) of {str(path)!r} is invalid: {bad.detail}",
                    code="training_invalid_request",
                    hint=f"fix line {lines} of the file; every line is one group with messages and 1 to 1024 "
                    "scored completions, each with at least one action token",
                    pointer=bad.pointer,
                ) from None
            snapshot = consumed.copy()
            snapshot.update(b"]")
            yield group, GrpoSourcePosition(lines, offset, lines, prefixed(snapshot.hexdigest()))
            index += 1
    if index == 0:
        raise RequestError(
            f"dataset_path {str(path)!r} has no groups",
            code="training_invalid_request",
            hint="write one group per line; blank lines are not groups",
        )


def _file_lines(path: Path) -> Iterator[bytes]:
    """Every physical line of the file, exactly as read (newline included), in binary."""
    try:
        with path.open("rb") as fh:
            yield from fh
    except OSError as exc:
        raise RequestError(
            f"cannot read dataset_path {str(path)!r}: {exc.strerror or exc}",
            code="training_invalid_request",
            hint="check that the file exists and is readable by the Kiln process",
        ) from None


def _parse_line(line: bytes) -> Any:
    try:
        value = parse_json(line, limit=max(len(line), 1))
    except KilnError as exc:
        raise _GroupError(exc.message) from None
    _require_finite(value)  # a literal such as 1e400 parses to infinity
    return value


def _inline_value(value: Any) -> Any:
    """An inline group as the plain JSON a file line would parse to."""
    _require_finite(value)
    try:
        return parse_json(canonical_json(value), limit=2**62)
    except (TypeError, ValueError) as exc:
        raise _GroupError(f"not representable as JSON: {exc}") from None
    except KilnError as exc:
        raise _GroupError(exc.message) from None


def _require_finite(value: Any) -> None:
    pointer = _non_finite(value, "")
    if pointer is not None:
        raise _GroupError(f"{_where(pointer)}: not a finite number (NaN and infinities are refused)", pointer)


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


def _where(pointer: str) -> str:
    """``/completions/1/trajectory/0/kind`` → ``completion 2, segment 1, kind`` (1-based)."""
    parts = pointer.split("/")[1:]
    words: list[str] = []
    i = 0
    while i < len(parts):
        part = parts[i]
        names = {"completions": "completion", "rollouts": "completion", "trajectory": "segment", "messages": "message"}
        if part in names and i + 1 < len(parts) and parts[i + 1].isdigit():
            words.append(f"{names[part]} {int(parts[i + 1]) + 1}")
            i += 2
        else:
            words.append(part)
            i += 1
    return ", ".join(words) or "the group"


# --- one group --------------------------------------------------------------------------


@dataclass
class _Segment:
    role: str
    content: str
    kind: str
    warning_prefix_len: int
    tool_call_id: str | None

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class _GroupTokenizer:
    """Checks one parsed group and tokenizes its completions with action/observation labels."""

    def __init__(self, tokenizer: Any, warning_filter: bool, behavior_policy: str):
        if behavior_policy not in BEHAVIOR_POLICIES:
            raise RequestError(
                f"behavior_policy {behavior_policy!r} is not one of {', '.join(BEHAVIOR_POLICIES)}",
                code="training_invalid_request",
                hint="leave behavior_policy unset for no_importance_correction",
            )
        if not isinstance(warning_filter, bool):
            raise RequestError(
                f"warning_filter must be a boolean, got {warning_filter!r}",
                code="training_invalid_request",
                hint="warning_filter is true (the default) or false",
            )
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError(
                "the model's tokenizer has no chat template, so prompts cannot be rendered",
                code="training_invalid_request",
                hint="use a chat model whose tokenizer_config.json carries a chat_template",
            )
        self.tokenizer = tokenizer
        self.warning_filter = warning_filter
        self.recorded = behavior_policy == "recorded"
        self.errors = _template_errors()
        self.specials = _RowTokenizer(tokenizer, None).specials

    def group(self, index: int, value: Any) -> GrpoGroup:
        rollouts_key = self._check_shape(value)
        messages = self._messages(value["messages"])
        prompt = self._render(messages, generation=True)
        prompt_ids: tuple[int, ...] | None = None
        completions = []
        for number, rollout in enumerate(value[rollouts_key]):
            pointer = f"/{rollouts_key}/{number}"
            try:
                completion = self._completion(number, rollout, messages, prompt)
            except _GroupError as bad:
                raise _GroupError(f"completion {number + 1}: {bad.detail}", pointer + bad.pointer) from None
            ids = completion[0].input_ids[: completion[1]]
            if prompt_ids is None:
                prompt_ids = ids
            elif ids != prompt_ids:
                raise _GroupError(
                    f"completion {number + 1}: tokenization_error: its prompt tokens differ from completion 1's",
                    pointer,
                )
            completions.append(completion[0])
        assert prompt_ids is not None  # the schema guarantees at least one completion
        return GrpoGroup(index, json_sha256(value), len(prompt_ids), tuple(completions))

    # schema and normalisation

    def _check_shape(self, value: Any) -> str:
        if not isinstance(value, dict):
            raise _GroupError(f"a group must be a JSON object, got {_json_type(value)}")
        present = [key for key in ("completions", "rollouts") if key in value]
        if len(present) != 1:
            raise _GroupError(
                "a group has completions or its alias rollouts, not both"
                if present
                else 'a group needs "completions" (or its alias "rollouts")'
            )
        found = problems("GrpoRequest", {"groups": [value]})
        if found:
            first = found[0]
            pointer = first.pointer.removeprefix("/groups/0")
            message = first.message
            if len(message) > _MAX_PROBLEM_CHARS:  # keep both ends: the value comes first, the rule last
                half = _MAX_PROBLEM_CHARS // 2
                message = f"{message[:half]} ... {message[-half:]}"
            more = f" (and {len(found) - 1} more problems)" if len(found) > 1 else ""
            raise _GroupError(f"{_where(pointer)}: {first.code}: {message}{more}", pointer)
        return present[0]

    @staticmethod
    def _messages(raw: list[Any]) -> list[dict[str, Any]]:
        out = []
        for number, message in enumerate(raw, start=1):
            try:
                out.append(_normalise_message(number, message))
            except _InvalidRowError as bad:
                raise _GroupError(bad.detail, f"/messages/{number - 1}") from None
        return out

    def _segments(self, rollout: dict[str, Any]) -> list[_Segment]:
        if "trajectory" not in rollout:
            return [_Segment("assistant", rollout["text"], "action", 0, None)]
        segments = []
        for number, raw in enumerate(rollout["trajectory"]):
            role, content = raw["role"], raw["content"]
            default = "action" if role == "assistant" else "observation" if role == "tool" else "context"
            kind = raw.get("kind", default)
            prefix = raw.get("warning_prefix_len", 0)
            if not role:
                raise _GroupError(f"segment {number + 1}: role is empty", f"/trajectory/{number}/role")
            if kind == "observation" and prefix > len(content):
                raise _GroupError(
                    f"segment {number + 1}: warning_prefix_len {prefix} is longer than its content "
                    f"({len(content)} characters)",
                    f"/trajectory/{number}/warning_prefix_len",
                )
            prefix = prefix if kind == "observation" else 0
            segments.append(_Segment(role, content, kind, prefix, raw.get("tool_call_id")))
        return segments

    # one completion

    def _completion(
        self, number: int, rollout: dict[str, Any], messages: list[dict[str, Any]], prompt: str
    ) -> tuple[GrpoCompletion, int]:
        try:
            reward = float(rollout["reward"])
        except OverflowError:
            reward = math.inf
        if not math.isfinite(reward):
            raise _GroupError("reward: too large for a 64-bit float", "/reward")
        segments = self._segments(rollout)
        if not any(segment.kind == "action" for segment in segments):
            raise _GroupError(
                "zero_action_tokens: the trajectory has no action segment; every completion needs at least one "
                "token written by the policy",
                "/trajectory",
            )
        n = len(messages)
        conversation = messages + [segment.message() for segment in segments]
        renders: dict[tuple[int, bool], str] = {(n, True): prompt}

        def render(count: int, generation: bool = False) -> str:
            if (count, generation) not in renders:
                renders[(count, generation)] = self._render(conversation[:count], generation=generation)
            return renders[(count, generation)]

        full = render(len(conversation))
        if not full.startswith(prompt):
            first = segments[0].role
            raise _GroupError(
                "tokenization_error: the completion does not continue the prompt's generation prompt"
                + (
                    f" (its first segment has role {first!r}; a trajectory starts with an assistant segment)"
                    if first != "assistant"
                    else ""
                ),
                "/trajectory/0" if "trajectory" in rollout else "",
            )
        contents, data = self._placeholder_spans(conversation, n, segments, full)
        spans: list[tuple[int, int, int]] = []
        for i, segment in enumerate(segments):
            k = n + i
            before, through = render(k), render(k + 1)
            for text in (before, through):
                if not full.startswith(text):
                    raise self._unstable(i, rollout)
            if segment.kind == "action" and segment.role == "assistant":
                header = render(k, True)
                if not full.startswith(header):
                    raise self._unstable(i, rollout)
                start = len(header)
                if start == len(before) or start > len(through):
                    raise _GroupError(
                        f"tokenization_error: the chat template's generation prompt does not match the header of "
                        f"assistant segment {i + 1}",
                        self._segment_pointer(i, rollout),
                    )
                spans.append((start, len(through), _ACTION))
            elif segment.kind in ("action", "observation"):
                start, end = contents[i]
                if start < len(before) or end > len(through):
                    raise self._unstable(i, rollout)
                if segment.kind == "action":
                    spans.append((start, len(through), _ACTION))
                else:
                    cut = _banner_end(segment.content, full[start:end], segment.warning_prefix_len) + start
                    spans.extend(((start, cut, _WARNING), (cut, end, _OBSERVATION)))
        spans = [span for span in spans if span[0] < span[1]]
        if any(a[1] > b[0] for a, b in itertools.pairwise(spans)) or (spans and spans[0][0] < len(prompt)):
            raise _GroupError("tokenization_error: segment spans overlap in the rendered conversation")
        input_ids, labels = self._encode(full, len(prompt), spans, data)
        return self._masks(number, rollout, input_ids, labels), labels.count(_PROMPT)

    def _masks(
        self,
        number: int,
        rollout: dict[str, Any],
        input_ids: tuple[int, ...],
        labels: list[int],
    ) -> GrpoCompletion:
        targets = labels[1:]
        action_mask = tuple(label == _ACTION for label in targets)
        observed = (_OBSERVATION,) if self.warning_filter else (_OBSERVATION, _WARNING)
        observation_mask = tuple(label in observed for label in targets)
        action_tokens = sum(action_mask)
        if action_tokens == 0:
            raise _GroupError(
                "zero_action_tokens: no action token after tokenisation; every completion needs at least one "
                "token written by the policy"
            )
        action_ids = [input_ids[t + 1] for t, active in enumerate(action_mask) if active]
        provenance = rollout.get("provenance")
        logprobs, problem = _recorded_logprobs(provenance, action_ids)
        if self.recorded and problem is not None:
            raise _GroupError(f"behavior_policy recorded: {problem}", "/provenance")
        return GrpoCompletion(
            index=number,
            reward=float(rollout["reward"]),
            input_ids=input_ids,
            action_mask=action_mask,
            observation_mask=observation_mask,
            recorded_logprobs=logprobs,
            action_tokens=action_tokens,
            observation_tokens=sum(observation_mask),
            warning_tokens=sum(1 for label in targets if label == _WARNING) if self.warning_filter else 0,
            provenance=provenance,
        )

    @staticmethod
    def _segment_pointer(i: int, rollout: dict[str, Any]) -> str:
        return f"/trajectory/{i}" if "trajectory" in rollout else ""

    def _unstable(self, i: int, rollout: dict[str, Any]) -> _GroupError:
        where = f"segment {i + 1}" if "trajectory" in rollout else "the completion"
        return _GroupError(
            f"tokenization_error: the chat template renders the conversation up to {where} differently from the "
            "whole conversation, so its tokens cannot be told apart",
            self._segment_pointer(i, rollout),
        )

    # rendering and tokenization

    def _render(self, conversation: list[dict[str, Any]], *, generation: bool) -> str:
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation)
        except self.errors as exc:
            raise _GroupError(f"tokenization_error: the chat template rejected the conversation: {exc}") from None
        if not isinstance(text, str):
            raise _GroupError("tokenization_error: the chat template did not render text")
        return text

    def _placeholder_spans(
        self, conversation: list[dict[str, Any]], n: int, segments: list[_Segment], full: str
    ) -> tuple[dict[int, tuple[int, int]], list[tuple[int, int]]]:
        """Content spans of the segments that need them, and spans of strings spelling a special token."""
        slots: list[str] = []
        data_slots: set[int] = set()
        content_slot: dict[int, int] = {}
        base = "kilnslot"
        while base in full:
            base += "x"

        def slot(value: str) -> str:
            if any(special in value for special in self.specials):
                data_slots.add(len(slots))
            slots.append(value)
            return f"{base}{len(slots) - 1}q"

        def swap(value: Any) -> Any:
            if isinstance(value, str):
                return slot(value) if any(special in value for special in self.specials) else value
            if isinstance(value, list):
                return [swap(item) for item in value]
            if isinstance(value, dict):
                if any(special in key for key in value for special in self.specials):
                    raise _GroupError("tokenization_error: a message has a key that spells a special token")
                return {key: swap(item) for key, item in value.items()}
            return value

        swapped = []
        for k, message in enumerate(conversation):
            segment = segments[k - n] if k >= n else None
            if segment is not None and (
                segment.kind == "observation" or (segment.kind == "action" and segment.role != "assistant")
            ):
                content_slot[k - n] = len(slots)
                swapped.append(
                    {
                        **swap({key: v for key, v in message.items() if key != "content"}),
                        "content": slot(message["content"]),
                    }
                )
            else:
                swapped.append(swap(message))
        if not slots:
            return {}, []
        parts = re.split(re.escape(base) + r"(\d+)q", self._render(swapped, generation=False))
        spans = _match_skeleton(parts, slots, full)
        if spans is None:
            raise _GroupError(
                "tokenization_error: the chat template does not insert segment content or text spelling a special "
                "token verbatim, so it cannot be kept apart from the template's own text"
            )
        found: dict[int, list[tuple[int, int]]] = {}
        for number, span in zip((int(p) for p in parts[1::2]), spans, strict=True):
            found.setdefault(number, []).append(span)
        contents = {}
        for i, number in content_slot.items():
            if len(found.get(number, ())) != 1:
                raise _GroupError(
                    f"tokenization_error: the chat template renders segment {i + 1}'s content "
                    f"{len(found.get(number, ()))} times; it must appear exactly once",
                    f"/trajectory/{i}",
                )
            contents[i] = found[number][0]
        data = [span for number in sorted(data_slots) for span in found.get(number, ()) if span[0] < span[1]]
        return contents, data

    def _encode(
        self, full: str, prompt_end: int, spans: list[tuple[int, int, int]], data: list[tuple[int, int]]
    ) -> tuple[tuple[int, ...], list[int]]:
        cuts = sorted({0, len(full), prompt_end, *(p for s in spans for p in s[:2]), *(p for s in data for p in s)})
        pieces: list[tuple[str, int, bool]] = []
        for a, b in itertools.pairwise(cuts):
            if a < b:
                label = _PROMPT if b <= prompt_end else next((s[2] for s in spans if s[0] <= a and b <= s[1]), _CONTEXT)
                pieces.append((full[a:b], label, any(s <= a and b <= e for s, e in data)))
        encoded: dict[int, list[int]] = {}
        for split in (False, True):
            batch = [n for n, piece in enumerate(pieces) if piece[2] == split]
            if not batch:
                continue
            try:
                ids = self.tokenizer(
                    [pieces[n][0] for n in batch], add_special_tokens=False, split_special_tokens=split, verbose=False
                )["input_ids"]
            except self.errors as exc:
                raise _GroupError(f"tokenization_error: the tokenizer rejected the conversation: {exc}") from None
            encoded.update(zip(batch, ids, strict=True))
        input_ids: list[int] = []
        labels: list[int] = []
        for n, (_, label, _) in enumerate(pieces):
            ids = [int(i) for i in encoded[n]]
            input_ids.extend(ids)
            labels.extend([label] * len(ids))
        return tuple(input_ids), labels


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
    raise _GroupError("tokenization_error: cannot place the warning prefix in the rendered content")


def _recorded_logprobs(provenance: Any, action_ids: list[int]) -> tuple[tuple[float, ...] | None, str | None]:
    """Behaviour log-probabilities aligned with the action targets, or why there are none."""
    if provenance is None:
        return None, "the completion has no provenance with recorded log-probabilities"
    schema = provenance.get("schema", _ROLLOUT_PROVENANCE)
    if schema != _ROLLOUT_PROVENANCE:
        return None, f"provenance schema {schema!r} is not {_ROLLOUT_PROVENANCE!r}"
    tokens = provenance.get("action_tokens")
    if not isinstance(tokens, list):
        return None, "provenance has no action_tokens list"
    if len(tokens) != len(action_ids):
        return None, f"provenance records {len(tokens)} action tokens but the completion has {len(action_ids)}"
    out = []
    for number, (token, expected) in enumerate(zip(tokens, action_ids, strict=True), start=1):
        if not isinstance(token, dict):
            return None, f"provenance action token {number} is not an object"
        token_id, logprob = token.get("token_id"), token.get("behavior_logprob")
        if isinstance(token_id, bool) or token_id != expected:
            return None, f"provenance action token {number} has token_id {token_id!r}, the tokenized one is {expected}"
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or not math.isfinite(logprob):
            return None, f"provenance action token {number} has no finite behavior_logprob"
        out.append(float(logprob))
    return tuple(out), None
