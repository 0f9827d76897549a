"""GRPO trainer: LoRA policy updates from groups of completions the user scored.

Objective (spec/40 "GRPO"): per group, advantages from the rewards (``dr_grpo``:
A = r − mean r; ``vanilla`` divides by the population std + 1e-8); on every action token
the policy loss at the configured importance-sampling level (``token`` PPO clip,
``sequence`` GSPO, ``cispo``) against the behaviour policy (ratio 1 without importance
correction, or the recorded rollout log-probabilities), plus ``kl_coeff`` × the KL
estimate (``k1``, ``k3``) against the reference (the frozen base with LoRA disabled, an
EMA of the LoRA weights, or none), optionally only on high-entropy tokens; ECHO adds
λ × the cross-entropy of observation tokens; ``no_policy_loss`` trains ECHO alone. The
loss is aggregated over all active tokens of the group (``token_level``: one optimizer
step per group) or per completion (``per_sample``: one step per completion).

Read top to bottom: admission (request and config rules, target, model, pinned source,
ingestion with action/observation masks, identity — everything that can fail before
training), the dry run (every check, no forward pass, a receipt without weights), the
loop (group filters, forwards, loss, steps, audits) and publication (adapter, receipt with
the ``grpo`` block and policy audit, manifest). A failure after admission writes a failed
receipt with its category.

Checkpoints (spec/30): every ``checkpoint_interval`` committed groups (never after the
last group: the adapter is published instead) and on cancellation. A checkpoint binds the
trainable group order, the streamed-source cursor (byte offset, lines consumed and their
digest), the EMA reference tensors and cadence, the optimizer slots and the audit
accumulators; resuming continues with the next trainable group and ends with exactly the
bytes of an uninterrupted run.

Deliberate simplifications: one pass over the groups in source order (``GrpoConfig`` has
no epochs); the group filters are decided before training, so the trainable order is
known up front; one forward per completion with dense logits (fine for the vocabularies
Kiln trains on CPU; the fused SFT route is not used here yet); no
``reward_filter_groups.json`` sidecar.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln.artifacts.checkpoint_manifest import GRPO_SOURCE_KINDS
from kiln.artifacts.loop_state import loop_state_file_name
from kiln.checkpoints import (
    checkpoint_id,
    load_checkpoint,
    publish_checkpoint,
    require_compatible,
)
from kiln.digests import json_sha256, raw_hex
from kiln.errors import RequestError
from kiln.publish import stage_adapter, write_adapter_manifest, write_train_receipt
from kiln.trainers._grpo_config import check_grpo_request, effective_grpo_config
from kiln.trainers._resume import claim_target, optimizer_identity, resume_metadata
from kiln.training import (
    TrainingFailedError,
    attach_lora,
    build_optimizer,
    classify_failure,
    lora_delta_norms,
    lora_parameters,
)
from kiln.training import _grpo_objective as obj
from kiln.training._receipt import receipt_base
from kiln.training._state import (
    ADAPTER_FILE,
    LORA_INIT_ALGORITHM,
    OPTIMIZER_FILE,
    adapter_tensors,
    auxiliary_identity,
    encode_tensors,
    optimizer_tensors,
    planning_identity,
    restore_adapter,
    restore_optimizer,
)

KIND = "grpo"
LOOP_FILE = loop_state_file_name(KIND)
REFERENCE_FILE = "reference.safetensors"
PROGRESS_AUX = ("source_byte_offset", "source_lines_consumed", "consumed_lines_sha256", "ema_groups_since_refresh")
Progress = Callable[[dict[str, Any]], None]


@dataclass
class AdmittedGrpo:
    adapter_name: str
    registry: Path
    config: dict[str, Any]
    loaded: Any
    ingestion: Any
    tokenize_ms: float
    identity: Any
    precision: dict[str, Any]
    dry_run: bool = False
    pin: str | None = None
    resume: Any = None  # kiln.checkpoints.LoadedCheckpoint when resuming


@dataclass
class GrpoResult:
    status: str
    adapter_dir: Path
    receipt_path: Path
    manifest_path: Path | None
    receipt: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)
    cancelled: bool = False


# ----------------------------------------------------------------------------- admission


def admit_grpo(
    *,
    adapter_name: str,
    registry: Path,
    request: dict[str, Any],
    model_path: str | None = None,
    loaded: Any = None,
) -> AdmittedGrpo:
    """Everything that can fail before training; raises ``KilnError`` and publishes nothing."""
    from kiln.data.grpo import dataset_sha256, read_groups
    from kiln.model import capture_identity, load_base_model, resolve_model_path, training_precision

    check_grpo_request(request)
    config = dict(request.get("config") or {})
    checkpoint_path = resume_metadata(registry, adapter_name, config, KIND)
    cfg = effective_grpo_config(config, adapter_name)
    claim_target(registry, adapter_name, checkpoint_path)
    if loaded is None:
        path, is_default = resolve_model_path(model_path)
        loaded = load_base_model(path, is_default=is_default)
    dataset_path = request.get("dataset_path")
    pin = dataset_sha256(dataset_path) if dataset_path is not None else None
    echo = cfg["loss"]["echo"]
    start = time.perf_counter()
    ingestion = read_groups(
        tokenizer=loaded.tokenizer,
        groups=request.get("groups"),
        agentic_groups=request.get("agentic_groups"),
        dataset_path=dataset_path,
        warning_filter=echo["warning_filter"] if echo else True,
        behavior_policy=cfg["behavior_policy"],
    )
    tokenize_ms = (time.perf_counter() - start) * 1000
    if pin is not None and ingestion.source_sha256 != pin:
        raise RequestError(
            f"{dataset_path} changed while it was being read (pinned {pin}, read {ingestion.source_sha256})",
            code="training_invalid_request",
            hint="do not modify the file while a job uses it; submit again",
        )
    import torch

    torch.use_deterministic_algorithms(True)
    precision = training_precision(optimizer_kind=cfg["optimizer"]["kind"])
    identity = capture_identity(loaded.path, loaded.tokenizer, training_policy=precision)
    job = AdmittedGrpo(
        adapter_name,
        registry,
        cfg,
        loaded,
        ingestion,
        tokenize_ms,
        identity,
        precision,
        bool(request.get("dry_run")),
        pin,
    )
    if checkpoint_path is not None:
        job.resume = load_checkpoint(checkpoint_path)  # every byte hashed, loop state checked
        identity_now = identity_manifest(job)
        for key in PROGRESS_AUX:  # cursors move with progress; the loop state binds them
            if key in job.resume.manifest["auxiliary_state"]:
                identity_now["auxiliary_state"][key] = job.resume.manifest["auxiliary_state"][key]
        require_compatible(checkpoint_path.name, job.resume.manifest, identity_now)
    return job


class _NothingToTrainError(TrainingFailedError):
    """``zero_groups``, carrying the filter counts so the failed receipt still reports them."""

    def __init__(self, message: str, counts: dict[str, int]):
        super().__init__("zero_groups", message)
        self.counts = counts


def _filter(job: AdmittedGrpo) -> tuple[list[Any], dict[str, int]]:
    """The groups that train, and the counts of those dropped (dynamic sampling, variance filter)."""
    cfg = job.config
    kept, dynamic, variance = [], 0, 0
    for group in job.ingestion.groups:
        keep, reason = obj.keep_group(
            [c.reward for c in group.completions],
            dynamic_sampling=cfg["dynamic_sampling"],
            var_min=cfg["reward_filter_var_min"],
            var_max=cfg["reward_filter_var_max"],
        )
        if keep:
            kept.append(group)
        elif reason == obj.DROP_EQUAL_REWARDS:
            dynamic += 1
        else:
            variance += 1
    filtering = cfg["reward_filter_var_min"] is not None or cfg["reward_filter_var_max"] is not None
    if filtering and len(kept) < cfg["reward_filter_min_groups"]:
        if cfg["reward_filter_on_empty"] == "fail":
            raise _NothingToTrainError(
                f"the reward-variance filter kept {len(kept)} group(s), fewer than reward_filter_min_groups "
                f"{cfg['reward_filter_min_groups']}",
                {"dynamic": dynamic, "variance": variance},
            )
        if cfg["reward_filter_on_empty"] == "train-all":
            kept = [g for g in job.ingestion.groups if not (cfg["dynamic_sampling"] and _equal(g))]
            variance = 0
        else:  # skip: finish without an update
            kept = []
    elif not kept:
        raise _NothingToTrainError(
            "every group was filtered out; nothing would train", {"dynamic": dynamic, "variance": variance}
        )
    return kept, {"dynamic": dynamic, "variance": variance}


def _equal(group: Any) -> bool:
    rewards = [c.reward for c in group.completions]
    return max(rewards) == min(rewards)


def _plan(job: AdmittedGrpo) -> tuple[list[Any], dict[str, int]]:
    """The trainable groups in order (empty when the filters leave nothing) and the filter counts."""
    try:
        return _filter(job)
    except _NothingToTrainError as exc:
        return [], exc.counts


def _total_steps(job: AdmittedGrpo, kept: list[Any]) -> int:
    if job.config["loss_aggregation"] == "per_sample":
        return sum(len(g.completions) for g in kept)
    return len(kept)


def identity_manifest(job: AdmittedGrpo) -> dict[str, Any]:
    """The manifest of this run without progress, files and time: what a resume must match."""
    cfg = job.config
    kept, _ = _plan(job)
    optimizer = cfg["optimizer"]
    stateful = optimizer["kind"] != "sgd"
    optimizer_block, scheduler_block = optimizer_identity(cfg)
    ema = cfg["kl_reference_policy"]["kind"] == "ema"
    state_files = {"adapter_parameters": ADAPTER_FILE, "loss_history": LOOP_FILE}
    if stateful:
        state_files["optimizer_state"] = OPTIMIZER_FILE
    if ema:
        state_files["reference_state"] = REFERENCE_FILE
    planning = planning_identity(device="cpu")
    aux: dict[str, Any] = {
        "loop_state_type": "kiln.grpo-loop-state.v1",
        **auxiliary_identity(job.identity, job.precision, planning),
        "training_runtime_planning_identity": planning,
        "route": job.ingestion.route,
        "trainable_order_sha256": json_sha256([g.index for g in kept]),
        "reference_policy": cfg["kl_reference_policy"]["kind"],
    }
    return {
        "schema_version": 1,
        "manifest_type": "kiln.training-checkpoint.v1",
        "checkpoint_kind": "resumable",
        "training_kind": KIND,
        "adapter_name": job.adapter_name,
        "effective_config": cfg,
        "precision_policy": job.precision,
        "progress": {"total_steps": _total_steps(job, kept)},
        "data": {
            "source_kind": GRPO_SOURCE_KINDS[job.ingestion.route],
            "content_sha256": raw_hex(job.ingestion.source_sha256),
            "item_count": len(kept),
        },
        "rng_states": {"lora-init": {"algorithm": LORA_INIT_ALGORITHM, "seed": cfg["seed"], "position": 0}},
        "optimizer": optimizer_block,
        "scheduler": scheduler_block,
        "state_files": state_files,
        "auxiliary_state": aux,
    }


@dataclass
class _Loop:
    """The loop's committed state; ``as_document`` is ``grpo_loop_state.json``."""

    route: str
    groups_committed: int = 0  # trainable groups done (the cursor into the trainable order)
    losses: list[float] = field(default_factory=list)
    completions: int = 0
    audits: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def as_document(self, job: AdmittedGrpo, kept: list[Any], counts: dict[str, int], ema: Any) -> dict[str, Any]:
        groups = job.ingestion.groups
        consumed = kept[self.groups_committed - 1].index + 1 if self.groups_committed else 0
        done = kept[: self.groups_committed]
        filtered = consumed - self.groups_committed
        dynamic = (
            sum(1 for g in groups[:consumed] if g not in done and _equal(g)) if job.config["dynamic_sampling"] else 0
        )
        doc: dict[str, Any] = {
            "schema_version": 1,
            "state_type": "kiln.grpo-loop-state.v1",
            "route": self.route,
            "global_step": len(self.losses),
            "processed_completions": self.completions,
            "loss_history": list(self.losses),
            "last_loss": self.losses[-1] if self.losses else None,
            "data_stats": {
                "groups_read": consumed,
                "groups_filtered": filtered,
                "groups_trained": self.groups_committed,
                "completions_read": sum(len(g.completions) for g in groups[:consumed]),
                "completions_trained": self.completions,
            },
            "token_counts": _token_counts(done),
            "dynamic_groups_filtered": min(dynamic, filtered),
            "echo_metrics": self.audits["echo"].loop_state(),
            "lora_grad_norms": [],
            "policy_audit": {
                "importance_sampling": self.audits["is"].loop_state(),
                "kl_reference": self.audits["kl"].loop_state(),
                "recorded_provenance": {
                    "completion_count": 0,
                    "sampled_action_tokens": 0,
                    "forced_action_tokens": 0,
                    "behavior_sources": [],
                },
            },
            "phase_timings": {
                "tokenize_ms": job.tokenize_ms,
                "mask_build_ms": 0.0,
                **{
                    k: self.timings.get(k, 0.0)
                    for k in ("reference_forward_ms", "policy_forward_ms", "backward_ms", "optimizer_ms")
                },
            },
            "writer_timings": {"gpu_writer_wait_ms": 0.0, "gpu_writer_held_ms": 0.0, "gpu_writer_acquisitions": 0},
        }
        doc.update(_cursor(job, consumed, ema, self.groups_committed, loop=True))
        return doc


