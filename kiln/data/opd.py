"""OPD ingestion: inline prompts → student and teacher prefixes with the ECHO observation
mask, and the pinned pre-scored off-policy teacher JSONL file → aligned action targets and
teacher top-K log-probabilities (spec/40 "OPD"). No model forward pass happens here.

API
    ``read_prompts(tokenizer, prompts, *, warning_filter=True) -> OpdPrompts``
        Every prompt of ``request["prompts"]`` checked and rendered; the first bad one is
        refused (``RequestError`` ``training_invalid_request``, ``pointer`` ``/prompts/<i>/...``).
    ``read_off_policy_file(tokenizer, dataset_path, *, vocab_size, tokenizer_vocab_sha256)
    -> OffPolicyFile``
        The file read once, streamed and hashed in the same pass; any bad line refuses the
        whole file with a message naming its 1-based line.
    ``tokenize_response(tokenizer, messages, response) -> (student_prefix, action_ids)``
        How a row's response becomes action targets (what the admission check compares
        ``teacher_tokens`` with, and what a producer of such files should score).
    The file's pin is re-checked before training with ``kiln.data.jsonl.check_unchanged``.

Prompts
    Each prompt is made plain JSON (canonical round trip, non-finite numbers refused) and
    validated as an ``OpdPrompt`` (not a contract entry point: it is wrapped as
    ``{"teacher": "-", "prompts": [prompt]}`` and validated as ``OpdRequest``, the pointer
    mapped back). ``messages`` (at least one) and ``teacher_extra_messages`` are normalised
    like SFT messages (roles ``system``, ``user``, ``assistant``, ``tool``). ``trajectory``
    segments are appended after ``messages`` as messages with their role (``tool_call_id``
    passed through); a missing ``kind`` defaults as in GRPO. Only ``observation`` segments
    matter here: their content tokens are the ECHO targets. ``action`` and ``context``
    segments are plain prompt context (the student's own rollout is the action).

    ``student_prefix`` = tokens of ``render(messages + segments, add_generation_prompt=True)``;
    ``teacher_prefix`` = the same with ``teacher_extra_messages`` first. The render without a
    generation prompt must be a prefix of the one with it. Observation content spans and any
    message string spelling a special token are located with a placeholder render (never by
    searching the text; ``kiln.data.trajectory``) and the render is cut there: template
    pieces are tokenized normally, data pieces with ``split_special_tokens`` (so text spelling
    ``<|im_end|>`` stays text and cannot move a boundary). For plain text the ids equal a
    plain tokenization of the render.

    ``observation_mask`` is aligned with ``student_prefix`` itself (not shifted):
    ``observation_mask[t]`` is true when ``student_prefix[t]`` is an observation token, so
    the ECHO loss predicts it from the logits at ``t - 1``. With ``warning_filter`` the tokens
    covering an observation's first ``warning_prefix_len`` characters are left out (counted in
    ``warning_tokens``); ids never depend on the filter.

    ``source_sha256`` is ``json_sha256`` of the list of prompts as parsed (the serialized
    effective input); ``training_data()`` is the receipt block (source ``opd_prompts``).

Off-policy file
    ``dataset_path`` must be absolute without ``..`` (else ``ContractError`` ``unsafe_path`` at
    ``/dataset_path``, as the server checks GRPO and SFT paths) and a readable regular file.
    Line 1 is the ``kiln.off-policy-distillation-manifest.v1`` record, strictly parsed and
    validated; its ``vocab_size`` and ``tokenizer_vocab_sha256`` (raw hex) must equal the
    student's. Every later non-blank line (blank = ASCII whitespace only, skipped but hashed)
    is one ``OffPolicyDistillationRow`` (schema, then ``off-policy-row.top-logprobs``: distinct
    ids, non-increasing log-probabilities). Then per row: the response's action targets are
    GRPO's plain-text completion tokenization (SFT's supervised span: the content, the closing
    end-of-turn token and its newline; ``student_prefix + action_ids`` is the render of
    ``messages + [assistant(response)]``); an empty response has no action targets and needs
    ``teacher_tokens == []``. ``teacher_tokens`` needs one entry per target with equal
    ``token_id``; each ``top_logprobs`` has exactly the manifest's ``top_k`` entries with ids
    below ``vocab_size``. The number of rows must equal ``row_count``. ``sha256`` is the
    file's bytes; ``manifest_sha256`` is ``json_sha256`` of the manifest as parsed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifacts.off_policy import MANIFEST, ROW
from kiln.contracts import problems
from kiln.data.chat import json_type
from kiln.data.jsonl import dataset_file, file_lines, is_blank, precheck_lines
from kiln.data.trajectory import (
    ACTION,
    PROMPT,
    ItemError,
    Segment,
    TrajectoryTokenizer,
    check_item,
    describe_problems,
    inline_value,
    normalised_messages,
    parse_line,
    segments,
)
from kiln.documents.digests import json_sha256, prefixed, raw_hex
from kiln.errors import ContractError, Problem, RequestError
from kiln.host.fs import unsafe_path_problem

__all__ = [
    "OFF_POLICY_SOURCE",
    "PROMPTS_SOURCE",
    "OffPolicyFile",
    "OffPolicyRow",
    "OpdPromptItem",
    "OpdPrompts",
    "read_off_policy_file",
    "read_prompts",
    "tokenize_response",
]

PROMPTS_SOURCE = "opd_prompts"
OFF_POLICY_SOURCE = "opd_teacher_jsonl"


@dataclass(frozen=True)
class OpdPromptItem:
    """One rendered prompt. ``observation_mask`` is aligned with ``student_prefix`` (unshifted)."""

    index: int
    student_prefix: tuple[int, ...]
    teacher_prefix: tuple[int, ...]
    observation_mask: tuple[bool, ...]
    observation_tokens: int
    warning_tokens: int


@dataclass
class OpdPrompts:
    """Every inline prompt in request order and the digest that pins them."""

    items: list[OpdPromptItem]
    source_sha256: str
    tokenize_ms: float

    def training_data(self) -> dict[str, Any]:
        """The receipt's ``training_data`` block."""
        return {"source": PROMPTS_SOURCE, "path": None, "sha256": self.source_sha256}


