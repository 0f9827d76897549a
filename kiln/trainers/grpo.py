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
training), the dry run (every check, no forward pass, a receipt without weights; data it
finds bad is its failed receipt, not a refusal), the
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
``reward_filter_groups.json`` sidecar. The loss is reduced by the objective's
``aggregate`` and ECHO's cross-entropy by its ``echo_loss`` (the components the objective
tests pin).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.artifacts.checkpoint_manifest import GRPO_SOURCE_KINDS
from kiln.digests import json_sha256, raw_hex
from kiln.errors import ZeroEnvTokensError, ZeroGroupsError
from kiln.trainers._admission import AdmittedJob, TrainingContext, base_model, job_fields, single_process
from kiln.trainers._checkpointing import CheckpointProgress, manifest_head, publish_state, restore_policy
from kiln.trainers._grpo_config import check_grpo_data, check_grpo_request, effective_grpo_config
from kiln.trainers._grpo_parts import (
    BatchedForwards,
    ReferencePolicy,
    completion_loss,
    filter_groups,
    ingest,
    logprobs,
    plan_groups,
    share_loss,
    step_plan,
    step_weights,
)
from kiln.trainers._kit import (
    Cadence,
    Policy,
    Progress,
    TrainResult,
    check_pin,
    guarded,
    publish_adapter,
    publish_receipt_only,
)
from kiln.trainers._loop_states import GrpoLoop, grpo_cursor
from kiln.trainers._receipts import data_block, echo_block, envelope
from kiln.trainers._resume import claim_target, load_resume, resume_metadata
from kiln.training import LORA_INIT_ALGORITHM, lora_delta_norms, model_head
from kiln.training import grpo_objective as obj

KIND = "grpo"
REFERENCE_FILE = "reference.safetensors"
PROGRESS_AUX = ("source_byte_offset", "source_lines_consumed", "consumed_lines_sha256", "ema_groups_since_refresh")
NO_COUNTS = {"dynamic": 0, "variance": 0}
# fmt: off
RECEIPT_CONFIG = (  # the effective-config members the receipt's grpo block repeats
    "kl_coeff", "clip_epsilon", "clip_eps_high", "cispo_max_weight", "dynamic_sampling", "advantage_mode",
    "loss_aggregation", "kl_estimator", "is_level", "behavior_policy", "kl_reference_policy",
    "entropy_aware_kl_quantile",
)
# fmt: on

__all__ = ["AdmittedGrpo", "admit_grpo", "admit_request", "run_grpo"]


# ----------------------------------------------------------------------------- admission


@dataclass(kw_only=True)
class AdmittedGrpo(AdmittedJob):
    ingestion: Any
    tokenize_ms: float
    pin: str | None = None
    refused: Any = None  # a dry run's data refusal (TrainingFailedError), recorded by its failed receipt
    head: Any = None  # kiln.training.ModelHead, proven at admission when micro-batches read the logits themselves
    kind: str = field(default=KIND, init=False)

    @property
    def total_steps(self) -> int:
        kept, _ = plan_groups(self)
        cfg = self.config
        return len(step_plan(kept, cfg["loss_aggregation"], cfg["gradient_accumulation_steps"]))

    @property
    def data_sha256(self) -> str:
        return self.ingestion.source_sha256

    def identity_manifest(self) -> dict[str, Any]:
        cfg = self.config
        kept, _ = plan_groups(self)
        return manifest_head(
            self,
            KIND,
            total_steps=self.total_steps,
            data={
                "source_kind": GRPO_SOURCE_KINDS[self.ingestion.route],
                "content_sha256": raw_hex(self.ingestion.source_sha256),
                "item_count": len(kept),
            },
            rng_states={"lora-init": {"algorithm": LORA_INIT_ALGORITHM, "seed": cfg["seed"], "position": 0}},
            extra_state_files={"reference_state": REFERENCE_FILE} if _ema(cfg) else None,
            auxiliary={
                "route": self.ingestion.route,
                "trainable_order_sha256": json_sha256([g.index for g in kept]),
                "reference_policy": cfg["kl_reference_policy"]["kind"],
            },
        )


