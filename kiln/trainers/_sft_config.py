"""The effective SFT configuration: schema, defaults and the refusals of the ``native_online_lora_v1`` profile.

``effective_config(config, adapter_name)`` validates an ``SftConfig`` object, fills every default the trainer
depends on (receipts, checkpoints and resume comparisons see one canonical object), resolves the seed and the
learning rate, and refuses what the profile does not execute (MTP, shape conversion, anomaly detection, the
post-training smoke test) and a LoRA scale above the guardrail unless ``allow_high_lora_scale``. The defaults
are the schema's (``schema_defaults("SftConfig")``, the learning rate by optimizer kind through ``default_by``).

The bounds that need the data live here too, for every kind (``check_run_bounds``): at most ``MAX_TOTAL_STEPS``
optimizer steps per job, and no row longer than the model's context length in tokens. The schema bounds the rest
(inline items, epochs, the learning rate).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kiln import contracts
from kiln.batch_plan import rows_per_step, steps_per_epoch
from kiln.errors import InternalError, RequestError
from kiln.training import default_by, effective_optimizer, effective_schedule, resolve_seed, schema_defaults

PROFILE = schema_defaults("SftConfig")["training_profile"]  # the only SftTrainingProfile
MAX_ALPHA_OVER_RANK = 2.0
MAX_TOTAL_STEPS = 1_000_000  # optimizer steps of one job (epochs x rows); 100,000 epochs are the schema's bound

__all__ = [
    "MAX_ALPHA_OVER_RANK",
    "MAX_TOTAL_STEPS",
    "PROFILE",
    "check_run_bounds",
    "check_sft_data",
    "context_length",
    "effective_config",
    "requested_targets",
    "resolve_max_seq_len",
]


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
        "lr_scheduler": effective_schedule(config.get("lr_scheduler")),
        "micro_batch_size": int(config.get("micro_batch_size", defaults["micro_batch_size"])),
        "gradient_accumulation_steps": int(
            config.get("gradient_accumulation_steps", defaults["gradient_accumulation_steps"])
        ),
        "group_by_length": bool(config.get("group_by_length", defaults["group_by_length"])),
        "lora_rank": rank,
        "lora_alpha": alpha,
        "lora_target_modules": requested_targets(config),
        "max_seq_len": config.get("max_seq_len", defaults["max_seq_len"]),
        "overlong_row_policy": config.get("overlong_row_policy", defaults["overlong_row_policy"]),
        "allow_high_lora_scale": allow_high,
        "output_name": adapter_name,
        "base_adapter": config.get("base_adapter", defaults["base_adapter"]),
        "checkpoint_interval": None if interval is None else int(interval),
        "seed": seed,
        "optimizer": optimizer,
    }


def requested_targets(config: dict[str, Any]) -> list[str] | None:
    """The requested LoRA targets (None: the model's default); ``job_fields`` resolves them against the model."""
    targets = config.get("lora_target_modules")
    return None if targets is None else [str(t) for t in targets]


def resolve_max_seq_len(config: dict[str, Any], loaded: Any) -> dict[str, Any]:
    """``config`` with ``max_seq_len`` resolved: the request's (at most the model's context length) or the context
    length itself (None when the model declares none)."""
    context = context_length(loaded)
    requested = config.get("max_seq_len")
    if requested is not None and context is not None and int(requested) > context:
        raise RequestError(
            f"max_seq_len {requested} exceeds the model's context length of {context} tokens",
            code="training_invalid_request",
            pointer="/config/max_seq_len",
            hint=f"use at most {context}, or omit max_seq_len for the context length",
        )
    return {**config, "max_seq_len": context if requested is None else int(requested)}


def context_length(loaded: Any) -> int | None:
    """The model's context length in tokens (None when the model declares none)."""
    from kiln.model import max_positions

    try:
        return max_positions(loaded.model, loaded.tokenizer)
    except InternalError:
        return None


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


def check_sft_data(config: dict[str, Any], examples: Iterable[Any], loaded: Any) -> None:
    """The SFT bounds that need the data: epochs x steps per epoch, and each kept row's tokens against the context."""
    examples = tuple(examples)
    rows = rows_per_step(config)
    per_epoch = steps_per_epoch(len(examples), rows)
    rule = f"{config['epochs']} epochs x {len(examples)} rows"
    if rows > 1:
        rule = f"{config['epochs']} epochs x {per_epoch} steps of {rows} of the {len(examples)} rows"
    check_run_bounds(
        total_steps=config["epochs"] * per_epoch,
        steps_rule=rule,
        rows=((f"row {ex.row_index + 1}", len(ex.input_ids)) for ex in examples),
        context=context_length(loaded),
    )