@dataclass(frozen=True)
class OffPolicyRow:
    """One admitted row: ``teacher_ids``/``teacher_logprobs`` are ``[len(action_ids)][top_k]``."""

    index: int
    line: int
    student_prefix: tuple[int, ...]
    action_ids: tuple[int, ...]
    teacher_ids: tuple[tuple[int, ...], ...]
    teacher_logprobs: tuple[tuple[float, ...], ...]
    response: str


@dataclass
class OffPolicyFile:
    """An admitted pre-scored teacher file: its pin, its manifest and every row."""

    path: Path
    sha256: str
    manifest: dict[str, Any]
    manifest_sha256: str
    rows: list[OffPolicyRow]
    tokenize_ms: float

    def training_data(self) -> dict[str, Any]:
        """The receipt's ``training_data`` block."""
        return {"source": OFF_POLICY_SOURCE, "path": str(self.path), "sha256": self.sha256}


# --- inline prompts ---------------------------------------------------------------------


def read_prompts(tokenizer: Any, prompts: list[dict[str, Any]], *, warning_filter: bool = True) -> OpdPrompts:
    """Validate and render every prompt; refuse the first bad one naming ``/prompts/<i>``."""
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Sequence):
        raise RequestError(
            f"prompts must be a list of prompts, got {type(prompts).__name__}",
            code="training_invalid_request",
            hint='send prompts as [{"messages": [{"role": "user", "content": ...}]}, ...]',
            pointer="/prompts",
        )
    if not prompts:
        raise RequestError(
            "prompts is empty; an on-policy distillation job needs at least one prompt",
            code="training_invalid_request",
            hint="send at least one prompt the student can answer",
            pointer="/prompts",
        )
    started = time.perf_counter()
    tokens = TrajectoryTokenizer(tokenizer, warning_filter)
    parsed: list[Any] = []
    items: list[OpdPromptItem] = []
    for index, value in enumerate(prompts):
        try:
            plain = inline_value(value)
            parsed.append(plain)
            items.append(_prompt(tokens, index, plain))
        except ItemError as bad:
            raise RequestError(
                f"prompt {index + 1} is invalid: {bad.detail}",
                code="training_invalid_request",
                hint=f"fix prompt {index + 1}; every prompt needs at least one message the chat template can render",
                pointer=f"/prompts/{index}{bad.pointer}",
            ) from None
    elapsed = (time.perf_counter() - started) * 1000.0
    return OpdPrompts(items=items, source_sha256=json_sha256(parsed), tokenize_ms=elapsed)


def _prompt(tokens: TrajectoryTokenizer, index: int, value: Any) -> OpdPromptItem:
    if not isinstance(value, dict):
        raise ItemError(f"a prompt must be a JSON object, got {json_type(value)}")
    check_item("OpdRequest", "prompts", value, whole="the prompt", teacher="-")
    if not value["messages"]:
        raise ItemError("messages is empty; the student needs at least one message to answer", "/messages")
    messages = normalised_messages(value["messages"], named=True)
    extra = normalised_messages(value.get("teacher_extra_messages", []), "teacher_extra_messages", named=True)
    after = segments(value) if "trajectory" in value else []  # only observations are marked: the rest is context
    student, labels = tokens.prefix(messages, after)
    teacher, _ = tokens.prefix(extra + messages, after)
    mask, warnings = tokens.observations(labels)
    return OpdPromptItem(index, student, teacher, mask, sum(mask), warnings)


