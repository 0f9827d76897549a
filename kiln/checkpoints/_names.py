"""Checkpoint names and where a resume may point.

A checkpoint is the directory ``<adapter>-checkpoint-step-<8 digits>.kiln-checkpoint``,
a direct child of the adapter registry. A resume names it by that basename, or by an
absolute path whose parent is the registry itself; anything else (``..``, nesting, a
relative path with a separator, a symlink) is refused before any model work.

The parse is strict, so an adapter owns exactly the checkpoints whose names parse back to
it: the name is exactly ``checkpoint_name(adapter, step)`` (the step zero-padded to 8
digits, more only from step 100,000,000 on, never a leading zero beyond 8) and ``adapter``
passes the registry's name rule (``kiln.host.fs.name_problem``, kind ``adapter``), which refuses
``-checkpoint-step-`` inside an adapter name -- so the first ``-checkpoint-step-`` of a
checkpoint name is where its adapter ends. ``victim-checkpoint-keep`` is no checkpoint of
``victim``; ``victim-checkpoint-step-00000001.kiln-checkpoint`` is one, and of no one else.

``parse_checkpoint_staging_name`` reads the hidden entries made from a checkpoint name:
``.<checkpoint name>.<purpose>-XXXXXXXX`` -- ``incomplete`` for a publication in progress
(``kiln.host.fs.staging_dir``), ``deleting`` for a deletion in progress.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kiln.errors import CheckpointError
from kiln.host.fs import name_problem

SUFFIX = ".kiln-checkpoint"
STEP_MARK = "-checkpoint-step-"
_NAME = re.compile(r"(?P<adapter>.+?)-checkpoint-step-(?P<step>[0-9]{8,})\.kiln-checkpoint")
_STAGING = re.compile(r"\.(?P<target>.+)\.(?P<purpose>[a-z]+)-[a-z0-9_]{8}")  # mkdtemp: 8 of [a-z0-9_]
MAX_NAME_BYTES = 255

__all__ = [
    "checkpoint_id",
    "checkpoint_name",
    "parse_checkpoint_name",
    "parse_checkpoint_staging_name",
    "resolve_checkpoint_path",
]


def checkpoint_name(adapter_name: str, global_step: int) -> str:
    return f"{adapter_name}{STEP_MARK}{global_step:08d}{SUFFIX}"


def checkpoint_id(training_kind: str, global_step: int) -> str:
    return f"{training_kind}-step-{global_step:08d}"


def parse_checkpoint_name(name: str) -> tuple[str, int] | None:
    """``(adapter, global_step)`` of a canonical basename, or None when it is not one (see the module docstring)."""
    if not isinstance(name, str) or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return None
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    adapter, step = match["adapter"], int(match["step"])
    if checkpoint_name(adapter, step) != name or name_problem(adapter, kind="adapter") is not None:
        return None
    return adapter, step


def parse_checkpoint_staging_name(name: str) -> tuple[str, int, str] | None:
    """``(adapter, global_step, purpose)`` of a hidden ``.<checkpoint name>.<purpose>-XXXXXXXX`` entry, or None."""
    match = _STAGING.fullmatch(name) if isinstance(name, str) else None
    parsed = parse_checkpoint_name(match["target"]) if match else None
    if match is None or parsed is None:
        return None
    return parsed[0], parsed[1], match["purpose"]


def resolve_checkpoint_path(registry: str | os.PathLike[str], value: str, *, adapter: str | None = None) -> Path:
    """The checkpoint directory a ``resume_checkpoint`` value names, or ``CheckpointError``.

    Accepted: a canonical basename (looked up in ``registry``) or an absolute path whose
    parent directory is ``registry``. Existence is checked by the loader, not here. The
    hint's example is a checkpoint of ``adapter``, the adapter the run trains, when known.
    """
    registry_path = Path(registry)
    example = checkpoint_name(adapter, 25) if adapter and name_problem(adapter, kind="adapter") is None else None
    hint = "pass the basename printed by `kiln checkpoints list`" + (
        f", e.g. {example}" if example else ": <adapter>-checkpoint-step-<8 digits>.kiln-checkpoint"
    )
    if not isinstance(value, str) or not value:
        raise CheckpointError("resume_checkpoint is empty", reason="outside_registry", hint=hint)
    if "\\" in value or "\x00" in value:
        raise CheckpointError(
            f"resume_checkpoint {value!r} contains a backslash or NUL", reason="outside_registry", hint=hint
        )
    raw = Path(value)
    if raw.is_absolute():
        if any(part in ("..", ".") for part in value.split("/")):
            raise CheckpointError(
                f"resume_checkpoint {value!r} is not a normalised path ('.' or '..' component)",
                reason="outside_registry",
                hint=hint,
            )
        if os.path.realpath(raw.parent) != os.path.realpath(registry_path):
            raise CheckpointError(
                f"resume_checkpoint {value!r} is not directly inside the adapter registry {registry_path}",
                reason="outside_registry",
                hint=hint,
            )
        name = raw.name
    else:
        if "/" in value or value in (".", ".."):
            raise CheckpointError(
                f"resume_checkpoint {value!r} must be a basename in the adapter registry or an absolute path "
                "directly inside it (no relative paths, no nesting, no '..')",
                reason="outside_registry",
                hint=hint,
            )
        name = value
    if parse_checkpoint_name(name) is None:
        raise CheckpointError(
            f"{name!r} is not a checkpoint name (<adapter>-checkpoint-step-<8 digits>.kiln-checkpoint)",
            reason="non_canonical_name",
            hint=hint,
        )
    return registry_path / name
