"""What every kind's effective configuration shares: typed, frozen, built from the generated config model.

A request's ``config`` is loaded into its generated model at the door (``SftConfig``, ``GrpoConfig``, ``OpdConfig``
of ``kiln_contracts``: schema-valid, numbers in their canonical type, every schema ``default`` in place). Each
trainer's resolver (``kiln.trainers.sft.resolve_config`` ...) turns that model into its frozen effective
configuration, an ``EffectiveConfig`` subclass, from components -- ``kiln.training.Schedule`` (the learning-rate
schedule), ``Muon`` | ``AdamW`` | ``Sgd`` (the optimizer) -- and these:

* ``Echo``: an ECHO term (GRPO's ``loss.echo``, OPD's ``echo``; its loss is ``kiln.training.echo``);

* ``common_members``: the members every kind resolves alike -- the effective seed (or the checkpoint's), the
  learning rate (``x-kiln-default-by`` the optimizer kind), the LoRA shape under the scale guardrail, the base
  adapter, the checkpoint interval (the caller's when the request has none), the batch shape;
* ``check_run_bounds``: at most ``MAX_TOTAL_STEPS`` optimizer steps per job, no row longer than the context
  (``context_length``: the model's).

``to_json()`` of an effective configuration is the ``effective_config`` a checkpoint manifest, a receipt and a
replay request record (canonical JSON: sorted keys, so member order does not matter).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict

from kiln_contracts.models.kiln_common_v1_schema import U64, DecimalU64, NonEmptyString, PositiveInteger
from kiln_contracts.models.kiln_control_plane_v1_schema import (
    AdamWOptimizer,
    EchoConfig,
    GradientCheckpointing,
    LearningRate,
    LoraTargetModules,
    LrScheduler,
    MuonOptimizer,
    Quantization,
    SgdOptimizer,
    TrainingDevice,
    TrainingPrecision,
)

from kiln.documents.jsonio import JsonObject
from kiln.errors import InternalError, RequestError
from kiln.training._defaults import default_by
from kiln.training._memory import MemorySettings
from kiln.training._optim import Optimizer, resolve_optimizer
from kiln.training._schedule import Schedule
from kiln.training._seeds import resolve_seed

if TYPE_CHECKING:
    from kiln.model import LoadedModel

__all__ = [
    "MAX_ALPHA_OVER_RANK",
    "MAX_TOTAL_STEPS",
    "CommonMembers",
    "ConfigModel",
    "Echo",
    "EffectiveConfig",
    "check_run_bounds",
    "common_members",
    "context_length",
    "refuse",
]

MAX_ALPHA_OVER_RANK = 2.0
MAX_TOTAL_STEPS = 1_000_000  # optimizer steps of one job; the schema bounds epochs, rows and the rest


def refuse(field: str, message: str, *, code: str = "training_invalid_request", hint: str | None = None) -> None:
    """Refuse the config member ``field`` (dotted for nested members): ``field: message``, pointing at it."""
    raise RequestError(f"{field}: {message}", code=code, hint=hint, pointer="/config/" + field.replace(".", "/"))


# ----------------------------------------------------------------------------- ECHO


@dataclass(frozen=True)
class Echo:
    """An ECHO term: ``lam`` times the cross-entropy of the observation tokens, which ``env_mask_mode`` selects;
    ``warning_filter`` drops warning tokens from them."""

    lam: float
    env_mask_mode: str
    warning_filter: bool

    @classmethod
    def resolve(cls, model: EchoConfig | None) -> Echo | None:
        """The term of an ``EchoConfig`` with its defaults (the schema bounds ``lambda`` at 0); None: ECHO off."""
        if model is None:
            return None
        return cls(lam=model.lambda_, env_mask_mode=model.env_mask_mode.value, warning_filter=model.warning_filter)

    def to_json(self) -> JsonObject:
        return {"env_mask_mode": self.env_mask_mode, "lambda": self.lam, "warning_filter": self.warning_filter}


# ----------------------------------------------------------------------------- the members every kind has


class CommonMembers(TypedDict):
    """The ``EffectiveConfig`` members every kind resolves alike (``common_members``)."""

    output_name: str
    seed: int
    learning_rate: float
    lr_scheduler: Schedule
    optimizer: Optimizer
    lora_rank: int
    lora_alpha: float
    lora_target_modules: tuple[str, ...] | None
    allow_high_lora_scale: bool
    base_adapter: str | None
    checkpoint_interval: int | None
    micro_batch_size: int
    gradient_accumulation_steps: int
    precision: str
    gradient_checkpointing: str
    quantization: str
    device: str


@dataclass(frozen=True, kw_only=True)
class EffectiveConfig:
    """The members every kind's effective configuration has; a subclass adds its own and writes ``to_json``."""

    output_name: str
    seed: int
    learning_rate: float
    lr_scheduler: Schedule
    optimizer: Optimizer
    lora_rank: int
    lora_alpha: float
    lora_target_modules: tuple[str, ...] | None  # None until admission resolves them against the model
    allow_high_lora_scale: bool
    base_adapter: str | None
    checkpoint_interval: int | None
    micro_batch_size: int
    gradient_accumulation_steps: int
    # the memory settings: as requested (or the caller's default, possibly "auto") until admission resolves them
    # against the model and the memory planner: precision fp32 | bf16, gradient_checkpointing on | off
    precision: str
    gradient_checkpointing: str
    quantization: str
    # where the job computes, as requested (or the caller's default): auto | cpu | cuda | cuda:N. Not an effective
    # config member: the planning identity's runtime_device and, on CUDA, the execution envelope record where it ran
    device: str = "auto"

    @property
    def targets(self) -> list[str]:
        """The resolved LoRA targets (admission fills them in before anything reads them)."""
        if self.lora_target_modules is None:
            raise AssertionError("lora_target_modules are resolved against the model at admission")
        return list(self.lora_target_modules)

    @property
    def rows_per_step(self) -> int:
        """Rows (SFT) or candidates (OPD) an optimizer step takes in one process."""
        return self.micro_batch_size * self.gradient_accumulation_steps

    def common_json(self) -> JsonObject:
        """The shared members as the effective configuration records them."""
        return {
            "learning_rate": self.learning_rate,
            "lr_scheduler": self.lr_scheduler.to_json(),
            "lora_rank": self.lora_rank,
            "lora_alpha": self.lora_alpha,
            "lora_target_modules": None if self.lora_target_modules is None else list(self.lora_target_modules),
            "allow_high_lora_scale": self.allow_high_lora_scale,
            "output_name": self.output_name,
            "base_adapter": self.base_adapter,
            "checkpoint_interval": self.checkpoint_interval,
            "seed": self.seed,
            "optimizer": self.optimizer.to_json(),
            "micro_batch_size": self.micro_batch_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "precision": self.precision,
            "gradient_checkpointing": self.gradient_checkpointing,
            "quantization": self.quantization,
        }

    def to_json(self) -> JsonObject:
        raise NotImplementedError


