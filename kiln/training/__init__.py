"""Components shared by the trainers: the typed effective-configuration parts (schedule, optimizer, ECHO, the members
every kind resolves alike, the run bounds), LoRA setup and warm start, seeds, failure categories, training state as
checkpoint files and back, the receipt base."""

from __future__ import annotations

from kiln.training._config import (
    MAX_ALPHA_OVER_RANK,
    MAX_TOTAL_STEPS,
    CommonMembers,
    ConfigModel,
    Echo,
    EffectiveConfig,
    check_run_bounds,
    common_members,
    context_length,
    refuse,
)
from kiln.training._data_parallel import (
    GRPO_SHARDING_RULE,
    OPD_SHARDING_RULE,
    SHARDING_RULE,
    DataParallel,
    RanksDivergedError,
    StepSync,
    backend_for,
)
from kiln.training._defaults import default_by
from kiln.training._failures import classify_failure
from kiln.training._head import ModelHead, decoder_of, model_head
from kiln.training._lora import (
    attach_lora,
    lora_delta_norms,
    lora_grad_norms,
    lora_parameters,
    module_of,
    target_modules,
)
from kiln.training._memory import (
    MemoryBudget,
    MemoryPlan,
    MemorySettings,
    ModelShape,
    ServingCopy,
    budget_beside_serving_copy,
    memory_budget,
    plan_memory,
    serving_copy_bytes_during,
    serving_copy_released,
)
from kiln.training._optim import AdamW, Muon, Optimizer, Sgd, resolve_optimizer
from kiln.training._receipt import receipt_base
from kiln.training._recompute import checkpoint_layers
from kiln.training._schedule import Schedule
from kiln.training._seeds import resolve_seed
from kiln.training._state import (
    ADAPTER_FILE,
    CUDA_RNG_ALGORITHM,
    CUDA_RNG_FILE,
    CUDA_RNG_STREAM,
    LORA_INIT_ALGORITHM,
    OPTIMIZER_FILE,
    adapter_tensors,
    auxiliary_identity,
    cuda_rng_capture,
    cuda_rng_position,
    cuda_rng_restore,
    cuda_rng_stream,
    encode_tensors,
    optimizer_tensors,
    planning_identity,
    restore_adapter,
    restore_optimizer,
)
from kiln.training._warm_start import warm_start

__all__ = [
    "ADAPTER_FILE",
    "CUDA_RNG_ALGORITHM",
    "CUDA_RNG_FILE",
    "CUDA_RNG_STREAM",
    "GRPO_SHARDING_RULE",
    "LORA_INIT_ALGORITHM",
    "MAX_ALPHA_OVER_RANK",
    "MAX_TOTAL_STEPS",
    "OPD_SHARDING_RULE",
    "OPTIMIZER_FILE",
    "SHARDING_RULE",
    "AdamW",
    "CommonMembers",
    "ConfigModel",
    "DataParallel",
    "Echo",
    "EffectiveConfig",
    "MemoryBudget",
    "MemoryPlan",
    "MemorySettings",
    "ModelHead",
    "ModelShape",
    "Muon",
    "Optimizer",
    "RanksDivergedError",
    "Schedule",
    "ServingCopy",
    "Sgd",
    "StepSync",
    "adapter_tensors",
    "attach_lora",
    "auxiliary_identity",
    "backend_for",
    "budget_beside_serving_copy",
    "check_run_bounds",
    "checkpoint_layers",
    "classify_failure",
    "common_members",
    "context_length",
    "cuda_rng_capture",
    "cuda_rng_position",
    "cuda_rng_restore",
    "cuda_rng_stream",
    "decoder_of",
    "default_by",
    "encode_tensors",
    "lora_delta_norms",
    "lora_grad_norms",
    "lora_parameters",
    "memory_budget",
    "model_head",
    "module_of",
    "optimizer_tensors",
    "plan_memory",
    "planning_identity",
    "receipt_base",
    "refuse",
    "resolve_optimizer",
    "resolve_seed",
    "restore_adapter",
    "restore_optimizer",
    "serving_copy_bytes_during",
    "serving_copy_released",
    "target_modules",
    "warm_start",
]