def admit_grpo(
    *,
    adapter_name: str,
    registry: Any,
    request: dict[str, Any],
    model_path: str | None = None,
    loaded: Any = None,
    data_parallel: Any = None,
) -> AdmittedGrpo:
    """Everything that can fail before training; raises ``KilnError`` and publishes nothing (``data_parallel``: the
    one worker process it trains in, when not this one)."""
    from kiln.data import check_unchanged, dataset_sha256

    check_grpo_request(request)
    config = dict(request.get("config") or {})
    checkpoint_path = resume_metadata(registry, adapter_name, config, KIND)
    cfg = effective_grpo_config(config, adapter_name)
    claim_target(registry, adapter_name, checkpoint_path)
    loaded = base_model(model_path, loaded)
    dataset_path = request.get("dataset_path")
    pin = dataset_sha256(dataset_path) if dataset_path is not None else None
    start = time.perf_counter()
    ingestion, refused = ingest(request, loaded.tokenizer, cfg, pin)
    tokenize_ms = (time.perf_counter() - start) * 1000
    if pin is not None and refused is None:  # the bytes the streamed pass read are the bytes pinned before it
        check_unchanged(dataset_path, pin, now=ingestion.source_sha256)
    job = AdmittedGrpo(
        **job_fields(adapter_name, registry, cfg, loaded, data_parallel=data_parallel),
        ingestion=ingestion,
        tokenize_ms=tokenize_ms,
        dry_run=bool(request.get("dry_run")),
        refused=refused,
        pin=pin,
        head=model_head(loaded.model) if cfg["micro_batch_size"] > 1 else None,
    )
    check_grpo_data(job)
    job.resume = load_resume(checkpoint_path, job.identity_manifest(), progress_auxiliary=PROGRESS_AUX)
    return job


def admit_request(request: dict[str, Any], *, adapter_name: str, context: TrainingContext) -> AdmittedGrpo:
    """A ``GrpoRequest`` body admitted in ``context`` (a dry run gets no default checkpoint interval)."""
    single_process(context, "GRPO")
    config = dict(request.get("config") or {})
    if config.get("checkpoint_interval") is None and not request.get("dry_run"):
        config["checkpoint_interval"] = context.checkpoint_interval
    return admit_grpo(
        adapter_name=adapter_name,
        registry=context.registry,
        request={**request, "config": config},
        model_path=context.model_path,
        loaded=context.loaded,
        data_parallel=context.data_parallel,
    )


def _ema(cfg: dict[str, Any]) -> bool:
    return cfg["kl_reference_policy"]["kind"] == "ema"


# ----------------------------------------------------------------------------- dry run


def dry_run_grpo(job: AdmittedGrpo) -> TrainResult:
    """Every check of a real run without a forward or backward pass; a receipt without weights."""
    started = time.perf_counter()
    run: dict[str, Any] = {"kept": [], "counts": dict(NO_COUNTS), "timings": {}, "delta_norms": []}

    def check() -> TrainResult:
        check_pin(job.ingestion.path, job.pin)
        if job.refused is not None:
            raise job.refused
        run["kept"], run["counts"] = filter_groups(job)
        return publish_receipt_only(job, _receipt(job, started, run, None, None, dry_run=True))

    def failed(failure: tuple[str, str], exc: BaseException) -> dict[str, Any]:
        if isinstance(exc, (ZeroGroupsError, ZeroEnvTokensError)):
            run["counts"] = exc.counts or run["counts"]
        return _receipt(job, started, run, None, None, failure=failure, dry_run=True)

    return guarded(job, check, failed, dict)


# ----------------------------------------------------------------------------- the run


