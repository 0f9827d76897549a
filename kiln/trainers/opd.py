"""OPD trainer: on-policy distillation of a registered teacher into a LoRA student.

Objective (spec/40 "OPD"): candidates are (prompt, sample index) pairs visited in the
seeded epoch order. For each candidate the student samples a rollout from its own policy
(temperature, top-p, at most ``max_tokens``; a sampled end-of-turn id is kept and ends
it) with the ``rollout-sampling`` generator; the teacher scores it: top-K log-probabilities
at every action position, the teacher's prefix being ``teacher_extra_messages`` +
``messages`` (+ trajectory) + the rollout. The loss at each action position restricts
student and teacher to the teacher's K ids, renormalises both and takes the reverse KL
KL(student ‖ teacher); a candidate's loss is the mean over its positions, plus λ × the
cross-entropy of the trajectory's observation tokens when ECHO is on. An optimizer step
takes ``micro_batch_size`` x ``gradient_accumulation_steps`` consecutive candidates (both
default 1); a step whose rollouts are all empty takes no optimizer step.
``off_policy`` replays a pre-scored teacher file instead: the row's response is the
rollout and its scores are the teacher's.

Read top to bottom: admission (request and config rules, teacher lookup and re-probe,
vocabulary/tokenizer agreement, model, data, identity, resume — everything that can fail
before training), the loop (rollout, scoring, loss, step, collapse diagnostics,
checkpoints) and publication (adapter, receipt with the ``opd`` block, manifest). A
failure after admission writes a failed receipt with its category.

Checkpoints (spec/30): every ``checkpoint_interval`` committed optimizer steps (never
after the last candidate: the adapter is published instead) and on cancellation, at the
settled candidate. A checkpoint binds the candidate cursor (apart from the optimizer step),
the epoch order, the rollout generator's state, the collapse accumulators, the teacher
alias and revisions, the optimizer slots. Cancellation publishes unless a checkpoint of the
same optimizer step already exists (published by this run or the one it resumed from):
the candidates settled since then were empty rollouts, which a resume replays exactly
from the saved generator state, so that checkpoint is the same boundary.

Steps and micro-batches: a step's candidates never span two epochs (the last step of an
epoch takes what is left). They are rolled out ``micro_batch_size`` at a time -- decoded
together and scored in one teacher call (``kiln/trainers/_opd_rollouts.py``) -- all from the
policy at the step's start, so every rollout is exactly on-policy; then each candidate's
forward and backward adds its share of the step's loss (the mean per-position reverse KL
over all the step's action positions, plus λ times ECHO's mean cross-entropy over all its
observation tokens), and one optimizer step follows. Checkpoints and cancellation land
between steps, where the generator state and the cursor say everything. With both sizes 1
this is the per-candidate loop, byte for byte.

Deliberate simplifications: dense student logits over the prefix + rollout; ``samples_per_prompt`` does
not apply to a pre-scored file (one candidate per row); the receipt's collapse windows
are cumulative (each entry covers the run up to its step); per-module gradient norms are
not collected.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.artifacts.checkpoint_manifest import OPD_SOURCE_KINDS
from kiln.batch_plan import rows_per_step, steps_per_epoch
from kiln.digests import json_sha256, raw_hex, teacher_identity_revision
from kiln.epoch_order import ALGORITHM_ID, epoch_order
from kiln.errors import ZeroActionTokensError
from kiln.trainers._admission import AdmittedJob, TrainingContext, base_model, job_fields, single_process
from kiln.trainers._checkpointing import (
    CheckpointProgress,
    base_adapter_block,
    manifest_head,
    publish_state,
    restore_policy,
)
from kiln.trainers._kit import Cadence, Policy, Progress, TrainResult, check_pin, guarded, publish_adapter
from kiln.trainers._loop_states import OpdLoop
from kiln.trainers._opd_config import check_opd_data, check_opd_request, effective_opd_config
from kiln.trainers._opd_rollouts import draw, train_shares
from kiln.trainers._opd_teacher import admitted_source, pinned_teacher
from kiln.trainers._receipts import data_block, echo_block, envelope, token_counts_block
from kiln.trainers._resume import claim_target, load_resume, resume_metadata
from kiln.training import LORA_INIT_ALGORITHM, lora_delta_norms, model_head, schema_defaults
from kiln.training import grpo_objective as grpo_obj
from kiln.training.opd_objective import CollapseAccumulator, receipt_snapshot

KIND = "opd"
ROLLOUT_RNG_FILE = "rollout_rng.safetensors"
ROLLOUT_STREAM = "rollout-sampling"
ROLLOUT_ALGORITHM = "kiln.torch-generator-state.v1"
ROLLOUT_SEED_SALT = 0x524F_4C4C_4F55_5453  # "ROLLOUTS": keeps the stream apart from lora-init's
PROGRESS_AUX = ("candidates_consumed", "collapse_guardrail")

__all__ = ["AdmittedOpd", "admit_opd", "admit_request", "rollout_generator", "run_opd"]


# ----------------------------------------------------------------------------- admission


@dataclass(kw_only=True)
class AdmittedOpd(AdmittedJob):
    source: Any  # kiln.data.opd.OpdPrompts (prompts) or OffPolicyFile (teacher_jsonl)
    route: str  # "prompts" | "teacher_jsonl"
    teacher: Any  # kiln.teachers.PinnedTeacher
    teacher_identity: dict[str, Any] | None
    teacher_identity_revision: str  # raw hex
    teacher_content_revision: str
    candidates: list[tuple[int, int]]
    stop_ids: frozenset[int]
    max_len: int
    pin: str | None = None
    teachers_root: Any = None
    head: Any = None  # kiln.training.ModelHead, proven at admission when micro-batches read the logits themselves
    kind: str = field(default=KIND, init=False)

    @property
    def total_steps(self) -> int:  # candidates: an optimizer step per non-empty step of candidates
        return self.config["epochs"] * len(self.candidates)

    @property
    def per_step(self) -> int:
        """Candidates an optimizer step consumes (the last step of an epoch takes what is left)."""
        return rows_per_step(self.config)

    @property
    def schedule_steps(self) -> int:  # the schedule's positions: the planned steps, empty ones included
        return self.config["epochs"] * steps_per_epoch(len(self.candidates), self.per_step)

    @property
    def data_sha256(self) -> str:
        return self.source.source_sha256 if self.route == "prompts" else self.source.sha256

    def fingerprint(self) -> dict[str, Any]:
        teacher = (
            f"{self.teacher.alias} identity {self.teacher_identity_revision} content {self.teacher_content_revision}"
        )
        return {**super().fingerprint(), "teacher": teacher}

    def identity_manifest(self) -> dict[str, Any]:
        cfg = self.config
        return manifest_head(
            self,
            KIND,
            total_steps=self.total_steps,
            data={
                "source_kind": OPD_SOURCE_KINDS[self.route],
                "content_sha256": raw_hex(self.data_sha256),
                "item_count": len(self.candidates),
            },
            rng_states={
                "epoch-order": {"algorithm": ALGORITHM_ID, "seed": cfg["seed"], "position": 0},
                "lora-init": {"algorithm": LORA_INIT_ALGORITHM, "seed": cfg["seed"], "position": 0},
                ROLLOUT_STREAM: {"algorithm": ROLLOUT_ALGORITHM, "seed": cfg["seed"], "position": 0},
            },
            planning_key="checkpoint_planning",
            auxiliary={
                "prompt_source": self.route,
                "prepared_source_sha256": json_sha256([list(c) for c in self.candidates]),
                "candidates_consumed": 0,
                "rollout_rng_stream": ROLLOUT_STREAM,
                "collapse_guardrail": CollapseAccumulator().state(),
                "base_adapter": base_adapter_block(self),
                "teacher_id": self.teacher.alias,
                "teacher_identity_revision": self.teacher_identity_revision,
                "teacher_content_revision": self.teacher_content_revision,
            },
        )


def admit_opd(
    *,
    adapter_name: str,
    registry: Any,
    request: dict[str, Any],
    teachers_root: Any,
    model_path: str | None = None,
    loaded: Any = None,
    server_checkpoint_interval: int | None = None,
    data_parallel: Any = None,
) -> AdmittedOpd:
    """Everything that can fail before training; raises ``KilnError`` and publishes nothing (``data_parallel``: the
    one worker process it trains in, when not this one)."""
    from kiln.model import max_positions, special_tokens, stop_token_ids

    mode = check_opd_request(request)
    config = dict(request.get("config") or {})
    checkpoint_path = resume_metadata(registry, adapter_name, config, KIND)
    teacher = pinned_teacher(request["teacher"], mode, teachers_root=teachers_root, registry=registry)
    claim_target(registry, adapter_name, checkpoint_path)
    loaded = base_model(model_path, loaded)
    max_len = max_positions(loaded.model, loaded.tokenizer)
    # the identity comes first: the source is checked against the student's tokenizer, and the effective config
    # against the source's teacher (its top-K bound)
    kind = (config.get("optimizer") or {}).get("kind", schema_defaults("OpdConfig")["optimizer"]["kind"])
    fields = job_fields(adapter_name, registry, {}, loaded, optimizer_kind=kind, data_parallel=data_parallel)
    start = time.perf_counter()
    admitted = admitted_source(mode, request, teacher, loaded, fields["identity"])
    cfg = effective_opd_config(
        config,
        adapter_name,
        teacher_max_top_k=admitted.max_top_k,
        model_max_len=max_len,
        server_checkpoint_interval=server_checkpoint_interval,
    )
    source = admitted.read(cfg)
    source.tokenize_ms = (time.perf_counter() - start) * 1000
    fields["config"] = cfg
    job = AdmittedOpd(
        **fields,
        source=source,
        route=admitted.route,
        teacher=teacher,
        teacher_identity=admitted.teacher_identity,
        teacher_identity_revision=admitted.identity_revision,
        teacher_content_revision=admitted.content_revision,
        candidates=admitted.candidates(source, cfg),
        stop_ids=stop_token_ids(loaded.model, loaded.tokenizer, special_tokens(loaded.tokenizer)),
        max_len=max_len,
        pin=admitted.pin,
        teachers_root=teachers_root,
        head=model_head(loaded.model) if cfg["micro_batch_size"] > 1 else None,
    )
    check_opd_data(job)
    job.resume = load_resume(
        checkpoint_path,
        job.identity_manifest(),
        progress_auxiliary=PROGRESS_AUX,
        progress_streams=(ROLLOUT_STREAM, "epoch-order"),
    )
    return job


def admit_request(request: dict[str, Any], *, adapter_name: str, context: TrainingContext) -> AdmittedOpd:
    """An ``OpdRequest`` body admitted in ``context`` (its teachers registry, its default checkpoint interval)."""
    single_process(context, "OPD")
    return admit_opd(
        adapter_name=adapter_name,
        registry=context.registry,
        request=request,
        teachers_root=context.teachers_root,
        model_path=context.model_path,
        loaded=context.loaded,
        server_checkpoint_interval=context.checkpoint_interval,
        data_parallel=context.data_parallel,
    )


# ----------------------------------------------------------------------------- the run


def rollout_generator(seed: int) -> Any:
    """The ``rollout-sampling`` stream: a CPU ``torch.Generator`` seeded from the run's seed."""
    import torch

    return torch.Generator().manual_seed((seed ^ ROLLOUT_SEED_SALT) % 2**64)