# --- the pre-scored off-policy file -----------------------------------------------------


def tokenize_response(
    tokenizer: Any, messages: list[dict[str, Any]], response: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(student_prefix, action_ids)`` of ``response`` answering ``messages`` (action ids empty
    for an empty response). Refuses what the file admission refuses, as ``RequestError``."""
    try:
        return _ResponseTokenizer(tokenizer).tokenize(normalised_messages(messages), response)
    except ItemError as bad:
        raise RequestError(f"the response cannot be tokenized: {bad.detail}", code="training_invalid_request") from None


class _ResponseTokenizer:
    """GRPO's plain-text completion path: one assistant action segment after the prompt."""

    def __init__(self, tokenizer: Any):
        self.tokens = TrajectoryTokenizer(tokenizer, True)

    def tokenize(self, messages: list[dict[str, Any]], response: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        prompt = self.tokens.prompt(messages)
        answer = [Segment("assistant", response, "action", 0, None)]
        ids, labels = self.tokens.completion(messages, answer, prompt, from_text=True)
        prompt_tokens = labels.count(PROMPT)
        actions = tuple(ids[t] for t in range(1, len(ids)) if labels[t] == ACTION)
        if actions != ids[prompt_tokens:]:
            raise ItemError("tokenization_error: the chat template emits text after the assistant turn")
        return ids[:prompt_tokens], actions if response else ()


def read_off_policy_file(
    tokenizer: Any,
    dataset_path: str | os.PathLike[str],
    *,
    vocab_size: int,
    tokenizer_vocab_sha256: str,
) -> OffPolicyFile:
    """Admit a pre-scored teacher file, or refuse it naming the first bad line."""
    path = _absolute_file(dataset_path)
    started = time.perf_counter()
    responses = _ResponseTokenizer(tokenizer)
    hasher = hashlib.sha256()
    manifest: dict[str, Any] | None = None
    rows: list[OffPolicyRow] = []
    number = 0
    with contextlib.closing(file_lines(path)) as lines:
        for line in lines:
            hasher.update(line)
            number += 1
            try:
                if manifest is None:
                    manifest = _manifest(line, vocab_size, tokenizer_vocab_sha256)
                elif not is_blank(line):
                    if len(rows) == manifest["row_count"]:
                        raise ItemError(
                            f"the manifest's row_count is {manifest['row_count']} but the file has more rows"
                        )
                    rows.append(_row(responses, manifest, len(rows), number, line))
            except ItemError as bad:
                raise _refused(path, number, bad) from None
    if manifest is None:
        raise _refused(path, 1, ItemError("the file is empty; line 1 must be the off-policy distillation manifest"))
    if len(rows) != manifest["row_count"]:
        raise RequestError(
            f"off-policy file {str(path)!r} is refused: it has {len(rows)} rows but the manifest's row_count "
            f"(line 1) is {manifest['row_count']}",
            code="training_invalid_request",
            hint="write one row per scored response after the manifest line, and set row_count to their number",
            pointer="/row_count",
        )
    elapsed = (time.perf_counter() - started) * 1000.0
    return OffPolicyFile(path, prefixed(hasher.hexdigest()), manifest, json_sha256(manifest), rows, elapsed)


def precheck_off_policy_file(dataset_path: str | os.PathLike[str]) -> int:
    """A pre-scored teacher file checked as far as it can be without the student's tokenizer -- every line JSON, line
    1 a schema-valid manifest, every later line a schema-valid row with well-formed messages, as many rows as the
    manifest says -- so a command line refuses a bad line before it loads torch or a model. Returns the rows."""
    path = _absolute_file(dataset_path)
    count: list[int] = []  # the manifest's row_count, once line 1 is read

    def check(value: Any, number: int) -> None:
        if not count:
            _schema(MANIFEST, value, "the off-policy distillation manifest")
            count.append(int(value["row_count"]))
            return
        _schema(ROW, value, "the row")
        normalised_messages(value["messages"], named=True)
        normalised_messages(value.get("teacher_extra_messages", []), "teacher_extra_messages", named=True)

    lines = precheck_lines(
        path,
        check,
        refused=(ItemError,),
        fix=lambda number: (
            f"fix line {number} of {path}; line 1 is the manifest, every later non-blank line one scored row"
        ),
    )
    if not count:
        raise _refused(path, 1, ItemError("the file is empty; line 1 must be the off-policy distillation manifest"))
    if lines - 1 != count[0]:
        raise RequestError(
            f"off-policy file {str(path)!r} is refused: it has {lines - 1} rows but the manifest's row_count "
            f"(line 1) is {count[0]}",
            code="training_invalid_request",
            hint="write one row per scored response after the manifest line, and set row_count to their number",
            pointer="/row_count",
        )
    return lines - 1


def _absolute_file(dataset_path: str | os.PathLike[str]) -> Path:
    text = os.fspath(dataset_path) if isinstance(dataset_path, (str, os.PathLike)) else ""
    unsafe = unsafe_path_problem(text) if text else None
    if unsafe is not None:
        raise ContractError(
            [Problem("unsafe_path", "/dataset_path", f"dataset_path {unsafe}")],
            document="OpdRequest",
            hint="give the absolute server-local path of the file",
        )
    return dataset_file(
        dataset_path,
        hint="point dataset_path at the absolute path of a pre-scored teacher JSONL file whose first line is its "
        "manifest",
    )


def _refused(path: Path, number: int, bad: ItemError) -> RequestError:
    return RequestError(
        f"off-policy file {str(path)!r} is refused: line {number}: {bad.detail}",
        code="training_invalid_request",
        hint=f"fix line {number}; any bad line rejects the whole file (line 1 is the manifest, every later "
        "non-blank line one scored row)",
        pointer=bad.pointer,
    )


def _schema(doc_type: str, value: Any, what: str) -> None:
    found = problems(doc_type, value)
    if found:
        raise ItemError(f"{what} is invalid at {found[0].pointer or '/'}: {describe_problems(found)}", found[0].pointer)


def _manifest(line: bytes, vocab_size: int, vocab_sha256: str) -> dict[str, Any]:
    value = parse_line(line)
    _schema(MANIFEST, value, "the off-policy distillation manifest")
    if value["vocab_size"] != vocab_size:
        raise ItemError(
            f"the manifest's vocab_size is {value['vocab_size']} but the student's is {vocab_size}", "/vocab_size"
        )
    if value["tokenizer_vocab_sha256"] != raw_hex(vocab_sha256):
        raise ItemError(
            f"the manifest's tokenizer_vocab_sha256 is {value['tokenizer_vocab_sha256']} but the student's tokenizer "
            f"vocabulary is {raw_hex(vocab_sha256)}; the token ids were produced with another tokenizer",
            "/tokenizer_vocab_sha256",
        )
    return value


def _row(responses: _ResponseTokenizer, manifest: dict[str, Any], index: int, number: int, line: bytes) -> OffPolicyRow:
    value = parse_line(line)
    _schema(ROW, value, "the row")
    messages = normalised_messages(value["messages"], named=True)
    normalised_messages(value.get("teacher_extra_messages", []), "teacher_extra_messages", named=True)
    response = value["response"]
    prefix, actions = responses.tokenize(messages, response)
    tokens = value["teacher_tokens"]
    if len(tokens) != len(actions):
        raise ItemError(
            f"teacher_tokens has {len(tokens)} entries but the response has {len(actions)} action targets",
            "/teacher_tokens",
        )
    top_k, vocab = manifest["top_k"], manifest["vocab_size"]
    ids: list[tuple[int, ...]] = []
    logprobs: list[tuple[float, ...]] = []
    for i, (token, target) in enumerate(zip(tokens, actions, strict=True)):
        if token["token_id"] != target:
            raise ItemError(
                f"teacher_tokens[{i}].token_id is {token['token_id']} but the action target is {target}",
                f"/teacher_tokens/{i}/token_id",
            )
        top = token["top_logprobs"]
        if len(top) != top_k:
            raise ItemError(
                f"teacher_tokens[{i}].top_logprobs has {len(top)} entries but the manifest's top_k is {top_k}",
                f"/teacher_tokens/{i}/top_logprobs",
            )
        for j, entry in enumerate(top):
            if entry["token_id"] >= vocab:
                raise ItemError(
                    f"teacher_tokens[{i}].top_logprobs[{j}].token_id is {entry['token_id']}, not below the "
                    f"manifest's vocab_size {vocab}",
                    f"/teacher_tokens/{i}/top_logprobs/{j}/token_id",
                )
        ids.append(tuple(int(entry["token_id"]) for entry in top))
        logprobs.append(tuple(float(entry["logprob"]) for entry in top))
    return OffPolicyRow(index, number, prefix, actions, tuple(ids), tuple(logprobs), response)
