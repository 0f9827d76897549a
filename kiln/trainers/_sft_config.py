"""The effective SFT configuration: schema, defaults and the refusals of the ``native_online_lora_v1`` profile.

``effective_config(config, adapter_name)`` validates an ``SftConfig`` object, fills every default the trainer
depends on (receipts, checkpoints and resume comparisons see one canonical object), resolves the seed and the
learning rate, and refuses what the profile does not execute (MTP, shape conversion, anomaly detection, the
post-training smoke test) and a LoRA scale above the guardrail unless ``allow_high_lora_scale``. The defaults
are the schema's (``schema_defaults("SftConfig")``, the learning rate by optimizer kind through ``default_by``).
"""

from __future__ import annotations

from typing import Any

from kiln import contracts
from kiln.errors import RequestError
from kiln.training import default_by, effective_optimizer, resolve_seed, schema_defaults

PROFILE = schema_defaults("SftConfig")["training_profile"]  # the only SftTrainingProfile
MAX_ALPHA_OVER_RANK = 2.0

__all__ = ["MAX_ALPHA_OVER_RANK", "PROFILE", "effective_config"]


def effective_config(config: dict[str, Any], adapter_name: str) -> dict[str, Any]:
    """Fill defaults and resolve the seed and learning rate; refuse what the profile does not do."""
    problems = contracts.problems("SftConfig", config)
    if problems:
        detail = "; ".join(f"{p.pointer or '/'}: {p.message}" for p in problems)
        raise RequestError(
            f"invalid SFT config: {detail}", code="training_invalid_request", pointer=problems[0].pointer
        )
    for flag in ("train_mtp", "allow_adapter_shape_conversion", "detect_anomaly"):
        if config.get(flag):
            raise RequestError(f"{flag} is not supported by the {PROFILE} profile", code="training_backend_unsupported")
    for flag, what in (
        ("adapter_smoke_test", "the post-training adapter smoke test"),
        ("adapter_smoke_prompts", "the post-training adapter smoke test"),
    ):
        if config.get(flag):
            raise RequestError(f"{flag}: {what} is not available yet", code="training_backend_unsupported")
    defaults = schema_defaults("SftConfig")
    try:
        optimizer = effective_optimizer(config.get("optimizer", defaults["optimizer"]))
        seed = resolve_seed(config.get("seed"))
    except ValueError as exc:
        raise RequestError(str(exc), code="training_invalid_request") from None
    rank = int(config.get("lora_rank", defaults["lora_rank"]))
    interval = config.get("checkpoint_interval", defaults["checkpoint_interval"])
    alpha = float(config.get("lora_alpha", defaults["lora_alpha"]))
    allow_high = bool(config.get("allow_high_lora_scale", defaults["allow_high_lora_scale"]))
    if alpha / rank > MAX_ALPHA_OVER_RANK and not allow_high:
        raise RequestError(
            f"unsafe_lora_scale: lora_alpha / lora_rank = {alpha / rank:g} exceeds {MAX_ALPHA_OVER_RANK:g}",
            code="training_invalid_request",
            hint="lower lora_alpha, raise lora_rank, or set allow_high_lora_scale",
        )
    learning_rate = config.get("learning_rate") or default_by("SftConfig", "learning_rate", {"optimizer": optimizer})
    return {
        "training_profile": config.get("training_profile", defaults["training_profile"]),
        "invalid_row_policy": config.get("invalid_row_policy", defaults["invalid_row_policy"]),
        "epochs": int(config.get("epochs", defaults["epochs"])),  # JSON Schema integers may arrive as 3.0
        "learning_rate": float(learning_rate),
        "lora_rank": rank,
        "lora_alpha": alpha,
        "allow_high_lora_scale": allow_high,
        "output_name": adapter_name,
        "base_adapter": config.get("base_adapter", defaults["base_adapter"]),
        "checkpoint_interval": None if interval is None else int(interval),
        "seed": seed,
        "optimizer": optimizer,
    }
