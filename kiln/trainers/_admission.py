"""What every trainer's admission shares, and what callers read from an admitted job.

``AdmittedJob`` is the common part of an admitted job -- target, typed effective config, base model, identity and
precision, the memory plan, the loaded checkpoint when resuming -- with what the server and the CLI read from any
kind: the step counts, the revalidation ``fingerprint`` and the resumed loss history. The admission steps after the
cheap checks:

* ``base_model``: the caller's model, or the one at ``model_path`` opened -- tokenizer, config and weight headers,
  no weight loaded yet, so a run that will not fit is refused before it spends the memory;
* ``planned_model``: once the data is read (its longest sequence known), the precision resolved (``auto``: the
  checkpoint's own dtype), the memory planned and held to the budget (``kiln.training.plan_memory``; refusal:
  ``memory_budget_exceeded`` naming the settings that fit), activation checkpointing resolved (``auto``: on exactly
  when needed; a resume keeps its checkpoint's), the C heap's mmap threshold fixed (``kiln.host.allocator``), and
  the weights loaded in that precision (NF4 when quantized);
* ``run_identity``: deterministic algorithms, the precision policy and the identity of everything the run depends on
  (which records that determinism); ``with_targets`` resolves the LoRA targets against the model.
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
from kiln.host.allocator import fix_mmap_threshold
from kiln.training import DataParallel, EffectiveConfig, MemoryBudget, MemoryPlan, MemorySettings, Optimizer

if TYPE_CHECKING:
    from kiln.model import LoadedModel, ModelIdentity
    from kiln.trainers._lineage import RequestLog
    from kiln.trainers._resume import ResumePoint

__all__ = [
    "AdmittedJob",
    "RunIdentity",
    "TrainingContext",
    "base_model",
    "planned_model",
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
    # what a request without precision, gradient_checkpointing or quantization gets, and the memory budget
    memory: MemorySettings = field(default_factory=MemorySettings)


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
    sharding: ClassVar[str]  # the kind's data-parallel rule (kiln.training.DataParallel)
    adapter_name: str
    registry: Path
    config: C
    loaded: LoadedModel
    run: RunIdentity
    resume: LoadedCheckpoint | None = None
    dry_run: bool = False
    memory_plan: MemoryPlan | None = None  # the planner's estimate and budget (None: admitted without a plan)
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
    def device(self) -> str:
        """Where the job computes: ``cpu`` or ``cuda:N`` (resolved at admission)."""
        return self.loaded.device

    @property
    def data_parallel_plan(self) -> JsonObject | None:
        """The ``DataParallelPlan`` its planning identity, receipt and manifest record: the group's world size and
        backend under the kind's sharding rule; None for one process (the record is omitted)."""
        return self.data_parallel.plan(self.sharding)

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
        config["device"] = self.config.device  # the setting (not an effective config member): each rank resolves it
        if resume_checkpoint is not None:
            config["resume_checkpoint"] = resume_checkpoint
        return config

    def resumed_history(self) -> list[JsonObject]:
        """The loss curve up to the resume checkpoint, as job-detail entries (empty when the kind reports none)."""
        return []

    @property
    def checkpoint_segments(self) -> int | None:
        """The decoder layers recomputed one by one in the backward pass (None: activation checkpointing off)."""
        if self.config.gradient_checkpointing != "on" or self.memory_plan is None:
            return None
        return self.memory_plan.shape.layers

    def release_model(self) -> None:
        """Drop the (trained) weights now, not when the job goes; the tokenizer and paths stay readable."""
        self.loaded = dataclasses.replace(self.loaded, model=None)


def single_process(context: TrainingContext, kind: str) -> None:
    """Refuse a data-parallel group for a kind that trains in one process only (a ``Trainer`` without
    ``data_parallel``)."""
    if context.data_parallel.active:
        raise RequestError(
            f"{kind} trains in one process; data parallelism (world size {context.data_parallel.world_size}) is "
            "not available for it",
            code="training_backend_unsupported",
            hint="run this job with nproc_per_node 1 on one node",
        )


def base_model(context: TrainingContext) -> LoadedModel:
    """The caller's base model, or the one at ``model_path`` (the built-in tiny model by default) opened: tokenizer,
    config and weight headers, its weights loaded later by ``planned_model``."""
    if context.loaded is not None:
        return context.loaded
    from kiln.model import open_base_model, resolve_model_path

    path, is_default = resolve_model_path(context.model_path)
    return open_base_model(path, is_default=is_default)


def requested_precision(value: object, context: TrainingContext) -> str:
    """A config's ``precision`` member (a generated enum or None) or the context's default."""
    return context.memory.precision if value is None else str(getattr(value, "value", value))