def run_grpo(
    job: AdmittedGrpo,
    *,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    on_checkpoint: Callable[[Any], None] | None = None,
) -> TrainResult:
    """Train, then publish adapter, receipt and manifest (or a failed receipt)."""
    if job.dry_run:
        return dry_run_grpo(job)
    started = time.perf_counter()
    cfg = job.config
    audits = {
        "is": obj.ImportanceSamplingAccumulator(),
        "kl": obj.KlReferenceAccumulator(),
        "echo": obj.EchoAccumulator(),
    }
    loop = GrpoLoop(job.ingestion.route, audits=audits, timings={})
    run: dict[str, Any] = {"kept": [], "counts": dict(NO_COUNTS), "timings": {}, "delta_norms": [], "cadence": None}
    echo = cfg["loss"]["echo"]
    reference = cfg["kl_reference_policy"]
    kl_on = cfg["kl_coeff"] > 0 and cfg["kl_estimator"] != "none"
    entropy_kl = kl_on and cfg["entropy_aware_kl_quantile"] is not None

    def train() -> TrainResult:
        import torch

        check_pin(job.ingestion.path, job.pin)
        kept, _ = run["kept"], run["counts"] = filter_groups(job)
        policy = Policy(job, restore=restore_policy)
        model, params = policy.model, policy.params
        loop.timings = run["timings"] = policy.timings
        ema = (
            obj.EmaReference(params, decay=reference["decay"], refresh_every=reference["refresh_every"])
            if reference["kind"] == "ema"
            else None
        )
        reference_logp = ReferencePolicy(model, params, ema, policy.timings)
        if job.resume is not None:
            loop.restore(job.resume, ema)
        cadence = run["cadence"] = Cadence(job, lambda: _publish(job, loop, kept, policy, ema), cancel, on_checkpoint)

        def completion_terms(c: Any, advantage: float, ref: Any, found: Any = None) -> tuple[Any, Any, Any, Any]:
            """One completion's loss terms (``completion_loss``); ``found``: its ``(taken, entropy)`` from a batched
            forward; None runs its own forward."""
            if found is None:
                t0 = time.perf_counter()
                logp_all, taken = logprobs(model, torch.tensor(c.input_ids, dtype=torch.long))
                loop.timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
                with torch.no_grad():
                    found = (taken, -(logp_all.exp() * logp_all).sum(-1) if entropy_kl else None)
            return completion_loss(cfg, audits, c, advantage, ref, *found, kl_on=kl_on)

        forwards = BatchedForwards(
            model, job.head, reference_logp, cfg["micro_batch_size"], echo=echo is not None, entropy=entropy_kl
        )

        def share(parts: list[tuple[Any, Any, Any, Any]], weight: float, echo_weight: float) -> tuple[float, Any]:
            """Backward of one share of an optimizer step (``share_loss``); its value and ``(CE, tokens)``."""
            loss, found = share_loss(parts, weight, echo_weight, echo)
            return policy.accumulate(loss, lambda: f"optimizer step {len(loop.losses) + 1}"), found

        def commit(values: list[float], found: list[Any]) -> float:
            """The optimizer step of the accumulated shares; its loss and ECHO cross-entropy are recorded."""
            policy.apply()
            value = sum(values[1:], values[0])
            audits["echo"].add(obj.step_echo_ce(found))
            loop.losses.append(value)
            return value

        group_refs: dict[int, list[Any]] = {}  # reference log-probabilities of the group in training, computed first

        def group_terms(number: int) -> list[tuple[Any, float, Any]]:
            if number not in group_refs:
                group_refs.clear()
                completions = kept[number - 1].completions
                rewards = torch.tensor([c.reward for c in completions], dtype=torch.float64)
                adv = obj.advantages(rewards, cfg["advantage_mode"]).tolist()
                # reference log-probabilities first: an EMA reference is swapped into the LoRA tensors,
                # which must not happen between a policy forward and its backward
                refs = forwards.references(completions) if kl_on else [None] * len(completions)
                group_refs[number] = [(c, adv[i], refs[i]) for i, c in enumerate(completions)]
            return group_refs[number]

        settled_at = loop.groups_committed
        for shares in step_plan(kept, cfg["loss_aggregation"], cfg["gradient_accumulation_steps"]):
            if shares[-1][0] <= loop.groups_committed:
                continue  # resumed: committed before the checkpoint (checkpoints land on step boundaries)
            values, found, value = [], [], None
            for (number, indices), weights in zip(
                shares, step_weights(kept, shares, cfg["loss_aggregation"]), strict=True
            ):
                terms = group_terms(number)
                if cfg["loss_aggregation"] == "token_level":  # the whole group: batched forwards when configured
                    batched = forwards.policy(kept[number - 1].completions, loop.timings)
                    parts = [completion_terms(*t, batched[i]) for i, t in enumerate(terms)]
                else:  # one completion
                    parts = [completion_terms(*terms[i]) for i in indices]
                out = share(parts, *weights)
                values.append(out[0])
                found.append(out[1])
                if indices[-1] + 1 < len(terms):
                    continue  # per_sample: the group goes on in the next step
                if number == shares[-1][0]:
                    value = commit(values, found)
                if ema is not None:
                    ema.update(params, number)
                loop.groups_committed = number
                loop.completions += len(terms)
                if progress:
                    progress(
                        {"step": number, "total": len(kept), "loss": value, "tokens": kept[number - 1].prompt_tokens}
                    )
            if value is None:  # per_sample, a step inside a group
                value = commit(values, found)
                continue
            cadence.settled(
                len(loop.losses),
                last=loop.groups_committed >= len(kept),
                # every checkpoint_interval groups, published at the end of the step that reaches it
                due=any(cadence.due(n) for n in range(settled_at + 1, loop.groups_committed + 1)),
                cancelled=lambda name, n=loop.groups_committed: (
                    f"cancelled after group {n} of {len(kept)}; resume from {name}"
                ),
            )
            settled_at = loop.groups_committed
        run["delta_norms"] = lora_delta_norms(model)
        if not kept:  # reward_filter_on_empty "skip": finish without an update
            return publish_receipt_only(job, _receipt(job, started, run, audits, None), losses=list(loop.losses))
        return publish_adapter(
            job,
            model,
            lambda adapter_dir: _receipt(job, started, run, audits, adapter_dir),
            losses=list(loop.losses),
            checkpoints=cadence.published,
        )

    def failed(failure: tuple[str, str], exc: BaseException) -> dict[str, Any]:
        if isinstance(exc, (ZeroGroupsError, ZeroEnvTokensError)):
            run["counts"] = exc.counts or run["counts"]
        return _receipt(job, started, run, audits, None, failure=failure)

    return guarded(
        job,
        train,
        failed,
        lambda: {"losses": list(loop.losses), "checkpoints": run["cadence"].published if run["cadence"] else []},
    )