def _token_counts(groups: list[Any]) -> dict[str, int]:
    action = sum(c.action_tokens for g in groups for c in g.completions)
    env = sum(c.observation_tokens for g in groups for c in g.completions)
    warning = sum(c.warning_tokens for g in groups for c in g.completions)
    total = sum(len(c.input_ids) for g in groups for c in g.completions)
    return {
        "action_tokens": action,
        "env_tokens": env,
        "env_tokens_before_warning_filter": env + warning,
        "env_tokens_after_warning_filter": env,
        "warning_tokens_filtered": warning,
        "context_tokens": total - action - env,
    }


def _cursor(job: AdmittedGrpo, consumed: int, ema: Any, committed: int, *, loop: bool = False) -> dict[str, Any]:
    """The progress-dependent members shared by the loop state and ``auxiliary_state``."""
    out: dict[str, Any] = {}
    if job.ingestion.route == "jsonl":
        position = job.ingestion.positions[consumed - 1] if consumed else None
        out["source_byte_offset"] = position.source_byte_offset if position else 0
        out["source_lines_consumed"] = position.source_lines_consumed if position else 0
        if not loop:
            out["consumed_lines_sha256"] = position.consumed_lines_sha256 if position else json_sha256([])
    if ema is not None:
        out["ema_groups_since_refresh"] = ema.groups_since_refresh(committed)
    return out


