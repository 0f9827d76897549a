"""OPD trainer: on-policy distillation of a registered teacher into a LoRA student.

Objective (spec/40 "OPD"): candidates are (prompt, sample index) pairs visited in the
seeded epoch order. For each candidate the student samples a rollout from its own policy
(temperature, top-p, at most ``max_tokens``; a sampled end-of-turn id is kept and ends
it) with the ``rollout-sampling`` generator; the teacher scores it: top-K log-probabilities
at every action position, the teacher's prefix being ``teacher_extra_messages`` +
``messages`` (+ trajectory) + the rollout. The loss at each action position restricts
student and teacher to the teacher's K ids, renormalises both and takes the reverse KL
KL(student ‖ teacher); a candidate's loss is the mean over its positions, plus λ × the
cross-entropy of the trajectory's observation tokens when ECHO is on. One optimizer step
per non-empty candidate; an empty rollout consumes its candidate without a step.
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

Deliberate simplifications: one rollout and one teacher call per candidate (no
batching); dense student logits over the prefix + rollout; ``samples_per_prompt`` does
not apply to a pre-scored file (one candidate per row); the receipt's collapse windows
are cumulative (each entry covers the run up to its step); per-module gradient norms are
not collected.
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
from kiln.artifacts.checkpoint_manifest import OPD_SOURCE_KINDS
from kiln.artifacts.loop_state import loop_state_file_name
from kiln.checkpoints import (
    checkpoint_id,
    list_checkpoints,
    load_checkpoint,
    publish_checkpoint,
    require_compatible,
)
from kiln.digests import file_sha256, json_sha256, prefixed, raw_hex, teacher_identity_revision
from kiln.epoch_order import ALGORITHM_ID, epoch_order
from kiln.errors import RequestError
from kiln.publish import stage_adapter, write_adapter_manifest, write_train_receipt
from kiln.trainers._opd_config import check_opd_request, effective_opd_config
from kiln.trainers._resume import claim_target, optimizer_identity, resume_metadata
from kiln.training import (
    TrainingFailedError,
    attach_lora,
    build_optimizer,
    classify_failure,
    lora_delta_norms,
    lora_parameters,
)
from kiln.training import _grpo_objective as grpo_obj
from kiln.training._opd_objective import CollapseAccumulator, receipt_snapshot, top_k_reverse_kl
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

KIND = "opd"
LOOP_FILE = loop_state_file_name(KIND)
ROLLOUT_RNG_FILE = "rollout_rng.safetensors"
ROLLOUT_STREAM = "rollout-sampling"
ROLLOUT_ALGORITHM = "kiln.torch-generator-state.v1"
ROLLOUT_SEED_SALT = 0x524F_4C4C_4F55_5453  # "ROLLOUTS": keeps the stream apart from lora-init's
PROGRESS_AUX = ("candidates_consumed", "collapse_guardrail")
Progress = Callable[[dict[str, Any]], None]


@dataclass
class AdmittedOpd:
    adapter_name: str
    registry: Path
    config: dict[str, Any]
    loaded: Any
    source: Any  # kiln.data.opd.OpdPrompts (prompts) or OffPolicyFile (teacher_jsonl)
    route: str  # "prompts" | "teacher_jsonl"
    teacher: Any  # kiln.teachers.PinnedTeacher
    teacher_identity: dict[str, Any] | None
    teacher_identity_revision: str  # raw hex
    teacher_content_revision: str
    identity: Any
    precision: dict[str, Any]
    candidates: list[tuple[int, int]]
    stop_ids: frozenset[int]
    max_len: int
    pin: str | None = None
    resume: Any = None  # kiln.checkpoints.LoadedCheckpoint when resuming
    teachers_root: Path | None = None

    @property
    def total_steps(self) -> int:
        return self.config["epochs"] * len(self.candidates)


@dataclass
class OpdResult:
    status: str
    adapter_dir: Path
    receipt_path: Path
    manifest_path: Path | None
    receipt: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)
    cancelled: bool = False


# ----------------------------------------------------------------------------- admission


def admit_opd(
    *,
    adapter_name: str,
    registry: Path,
    request: dict[str, Any],
    teachers_root: Path,
    model_path: str | None = None,
    loaded: Any = None,
    server_checkpoint_interval: int | None = None,
) -> AdmittedOpd:
    """Everything that can fail before training; raises ``KilnError`` and publishes nothing."""
    from kiln.model import capture_identity, load_base_model, resolve_model_path, training_precision
    from kiln.model._sampling import max_positions, special_tokens, stop_token_ids
    from kiln.teachers import TeacherRegistry, reprobe

    mode = check_opd_request(request)
    config = dict(request.get("config") or {})
    checkpoint_path = resume_metadata(registry, adapter_name, config, KIND)
    teacher = TeacherRegistry(teachers_root, adapter_registry=registry).get(request["teacher"])  # teacher_not_found
    reprobe(teacher, registry_dir=registry)  # teacher_identity_mismatch when the teacher changed since registration
    if mode == "on_policy" and teacher.kind == "fixture":
        raise RequestError(
            f"teacher {teacher.alias!r} is a fixture (pre-scored file) and cannot score new rollouts",
            code="training_invalid_request",
            pointer="/teacher",
            hint='use "training_mode": "off_policy" with its file as dataset_path, or a local/remote teacher',
        )
    if mode == "off_policy" and teacher.kind != "fixture":
        raise RequestError(
            f"off_policy replays a pre-scored file, but teacher {teacher.alias!r} is {teacher.kind}",
            code="training_invalid_request",
            pointer="/teacher",
            hint="register the file as a fixture teacher (kiln teachers add ALIAS --kind fixture --file F)",
        )
    claim_target(registry, adapter_name, checkpoint_path)
    if loaded is None:
        path, is_default = resolve_model_path(model_path)
        loaded = load_base_model(path, is_default=is_default)
    max_len = max_positions(loaded.model, loaded.tokenizer)
    max_top_k = teacher.identity["max_top_k"] if teacher.identity else 32
    import torch

    torch.use_deterministic_algorithms(True)
    precision = training_precision(optimizer_kind=(config.get("optimizer") or {}).get("kind", "muon"))
    identity = capture_identity(loaded.path, loaded.tokenizer, training_policy=precision)
    student_vocab = int(loaded.model.config.vocab_size)
    student_tokenizer = raw_hex(identity.tokenizer_vocab_hash)
    start = time.perf_counter()
    if mode == "on_policy":
        _check_vocabulary(teacher.identity, student_vocab, student_tokenizer, teacher.alias)
        cfg = effective_opd_config(
            config,
            adapter_name,
            teacher_max_top_k=max_top_k,
            model_max_len=max_len,
            server_checkpoint_interval=server_checkpoint_interval,
        )
        from kiln.data.opd import read_prompts

        echo = cfg["echo"]
        source = read_prompts(
            loaded.tokenizer, request["prompts"], warning_filter=echo["warning_filter"] if echo else True
        )
        candidates = [(item.index, s) for item in source.items for s in range(cfg["samples_per_prompt"])]
        pin = None
        teacher_identity = teacher.identity
        identity_revision = teacher.identity_revision
        content_revision = teacher.content_revision
        route = "prompts"
    else:
        from kiln.data.opd import read_off_policy_file

        source = read_off_policy_file(
            loaded.tokenizer,
            request["dataset_path"],
            vocab_size=student_vocab,
            tokenizer_vocab_sha256=student_tokenizer,
        )
        manifest = source.manifest
        if manifest["fixture_id"] != teacher.model_id:
            raise RequestError(
                f"{source.path} is fixture {manifest['fixture_id']!r} but teacher {teacher.alias!r} is "
                f"registered for fixture {teacher.model_id!r}",
                code="training_invalid_request",
                pointer="/dataset_path",
            )
        if teacher.content_revision is not None and teacher.content_revision != source.sha256:
            raise RequestError(
                f"teacher {teacher.alias!r} was registered with a file of digest {teacher.content_revision}; "
                f"{source.path} has {source.sha256}",
                code="teacher_identity_mismatch",
                pointer="/dataset_path",
                hint="train from the registered file, or register the new file under a new alias",
            )
        cfg = effective_opd_config(
            config,
            adapter_name,
            teacher_max_top_k=int(manifest["top_k"]),
            model_max_len=max_len,
            server_checkpoint_interval=server_checkpoint_interval,
        )
        candidates = [(row.index, 0) for row in source.rows]
        pin = source.sha256
        teacher_identity = manifest.get("teacher_identity")
        identity_revision = (
            teacher_identity_revision(teacher_identity) if teacher_identity else raw_hex(source.manifest_sha256)
        )
        content_revision = source.sha256
        route = "teacher_jsonl"
    tokenize_ms = (time.perf_counter() - start) * 1000
    source.tokenize_ms = tokenize_ms
    job = AdmittedOpd(
        adapter_name=adapter_name,
        registry=registry,
        config=cfg,
        loaded=loaded,
        source=source,
        route=route,
        teacher=teacher,
        teacher_identity=teacher_identity,
        teacher_identity_revision=identity_revision,
        teacher_content_revision=content_revision,
        identity=identity,
        precision=precision,
        candidates=candidates,
        stop_ids=stop_token_ids(loaded.model, loaded.tokenizer, special_tokens(loaded.tokenizer)),
        max_len=max_len,
        pin=pin,
        teachers_root=teachers_root,
    )
    if checkpoint_path is not None:
        job.resume = load_checkpoint(checkpoint_path)  # every byte hashed, loop state checked
        identity_now = identity_manifest(job)
        aux = job.resume.manifest["auxiliary_state"]
        for key in PROGRESS_AUX:  # cursors move with progress; the loop state binds them
            identity_now["auxiliary_state"][key] = aux[key]
        identity_now["rng_states"][ROLLOUT_STREAM] = job.resume.manifest["rng_states"][ROLLOUT_STREAM]
        identity_now["rng_states"]["epoch-order"] = job.resume.manifest["rng_states"]["epoch-order"]
        require_compatible(checkpoint_path.name, job.resume.manifest, identity_now)
    return job


def _check_vocabulary(identity: dict[str, Any] | None, vocab: int, tokenizer: str, alias: str) -> None:
    """The teacher scores ids of the student's vocabulary, or the loss compares different tokens."""
    if identity is None:
        return
    if identity["vocab_size"] != vocab:
        raise RequestError(
            f"teacher {alias!r} has a vocabulary of {identity['vocab_size']} ids, the student {vocab}",
            code="training_invalid_request",
            pointer="/teacher",
            hint="distil from a teacher that shares the student's tokenizer",
        )
    if identity["tokenizer_vocab_sha256"] != tokenizer:
        raise RequestError(
            f"teacher {alias!r} uses tokenizer vocabulary {identity['tokenizer_vocab_sha256']}, "
            f"the student {tokenizer}",
            code="training_invalid_request",
            pointer="/teacher",
            hint="distil from a teacher that shares the student's tokenizer",
        )


