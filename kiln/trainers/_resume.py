"""What every trainer does the same way around exact-resume checkpoints.

``resume_metadata`` is the cheap first half of resume admission, before any model work:
a path-safe target, the checkpoint named by ``resume_checkpoint`` read metadata-only, its
kind and adapter checked, and the seed taken from its ``lora-init`` stream (a conflicting
explicit seed is refused). ``optimizer_identity`` is the optimizer and scheduler part of a
manifest, identical for every kind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.checkpoints import inspect_checkpoint, resolve_checkpoint_path
from kiln.errors import CheckpointError
from kiln.publish import check_target
from kiln.training._state import OPTIMIZER_FILE

NAMES = {
    "sft": "an SFT job resumes only SFT checkpoints",
    "grpo": "a GRPO job resumes only GRPO checkpoints",
    "opd": "an OPD job resumes only OPD checkpoints",
}


def resume_metadata(registry: Path, adapter_name: str, config: dict[str, Any], kind: str) -> Path | None:
    """Pop ``resume_checkpoint`` from ``config``; when set, check the checkpoint's metadata and
    put its authoritative seed into ``config``. Returns the checkpoint path (None: a fresh run)."""
    from kiln.trainers.sft import _checkpoint_seed

    resume_value = config.pop("resume_checkpoint", None)
    if resume_value is None:
        return None
    check_target(registry, adapter_name)  # a path-safe name before it meets the file system
    checkpoint_path = resolve_checkpoint_path(registry, resume_value)
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
    config["seed"] = _checkpoint_seed(config, manifest, info.name)
    return checkpoint_path


def claim_target(registry: Path, adapter_name: str, checkpoint_path: Path | None) -> None:
    """A free, path-safe adapter name, and no checkpoint of it past where this run starts."""
    from kiln.trainers.sft import _refuse_later_checkpoints

    check_target(registry, adapter_name)
    start = inspect_checkpoint(checkpoint_path).manifest["progress"]["global_step"] if checkpoint_path else 0
    _refuse_later_checkpoints(registry, adapter_name, start)


def optimizer_identity(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The manifest's ``optimizer`` and ``scheduler`` objects at step 0 (constant learning rate)."""
    optimizer = cfg["optimizer"]
    stateful = optimizer["kind"] != "sgd"
    return (
        {
            "kind": optimizer["kind"],
            "step": 0,
            "hyperparameters": {
                "learning_rate": cfg["learning_rate"],
                **{k: v for k, v in optimizer.items() if k != "kind"},
            },
            **({"state_file": OPTIMIZER_FILE} if stateful else {}),
        },
        {"kind": "constant", "step": 0, "state": {"learning_rate": cfg["learning_rate"]}},
    )