def _publish(
    job: AdmittedGrpo, loop: _Loop, kept: list[Any], counts: dict[str, int], params: Any, optimizer: Any, ema: Any
) -> Any:
    stateful = job.config["optimizer"]["kind"] != "sgd"

    def capture() -> tuple[Any, Any, Any, dict[str, Any]]:
        return (
            adapter_tensors(params),
            optimizer_tensors(optimizer, params) if stateful else None,
            ema.state_dict() if ema is not None else None,
            loop.as_document(job, kept, counts, ema),
        )

    def encode(snapshot: Any) -> tuple[dict[str, Any], dict[str, tuple[str, bytes]]]:
        adapter, slots, reference, loop_doc = snapshot
        manifest = identity_manifest(job)
        step = loop_doc["global_step"]
        manifest["checkpoint_id"] = checkpoint_id(KIND, step)
        manifest["created_at"] = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        manifest["progress"] = {
            "global_step": step,
            "total_steps": _total_steps(job, kept),
            "epoch_index": 0,
            "cursor_in_epoch": loop.groups_committed,
            "data_order": list(range(len(kept))),
        }
        manifest["optimizer"]["step"] = step
        manifest["scheduler"]["step"] = step
        consumed = kept[loop.groups_committed - 1].index + 1 if loop.groups_committed else 0
        manifest["auxiliary_state"].update(_cursor(job, consumed, ema, loop.groups_committed))
        files = {
            ADAPTER_FILE: ("adapter-parameters", encode_tensors(adapter)),
            LOOP_FILE: ("loss-history", contracts.render("GrpoLoopState", loop_doc)),
        }
        if slots is not None:
            files[OPTIMIZER_FILE] = ("optimizer-state", encode_tensors(slots))
        if reference is not None:
            files[REFERENCE_FILE] = ("reference-state", encode_tensors(reference))
        return manifest, files

    return publish_checkpoint(job.registry, capture, encode)


