"""Crash-safe checkpoint publication.

1. refuse if the canonical name exists (names are immutable);
2. create the hidden sibling ``.<name>.incomplete-<random>`` with an ``.incomplete``
   sentinel; fsync the sentinel and the directory;
3. write every state file and fsync it;
4. record sizes and SHA-256 in the manifest, write it, fsync it;
5. remove the sentinel, fsync the staging directory;
6. rename staging to the canonical name, fsync the registry.

The canonical name is absent before step 6 and complete after it; a crash leaves at most
a hidden staging directory, which no reader lists or loads. A write the file system refuses
(read-only, permission denied, no space or quota left, a name too long) removes the staging
directory and raises ``kiln.errors.StorageFailureError`` naming the checkpoint and the path. The manifest (with its
digests pending) and the loop state are validated before the first byte is written, so a
bad manifest never reaches the disk.

The work is split in three timed phases: ``capture`` (copy device tensors to host,
under the caller's lock when the device is shared), ``encode`` (serialise and hash) and
``write`` (I/O, fsync, rename; the SHA-256 of each file is computed on worker threads
while the files are written, the manifest is written once the digests are in, and the
state files and the manifest are fsynced together -- all before the sentinel is removed,
which is what makes the directory publishable). Only the first holds the lock.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kiln.artifacts.checkpoint_manifest import DOC, INCOMPLETE_SENTINEL, MANIFEST_FILE
from kiln.checkpoints._names import checkpoint_name
from kiln.checkpoints._read import MAX_FILES, check_loop_state
from kiln.documents import pipeline
from kiln.documents.jsonio import canonical_json
from kiln.errors import CheckpointError, StorageFailureError
from kiln.host.fs import fsync_dir, staging_dir

log = logging.getLogger("kiln.checkpoints")

__all__ = ["PublishTimings", "PublishedCheckpoint", "publish_checkpoint"]

Files = Mapping[str, tuple[str, bytes]]


@dataclass(frozen=True)
class PublishTimings:
    capture_ms: float  # device-to-host copy, under the lock
    encode_ms: float  # serialisation and the strict checks that precede any write
    write_ms: float  # file I/O, fsync and rename, with SHA-256 hashing running alongside


@dataclass(frozen=True)
class PublishedCheckpoint:
    path: Path
    manifest: dict[str, Any]
    timings: PublishTimings


def _create(path: Path, data: bytes) -> int:
    """Write ``data`` to a new read-only file; return its still-open descriptor (not yet synced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o444)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_synced(path: Path, data: bytes) -> None:
    fd = _create(path, data)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_POOL: list[ThreadPoolExecutor] = []


def _pool() -> ThreadPoolExecutor:
    """Worker threads for hashing and fsync (created once: thread start-up is not free)."""
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=4, thread_name_prefix="kiln-checkpoint"))
    return _POOL[0]


def _write_sentinel(staging: Path) -> None:
    """Step 2: the ``.incomplete`` sentinel and its directory entry, both synced."""
    _write_synced(staging / INCOMPLETE_SENTINEL, b"")
    fsync_dir(staging)


_PENDING = "0" * 64  # digest placeholder for the validation that runs before any write


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()  # hashlib releases the GIL: this overlaps the writes


def _with_files(manifest: dict[str, Any], files: Files, digests: Mapping[str, str]) -> dict[str, Any]:
    entries = {
        rel: {"role": role, "size_bytes": len(data), "sha256": digests.get(rel, _PENDING)}
        for rel, (role, data) in sorted(files.items())
    }
    return {**manifest, "files": entries}


def _refused(exc: OSError, doing: str, path: Path) -> NoReturn:
    """Raise ``exc`` as the storage failure it is (naming ``path`` when it names none), or as it is."""
    failure = StorageFailureError.from_os_error(exc, doing=doing, path=path)
    if failure is None:
        raise exc
    raise failure from exc


