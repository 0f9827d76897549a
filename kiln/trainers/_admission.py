"""What every trainer's admission shares, and what callers read from an admitted job.

``AdmittedJob`` is the common part of an admitted job -- target, typed effective config, base model, identity and
precision, the loaded checkpoint when resuming -- with what the server and the CLI read from any kind: the step
counts, the revalidation ``fingerprint``, the resumed loss history and a memory estimate. ``base_model`` and
``run_identity`` are the two admission steps after the cheap checks: the model (the caller's, or loaded from
``model_path``), then deterministic algorithms, the precision policy and the identity of everything the run depends
on (which records that determinism); ``with_targets`` resolves the LoRA targets against the model.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Generic, TypeVar

from kiln.checkpoints import LoadedCheckpoint
from kiln.documents.jsonio import JsonObject
from kiln.errors import RequestError
from kiln.training import DataParallel, EffectiveConfig, Optimizer

if TYPE_CHECKING:
    from kiln.model import LoadedModel, ModelIdentity
    from kiln.trainers._lineage import RequestLog

__all__ = [
    "AdmittedJob",
    "RunIdentity",
    "TrainingContext",
    "base_model",
    "run_identity",
    "single_process",
    "with_targets",
]

C = TypeVar("C", bound=EffectiveConfig, covariant=True)  # an AdmittedSft is an admitted job of some kind
E = TypeVar("E", bound=EffectiveConfig)


@dataclass(frozen=True)
class TrainingContext:
    """Where a job trains and what its caller configured: the registry, the base model (loaded, or a path), the
    teacher registry, the checkpoint interval a request that omits one gets, and where a request may read."""

    registry: Path
    model_path: str | None = None
    loaded: LoadedModel | None = None  # admit against it instead of loading model_path
    teachers_root: Path | None = None
    checkpoint_interval: int | None = None
    # the only directories a dataset_path may lie in, and base_adapter only in the registry (kiln.trainers._sources);
    # None: no restriction (a --local run reads its user's own files)
    data_roots: tuple[Path, ...] | None = None
    # the data-parallel group this process trains in (torchrun's ranks); one process by default
    data_parallel: DataParallel = field(default_factory=DataParallel)


@dataclass(frozen=True)
class RunIdentity:
    """What a run records about the model and the process: their identity, the precision policy, the ranks."""

    identity: ModelIdentity
    precision: JsonObject
    data_parallel: DataParallel


@dataclass(kw_only=True)
class AdmittedJob(Generic[C]):
    """An admitted job of some kind: the shared fields, and what every caller reads from any kind."""

    kind: ClassVar[str]
    adapter_name: str
    registry: Path
    config: C
    loaded: LoadedModel
    run: RunIdentity
    resume: LoadedCheckpoint | None = None
    dry_run: bool = False
    request_log: RequestLog | None = field(default=None, init=False, repr=False)  # this run's request record

    @property
    def identity(self) -> ModelIdentity:
        return self.run.identity

    @property
    def precision(self) -> JsonObject:
        return self.run.precision

    @property
    def data_parallel(self) -> DataParallel:
        return self.run.data_parallel

    @property
    def total_steps(self) -> int:
        raise NotImplementedError

    @property
    def schedule_steps(self) -> int:
        """The step positions the learning-rate schedule spans: ``total_steps`` unless a trainer counts otherwise."""
        return self.total_steps

    @property
    def start_step(self) -> int:
        return int(self.resume.manifest["progress"]["global_step"]) if self.resume else 0

    @property
    def data_sha256(self) -> str:
        """The digest of the training data this job was admitted with."""
        raise NotImplementedError

    def identity_manifest(self) -> JsonObject:
        """The checkpoint manifest of this run without progress, files and time: what a resume must match."""
        raise NotImplementedError

    def fingerprint(self) -> JsonObject:
        """What revalidation at dequeue compares with the admission: data, seed, resume checkpoint (and what the
        kind adds)."""
        return {"data_sha256": self.data_sha256, "seed": str(self.config.seed), "checkpoint": self._checkpoint()}

    def _checkpoint(self) -> JsonObject | None:
        if self.resume is None:
            return None
        digest = hashlib.sha256((self.resume.path / "checkpoint_manifest.json").read_bytes()).hexdigest()
        return {"name": self.resume.path.name, "manifest_sha256": digest}

    def replay_config(self, resume_checkpoint: str | None) -> JsonObject:
        """The config a replay of this job sends (a server's dequeue, a rank of ``kiln train --local``): the effective
        config, every default resolved and the seed filled in, with the requested resume checkpoint."""
        config = self.config.to_json()
        if resume_checkpoint is not None:
            config["resume_checkpoint"] = resume_checkpoint
        return config

    def resumed_history(self) -> list[JsonObject]:
        """The loss curve up to the resume checkpoint, as job-detail entries (empty when the kind reports none)."""
        return []

    def memory_estimate(self) -> int | None:
        """A coarse upper bound of the run's extra host memory in bytes (None: no estimate for this kind)."""
        return None

    def release_model(self) -> None:
        """Drop the (trained) weights now, not when the job goes; the tokenizer and paths stay readable."""
        self.loaded = dataclasses.replace(self.loaded, model=None)


def single_process(context: TrainingContext, kind: str) -> None:
    """Refuse a data-parallel group for a kind that trains in one process only (GRPO, OPD)."""
    if context.data_parallel.active:
        raise RequestError(
            f"{kind} trains in one process; data parallelism (world size {context.data_parallel.world_size}) is "
            "available for sft only",
            code="training_backend_unsupported",
            hint="run this job with nproc_per_node 1 on one node",
        )


def base_model(context: TrainingContext) -> LoadedModel:
    """The caller's loaded base model, or the one at ``model_path`` (the built-in tiny model by default)."""
    if context.loaded is not None:
        return context.loaded
    from kiln.model import load_base_model, resolve_model_path

    path, is_default = resolve_model_path(context.model_path)
    return load_base_model(path, is_default=is_default)


def run_identity(loaded: LoadedModel, optimizer: Optimizer, data_parallel: DataParallel) -> RunIdentity:
    """Deterministic algorithms switched on (the provenance records it), then the precision policy of ``optimizer``
    and the identity of the model and of the process(es) that will train -- their number and intra-op threads, when
    admission runs in another process (a server's, ``kiln train --local`` of several ranks)."""
    import torch

    from kiln.model import capture_identity, training_precision

    torch.use_deterministic_algorithms(True)
    precision = training_precision(optimizer_kind=optimizer.kind)
    identity = capture_identity(
        loaded.path, loaded.tokenizer, training_policy=precision, intra_op_threads=data_parallel.threads
    )
    return RunIdentity(identity=identity, precision=precision, data_parallel=data_parallel)


def with_targets(config: E, loaded: LoadedModel) -> E:
    """``config`` with ``lora_target_modules`` resolved against the model: the request's, checked, or the
    architecture's default."""
    from kiln.training import target_modules

    requested = None if config.lora_target_modules is None else list(config.lora_target_modules)
    return dataclasses.replace(config, lora_target_modules=tuple(target_modules(loaded.model, requested)))
