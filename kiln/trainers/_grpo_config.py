"""The effective GRPO configuration: schema, defaults and every refusal of spec/40.

``effective_grpo_config(config, adapter_name)`` validates a ``GrpoConfig`` object, fills
every default the trainer depends on (so receipts, checkpoints and resume comparisons see
one canonical object) and refuses what Kiln does not execute, naming the field:

* ``kl_reference_policy`` and its alias ``reference_policy`` together; the effective
  config always records ``kl_reference_policy`` (an EMA reference with both members, their
  defaults filling what was omitted);
* a KL term against reference ``none`` (``kl_coeff`` > 0 with an estimator other than
  ``none``);
* ``reward_filter_var_min`` > ``reward_filter_var_max``;
* ``loss.opd`` (``training_backend_unsupported``), ``loss.no_policy_loss`` without an ECHO
  term of positive ``lambda``;
* the LoRA scale guardrail, shape conversion, MTP-like reference knobs, as for SFT.

Every default is the schema's: ``schema_defaults("GrpoConfig")`` and those of its
sub-objects (``GrpoLossConfig``, ``EchoConfig``, the ``ema`` branch of ``KlReferencePolicy``),
the learning rate by optimizer kind through ``default_by``.

The request-level rules (data source, ``dry_run`` needs ``dataset_path``, named datasets,
``post_eval``) are checked by ``check_grpo_request``; the bounds that need the tokenised groups
(total optimizer steps, each prompt + completion within the model's context) by ``check_grpo_data``.
"""

from __future__ import annotations

from typing import Any

from kiln import contracts
from kiln.errors import RequestError
from kiln.trainers._sft_config import check_run_bounds, context_length, requested_targets
from kiln.training import default_by, effective_optimizer, effective_schedule, resolve_seed, schema_defaults

MAX_ALPHA_OVER_RANK = 2.0

__all__ = ["check_grpo_data", "check_grpo_request", "effective_echo", "effective_grpo_config", "optimizer_seed_lora"]


def _refuse(field: str, message: str, *, code: str = "training_invalid_request", hint: str | None = None) -> None:
    raise RequestError(f"{field}: {message}", code=code, hint=hint, pointer="/config/" + field.replace(".", "/"))


def _reference(config: dict[str, Any]) -> dict[str, Any]:
    if "kl_reference_policy" in config and "reference_policy" in config:
        _refuse(
            "reference_policy",
            "send either kl_reference_policy or its alias reference_policy, not both",
            hint="keep kl_reference_policy",
        )
    default = schema_defaults("GrpoConfig")["kl_reference_policy"]
    given = config.get("kl_reference_policy", config.get("reference_policy", default))
    kind = given["kind"]
    if kind == "ema":
        members = schema_defaults("KlReferencePolicy", variant="ema")
        reference = {"kind": "ema", **members, **{k: given[k] for k in members if k in given}}
        if not 0.0 <= float(reference["decay"]) <= 1.0:
            _refuse("kl_reference_policy.decay", f"{reference['decay']} is outside [0, 1]")
        if int(reference["refresh_every"]) < 1:
            _refuse("kl_reference_policy.refresh_every", f"{reference['refresh_every']} must be at least 1")
        reference["decay"], reference["refresh_every"] = float(reference["decay"]), int(reference["refresh_every"])
        return reference
    return {"kind": kind}


def effective_echo(echo: dict[str, Any] | None) -> dict[str, Any] | None:
    """An ECHO term with the schema's ``EchoConfig`` defaults filled in; None stays None (ECHO off)."""
    return None if echo is None else {**schema_defaults("EchoConfig"), **echo}


def _loss(config: dict[str, Any]) -> dict[str, Any]:
    loss = dict(config.get("loss", schema_defaults("GrpoConfig")["loss"]))
    if loss.get("opd") is not None:
        _refuse("loss.opd", "an OPD term inside GRPO is not executed by Kiln", code="training_backend_unsupported")
    defaults = schema_defaults("GrpoLossConfig")
    echo = effective_echo(loss.get("echo", defaults["echo"]))
    no_policy_loss = bool(loss.get("no_policy_loss", defaults["no_policy_loss"]))
    if no_policy_loss and (echo is None or float(echo["lambda"]) <= 0):
        _refuse(
            "loss.no_policy_loss",
            "training with the policy loss off needs an ECHO term with lambda > 0",
            hint=f'add "loss": {{"echo": {{"lambda": {schema_defaults("EchoConfig")["lambda"]:g}}}}} or drop no_policy_loss',
        )
    return {"echo": echo, "no_policy_loss": no_policy_loss}


