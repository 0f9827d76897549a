"""The exact-resume checkpoint engine, shared by every trainer (spec/30).

A checkpoint protects training progress: resuming continues the same optimizer run, bit
for bit, or is refused with the exact reason. It is never a warm start (that is
``base_adapter``), and a PEFT adapter directory is not a checkpoint.

``publish_checkpoint``   crash-safe publication (hidden staging, sentinel, fsync, rename)
``inspect_checkpoint``   metadata-only strict read (no tensor hashing; flat cost)
``load_checkpoint``      full strict load: sizes, SHA-256, loop state, with verified bytes
``list_checkpoints``     the checkpoints of a registry (optionally of one adapter)
``latest_checkpoint``    the newest valid checkpoint of an adapter, as a summary
``orphaned_staging_dirs``  the hidden staging directories of unfinished publications (per adapter)
``clean_unfinished_publications``  remove those that can no longer complete (``kiln checkpoints clean``)
``resolve_checkpoint_path``  where a ``resume_checkpoint`` value may point
``require_compatible``   resume admission: every difference named by field path

Every refusal is a ``CheckpointError`` whose ``reason`` is one of ``REASONS`` (or, for a
manifest that breaks its contract, the problem code; for an incompatible resume, the
dotted field path).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.artifacts.checkpoint_manifest import INCOMPLETE_SENTINEL
from kiln.checkpoints._admission import incompatibilities, require_compatible
from kiln.checkpoints._names import (
    checkpoint_id,
    checkpoint_name,
    parse_checkpoint_name,
    parse_checkpoint_staging_name,
    resolve_checkpoint_path,
)
from kiln.checkpoints._publish import PublishedCheckpoint, PublishTimings, publish_checkpoint
from kiln.checkpoints._read import (
    MAX_FILES,
    CheckpointInfo,
    LoadedCheckpoint,
    inspect_checkpoint,
    load_checkpoint,
    summarize,
)
from kiln.errors import CheckpointError, Problem, all_codes

REASONS = {
    # where the checkpoint is
    "not_found": "the path does not exist",
    "unreadable": "the path or a file cannot be read",
    "outside_registry": "a resume names a path that is not a direct child of the adapter registry",
    "non_canonical_name": "the directory name is not <adapter>-checkpoint-step-<8 digits>.kiln-checkpoint",
    "symlinked_root": "the checkpoint directory is a symlink",
    "not_a_directory": "the checkpoint path is not a directory",
    "sentinel_present": "the .incomplete publication sentinel is present",
    # the manifest
    "missing_manifest": "no checkpoint_manifest.json (a PEFT snapshot is not resumable)",
    "manifest_symlink": "checkpoint_manifest.json is a symlink",
    "manifest_hard_link": "checkpoint_manifest.json has more than one hard link",
    "manifest_special_file": "checkpoint_manifest.json is not a regular file",
    "manifest_too_large": "checkpoint_manifest.json is larger than 16 MiB",
    "name_mismatch": "the directory name does not match the manifest's adapter and step",
    "training_kind_not_resumable": "a checkpoint kind Kiln reads but never resumes",
    # the file set
    "symlink": "a symlink inside the checkpoint",
    "hard_link": "a file with more than one hard link",
    "special_file": "a device, FIFO or socket inside the checkpoint",
    "too_many_files": "more than 64 files",
    "extra_file": "a file the manifest does not list",
    "missing_file": "a file the manifest lists is missing",
    "size_mismatch": "a file's size differs from the manifest",
    "checksum_mismatch": "a file's SHA-256 differs from the manifest (full load only)",
    "loop_state_invalid": "the loop-state file breaks its schema or rules (full load only)",
    "loop_state_mismatch": "the loop state disagrees with the manifest's progress (full load only)",
    # publication
    "checkpoint_exists": "the canonical name is already published",
}

__all__ = [
    "ABANDONED_AFTER_SECONDS",
    "MAX_FILES",
    "REASONS",
    "CheckpointInfo",
    "CheckpointListing",
    "CleanResult",
    "LoadedCheckpoint",
    "PublishTimings",
    "PublishedCheckpoint",
    "UnfinishedPublication",
    "checkpoint_id",
    "checkpoint_name",
    "clean_unfinished_publications",
    "error_problems",
    "incompatibilities",
    "inspect_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "orphaned_staging_dirs",
    "parse_checkpoint_name",
    "parse_checkpoint_staging_name",
    "publish_checkpoint",
    "require_compatible",
    "resolve_checkpoint_path",
    "summarize",
]


@dataclass(frozen=True)
class CheckpointListing:
    """One checkpoint directory of a registry: its metadata, or why it does not validate."""

    path: Path
    adapter: str
    global_step: int
    info: CheckpointInfo | None
    error: CheckpointError | None


def list_checkpoints(registry: str | os.PathLike[str], adapter: str | None = None) -> list[CheckpointListing]:
    """Every canonical checkpoint directory in ``registry`` (hidden staging never), oldest first."""
    root = Path(registry)
    if not root.is_dir():
        return []
    found = []
    for entry in os.scandir(root):
        parsed = parse_checkpoint_name(entry.name)
        if parsed is None or (adapter is not None and parsed[0] != adapter):
            continue
        try:
            info, error = inspect_checkpoint(entry.path), None
        except CheckpointError as exc:
            info, error = None, exc
        found.append(CheckpointListing(Path(entry.path), parsed[0], parsed[1], info, error))
    return sorted(found, key=lambda c: (c.adapter, c.global_step))


def latest_checkpoint(registry: str | os.PathLike[str], adapter: str) -> dict[str, Any] | None:
    """The summary of the newest checkpoint of ``adapter`` whose manifest validates, or None.

    Names are sorted by step without reading anything; manifests are inspected newest
    first and the first that validates wins, so a status poll costs one inspection however
    many checkpoints the run has published.
    """
    root = Path(registry)
    if not root.is_dir():
        return None
    steps = []
    for entry in os.scandir(root):
        parsed = parse_checkpoint_name(entry.name)
        if parsed is not None and parsed[0] == adapter:
            steps.append((parsed[1], entry.path))
    for _, path in sorted(steps, reverse=True):
        try:
            return inspect_checkpoint(path).summary
        except CheckpointError:
            continue
    return None


def _staging_entries(registry: Path, adapter: str | None) -> list[tuple[os.DirEntry[str], tuple[str, int, str]]]:
    """The real directories of ``registry`` named ``.<checkpoint name>.incomplete-XXXXXXXX`` (of ``adapter``)."""
    if not registry.is_dir():
        return []
    found = []
    for entry in os.scandir(registry):
        parsed = parse_checkpoint_staging_name(entry.name)
        if parsed is None or parsed[2] != "incomplete" or (adapter is not None and parsed[0] != adapter):
            continue
        if entry.is_dir(follow_symlinks=False):
            found.append((entry, parsed))
    return found


def orphaned_staging_dirs(registry: str | os.PathLike[str], adapter: str | None = None) -> list[Path]:
    """Hidden staging directories of checkpoint publications that have not finished, all or ``adapter``'s own
    (the exact parse of ``.<checkpoint name>.incomplete-XXXXXXXX``; another adapter's never). Never loaded."""
    return sorted(Path(entry.path) for entry, _ in _staging_entries(Path(registry), adapter))


ABANDONED_AFTER_SECONDS = 3600.0  # idle this long, a publication is taken as abandoned (a live one writes steadily)


@dataclass(frozen=True)
class UnfinishedPublication:
    """One hidden staging directory of a checkpoint publication that has not finished."""

    path: Path
    checkpoint: str  # the canonical name it was being published as
    adapter: str
    global_step: int
    idle_seconds: float  # since anything in it last changed (the newest mtime of the directory and its entries)
    superseded: bool  # that name is published since: this directory can never be renamed into place
    sentinel: bool  # the ``.incomplete`` sentinel is still there (absent: killed between its removal and the rename)

    def abandoned(self, older_than: float) -> bool:
        return self.superseded or self.idle_seconds >= older_than


@dataclass(frozen=True)
class CleanResult:
    removed: list[UnfinishedPublication] = field(default_factory=list)  # or, in a dry run, what would be
    kept: list[UnfinishedPublication] = field(default_factory=list)  # changed too recently: perhaps still written
    errors: list[tuple[UnfinishedPublication, str]] = field(default_factory=list)  # removal failed, with the reason


def _newest_mtime(root: str) -> float:
    """The newest mtime of ``root`` and of every entry below it (links themselves, never followed)."""
    newest = os.lstat(root).st_mtime
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            newest = max(newest, os.lstat(os.path.join(directory, name)).st_mtime)
    return newest


def _unfinished(registry: Path, adapter: str | None, now: float) -> list[UnfinishedPublication]:
    found = []
    for entry, (owner, step, _) in _staging_entries(registry, adapter):
        name = checkpoint_name(owner, step)
        try:
            idle = max(0.0, now - _newest_mtime(entry.path))
        except FileNotFoundError:  # finished (renamed) or removed while we looked
            continue
        sentinel = os.path.lexists(os.path.join(entry.path, INCOMPLETE_SENTINEL))
        superseded = os.path.lexists(registry / name)
        found.append(UnfinishedPublication(Path(entry.path), name, owner, step, idle, superseded, sentinel))
    return sorted(found, key=lambda u: (u.adapter, u.global_step, u.path.name))


def clean_unfinished_publications(
    registry: str | os.PathLike[str],
    adapter: str | None = None,
    *,
    older_than: float = ABANDONED_AFTER_SECONDS,
    dry_run: bool = False,
) -> CleanResult:
    """Remove the staging directories of checkpoint publications that can no longer complete.

    A staging directory (the exact ``.<checkpoint name>.incomplete-XXXXXXXX`` of a real directory, never a
    link; of ``adapter`` only when given) is removed when its checkpoint name has been published since (the
    rename can never happen: names are never reused) or when nothing in it changed for ``older_than`` seconds:
    a live publication writes its files one after another and renames within seconds, so only a killed one
    stays idle. Younger ones are kept and reported. Nothing else of the registry is touched: canonical
    checkpoints, adapters and their own staging directories stay. ``older_than=0`` takes every one, and is
    right only while no job publishes into this registry.
    """
    result = CleanResult()
    for unfinished in _unfinished(Path(registry), adapter, time.time()):
        if not unfinished.abandoned(older_than):
            result.kept.append(unfinished)
            continue
        if not dry_run:
            try:
                shutil.rmtree(unfinished.path)  # removes links inside as links, never what they point to
            except OSError as exc:
                result.errors.append((unfinished, f"{exc.strerror or exc}: {exc.filename or unfinished.path}"))
                continue
        result.removed.append(unfinished)
    return result


def error_problems(exc: CheckpointError) -> list[Problem]:
    """A checkpoint error as problems carrying schema error codes (the exact reason in brackets)."""
    codes = all_codes()
    found = exc.problems or [Problem(exc.reason, exc.pointer or "", exc.message)]
    return [p if p.code in codes else Problem(exc.code, p.pointer, f"[{p.code}] {p.message}") for p in found]
