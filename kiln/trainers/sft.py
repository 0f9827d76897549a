"""SFT trainer, profile ``native_online_lora_v1``.

Objective: mean next-token cross-entropy over the assistant tokens of one conversation
(assistant content plus its closing end-of-turn token and newline), one conversation per
optimizer step, constant learning rate, no warmup, accumulation or clipping. Only the LoRA
A/B matrices train; the base model, embeddings and LM head are frozen.

Read top to bottom: admission (config, seed, target, model, data -- everything that can
fail before training, publishing nothing), setup (identity, LoRA, optimizer, loss route),
the loop (epochs in the portable SplitMix64 Fisher-Yates order), publication (adapter,
receipt, manifest). A failure after admission writes a failed receipt with its category.

Deliberate simplifications: batch size 1 (one conversation per step); the loss route is
chosen by capability; the divergence check runs at epoch boundaries only.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln import __version__, contracts
from kiln.digests import json_sha256
from kiln.epoch_order import ALGORITHM_ID, epoch_order
from kiln.errors import RequestError
from kiln.publish import (
    adapter_file_receipt,
    check_target,
    stage_adapter,
    write_adapter_manifest,
    write_train_receipt,
)
from kiln.training import (
    DEFAULT_LEARNING_RATES,
    TrainingFailedError,
    attach_lora,
    build_optimizer,
    classify_failure,
    effective_optimizer,
    lora_delta_norms,
    lora_parameters,
    resolve_seed,
)
from kiln.training._lora import module_of

PROFILE = "native_online_lora_v1"
DIVERGENCE_RATIO = 8.0
DIVERGENCE_MARGIN = 5.0
MAX_ALPHA_OVER_RANK = 2.0

Progress = Callable[[dict[str, Any]], None]


@dataclass
class SftResult:
    status: str
    adapter_dir: Path
    receipt_path: Path
    manifest_path: Path | None
    receipt: dict[str, Any]
    losses: list[float] = field(default_factory=list)


# ----------------------------------------------------------------------------- admission


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
        ("resume_checkpoint", "resuming from a checkpoint"),
        ("checkpoint_interval", "periodic exact-resume checkpoints"),
        ("adapter_smoke_test", "the post-training adapter smoke test"),
        ("adapter_smoke_prompts", "the post-training adapter smoke test"),
    ):
        if config.get(flag):
            raise RequestError(f"{flag}: {what} is not available yet", code="training_backend_unsupported")
    try:
        optimizer = effective_optimizer(config.get("optimizer"))
        seed = resolve_seed(config.get("seed"))
    except ValueError as exc:
        raise RequestError(str(exc), code="training_invalid_request") from None
    rank = config.get("lora_rank", 16)
    alpha = float(config.get("lora_alpha", 32.0))
    if alpha / rank > MAX_ALPHA_OVER_RANK and not config.get("allow_high_lora_scale", False):
        raise RequestError(
            f"unsafe_lora_scale: lora_alpha / lora_rank = {alpha / rank:g} exceeds {MAX_ALPHA_OVER_RANK:g}",
            code="training_invalid_request",
            hint="lower lora_alpha, raise lora_rank, or set allow_high_lora_scale",
        )
    learning_rate = config.get("learning_rate") or DEFAULT_LEARNING_RATES["sft"][optimizer["kind"]]
    return {
        "training_profile": PROFILE,
        "invalid_row_policy": config.get("invalid_row_policy", "fail"),
        "epochs": config.get("epochs", 3),
        "learning_rate": float(learning_rate),
        "lora_rank": rank,
        "lora_alpha": alpha,
        "allow_high_lora_scale": bool(config.get("allow_high_lora_scale", False)),
        "output_name": adapter_name,
        "base_adapter": config.get("base_adapter"),
        "checkpoint_interval": None,
        "seed": seed,
        "optimizer": optimizer,
    }


@dataclass
class AdmittedSft:
    adapter_name: str
    registry: Path
    config: dict[str, Any]
    loaded: Any
    ingestion: Any
    tokenize_ms: float


def admit_sft(
    *,
    adapter_name: str,
    registry: Path,
    config: dict[str, Any],
    examples: list[Any] | None = None,
    dataset_path: str | Path | None = None,
    model_path: str | None = None,
) -> AdmittedSft:
    """Everything that can fail before training; raises ``KilnError`` and publishes nothing."""
    from kiln.data import ingest_sft
    from kiln.model import load_base_model, resolve_model_path

    cfg = effective_config(config, adapter_name)
    check_target(registry, adapter_name)
    path, is_default = resolve_model_path(model_path)
    loaded = load_base_model(path, is_default=is_default)
    start = time.perf_counter()
    if dataset_path is not None:
        dataset_path = str(Path(dataset_path).resolve())
    ingestion = ingest_sft(
        tokenizer=loaded.tokenizer,
        examples=examples,
        dataset_path=dataset_path,
        invalid_row_policy=cfg["invalid_row_policy"],
    )
    return AdmittedSft(adapter_name, registry, cfg, loaded, ingestion, (time.perf_counter() - start) * 1000)


# ----------------------------------------------------------------------------- the run


def run_sft(job: AdmittedSft, *, progress: Progress | None = None) -> SftResult:
    """Train, then publish adapter, receipt and manifest (or a failed receipt)."""
    import torch

    from kiln.kernels import select_loss_route, sft_loss
    from kiln.model import capture_identity, training_precision

    started = time.perf_counter()
    cfg, ingestion = job.config, job.ingestion
    adapter_dir = job.registry / job.adapter_name
    precision = training_precision(optimizer_kind=cfg["optimizer"]["kind"])
    identity = capture_identity(job.loaded.path, job.loaded.tokenizer, training_policy=precision)
    route = select_loss_route("cpu", torch.float32)
    state: dict[str, Any] = {
        "losses": [],
        "steps": 0,
        "timings": dict.fromkeys(("policy_forward_ms", "backward_ms", "optimizer_ms"), 0.0),
        "grad_norms": {},
        "delta_norms": [],
    }
    examples = ingestion.examples
    try:
        torch.manual_seed(0)  # nothing should draw from the global RNG; pin it anyway
        model = attach_lora(job.loaded.model, rank=cfg["lora_rank"], alpha=cfg["lora_alpha"], seed=cfg["seed"])
        params = lora_parameters(model)
        if cfg["base_adapter"]:
            _warm_start(params, base_adapter_dir(job.registry, cfg["base_adapter"]))
        optimizer = build_optimizer(cfg["optimizer"], list(params.values()), cfg["learning_rate"])
        causal = model.get_base_model()
        body, head = causal.get_decoder(), causal.get_output_embeddings()
        tensors = [
            (torch.tensor(ex.input_ids, dtype=torch.long).unsqueeze(0), torch.tensor(ex.labels[1:], dtype=torch.long))
            for ex in examples
        ]
        total = cfg["epochs"] * len(examples)
        epoch_means: list[float] = []
        for epoch in range(cfg["epochs"]):
            epoch_sum = 0.0
            for index in epoch_order(cfg["seed"], epoch, len(examples)):
                ids, targets = tensors[index]
                t0 = time.perf_counter()
                hidden = body(input_ids=ids).last_hidden_state[0, :-1]
                loss = sft_loss(route, hidden, head.weight, targets)
                t1 = time.perf_counter()
                value = float(loss.detach())
                if not torch.isfinite(loss.detach()):
                    raise TrainingFailedError(
                        "nan_loss",
                        f"non-finite loss {value} at step {state['steps'] + 1} "
                        f"(epoch {epoch + 1}, row {examples[index].row_index})",
                    )
                loss.backward()
                t2 = time.perf_counter()
                _record_grad_norms(state["grad_norms"], params)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                t3 = time.perf_counter()
                state["timings"]["policy_forward_ms"] += (t1 - t0) * 1000
                state["timings"]["backward_ms"] += (t2 - t1) * 1000
                state["timings"]["optimizer_ms"] += (t3 - t2) * 1000
                state["losses"].append(value)
                state["steps"] += 1
                epoch_sum += value
                if progress:
                    progress({"step": state["steps"], "total": total, "loss": value, "tokens": int(ids.shape[1])})
            epoch_means.append(epoch_sum / len(examples))
            _check_divergence(epoch_means)
        state["delta_norms"] = lora_delta_norms(model)
        adapter_dir = stage_adapter(model, job.registry, job.adapter_name)
        receipt = _receipt(job, identity, precision, route, state, started, adapter_dir=adapter_dir)
        receipt_path = write_train_receipt(adapter_dir, receipt)
        manifest_path = write_adapter_manifest(adapter_dir, receipt)
        return SftResult("success", adapter_dir, receipt_path, manifest_path, receipt, state["losses"])
    except BaseException as exc:
        reason, message = classify_failure(exc)
        receipt = _receipt(job, identity, precision, route, state, started, failure=(reason, message))
        receipt_path = write_train_receipt(adapter_dir, receipt)
        if isinstance(exc, KeyboardInterrupt):
            raise
        return SftResult("failed", adapter_dir, receipt_path, None, receipt, state["losses"])


def base_adapter_dir(registry: Path, base_adapter: str) -> Path:
    """A registry name or an absolute path of a PEFT adapter directory."""
    path = Path(base_adapter)
    return path if path.is_absolute() else registry / base_adapter


def _warm_start(params: dict[str, Any], base_dir: Path) -> None:
    """Copy A/B from a PEFT adapter (weights only: no optimizer state, no data cursor)."""
    import torch
    from safetensors.torch import load_file

    weights = base_dir / "adapter_model.safetensors"
    if not weights.is_file():
        raise TrainingFailedError("base_adapter_missing", f"base adapter {base_dir} has no adapter_model.safetensors")
    saved = load_file(weights)
    with torch.no_grad():
        for name, param in params.items():
            key = name.replace(".default.", ".")
            if key not in saved:
                raise TrainingFailedError("shape_mismatch", f"base adapter {base_dir} has no tensor {key}")
            if tuple(saved[key].shape) != tuple(param.shape):
                raise TrainingFailedError(
                    "shape_mismatch",
                    f"base adapter tensor {key} has shape {tuple(saved[key].shape)}, the new adapter needs "
                    f"{tuple(param.shape)} (rank and target modules must match)",
                )
            param.copy_(saved[key].to(param.dtype))


def _record_grad_norms(acc: dict[str, list[float]], params: dict[str, Any]) -> None:
    squares: dict[str, float] = {}
    for name, param in params.items():
        if param.grad is not None:
            module = module_of(name)
            squares[module] = squares.get(module, 0.0) + float(param.grad.detach().pow(2).sum())
    for module, sq in squares.items():
        acc.setdefault(module, []).append(sq**0.5)


def _check_divergence(epoch_means: list[float]) -> None:
    if len(epoch_means) < 2:
        return
    first, last, best = epoch_means[0], epoch_means[-1], min(epoch_means[:-1])
    if last > DIVERGENCE_RATIO * first and last > best + DIVERGENCE_MARGIN:
        raise TrainingFailedError(
            "training_error",
            f"training diverged: epoch {len(epoch_means)} mean loss {last:.4f} exceeds {DIVERGENCE_RATIO:g}x the "
            f"first epoch ({first:.4f}) and the best epoch ({best:.4f}) by more than {DIVERGENCE_MARGIN:g}",
        )


# ----------------------------------------------------------------------------- the receipt


def _receipt(job, identity, precision, route, state, started, *, adapter_dir=None, failure=None) -> dict[str, Any]:
    from kiln.model._identity import git_source

    cfg, record = job.config, job.ingestion.record
    config_hash = json_sha256(cfg)
    commit, dirty = git_source()
    examples = job.ingestion.examples
    per_epoch_action = sum(ex.supervised_tokens for ex in examples)
    per_epoch_context = sum(len(ex.input_ids) - 1 for ex in examples) - per_epoch_action
    epochs_done = cfg["epochs"] if failure is None else min(cfg["epochs"], -(-state["steps"] // max(len(examples), 1)))
    grad_norms = [
        {"module": m, "sample_count": len(v), "min": min(v), "mean": sum(v) / len(v), "max": max(v)}
        for m, v in sorted(state["grad_norms"].items())
    ]
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    receipt: dict[str, Any] = {
        "schema_version": 1,
        "receipt_type": "kiln_train_receipt",
        "adapter_name": job.adapter_name,
        "produced_at": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "status": "success" if failure is None else "failed",
        "failure_reason": None if failure is None else failure[0],
        "kiln": {
            "package_version": __version__,
            "git_commit": commit,
            "git_dirty": dirty,
            "git_source": "git" if commit else None,
            "env_config_hash": config_hash,
        },
        "model": {
            "path": identity.path,
            "config_hash": identity.config_hash,
            "base_weight_shard_manifest": identity.base_weight_shard_manifest,
        },
        "tokenizer": {
            "config_hash": identity.tokenizer_combined_hash,
            "tokenizer_config_hash": identity.tokenizer_config_hash,
            "chat_template_hash": identity.chat_template_hash,
            "training_chat_template_hash": identity.training_chat_template_hash,
        },
        "adapters": {
            "base": adapter_file_receipt(
                base_adapter_dir(job.registry, cfg["base_adapter"]) if cfg["base_adapter"] else None
            ),
            "output": adapter_file_receipt(adapter_dir),
        },
        "training_data": {
            "source": record["source"],
            "path": record.get("source_locator"),
            "sha256": record["kept_corpus_sha256"],
        },
        "hyperparameters": {
            "mode": "sft",
            "rank": cfg["lora_rank"],
            "alpha": cfg["lora_alpha"],
            "alpha_over_rank": cfg["lora_alpha"] / cfg["lora_rank"],
            "learning_rate": cfg["learning_rate"],
            "epochs": cfg["epochs"],
            "seed": cfg["seed"],
            "shuffle": True,
            "epoch_order_algorithm": ALGORITHM_ID,
        },
        "grpo": None,
        "echo": {
            "enabled": False,
            "lambda": None,
            "env_mask_mode": None,
            "warning_filter": None,
            "initial_env_ce": None,
            "final_env_ce": None,
        },
        "no_policy_loss": False,
        "data": {
            "examples_read": record["rows_read"],
            "examples_filtered": record["rows_rejected"],
            "examples_trained": record["rows_kept"] * cfg["epochs"] if failure is None else state["steps"],
            "groups_read": 0,
            "groups_filtered": 0,
            "groups_trained": 0,
            "completions_read": 0,
            "completions_trained": 0,
            "reward_groups_filtered": 0,
            "reward_groups_kept": 0,
            "sft_ingestion": record,
        },
        "rewards": {
            "count": 0,
            "mean": None,
            "stdev": None,
            "min": None,
            "max": None,
            "group_count": 0,
            "all_pass_group_count": 0,
            "all_fail_group_count": 0,
            "degenerate_group_count": 0,
            "group_variance_histogram": [],
        },
        "token_counts": {
            "action_tokens": per_epoch_action * epochs_done,
            "env_tokens": 0,
            "env_tokens_before_warning_filter": 0,
            "env_tokens_after_warning_filter": 0,
            "warning_tokens_filtered": 0,
            "context_tokens": per_epoch_context * epochs_done,
        },
        "phase_timings": {
            "tokenize_ms": job.tokenize_ms,
            "mask_build_ms": 0.0,
            "reference_forward_ms": 0.0,
            **state["timings"],
            "gpu_writer_wait_ms": 0.0,
            "gpu_writer_held_ms": 0.0,
            "gpu_writer_acquisitions": 0,
        },
        "runtime": {
            "wall_clock_ms": int((time.perf_counter() - started) * 1000),
            "peak_vram_mib": None,
            "peak_host_memory_mib": peak_kib // 1024,
            "sft_loss_route": route,
            "execution_provenance": identity.execution_provenance,
            "training_precision": precision,
        },
        "config_hashes": {
            "tokenizer_config_hash": identity.tokenizer_config_hash,
            "chat_template_hash": identity.chat_template_hash,
            "training_chat_template_hash": identity.training_chat_template_hash,
            "model_config_hash": identity.config_hash,
            "effective_config_hash": config_hash,
        },
        "lora_delta_norms": state["delta_norms"],
        "lora_grad_norms": grad_norms,
        "config": cfg,
    }
    if failure is not None:
        receipt["failure_message"] = failure[1]
    return receipt