def run_opd(
    job: AdmittedOpd,
    *,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    on_checkpoint: Callable[[Any], None] | None = None,
) -> TrainResult:
    """Train, then publish adapter, receipt and manifest (or a failed receipt)."""
    started = time.perf_counter()
    cfg = job.config
    echo = cfg["echo"]
    loop = OpdLoop(items=len(job.candidates), per_step=job.per_step)
    run: dict[str, Any] = {"delta_norms": [], "cadence": None, "scorer": None}

    def train() -> TrainResult:
        nonlocal loop

        check_pin(job.source.path if job.pin is not None else None, job.pin)
        policy = Policy(job, restore=restore_policy)
        model = policy.model
        generator = rollout_generator(cfg["seed"])
        if job.resume is not None:
            from safetensors.torch import load as load_tensors

            rng = job.resume.manifest["rng_states"][ROLLOUT_STREAM]
            generator.set_state(load_tensors(job.resume.blobs[rng["state_file"]])["state"])
            loop = OpdLoop.restore(len(job.candidates), job.resume.loop_state)
            loop.rollouts_sampled = rng["position"]
        loop.timings = policy.timings
        if job.route == "prompts":
            from kiln.teachers import open_scorer

            run["scorer"] = open_scorer(job.teacher, registry_dir=job.registry)
        cadence = run["cadence"] = Cadence(job, lambda: _publish(job, loop, policy, generator), cancel, on_checkpoint)
        total, width, per_step = job.total_steps, cfg["micro_batch_size"], job.per_step
        slots = steps_per_epoch(len(job.candidates), per_step)
        order_epoch, order = -1, []
        while loop.consumed < total:
            if order_epoch != loop.epoch_index:  # the order is drawn once per epoch, not per candidate
                order_epoch, order = loop.epoch_index, epoch_order(cfg["seed"], loop.epoch_index, len(job.candidates))
            members = order[loop.cursor : loop.cursor + per_step]  # a step never spans two epochs
            position, first_step = loop.epoch_index * slots + loop.cursor // per_step, loop.global_step
            # every rollout of the step comes from the policy at its start: micro-batches, then their losses
            rollouts = [
                r
                for start in range(0, len(members), width)
                for r in draw(job, model, generator, loop, members[start : start + width], run["scorer"])
            ]
            values, found, kls = train_shares(
                model,
                job.head,
                rollouts,
                echo,
                width,
                loop.timings,
                lambda loss: policy.accumulate(loss, lambda: f"optimizer step {loop.global_step + 1}"),
            )
            seen = []
            for rollout, mean_kl in zip(rollouts, kls, strict=True):
                action = rollout.action
                text = job.loaded.tokenizer.decode(action, skip_special_tokens=False) if action else ""
                loop.action_tokens += len(action)
                loop.empty += 0 if action else 1
                seen.append((rollout, text, mean_kl))
            loop.env_tokens += sum(env[1] for env in found if env is not None)
            if values:  # a step whose rollouts are all empty takes no optimizer step (and keeps its place)
                policy.apply(position=position)
                loop.echo.add(grpo_obj.step_echo_ce(found))
                loop.losses.append(sum(values[1:], values[0]))
            for rollout, text, mean_kl in seen:
                loop.collapse.add(tokens=len(rollout.action), truncated=rollout.truncated, mean_kl=mean_kl, text=text)
                loop.settle()
                if progress:
                    step_loss = loop.losses[-1] if rollout.action else None
                    tokens = len(rollout.prefix) + len(rollout.action)
                    progress({"step": loop.consumed, "total": total, "loss": step_loss, "tokens": tokens})
            # a checkpoint (due, or on cancellation) lands between steps: the next step's rollouts are not drawn
            cadence.settled(
                loop.global_step,
                last=loop.consumed >= total,
                due=any(cadence.due(step) for step in range(first_step + 1, loop.global_step + 1)),
                cancelled=lambda name: (
                    f"cancelled after candidate {loop.consumed} of {total} (optimizer step "
                    f"{loop.global_step}); resume from {name}"
                ),
            )
        loop.snapshots.append(loop.collapse.snapshot(loop.global_step))
        run["delta_norms"] = lora_delta_norms(model)
        if not loop.losses:
            raise ZeroActionTokensError(
                "every rollout was empty: no optimizer step ran, so there is no adapter to publish"
            )
        return publish_adapter(
            job,
            model,
            lambda adapter_dir: _receipt(job, started, loop, run["delta_norms"], adapter_dir),
            losses=list(loop.losses),
            checkpoints=cadence.published,
        )

    try:
        return guarded(
            job,
            train,
            lambda failure, _exc: _receipt(job, started, loop, run["delta_norms"], None, failure=failure),
            lambda: {"losses": list(loop.losses), "checkpoints": run["cadence"].published if run["cadence"] else []},
        )
    finally:
        if run["scorer"] is not None:
            run["scorer"].close()