def _base_adapter_block(job: AdmittedOpd) -> dict[str, Any] | None:
    from kiln.trainers.sft import base_adapter_dir

    name = job.config["base_adapter"]
    if not name:
        return None
    path = base_adapter_dir(job.registry, name) / "adapter_model.safetensors"
    if not path.is_file():
        raise RequestError(
            f"base_adapter {name!r}: {path} does not exist",
            code="training_invalid_request",
            pointer="/config/base_adapter",
        )
    return {"name": name, "adapter_model_sha256": prefixed(file_sha256(path)[0])}


def _prepared_source(job: AdmittedOpd) -> str:
    return json_sha256([list(c) for c in job.candidates])


def identity_manifest(job: AdmittedOpd) -> dict[str, Any]:
    """The manifest of this run without progress, files and time: what a resume must match."""
    cfg = job.config
    optimizer_block, scheduler_block = optimizer_identity(cfg)
    stateful = cfg["optimizer"]["kind"] != "sgd"
    state_files = {"adapter_parameters": ADAPTER_FILE, "loss_history": LOOP_FILE}
    if stateful:
        state_files["optimizer_state"] = OPTIMIZER_FILE
    planning = planning_identity(device="cpu")
    source_digest = job.source.source_sha256 if job.route == "prompts" else job.source.sha256
    return {
        "schema_version": 1,
        "manifest_type": "kiln.training-checkpoint.v1",
        "checkpoint_kind": "resumable",
        "training_kind": KIND,
        "adapter_name": job.adapter_name,
        "effective_config": cfg,
        "precision_policy": job.precision,
        "progress": {"total_steps": job.total_steps},
        "data": {
            "source_kind": OPD_SOURCE_KINDS[job.route],
            "content_sha256": raw_hex(source_digest),
            "item_count": len(job.candidates),
        },
        "rng_states": {
            "epoch-order": {"algorithm": ALGORITHM_ID, "seed": cfg["seed"], "position": 0},
            "lora-init": {"algorithm": LORA_INIT_ALGORITHM, "seed": cfg["seed"], "position": 0},
            ROLLOUT_STREAM: {"algorithm": ROLLOUT_ALGORITHM, "seed": cfg["seed"], "position": 0},
        },
        "optimizer": optimizer_block,
        "scheduler": scheduler_block,
        "state_files": state_files,
        "auxiliary_state": {
            "loop_state_type": "kiln.opd-loop-state.v1",
            **auxiliary_identity(job.identity, job.precision, planning),
            "checkpoint_planning": planning,
            "prompt_source": job.route,
            "prepared_source_sha256": _prepared_source(job),
            "candidates_consumed": 0,
            "rollout_rng_stream": ROLLOUT_STREAM,
            "collapse_guardrail": CollapseAccumulator().state(),
            "base_adapter": _base_adapter_block(job),
            "teacher_id": job.teacher.alias,
            "teacher_identity_revision": job.teacher_identity_revision,
            "teacher_content_revision": job.teacher_content_revision,
        },
    }


