"""A cache of large files' SHA-256 digests, so an unchanged base-weight shard is hashed once per file version.

Hashing a 15 GB model takes tens of seconds, and every job's identity needs its shards' digests. The cache keeps one
entry per file, keyed the way git's index decides that a working-tree file is unchanged: the file's device, inode,
size, modification time and status-change time (nanoseconds). Any write to the file, a replacement by rename, a copy
elsewhere or a ``touch`` changes one of them, and the file is hashed again.

* Where: ``<home>/cache/file-digests/`` (``paths.home``: ``KILN_HOME``, else ``~/.kiln``), one small JSON file per
  cached path, named by the digest of the path, written atomically (concurrent writers never corrupt an entry; the
  last one wins).
* Racy files: a file modified less than ``RACY_WINDOW_NS`` before it was hashed may be modified again within the
  same timestamp tick without changing its key, so its digest is not cached (git's "racily clean" rule); the next
  start hashes it again.
* Forcing a rehash: ``KILN_REHASH=1`` ignores (and rewrites) every entry; deleting the directory forgets them all.
* What it does not change: the digests themselves. Exact resume still compares content digests; the cache only
  spares recomputing an unchanged file's.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from kiln.documents.digests import file_sha256
from kiln.host.fs import atomic_write_bytes
from kiln.host.progress import human_bytes, stage

__all__ = ["RACY_WINDOW_NS", "REHASH_ENV", "cached_file_sha256", "digest_cache_dir"]

REHASH_ENV = "KILN_REHASH"
RACY_WINDOW_NS = 2_000_000_000  # coarser than any file system's timestamp granularity Kiln runs on
_ENTRY_SCHEMA = "kiln.file-digest-cache.v1"


def digest_cache_dir(home: Path) -> Path:
    return home / "cache" / "file-digests"


def _key(stat: os.stat_result) -> dict[str, int]:
    return {
        "device": stat.st_dev,
        "inode": stat.st_ino,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "ctime_ns": stat.st_ctime_ns,
    }


def cached_file_sha256(path: Path, cache_dir: Path | None) -> tuple[str, int]:
    """Raw hex SHA-256 and size of ``path``: from the cache when the file is unchanged since it was hashed, else
    hashed now (and cached unless it changed too recently). ``cache_dir`` None: always hashed, nothing cached."""
    if cache_dir is None:
        return file_sha256(path)
    resolved = os.path.realpath(path)
    entry_path = cache_dir / (hashlib.sha256(resolved.encode("utf-8", "surrogateescape")).hexdigest() + ".json")
    before = os.stat(resolved)
    key = _key(before)
    if os.environ.get(REHASH_ENV, "") not in ("1", "true", "yes"):
        cached = _read_entry(entry_path)
        if cached is not None and cached.get("path") == resolved and cached.get("key") == key:
            digest = cached.get("sha256")
            if isinstance(digest, str) and len(digest) == 64:
                return digest, before.st_size
    stage(f"hashing {Path(resolved).name} ({human_bytes(before.st_size)})")
    digest, size = file_sha256(resolved)
    after = os.stat(resolved)
    settled = time.time_ns() - after.st_mtime_ns >= RACY_WINDOW_NS
    if _key(after) == key and size == after.st_size and settled:
        entry = {"schema": _ENTRY_SCHEMA, "path": resolved, "key": key, "sha256": digest}
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(entry_path, json.dumps(entry, sort_keys=True).encode("utf-8"))
        except OSError:
            pass  # a cache that cannot be written only costs the next start a rehash
    return digest, size


def _read_entry(path: Path) -> dict[str, object] | None:
    try:
        found = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found.get("schema") == _ENTRY_SCHEMA else None