def _publish(job: AdmittedOpd, loop: OpdLoop, policy: Policy, generator: Any) -> Any:
    def loop_document() -> dict[str, Any]:
        loop.snapshots.append(loop.collapse.snapshot(loop.global_step))
        return loop.as_document(job)

    def stamp(manifest: dict[str, Any], loop_doc: dict[str, Any]) -> CheckpointProgress:
        finished = loop_doc["candidates_consumed"] >= job.total_steps
        manifest["rng_states"]["epoch-order"]["position"] = loop_doc["epoch_index"]
        manifest["rng_states"][ROLLOUT_STREAM].update(position=loop.rollouts_sampled, state_file=ROLLOUT_RNG_FILE)
        manifest["auxiliary_state"]["candidates_consumed"] = loop_doc["candidates_consumed"]
        manifest["auxiliary_state"]["collapse_guardrail"] = loop_doc["collapse_guardrail"]
        order = [] if finished else epoch_order(job.config["seed"], loop_doc["epoch_index"], loop.items)
        return CheckpointProgress(
            loop_doc["global_step"], job.total_steps, loop_doc["epoch_index"], loop_doc["cursor_in_epoch"], order
        )

    try:
        return publish_state(
            job,
            KIND,
            policy.params,
            policy.optimizer,
            loop_document=loop_document,
            stamp=stamp,
            extra_tensors=lambda: {ROLLOUT_RNG_FILE: ("rng-state", {"state": generator.get_state().clone()})},
        )
    except BaseException:
        if loop.snapshots and loop.snapshots[-1]["candidates_consumed"] == loop.consumed:
            loop.snapshots.pop()  # the snapshot belongs to a checkpoint that was not published
        raise