def _publish(job: AdmittedGrpo, loop: GrpoLoop, kept: list[Any], policy: Policy, ema: Any) -> Any:
    def stamp(manifest: dict[str, Any], loop_doc: dict[str, Any]) -> CheckpointProgress:
        consumed = loop.consumed(kept)
        manifest["auxiliary_state"].update(grpo_cursor(job.ingestion, consumed, ema, loop.groups_committed))
        return CheckpointProgress(
            loop_doc["global_step"], job.total_steps, 0, loop.groups_committed, list(range(len(kept)))
        )

    def reference() -> dict[str, Any]:
        return {REFERENCE_FILE: ("reference-state", ema.state_dict())} if ema is not None else {}

    return publish_state(
        job,
        KIND,
        policy.params,
        policy.optimizer,
        loop_document=lambda: loop.as_document(job, kept, ema),
        stamp=stamp,
        extra_tensors=reference,
    )


# ----------------------------------------------------------------------------- the receipt


def _receipt(job, started, run, audits, adapter_dir, *, failure=None, dry_run=False) -> dict[str, Any]:
    cfg, ingestion = job.config, job.ingestion
    kept, counts = run["kept"], run["counts"]
    rewards = obj.RewardStatsAccumulator(
        saturation_threshold=cfg["reward_saturation_threshold"],
        low_variance_threshold=cfg["reward_low_variance_threshold"],
    )
    for group in ingestion.groups:
        rewards.add_group([c.reward for c in group.completions])
    receipt = envelope(
        job,
        KIND,
        training_data=ingestion.training_data(dry_run=dry_run),
        started=started,
        epochs=1,
        adapter_dir=adapter_dir,
        failure=failure,
        tokenize_ms=job.tokenize_ms,
        timings=run["timings"],
        delta_norms=run["delta_norms"],
        grad_norms=[],
    )
    receipt["hyperparameters"]["shuffle"] = False  # groups train once, in source order
    grpo: dict[str, Any] = {key: cfg[key] for key in RECEIPT_CONFIG}
    grpo["dynamic_groups_filtered"] = counts["dynamic"]
    if audits and (audits["is"].ratio_observations or audits["kl"].token_observations):
        grpo["policy_audit"] = obj.policy_audit_receipt(audits["is"], audits["kl"])
    receipt["grpo"] = grpo
    receipt["echo"] = echo_block(cfg["loss"]["echo"], audits["echo"] if audits else obj.EchoAccumulator())
    receipt["no_policy_loss"] = cfg["loss"]["no_policy_loss"]
    trained = len(kept) if failure is None and not dry_run else 0
    receipt["data"] = data_block(
        groups_read=len(ingestion.groups),
        groups_filtered=counts["dynamic"] + counts["variance"],
        groups_trained=trained,
        completions_read=sum(len(g.completions) for g in ingestion.groups),
        completions_trained=sum(len(g.completions) for g in kept) if trained else 0,
        reward_groups_filtered=counts["variance"],
        reward_groups_kept=len(ingestion.groups) - counts["variance"],
    )
    receipt["rewards"] = rewards.as_receipt()
    receipt["token_counts"] = ingestion.counts.token_counts()
    return receipt
