"""Crash-safe file-system primitives every writer of Kiln shares.

* ``atomic_write_bytes``: the path holds either its old content or all of the new (temp file in the same directory,
  fsync, rename, directory fsync);
* ``create_exclusive``: the same, but only when the path does not exist yet (hard link instead of rename), so two
  writers of one name never both succeed;
* ``staging_dir``: a hidden directory beside its destination, renamed into place once complete;
* ``publish_dir``: the whole staged publication of a directory (stage, fsync, one rename, fsync the parent), which
  may supersede an earlier attempt's record at the same name in that one rename;
* ``fsync_dir``: make a rename or link in a directory durable;
* ``writable_problem``: why no file can be created in a directory (read-only, permission denied, full), or None;
* ``within_roots``: whether a path, every symlink resolved, lies inside one of a set of directories (nothing is
  opened to find out);
* ``name_problem``: the one rule for every name Kiln turns into a directory entry (registry names and the file
  names inside artifacts), by kind.

Modes follow the process umask like any ``open()``: a file is ``0o666 & ~umask`` and a directory ``0o777 & ~umask``
(``tempfile`` would leave them ``0600``/``0700``, so an adapter published by one user could not be read by the
server of another). Files that are immutable by contract (checkpoint files) set their own mode.

Names (``name_problem(name, kind=...)``). A name must be exactly one plain directory entry: a non-empty string,
no ``/``, ``\\``, NUL or other control character (U+0000-U+001F, U+007F), no ``..`` anywhere (so never ``.`` or
``..`` either), not starting with ``.`` (hidden names are where Kiln stages: staging directories, temp files, the
checkpoint sentinel), not blank and without leading or trailing whitespace (``str.isspace``: a name that looks
empty, or like another name, in a listing), valid UTF-8 (a lone surrogate, such as an undecodable command-line
byte, is not). An ``adapter`` name must also not read as a name Kiln derives from another adapter: it never
contains ``-checkpoint-step-`` (so ``<adapter>-checkpoint-step-<8 digits>.kiln-checkpoint`` parses back to exactly
one adapter) and never ends in a reserved suffix -- ``.kiln-checkpoint`` (checkpoints), ``.failed`` or
``.failed-<n>`` (the gate's demotion), ``.incomplete``, ``.restore``, ``.replaced`` or ``.deleting``, alone or
followed by ``-...`` (staging and deletion directories), in any letter case. ``-checkpoint-`` alone is allowed:
``victim-checkpoint-keep`` is an adapter of its own, and no checkpoint of ``victim`` can have that name. Its UTF-8
length is bounded by the 255-byte file-name limit less the longest suffix Kiln adds to it (``name_max_bytes``):

=============  =====  ========================================================================================
kind           bytes  the longest entry made from the name
=============  =====  ========================================================================================
``adapter``     193   the staging directory of one of its checkpoints,
                      ``.<name>-checkpoint-step-<8 digits>.kiln-checkpoint.incomplete-XXXXXXXX`` (+62)
``checkpoint``  234   its staging directory ``.<name>.incomplete-XXXXXXXX`` (+21)
``teacher``     250   the record ``<alias>.json`` (+5)
``suite``       250   the suite ``<name>.json`` and its entry ``.entries/<name>.json`` (+5)
``file``        255   itself: a file name inside an artifact directory (one component of a checkpoint path)
=============  =====  ========================================================================================

Every staging purpose is at most ``incomplete`` long (``staging_dir`` refuses a longer one), so ``+21`` covers
the ``restore`` and ``replaced`` staging directories and the registry's ``.deleting-`` renames too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Literal

from kiln.errors import storage_condition

__all__ = [
    "NAME_KINDS",
    "NameKind",
    "atomic_write_bytes",
    "create_exclusive",
    "dir_mode",
    "file_mode",
    "fsync_dir",
    "name_max_bytes",
    "name_problem",
    "publish_dir",
    "staging_dir",
    "superseded_entries",
    "within_roots",
    "writable_problem",
]

NameKind = Literal["adapter", "checkpoint", "teacher", "suite", "file"]
NAME_KINDS: tuple[NameKind, ...] = ("adapter", "checkpoint", "teacher", "suite", "file")
FILE_NAME_MAX_BYTES = 255  # the file-name limit of ext4, XFS, btrfs, ZFS and APFS
STAGING_PURPOSE_MAX = len("incomplete")  # the longest purpose of a staging directory
STAGING_NAME_EXTRA = len("." + "." + "-") + STAGING_PURPOSE_MAX + 8  # .<name>.<purpose>-XXXXXXXX (mkdtemp: 8)
CHECKPOINT_NAME_EXTRA = len("-checkpoint-step-00000000.kiln-checkpoint")  # kiln.checkpoints.checkpoint_name
JSON_NAME_EXTRA = len(".json")  # teacher records and evaluation suites
_NAME_SUFFIXES: dict[str, tuple[int, str]] = {  # kind: (the most bytes Kiln adds to the name, what adds them)
    "adapter": (CHECKPOINT_NAME_EXTRA + STAGING_NAME_EXTRA, "the suffix of its checkpoints' staging directories"),
    "checkpoint": (STAGING_NAME_EXTRA, "the suffix of its staging directory"),
    "teacher": (JSON_NAME_EXTRA, "'.json'"),
    "suite": (JSON_NAME_EXTRA, "'.json'"),
    "file": (0, ""),
}
_TEMP_NAME_MAX = 64  # bytes of the target's name kept in a temp file's name


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
    fd, tmp = tempfile.mkstemp(prefix=f".{_shortened(name, _TEMP_NAME_MAX)}.", suffix=".tmp", dir=directory)
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


def _shortened(name: str, max_bytes: int) -> str:
    """``name`` cut to at most ``max_bytes`` UTF-8 bytes, never inside a character."""
    return name.encode("utf-8", "surrogatepass")[:max_bytes].decode("utf-8", "ignore")


def staging_dir(parent: Path, name: str, purpose: str = "incomplete") -> Path:
    """A new hidden directory ``<parent>/.<name>.<purpose>-XXXXXXXX`` with the usual directory mode.

    A name that passes ``name_problem`` is kept whole (readers find leftovers by it); a longer one, such as an
    arbitrary model directory's, is shortened so that the staging name is still a file name.
    """
    if len(purpose) > STAGING_PURPOSE_MAX:
        raise ValueError(f"a staging purpose is at most {STAGING_PURPOSE_MAX} characters, not {purpose!r}")
    kept = _shortened(name, FILE_NAME_MAX_BYTES - STAGING_NAME_EXTRA)
    staging = Path(tempfile.mkdtemp(prefix=f".{kept}.{purpose}-", dir=parent))
    os.chmod(staging, dir_mode())
    return staging


def _sync_tree(root: Path) -> None:
    """fsync every regular file below ``root``, then every directory, deepest first and ``root`` last."""
    for directory, _dirs, files in os.walk(root, topdown=False):
        for file_name in files:
            path = os.path.join(directory, file_name)
            if os.path.islink(path):  # the link is an entry of its directory, synced below
                continue
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(directory)


def superseded_entries(target: str | os.PathLike[str], supersede: Collection[str]) -> list[str] | None:
    """The entries ``publish_dir(target, supersede=...)`` would move aside to replace ``target`` in its one rename:
    every entry, when ``target`` is a real directory holding nothing but entries named in ``supersede`` and hidden
    ones (temp files of an interrupted write; no published name starts with ``.``); None when it holds anything else
    or is not a directory."""
    path = Path(target)
    if os.path.islink(path) or not path.is_dir():
        return None
    entries = sorted(os.listdir(path))
    return entries if all(e in supersede or e.startswith(".") for e in entries) else None


def _rename_into_place(
    staging: Path, target: Path, *, overwrite: bool, supersede: Collection[str] | None
) -> Path | None:
    """Rename ``staging`` to ``target``; return the hidden directory now holding what it replaced, if anything."""
    if not os.path.lexists(target):
        os.rename(staging, target)
        return None
    superseded = None if supersede is None else superseded_entries(target, supersede)
    if superseded is not None:
        aside = staging_dir(target.parent, target.name, "replaced")
        moved: list[str] = []
        try:
            for entry in superseded:
                os.rename(target / entry, aside / entry)
                moved.append(entry)
            os.rename(staging, target)  # rename(2) replaces an empty directory in the same step
        except BaseException:
            for entry in reversed(moved):
                os.rename(aside / entry, target / entry)
            aside.rmdir()
            raise
        return aside
    if not overwrite:
        raise FileExistsError(errno.EEXIST, "already exists; choose another name or replace it", str(target))
    aside = staging_dir(target.parent, target.name, "replaced")
    try:
        os.rename(target, aside / "old")
    except BaseException:
        aside.rmdir()
        raise
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(aside / "old", target)
        aside.rmdir()
        raise
    return aside


@contextlib.contextmanager
def publish_dir(
    target: str | os.PathLike[str],
    *,
    purpose: str = "incomplete",
    overwrite: bool = False,
    supersede: Collection[str] | None = None,
) -> Iterator[Path]:
    """Build a directory that appears at ``target`` complete, or not at all.

    1. ``staging_dir``: a new hidden ``.<name>.<purpose>-XXXXXXXX`` beside ``target``, yielded for the block to fill;
    2. when the block returns: fsync every file in it, then every directory, the staging directory last;
    3. one rename to ``target``. An existing ``target`` is refused (``FileExistsError``), except:

       * ``supersede`` (file names): a ``target`` directory holding nothing but entries of these names -- an earlier
         attempt's record, such as a failed run's receipt, or nothing at all -- and hidden temp files
         (``superseded_entries``) is replaced by the same one rename:
         its entries are first moved into a hidden ``.<name>.replaced-XXXXXXXX`` directory (moved back if the
         rename fails), which leaves it empty, and rename(2) replaces an empty directory in one step;
       * ``overwrite``: any other ``target`` is first renamed into a hidden ``.<name>.replaced-XXXXXXXX`` directory
         (and renamed back if the rename fails);

       what was replaced is removed once the new directory is durable;
    4. fsync the parent, so that the rename survives a crash.

    A failure before the rename, the block's own included, removes the staging directory and leaves an existing
    ``target`` as it was. A crash leaves at most hidden directories, which no reader lists or loads (and, when it
    strikes between moving superseded entries aside and the rename, an empty ``target``). The replaced entries are
    removed after the publication is complete; a failure to remove them leaves a hidden directory behind, never a
    failed publication.
    """
    target = Path(target)
    staging = staging_dir(target.parent, target.name, purpose)
    try:
        yield staging
        _sync_tree(staging)
        replaced = _rename_into_place(staging, target, overwrite=overwrite, supersede=supersede)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(target.parent)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)  # removes a replaced symlink itself, never what it points to


def writable_problem(directory: str | os.PathLike[str], *, probe: bool = False) -> str | None:
    """Why no new file can be created in ``directory`` -- or, while it does not exist yet, in the nearest existing
    directory above it, where it would be created -- as a sentence naming the directory; None when one can.

    Without ``probe`` it asks ``os.access`` and nothing is written (a read-only file system or missing permission;
    ``access`` ignores permissions for root). With ``probe`` it creates a hidden ``.kiln-write-probe.*`` file, writes
    one byte and removes it, so a full file system and a root-owned process see the truth too.
    """
    where = Path(directory)
    try:
        while not where.is_dir() and not os.path.lexists(where) and where.parent != where:
            where = where.parent
        if not where.is_dir():
            return f"{where} is not a directory"
        if not probe:
            if os.access(where, os.W_OK | os.X_OK):
                return None
            read_only = os.statvfs(where).f_flag & os.ST_RDONLY
            return f"cannot create a file in {where}: {storage_condition(errno.EROFS if read_only else errno.EACCES)}"
        fd, tmp = tempfile.mkstemp(prefix=".kiln-write-probe.", dir=where)
        try:
            os.write(fd, b"\0")  # a full file system refuses the first byte
        finally:
            os.close(fd)
            os.unlink(tmp)
    except OSError as exc:
        condition = storage_condition(exc.errno) if exc.errno is not None else str(exc)
        return f"cannot create a file in {where}: {condition}"
    return None


def unsafe_path_problem(path: str) -> str | None:
    """Why ``path`` cannot name a server-local file a request reads (a ``dataset_path``): it must be absolute,
    without ``..`` and without a NUL (no file name holds one); None when it can."""
    if not os.path.isabs(path) or ".." in Path(path).parts:
        return f"{path!r} must be an absolute path without '..'"
    if "\x00" in path:
        return f"{path!r} holds a NUL character, which no file path can"
    return None


def within_roots(path: str | os.PathLike[str], roots: Collection[str | os.PathLike[str]]) -> bool:
    """Whether ``path`` -- absolute, every symlink on the way resolved (``os.path.realpath``) -- is inside one of
    ``roots`` (themselves resolved) or is one of them. Nothing is opened: a path that does not exist resolves as far
    as it can, and a symlink inside a root that points out of it is outside."""
    if not os.path.isabs(path):
        return False
    real = os.path.realpath(path)
    for root in roots:
        base = os.path.realpath(root)
        if real == base or real.startswith(base.rstrip(os.sep) + os.sep):
            return True
    return False


# --- names --------------------------------------------------------------------------------------


def name_max_bytes(kind: NameKind) -> int:
    """The most UTF-8 bytes a ``kind`` name may have (see the module docstring)."""
    if kind not in _NAME_SUFFIXES:
        raise ValueError(f"unknown name kind {kind!r}; one of {', '.join(NAME_KINDS)}")
    return FILE_NAME_MAX_BYTES - _NAME_SUFFIXES[kind][0]


def name_problem(name: object, *, kind: NameKind) -> str | None:
    """Why ``name`` cannot be used as a ``kind`` name (a sentence starting with "it"), or None when it can."""
    limit = name_max_bytes(kind)
    if not isinstance(name, str) or not name:
        return "it must be a non-empty string"
    if "/" in name or "\\" in name:
        return "it must not contain '/' or '\\'"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "it must not contain NUL or other control characters"
    if ".." in name:
        return "it must not contain '..'"
    if name.startswith("."):
        return "it must not start with '.' (hidden names are reserved for staging and temporary files)"
    if not name.strip():
        return "it is blank (nothing but whitespace)"
    if name != name.strip():
        return "it must not start or end with whitespace"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "it is not valid UTF-8 text (it holds a lone surrogate, such as an undecodable byte)"
    if size > limit:
        extra, adds = _NAME_SUFFIXES[kind]
        why = f"the file-name limit less {extra} for {adds}" if extra else "the file-name limit"
        return f"it is {size} bytes in UTF-8; at most {limit} are allowed ({why})"
    return _derived_name_problem(name) if kind == "adapter" else None


_CHECKPOINT_MARK = "-checkpoint-step-"  # kiln.checkpoints.checkpoint_name: <adapter>-checkpoint-step-<8 digits>...
_RESERVED_SUFFIX = re.compile(
    r"\.(?P<suffix>kiln-checkpoint|failed(?:-[0-9]+)?|(?:incomplete|restore|replaced|deleting)(?:-[^.]*)?)$",
    re.IGNORECASE,
)
_RESERVED_WHY = {
    "kiln-checkpoint": "checkpoint directories end in it",
    "failed": "the promotion gate renames a demoted adapter <name>.failed",
}


def _derived_name_problem(name: str) -> str | None:
    """Why an adapter name could be read as a name Kiln derives (a checkpoint, a demotion, a staging directory)."""
    if _CHECKPOINT_MARK in name:
        return (
            f"it must not contain {_CHECKPOINT_MARK!r} (checkpoints are named "
            "<adapter>-checkpoint-step-<8 digits>.kiln-checkpoint, so it could be read as another adapter's)"
        )
    found = _RESERVED_SUFFIX.search(name)
    if found is None:
        return None
    suffix = found["suffix"].lower()
    base = suffix if suffix == "kiln-checkpoint" else suffix.split("-", 1)[0]
    why = _RESERVED_WHY.get(base, "Kiln's staging and deletion directories end in it")
    return f"it must not end in '.{base}', a suffix Kiln reserves ({why})"