def optimizer_seed_lora(config: dict[str, Any], definition: str) -> tuple[dict[str, Any], int, int, float, bool]:
    """What GRPO and OPD resolve alike, with the defaults of ``definition`` (``GrpoConfig``, ``OpdConfig``): the
    optimizer with its defaults, the effective seed, and the LoRA rank, alpha and ``allow_high_lora_scale`` under
    the scale guardrail (alpha / rank at most 2 unless allowed)."""
    defaults = schema_defaults(definition)
    try:
        optimizer = effective_optimizer(config.get("optimizer", defaults["optimizer"]))
        seed = resolve_seed(config.get("seed"))
    except ValueError as exc:
        raise RequestError(str(exc), code="training_invalid_request") from None
    rank = int(config.get("lora_rank", defaults["lora_rank"]))
    alpha = float(config.get("lora_alpha", defaults["lora_alpha"]))
    allow_high = bool(config.get("allow_high_lora_scale", defaults["allow_high_lora_scale"]))
    if alpha / rank > MAX_ALPHA_OVER_RANK and not allow_high:
        _refuse(
            "lora_alpha",
            f"unsafe_lora_scale: lora_alpha / lora_rank = {alpha / rank:g} exceeds {MAX_ALPHA_OVER_RANK:g}",
            hint="lower lora_alpha, raise lora_rank, or set allow_high_lora_scale",
        )
    return optimizer, seed, rank, alpha, allow_high


def effective_grpo_config(config: dict[str, Any], adapter_name: str) -> dict[str, Any]:
    """Validate ``GrpoConfig``, fill defaults, resolve seed and learning rate; raise ``RequestError``."""
    found = contracts.problems("GrpoConfig", config)
    if found:
        detail = "; ".join(f"{p.pointer or '/'}: {p.message}" for p in found)
        raise RequestError(f"invalid GRPO config: {detail}", code="training_invalid_request", pointer=found[0].pointer)
    if config.get("allow_adapter_shape_conversion"):
        _refuse(
            "allow_adapter_shape_conversion", "Kiln never converts adapter shapes", code="training_backend_unsupported"
        )
    for flag in ("adapter_smoke_test", "adapter_smoke_prompts", "detect_anomaly"):
        if config.get(flag):
            _refuse(flag, "not available for GRPO in this Kiln", code="training_backend_unsupported")
    defaults = schema_defaults("GrpoConfig")
    optimizer, seed, rank, alpha, allow_high = optimizer_seed_lora(config, "GrpoConfig")
    reference = _reference(config)
    kl_coeff = float(config.get("kl_coeff", defaults["kl_coeff"]))
    estimator = config.get("kl_estimator", defaults["kl_estimator"])
    if reference["kind"] == "none" and kl_coeff > 0 and estimator != "none":
        _refuse(
            "kl_reference_policy",
            f"reference 'none' needs the KL term off, but kl_coeff is {kl_coeff:g} with estimator {estimator!r}",
            hint='set "kl_coeff": 0 or "kl_estimator": "none", or choose a reference (base_per_step, ema)',
        )
    var_min = config.get("reward_filter_var_min", defaults["reward_filter_var_min"])
    var_max = config.get("reward_filter_var_max", defaults["reward_filter_var_max"])
    if var_min is not None and var_max is not None and var_min > var_max:
        _refuse("reward_filter_var_min", f"{var_min:g} is above reward_filter_var_max {var_max:g}")
    interval = config.get("checkpoint_interval", defaults["checkpoint_interval"])
    learning_rate = config.get("learning_rate") or default_by("GrpoConfig", "learning_rate", {"optimizer": optimizer})
    clip_eps_high = config.get("clip_eps_high", defaults["clip_eps_high"])
    return {
        "learning_rate": float(learning_rate),
        "lr_scheduler": effective_schedule(config.get("lr_scheduler")),
        "kl_coeff": kl_coeff,
        "clip_epsilon": float(config.get("clip_epsilon", defaults["clip_epsilon"])),
        "clip_eps_high": None if clip_eps_high is None else float(clip_eps_high),
        "cispo_max_weight": float(config.get("cispo_max_weight", defaults["cispo_max_weight"])),
        "advantage_mode": config.get("advantage_mode", defaults["advantage_mode"]),
        "loss_aggregation": config.get("loss_aggregation", defaults["loss_aggregation"]),
        "micro_batch_size": int(config.get("micro_batch_size", defaults["micro_batch_size"])),
        "gradient_accumulation_steps": int(
            config.get("gradient_accumulation_steps", defaults["gradient_accumulation_steps"])
        ),
        "kl_estimator": estimator,
        "dynamic_sampling": bool(config.get("dynamic_sampling", defaults["dynamic_sampling"])),
        "is_level": config.get("is_level", defaults["is_level"]),
        "behavior_policy": config.get("behavior_policy", defaults["behavior_policy"]),
        "kl_reference_policy": reference,
        "entropy_aware_kl_quantile": config.get("entropy_aware_kl_quantile", defaults["entropy_aware_kl_quantile"]),
        "reward_saturation_threshold": float(
            config.get("reward_saturation_threshold", defaults["reward_saturation_threshold"])
        ),
        "reward_low_variance_threshold": float(
            config.get("reward_low_variance_threshold", defaults["reward_low_variance_threshold"])
        ),
        "reward_filter_var_min": var_min,
        "reward_filter_var_max": var_max,
        "reward_filter_min_groups": int(config.get("reward_filter_min_groups", defaults["reward_filter_min_groups"])),
        "reward_filter_on_empty": config.get("reward_filter_on_empty", defaults["reward_filter_on_empty"]),
        "lora_rank": rank,
        "lora_alpha": alpha,
        "lora_target_modules": requested_targets(config),
        "allow_high_lora_scale": allow_high,
        "output_name": adapter_name,
        "base_adapter": config.get("base_adapter", defaults["base_adapter"]),
        "checkpoint_interval": None if interval is None else int(interval),
        "seed": seed,
        "optimizer": optimizer,
        "loss": _loss(config),
    }


