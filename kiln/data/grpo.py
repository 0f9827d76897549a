"""GRPO ingestion: scored groups, inline or from a pinned JSONL file → tokenized completions
with action and observation masks (spec/40 "GRPO"). No model forward pass happens here.

Longer than 600 lines: one reader of GRPO groups for every route -- inline, the streamed file, an online run's
growing rollout log (``OnlineLog``) -- with the trajectory rules, the recorded-provenance rules and the sampled-ids
rule side by side, since each route must tokenize a group exactly as the others do.

API
    ``read_groups(*, tokenizer, groups=None, agentic_groups=None, dataset_path=None,
    warning_filter=True, behavior_policy="no_importance_correction") -> GrpoIngestion``
        Exactly one source: inline ``groups`` (or its alias ``agentic_groups``) or a JSONL
        ``dataset_path``. Every group is checked and tokenized; the first bad one is refused.
    ``OnlineLog(tokenizer=, warning_filter=, path=)`` / ``online_ingestion(values, ...)``
        An online GRPO run's rollout log, read group by group as it grows, with its cursor.
    ``refused_ingestion(dataset_path, sha256)``
        No groups from a pinned file: what a dry run whose data was refused records.
    ``iter_dataset_groups(*, tokenizer, dataset_path, ..., expected_sha256=None)``
        The streamed pass over a JSONL file, one ``(GrpoGroup, GrpoSourcePosition)`` at a
        time (what a training pass reads; ``read_groups`` collects it). With
        ``expected_sha256`` the bytes read are compared with the pin once the file ends
        (``kiln.data.jsonl.check_unchanged``).
    ``GrpoIngestion`` carries the groups, the receipt's ``training_data`` (``source``
    ``inline_grpo_groups`` | ``jsonl_grpo_groups``, or ``jsonl_grpo_groups_dry_run`` via
    ``training_data(dry_run=True)``; ``path``; ``sha256``), the checkpoint ``route``
    (``inline`` | ``jsonl``), per-group stream positions and ``GrpoCounts`` (whose
    ``token_counts()`` has the receipt's ``token_counts`` layout).

Groups
    A group is one inline list item or one non-blank line of the file (blank = only ASCII
    whitespace; blank lines are not groups but are counted and hashed as consumed lines).
    Lines are parsed strictly (``kiln.documents.jsonio.parse_json``: UTF-8, no duplicate keys, no
    NaN/Infinity). Inline groups are checked for non-finite numbers, serialised to canonical
    JSON and parsed back, so both routes see the same plain JSON values. Each group is then
    validated as an ``AgenticGroup``: it is not a contract entry point, so the group is
    wrapped as ``{"groups": [group]}`` and validated against ``GrpoRequest`` (the pointer is
    mapped back). ``completions`` and its alias ``rollouts`` are checked first (exactly one)
    so that mistake gets a plain message. Message roles follow SFT (``system``, ``user``,
    ``assistant``, ``tool``; messages are normalised by ``kiln.data.chat``). Refusals of a group
    or of a file without groups are ``TrainingDataError`` (``training_invalid_request``, with
    the receipt category a dry run records as ``reason``) naming the group (1-based), for files
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

Rendering and masks (any Hugging Face chat template that is prefix-stable;
``kiln.data.trajectory`` does steps 1-3)
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

Sampled token ids
    A plain-text completion whose provenance (rollout-provenance v1) lists action token ids that spell exactly
    what the text's tokenization of its action block spells (decoded with every token kept, nothing cleaned up)
    is trained on those ids: the ids the behaviour policy sampled, where re-tokenizing the text would split a
    sampled word otherwise. Ids that spell something else leave the text's tokenization (and, with
    ``behavior_policy="recorded"``, refuse the completion as misaligned).

Recorded behaviour log-probabilities
    From ``provenance.action_tokens[*].behavior_logprob`` (rollout-provenance v1 layout),
    one per action target in order, and only when that list matches the tokenized action
    tokens (same count, same ``token_id``s). With ``behavior_policy="recorded"`` a missing or
    misaligned provenance refuses the completion; otherwise ``recorded_logprobs`` is None.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.data.chat import json_type
from kiln.data.jsonl import check_unchanged, dataset_file, file_lines, is_blank, precheck_lines
from kiln.data.trajectory import (
    ACTION,
    PROMPT,
    ItemError,
    TrajectoryTokenizer,
    check_item,
    inline_value,
    normalised_messages,
    parse_line,
    segments,
)
from kiln.documents.digests import json_sha256, prefixed
from kiln.errors import RequestError, TrainingDataError

__all__ = [
    "BEHAVIOR_POLICIES",
    "GRPO_SOURCES",
    "SEGMENT_KINDS",
    "GrpoCompletion",
    "GrpoCounts",
    "GrpoGroup",
    "GrpoIngestion",
    "GrpoSourcePosition",
    "OnlineLog",
    "iter_dataset_groups",
    "online_ingestion",
    "read_groups",
    "rollout_log_lines",
    "spelled",
]

GRPO_SOURCES = ("inline_grpo_groups", "jsonl_grpo_groups", "jsonl_grpo_groups_dry_run", "online_grpo_tasks")
SEGMENT_KINDS = ("context", "action", "observation")
BEHAVIOR_POLICIES = ("no_importance_correction", "recorded")
_ROLLOUT_PROVENANCE = "kiln.rollout-provenance.v1"
_FILE_HINT = "point dataset_path at a JSONL file with one group per line"


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
        path = dataset_file(dataset_path, hint=_FILE_HINT)
        read: list[GrpoGroup] = []
        positions: list[GrpoSourcePosition] = []
        hasher = hashlib.sha256()
        renderer = _GroupReader(tokenizer, warning_filter, behavior_policy)
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
    renderer = _GroupReader(tokenizer, warning_filter, behavior_policy)
    parsed: list[Any] = []
    read = []
    for index, value in enumerate(values):
        try:
            plain = inline_value(value)
            parsed.append(plain)
            read.append(renderer.group(index, plain))
        except ItemError as bad:
            raise TrainingDataError(
                f"group {index + 1} is invalid: {bad.detail}",
                reason=bad.reason,
                hint=f"fix group {index + 1} of {name}; every group needs messages and 1 to 1024 scored "
                "completions, each with at least one action token",
                pointer=f"/{name}/{index}{bad.pointer}",
            ) from None
    return _ingestion(read, "inline_grpo_groups", "inline", None, json_sha256(parsed), [])


ONLINE_SOURCE = "online_grpo_tasks"


class OnlineLog:
    """An online GRPO run's rollout log as it grows: each group (one per task visit, as the JSON object of its log
    line) read once by the GRPO reader with ``behavior_policy="recorded"``, and the log's cursor after each line
    kept incrementally (bytes, lines, the digest of the line digests); ``ingestion()`` is the log so far."""

    def __init__(self, *, tokenizer: Any, warning_filter: bool, path: str | None) -> None:
        self._reader = _GroupReader(tokenizer, warning_filter, "recorded")
        self.path = path
        self.values: list[Any] = []
        self.lines: list[bytes] = []
        self.groups: list[GrpoGroup] = []
        self.positions: list[GrpoSourcePosition] = []
        self._offset = 0
        self._consumed = hashlib.sha256(b"[")  # canonical JSON of the list of line digests, built incrementally

    def extend(self, values: Sequence[Any]) -> list[GrpoGroup]:
        """Append ``values`` (in task-visit order); returns their groups."""
        added = []
        for value, line in zip(values, rollout_log_lines(values), strict=True):
            index = len(self.groups)
            try:
                group = self._reader.group(index, value)
            except ItemError as bad:
                raise TrainingDataError(
                    f"online group {index + 1} is invalid: {bad.detail}", reason=bad.reason, pointer=bad.pointer
                ) from None
            self._consumed.update(b'"' if index == 0 else b',"')
            self._consumed.update(prefixed(hashlib.sha256(line).hexdigest()).encode("ascii") + b'"')
            snapshot = self._consumed.copy()
            snapshot.update(b"]")
            self._offset += len(line)
            self.positions.append(
                GrpoSourcePosition(index + 1, self._offset, index + 1, prefixed(snapshot.hexdigest()))
            )
            self.values.append(value)
            self.lines.append(line)
            self.groups.append(group)
            added.append(group)
        return added

    def data(self) -> bytes:
        """The log's bytes so far."""
        return b"".join(self.lines)

    def ingestion(self) -> GrpoIngestion:
        digest = self.positions[-1].consumed_lines_sha256 if self.positions else json_sha256([])
        return _ingestion(list(self.groups), ONLINE_SOURCE, "online", self.path, digest, list(self.positions))


