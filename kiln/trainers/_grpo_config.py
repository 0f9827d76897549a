"""The effective GRPO configuration: schema, defaults and every refusal of spec/40.

``effective_grpo_config(config, adapter_name)`` validates a ``GrpoConfig`` object, fills
every default the trainer depends on (so receipts, checkpoints and resume comparisons see
one canonical object) and refuses what Kiln does not execute, naming the field:

* ``kl_reference_policy`` and its alias ``reference_policy`` together; the effective
  config always records ``kl_reference_policy`` (``{"kind": "base_per_step"}`` by default;
  an EMA reference gets ``decay`` 0.99 and ``refresh_every`` 1 when omitted);
* a KL term against reference ``none`` (``kl_coeff`` > 0 with an estimator other than
  ``none``);
* ``reward_filter_var_min`` > ``reward_filter_var_max``;
* ``loss.opd`` (``training_backend_unsupported``), ``loss.no_policy_loss`` without an ECHO
  term of positive ``lambda``;
* the LoRA scale guardrail, shape conversion, MTP-like reference knobs, as for SFT.

The request-level rules (data source, ``dry_run`` needs ``dataset_path``, named datasets,
``post_eval``) are checked by ``check_grpo_request``.
"""

from __future__ import annotations

from typing import Any

from kiln import contracts
from kiln.errors import RequestError
from kiln.training import DEFAULT_LEARNING_RATES, effective_optimizer, resolve_seed

MAX_ALPHA_OVER_RANK = 2.0
EMA_DEFAULTS = {"decay": 0.99, "refresh_every": 1}
ECHO_DEFAULTS = {"lambda": 0.05, "env_mask_mode": "env_only", "warning_filter": True}

__all__ = ["check_grpo_request", "effective_grpo_config"]


def _refuse(field: str, message: str, *, code: str = "training_invalid_request", hint: str | None = None) -> None:
    raise RequestError(f"{field}: {message}", code=code, hint=hint, pointer="/config/" + field.replace(".", "/"))


def _reference(config: dict[str, Any]) -> dict[str, Any]:
    if "kl_reference_policy" in config and "reference_policy" in config:
        _refuse(
            "reference_policy",
            "send either kl_reference_policy or its alias reference_policy, not both",
            hint="keep kl_reference_policy",
        )
    given = config.get("kl_reference_policy", config.get("reference_policy")) or {"kind": "base_per_step"}
    kind = given["kind"]
    if kind == "ema":
        reference = {"kind": "ema", **EMA_DEFAULTS, **{k: given[k] for k in EMA_DEFAULTS if k in given}}
        if not 0.0 <= float(reference["decay"]) <= 1.0:
            _refuse("kl_reference_policy.decay", f"{reference['decay']} is outside [0, 1]")
        if int(reference["refresh_every"]) < 1:
            _refuse("kl_reference_policy.refresh_every", f"{reference['refresh_every']} must be at least 1")
        reference["decay"], reference["refresh_every"] = float(reference["decay"]), int(reference["refresh_every"])
        return reference
    return {"kind": kind}


def _loss(config: dict[str, Any]) -> dict[str, Any]:
    loss = dict(config.get("loss") or {})
    if loss.get("opd") is not None:
        _refuse("loss.opd", "an OPD term inside GRPO is not executed by Kiln", code="training_backend_unsupported")
    echo = loss.get("echo")
    echo = None if echo is None else {**ECHO_DEFAULTS, **echo}
    no_policy_loss = bool(loss.get("no_policy_loss", False))
    if no_policy_loss and (echo is None or float(echo["lambda"]) <= 0):
        _refuse(
            "loss.no_policy_loss",
            "training with the policy loss off needs an ECHO term with lambda > 0",
            hint='add "loss": {"echo": {"lambda": 0.05}} or drop no_policy_loss',
        )
    return {"echo": echo, "no_policy_loss": no_policy_loss}


def optimizer_seed_lora(config: dict[str, Any]) -> tuple[dict[str, Any], int, int, float]:
    """What GRPO and OPD resolve alike: the optimizer with its defaults, the effective seed, and the
    LoRA rank and alpha under the scale guardrail (alpha / rank at most 2 unless allowed)."""
    try:
        optimizer = effective_optimizer(config.get("optimizer"))
        seed = resolve_seed(config.get("seed"))
    except ValueError as exc:
        raise RequestError(str(exc), code="training_invalid_request") from None
    rank = int(config.get("lora_rank", 16))
    alpha = float(config.get("lora_alpha", 32.0))
    if alpha / rank > MAX_ALPHA_OVER_RANK and not config.get("allow_high_lora_scale", False):
        _refuse(
            "lora_alpha",
            f"unsafe_lora_scale: lora_alpha / lora_rank = {alpha / rank:g} exceeds {MAX_ALPHA_OVER_RANK:g}",
            hint="lower lora_alpha, raise lora_rank, or set allow_high_lora_scale",
        )
    return optimizer, seed, rank, alpha


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
    optimizer, seed, rank, alpha = optimizer_seed_lora(config)
    reference = _reference(config)
    kl_coeff = float(config.get("kl_coeff", 0.1))
    estimator = config.get("kl_estimator", "k1")
    if reference["kind"] == "none" and kl_coeff > 0 and estimator != "none":
        _refuse(
            "kl_reference_policy",
            f"reference 'none' needs the KL term off, but kl_coeff is {kl_coeff:g} with estimator {estimator!r}",
            hint='set "kl_coeff": 0 or "kl_estimator": "none", or choose a reference (base_per_step, ema)',
        )
    var_min, var_max = config.get("reward_filter_var_min"), config.get("reward_filter_var_max")
    if var_min is not None and var_max is not None and var_min > var_max:
        _refuse("reward_filter_var_min", f"{var_min:g} is above reward_filter_var_max {var_max:g}")
    interval = config.get("checkpoint_interval")
    learning_rate = config.get("learning_rate") or DEFAULT_LEARNING_RATES["grpo"][optimizer["kind"]]
    return {
        "learning_rate": float(learning_rate),
        "kl_coeff": kl_coeff,
        "clip_epsilon": float(config.get("clip_epsilon", 0.2)),
        "clip_eps_high": None if config.get("clip_eps_high") is None else float(config["clip_eps_high"]),
        "cispo_max_weight": float(config.get("cispo_max_weight", 5.0)),
        "advantage_mode": config.get("advantage_mode", "dr_grpo"),
        "loss_aggregation": config.get("loss_aggregation", "token_level"),
        "kl_estimator": estimator,
        "dynamic_sampling": bool(config.get("dynamic_sampling", False)),
        "is_level": config.get("is_level", "token"),
        "behavior_policy": config.get("behavior_policy", "no_importance_correction"),
        "kl_reference_policy": reference,
        "entropy_aware_kl_quantile": config.get("entropy_aware_kl_quantile"),
        "reward_saturation_threshold": float(config.get("reward_saturation_threshold", 0.95)),
        "reward_low_variance_threshold": float(config.get("reward_low_variance_threshold", 1e-12)),
        "reward_filter_var_min": var_min,
        "reward_filter_var_max": var_max,
        "reward_filter_min_groups": int(config.get("reward_filter_min_groups", 1)),
        "reward_filter_on_empty": config.get("reward_filter_on_empty", "fail"),
        "lora_rank": rank,
        "lora_alpha": alpha,
        "allow_high_lora_scale": bool(config.get("allow_high_lora_scale", False)),
        "output_name": adapter_name,
        "base_adapter": config.get("base_adapter"),
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