def check_grpo_request(body: dict[str, Any]) -> None:
    """The request-level refusals of spec/40 that need no data or model."""
    found = contracts.problems("GrpoRequest", body)
    if found:
        from kiln.errors import ContractError

        raise ContractError(found, document="GrpoRequest")
    if body.get("dataset") is not None or "dataset_split" in body:
        raise RequestError(
            "named datasets (dataset, dataset_split) are not supported: Kiln has no dataset registry",
            code="training_backend_unsupported",
        )
    if body.get("post_eval") is not None:
        raise RequestError(
            "post_eval: the evaluation gate runs on the server, which owns what is served; a local run has "
            "nothing to promote into",
            code="training_backend_unsupported",
            hint="submit the request to `kiln serve` (drop --local), or evaluate afterwards with `kiln eval run`",
        )
    sources = [key for key in ("groups", "agentic_groups") if key in body]
    if len(sources) > 1:
        raise RequestError("send groups or its alias agentic_groups, not both", code="training_invalid_request")
    if body.get("dataset_path") is not None and sources:
        raise RequestError("send inline groups or a dataset_path, not both", code="training_invalid_request")
    if body.get("dataset_path") is None and not sources:
        raise RequestError("a GRPO request needs groups or a dataset_path", code="training_invalid_request")
    if body.get("dry_run") and body.get("dataset_path") is None:
        raise RequestError(
            "dry_run checks a streamed file: it needs dataset_path",
            code="training_invalid_request",
            hint="write the groups to a .jsonl file (one group per line) and send its absolute path",
        )


def check_grpo_data(job: Any) -> None:
    """An admitted GRPO job (``AdmittedGrpo``) within the run bounds: its optimizer steps and, per completion, the
    prompt + completion tokens against the model's context length."""
    per = "completions" if job.config["loss_aggregation"] == "per_sample" else "groups"
    check_run_bounds(
        total_steps=job.total_steps,
        steps_rule=f"one per kept {per[:-1]}",
        rows=(
            (f"group {group.index + 1} completion {completion.index + 1}", len(completion.input_ids))
            for group in job.ingestion.groups
            for completion in group.completions
        ),
        context=context_length(job.loaded),
    )