def online_ingestion(values: Sequence[Any], *, tokenizer: Any, warning_filter: bool, path: str | None) -> GrpoIngestion:
    """The ingestion of an online run's rollout log ``values`` (``OnlineLog`` read in one go)."""
    log = OnlineLog(tokenizer=tokenizer, warning_filter=warning_filter, path=path)
    log.extend(values)
    return log.ingestion()


def rollout_log_lines(values: Sequence[Any]) -> list[bytes]:
    """An online run's rollout log, one canonical JSON line per group (what its checkpoints and adapter hold)."""
    from kiln.documents.jsonio import canonical_json

    return [canonical_json(value) + b"\n" for value in values]


def refused_ingestion(dataset_path: str | os.PathLike[str], sha256: str) -> GrpoIngestion:
    """No groups from the JSONL file at ``dataset_path`` pinned at ``sha256``: what a dry run whose data was refused
    records (its receipt's ``training_data`` names the file and the pin)."""
    return _ingestion([], "jsonl_grpo_groups", "jsonl", str(dataset_file(dataset_path, hint=_FILE_HINT)), sha256, [])


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
    path = dataset_file(dataset_path, hint=_FILE_HINT)
    renderer = _GroupReader(tokenizer, warning_filter, behavior_policy)

    def stream() -> Iterator[tuple[GrpoGroup, GrpoSourcePosition]]:
        hasher = hashlib.sha256()
        yield from _file_groups(path, renderer, hasher)
        if expected_sha256 is not None:
            check_unchanged(path, expected_sha256, now=hasher.hexdigest())

    return stream()


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


