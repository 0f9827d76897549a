"""What every trainer's admission shares, and what callers read from an admitted job.

``AdmittedJob`` is the common part of an admitted job -- target, effective config, base model, identity and
precision, the loaded checkpoint when resuming -- with what the server and the CLI read from any kind: the step
counts, the revalidation ``fingerprint``, the resumed loss history and a memory estimate. ``base_model`` and
``job_fields`` are the two admission steps after the cheap checks: the model (the caller's, or loaded from
``model_path``), then deterministic algorithms, the precision policy and the identity of everything the run depends
on (which records that determinism).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.checkpoints import LoadedCheckpoint
from kiln.training import DataParallel

__all__ = ["AdmittedJob", "TrainingContext", "base_model", "job_fields", "single_process"]


@dataclass(frozen=True)
class TrainingContext:
    """Where a job trains and what its caller configured: the registry, the base model (loaded, or a path), the
    teacher registry, the checkpoint interval a request that omits one gets, and where a request may read."""

    registry: Path
    model_path: str | None = None
    loaded: Any = None  # kiln.model.LoadedModel: admit against it instead of loading model_path
    teachers_root: Path | None = None
    checkpoint_interval: int | None = None
    # the only directories a dataset_path may lie in, and base_adapter only in the registry (kiln.trainers._sources);
    # None: no restriction (a --local run reads its user's own files)
    data_roots: tuple[Path, ...] | None = None
    # the data-parallel group this process trains in (torchrun's ranks); one process by default
    data_parallel: DataParallel = field(default_factory=DataParallel)


@dataclass(kw_only=True)
class AdmittedJob:
    adapter_name: str
    registry: Path
    config: dict[str, Any]
    loaded: Any
    identity: Any
    precision: dict[str, Any]
    resume: LoadedCheckpoint | None = None
    dry_run: bool = False
    data_parallel: DataParallel = field(default_factory=DataParallel)  # rank 0 alone publishes
    kind: str = field(default="", init=False)
    request_log: Any = field(default=None, init=False, repr=False)  # kiln.trainers._lineage: this run's request

    @property
    def total_steps(self) -> int:
        raise NotImplementedError

    @property
    def schedule_steps(self) -> int:
        """The step positions the learning-rate schedule spans: ``total_steps`` unless a trainer counts otherwise."""
        return self.total_steps

    @property
    def start_step(self) -> int:
        return self.resume.manifest["progress"]["global_step"] if self.resume else 0

    @property
    def data_sha256(self) -> str:
        """The digest of the training data this job was admitted with."""
        raise NotImplementedError

    def identity_manifest(self) -> dict[str, Any]:
        """The checkpoint manifest of this run without progress, files and time: what a resume must match."""
        raise NotImplementedError

    def fingerprint(self) -> dict[str, Any]:
        """What revalidation at dequeue compares with the admission: data, seed, resume checkpoint (and what the
        kind adds)."""
        return {"data_sha256": self.data_sha256, "seed": str(self.config["seed"]), "checkpoint": self._checkpoint()}

    def _checkpoint(self) -> dict[str, Any] | None:
        if self.resume is None:
            return None
        digest = hashlib.sha256((self.resume.path / "checkpoint_manifest.json").read_bytes()).hexdigest()
        return {"name": self.resume.path.name, "manifest_sha256": digest}

    def replay_config(self, requested: dict[str, Any]) -> dict[str, Any]:
        """The config a replay of this job sends (a server's dequeue, a rank of ``kiln train --local``): the effective
        config, every default resolved and the seed filled in, with the ``requested`` config's resume checkpoint."""
        config = dict(self.config)
        if requested.get("resume_checkpoint") is not None:
            config["resume_checkpoint"] = requested["resume_checkpoint"]
        return config

    def resumed_history(self) -> list[dict[str, Any]]:
        """The loss curve up to the resume checkpoint, as job-detail entries (empty when the kind reports none)."""
        return []

    def memory_estimate(self) -> int | None:
        """A coarse upper bound of the run's extra host memory in bytes (None: no estimate for this kind)."""
        return None


def single_process(context: TrainingContext, kind: str) -> None:
    """Refuse a data-parallel group for a kind that trains in one process only (GRPO, OPD)."""
    if context.data_parallel.active:
        from kiln.errors import RequestError

        raise RequestError(
            f"{kind} trains in one process; data parallelism (world size {context.data_parallel.world_size}) is "
            "available for sft only",
            code="training_backend_unsupported",
            hint="run this job with nproc_per_node 1 on one node",
        )


def base_model(model_path: str | None, loaded: Any) -> Any:
    """The caller's loaded base model, or the one at ``model_path`` (the built-in tiny model by default)."""
    if loaded is not None:
        return loaded
    from kiln.model import load_base_model, resolve_model_path

    path, is_default = resolve_model_path(model_path)
    return load_base_model(path, is_default=is_default)


def job_fields(
    adapter_name: str,
    registry: Path,
    config: dict[str, Any],
    loaded: Any,
    *,
    optimizer_kind: str | None = None,
    data_parallel: DataParallel | None = None,
) -> dict[str, Any]:
    """The ``AdmittedJob`` fields of a run on ``loaded``: target, effective config (with ``lora_target_modules``
    resolved against the model: the request's, checked, or the architecture's default), the model, and the
    precision policy and identity -- deterministic algorithms switched on first (the provenance records it);
    ``data_parallel``: the process(es) that will train -- their number and intra-op threads, when admission runs in
    another process (a server's, ``kiln train --local`` of several ranks)."""
    import torch

    from kiln.model import capture_identity, training_precision
    from kiln.training import target_modules

    config = {**config, "lora_target_modules": target_modules(loaded.model, config.get("lora_target_modules"))}

    torch.use_deterministic_algorithms(True)
    precision = training_precision(optimizer_kind=optimizer_kind or config["optimizer"]["kind"])
    data_parallel = data_parallel or DataParallel()
    identity = capture_identity(
        loaded.path, loaded.tokenizer, training_policy=precision, intra_op_threads=data_parallel.threads
    )
    return {
        "adapter_name": adapter_name,
        "registry": registry,
        "config": config,
        "loaded": loaded,
        "identity": identity,
        "precision": precision,
        "data_parallel": data_parallel,
    }
