"""SFT ingestion: JSONL rows or inline examples → tokenized examples with assistant-only
labels, plus the ``kiln.sft-ingestion.v1`` record (spec/40 "SFT", spec/10, spec/20).

Rows
    A row is one non-blank line of the JSONL file (blank = only ASCII whitespace) or one
    inline example; rows are numbered from 1 among non-blank rows. Each line is parsed
    strictly (``kiln._jsonio.parse_json``: UTF-8, no duplicate keys, no NaN). Inline
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
                            not prefix-stable for it, fewer than 2 tokens, longer than
                            ``max_seq_len``, or no supervised target after the causal shift

Normalisation and row hashes
    Each message becomes ``{role, content[, tool_calls][, name][, tool_call_id]}``: content
    null or absent → ``""``, a list of parts (``{"type": "text", "text": ...}`` or plain
    strings) → their texts joined in order; optional fields that are absent or null are
    omitted; unknown message keys and unknown row keys are dropped (the control-plane schema
    declares them accepted-and-ignored). The normalised row ``{"messages": [...]}`` is what
    the template sees and what ``sft_parsed_row_hash`` hashes. A JSON object that cannot be
    normalised (``empty_messages``, ``invalid_role``) is hashed as parsed; a row that is not
    a JSON object gets the raw-row hash of its trimmed line bytes.

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
       stripped, or JSON-escaped; no match → ``tokenization_error``).
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
import itertools
import json
import os
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln._jsonio import canonical_json, parse_json
from kiln.digests import sft_kept_corpus_digest, sft_parsed_row_hash, sft_raw_row_hash
from kiln.errors import KilnError, RequestError

__all__ = [
    "IGNORE_INDEX",
    "REJECTION_REASONS",
    "ROLES",
    "SFT_INGESTION_SCHEMA",
    "SftExample",
    "SftIngestion",
    "ingest_sft",
]

SFT_INGESTION_SCHEMA = "kiln.sft-ingestion.v1"
IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")
REJECTION_REASONS = ("invalid_json", "empty_messages", "invalid_role", "tokenization_error")
_POLICIES = ("fail", "skip")
_SOURCES = ("inline", "dataset_path", "named_dataset", "corrections", "recipe", "api")
_ASCII_WS = b" \t\n\r\x0b\x0c"
_OPTIONAL_STRING_FIELDS = ("name", "tool_call_id")


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


class _InvalidRowError(Exception):
    """Internal: why one row is rejected (never escapes this module)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def ingest_sft(
    *,
    tokenizer: Any,
    examples: Sequence[Any] | None = None,
    dataset_path: str | os.PathLike[str] | None = None,
    invalid_row_policy: str = "fail",
    source: str | None = None,
    source_locator: str | None = None,
    max_seq_len: int | None = None,
) -> SftIngestion:
    """Validate, normalise and tokenize SFT rows from exactly one of ``examples`` or ``dataset_path``.

    Under ``fail`` the first invalid row raises ``RequestError`` (``training_invalid_request``)
    naming its 1-based row number, hash and reason; under ``skip`` invalid rows are recorded
    in ``rejected_rows`` and at least one row must be kept.
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
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError(
            "the model's tokenizer has no chat template, so conversations cannot be rendered",
            code="training_invalid_request",
            hint="use a chat model whose tokenizer_config.json carries a chat_template",
        )

    if examples is not None:
        if isinstance(examples, (str, bytes, Mapping)) or not isinstance(examples, Sequence):
            raise RequestError(
                f"examples must be a list of conversations, got {type(examples).__name__}",
                code="training_invalid_request",
                hint='send examples as [{"messages": [...]}, ...]',
            )
        source = source or "inline"
        rows: Iterator[bytes] = _inline_rows(examples)
    else:
        path = Path(os.path.abspath(os.fspath(dataset_path)))  # type: ignore[arg-type]
        if not path.is_file():
            raise RequestError(
                f"dataset_path {str(path)!r} is not a readable file",
                code="training_invalid_request",
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
        rows_read, kept, rejected = _read_rows(
            rows, _RowTokenizer(tokenizer, max_seq_len), invalid_row_policy, source_locator
        )
    if rows_read == 0:
        raise RequestError(
            f"the SFT input{_where(source_locator)} has no rows",
            code="training_invalid_request",
            hint='give at least one {"messages": [...]} conversation; blank lines are not rows',
        )
    if not kept:
        counts = Counter(row["reason"] for row in rejected)
        by_reason = ", ".join(f"{reason} {counts[reason]}" for reason in REJECTION_REASONS if counts[reason])
        raise RequestError(
            f"every row was rejected ({rows_read} rows: {by_reason}); nothing is left to train on",
            code="training_invalid_request",
            hint="fix the rows; each needs at least one assistant turn after a system or user turn",
        )

    kept_hashes = [example.row_sha256 for example in kept]
    corpus = sft_kept_corpus_digest(kept_hashes)
    record: dict[str, Any] = {"schema": SFT_INGESTION_SCHEMA, "source": source}
    if source_locator is not None:
        record["source_locator"] = source_locator
    record.update(
        invalid_row_policy=invalid_row_policy,
        rows_read=rows_read,
        rows_kept=len(kept),
        rows_rejected=len(rejected),
        kept_row_hashes=kept_hashes,
        rejected_rows=rejected,
        kept_corpus_sha256=corpus,
    )
    return SftIngestion(examples=tuple(kept), record=record, corpus_sha256=corpus)


def _read_rows(
    rows: Iterator[bytes], renderer: _RowTokenizer, policy: str, locator: str | None
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
        except _InvalidRowError as bad:
            row_hash = row_hash or sft_raw_row_hash(line)
            if policy == "fail":
                raise RequestError(
                    f"row {index} ({row_hash}) is invalid: {bad.reason}: {bad.detail}",
                    code="training_invalid_request",
                    hint=f'fix row {index}{_where(locator)}, or set invalid_row_policy to "skip" '
                    "to train on the valid rows and record the rejected ones",
                ) from None
            rejected.append({"row_index": index, "row_sha256": row_hash, "reason": bad.reason})
            continue
        supervised = sum(1 for label in labels[1:] if label != IGNORE_INDEX)
        kept.append(SftExample(index, row_hash, input_ids, labels, supervised, text))
    return rows_read, kept, rejected


def _where(locator: str | None) -> str:
    return f" of {locator}" if locator else ""


# --- rows -------------------------------------------------------------------------------


def _file_rows(path: Path) -> Iterator[bytes]:
    """Non-blank lines of a JSONL file, read in binary one line at a time."""
    try:
        with path.open("rb") as fh:
            for line in fh:
                if line.strip(_ASCII_WS):
                    yield line
    except OSError as exc:
        raise RequestError(
            f"cannot read dataset_path {str(path)!r}: {exc.strerror or exc}",
            code="training_invalid_request",
            hint="check that the file exists and is readable by the Kiln process",
        ) from None


def _inline_rows(examples: Sequence[Any]) -> Iterator[bytes]:
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
        raise _InvalidRowError("invalid_json", exc.message) from None
    if not isinstance(value, dict):
        raise _InvalidRowError("invalid_json", f"a row must be a JSON object, got {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _normalise_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = row.get("messages")
    if "messages" not in row:
        raise _InvalidRowError("empty_messages", 'the row has no "messages"')
    if not isinstance(messages, list):
        raise _InvalidRowError("empty_messages", f'"messages" must be an array, got {_json_type(messages)}')
    if not messages:
        raise _InvalidRowError("empty_messages", '"messages" is empty')
    return [_normalise_message(number, message) for number, message in enumerate(messages, start=1)]


def _normalise_message(number: int, message: Any) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise _InvalidRowError("invalid_role", f"message {number} must be an object, got {_json_type(message)}")
    role = message.get("role")
    if role not in ROLES:
        found = "has no role" if role is None else f"has role {role!r}"
        raise _InvalidRowError("invalid_role", f"message {number} {found}; roles are {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _content_text(number, message.get("content"))}
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise _InvalidRowError(
                "invalid_role", f"message {number} tool_calls must be an array or null, got {_json_type(tool_calls)}"
            )
        out["tool_calls"] = tool_calls
    for field in _OPTIONAL_STRING_FIELDS:
        value = message.get(field)
        if value is not None:
            if not isinstance(value, str):
                raise _InvalidRowError(
                    "invalid_role", f"message {number} {field} must be a string or null, got {_json_type(value)}"
                )
            out[field] = value
    return out


def _content_text(number: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _InvalidRowError(
            "invalid_role",
            f"message {number} content must be a string, null or a list of text parts, got {_json_type(content)}",
        )
    texts = []
    for part_number, part in enumerate(content, start=1):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise _InvalidRowError(
                "invalid_role",
                f'message {number} content part {part_number} is not a text part ({{"type": "text", "text": "..."}} '
                "or a string); only text can be trained on",
            )
    return "".join(texts)


# --- rendering and labels ---------------------------------------------------------------


def _template_errors() -> tuple[type[BaseException], ...]:
    """What a chat template or tokenizer raises when it refuses a conversation."""
    import jinja2

    return (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class _RowTokenizer:
    """Renders one normalised conversation and tokenizes it with assistant-only labels."""

    def __init__(self, tokenizer: Any, max_seq_len: int | None):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.errors = _template_errors()
        specials = {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
        for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
            if getattr(token, "special", False):
                specials.add(str(token.content))
        self.specials = tuple(sorted(s for s in specials if s))

    def tokenize(self, messages: list[dict[str, Any]]) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        renders: dict[tuple[int, bool], str] = {}

        def render(count: int, generation: bool = False) -> str:
            key = (count, generation)
            if key not in renders:
                try:
                    text = self.tokenizer.apply_chat_template(
                        messages[:count], tokenize=False, add_generation_prompt=generation
                    )
                except self.errors as exc:
                    raise _InvalidRowError(
                        "tokenization_error", f"the chat template rejected the conversation: {exc}"
                    ) from None
                if not isinstance(text, str):
                    raise _InvalidRowError("tokenization_error", "the chat template did not render text")
                renders[key] = text
            return renders[key]

        full = render(len(messages))
        supervised = self._assistant_spans(messages, full, render)
        data = self._data_spans(messages, full)
        input_ids, labels = self._encode(full, supervised, data)
        if len(input_ids) < 2:
            raise _InvalidRowError(
                "tokenization_error", f"the conversation is {len(input_ids)} token(s); at least 2 are needed"
            )
        if self.max_seq_len is not None and len(input_ids) > self.max_seq_len:
            raise _InvalidRowError(
                "tokenization_error",
                f"the conversation is {len(input_ids)} tokens, over max_seq_len {self.max_seq_len}",
            )
        if all(label == IGNORE_INDEX for label in labels[1:]):
            raise _InvalidRowError(
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
                raise _InvalidRowError(
                    "tokenization_error",
                    "message 1 is an assistant turn; its header cannot be measured without a preceding turn",
                )
            prefix, prompt, through = render(i), render(i, True), render(i + 1)
            for text in (prefix, prompt, through):
                if not full.startswith(text):
                    raise _InvalidRowError(
                        "tokenization_error",
                        f"the chat template renders a prefix of the conversation around message {i + 1} differently "
                        "from the whole conversation, so labels cannot be derived",
                    )
            start, end = len(prompt), len(through)
            if start == len(prefix) or start > end or (spans and start < spans[-1][1]):
                raise _InvalidRowError(
                    "tokenization_error",
                    f"the chat template's generation prompt does not match the header of assistant message {i + 1}",
                )
            if start < end:
                spans.append((start, end))
        return spans

    def _data_spans(self, messages: list[dict[str, Any]], full: str) -> list[tuple[int, int]]:
        """Character spans of ``full`` that came from message strings spelling a special token."""
        slots: list[str] = []
        base = "kilnslot"
        while base in full:
            base += "x"

        def swap(value: Any, where: str) -> Any:
            if isinstance(value, str):
                if any(special in value for special in self.specials):
                    slots.append(value)
                    return f"{base}{len(slots) - 1}q"
                return value
            if isinstance(value, list):
                return [swap(item, where) for item in value]
            if isinstance(value, dict):
                if any(special in key for key in value for special in self.specials):
                    raise _InvalidRowError("tokenization_error", f"{where} has a key that spells a special token")
                return {key: swap(item, where) for key, item in value.items()}
            return value

        swapped = [swap(message, f"message {number}") for number, message in enumerate(messages, start=1)]
        if not slots:
            return []
        try:
            skeleton = self.tokenizer.apply_chat_template(swapped, tokenize=False, add_generation_prompt=False)
        except self.errors as exc:
            raise _InvalidRowError(
                "tokenization_error", f"the chat template rejected the conversation: {exc}"
            ) from None
        spans = _match_skeleton(re.split(re.escape(base) + r"(\d+)q", skeleton), slots, full)
        if spans is None:
            raise _InvalidRowError(
                "tokenization_error",
                "message text spells a special token and the chat template does not insert it verbatim, "
                "so it cannot be kept apart from the template's own delimiters",
            )
        return [span for span in spans if span[0] < span[1]]

    def _encode(
        self, full: str, supervised: list[tuple[int, int]], data: list[tuple[int, int]]
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        cuts = sorted({0, len(full), *(p for span in supervised for p in span), *(p for span in data for p in span)})
        pieces = []
        for a, b in itertools.pairwise(cuts):
            if a < b:
                is_supervised = any(s <= a and b <= e for s, e in supervised)
                is_data = any(s <= a and b <= e for s, e in data)
                pieces.append((full[a:b], is_supervised, is_data))
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
                raise _InvalidRowError(
                    "tokenization_error", f"the tokenizer rejected the conversation: {exc}"
                ) from None
            encoded.update(zip(batch, ids, strict=True))
        input_ids: list[int] = []
        labels: list[int] = []
        for n, (_, is_supervised, _) in enumerate(pieces):
            ids = [int(i) for i in encoded[n]]
            input_ids.extend(ids)
            labels.extend(ids if is_supervised else [IGNORE_INDEX] * len(ids))
        return tuple(input_ids), tuple(labels)


def _match_skeleton(parts: list[str], slots: list[str], full: str) -> list[tuple[int, int]] | None:
    """Align a placeholder render (template text, slot number, template text, ...) with ``full``."""
    spans: list[tuple[int, int]] = []
    pos = 0
    for k in range(0, len(parts), 2):
        if not full.startswith(parts[k], pos):
            return None
        pos += len(parts[k])
        if k + 1 == len(parts):
            break
        slot = int(parts[k + 1])
        if slot >= len(slots):
            return None
        for candidate in _insertions(slots[slot]):
            if full.startswith(candidate, pos) and full.startswith(parts[k + 2], pos + len(candidate)):
                spans.append((pos, pos + len(candidate)))
                pos += len(candidate)
                break
        else:
            return None
    return spans if pos == len(full) else None


def _insertions(value: str) -> list[str]:
    """How a template may have inserted a message string: verbatim, stripped, or JSON-escaped."""
    out: list[str] = []
    for candidate in (
        value,
        value.strip(),
        json.dumps(value, ensure_ascii=False)[1:-1],
        json.dumps(value, ensure_ascii=True)[1:-1],
    ):
        if candidate not in out:
            out.append(candidate)
    return out