def planned_model(
    loaded: LoadedModel,
    cfg: E,
    context: TrainingContext,
    *,
    tokens: int,
    loss_logits: int,
    point: ResumePoint | None,
    segments: int | None = None,
    seq_len_field: str | None = None,
    check: bool = True,
) -> tuple[LoadedModel, E, MemoryPlan]:
    """The run's memory settings resolved, its memory planned, and its base weights loaded accordingly.

    ``tokens``: the longest sequence one forward sees; ``loss_logits``: the float32 logits the loss holds at once; ``point``: the checkpoint resumed (its activation checkpointing is kept when the request says ``auto``);
    ``segments``: the request's ``grad_checkpoint_segments``; ``check``: refuse a plan over budget (a dry run trains
    nothing and is not held to one)."""
    from kiln.model import apply_determinism, resolve_device, resolve_precision
    from kiln.training import ModelShape, plan_memory

    device = resolve_device(cfg.device)  # a device this machine lacks is refused before any weight loads
    apply_determinism(device)  # before anything initialises CUDA
    precision = resolve_precision(cfg.precision, loaded)
    checkpointing = cfg.gradient_checkpointing
    if checkpointing == "auto" and point is not None and point.gradient_checkpointing in ("on", "off"):
        checkpointing = point.gradient_checkpointing
    if loaded.weights is None or loaded.config is None:
        raise AssertionError("planning needs the model's config and weight headers (kiln.model.open_base_model)")
    shape = ModelShape.of(loaded.config, loaded.weights)
    if segments is not None:
        if checkpointing == "off":
            raise RequestError(
                "grad_checkpoint_segments: activation checkpointing is off (gradient_checkpointing off)",
                code="training_invalid_request",
                pointer="/config/grad_checkpoint_segments",
                hint="omit grad_checkpoint_segments, or set gradient_checkpointing on",
            )
        if segments != shape.layers:
            raise RequestError(
                f"grad_checkpoint_segments: Kiln recomputes every decoder layer as its own segment, so the segment "
                f"count is the model's {shape.layers} layers, not {segments}",
                code="training_backend_unsupported",
                pointer="/config/grad_checkpoint_segments",
                hint=f"omit grad_checkpoint_segments or set it to {shape.layers}",
            )
        checkpointing = "on"
    plan = plan_memory(
        shape,
        precision=precision,
        quantization=cfg.quantization,
        gradient_checkpointing=checkpointing,
        lora_rank=cfg.lora_rank,
        targets=cfg.lora_target_modules,
        optimizer_kind=cfg.optimizer.kind,
        micro_batch_size=cfg.micro_batch_size,
        tokens=tokens,
        loss_logits=loss_logits,
        budget=budget_for(context, device),
        seq_len_field=seq_len_field,
        processes=context.data_parallel.world_size,
    )
    if check:
        plan.check()
    cfg = dataclasses.replace(cfg, precision=precision, gradient_checkpointing=plan.run.gradient_checkpointing)
    fix_mmap_threshold()  # freed activations go back to the system: the second step's peak stays at the first's
    return load_weights_for(loaded, cfg, device), cfg, plan


def budget_for(context: TrainingContext, device: str) -> MemoryBudget:
    """The budget of a job on ``device``: the configured limit, else the device's free memory, else the host's
    available memory -- beside a server, moved by what that source could not see of its serving copy."""
    from kiln.model import device_free_bytes
    from kiln.training import memory_budget

    budget = memory_budget(context.memory.memory_limit_bytes, device_free=device_free_bytes(device))
    serving = context.memory.serving_copy
    return budget if serving is None else serving.budget(budget, device)


def load_weights_for(loaded: LoadedModel, cfg: EffectiveConfig, device: str) -> LoadedModel:
    """``loaded`` with its weights in the precision and quantization ``cfg`` resolved, on ``device`` (kept when
    they already are)."""
    from kiln.model import load_weights

    return load_weights(loaded, precision=cfg.precision, quantization=cfg.quantization, device=device)


def run_identity(
    loaded: LoadedModel,
    optimizer: Optimizer,
    data_parallel: DataParallel,
    precision: str = "fp32",
    *,
    device: str | None = None,
) -> RunIdentity:
    """Deterministic algorithms switched on (the provenance records it), then the precision policy of ``optimizer``
    under ``precision`` and the identity of the model and of the process(es) that will train -- their number and
    intra-op threads, when admission runs in another process (a server's, ``kiln train --local`` of several ranks)."""
    from kiln.model import apply_determinism, capture_identity, training_precision
    from kiln.training import backend_for

    device = loaded.device if device is None else device  # OPD captures it before the weights load
    apply_determinism(device)
    if data_parallel.active:  # the ranks sum tensors where they train: gloo on the CPU, NCCL on CUDA
        data_parallel = dataclasses.replace(data_parallel, backend=backend_for(device))
    compute = "bf16" if precision == "bf16" else "f32"
    policy = training_precision(optimizer_kind=optimizer.kind, activation_dtype=compute)
    identity = capture_identity(
        loaded.path,
        loaded.tokenizer,
        device=device,
        inference_dtype=compute,
        training_policy=policy,
        intra_op_threads=data_parallel.threads,
    )
    return RunIdentity(identity=identity, precision=policy, data_parallel=data_parallel)


def with_targets(config: E, loaded: LoadedModel) -> E:
    """``config`` with ``lora_target_modules`` resolved against the model: the request's, checked, or the
    architecture's default."""
    from kiln.training import target_modules

    requested = None if config.lora_target_modules is None else list(config.lora_target_modules)
    return dataclasses.replace(config, lora_target_modules=tuple(target_modules(loaded.model, requested)))