def _file_groups(path: Path, renderer: _GroupReader, hasher: Any) -> Iterator[tuple[GrpoGroup, GrpoSourcePosition]]:
    """Groups of a JSONL file with their cursor; ``hasher`` sees every byte read."""
    consumed = hashlib.sha256(b"[")  # canonical JSON of the list of line digests, built incrementally
    offset = lines = index = 0
    with contextlib.closing(file_lines(path)) as physical:
        for line in physical:
            hasher.update(line)
            consumed.update(b'"' if lines == 0 else b',"')
            consumed.update(prefixed(hashlib.sha256(line).hexdigest()).encode("ascii") + b'"')
            offset += len(line)
            lines += 1
            if is_blank(line):
                continue
            try:
                group = renderer.group(index, parse_line(line))
            except ItemError as bad:
                raise TrainingDataError(
                    f"line {lines} (group {index + 1}) of {str(path)!r} is invalid: {bad.detail}",
                    reason=bad.reason,
                    hint=f"fix line {lines} of the file; every line is one group with messages and 1 to 1024 "
                    "scored completions, each with at least one action token",
                    pointer=bad.pointer,
                ) from None
            snapshot = consumed.copy()
            snapshot.update(b"]")
            yield group, GrpoSourcePosition(lines, offset, lines, prefixed(snapshot.hexdigest()))
            index += 1
    if index == 0:
        raise TrainingDataError(
            f"dataset_path {str(path)!r} has no groups",
            reason="zero_groups",
            hint="write one group per line; blank lines are not groups",
        )


def precheck_grpo_groups(path: str | os.PathLike[str]) -> int:
    """The groups of a JSONL file checked as far as they can be without a tokenizer -- JSON, the group's schema,
    its messages, finite rewards -- so a command line refuses a bad line before it loads torch or a model
    (``kiln.data.jsonl.precheck_lines``). Returns the groups read; a file without one is refused."""
    source = dataset_file(path, hint="point the file at JSON lines, one group per line")

    def check(value: Any, _: int) -> None:
        inline_value(value)  # every number finite
        key = _check_shape(value)
        normalised_messages(value["messages"])
        for number, rollout in enumerate(value[key]):
            if not math.isfinite(float(rollout["reward"])):
                raise ItemError(f"completion {number + 1}: reward: too large for a 64-bit float")

    groups = precheck_lines(
        source,
        check,
        refused=(ItemError, OverflowError),
        fix=lambda number: (
            f"fix line {number} of {source}; every line is one group with messages and 1 to 1024 "
            "scored completions, each with at least one action token"
        ),
    )
    if groups == 0:
        raise TrainingDataError(
            f"dataset_path {str(source)!r} has no groups",
            reason="zero_groups",
            hint="write one group per line; blank lines are not groups",
        )
    return groups


# --- one group --------------------------------------------------------------------------


