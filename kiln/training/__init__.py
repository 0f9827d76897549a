"""Components shared by the trainers: LoRA setup, optimizers, seeds, failure categories."""

from __future__ import annotations

from kiln.training._failures import TrainingFailedError, classify_failure
from kiln.training._lora import attach_lora, lora_delta_norms, lora_parameters, target_modules
from kiln.training._optim import DEFAULT_LEARNING_RATES, build_optimizer, effective_optimizer
from kiln.training._seeds import resolve_seed

__all__ = [
    "DEFAULT_LEARNING_RATES",
    "TrainingFailedError",
    "attach_lora",
    "build_optimizer",
    "classify_failure",
    "effective_optimizer",
    "lora_delta_norms",
    "lora_parameters",
    "resolve_seed",
    "target_modules",
]