class ConfigModel(Protocol):
    """The members of the generated ``SftConfig``, ``GrpoConfig`` and ``OpdConfig`` that ``common_members`` reads."""

    @property
    def seed(self) -> DecimalU64 | U64 | None: ...
    @property
    def learning_rate(self) -> LearningRate | None: ...
    @property
    def lr_scheduler(self) -> LrScheduler: ...
    @property
    def optimizer(self) -> SgdOptimizer | AdamWOptimizer | MuonOptimizer: ...
    @property
    def lora_rank(self) -> int: ...
    @property
    def lora_alpha(self) -> float: ...
    @property
    def lora_target_modules(self) -> LoraTargetModules | None: ...
    @property
    def allow_high_lora_scale(self) -> bool: ...
    @property
    def base_adapter(self) -> NonEmptyString | None: ...
    @property
    def checkpoint_interval(self) -> PositiveInteger | None: ...
    @property
    def micro_batch_size(self) -> int: ...
    @property
    def gradient_accumulation_steps(self) -> int: ...
    @property
    def precision(self) -> TrainingPrecision | None: ...
    @property
    def gradient_checkpointing(self) -> GradientCheckpointing | None: ...
    @property
    def quantization(self) -> Quantization | None: ...
    @property
    def device(self) -> TrainingDevice | None: ...


