"""Chat messages and the chat template: what SFT, GRPO and OPD ingestion (and serving) share.

Messages
    ``normalise_message(number, message)`` turns one chat message into
    ``{role, content[, tool_calls][, name][, tool_call_id]}``: role one of ``ROLES``; content
    null or absent → ``""``, a list of parts (``{"type": "text", "text": ...}`` or plain strings)
    → their texts joined in order; optional fields that are absent or null are omitted;
    unknown keys are dropped. A message that cannot be normalised raises ``InvalidRowError``
    (reason ``invalid_role``; the detail names the 1-based message ``number``).

The chat template (``ChatTemplate``)
    ``render`` applies the tokenizer's template (no tokenization); ``prefixes`` renders the
    leading messages of one conversation, each prefix once. ``locate`` finds where message
    data lies in a render without searching its text: strings spelling a special token (and
    the contents asked for) are swapped for unique placeholders, the conversation is rendered
    again, and that skeleton is aligned with the render (``match_skeleton``: each string
    tried as inserted verbatim, stripped, or JSON-escaped). ``encode`` cuts a render at span
    boundaries and tokenizes the pieces (template pieces normally, data pieces with
    ``split_special_tokens=True``, no added special tokens), so every boundary is a token
    boundary and the only special-token ids come from the template. A template or tokenizer
    that refuses raises ``InvalidRowError`` with reason ``tokenization_error``.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

from kiln.errors import RequestError

__all__ = [
    "ROLES",
    "ChatTemplate",
    "InvalidRowError",
    "json_type",
    "match_skeleton",
    "normalise_message",
    "template_errors",
]

ROLES = ("system", "user", "assistant", "tool")
_OPTIONAL_STRING_FIELDS = ("name", "tool_call_id")

Span = tuple[int, int]
Label = TypeVar("Label")


class InvalidRowError(Exception):
    """Why one row is refused: a reason (SFT's rejection reasons) and what is wrong.

    Raised by this module and by SFT ingestion; callers turn it into their own refusal.
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def json_type(value: Any) -> str:
    """The JSON type of a parsed value, with its article (``a string``, ``an array``, ``null``)."""
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


# --- messages ---------------------------------------------------------------------------


def normalise_message(number: int, message: Any) -> dict[str, Any]:
    """One chat message in its normal form; ``number`` (1-based) names it in a refusal."""
    if not isinstance(message, dict):
        raise InvalidRowError("invalid_role", f"message {number} must be an object, got {json_type(message)}")
    role = message.get("role")
    if role not in ROLES:
        found = "has no role" if role is None else f"has role {role!r}"
        raise InvalidRowError("invalid_role", f"message {number} {found}; roles are {', '.join(ROLES)}")
    out: dict[str, Any] = {"role": role, "content": _content_text(number, message.get("content"))}
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if not isinstance(tool_calls, list):
            raise InvalidRowError(
                "invalid_role", f"message {number} tool_calls must be an array or null, got {json_type(tool_calls)}"
            )
        out["tool_calls"] = tool_calls
    for field in _OPTIONAL_STRING_FIELDS:
        value = message.get(field)
        if value is not None:
            if not isinstance(value, str):
                raise InvalidRowError(
                    "invalid_role", f"message {number} {field} must be a string or null, got {json_type(value)}"
                )
            out[field] = value
    return out


def _content_text(number: int, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRowError(
            "invalid_role",
            f"message {number} content must be a string, null or a list of text parts, got {json_type(content)}",
        )
    texts = []
    for part_number, part in enumerate(content, start=1):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise InvalidRowError(
                "invalid_role",
                f'message {number} content part {part_number} is not a text part ({{"type": "text", "text": "..."}} '
                "or a string); only text can be trained on",
            )
    return "".join(texts)


# --- the chat template ------------------------------------------------------------------


def template_errors() -> tuple[type[BaseException], ...]:
    """What a chat template or tokenizer raises when it refuses a conversation."""
    import jinja2

    return (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class ChatTemplate:
    """A tokenizer's chat template: render, locate message data in a render, tokenize a render.

    A tokenizer without a chat template is refused (``RequestError``, ``training_invalid_request``).
    """

    def __init__(self, tokenizer: Any):
        if getattr(tokenizer, "chat_template", None) is None:
            raise RequestError(
                "the model's tokenizer has no chat template, so conversations cannot be rendered",
                code="training_invalid_request",
                hint="use a chat model whose tokenizer_config.json carries a chat_template",
            )
        self.tokenizer = tokenizer
        self.errors = template_errors()
        specials = {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
        for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
            if getattr(token, "special", False):
                specials.add(str(token.content))
        self.specials = tuple(sorted(s for s in specials if s))

    def render(self, conversation: list[dict[str, Any]], *, generation: bool = False) -> str:
        """The template's text for ``conversation`` (with the generation prompt when ``generation``)."""
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=generation)
        except self.errors as exc:
            raise InvalidRowError("tokenization_error", f"the chat template rejected the conversation: {exc}") from None
        if not isinstance(text, str):
            raise InvalidRowError("tokenization_error", "the chat template did not render text")
        return text

    def prefixes(
        self, conversation: list[dict[str, Any]], known: dict[tuple[int, bool], str] | None = None
    ) -> Callable[..., str]:
        """``render(count, generation=False)``: the render of the first ``count`` messages, each
        made once; ``known`` holds renders already made, keyed ``(count, generation)``."""
        renders = dict(known or {})

        def render(count: int, generation: bool = False) -> str:
            if (count, generation) not in renders:
                renders[(count, generation)] = self.render(conversation[:count], generation=generation)
            return renders[(count, generation)]

        return render

    def locate(
        self, conversation: list[dict[str, Any]], full: str, contents: Collection[int] = ()
    ) -> tuple[dict[int, list[Span]], list[Span]] | None:
        """Where message data lies in ``full``, the render of ``conversation`` without a generation
        prompt: for each message index in ``contents``, every span its content was inserted at;
        and the non-empty spans of every string that spells a special token. ``None`` when the
        placeholder render does not align with ``full`` (the template does not insert the data
        verbatim, stripped or JSON-escaped)."""
        slots: list[str] = []
        data_slots: set[int] = set()
        content_slot: dict[int, int] = {}
        base = "kilnslot"
        while base in full:
            base += "x"

        def slot(value: str) -> str:
            if self._spells_special(value):
                data_slots.add(len(slots))
            slots.append(value)
            return f"{base}{len(slots) - 1}q"

        def swap(value: Any, number: int) -> Any:
            if isinstance(value, str):
                return slot(value) if self._spells_special(value) else value
            if isinstance(value, list):
                return [swap(item, number) for item in value]
            if isinstance(value, dict):
                if any(self._spells_special(key) for key in value):
                    raise InvalidRowError(
                        "tokenization_error", f"message {number} has a key that spells a special token"
                    )
                return {key: swap(item, number) for key, item in value.items()}
            return value

        swapped = []
        for k, message in enumerate(conversation):
            if k in contents:
                content_slot[k] = len(slots)
                rest = swap({key: value for key, value in message.items() if key != "content"}, k + 1)
                swapped.append({**rest, "content": slot(message["content"])})
            else:
                swapped.append(swap(message, k + 1))
        if not slots:
            return {}, []
        parts = re.split(re.escape(base) + r"(\d+)q", self.render(swapped))
        spans = match_skeleton(parts, slots, full)
        if spans is None:
            return None
        found: dict[int, list[Span]] = {}
        for number, span in zip((int(p) for p in parts[1::2]), spans, strict=True):
            found.setdefault(number, []).append(span)
        located = {k: found.get(number, []) for k, number in content_slot.items()}
        data = [span for number in sorted(data_slots) for span in found.get(number, ()) if span[0] < span[1]]
        return located, data

    def encode(
        self, text: str, spans: Sequence[tuple[int, int, Label]], data: Sequence[Span], default: Label
    ) -> tuple[tuple[int, ...], list[Label]]:
        """Token ids of ``text`` cut at every boundary of ``spans`` and ``data``, with one label per
        id: that of the first span holding its piece, else ``default``. Pieces inside ``data``
        spans are tokenized with ``split_special_tokens`` (text spelling a special token stays text)."""
        cuts = sorted({0, len(text), *(p for s in spans for p in s[:2]), *(p for s in data for p in s)})
        pieces: list[tuple[str, Label, bool]] = []
        for a, b in itertools.pairwise(cuts):
            if a < b:
                label = next((s[2] for s in spans if s[0] <= a and b <= s[1]), default)
                pieces.append((text[a:b], label, any(s <= a and b <= e for s, e in data)))
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
                raise InvalidRowError("tokenization_error", f"the tokenizer rejected the conversation: {exc}") from None
            encoded.update(zip(batch, ids, strict=True))
        input_ids: list[int] = []
        labels: list[Label] = []
        for n, (_, label, _) in enumerate(pieces):
            ids = [int(i) for i in encoded[n]]
            input_ids.extend(ids)
            labels.extend([label] * len(ids))
        return tuple(input_ids), labels

    def _spells_special(self, value: str) -> bool:
        return any(special in value for special in self.specials)


def match_skeleton(parts: list[str], slots: list[str], full: str) -> list[Span] | None:
    """Align a placeholder render (template text, slot number, template text, ...) with ``full``:
    the span of ``full`` each slot's string was inserted at, in order, or ``None``."""
    spans: list[Span] = []
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