# ----------------------------------------------------------------------------- loop state


@dataclass
class _Loop:
    """The loop's committed state; ``as_document`` is ``opd_loop_state.json``."""

    items: int
    epoch_index: int = 0
    cursor: int = 0
    consumed: int = 0
    empty: int = 0
    losses: list[float] = field(default_factory=list)
    action_tokens: int = 0
    env_tokens: int = 0
    collapse: CollapseAccumulator = field(default_factory=CollapseAccumulator)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    echo: Any = field(default_factory=grpo_obj.EchoAccumulator)
    timings: dict[str, float] = field(default_factory=dict)
    rollouts_sampled: int = 0

    @property
    def global_step(self) -> int:
        return len(self.losses)

    def settle(self) -> None:
        """One candidate consumed: advance the cursor (into the next epoch at the end of one)."""
        self.consumed += 1
        self.cursor += 1
        if self.cursor == self.items:
            self.epoch_index += 1
            self.cursor = 0

    def as_document(self, job: AdmittedOpd) -> dict[str, Any]:
        return {
            "schema_version": 1,
            "state_type": "kiln.opd-loop-state.v1",
            "global_step": self.global_step,
            "epoch_index": self.epoch_index,
            "cursor_in_epoch": self.cursor,
            "candidates_consumed": self.consumed,
            "empty_rollouts": self.empty,
            "loss_history": list(self.losses),
            "last_loss": self.losses[-1] if self.losses else None,
            "action_tokens": self.action_tokens,
            "env_tokens": self.env_tokens,
            "echo_metrics": self.echo.loop_state(),
            "collapse_guardrail": self.collapse.state(),
            "collapse_snapshots": list(self.snapshots),
            "teacher_id": job.teacher.alias,
            "teacher_identity_revision": job.teacher_identity_revision,
            "teacher_content_revision": job.teacher_content_revision,
            "lora_grad_norms": [],
            "phase_timings": {
                "tokenize_ms": job.source.tokenize_ms,
                "mask_build_ms": 0.0,
                **{
                    k: self.timings.get(k, 0.0)
                    for k in ("reference_forward_ms", "policy_forward_ms", "backward_ms", "optimizer_ms")
                },
            },
        }

    @classmethod
    def restore(cls, items: int, state: dict[str, Any]) -> _Loop:
        loop = cls(items=items)
        loop.epoch_index, loop.cursor = state["epoch_index"], state["cursor_in_epoch"]
        loop.consumed, loop.empty = state["candidates_consumed"], state["empty_rollouts"]
        loop.losses = list(state["loss_history"])
        loop.action_tokens, loop.env_tokens = state["action_tokens"], state["env_tokens"]
        loop.collapse = CollapseAccumulator.from_state(
            state["collapse_guardrail"], nonempty_rollouts=state["candidates_consumed"] - state["empty_rollouts"]
        )
        loop.snapshots = list(state["collapse_snapshots"])
        loop.echo = grpo_obj.EchoAccumulator.from_loop_state(state["echo_metrics"])
        return loop