class _GroupReader:
    """Checks one parsed group and tokenizes its completions with action/observation masks."""

    def __init__(self, tokenizer: Any, warning_filter: bool, behavior_policy: str):
        if behavior_policy not in BEHAVIOR_POLICIES:
            raise RequestError(
                f"behavior_policy {behavior_policy!r} is not one of {', '.join(BEHAVIOR_POLICIES)}",
                code="training_invalid_request",
                hint="leave behavior_policy unset for no_importance_correction",
            )
        self.tokens = TrajectoryTokenizer(tokenizer, warning_filter)
        self.tokenizer = tokenizer
        self.recorded = behavior_policy == "recorded"

    def group(self, index: int, value: Any) -> GrpoGroup:
        rollouts_key = _check_shape(value)
        messages = normalised_messages(value["messages"])
        prompt = self.tokens.prompt(messages)
        prompt_ids: tuple[int, ...] | None = None
        completions = []
        for number, rollout in enumerate(value[rollouts_key]):
            pointer = f"/{rollouts_key}/{number}"
            try:
                completion, prompt_tokens = self._completion(number, rollout, messages, prompt)
            except ItemError as bad:
                raise ItemError(
                    f"completion {number + 1}: {bad.detail}", pointer + bad.pointer, reason=bad.reason
                ) from None
            ids = completion.input_ids[:prompt_tokens]
            if prompt_ids is None:
                prompt_ids = ids
            elif ids != prompt_ids:
                raise ItemError(
                    f"completion {number + 1}: tokenization_error: its prompt tokens differ from completion 1's",
                    pointer,
                )
            completions.append(completion)
        assert prompt_ids is not None  # the schema guarantees at least one completion
        return GrpoGroup(index, json_sha256(value), len(prompt_ids), tuple(completions))

    def _completion(
        self, number: int, rollout: dict[str, Any], messages: list[dict[str, Any]], prompt: str
    ) -> tuple[GrpoCompletion, int]:
        try:
            reward = float(rollout["reward"])
        except OverflowError:
            reward = math.inf
        if not math.isfinite(reward):
            raise ItemError("reward: too large for a 64-bit float", "/reward")
        from_text = "trajectory" not in rollout
        input_ids, labels = self.tokens.completion(messages, segments(rollout), prompt, from_text=from_text)
        if from_text:
            input_ids, labels = self._as_sampled(rollout.get("provenance"), input_ids, labels)
        return self._masks(number, rollout, input_ids, labels), labels.count(PROMPT)

    def _as_sampled(
        self, provenance: Any, input_ids: tuple[int, ...], labels: list[int]
    ) -> tuple[tuple[int, ...], list[int]]:
        """A text completion's ids with its action block replaced by the token ids its provenance records, when
        those spell exactly what the text's own tokenization spells (``spelled``): the ids the behaviour policy
        sampled, which a byte-level tokenizer may split otherwise when it re-tokenizes the text."""
        recorded = _provenance_ids(provenance, len(self.tokenizer))
        block = [i for i, label in enumerate(labels) if label == ACTION]
        if recorded is None or not block or block != list(range(block[0], block[-1] + 1)):
            return input_ids, labels
        start, end = block[0], block[-1] + 1
        if list(input_ids[start:end]) == recorded or spelled(self.tokenizer, recorded) != spelled(
            self.tokenizer, input_ids[start:end]
        ):
            return input_ids, labels
        return (
            (*input_ids[:start], *recorded, *input_ids[end:]),
            [*labels[:start], *([ACTION] * len(recorded)), *labels[end:]],
        )

    def _masks(
        self,
        number: int,
        rollout: dict[str, Any],
        input_ids: tuple[int, ...],
        labels: list[int],
    ) -> GrpoCompletion:
        targets = labels[1:]
        action_mask = tuple(label == ACTION for label in targets)
        observation_mask, warning_tokens = self.tokens.observations(targets)
        action_ids = [input_ids[t + 1] for t, active in enumerate(action_mask) if active]
        provenance = rollout.get("provenance")
        logprobs, problem = _recorded_logprobs(provenance, action_ids)
        if self.recorded and problem is not None:
            raise ItemError(f"behavior_policy recorded: {problem}", "/provenance")
        return GrpoCompletion(
            index=number,
            reward=float(rollout["reward"]),
            input_ids=input_ids,
            action_mask=action_mask,
            observation_mask=observation_mask,
            recorded_logprobs=logprobs,
            action_tokens=sum(action_mask),
            observation_tokens=sum(observation_mask),
            warning_tokens=warning_tokens,
            provenance=provenance,
        )


def _check_shape(value: Any) -> str:
    """The group's completions key, once the group is a schema-valid ``AgenticGroup``."""
    if not isinstance(value, dict):
        raise ItemError(f"a group must be a JSON object, got {json_type(value)}")
    present = [key for key in ("completions", "rollouts") if key in value]
    if len(present) != 1:
        raise ItemError(
            "a group has completions or its alias rollouts, not both"
            if present
            else 'a group needs "completions" (or its alias "rollouts")'
        )
    check_item("GrpoRequest", "groups", value, whole="the group")
    return present[0]


def spelled(tokenizer: Any, ids: Sequence[int]) -> str:
    """The text ``ids`` decode to, every token kept and nothing cleaned up: what two tokenizations of one text
    share."""
    return str(tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _provenance_ids(provenance: Any, vocabulary: int) -> list[int] | None:
    """The action token ids a rollout-provenance v1 record lists, when it lists valid ones."""
    if not isinstance(provenance, dict) or provenance.get("schema", _ROLLOUT_PROVENANCE) != _ROLLOUT_PROVENANCE:
        return None
    tokens = provenance.get("action_tokens")
    if not isinstance(tokens, list) or not tokens:
        return None
    ids = [t.get("token_id") if isinstance(t, dict) else None for t in tokens]
    if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocabulary for i in ids):
        return None
    return ids  # type: ignore[return-value]


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
