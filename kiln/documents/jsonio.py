"""Strict JSON in, canonical JSON out (crash-atomic writes live in ``kiln.host.fs``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kiln.errors import DocumentReadError, Problem

MAX_DOCUMENT_BYTES = 16 * 1024 * 1024

# JSON as parsed: what a document, a request body or a record is before it becomes its generated model, and after it
# is rendered from one. The only place the engine's types say ``Any``: at the JSON boundary.
JsonValue = Any
JsonObject = dict[str, Any]


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON (non-finite numbers are refused)")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} overflows to infinity (non-finite numbers are refused)")
    return value


_DECODER = json.JSONDecoder(
    object_pairs_hook=_no_duplicates, parse_constant=_reject_constant, parse_float=_finite_float
)


def decode_error(text: str) -> ValueError | None:
    """Why ``text`` is not one strict JSON value -- the decoder's own exception (a ``json.JSONDecodeError`` carries
    the position), a duplicate key, a non-finite number -- or None when it is one."""
    try:
        _DECODER.decode(text)
    except ValueError as exc:
        return exc
    return None


def parse_json(data: bytes | str, *, source: str | None = None, limit: int = MAX_DOCUMENT_BYTES) -> Any:
    """Parse one strict JSON document: UTF-8, no duplicate keys, no NaN/Infinity, bounded size."""
    if len(data) > limit:
        raise DocumentReadError(
            [Problem("document_too_large", "", f"document is {len(data)} bytes; the limit is {limit}")], document=source
        )
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DocumentReadError([Problem("invalid_json", "", f"not UTF-8: {exc}")], document=source) from None
    else:
        text = data
    try:
        value = _DECODER.decode(text)
    except (ValueError, RecursionError) as exc:
        raise DocumentReadError([Problem("invalid_json", "", f"not valid JSON: {exc}")], document=source) from None
    return value


def read_json_file(path: str | os.PathLike[str], *, limit: int = MAX_DOCUMENT_BYTES) -> Any:
    """Read and strictly parse a JSON file, refusing files over ``limit`` before reading them."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size > limit:
                raise DocumentReadError(
                    [Problem("document_too_large", "", f"file is {size} bytes; the limit is {limit}")], document=str(p)
                )
            data = fh.read(limit + 1)
    except OSError as exc:
        raise DocumentReadError(
            [Problem("document_unreadable", "", f"cannot read {p}: {exc.strerror or exc}")], document=str(p)
        ) from None
    return parse_json(data, source=str(p), limit=limit)


def canonical_json(value: Any) -> bytes:
    """The canonical form of spec/20: sorted keys, no spaces, UTF-8, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