# ----------------------------------------------------------------------------- the run


def rollout_generator(seed: int) -> Any:
    """The ``rollout-sampling`` stream: a CPU ``torch.Generator`` seeded from the run's seed."""
    import torch

    return torch.Generator().manual_seed((seed ^ ROLLOUT_SEED_SALT) % 2**64)


def run_opd(job: AdmittedOpd, *, progress: Progress | None = None, cancel: threading.Event | None = None) -> OpdResult:
    """Train, then publish adapter, receipt and manifest (or a failed receipt)."""
    import torch

    from kiln.model._sampling import sample
    from kiln.trainers.sft import _warm_start, base_adapter_dir

    started = time.perf_counter()
    cfg = job.config
    adapter_dir = job.registry / job.adapter_name
    loop = _Loop(items=len(job.candidates))
    loop.timings = dict.fromkeys(("policy_forward_ms", "reference_forward_ms", "backward_ms", "optimizer_ms"), 0.0)
    published: list[Path] = []
    delta_norms: list[dict[str, Any]] = []
    scorer = None
    echo = cfg["echo"]
    try:
        if job.pin is not None:
            from kiln.data.grpo import check_unchanged

            check_unchanged(job.source.path, job.pin)
        torch.manual_seed(0)  # nothing should draw from the global RNG; pin it anyway
        model = attach_lora(job.loaded.model, rank=cfg["lora_rank"], alpha=cfg["lora_alpha"], seed=cfg["seed"])
        params = lora_parameters(model)
        if cfg["base_adapter"]:
            _warm_start(params, base_adapter_dir(job.registry, cfg["base_adapter"]))
        optimizer = build_optimizer(cfg["optimizer"], list(params.values()), cfg["learning_rate"])
        generator = rollout_generator(cfg["seed"])
        published_steps = {c.global_step for c in list_checkpoints(job.registry, job.adapter_name)}
        if job.resume is not None:
            from safetensors.torch import load as load_tensors

            manifest, state = job.resume.manifest, job.resume.loop_state
            restore_adapter(params, job.resume.blobs[manifest["state_files"]["adapter_parameters"]])
            state_file = manifest["optimizer"].get("state_file")
            restore_optimizer(optimizer, params, job.resume.blobs[state_file] if state_file else None)
            rng = manifest["rng_states"][ROLLOUT_STREAM]
            generator.set_state(load_tensors(job.resume.blobs[rng["state_file"]])["state"])
            loop = _Loop.restore(len(job.candidates), state)
            loop.timings = dict.fromkeys(
                ("policy_forward_ms", "reference_forward_ms", "backward_ms", "optimizer_ms"), 0.0
            )
            loop.rollouts_sampled = rng["position"]
        if job.route == "prompts":
            from kiln.teachers import open_scorer

            scorer = open_scorer(job.teacher, registry_dir=job.registry)
        interval = cfg["checkpoint_interval"]
        total = job.total_steps

        def publish() -> Any:
            where = _publish(job, loop, params, optimizer, generator)
            published.append(where.path)
            published_steps.add(loop.global_step)
            return where

        order_epoch, order = -1, []
        while loop.consumed < total:
            if order_epoch != loop.epoch_index:  # the order is drawn once per epoch, not per candidate
                order_epoch, order = loop.epoch_index, epoch_order(cfg["seed"], loop.epoch_index, len(job.candidates))
            prompt_index, _sample = job.candidates[order[loop.cursor]]
            t0 = time.perf_counter()
            if job.route == "prompts":
                item = job.source.items[prompt_index]
                prefix = list(item.student_prefix)
                room = min(cfg["max_tokens"], job.max_len - len(prefix))
                model.eval()
                action, truncated = sample(
                    model,
                    prefix,
                    max_new=room,
                    temperature=cfg["temperature"],
                    top_p=cfg["top_p"],
                    generator=generator,
                    stop_ids=job.stop_ids,
                )
                loop.rollouts_sampled += 1
                loop.timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
                observation = list(item.observation_mask)
                if action:
                    t1 = time.perf_counter()
                    teacher_ids, teacher_lp = scorer.score(list(item.teacher_prefix), action, cfg["top_k"])
                    loop.timings["reference_forward_ms"] += (time.perf_counter() - t1) * 1000
            else:
                row = job.source.rows[prompt_index]
                prefix, action, truncated = list(row.student_prefix), list(row.action_ids), False
                observation = [False] * len(prefix)
                if action:
                    k = cfg["top_k"]
                    teacher_ids = torch.tensor([list(ids[:k]) for ids in row.teacher_ids], dtype=torch.long)
                    teacher_lp = torch.tensor([list(lp[:k]) for lp in row.teacher_logprobs], dtype=torch.float32)
            text = job.loaded.tokenizer.decode(action, skip_special_tokens=False) if action else ""
            mean_kl = None
            if action:
                model.train()
                ids = torch.tensor([prefix + action], dtype=torch.long)
                t1 = time.perf_counter()
                logits = model(input_ids=ids).logits[0]
                loop.timings["policy_forward_ms"] += (time.perf_counter() - t1) * 1000
                start = len(prefix) - 1
                loss, per_position = top_k_reverse_kl(logits[start : start + len(action)], teacher_ids, teacher_lp)
                mean_kl = float(per_position.detach().mean())
                env_ce = None
                observed = [p for p in range(1, len(prefix)) if observation[p]]
                if echo is not None and observed:
                    positions = torch.tensor(observed, dtype=torch.long)
                    logp = torch.log_softmax(logits[positions - 1].float(), dim=-1)
                    ce = -logp.gather(-1, ids[0, positions].unsqueeze(-1)).mean()
                    loss = loss + float(echo["lambda"]) * ce
                    env_ce = float(ce.detach())
                value = float(loss.detach())
                if not torch.isfinite(loss.detach()):
                    raise TrainingFailedError(
                        "nan_loss", f"non-finite OPD loss {value} at optimizer step {loop.global_step + 1}"
                    )
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                loop.timings["backward_ms"] += (t2 - t1) * 1000
                loop.timings["optimizer_ms"] += (time.perf_counter() - t2) * 1000
                loop.echo.add(env_ce)
                loop.losses.append(value)
                loop.action_tokens += len(action)
                loop.env_tokens += len(observed) if echo is not None else 0
            else:
                loop.empty += 1
            loop.collapse.add(tokens=len(action), truncated=truncated, mean_kl=mean_kl, text=text)
            loop.settle()
            if progress:
                progress(
                    {
                        "step": loop.consumed,
                        "total": total,
                        "loss": loop.losses[-1] if action else None,
                        "tokens": len(prefix) + len(action),
                    }
                )
            if loop.consumed >= total:
                break  # the final candidate publishes the adapter, not a checkpoint
            just_published = None
            if action and interval and loop.global_step % interval == 0:
                just_published = publish()
            if cancel is not None and cancel.is_set():
                if just_published is None and loop.global_step not in published_steps:
                    just_published = publish()
                where = just_published.path.name if just_published else _checkpoint_name(job, loop.global_step)
                raise TrainingFailedError(
                    "cancelled",
                    f"cancelled after candidate {loop.consumed} of {total} (optimizer step {loop.global_step}); "
                    f"resume from {where}",
                )
        loop.snapshots.append(loop.collapse.snapshot(loop.global_step))
        delta_norms = lora_delta_norms(model)
        if not loop.losses:
            raise TrainingFailedError(
                "zero_action_tokens",
                "every rollout was empty: no optimizer step ran, so there is no adapter to publish",
            )
        adapter_dir = stage_adapter(model, job.registry, job.adapter_name)
        receipt = _receipt(job, started, loop, delta_norms, adapter_dir)
        receipt_path = write_train_receipt(adapter_dir, receipt)
        manifest_path = write_adapter_manifest(adapter_dir, receipt)
        return OpdResult("success", adapter_dir, receipt_path, manifest_path, receipt, loop.losses, published)
    except BaseException as exc:
        reason, message = classify_failure(exc)
        receipt = _receipt(job, started, loop, delta_norms, None, failure=(reason, message))
        receipt_path = write_train_receipt(adapter_dir, receipt)
        if isinstance(exc, KeyboardInterrupt):
            raise
        return OpdResult(
            "failed", adapter_dir, receipt_path, None, receipt, loop.losses, published, cancelled=reason == "cancelled"
        )
    finally:
        if scorer is not None:
            scorer.close()


