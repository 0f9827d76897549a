"""The parts of a train receipt every trainer writes the same way.

``receipt_base`` fills the envelope, build, model, tokenizer, adapter files, hyperparameters,
phase timings, runtime, config hashes and norms from what every trainer has; the trainer
then sets its own blocks (``data``, ``token_counts``, ``rewards``, ``grpo``, ``echo``, the
SFT loss-route facts). The defaults here are the "did not apply" values of the schema.
"""

from __future__ import annotations

import resource
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln import __version__
from kiln.adapters.publish import adapter_file_receipt
from kiln.documents.digests import json_sha256
from kiln.documents.jsonio import JsonObject
from kiln.training._config import EffectiveConfig

if TYPE_CHECKING:
    from kiln.model import ModelIdentity

EMPTY_REWARDS: dict[str, Any] = {
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
}
ECHO_OFF: dict[str, Any] = {
    "enabled": False,
    "lambda": None,
    "env_mask_mode": None,
    "warning_filter": None,
    "initial_env_ce": None,
    "final_env_ce": None,
}


def receipt_base(
    *,
    mode: str,
    adapter_name: str,
    cfg: EffectiveConfig,
    identity: ModelIdentity,
    precision: JsonObject,
    training_data: JsonObject,
    started: float,
    epochs: int,
    base_adapter_dir: Path | None,
    adapter_dir: Path | None,
    failure: tuple[str, str] | None,
    tokenize_ms: float,
    timings: dict[str, float],
    delta_norms: list[JsonObject],
    grad_norms: list[JsonObject],
) -> JsonObject:
    from kiln.model import git_source

    config = cfg.to_json()
    config_hash = json_sha256(config)
    commit, dirty = git_source()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    receipt: JsonObject = {
        "schema_version": 1,
        "receipt_type": "kiln_train_receipt",
        "adapter_name": adapter_name,
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
        },
        "adapters": {"base": adapter_file_receipt(base_adapter_dir), "output": adapter_file_receipt(adapter_dir)},
        "training_data": training_data,
        "hyperparameters": {
            "mode": mode,
            "rank": cfg.lora_rank,
            "alpha": cfg.lora_alpha,
            "alpha_over_rank": cfg.lora_alpha / cfg.lora_rank,
            "learning_rate": cfg.learning_rate,
            "epochs": epochs,
            "seed": cfg.seed,
        },
        "grpo": None,
        "echo": dict(ECHO_OFF),
        "no_policy_loss": False,
        "rewards": dict(EMPTY_REWARDS),
        "phase_timings": {
            "tokenize_ms": tokenize_ms,
            "mask_build_ms": 0.0,
            "reference_forward_ms": 0.0,
            "policy_forward_ms": 0.0,
            "backward_ms": 0.0,
            "optimizer_ms": 0.0,
            **timings,
            "gpu_writer_wait_ms": 0.0,
            "gpu_writer_held_ms": 0.0,
            "gpu_writer_acquisitions": 0,
        },
        "runtime": {
            "wall_clock_ms": int((time.perf_counter() - started) * 1000),
            "peak_vram_mib": None,
            "peak_host_memory_mib": peak_kib // 1024,
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
        "lora_delta_norms": delta_norms,
        "lora_grad_norms": grad_norms,
        "config": config,
    }
    if failure is not None:
        receipt["failure_message"] = failure[1]
    return receipt
