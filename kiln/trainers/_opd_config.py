"""The effective OPD configuration: schema, defaults and every refusal of spec/40.

``effective_opd_config(config, adapter_name, teacher_max_top_k=..., model_max_len=...)``
validates an ``OpdConfig`` object, fills every default the trainer depends on (receipts,
checkpoints and resume comparisons see one canonical object) and refuses, naming the
field, what Kiln does not execute: an objective other than ``reverse_kl``, a loss
granularity other than ``teacher_top_k``, ``top_k`` other than 16 or 32, a stable-OPD mode
other than off, a non-zero ``discount`` or ``clip_epsilon``, a cost cap, the
``legacy_action_boundary`` rendering, shape conversion and the LoRA scale guardrail.

Resolved values: ``top_k`` is min(requested, the teacher's ``max_top_k``);
``max_tokens`` defaults to the student's context length and is capped by it (a rollout
also stops where prefix + rollout would exceed it); ``checkpoint_interval`` omitted is
25, null defers to the server's ``training.checkpoint_interval``.

``check_opd_request`` holds the request-level rules (schema, ``post_eval``, exactly one
source matching ``training_mode``).
"""

from __future__ import annotations

from typing import Any

from kiln import contracts
from kiln.errors import RequestError
from kiln.trainers._grpo_config import ECHO_DEFAULTS, optimizer_seed_lora
from kiln.training import DEFAULT_LEARNING_RATES

EXECUTABLE_TOP_K = (16, 32)
DEFAULT_CHECKPOINT_INTERVAL = 25

__all__ = ["DEFAULT_CHECKPOINT_INTERVAL", "check_opd_request", "effective_opd_config"]


def _refuse(field: str, message: str, *, code: str = "training_invalid_request", hint: str | None = None) -> None:
    raise RequestError(f"{field}: {message}", code=code, hint=hint, pointer="/config/" + field.replace(".", "/"))


def _only(config: dict[str, Any], field: str, allowed: Any, why: str) -> Any:
    value = config.get(field, allowed)
    if value != allowed:
        _refuse(field, f"{value!r} is not executed by Kiln ({why})", code="training_backend_unsupported")
    return allowed


def effective_opd_config(
    config: dict[str, Any],
    adapter_name: str,
    *,
    teacher_max_top_k: int,
    model_max_len: int,
    server_checkpoint_interval: int | None = None,
) -> dict[str, Any]:
    """Validate ``OpdConfig``, fill defaults, resolve seed, learning rate and top-K; raise ``RequestError``."""
    found = contracts.problems("OpdConfig", config)
    if found:
        detail = "; ".join(f"{p.pointer or '/'}: {p.message}" for p in found)
        raise RequestError(f"invalid OPD config: {detail}", code="training_invalid_request", pointer=found[0].pointer)
    objective = _only(config, "objective", "reverse_kl", "the only objective is the top-K reverse KL")
    loss = _only(config, "loss", "teacher_top_k", "student and teacher are compared on the teacher's top-K ids")
    _only(config, "rollout_prompt_rendering", "chat_template", "rollouts are rendered with the chat template")
    stable = config.get("stable_opd")
    if stable is not None and stable != {"mode": "off"}:
        _refuse("stable_opd", f"{stable!r}: only {{'mode': 'off'}} runs", code="training_backend_unsupported")
    for field in ("discount", "clip_epsilon"):
        if float(config.get(field, 0)) != 0:
            _refuse(field, f"{config[field]!r}: Kiln requires 0", code="training_backend_unsupported")
    if config.get("max_cost_usd") is not None:
        _refuse(
            "max_cost_usd", "Kiln has no cost accounting; send null or omit it", code="training_backend_unsupported"
        )
    if config.get("allow_adapter_shape_conversion"):
        _refuse(
            "allow_adapter_shape_conversion", "Kiln never converts adapter shapes", code="training_backend_unsupported"
        )
    if config.get("detect_anomaly"):
        _refuse("detect_anomaly", "not available for OPD in this Kiln", code="training_backend_unsupported")
    requested_k = int(config.get("top_k", 32))
    if requested_k not in EXECUTABLE_TOP_K:
        _refuse("top_k", f"{requested_k}: Kiln executes top_k 16 or 32", code="training_backend_unsupported")
    optimizer, seed, rank, alpha = optimizer_seed_lora(config)
    max_tokens = int(config.get("max_tokens", model_max_len))
    if max_tokens > model_max_len:
        _refuse("max_tokens", f"{max_tokens} exceeds the student's context length {model_max_len}")
    if "checkpoint_interval" not in config:
        interval: int | None = DEFAULT_CHECKPOINT_INTERVAL
    elif config["checkpoint_interval"] is None:
        interval = server_checkpoint_interval
    else:
        interval = int(config["checkpoint_interval"])
    echo = config.get("echo")
    learning_rate = config.get("learning_rate") or DEFAULT_LEARNING_RATES["opd"][optimizer["kind"]]
    effective = {
        "training_mode": config.get("training_mode", "on_policy"),
        "objective": objective,
        "loss": loss,
        "top_k": min(requested_k, int(teacher_max_top_k)),
        "samples_per_prompt": int(config.get("samples_per_prompt", 4)),
        "temperature": float(config.get("temperature", 1.0)),
        "top_p": float(config.get("top_p", 0.9)),
        "max_tokens": max_tokens,
        "rollout_prompt_rendering": "chat_template",
        "stable_opd": {"mode": "off"},
        "discount": 0.0,
        "clip_epsilon": 0.0,
        "learning_rate": float(learning_rate),
        "lora_rank": rank,
        "lora_alpha": alpha,
        "allow_high_lora_scale": bool(config.get("allow_high_lora_scale", False)),
        "base_adapter": config.get("base_adapter"),
        "output_name": adapter_name,
        "checkpoint_interval": interval,
        "seed": seed,
        "optimizer": optimizer,
        "echo": None if echo is None else {**ECHO_DEFAULTS, **echo},
        "epochs": int(config.get("epochs", 1)),
    }
    if "grad_checkpoint_segments" in config:
        effective["grad_checkpoint_segments"] = int(config["grad_checkpoint_segments"])
    if effective["echo"] is not None and float(effective["echo"]["lambda"]) < 0:
        _refuse("echo.lambda", f"{effective['echo']['lambda']} must not be negative")
    return effective


def check_opd_request(body: dict[str, Any]) -> str:
    """The request-level refusals of spec/40 that need no data, teacher or model; returns the training mode."""
    found = contracts.problems("OpdRequest", body)
    if found:
        from kiln.errors import ContractError

        raise ContractError(found, document="OpdRequest")
    if body.get("post_eval") is not None:
        raise RequestError(
            "post_eval: the evaluation gate runs on the server, which owns what is served; a local run has "
            "nothing to promote into",
            code="training_backend_unsupported",
            hint="submit the request to `kiln serve` (drop --local), or evaluate afterwards with `kiln eval run`",
        )
    mode = (body.get("config") or {}).get("training_mode", "on_policy")
    if mode == "on_policy" and "prompts" not in body:
        raise RequestError(
            "training_mode on_policy samples from inline prompts: send prompts",
            code="training_invalid_request",
            pointer="/prompts",
            hint='or set "training_mode": "off_policy" with a pre-scored dataset_path',
        )
    if mode == "off_policy" and body.get("dataset_path") is None:
        raise RequestError(
            "training_mode off_policy replays a pre-scored teacher file: send dataset_path",
            code="training_invalid_request",
            pointer="/dataset_path",
        )
    return mode
