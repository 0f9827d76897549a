"""The effective OPD configuration: schema, defaults and every refusal of spec/40.

``effective_opd_config(config, adapter_name, teacher_max_top_k=..., model_max_len=...)``
validates an ``OpdConfig`` object, fills every default the trainer depends on (receipts,
checkpoints and resume comparisons see one canonical object) and refuses, naming the
field, what Kiln does not execute: an ``objective``, ``loss``, ``rollout_prompt_rendering``,
``stable_opd``, ``discount`` or ``clip_epsilon`` other than its schema default (the only one
Kiln runs), ``top_k`` other than 16 or 32, a cost cap, shape conversion and the LoRA scale
guardrail.

Every default is the schema's (``schema_defaults("OpdConfig")``, ``EchoConfig``'s for an
ECHO term, the learning rate by optimizer kind through ``default_by``) except two that come
from outside the request: ``max_tokens`` defaults to the student's context length and is
capped by it (a rollout also stops where prefix + rollout would exceed it), and a null
``checkpoint_interval`` defers to the server's ``training.checkpoint_interval``. ``top_k``
is min(requested, the teacher's ``max_top_k``).

``check_opd_request`` holds the request-level rules (schema, ``post_eval``, exactly one
source matching ``training_mode``, and epochs x prompts x samples within the step bound before
any prompt is rendered); ``check_opd_data`` the bounds that need the tokenised source (total
steps, each prompt short enough to leave the rollout at least one token of the context).
"""

from __future__ import annotations

from typing import Any

from kiln import contracts
from kiln.errors import RequestError
from kiln.trainers._grpo_config import effective_echo, optimizer_seed_lora
from kiln.trainers._sft_config import check_run_bounds, context_length, requested_targets
from kiln.training import default_by, effective_schedule, schema_defaults

EXECUTABLE_TOP_K = (16, 32)

__all__ = ["check_opd_data", "check_opd_request", "effective_opd_config"]


def _refuse(field: str, message: str, *, code: str = "training_invalid_request", hint: str | None = None) -> None:
    raise RequestError(f"{field}: {message}", code=code, hint=hint, pointer="/config/" + field.replace(".", "/"))


def _only(config: dict[str, Any], defaults: dict[str, Any], field: str, why: str) -> Any:
    """The default of ``field``, the only value Kiln executes; any other value is refused."""
    allowed = defaults[field]
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
    defaults = schema_defaults("OpdConfig")
    objective = _only(config, defaults, "objective", "the only objective is the top-K reverse KL")
    loss = _only(config, defaults, "loss", "student and teacher are compared on the teacher's top-K ids")
    rendering = _only(config, defaults, "rollout_prompt_rendering", "rollouts are rendered with the chat template")
    stable = config.get("stable_opd", defaults["stable_opd"])
    if stable != defaults["stable_opd"]:
        _refuse("stable_opd", f"{stable!r}: only {defaults['stable_opd']!r} runs", code="training_backend_unsupported")
    for field in ("discount", "clip_epsilon"):
        if float(config.get(field, defaults[field])) != defaults[field]:
            _refuse(field, f"{config[field]!r}: Kiln requires {defaults[field]:g}", code="training_backend_unsupported")
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
    requested_k = int(config.get("top_k", defaults["top_k"]))
    if requested_k not in EXECUTABLE_TOP_K:
        _refuse("top_k", f"{requested_k}: Kiln executes top_k 16 or 32", code="training_backend_unsupported")
    optimizer, seed, rank, alpha, allow_high = optimizer_seed_lora(config, "OpdConfig")
    max_tokens = int(config.get("max_tokens", model_max_len))
    if max_tokens > model_max_len:
        _refuse("max_tokens", f"{max_tokens} exceeds the student's context length {model_max_len}")
    interval = config.get("checkpoint_interval", defaults["checkpoint_interval"])
    interval = server_checkpoint_interval if interval is None else int(interval)
    learning_rate = config.get("learning_rate") or default_by("OpdConfig", "learning_rate", {"optimizer": optimizer})
    effective = {
        "training_mode": config.get("training_mode", defaults["training_mode"]),
        "objective": objective,
        "loss": loss,
        "top_k": min(requested_k, int(teacher_max_top_k)),
        "samples_per_prompt": int(config.get("samples_per_prompt", defaults["samples_per_prompt"])),
        "temperature": float(config.get("temperature", defaults["temperature"])),
        "top_p": float(config.get("top_p", defaults["top_p"])),
        "max_tokens": max_tokens,
        "micro_batch_size": int(config.get("micro_batch_size", defaults["micro_batch_size"])),
        "gradient_accumulation_steps": int(
            config.get("gradient_accumulation_steps", defaults["gradient_accumulation_steps"])
        ),
        "rollout_prompt_rendering": rendering,
        "stable_opd": defaults["stable_opd"],
        "discount": float(defaults["discount"]),
        "clip_epsilon": float(defaults["clip_epsilon"]),
        "learning_rate": float(learning_rate),
        "lr_scheduler": effective_schedule(config.get("lr_scheduler")),
        "lora_rank": rank,
        "lora_alpha": alpha,
        "lora_target_modules": requested_targets(config),
        "allow_high_lora_scale": allow_high,
        "base_adapter": config.get("base_adapter", defaults["base_adapter"]),
        "output_name": adapter_name,
        "checkpoint_interval": interval,
        "seed": seed,
        "optimizer": optimizer,
        "echo": effective_echo(config.get("echo", defaults["echo"])),
        "epochs": int(config.get("epochs", defaults["epochs"])),
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
    mode = (body.get("config") or {}).get("training_mode", schema_defaults("OpdConfig")["training_mode"])
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
    if "prompts" in body:  # bounded before the candidates (prompts x samples) are listed
        config, defaults = body.get("config") or {}, schema_defaults("OpdConfig")
        epochs, samples = (int(config.get(k, defaults[k])) for k in ("epochs", "samples_per_prompt"))
        check_run_bounds(
            total_steps=epochs * len(body["prompts"]) * samples,
            steps_rule=f"{epochs} epochs x {len(body['prompts'])} prompts x {samples} samples_per_prompt",
            rows=(),
            context=None,
        )
    return mode


def check_opd_data(job: Any) -> None:
    """An admitted OPD job (``AdmittedOpd``) within the run bounds: its optimizer steps, and each prompt short enough
    (student and teacher prefix) to leave a rollout token, or each pre-scored row (prefix + response) within the
    model's context length."""
    if job.route == "prompts":
        rows = (
            (f"prompt {item.index + 1}", max(len(item.student_prefix), len(item.teacher_prefix)))
            for item in job.source.items
        )
        margin = 1
    else:
        rows = ((f"line {row.line}", len(row.student_prefix) + len(row.action_ids)) for row in job.source.rows)
        margin = 0
    check_run_bounds(
        total_steps=job.total_steps,
        steps_rule=f"{job.config['epochs']} epochs x {len(job.candidates)} candidates",
        rows=rows,
        context=context_length(job.loaded),
        margin=margin,
    )