def publish_checkpoint(
    registry: str | os.PathLike[str],
    capture: Callable[[], Any],
    encode: Callable[[Any], tuple[dict[str, Any], Files]],
    *,
    lock: contextlib.AbstractContextManager[Any] | None = None,
) -> PublishedCheckpoint:
    """Publish one checkpoint into ``registry``.

    ``capture()`` copies live state to host memory (run under ``lock``); ``encode(snapshot)``
    returns the manifest without ``files`` and ``{relative path: (role, bytes)}``.
    """
    t0 = time.perf_counter()
    with lock if lock is not None else contextlib.nullcontext():
        snapshot = capture()
    t1 = time.perf_counter()
    manifest, files = encode(snapshot)
    manifest = pipeline.canonical(DOC, manifest)  # written as it is judged: numbers canonical (kiln.documents.numbers)
    if len(files) > MAX_FILES:
        raise ValueError(f"a checkpoint holds at most {MAX_FILES} files, not {len(files)}")
    # Strict checks before the first byte is written: the manifest (digests pending) and the
    # loop state against its progress. The digests are computed while the files are written.
    pending = _with_files(manifest, files, {})
    pipeline.render(DOC, pending)
    loop_file = pending["state_files"]["loss_history"]
    check_loop_state(pending, files[loop_file][1], source=loop_file)
    t2 = time.perf_counter()

    root = Path(registry)
    name = checkpoint_name(manifest["adapter_name"], manifest["progress"]["global_step"])
    target = root / name
    if os.path.lexists(target):
        raise CheckpointError(
            f"checkpoint {name} already exists in {root}; checkpoints are immutable and never overwritten",
            code="checkpoint_exists",
            reason="checkpoint_exists",
            hint="to rerun from an older checkpoint, first archive (move out of the registry) every later "
            f"checkpoint of {manifest['adapter_name']!r}, including {name}",
        )
    doing = f"publishing checkpoint {name} in {root}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = staging_dir(root, name)
    except OSError as exc:
        _refused(exc, doing, root)
    writing = staging  # the file being written, for a refusal that names none (write, fsync)
    try:
        fds: list[int] = []
        pool = _pool()
        hashing = {rel: pool.submit(_sha256, data) for rel, (_, data) in files.items()}
        sentinel = pool.submit(_write_sentinel, staging)
        try:
            for rel, (_, data) in sorted(files.items()):
                path = writing = staging / rel
                if path.parent != staging:
                    path.parent.mkdir(parents=True, exist_ok=True)
                fds.append(_create(path, data))
            manifest = _with_files(manifest, files, {rel: future.result() for rel, future in hashing.items()})
            # validated above with the digests pending; hex digests cannot change the verdict
            writing = staging / MANIFEST_FILE
            fds.append(_create(writing, canonical_json(manifest)))
            writing = staging
            # the sentinel is durable before any state file is synced, and every file is synced
            # before the sentinel goes; concurrent fsyncs share journal commits
            sentinel.result()
            list(pool.map(os.fsync, fds))
        finally:
            running: list[Future[Any]] = [*hashing.values(), sentinel]
            wait(running)  # nothing may touch the staging directory after this
            for fd in fds:
                os.close(fd)
        for directory in {(staging / rel).parent for rel in files} - {staging}:
            fsync_dir(directory)  # subdirectories; the staging directory itself is synced next
        os.unlink(staging / INCOMPLETE_SENTINEL)
        fsync_dir(staging)
        if os.path.lexists(target):  # a concurrent writer won the name
            raise CheckpointError(
                f"checkpoint {name} appeared in {root} while it was being published",
                code="checkpoint_exists",
                reason="checkpoint_exists",
            )
        os.rename(staging, target)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        _refused(exc, doing, writing)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        fsync_dir(root)
    except OSError as exc:
        _refused(exc, doing, root)
    t3 = time.perf_counter()
    timings = PublishTimings((t1 - t0) * 1000, (t2 - t1) * 1000, (t3 - t2) * 1000)
    log.info(
        "published %s: capture %.1f ms (under lock), encode %.1f ms, hash+write+fsync+rename %.1f ms",
        name,
        timings.capture_ms,
        timings.encode_ms,
        timings.write_ms,
    )
    return PublishedCheckpoint(target, manifest, timings)