# ----------------------------------------------------------------------------- dry run


def dry_run_grpo(job: AdmittedGrpo) -> GrpoResult:
    """Every check of a real run without a forward or backward pass; a receipt without weights."""
    from kiln.data.grpo import check_unchanged

    started = time.perf_counter()
    adapter_dir = job.registry / job.adapter_name
    kept: list[Any] = []
    counts = {"dynamic": 0, "variance": 0}
    try:
        if job.pin is not None:
            check_unchanged(job.ingestion.path, job.pin)
        kept, counts = _filter(job)
        failure = None
    except TrainingFailedError as exc:
        failure = (exc.reason, str(exc))
        counts = getattr(exc, "counts", counts)
    receipt = _receipt(job, started, kept, counts, {}, [], None, None, failure=failure, dry_run=True)
    path = write_train_receipt(adapter_dir, receipt)
    return GrpoResult("success" if failure is None else "failed", adapter_dir, path, None, receipt)


# ----------------------------------------------------------------------------- the run


def _logprobs(model: Any, ids: Any) -> tuple[Any, Any]:
    """Log-probabilities of every next token ``[T-1, V]`` and of the taken ones ``[T-1]``."""
    import torch

    logits = model(input_ids=ids.unsqueeze(0)).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp, logp.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)


def run_grpo(
    job: AdmittedGrpo, *, progress: Progress | None = None, cancel: threading.Event | None = None
) -> GrpoResult:
    """Train, then publish adapter, receipt and manifest (or a failed receipt)."""
    import torch

    from kiln.trainers.sft import _warm_start, base_adapter_dir

    if job.dry_run:
        return dry_run_grpo(job)
    started = time.perf_counter()
    cfg = job.config
    adapter_dir = job.registry / job.adapter_name
    timings = dict.fromkeys(("policy_forward_ms", "reference_forward_ms", "backward_ms", "optimizer_ms"), 0.0)
    audits = {
        "is": obj.ImportanceSamplingAccumulator(),
        "kl": obj.KlReferenceAccumulator(),
        "echo": obj.EchoAccumulator(),
    }
    losses: list[float] = []
    published: list[Path] = []
    kept: list[Any] = []
    counts = {"dynamic": 0, "variance": 0}
    delta_norms: list[dict[str, Any]] = []
    echo = cfg["loss"]["echo"]
    reference = cfg["kl_reference_policy"]
    kl_on = cfg["kl_coeff"] > 0 and cfg["kl_estimator"] != "none"
    try:
        from kiln.data.grpo import check_unchanged

        if job.pin is not None:
            check_unchanged(job.ingestion.path, job.pin)
        kept, counts = _filter(job)
        torch.manual_seed(0)  # nothing should draw from the global RNG; pin it anyway
        model = attach_lora(job.loaded.model, rank=cfg["lora_rank"], alpha=cfg["lora_alpha"], seed=cfg["seed"])
        params = lora_parameters(model)
        if cfg["base_adapter"]:
            _warm_start(params, base_adapter_dir(job.registry, cfg["base_adapter"]))
        optimizer = build_optimizer(cfg["optimizer"], list(params.values()), cfg["learning_rate"])
        ema = (
            obj.EmaReference(params, decay=reference["decay"], refresh_every=reference["refresh_every"])
            if reference["kind"] == "ema"
            else None
        )
        loop = _Loop(job.ingestion.route, audits=audits, timings=timings, losses=losses)
        if job.resume is not None:
            from safetensors.torch import load as load_tensors

            manifest, state = job.resume.manifest, job.resume.loop_state
            restore_adapter(params, job.resume.blobs[manifest["state_files"]["adapter_parameters"]])
            state_file = manifest["optimizer"].get("state_file")
            restore_optimizer(optimizer, params, job.resume.blobs[state_file] if state_file else None)
            if ema is not None:
                ema.load_state_dict(load_tensors(job.resume.blobs[manifest["state_files"]["reference_state"]]))
            losses.extend(state["loss_history"])
            loop.completions = state["processed_completions"]
            loop.groups_committed = manifest["progress"]["cursor_in_epoch"]
            audits["is"] = obj.ImportanceSamplingAccumulator.from_loop_state(
                state["policy_audit"]["importance_sampling"]
            )
            audits["kl"] = obj.KlReferenceAccumulator.from_loop_state(state["policy_audit"]["kl_reference"])
            audits["echo"] = obj.EchoAccumulator.from_loop_state(state["echo_metrics"])
        interval = cfg["checkpoint_interval"]

        def reference_logp(ids: Any) -> Any:
            t0 = time.perf_counter()
            with torch.no_grad():
                if reference["kind"] == "base_per_step":
                    with model.disable_adapter():
                        _, taken = _logprobs(model, ids)
                else:  # ema: the averaged LoRA tensors in place for one forward
                    saved = {n: p.detach().clone() for n, p in params.items()}
                    for name, tensor in ema.tensors.items():
                        params[name].copy_(tensor)
                    _, taken = _logprobs(model, ids)
                    for name, tensor in saved.items():
                        params[name].copy_(tensor)
            timings["reference_forward_ms"] += (time.perf_counter() - t0) * 1000
            return taken

        def completion_terms(group: Any, index: int, advantage: float, ref: Any) -> tuple[Any, Any, int]:
            """One completion: its policy(+KL) loss summed over action tokens, and the sum and count
            of its observation-token log-probabilities (ECHO)."""
            c = group.completions[index]
            ids = torch.tensor(c.input_ids, dtype=torch.long)
            t0 = time.perf_counter()
            logp_all, taken = _logprobs(model, ids)
            timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
            mask = torch.tensor(c.action_mask, dtype=torch.bool).unsqueeze(0)
            new = taken.unsqueeze(0)
            behavior = None
            if cfg["behavior_policy"] == "recorded":
                behavior = torch.zeros_like(new)
                behavior[mask] = torch.tensor(c.recorded_logprobs, dtype=new.dtype)
            per_token, is_audit = obj.policy_loss(
                new,
                behavior,
                torch.tensor([[advantage]], dtype=new.dtype),
                mask,
                is_level=cfg["is_level"],
                clip_low=cfg["clip_epsilon"],
                clip_high=cfg["clip_eps_high"],
                cispo_max_weight=cfg["cispo_max_weight"],
            )
            audits["is"].add(is_audit)
            if cfg["loss"]["no_policy_loss"]:
                per_token = torch.zeros_like(per_token)
            if kl_on:
                entropy = None
                if cfg["entropy_aware_kl_quantile"] is not None:
                    with torch.no_grad():
                        entropy = -(logp_all.exp() * logp_all).sum(-1).unsqueeze(0)
                kl, kl_audit = obj.kl_estimate(
                    new,
                    ref.unsqueeze(0),
                    mask,
                    cfg["kl_estimator"],
                    entropy=entropy,
                    entropy_quantile=cfg["entropy_aware_kl_quantile"],
                )
                audits["kl"].add(kl_audit)
                per_token = per_token + cfg["kl_coeff"] * kl
            policy = torch.where(mask, per_token, torch.zeros_like(per_token)).sum()
            obs = torch.tensor(c.observation_mask, dtype=torch.bool)
            return policy, torch.where(obs, taken, torch.zeros_like(taken)).sum(), int(obs.sum())

        def step(parts: list[tuple[Any, Any, int]], tokens: int) -> float:
            """One optimizer step: mean policy loss over ``tokens`` action tokens, plus λ·CE(observations)."""
            loss = sum(p for p, _, _ in parts) / max(tokens, 1)
            observed = sum(n for _, _, n in parts)
            env_ce = None
            if echo is not None and observed:
                ce = -sum(o for _, o, _ in parts) / observed
                loss = loss + float(echo["lambda"]) * ce
                env_ce = float(ce.detach())
            value = float(loss.detach())
            if not torch.isfinite(loss.detach()):
                raise TrainingFailedError(
                    "nan_loss", f"non-finite GRPO loss {value} at optimizer step {len(losses) + 1}"
                )
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            timings["backward_ms"] += (t1 - t0) * 1000
            timings["optimizer_ms"] += (time.perf_counter() - t1) * 1000
            audits["echo"].add(env_ce)
            losses.append(value)
            return value

        for number, group in enumerate(kept, start=1):
            if number <= loop.groups_committed:
                continue  # resumed: committed before the checkpoint
            rewards = torch.tensor([c.reward for c in group.completions], dtype=torch.float64)
            adv = obj.advantages(rewards, cfg["advantage_mode"]).tolist()
            # reference log-probabilities first: an EMA reference is swapped into the LoRA tensors,
            # which must not happen between a policy forward and its backward
            refs = [
                reference_logp(torch.tensor(c.input_ids, dtype=torch.long)) if kl_on else None
                for c in group.completions
            ]
            if cfg["loss_aggregation"] == "token_level":
                parts = [completion_terms(group, i, adv[i], refs[i]) for i in range(len(group.completions))]
                value = step(parts, sum(c.action_tokens for c in group.completions))
            else:
                for i, c in enumerate(group.completions):
                    value = step([completion_terms(group, i, adv[i], refs[i])], c.action_tokens)
            if ema is not None:
                ema.update(params, number)
            loop.groups_committed = number
            loop.completions += len(group.completions)
            if progress:
                progress({"step": number, "total": len(kept), "loss": value, "tokens": group.prompt_tokens})
            if number >= len(kept):
                break  # the final group publishes the adapter, not a checkpoint
            just_published = None
            if interval and number % interval == 0:
                just_published = _publish(job, loop, kept, counts, params, optimizer, ema)
                published.append(just_published.path)
            if cancel is not None and cancel.is_set():
                where = just_published or _publish(job, loop, kept, counts, params, optimizer, ema)
                if where is not just_published:
                    published.append(where.path)
                raise TrainingFailedError(
                    "cancelled", f"cancelled after group {number} of {len(kept)}; resume from {where.path.name}"
                )
        delta_norms = lora_delta_norms(model)
        if not kept:  # reward_filter_on_empty "skip": finish without an update
            receipt = _receipt(job, started, kept, counts, timings, delta_norms, audits, None)
            return GrpoResult(
                "success", adapter_dir, write_train_receipt(adapter_dir, receipt), None, receipt, losses, published
            )
        adapter_dir = stage_adapter(model, job.registry, job.adapter_name)
        receipt = _receipt(job, started, kept, counts, timings, delta_norms, audits, adapter_dir)
        receipt_path = write_train_receipt(adapter_dir, receipt)
        manifest_path = write_adapter_manifest(adapter_dir, receipt)
        return GrpoResult("success", adapter_dir, receipt_path, manifest_path, receipt, losses, published)
    except BaseException as exc:
        reason, message = classify_failure(exc)
        counts = getattr(exc, "counts", counts)
        receipt = _receipt(job, started, kept, counts, timings, delta_norms, audits, None, failure=(reason, message))
        receipt_path = write_train_receipt(adapter_dir, receipt)
        if isinstance(exc, KeyboardInterrupt):
            raise
        return GrpoResult(
            "failed", adapter_dir, receipt_path, None, receipt, losses, published, cancelled=reason == "cancelled"
        )


