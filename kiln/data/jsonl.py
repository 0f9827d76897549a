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

Every refusal is ``RequestError`` (``training_invalid_request``) naming the file.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path

from kiln.documents.digests import prefixed, raw_hex, stream_sha256
from kiln.errors import RequestError

__all__ = ["check_unchanged", "dataset_file", "dataset_sha256", "file_lines", "is_blank"]

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


def _absolute(path: str | os.PathLike[str]) -> Path:
    return Path(os.path.abspath(os.fspath(path)))


def _unreadable(path: Path, exc: OSError) -> RequestError:
    return RequestError(
        f"cannot read dataset_path {str(path)!r}: {exc.strerror or exc}",
        code="training_invalid_request",
        hint="check that the file exists and is readable by the Kiln process",
    )
