"""Dataset uploads (``POST /v1/datasets``): a client's JSONL file stored where training may read it.

The server reads a ``dataset_path`` only inside its data roots (``training.data_roots``, always including
``<home>/data``), so a client whose file lives on its own machine -- or anywhere the operator did not allow --
uploads it first. The body is streamed to a hidden temp file in ``<home>/data/uploads/`` while its SHA-256 is
computed, bounded by ``server.max_upload_bytes`` (a declared length over it is refused before a byte is read, a
longer body as soon as it passes it), synced, and linked into place as ``<hex>.jsonl``: content-addressed, written
once, never overwritten (an upload of bytes already stored answers ``created: false``). Nothing is parsed here;
the training request that names the file checks its rows as for any ``dataset_path``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from kiln.errors import CapacityError, ContractError, Problem, RegistryError, RequestError, storage_condition
from kiln.host.fs import file_mode, fsync_dir
from kiln.server._drain import unread

__all__ = ["UPLOAD_MEDIA_TYPES", "receive"]

# what an upload may be declared as: JSON Lines by any of its names, or plain bytes
UPLOAD_MEDIA_TYPES = ("application/jsonl", "application/x-ndjson", "application/json-lines", "application/octet-stream")


def _too_large(size: str, limit: int) -> CapacityError:
    return CapacityError(
        f"upload {size} exceeds server.max_upload_bytes ({limit} bytes)",
        code="payload_too_large",
        hint="raise server.max_upload_bytes (KILN_SERVER_MAX_UPLOAD_BYTES), or place the file in a directory of "
        "training.data_roots and send its path",
    )


def check_declared(headers: Any, limit: int) -> None:
    """Refuse an upload by its headers alone: a media type that is not one of ``UPLOAD_MEDIA_TYPES``, a
    declared length over ``limit``."""
    content_type = headers.get("content-type")
    kind = (content_type or "").partition(";")[0].strip().lower()
    if kind not in UPLOAD_MEDIA_TYPES:
        raise unread(
            RequestError(
                f"an upload is declared as {content_type!r}; this route stores the raw bytes of a JSONL file",
                code="unsupported_media_type",
                hint=f"send Content-Type: {UPLOAD_MEDIA_TYPES[0]}",
            )
        )
    declared = headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise unread(_too_large(f"of {declared} bytes", limit))


class Upload:
    """One upload in progress: chunks appended to a hidden temp file, hashed as they come."""

    def __init__(self, uploads: Path, limit: int):
        self.uploads, self.limit = uploads, limit
        self.digest = hashlib.sha256()
        self.size = 0
        try:
            uploads.mkdir(parents=True, exist_ok=True)
            self.fd, self.tmp = tempfile.mkstemp(prefix=".upload.", dir=uploads)
        except OSError as exc:
            raise _unwritable(uploads, exc) from exc

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise _too_large(f"of more than {self.limit} bytes", self.limit)
        self.digest.update(chunk)
        try:
            view = memoryview(chunk)
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            raise _unwritable(self.uploads, exc) from exc

    def finish(self) -> dict[str, Any]:
        """Sync the file and link it into place by its digest; the ``DatasetUploadResponse``."""
        if self.size == 0:
            raise ContractError([Problem("missing_field", "", "the upload is empty: send the bytes of a JSONL file")])
        hex_digest = self.digest.hexdigest()
        target = self.uploads / f"{hex_digest}.jsonl"
        try:
            os.fchmod(self.fd, file_mode())
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
            try:
                os.link(self.tmp, target)  # exclusive: never over a stored file
                created = True
            except FileExistsError:
                created = False  # the same bytes, by their digest
            fsync_dir(self.uploads)
        except OSError as exc:
            raise _unwritable(self.uploads, exc) from exc
        finally:
            self.discard()
        return {
            "object": "dataset",
            "dataset_path": str(target),
            "sha256": f"sha256:{hex_digest}",
            "bytes": self.size,
            "created": created,
        }

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.tmp)


def _unwritable(uploads: Path, exc: OSError) -> RegistryError:
    condition = storage_condition(exc.errno) if exc.errno is not None else str(exc)
    return RegistryError(
        f"the upload cannot be stored in {uploads}: {condition}",
        hint=f"make {uploads} writable (or free space there)",
    )


async def receive(request: Any, uploads: Path, limit: int) -> dict[str, Any]:
    """Stream the body of ``request`` into ``uploads``; the ``DatasetUploadResponse``."""
    check_declared(request.headers, limit)
    upload = Upload(uploads, limit)
    try:
        async for chunk in request.stream():
            if chunk:
                upload.write(chunk)
        return upload.finish()
    except BaseException:
        upload.discard()
        raise