def _checkpoint_name(job: AdmittedOpd, step: int) -> str:
    from kiln.checkpoints import checkpoint_name

    return checkpoint_name(job.adapter_name, step)


def _publish(job: AdmittedOpd, loop: _Loop, params: Any, optimizer: Any, generator: Any) -> Any:
    stateful = job.config["optimizer"]["kind"] != "sgd"

    def capture() -> tuple[Any, Any, Any, dict[str, Any]]:
        loop.snapshots.append(loop.collapse.snapshot(loop.global_step))
        return (
            adapter_tensors(params),
            optimizer_tensors(optimizer, params) if stateful else None,
            {"state": generator.get_state().clone()},
            loop.as_document(job),
        )

    def encode(snapshot: Any) -> tuple[dict[str, Any], dict[str, tuple[str, bytes]]]:
        adapter, slots, rng, loop_doc = snapshot
        manifest = identity_manifest(job)
        step = loop_doc["global_step"]
        manifest["checkpoint_id"] = checkpoint_id(KIND, step)
        manifest["created_at"] = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        finished = loop_doc["candidates_consumed"] >= job.total_steps
        manifest["progress"] = {
            "global_step": step,
            "total_steps": job.total_steps,
            "epoch_index": loop_doc["epoch_index"],
            "cursor_in_epoch": loop_doc["cursor_in_epoch"],
            "data_order": [] if finished else epoch_order(job.config["seed"], loop_doc["epoch_index"], loop.items),
        }
        manifest["optimizer"]["step"] = step
        manifest["scheduler"]["step"] = step
        manifest["rng_states"]["epoch-order"]["position"] = loop_doc["epoch_index"]
        manifest["rng_states"][ROLLOUT_STREAM].update(position=loop.rollouts_sampled, state_file=ROLLOUT_RNG_FILE)
        manifest["auxiliary_state"]["candidates_consumed"] = loop_doc["candidates_consumed"]
        manifest["auxiliary_state"]["collapse_guardrail"] = loop_doc["collapse_guardrail"]
        files = {
            ADAPTER_FILE: ("adapter-parameters", encode_tensors(adapter)),
            LOOP_FILE: ("loss-history", contracts.render("OpdLoopState", loop_doc)),
            ROLLOUT_RNG_FILE: ("rng-state", encode_tensors(rng)),
        }
        if slots is not None:
            files[OPTIMIZER_FILE] = ("optimizer-state", encode_tensors(slots))
        return manifest, files

    try:
        return publish_checkpoint(job.registry, capture, encode)
    except BaseException:
        if loop.snapshots and loop.snapshots[-1]["candidates_consumed"] == loop.consumed:
            loop.snapshots.pop()  # the snapshot belongs to a checkpoint that was not published
        raise