def common_members(
    config: ConfigModel,
    definition: str,
    *,
    adapter_name: str,
    seed: int | None,
    checkpoint_interval: int | None,
    memory: MemorySettings | None = None,
) -> CommonMembers:
    """The shared members of a config ``model`` of ``definition`` (``SftConfig``, ``GrpoConfig``, ``OpdConfig``).

    ``seed``: the checkpoint's when resuming (authoritative), else the request's or a fresh one is drawn.
    ``checkpoint_interval``: what a request without one gets (the server's ``training.checkpoint_interval``).
    ``memory``: the precision, activation checkpointing, quantization and device a request without them gets.
    The LoRA scale guardrail refuses ``lora_alpha / lora_rank`` above 2 unless ``allow_high_lora_scale``."""
    optimizer = resolve_optimizer(config.optimizer)
    try:
        effective_seed = seed if seed is not None else resolve_seed(None if config.seed is None else config.seed.root)
    except ValueError as exc:
        raise RequestError(str(exc), code="training_invalid_request") from None
    rank, alpha = config.lora_rank, config.lora_alpha
    if alpha / rank > MAX_ALPHA_OVER_RANK and not config.allow_high_lora_scale:
        refuse(
            "lora_alpha",
            f"unsafe_lora_scale: lora_alpha / lora_rank = {alpha / rank:g} exceeds {MAX_ALPHA_OVER_RANK:g}",
            hint="lower lora_alpha, raise lora_rank, or set allow_high_lora_scale",
        )
    rate = config.learning_rate
    learning_rate = (
        float(rate.root)
        if rate is not None
        else float(default_by(definition, "learning_rate", {"optimizer": {"kind": optimizer.kind}}))
    )
    targets = config.lora_target_modules
    interval = config.checkpoint_interval
    defaults = memory or MemorySettings()
    base = config.base_adapter
    return CommonMembers(
        output_name=adapter_name,
        seed=effective_seed,
        learning_rate=learning_rate,
        lr_scheduler=Schedule.resolve(config.lr_scheduler),
        optimizer=optimizer,
        lora_rank=rank,
        lora_alpha=alpha,
        lora_target_modules=None if targets is None else tuple(t.root for t in targets.root),
        allow_high_lora_scale=config.allow_high_lora_scale,
        base_adapter=None if base is None else str(base.root),
        checkpoint_interval=checkpoint_interval if interval is None else int(interval.root),
        micro_batch_size=config.micro_batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        precision=defaults.precision if config.precision is None else config.precision.value,
        gradient_checkpointing=(
            defaults.gradient_checkpointing
            if config.gradient_checkpointing is None
            else config.gradient_checkpointing.value
        ),
        quantization=defaults.quantization if config.quantization is None else config.quantization.value,
        device=defaults.device if config.device is None else config.device.root,
    )


# ----------------------------------------------------------------------------- bounds that need the data


def check_run_bounds(
    *, total_steps: int, steps_rule: str, rows: Iterable[tuple[str, int]], context: int | None, margin: int = 0
) -> None:
    """Refuse a job of more than ``MAX_TOTAL_STEPS`` optimizer steps, or with a row longer than ``context`` tokens
    (``rows`` yields a label and a token count; ``margin`` tokens must stay free, e.g. for a rollout)."""
    if total_steps > MAX_TOTAL_STEPS:
        raise RequestError(
            f"total_steps: this job would run {total_steps} optimizer steps ({steps_rule}); the limit is "
            f"{MAX_TOTAL_STEPS}",
            code="training_invalid_request",
            hint="train fewer epochs or fewer rows per job",
        )
    if context is None:
        return
    limit = context - margin
    for label, tokens in rows:
        if tokens > limit:
            room = f" with room for {margin} generated token" if margin else ""
            raise RequestError(
                f"tokens_per_row: {label} has {tokens} tokens; the limit is the model's context length of {context} "
                f"tokens{room}",
                code="training_invalid_request",
                hint="shorten or split the conversation",
            )


def context_length(loaded: LoadedModel) -> int | None:
    """The model's context length in tokens (None when the model declares none)."""
    from kiln.model import max_positions

    try:
        return max_positions(loaded.config, loaded.tokenizer)
    except InternalError:
        return None