# ----------------------------------------------------------------------------- the receipt


def _receipt(job, started, kept, counts, timings, delta_norms, audits, adapter_dir, *, failure=None, dry_run=False):
    from kiln.trainers.sft import base_adapter_dir

    cfg, ingestion = job.config, job.ingestion
    rewards = obj.RewardStatsAccumulator(
        saturation_threshold=cfg["reward_saturation_threshold"],
        low_variance_threshold=cfg["reward_low_variance_threshold"],
    )
    for group in ingestion.groups:
        rewards.add_group([c.reward for c in group.completions])
    receipt = receipt_base(
        mode=KIND,
        adapter_name=job.adapter_name,
        cfg=cfg,
        identity=job.identity,
        precision=job.precision,
        training_data=ingestion.training_data(dry_run=dry_run),
        started=started,
        epochs=1,
        base_adapter_dir=base_adapter_dir(job.registry, cfg["base_adapter"]) if cfg["base_adapter"] else None,
        adapter_dir=adapter_dir,
        failure=failure,
        tokenize_ms=job.tokenize_ms,
        timings=timings,
        delta_norms=delta_norms,
        grad_norms=[],
    )
    receipt["hyperparameters"]["shuffle"] = False  # groups train once, in source order
    grpo: dict[str, Any] = {
        key: cfg[key]
        for key in (
            "kl_coeff",
            "clip_epsilon",
            "clip_eps_high",
            "cispo_max_weight",
            "dynamic_sampling",
            "advantage_mode",
            "loss_aggregation",
            "kl_estimator",
            "is_level",
            "behavior_policy",
            "kl_reference_policy",
            "entropy_aware_kl_quantile",
        )
    }
    grpo["dynamic_groups_filtered"] = counts["dynamic"]
    if audits and (audits["is"].ratio_observations or audits["kl"].token_observations):
        grpo["policy_audit"] = obj.policy_audit_receipt(audits["is"], audits["kl"])
    receipt["grpo"] = grpo
    echo = cfg["loss"]["echo"]
    echo_acc = audits["echo"] if audits else obj.EchoAccumulator()
    receipt["echo"] = echo_acc.as_receipt(
        lam=float(echo["lambda"]) if echo else None,
        env_mask_mode=echo["env_mask_mode"] if echo else None,
        warning_filter=echo["warning_filter"] if echo else None,
    )
    receipt["no_policy_loss"] = cfg["loss"]["no_policy_loss"]
    trained = len(kept) if failure is None and not dry_run else 0
    receipt["data"] = {
        "examples_read": 0,
        "examples_filtered": 0,
        "examples_trained": 0,
        "groups_read": len(ingestion.groups),
        "groups_filtered": counts["dynamic"] + counts["variance"],
        "groups_trained": trained,
        "completions_read": sum(len(g.completions) for g in ingestion.groups),
        "completions_trained": sum(len(g.completions) for g in kept) if trained else 0,
        "reward_groups_filtered": counts["variance"],
        "reward_groups_kept": len(ingestion.groups) - counts["variance"],
    }
    receipt["rewards"] = rewards.as_receipt()
    receipt["token_counts"] = ingestion.counts.token_counts()
    return receipt
