"""SFT ingestion: JSONL rows or inline examples → tokenized examples with assistant-only
labels, plus the ``kiln.sft-ingestion.v1`` record (spec/40 "SFT", spec/10, spec/20).

Rows
    A row is one non-blank line of the JSONL file (blank = only ASCII whitespace) or one
    inline example; rows are numbered from 1 among non-blank rows. Each line is parsed
    strictly (``kiln.documents.jsonio.parse_json``: UTF-8, no duplicate keys, no NaN). Inline
    examples are serialised to canonical JSON and go through the same parser, so inline and
    file input of the same rows give the same row hashes.

Validation (first failing check wins)
    ``invalid_json``        not strict JSON, or not a JSON object
    ``empty_messages``      ``messages`` missing, not a list, or empty
    ``invalid_role``        a message that is not a well-formed chat message: not an object,
                            role missing or not one of system|user|assistant|tool, content not
                            string|null|list of text parts, or ``tool_calls``/``name``/
                            ``tool_call_id`` of the wrong type (the reason enum has no separate
                            "malformed message" value; the message text says what is wrong)
    ``tokenization_error``  the chat template or tokenizer rejects the row, the template is
                            not prefix-stable for it, fewer than 2 tokens, or no supervised
                            target after the causal shift

Sequence limit
    A row longer than ``max_seq_len`` tokens is handled by ``overlong_row_policy``, whatever
    ``invalid_row_policy`` says (a long row is not an invalid one): ``fail`` refuses the job
    naming the row; ``skip`` drops it as a rejected ``tokenization_error`` row; ``truncate``
    keeps its last ``max_seq_len`` tokens and labels -- the start of the conversation, the
    prompt side, is cut -- and drops it (as ``skip`` does) when no supervised target is left.
    The record's ``sequence_limit`` counts the rows over the limit, truncated and skipped,
    and the tokens (and supervised tokens) truncation removed.

Normalisation and row hashes
    Each message becomes ``{role, content[, tool_calls][, name][, tool_call_id]}``
    (``kiln.data.chat.normalise_message``): content null or absent → ``""``, a list of parts
    (``{"type": "text", "text": ...}`` or plain strings) → their texts joined in order;
    optional fields that are absent or null are omitted; unknown message keys and unknown row
    keys are dropped (the control-plane schema declares them accepted-and-ignored). The
    normalised row ``{"messages": [...]}`` is what the template sees and what
    ``sft_parsed_row_hash`` hashes. A JSON object that cannot be normalised
    (``empty_messages``, ``invalid_role``) is hashed as parsed; a row that is not a JSON
    object gets the raw-row hash of its trimmed line bytes.

Labels (works for any Hugging Face chat template, not only ChatML)
    1. Render the whole conversation ``F`` and, for each assistant turn i, the prefix
       ``P_i = render(m[:i])``, the generation prompt ``G_i = render(m[:i], add_generation_prompt)``
       and ``P_{i+1} = render(m[:i+1])``. Each must be a prefix of ``F`` (else the template is
       not prefix-stable for this row → ``tokenization_error``).
    2. The supervised character span of turn i is ``[len(G_i), len(P_{i+1}))``: the
       assistant header (what the model is prompted with at inference) is masked, and
       everything the template emits for the turn up to where the next prefix ends is
       supervised, i.e. the content, any tool calls, the end-of-turn token and the newline
       after it. Boundaries come from rendering messages, never from searching the text,
       so content that spells a delimiter cannot move them.
    3. Any string in a message (content, name, tool-call fields) that spells a special
       token is swapped for a unique placeholder and the conversation is rendered again;
       splitting that render at the placeholders and matching it against ``F`` gives the
       exact character spans that came from message data (tried as inserted verbatim,
       stripped, or JSON-escaped; no match → ``tokenization_error``; ``kiln.data.chat``).
    4. ``F`` is cut at every span boundary; template pieces are tokenized normally, data
       pieces with ``split_special_tokens=True``; ids are concatenated (no extra BOS/EOS:
       ``add_special_tokens=False``, the template carries its own). Every boundary is a
       token boundary by construction, so a token is supervised exactly when its piece
       lies in a supervised span, and the only special-token ids come from the template.
    5. ``labels[t] = input_ids[t]`` for supervised tokens, else ``-100``, unshifted (the
       trainer shifts); ``supervised_tokens`` counts ``labels[1:] != -100``.

    For ChatML the pieces fall on the tokenizer's own boundaries (special tokens and
    newlines), so ids equal a plain tokenization of ``F`` except where data spells a
    special token. An assistant turn that is the first message has no generation prompt
    to measure its header against and is rejected (``tokenization_error``).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.data.chat import ChatTemplate, InvalidRowError, json_type, normalise_message
from kiln.data.jsonl import dataset_file, file_lines, is_blank, precheck_lines
from kiln.documents.digests import sft_kept_corpus_digest, sft_parsed_row_hash, sft_raw_row_hash
from kiln.documents.jsonio import canonical_json, parse_json
from kiln.errors import KilnError, RequestError

__all__ = [
    "IGNORE_INDEX",
    "OVERLONG_POLICIES",
    "REJECTION_REASONS",
    "SFT_INGESTION_SCHEMA",
    "SftExample",
    "SftIngestion",
    "ingest_sft",
    "precheck_sft_rows",
]

SFT_INGESTION_SCHEMA = "kiln.sft-ingestion.v1"
IGNORE_INDEX = -100
REJECTION_REASONS = ("invalid_json", "empty_messages", "invalid_role", "tokenization_error")
_POLICIES = ("fail", "skip")
OVERLONG_POLICIES = ("fail", "skip", "truncate")
_SOURCES = ("inline", "dataset_path", "named_dataset", "corrections", "recipe", "api")


@dataclass(frozen=True)
class SftExample:
    """One kept row, tokenized. ``labels`` are aligned with ``input_ids`` (not shifted)."""

    row_index: int
    row_sha256: str
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    supervised_tokens: int
    text: str


@dataclass(frozen=True)
class SftIngestion:
    """The kept examples in input order and the ``kiln.sft-ingestion.v1`` record."""

    examples: tuple[SftExample, ...]
    record: dict[str, Any]
    corpus_sha256: str


def ingest_sft(
    *,
    tokenizer: Any,
    examples: Sequence[Any] | None = None,
    dataset_path: str | os.PathLike[str] | None = None,
    invalid_row_policy: str = "fail",
    source: str | None = None,
    source_locator: str | None = None,
    max_seq_len: int | None = None,
    overlong_row_policy: str = "fail",
) -> SftIngestion:
    """Validate, normalise and tokenize SFT rows from exactly one of ``examples`` or ``dataset_path``.

    Under ``fail`` the first invalid row raises ``RequestError`` (``training_invalid_request``)
    naming its 1-based row number, hash and reason; under ``skip`` invalid rows are recorded
    in ``rejected_rows`` and at least one row must be kept. Rows longer than ``max_seq_len``
    follow ``overlong_row_policy`` (module docstring, "Sequence limit").
    """
    if (examples is None) == (dataset_path is None):
        raise RequestError(
            "give exactly one of examples or dataset_path",
            code="training_invalid_request",
            hint="send the conversations inline as examples, or point dataset_path at a JSONL file",
        )
    if invalid_row_policy not in _POLICIES:
        raise RequestError(
            f"invalid_row_policy {invalid_row_policy!r} is not one of fail, skip",
            code="training_invalid_request",
            hint='use "fail" to reject the submission at the first bad row or "skip" to drop bad rows',
        )
    if max_seq_len is not None and (
        isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 2
    ):
        raise RequestError(
            f"max_seq_len must be an integer of at least 2, got {max_seq_len!r}",
            code="training_invalid_request",
            hint="omit max_seq_len to accept rows of any length",
        )
    if overlong_row_policy not in OVERLONG_POLICIES:
        raise RequestError(
            f"overlong_row_policy {overlong_row_policy!r} is not one of {', '.join(OVERLONG_POLICIES)}",
            code="training_invalid_request",
        )
    renderer = _RowTokenizer(tokenizer)  # refuses a tokenizer without a chat template
    limit = _SequenceLimit(max_seq_len, overlong_row_policy)

    if examples is not None:
        if isinstance(examples, (str, bytes, Mapping)) or not isinstance(examples, Sequence):
            raise RequestError(
                f"examples must be a list of conversations, got {type(examples).__name__}",
                code="training_invalid_request",
                hint='send examples as [{"messages": [...]}, ...]',
            )
        source = source or "inline"
        rows: Generator[bytes, None, None] = _inline_rows(examples)
    else:
        path = dataset_file(
            dataset_path,  # type: ignore[arg-type]
            hint='point dataset_path at a JSONL file with one {"messages": [...]} object per line',
        )
        source = source or "dataset_path"
        source_locator = source_locator if source_locator is not None else str(path)
        rows = _file_rows(path)
    if source not in _SOURCES:
        raise RequestError(
            f"source {source!r} is not one of {', '.join(_SOURCES)}",
            code="training_invalid_request",
            hint="leave source unset to record inline or dataset_path",
        )
    if source_locator is not None and (not isinstance(source_locator, str) or not source_locator.strip()):
        raise RequestError(
            "source_locator must be a non-blank string when given",
            code="training_invalid_request",
            hint="omit source_locator when there is nothing to point at",
        )

    with contextlib.closing(rows):
        rows_read, kept, rejected = _read_rows(rows, renderer, invalid_row_policy, source_locator, limit)
    if rows_read == 0:
        raise RequestError(
            f"the SFT input{_where(source_locator)} has no rows",
            code="training_invalid_request",
            hint='give at least one {"messages": [...]} conversation; blank lines are not rows',
        )
    if not kept:
        counts = Counter(row["reason"] for row in rejected)
        by_reason = ", ".join(f"{reason} {counts[reason]}" for reason in REJECTION_REASONS if counts[reason])
        too_long = f", {limit.skipped} of them over max_seq_len {limit.max_seq_len}" if limit.skipped else ""
        raise RequestError(
            f"every row was rejected ({rows_read} rows: {by_reason}{too_long}); nothing is left to train on",
            code="training_invalid_request",
            hint="raise max_seq_len or truncate the long rows (overlong_row_policy)"
            if limit.skipped
            else "fix the rows; each needs at least one assistant turn after a system or user turn",
        )

    kept_hashes = [example.row_sha256 for example in kept]
    corpus = sft_kept_corpus_digest(kept_hashes)
    record: dict[str, Any] = {"schema": SFT_INGESTION_SCHEMA, "source": source}
    if source_locator is not None:
        record["source_locator"] = source_locator
    record.update(
        invalid_row_policy=invalid_row_policy,
        sequence_limit=limit.record(),
        rows_read=rows_read,
        rows_kept=len(kept),
        rows_rejected=len(rejected),
        kept_row_hashes=kept_hashes,
        rejected_rows=rejected,
        kept_corpus_sha256=corpus,
    )
    return SftIngestion(examples=tuple(kept), record=record, corpus_sha256=corpus)


def _read_rows(
    rows: Iterator[bytes], renderer: _RowTokenizer, policy: str, locator: str | None, limit: _SequenceLimit
) -> tuple[int, list[SftExample], list[dict[str, Any]]]:
    kept: list[SftExample] = []
    rejected: list[dict[str, Any]] = []
    rows_read = 0
    for index, line in enumerate(rows, start=1):
        rows_read = index
        row_hash = None
        try:
            value = _parse_row(line)
            row_hash = sft_parsed_row_hash(value)  # hashed as parsed until the row normalises
            messages = _normalise_messages(value)
            row_hash = sft_parsed_row_hash({"messages": messages})
            text, input_ids, labels = renderer.tokenize(messages)
        except InvalidRowError as bad:
            row_hash = row_hash or sft_raw_row_hash(line)
            if policy == "fail":
                raise _row_refusal(index, row_hash, bad, locator) from None
            rejected.append({"row_index": index, "row_sha256": row_hash, "reason": bad.reason})
            continue
        fitted = limit.fit(index, row_hash, input_ids, labels, locator)
        if fitted is None:
            rejected.append({"row_index": index, "row_sha256": row_hash, "reason": "tokenization_error"})
            continue
        input_ids, labels = fitted
        supervised = sum(1 for label in labels[1:] if label != IGNORE_INDEX)
        kept.append(SftExample(index, row_hash, input_ids, labels, supervised, text))
    return rows_read, kept, rejected


def _row_refusal(index: int, row_hash: str, bad: InvalidRowError, locator: str | None) -> RequestError:
    return RequestError(
        f"row {index} ({row_hash}) is invalid: {bad.reason}: {bad.detail}",
        code="training_invalid_request",
        hint=f'fix row {index}{_where(locator)}, or set invalid_row_policy to "skip" '
        "to train on the valid rows and record the rejected ones",
    )


def precheck_sft_rows(path: str | os.PathLike[str], *, invalid_row_policy: str = "fail") -> int:
    """The rows of a JSONL file checked as far as they can be without a tokenizer -- JSON, an object, a non-empty
    ``messages`` array of well-formed messages -- so a command line refuses a bad row before it loads torch or a
    model, as ``PATH line N: ...`` (``kiln.data.jsonl.precheck_lines``). ``skip`` refuses nothing here: ingestion
    records what it skips. Returns the rows read."""
    source = dataset_file(path, hint='point the file at JSON lines, one {"messages": [...]} object per line')
    if invalid_row_policy != "fail":
        with contextlib.closing(_file_rows(source)) as rows:
            return sum(1 for _ in rows)

    def check(value: Any, _: int) -> None:
        if not isinstance(value, dict):
            raise InvalidRowError("invalid_json", f"a row must be a JSON object, got {json_type(value)}")
        _normalise_messages(value)

    return precheck_lines(
        source,
        check,
        refused=(InvalidRowError,),
        fix=lambda number: (
            f'fix line {number} of {source}, or set invalid_row_policy to "skip" to train on the '
            "valid rows and record the rejected ones"
        ),
    )


def _where(locator: str | None) -> str:
    return f" of {locator}" if locator else ""


class _SequenceLimit:
    """``max_seq_len`` and ``overlong_row_policy`` applied to tokenized rows, with the record's counts."""

    def __init__(self, max_seq_len: int | None, policy: str):
        self.max_seq_len, self.policy = max_seq_len, policy
        self.over = self.truncated = self.skipped = self.tokens = self.supervised = 0

    def fit(
        self, index: int, row_hash: str, input_ids: tuple[int, ...], labels: tuple[int, ...], locator: str | None
    ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """The row within the limit (truncated when the policy says so), or None when it is dropped."""
        limit = self.max_seq_len
        if limit is None or len(input_ids) <= limit:
            return input_ids, labels
        self.over += 1
        if self.policy == "fail":
            raise RequestError(
                f"row {index} ({row_hash}) is invalid: tokenization_error: the conversation is {len(input_ids)} "
                f"tokens, over max_seq_len {limit}",
                code="training_invalid_request",
                hint=f"shorten row {index}{_where(locator)}, raise max_seq_len (at most the model's context "
                'length), or set overlong_row_policy to "truncate" (keep its last tokens) or "skip"',
            )
        cut = len(input_ids) - limit
        kept_ids, kept_labels = input_ids[cut:], labels[cut:]
        before = sum(1 for label in labels[1:] if label != IGNORE_INDEX)
        after = sum(1 for label in kept_labels[1:] if label != IGNORE_INDEX)
        if self.policy == "skip" or after == 0:
            self.skipped += 1
            return None
        self.truncated += 1
        self.tokens += cut
        self.supervised += before - after
        return kept_ids, kept_labels

    def record(self) -> dict[str, Any]:
        return {
            "max_seq_len": self.max_seq_len,
            "overlong_row_policy": self.policy,
            "rows_over": self.over,
            "rows_truncated": self.truncated,
            "rows_skipped": self.skipped,
            "tokens_truncated": self.tokens,
            "supervised_tokens_truncated": self.supervised,
        }


# --- rows -------------------------------------------------------------------------------


def _file_rows(path: Path) -> Generator[bytes, None, None]:
    """Non-blank lines of a JSONL file, read in binary one line at a time."""
    with contextlib.closing(file_lines(path)) as lines:
        for line in lines:
            if not is_blank(line):
                yield line


def _inline_rows(examples: Sequence[Any]) -> Generator[bytes, None, None]:
    """Inline examples as canonical JSON lines, so they take the file path's parser."""
    for example in examples:
        try:
            yield canonical_json(example)
        except (TypeError, ValueError):  # not representable as strict JSON (NaN, odd types)
            yield repr(example).encode("utf-8", "backslashreplace")


def _parse_row(line: bytes) -> dict[str, Any]:
    try:
        value = parse_json(line, limit=max(len(line), 1))
    except KilnError as exc:
        raise InvalidRowError("invalid_json", exc.message) from None
    if not isinstance(value, dict):
        raise InvalidRowError("invalid_json", f"a row must be a JSON object, got {json_type(value)}")
    return value


def _normalise_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = row.get("messages")
    if "messages" not in row:
        raise InvalidRowError("empty_messages", 'the row has no "messages"')
    if not isinstance(messages, list):
        raise InvalidRowError("empty_messages", f'"messages" must be an array, got {json_type(messages)}')
    if not messages:
        raise InvalidRowError("empty_messages", '"messages" is empty')
    return [normalise_message(number, message) for number, message in enumerate(messages, start=1)]


# --- labels -----------------------------------------------------------------------------


class _RowTokenizer:
    """Renders one normalised conversation and tokenizes it with assistant-only labels."""

    def __init__(self, tokenizer: Any):
        self.template = ChatTemplate(tokenizer)

    def tokenize(self, messages: list[dict[str, Any]]) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        render = self.template.prefixes(messages)
        full = render(len(messages))
        supervised = self._assistant_spans(messages, full, render)
        located = self.template.locate(messages, full)
        if located is None:
            raise InvalidRowError(
                "tokenization_error",
                "message text spells a special token and the chat template does not insert it verbatim, "
                "so it cannot be kept apart from the template's own delimiters",
            )
        input_ids, flags = self.template.encode(full, [(s, e, True) for s, e in supervised], located[1], False)
        labels = tuple(i if flag else IGNORE_INDEX for i, flag in zip(input_ids, flags, strict=True))
        if len(input_ids) < 2:
            raise InvalidRowError(
                "tokenization_error", f"the conversation is {len(input_ids)} token(s); at least 2 are needed"
            )
        if all(label == IGNORE_INDEX for label in labels[1:]):
            raise InvalidRowError(
                "tokenization_error",
                "no assistant token is supervised; a row needs an assistant turn after the first message",
            )
        return full, input_ids, labels

    @staticmethod
    def _assistant_spans(messages: list[dict[str, Any]], full: str, render: Any) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            if i == 0:
                raise InvalidRowError(
                    "tokenization_error",
                    "message 1 is an assistant turn; its header cannot be measured without a preceding turn",
                )
            prefix, prompt, through = render(i), render(i, True), render(i + 1)
            for text in (prefix, prompt, through):
                if not full.startswith(text):
                    raise InvalidRowError(
                        "tokenization_error",
                        f"the chat template renders a prefix of the conversation around message {i + 1} differently "
                        "from the whole conversation, so labels cannot be derived",
                    )
            start, end = len(prompt), len(through)
            if start == len(prefix) or start > end or (spans and start < spans[-1][1]):
                raise InvalidRowError(
                    "tokenization_error",
                    f"the chat template's generation prompt does not match the header of assistant message {i + 1}",
                )
            if start < end:
                spans.append((start, end))
        return spans