# ----------------------------------------------------------------------------- the receipt


def _receipt(job, started, loop, delta_norms, adapter_dir, *, failure=None) -> dict[str, Any]:
    cfg = job.config
    receipt = envelope(
        job,
        KIND,
        training_data=job.source.training_data(),
        started=started,
        epochs=cfg["epochs"],
        adapter_dir=adapter_dir,
        failure=failure,
        tokenize_ms=job.source.tokenize_ms,
        timings=loop.timings,
        delta_norms=delta_norms,
        grad_norms=[],
    )
    receipt["hyperparameters"]["shuffle"] = True
    opd: dict[str, Any] = {
        "training_mode": cfg["training_mode"],
        "objective": cfg["objective"],
        "loss_granularity": cfg["loss"],
        "teacher_id": job.teacher.alias,
        "teacher_content_revision": job.teacher_content_revision,
        "top_k": cfg["top_k"],
        "samples_per_prompt": cfg["samples_per_prompt"],
        "action_tokens": loop.action_tokens,
        "env_tokens": loop.env_tokens,
        "echo_combined": cfg["echo"] is not None and loop.echo.contributed,
        "echo_lambda": float(cfg["echo"]["lambda"]) if cfg["echo"] is not None else None,
        "initial_opd_loss": loop.losses[0] if loop.losses else None,
        "final_opd_loss": loop.losses[-1] if loop.losses else None,
    }
    if job.teacher_identity is not None:
        opd["teacher_identity"] = job.teacher_identity
        opd["teacher_identity_revision"] = teacher_identity_revision(job.teacher_identity)
    if loop.snapshots:
        opd["collapse_diagnostics"] = [receipt_snapshot(s) for s in loop.snapshots]
    receipt["opd"] = opd
    receipt["echo"] = echo_block(cfg["echo"], loop.echo)
    items = len(job.source.items) if job.route == "prompts" else len(job.source.rows)
    receipt["data"] = data_block(
        examples_read=items,
        examples_trained=loop.global_step,
        completions_read=loop.consumed,
        completions_trained=loop.global_step,
    )
    receipt["token_counts"] = token_counts_block(action=loop.action_tokens, env=loop.env_tokens)
    return receipt
