"""Receipt blocks the trainers fill the same way: the envelope (``kiln.training.receipt_base``) with the base
adapter resolved and the data-parallel plan of a run over several ranks, the ``data`` and ``token_counts`` blocks with every member the run does not use at 0, and the
``echo`` block."""

from __future__ import annotations

from typing import Any

from kiln.adapters import base_adapter_dir
from kiln.documents.jsonio import JsonObject
from kiln.trainers._admission import AdmittedJob
from kiln.training import Echo, EffectiveConfig, receipt_base
from kiln.training.echo import EchoAccumulator

__all__ = ["data_block", "echo_block", "envelope", "token_counts_block"]

DATA_MEMBERS = (
    "examples_read",
    "examples_filtered",
    "examples_trained",
    "groups_read",
    "groups_filtered",
    "groups_trained",
    "completions_read",
    "completions_trained",
    "reward_groups_filtered",
    "reward_groups_kept",
)


def envelope(job: AdmittedJob[EffectiveConfig], kind: str, **members: Any) -> JsonObject:
    """``receipt_base`` for ``job`` (its config, identity, precision, memory plan, adapter name and base adapter)."""
    cfg = job.config
    base = base_adapter_dir(job.registry, cfg.base_adapter) if cfg.base_adapter else None
    receipt = receipt_base(
        mode=kind,
        adapter_name=job.adapter_name,
        cfg=cfg,
        identity=job.identity,
        precision=job.precision,
        base_adapter_dir=base,
        **members,
    )
    if job.memory_plan is not None:  # the planner's estimate beside the measured peak
        receipt["runtime"]["memory_plan"] = job.memory_plan.record()
    if job.data_parallel_plan is not None:  # the ranks that trained and the kind's rule (the manifest repeats it)
        receipt["runtime"]["data_parallel"] = job.data_parallel_plan
    return receipt


def data_block(**counts: Any) -> JsonObject:
    """The receipt's ``data``: the given counts, every other member 0 (extra members such as ``sft_ingestion`` kept)."""
    unknown = set(counts) - set(DATA_MEMBERS) - {"sft_ingestion"}
    if unknown:
        raise ValueError(f"not members of the receipt's data block: {sorted(unknown)}")
    return {**dict.fromkeys(DATA_MEMBERS, 0), **counts}


def token_counts_block(*, action: int, env: int = 0, warning_filtered: int = 0, context: int = 0) -> dict[str, int]:
    """The receipt's ``token_counts``; ``env`` counts observation tokens after the warning filter."""
    return {
        "action_tokens": action,
        "env_tokens": env,
        "env_tokens_before_warning_filter": env + warning_filtered,
        "env_tokens_after_warning_filter": env,
        "warning_tokens_filtered": warning_filtered,
        "context_tokens": context,
    }


def echo_block(echo: Echo | None, accumulator: EchoAccumulator) -> JsonObject:
    """The receipt's ``echo`` from the effective ECHO term (None: off) and the run's ``EchoAccumulator``."""
    return accumulator.as_receipt(
        lam=echo.lam if echo else None,
        env_mask_mode=echo.env_mask_mode if echo else None,
        warning_filter=echo.warning_filter if echo else None,
    )
