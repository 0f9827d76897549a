"""JSONL dataset files: their lines exactly as read, and the pin that keeps a file unchanged.

``dataset_file(dataset_path, *, hint)``
    ``dataset_path`` as an absolute path to a readable regular file, or a refusal naming it.
``file_lines(path)``
    Every physical line, newline included, read in binary one line at a time (a file is
    never read whole). ``is_blank(line)``: a line of only ASCII whitespace, which is no row,
    group or record; callers that hash or count lines still see it.
``dataset_sha256(path)``
    The pin of a file: the ``sha256:`` digest of its bytes, streamed.
``check_unchanged(path, pin, *, now=None)``
    Refuse a pinned file whose bytes changed: hashed again, or ``now``, the digest of the
    bytes a streamed pass has just read. The refusal names the file and both digests.
``precheck_lines(path, check, *, fix)``
    Every non-blank line parsed as strict JSON and given to ``check`` -- what a kind can check
    without a tokenizer -- so a command line refuses a bad line before torch loads, as
    ``PATH line N: what is wrong`` (a JSON mistake said in words, not a decoder's offsets).

Every refusal is ``RequestError`` (``training_invalid_request``) naming the file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from kiln.documents.digests import prefixed, raw_hex, stream_sha256
from kiln.documents.jsonio import decode_error, parse_json
from kiln.errors import KilnError, RequestError

__all__ = [
    "check_unchanged",
    "dataset_file",
    "dataset_sha256",
    "file_lines",
    "is_blank",
    "json_words",
    "precheck_lines",
]

_ASCII_WS = b" \t\n\r\x0b\x0c"


def dataset_file(dataset_path: str | os.PathLike[str], *, hint: str) -> Path:
    """``dataset_path`` made absolute, once it names a regular file; ``hint`` says what file to give."""
    if not isinstance(dataset_path, (str, os.PathLike)) or not os.fspath(dataset_path):
        raise RequestError(
            f"dataset_path must be a non-empty path, got {dataset_path!r}", code="training_invalid_request", hint=hint
        )
    path = _absolute(dataset_path)
    if not path.is_file():
        raise RequestError(
            f"dataset_path {str(path)!r} is not a readable regular file", code="training_invalid_request", hint=hint
        )
    return path


def file_lines(path: Path) -> Generator[bytes, None, None]:
    """Every physical line of the file, exactly as read (newline included), in binary."""
    try:
        with path.open("rb") as fh:
            yield from fh
    except OSError as exc:
        raise _unreadable(path, exc) from None


def is_blank(line: bytes) -> bool:
    """Only ASCII whitespace: not a row, group or record."""
    return not line.strip(_ASCII_WS)


def dataset_sha256(path: str | os.PathLike[str]) -> str:
    """``sha256:`` digest of a file's bytes, read in chunks (the pin of a dataset file)."""
    target = _absolute(path)
    try:
        with target.open("rb") as fh:
            digest, _ = stream_sha256(fh)
    except OSError as exc:
        raise _unreadable(target, exc) from None
    return prefixed(digest)


def check_unchanged(path: str | os.PathLike[str], pin: str, *, now: str | None = None) -> None:
    """Refuse when the file's bytes no longer hash to ``pin`` (raw or ``sha256:`` hex).

    ``now`` is the digest of the bytes a streamed pass has just read; without it the file is
    hashed again (a vanished or unreadable file is refused too).
    """
    target = _absolute(path)
    actual = raw_hex(dataset_sha256(target) if now is None else now)
    if raw_hex(pin) != actual:
        raise RequestError(
            f"dataset_path {str(target)!r} changed since the job was admitted (pinned {prefixed(raw_hex(pin))}, "
            f"now {prefixed(actual)}); a pinned dataset file must not change during a job",
            code="training_invalid_request",
            hint="restore the file's bytes, or submit the job again to pin the new file",
        )


def precheck_lines(
    path: Path,
    check: Callable[[Any, int], None],
    *,
    fix: Callable[[int], str],
    refused: tuple[type[Exception], ...] = (),
) -> int:
    """Parse every non-blank line of ``path`` (strict JSON) and give it to ``check(value, line_number)``; the first
    line that is not JSON, or that ``check`` refuses with one of ``refused`` (its ``detail``, else its text), is
    refused as ``PATH line N: ...`` with ``fix(N)`` as the hint. Returns the non-blank lines read."""
    rows = 0
    with contextlib.closing(file_lines(path)) as lines:
        for number, line in enumerate(lines, start=1):
            if is_blank(line):
                continue
            rows += 1
            try:
                value = parse_json(line, limit=max(len(line), 1))
            except KilnError:
                detail = json_words(line)
            else:
                try:
                    check(value, number)
                    continue
                except refused as bad:
                    detail = str(getattr(bad, "detail", bad))
            raise RequestError(f"{path} line {number}: {detail}", code="training_invalid_request", hint=fix(number))
    return rows


def json_words(line: bytes) -> str:
    """Why ``line`` is not strict JSON, for a person: where the value breaks off, not a decoder's character offset."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"not UTF-8 text (byte {exc.start + 1} of the line)"
    error = decode_error(text)
    if isinstance(error, json.JSONDecodeError):
        if error.pos >= len(text.rstrip()):
            return "not valid JSON (the line ends before its value does: a bracket, brace or quote left open)"
        return f"not valid JSON ({error.msg[:1].lower()}{error.msg[1:]} at column {error.colno})"
    if error is None:
        return "not valid JSON"
    return str(error) if "JSON" in str(error) else f"not valid JSON ({error})"


def _absolute(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.fspath(path)))


def _unreadable(path: Path, exc: OSError) -> RequestError:
    return RequestError(
        f"cannot read dataset_path {str(path)!r}: {exc.strerror or exc}",
        code="training_invalid_request",
        hint="check that the file exists and is readable by the Kiln process",
    )
