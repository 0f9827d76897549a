"""Crash-safe file-system primitives every writer of Kiln shares.

* ``atomic_write_bytes``: the path holds either its old content or all of the new (temp file in the same directory,
  fsync, rename, directory fsync);
* ``create_exclusive``: the same, but only when the path does not exist yet (hard link instead of rename), so two
  writers of one name never both succeed;
* ``staging_dir``: a hidden directory beside its destination, renamed into place once complete;
* ``fsync_dir``: make a rename or link in a directory durable.

Modes follow the process umask like any ``open()``: a file is ``0o666 & ~umask`` and a directory ``0o777 & ~umask``
(``tempfile`` would leave them ``0600``/``0700``, so an adapter published by one user could not be read by the
server of another). Files that are immutable by contract (checkpoint files) set their own mode.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write_bytes", "create_exclusive", "dir_mode", "file_mode", "fsync_dir", "staging_dir"]


def _umask() -> int:
    """The process umask, read without changing it where the platform allows (``os.umask`` is process-wide)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode ``open()`` would give a new file."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """The mode ``mkdir()`` would give a new directory."""
    return 0o777 & ~_umask()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _durable_temp(directory: Path, name: str, data: bytes) -> str:
    """A synced temp file holding ``data`` in ``directory`` (hidden, named after ``name``), with the usual mode."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name[:64]}.", suffix=".tmp", dir=directory)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def _place(path: str | os.PathLike[str], data: bytes, place: Callable[[str, Path], bool]) -> bool:
    """Write ``data`` to a synced temp file beside ``path``, ``place`` it there, sync the directory if placed."""
    target = Path(path)
    tmp = _durable_temp(target.parent, target.name, data)
    try:
        placed = place(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):  # gone after a rename; still there after a link or failure
            os.unlink(tmp)
    if placed:
        fsync_dir(target.parent)
    return placed


def _rename(tmp: str, target: Path) -> bool:
    os.replace(tmp, target)
    return True


def _link(tmp: str, target: Path) -> bool:
    try:
        os.link(tmp, target)
    except FileExistsError:
        return False
    return True


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either the old content or all of the new."""
    _place(path, data, _rename)


def create_exclusive(path: str | os.PathLike[str], data: bytes) -> bool:
    """Create ``path`` holding all of ``data``, crash-atomically, unless it exists: False when it does."""
    return _place(path, data, _link)


def staging_dir(parent: Path, name: str, purpose: str = "incomplete") -> Path:
    """A new hidden directory ``<parent>/.<name>.<purpose>-XXXX`` with the usual directory mode."""
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.{purpose}-", dir=parent))
    os.chmod(staging, dir_mode())
    return staging
