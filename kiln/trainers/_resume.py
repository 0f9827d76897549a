"""Resume admission every trainer shares, before and after its own model work.

* ``resume_metadata``: the cheap first half, before any model work -- a path-safe target, the checkpoint named by
  ``resume_checkpoint`` read metadata-only, its kind and adapter checked, and the seed taken from its ``lora-init``
  stream (a conflicting explicit seed is refused): a ``ResumePoint``;
* ``claim_target``: a free adapter name (or one an earlier attempt's receipt holds, which the publication
  supersedes), a registry the process can write, and no checkpoint of it past where this run starts (checkpoints
  are never overwritten);
* ``load_resume``: the second half, once the trainer knows its own identity -- every byte of the checkpoint loaded
  and compared with what this run would write, field by field (the progress-dependent members a trainer names are
  taken from the checkpoint, since its loop state binds them).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from kiln.adapters.publish import check_target
from kiln.checkpoints import (
    LoadedCheckpoint,
    inspect_checkpoint,
    list_checkpoints,
    load_checkpoint,
    require_compatible,
    resolve_checkpoint_path,
)
from kiln.documents.jsonio import JsonObject
from kiln.errors import CheckpointError, Problem, RegistryError, RequestError
from kiln.host.fs import writable_problem
from kiln.training import resolve_seed

__all__ = ["ResumePoint", "claim_target", "load_resume", "refuse_later_checkpoints", "resume_metadata"]

NAMES = {
    "sft": "an SFT job resumes only SFT checkpoints",
    "grpo": "a GRPO job resumes only GRPO checkpoints",
    "opd": "an OPD job resumes only OPD checkpoints",
}


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from, checked metadata-only: where it is, its authoritative seed, its step, and
    the activation checkpointing it ran with (kept when the resuming request says ``auto``)."""

    path: Path
    seed: int
    global_step: int
    gradient_checkpointing: str | None = None


def resume_metadata(
    registry: Path, adapter_name: str, resume_value: str | None, requested_seed: int | str | None, kind: str
) -> ResumePoint | None:
    """When ``resume_value`` (a config's ``resume_checkpoint``) is set, check the checkpoint's metadata and take its
    authoritative seed (``requested_seed``, the config's, must agree). None: a fresh run."""
    if resume_value is None:
        return None
    check_target(registry, adapter_name)  # a path-safe name before it meets the file system
    checkpoint_path = resolve_checkpoint_path(registry, resume_value, adapter=adapter_name)
    info = inspect_checkpoint(checkpoint_path)  # metadata only: fail fast, before any model work
    manifest = info.manifest
    if manifest["training_kind"] != kind:
        raise CheckpointError(
            f"{info.name} is a {manifest['training_kind']} checkpoint; {NAMES[kind]}",
            code="checkpoint_incompatible",
            reason="training_kind",
            pointer="/training_kind",
        )
    if manifest["adapter_name"] != adapter_name:
        raise CheckpointError(
            f"{info.name} belongs to adapter {manifest['adapter_name']!r}, not {adapter_name!r}",
            code="checkpoint_incompatible",
            reason="adapter_name",
            pointer="/adapter_name",
            hint=f"resume with --adapter {manifest['adapter_name']}",
        )
    seed = _checkpoint_seed(requested_seed, manifest, info.name)
    recomputed = manifest["effective_config"].get("gradient_checkpointing")
    return ResumePoint(
        checkpoint_path,
        seed,
        int(manifest["progress"]["global_step"]),
        recomputed if isinstance(recomputed, str) else None,
    )


def claim_target(registry: Path, adapter_name: str, point: ResumePoint | None) -> None:
    """A free, path-safe adapter name in a writable registry, and no checkpoint of it past where this run starts."""
    check_target(registry, adapter_name)
    problem = writable_problem(registry)  # os.access: nothing is written at admission
    if problem is not None:
        raise RegistryError(
            f"adapter {adapter_name!r} cannot be published: {problem}",
            hint=f"make {registry} writable, or train into another registry (model.adapter_dir, --adapter-dir)",
        )
    refuse_later_checkpoints(registry, adapter_name, point.global_step if point else 0)


def load_resume(
    point: ResumePoint | None,
    identity: JsonObject,
    *,
    progress_auxiliary: Iterable[str] = (),
    progress_streams: Iterable[str] = (),
) -> LoadedCheckpoint | None:
    """Load every byte of the checkpoint and refuse it unless it matches ``identity`` (this run's manifest without
    progress); ``progress_auxiliary``/``progress_streams`` name the ``auxiliary_state`` members and ``rng_states``
    streams that move with progress and are taken from the checkpoint."""
    if point is None:
        return None
    resume = load_checkpoint(point.path)  # every byte hashed, loop state checked
    manifest = resume.manifest
    for key in progress_auxiliary:
        if key in manifest["auxiliary_state"]:
            identity["auxiliary_state"][key] = manifest["auxiliary_state"][key]
    for stream in progress_streams:
        identity["rng_states"][stream] = manifest["rng_states"][stream]
    require_compatible(point.path.name, manifest, identity)
    return resume


def _checkpoint_seed(asked: int | str | None, manifest: JsonObject, name: str) -> int:
    """The checkpoint's ``lora-init`` seed is authoritative; a conflicting explicit seed is refused."""
    seed: int = manifest["rng_states"]["lora-init"]["seed"]
    if asked is not None:
        try:
            asked_value = resolve_seed(asked)
        except ValueError as exc:
            raise RequestError(str(exc), code="training_invalid_request") from None
        if asked_value != seed:
            message = f"effective_config.seed differs: {seed} (checkpoint's lora-init seed) != {asked_value} (this run)"
            raise CheckpointError(
                f"{name} cannot resume this run: {message}",
                problems=[Problem("effective_config.seed", "/effective_config/seed", message)],
                code="checkpoint_incompatible",
                reason="effective_config.seed",
                pointer="/effective_config/seed",
                hint="omit --seed when resuming: the checkpoint's seed is used",
            )
    return seed


def refuse_later_checkpoints(registry: Path, adapter: str, start_step: int) -> None:
    later = [c for c in list_checkpoints(registry, adapter) if c.global_step > start_step]
    if later:
        first = later[0].path.name
        raise CheckpointError(
            f"adapter {adapter!r} already has checkpoint {first}"
            + (f" (and {len(later) - 1} more)" if len(later) > 1 else "")
            + f" past step {start_step}; this run would reach those names, and checkpoints are never overwritten",
            code="checkpoint_exists",
            reason="checkpoint_exists",
            hint=f"resume the newest one with --resume-checkpoint {later[-1].path.name}, or archive (move out of "
            f"{registry}) every checkpoint of {adapter!r} past step {start_step} before running again",
        )