# ----------------------------------------------------------------------------- the receipt


def _receipt(job, started, loop, delta_norms, adapter_dir, *, failure=None):
    from kiln.trainers.sft import base_adapter_dir

    cfg = job.config
    receipt = receipt_base(
        mode=KIND,
        adapter_name=job.adapter_name,
        cfg=cfg,
        identity=job.identity,
        precision=job.precision,
        training_data=job.source.training_data(),
        started=started,
        epochs=cfg["epochs"],
        base_adapter_dir=base_adapter_dir(job.registry, cfg["base_adapter"]) if cfg["base_adapter"] else None,
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
    echo = cfg["echo"]
    receipt["echo"] = loop.echo.as_receipt(
        lam=float(echo["lambda"]) if echo else None,
        env_mask_mode=echo["env_mask_mode"] if echo else None,
        warning_filter=echo["warning_filter"] if echo else None,
    )
    items = len(job.source.items) if job.route == "prompts" else len(job.source.rows)
    receipt["data"] = {
        "examples_read": items,
        "examples_filtered": 0,
        "examples_trained": loop.global_step,
        "groups_read": 0,
        "groups_filtered": 0,
        "groups_trained": 0,
        "completions_read": loop.consumed,
        "completions_trained": loop.global_step,
        "reward_groups_filtered": 0,
        "reward_groups_kept": 0,
    }
    receipt["token_counts"] = {
        "action_tokens": loop.action_tokens,
        "env_tokens": loop.env_tokens,
        "env_tokens_before_warning_filter": loop.env_tokens,
        "env_tokens_after_warning_filter": loop.env_tokens,
        "warning_tokens_filtered": 0,
        "context_tokens": 0,
    }
    return receipt
