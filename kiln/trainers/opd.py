"""OPD trainer: on-policy distillation of a registered teacher into a LoRA student.

Longer than 600 lines: one trainer read top to bottom -- its effective configuration, admission with the teacher's
side, rollouts and their losses, the run and its receipt -- over the shared components of the kit.

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

Read top to bottom:

1. the effective configuration (``EffectiveOpdConfig``, ``resolve_config``) and the request rules
   (``check_request``): every refusal of spec/40, naming the field;
2. admission (``admit_request``, ``admit_opd``): the teacher looked up and re-probed (``pinned_teacher``), the
   source it scores or has scored (``Prompts``, ``PreScored``) checked against the student's vocabulary and
   tokenizer, model, data, identity, resume -- everything that can fail before training;
3. rollouts and their losses (``draw``, ``step_weights``, ``train_shares``, ``gather_step``);
4. the run (``OpdRun``): rollout, scoring, loss, step, collapse diagnostics, checkpoints, and publication (adapter,
   receipt with the ``opd`` block, manifest). A failure after admission writes a failed receipt with its category;
5. the loop's committed state (``OpdLoop``: ``opd_loop_state.json``) and the receipt.

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
together (one left-padded, KV-cached decode; each step's tokens drawn row by row from the one ``rollout-sampling``
generator) and scored in one teacher call -- all from the policy at the step's start, so every rollout is exactly
on-policy; then each candidate's forward and backward adds its share of the step's loss (the mean per-position
reverse KL over all the step's action positions, plus λ times ECHO's mean cross-entropy over all its observation
tokens), and one optimizer step follows. The non-empty rollouts of a micro-batch go through one right-padded student
forward (``kiln.trainers._forwards.selected_logits``: the model's own head and logit post-processing, only at the
rows the loss reads) and one backward; a micro-batch with a single non-empty rollout runs it alone and dense.
Checkpoints and cancellation land between steps, where the generator state and the cursor say everything. With both
sizes 1 this is the per-candidate loop, byte for byte.

Data parallelism (``kiln.opd-step-candidates.v1``; ``docs/opd.md``): over several ranks a step is still what one
process takes. Every rank decodes every rollout of the step from the one ``rollout-sampling`` generator -- the stream
is sequential, and a batched, memory-bound decode costs about as much for the step's rows as for a rank's part --
then the step's micro-batches are dealt to the ranks in turn: rank r has the teacher score, and trains, micro-batch
j when j mod world_size == r, weighted over the whole step (``train_shares``); one collective per step sums the
gradients, and each rollout's mean KL and ECHO cross-entropy are gathered (``gather_step``) so the collapse and ECHO
accumulators of every rank are one process's; rank 0 publishes.

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
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kiln_contracts.models.kiln_control_plane_v1_schema import OpdConfig, OpdRequest

from kiln.artifacts.checkpoint_manifest import OPD_SOURCE_KINDS
from kiln.checkpoints import PublishedCheckpoint
from kiln.data.opd import OffPolicyFile, OpdPrompts
from kiln.documents.batch_plan import steps_per_epoch
from kiln.documents.digests import json_sha256, raw_hex, teacher_identity_revision
from kiln.documents.epoch_order import ALGORITHM_ID, epoch_order
from kiln.documents.jsonio import JsonObject
from kiln.errors import NotFoundError, RequestError, ZeroActionTokensError
from kiln.trainers._admission import (
    AdmittedJob,
    RunIdentity,
    TrainingContext,
    base_model,
    planned_model,
    requested_precision,
    run_identity,
    with_targets,
)
from kiln.trainers._checkpointing import (
    CheckpointProgress,
    base_adapter_block,
    manifest_head,
    phase_timings,
    publish_state,
    restore_policy,
)
from kiln.trainers._forwards import (
    PrefixPlan,
    invariant_decoder,
    invariant_logits,
    invariant_selected,
    plan_sharing,
    run_prefix,
    selected_logits,
    shared_length,
)
from kiln.trainers._kit import (
    Cadence,
    OnCheckpoint,
    Policy,
    Progress,
    RunProgress,
    RunTexts,
    TrainResult,
    artifact_lines,
    check_pin,
    guarded,
    publish_adapter,
)
from kiln.trainers._receipts import data_block, echo_block, envelope, token_counts_block
from kiln.trainers._requests import Request, dataset_path_of, parse_request, refuse_gate
from kiln.trainers._resume import claim_target, load_resume, resume_metadata
from kiln.training import (
    LORA_INIT_ALGORITHM,
    OPD_SHARDING_RULE,
    DataParallel,
    Echo,
    EffectiveConfig,
    MemorySettings,
    StepSync,
    check_run_bounds,
    common_members,
    context_length,
    lora_delta_norms,
    model_head,
    refuse,
    resolve_optimizer,
)
from kiln.training.echo import EchoAccumulator, echo_from_logits, step_echo_ce
from kiln.training.opd_objective import CollapseAccumulator, receipt_snapshot, top_k_reverse_kl

if TYPE_CHECKING:
    import torch

    from kiln.model import LoadedModel
    from kiln.teachers import PinnedTeacher, TeacherScorer
    from kiln.training import ModelHead

KIND = "opd"
ROLLOUT_STREAM = "rollout-sampling"
ROLLOUT_ALGORITHM = "kiln.counter-draws.splitmix64.v1"  # kiln.model.DrawKey: seed and position say everything
ROLLOUT_SEED_SALT = 0x524F_4C4C_4F55_5453  # "ROLLOUTS": keeps the stream apart from lora-init's
PROGRESS_AUX = ("candidates_consumed", "collapse_guardrail")
EXECUTABLE_TOP_K = (16, 32)
DEFAULT_MAX_TOP_K = 32  # a teacher without a pinned identity (none is registered so today) bounds top_k here

__all__ = [
    "AdmittedOpd",
    "EffectiveOpdConfig",
    "OpdLoop",
    "OpdRun",
    "admit_opd",
    "admit_request",
    "check_request",
    "resolve_config",
    "rollout_seed",
    "run_opd",
]


# ----------------------------------------------------------------------------- the effective configuration


@dataclass(frozen=True, kw_only=True)
class EffectiveOpdConfig(EffectiveConfig):
    """An OPD run's configuration with every default resolved: what its checkpoints, receipt and replay record."""

    training_mode: str
    objective: str
    loss: str
    top_k: int
    samples_per_prompt: int
    temperature: float
    top_p: float
    max_tokens: int
    rollout_prompt_rendering: str
    stable_opd: str  # its mode
    discount: float
    clip_epsilon: float
    echo: Echo | None
    epochs: int
    grad_checkpoint_segments: int | None  # recorded only when the request gives it
    prefix_sharing: str  # auto | off

    def to_json(self) -> JsonObject:
        out = {
            **self.common_json(),
            "training_mode": self.training_mode,
            "objective": self.objective,
            "loss": self.loss,
            "top_k": self.top_k,
            "samples_per_prompt": self.samples_per_prompt,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_tokens": self.max_tokens,
            "rollout_prompt_rendering": self.rollout_prompt_rendering,
            "stable_opd": {"mode": self.stable_opd},
            "discount": self.discount,
            "clip_epsilon": self.clip_epsilon,
            "echo": None if self.echo is None else self.echo.to_json(),
            "epochs": self.epochs,
            "prefix_sharing": self.prefix_sharing,
        }
        if self.grad_checkpoint_segments is not None:
            out["grad_checkpoint_segments"] = self.grad_checkpoint_segments
        return out


def resolve_config(
    config: OpdConfig,
    adapter_name: str,
    *,
    teacher_max_top_k: int,
    model_max_len: int,
    seed: int | None = None,
    checkpoint_interval: int | None = None,
    memory: MemorySettings | None = None,
) -> EffectiveOpdConfig:
    """The effective configuration of a (schema-valid) ``OpdConfig``; refuses, naming the field, what Kiln does not
    execute: an ``objective``, ``loss``, ``rollout_prompt_rendering``, ``stable_opd``, ``discount`` or ``clip_epsilon``
    other than its schema default (the only one Kiln runs), ``top_k`` other than 16 or 32, a cost cap, shape
    conversion, anomaly detection and the LoRA scale guardrail.

    Two defaults come from outside the request: ``max_tokens`` defaults to the student's context length
    (``model_max_len``) and is capped by it, and a null ``checkpoint_interval`` defers to ``checkpoint_interval`` (the
    server's). ``top_k`` is min(requested, the teacher's ``max_top_k``)."""
    defaults = OpdConfig()
    for name, why in (
        ("objective", "the only objective is the top-K reverse KL"),
        ("loss", "student and teacher are compared on the teacher's top-K ids"),
        ("rollout_prompt_rendering", "rollouts are rendered with the chat template"),
    ):
        value, allowed = getattr(config, name).value, getattr(defaults, name).value
        if value != allowed:
            refuse(name, f"{value!r} is not executed by Kiln ({why})", code="training_backend_unsupported")
    stable, only = config.stable_opd.model_dump(mode="json"), defaults.stable_opd.model_dump(mode="json")
    if stable != only:
        refuse("stable_opd", f"{stable!r}: only {only!r} runs", code="training_backend_unsupported")
    for name in ("discount", "clip_epsilon"):
        value, required = getattr(config, name), getattr(defaults, name)
        if value != required:
            refuse(name, f"{value!r}: Kiln requires {required:g}", code="training_backend_unsupported")
    if config.max_cost_usd is not None:
        refuse("max_cost_usd", "Kiln has no cost accounting; send null or omit it", code="training_backend_unsupported")
    if (config.model_extra or {}).get("allow_adapter_shape_conversion"):  # an open config's unknown member
        refuse(
            "allow_adapter_shape_conversion", "Kiln never converts adapter shapes", code="training_backend_unsupported"
        )
    if config.detect_anomaly:
        refuse("detect_anomaly", "not available for OPD in this Kiln", code="training_backend_unsupported")
    if config.top_k not in EXECUTABLE_TOP_K:
        refuse("top_k", f"{config.top_k}: Kiln executes top_k 16 or 32", code="training_backend_unsupported")
    common = common_members(
        config,
        "OpdConfig",
        adapter_name=adapter_name,
        seed=seed,
        checkpoint_interval=checkpoint_interval,
        memory=memory,
    )
    max_tokens = model_max_len if config.max_tokens is None else config.max_tokens
    if max_tokens > model_max_len:
        refuse("max_tokens", f"{max_tokens} exceeds the student's context length {model_max_len}")
    return EffectiveOpdConfig(
        **common,
        training_mode=config.training_mode.value,
        objective=defaults.objective.value,
        loss=defaults.loss.value,
        top_k=min(config.top_k, teacher_max_top_k),
        samples_per_prompt=config.samples_per_prompt,
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=max_tokens,
        rollout_prompt_rendering=defaults.rollout_prompt_rendering.value,
        stable_opd=defaults.stable_opd.mode,
        discount=defaults.discount,
        clip_epsilon=defaults.clip_epsilon,
        echo=Echo.resolve(config.echo),
        epochs=config.epochs,
        grad_checkpoint_segments=config.grad_checkpoint_segments,
        prefix_sharing=config.prefix_sharing.value,
    )


def check_request(request: Request[OpdRequest]) -> str:
    """The request-level refusals of spec/40 that need no data, teacher or model (the schema has been checked at
    the door); returns the training mode."""
    model = request.model
    refuse_gate(model.post_eval)
    config = model.config or OpdConfig()
    mode = config.training_mode.value
    if mode == "on_policy" and model.prompts is None:
        raise RequestError(
            "training_mode on_policy samples from inline prompts: send prompts",
            code="training_invalid_request",
            pointer="/prompts",
            hint='or set "training_mode": "off_policy" with a pre-scored dataset_path',
        )
    if mode == "off_policy" and model.dataset_path is None:
        raise RequestError(
            "training_mode off_policy replays a pre-scored teacher file: send dataset_path",
            code="training_invalid_request",
            pointer="/dataset_path",
        )
    if model.prompts is not None:  # bounded before the candidates (prompts x samples) are listed
        epochs, samples, prompts = config.epochs, config.samples_per_prompt, len(model.prompts)
        check_run_bounds(
            total_steps=epochs * prompts * samples,
            steps_rule=f"{epochs} epochs x {prompts} prompts x {samples} samples_per_prompt",
            rows=(),
            context=None,
        )
    return mode


# ----------------------------------------------------------------------------- admission


@dataclass(kw_only=True)
class AdmittedOpd(AdmittedJob[EffectiveOpdConfig]):
    """An admitted OPD job: the source and its candidates, the pinned teacher and its revisions."""

    kind: ClassVar[str] = KIND
    sharding: ClassVar[str] = OPD_SHARDING_RULE
    source: OpdPrompts | OffPolicyFile  # prompts (on_policy) or the pre-scored file (off_policy)
    route: str  # "prompts" | "teacher_jsonl"
    teacher: PinnedTeacher
    teacher_identity: JsonObject | None
    teacher_identity_revision: str  # raw hex
    teacher_content_revision: str
    candidates: list[tuple[int, int]]
    stop_ids: frozenset[int]
    max_len: int
    pin: str | None = None
    teachers_root: Path | None = None
    head: ModelHead | None = None  # proven at admission when micro-batches read the logits themselves
    sharing: PrefixPlan = field(default_factory=PrefixPlan)  # whether batched student forwards share tokens

    @property
    def total_steps(self) -> int:  # candidates: an optimizer step per non-empty step of candidates
        return self.config.epochs * len(self.candidates)

    @property
    def per_step(self) -> int:
        """Candidates an optimizer step consumes (the last step of an epoch takes what is left)."""
        return self.config.rows_per_step

    @property
    def schedule_steps(self) -> int:  # the schedule's positions: the planned steps, empty ones included
        return self.config.epochs * steps_per_epoch(len(self.candidates), self.per_step)

    @property
    def data_sha256(self) -> str:
        return self.source.source_sha256 if isinstance(self.source, OpdPrompts) else self.source.sha256

    @property
    def prompts(self) -> OpdPrompts:
        assert isinstance(self.source, OpdPrompts)
        return self.source

    @property
    def pre_scored(self) -> OffPolicyFile:
        assert isinstance(self.source, OffPolicyFile)
        return self.source

    def fingerprint(self) -> JsonObject:
        teacher = (
            f"{self.teacher.alias} identity {self.teacher_identity_revision} content {self.teacher_content_revision}"
        )
        return {**super().fingerprint(), "teacher": teacher}

    def identity_manifest(self) -> JsonObject:
        seed = self.config.seed
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
                "epoch-order": {"algorithm": ALGORITHM_ID, "seed": seed, "position": 0},
                "lora-init": {"algorithm": LORA_INIT_ALGORITHM, "seed": seed, "position": 0},
                ROLLOUT_STREAM: {"algorithm": ROLLOUT_ALGORITHM, "seed": seed, "position": 0},
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


def admit_request(request: Request[OpdRequest], *, adapter_name: str, context: TrainingContext) -> AdmittedOpd:
    """An ``OpdRequest`` admitted in ``context`` (its teachers registry, its default checkpoint interval); raises
    ``KilnError`` and publishes nothing."""
    from kiln.model import max_positions, resolve_device, resolve_precision, special_tokens, stop_token_ids

    mode = check_request(request)
    config = request.model.config or OpdConfig()
    registry = context.registry
    resume = None if config.resume_checkpoint is None else config.resume_checkpoint.root
    point = resume_metadata(registry, adapter_name, resume, None if config.seed is None else config.seed.root, KIND)
    if context.teachers_root is None:
        raise NotFoundError(
            f"teacher {request.model.teacher!r}: no teacher registry is configured", code="teacher_not_found"
        )
    teacher = pinned_teacher(request.model.teacher, mode, teachers_root=context.teachers_root, registry=registry)
    claim_target(registry, adapter_name, point)
    opened = base_model(context)  # tokenizer, config and weight headers: no weight is loaded before the plan
    max_len = max_positions(opened.config, opened.tokenizer)
    # the identity comes first: the source is checked against the student's tokenizer, and the effective config
    # against the source's teacher (its top-K bound)
    precision = resolve_precision(requested_precision(config.precision, context), opened)
    device = resolve_device(context.memory.device if config.device is None else config.device.root)
    optimizer = resolve_optimizer(config.optimizer)
    identity = run_identity(opened, optimizer, context.data_parallel, precision, device=device)
    start = time.perf_counter()
    source = admitted_source(mode, request, teacher, opened, identity)
    cfg = resolve_config(
        config,
        adapter_name,
        teacher_max_top_k=source.max_top_k,
        model_max_len=max_len,
        seed=None if point is None else point.seed,
        checkpoint_interval=context.checkpoint_interval,
        memory=context.memory,
    )
    data = source.read(cfg)
    data.tokenize_ms = (time.perf_counter() - start) * 1000
    longest = _longest_sequence(data, cfg, max_len)
    loaded, cfg, plan = planned_model(
        opened,
        cfg,
        context,
        tokens=longest,
        loss_logits=longest * cfg.micro_batch_size * opened.vocab_size,  # a micro-batch's scored positions
        point=point,
        segments=cfg.grad_checkpoint_segments,
    )
    cfg = with_targets(cfg, loaded)
    job = AdmittedOpd(
        adapter_name=adapter_name,
        registry=registry,
        config=cfg,
        loaded=loaded,
        run=identity,
        memory_plan=plan,
        source=data,
        route=source.route,
        teacher=teacher,
        teacher_identity=source.teacher_identity,
        teacher_identity_revision=source.identity_revision,
        teacher_content_revision=source.content_revision,
        candidates=source.candidates(data, cfg),
        stop_ids=stop_token_ids(loaded.model, loaded.tokenizer, special_tokens(loaded.tokenizer)),
        max_len=max_len,
        pin=source.pin,
        teachers_root=context.teachers_root,
        head=model_head(loaded.model) if cfg.micro_batch_size > 1 else None,
    )
    job.head, job.sharing = sharing_plan(cfg, loaded.model, job.head)
    _check_data(job)
    job.resume = load_resume(
        point,
        job.identity_manifest(),
        progress_auxiliary=PROGRESS_AUX,
        progress_streams=(ROLLOUT_STREAM, "epoch-order"),
    )
    return job


def sharing_plan(cfg: EffectiveOpdConfig, model: Any, head: ModelHead | None) -> tuple[ModelHead | None, PrefixPlan]:
    """``(head, plan)``: whether the student's batched training forward runs the tokens its rollouts share once;
    only a micro-batch of several rollouts has a forward to share. With the invariant forward (the student's
    rollouts and losses both run it) sharing is exact by construction (``Decoder.prefix``: the shared rows and the
    suffixes after them are the whole sequences' bits), checkpointing or not; with the model's own forward it is
    proven by ``plan_sharing``, and a recomputed layer (activation checkpointing) keeps no key/value cache. OPD's
    reference is the teacher: nothing to plan there."""
    blockers = []
    if cfg.micro_batch_size == 1:
        blockers.append("micro_batch_size 1: every rollout runs its own forward, so no forward holds two")
    if invariant_decoder(model) is not None:
        if cfg.prefix_sharing == "off":
            return head, PrefixPlan()
        return head, PrefixPlan(cfg.prefix_sharing, policy=not blockers, reason="; ".join(blockers) or None)
    if cfg.gradient_checkpointing == "on" and not blockers:
        blockers.append("gradient_checkpointing recomputes each decoder layer without a key/value cache")
    return plan_sharing(cfg.prefix_sharing, model, head, blockers=blockers, reference=False)


def admit_opd(
    *,
    adapter_name: str,
    registry: Path,
    request: JsonObject,
    teachers_root: Path,
    model_path: str | None = None,
    loaded: LoadedModel | None = None,
    server_checkpoint_interval: int | None = None,
    data_parallel: DataParallel | None = None,
) -> AdmittedOpd:
    """``admit_request`` for a caller holding an ``OpdRequest`` body as JSON (``data_parallel``: the one worker process
    it trains in, when not this one)."""
    context = TrainingContext(
        registry=registry,
        model_path=model_path,
        loaded=loaded,
        teachers_root=teachers_root,
        checkpoint_interval=server_checkpoint_interval,
        data_parallel=data_parallel or DataParallel(),
    )
    return admit_request(parse_request(OpdRequest, request), adapter_name=adapter_name, context=context)


def _longest_sequence(data: OpdPrompts | OffPolicyFile, cfg: EffectiveOpdConfig, max_len: int) -> int:
    """The longest sequence a training forward sees: a prompt with its longest rollout (capped by the context), or a
    pre-scored row's prefix and response."""
    if isinstance(data, OpdPrompts):
        prompt = max((len(item.student_prefix) for item in data.items), default=1)
        return min(max_len, prompt + cfg.max_tokens)
    return max((len(row.student_prefix) + len(row.action_ids) for row in data.rows), default=1)


def _check_data(job: AdmittedOpd) -> None:
    """An admitted job within the run bounds: its optimizer steps, and each prompt short enough (student and teacher
    prefix) to leave a rollout token, or each pre-scored row (prefix + response) within the model's context."""
    if job.route == "prompts":
        rows = [
            (f"prompt {item.index + 1}", max(len(item.student_prefix), len(item.teacher_prefix)))
            for item in job.prompts.items
        ]
        margin = 1
    else:
        rows = [(f"line {row.line}", len(row.student_prefix) + len(row.action_ids)) for row in job.pre_scored.rows]
        margin = 0
    check_run_bounds(
        total_steps=job.total_steps,
        steps_rule=f"{job.config.epochs} epochs x {len(job.candidates)} candidates",
        rows=rows,
        context=context_length(job.loaded),
        margin=margin,
    )


# ----------------------------------------------------------------------------- the teacher's side of admission


def pinned_teacher(alias: str, mode: str, *, teachers_root: Path, registry: Path) -> PinnedTeacher:
    """The registered teacher ``alias``, re-probed (``teacher_not_found``; ``teacher_identity_mismatch`` when it changed
    since registration), whose kind can serve ``mode``: a fixture (pre-scored file) cannot score new rollouts, and
    ``off_policy`` replays only a fixture's file."""
    from kiln.teachers import TeacherRegistry, reprobe

    teacher = TeacherRegistry(teachers_root, adapter_registry=registry).get(alias)
    reprobe(teacher, registry_dir=registry)
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
    return teacher


def admitted_source(
    mode: str, request: Request[OpdRequest], teacher: PinnedTeacher, loaded: LoadedModel, run: RunIdentity
) -> Prompts | PreScored:
    """The source of ``mode`` for the student ``loaded`` (with its run identity), checked against ``teacher``: what the
    effective config needs (the teacher's top-K bound), the revisions a checkpoint binds, the candidates."""
    vocab = loaded.vocab_size
    tokenizer = raw_hex(run.identity.tokenizer_vocab_hash)
    if mode == "on_policy":
        return Prompts(request, teacher, loaded, vocab, tokenizer)
    return PreScored(request, teacher, loaded, vocab, tokenizer)


class Prompts:
    """``on_policy``: the request's prompts; the teacher scores each rollout live (it must share the student's
    vocabulary and tokenizer)."""

    route = "prompts"
    pin = None

    def __init__(
        self, request: Request[OpdRequest], teacher: PinnedTeacher, loaded: LoadedModel, vocab: int, tokenizer: str
    ) -> None:
        _check_vocabulary(teacher.identity, vocab, tokenizer, teacher.alias)
        self.prompts, self.loaded = request.rows("prompts") or [], loaded
        self.max_top_k: int = teacher.identity["max_top_k"] if teacher.identity else DEFAULT_MAX_TOP_K
        self.teacher_identity = teacher.identity
        self.identity_revision: str = teacher.identity_revision or ""  # a live teacher has both, pinned at
        self.content_revision: str = teacher.content_revision or ""  # registration

    def read(self, cfg: EffectiveOpdConfig) -> OpdPrompts:
        from kiln.data.opd import read_prompts

        warning_filter = cfg.echo.warning_filter if cfg.echo else True
        return read_prompts(self.loaded.tokenizer, self.prompts, warning_filter=warning_filter)

    @staticmethod
    def candidates(source: OpdPrompts | OffPolicyFile, cfg: EffectiveOpdConfig) -> list[tuple[int, int]]:
        assert isinstance(source, OpdPrompts)
        return [(item.index, s) for item in source.items for s in range(cfg.samples_per_prompt)]


class PreScored:
    """``off_policy``: the fixture's pre-scored file, read row by row against the student's vocabulary and bound to
    the fixture the teacher was registered for (its id and, when pinned, its digest); the row's response is the
    rollout, its scores the teacher's."""

    route = "teacher_jsonl"

    def __init__(
        self, request: Request[OpdRequest], teacher: PinnedTeacher, loaded: LoadedModel, vocab: int, tokenizer: str
    ) -> None:
        from kiln.data.opd import read_off_policy_file

        path = dataset_path_of(request.model)
        if path is None:  # check_request guarantees it for off_policy
            raise RequestError("off_policy needs dataset_path", code="training_invalid_request")
        self.source = source = read_off_policy_file(
            loaded.tokenizer, path, vocab_size=vocab, tokenizer_vocab_sha256=tokenizer
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
        self.max_top_k = int(manifest["top_k"])
        self.pin: str | None = source.sha256
        self.content_revision: str = source.sha256
        self.teacher_identity: JsonObject | None = manifest.get("teacher_identity")
        self.identity_revision: str = (
            teacher_identity_revision(self.teacher_identity)
            if self.teacher_identity
            else raw_hex(source.manifest_sha256)
        )

    def read(self, cfg: EffectiveOpdConfig) -> OffPolicyFile:
        return self.source

    @staticmethod
    def candidates(source: OpdPrompts | OffPolicyFile, cfg: EffectiveOpdConfig) -> list[tuple[int, int]]:
        assert isinstance(source, OffPolicyFile)
        return [(row.index, 0) for row in source.rows]


def _check_vocabulary(identity: JsonObject | None, vocab: int, tokenizer: str, alias: str) -> None:
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


# ----------------------------------------------------------------------------- rollouts and their losses


@dataclass
class Rollout:
    prefix: list[int]
    action: list[int]
    truncated: bool
    observation: list[bool]
    teacher_ids: torch.Tensor | None = None  # LongTensor [A, K] (None for an empty rollout)
    teacher_lp: torch.Tensor | None = None  # FloatTensor [A, K]

    @property
    def scores(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's top-K ids and log-probabilities of a non-empty rollout."""
        assert self.teacher_ids is not None
        assert self.teacher_lp is not None
        return self.teacher_ids, self.teacher_lp


def rollout_seed(seed: int) -> int:
    """The ``rollout-sampling`` stream's key: rollout i's token at position p is drawn with
    ``kiln.model.DrawKey(rollout_seed(seed), i, p)`` (i counts the run's rollouts from 0)."""
    return (seed ^ ROLLOUT_SEED_SALT) % 2**64


def draw(
    job: AdmittedOpd,
    model: Any,
    loop: OpdLoop,
    candidates: list[int],
    scorer: TeacherScorer | None,
) -> list[Rollout]:
    """The rollouts of ``candidates`` (indices into ``job.candidates``), in order, scored by the teacher: on the
    ``prompts`` route sampled by the student from its current policy -- decoded together by the one batched decoder
    (``kiln.model.decode``), rollout i of the run drawing with ``DrawKey(rollout_seed(seed), i, position)`` -- and
    scored several in one ``score_batch`` call; on the ``teacher_jsonl`` route the row's response and its recorded
    scores."""
    import torch

    from kiln.model import Sampling, decode

    cfg = job.config
    if job.route != "prompts":
        out = []
        for index in candidates:
            row = job.pre_scored.rows[job.candidates[index][0]]
            rollout = Rollout(list(row.student_prefix), list(row.action_ids), False, [False] * len(row.student_prefix))
            if rollout.action:
                k = cfg.top_k
                rollout.teacher_ids = torch.tensor([list(ids[:k]) for ids in row.teacher_ids], dtype=torch.long)
                rollout.teacher_lp = torch.tensor([list(lp[:k]) for lp in row.teacher_logprobs], dtype=torch.float32)
            out.append(rollout)
        return out
    items = [job.prompts.items[job.candidates[index][0]] for index in candidates]
    prefixes = [list(item.student_prefix) for item in items]
    t0 = time.perf_counter()
    model.eval()
    sampled = decode(
        model,
        prefixes,
        max_new=[min(cfg.max_tokens, job.max_len - len(prefix)) for prefix in prefixes],
        sampling=Sampling(temperature=cfg.temperature, top_p=cfg.top_p),
        seed=rollout_seed(cfg.seed),
        sequences=[loop.rollouts_sampled + i for i in range(len(prefixes))],
        stop_ids=job.stop_ids,
    )
    loop.rollouts_sampled += len(candidates)
    loop.timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
    rolled = [
        Rollout(prefix, found.ids, found.truncated, list(item.observation_mask))
        for prefix, found, item in zip(prefixes, sampled, items, strict=True)
    ]
    scored = [(r, item) for r, item in zip(rolled, items, strict=True) if r.action]
    if scored and scorer is not None:
        t1 = time.perf_counter()
        pairs = [(list(item.teacher_prefix), r.action) for r, item in scored]
        for (rollout, _), (ids, lp) in zip(scored, scorer.score_batch(pairs, cfg.top_k), strict=True):
            rollout.teacher_ids, rollout.teacher_lp = ids, lp
        loop.timings["reference_forward_ms"] += (time.perf_counter() - t1) * 1000
    return rolled


def observed_positions(rollout: Rollout) -> list[int]:
    """Prefix positions whose token is an observation (ECHO's targets)."""
    return [p for p in range(1, len(rollout.prefix)) if rollout.observation[p]]


def step_weights(rollouts: list[Rollout], echo: bool) -> list[tuple[float, float]]:
    """Per rollout of a step, ``(KL weight, ECHO weight)``: its action positions over the step's, its observation
    tokens over the step's; ``(1, 1)`` for all when at most one rollout of the step is non-empty (a step with one
    non-empty candidate is that candidate's own loss, exactly as before steps could hold several)."""
    live = [r for r in rollouts if r.action]
    if len(live) <= 1:
        return [(1.0, 1.0)] * len(rollouts)
    actions = max(sum(len(r.action) for r in live), 1)
    counts = [len(observed_positions(r)) if echo and r.action else 0 for r in rollouts]
    observed = max(sum(counts), 1)
    return [(len(r.action) / actions, n / observed) for r, n in zip(rollouts, counts, strict=True)]


EnvCe = tuple[float, int] | None  # a rollout's ECHO (CE, observation tokens); None without one


def candidate_loss(
    model: Any, rollout: Rollout, echo: Echo | None, weights: tuple[float, float], timings: dict[str, float]
) -> tuple[torch.Tensor, float, EnvCe]:
    """A non-empty rollout's share of its step's loss (``weights`` from ``step_weights``) from its own dense forward,
    its mean per-position KL, and its ECHO ``(CE, observation tokens)``."""
    import torch

    from kiln.model import forward_logits, model_device

    prefix, action = rollout.prefix, rollout.action
    model.train()
    ids = torch.tensor([prefix + action], dtype=torch.long, device=model_device(model))
    t0 = time.perf_counter()
    decoder = invariant_decoder(model)
    logits = invariant_logits(decoder, ids) if decoder is not None else forward_logits(model, ids)
    timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
    start = len(prefix) - 1
    loss, per_position = top_k_reverse_kl(logits[start : start + len(action)], *rollout.scores)
    if weights[0] != 1.0:
        loss = loss * weights[0]
    mean_kl = float(per_position.detach().mean())
    observed = observed_positions(rollout)
    env = None
    if echo is not None and observed:
        positions = torch.tensor(observed, dtype=torch.long, device=ids.device)
        term, env = echo_from_logits(logits[positions - 1], ids[0, positions], echo.lam, weights[1])
        loss = loss + term
    return loss, mean_kl, env


def batch_loss(
    model: Any,
    head: ModelHead | None,
    rollouts: list[Rollout],
    weights: list[tuple[float, float]],
    echo: Echo | None,
    timings: dict[str, float],
    *,
    share: bool = False,
) -> tuple[torch.Tensor, list[tuple[float, EnvCe]]]:
    """The summed shares of several non-empty rollouts from one right-padded forward, and per rollout its mean KL and
    ECHO ``(CE, observation tokens)``; ``share``: the tokens every rollout starts with run once (``run_prefix``)."""
    wanted, observed = [], []
    for rollout in rollouts:
        p, a = len(rollout.prefix), len(rollout.action)
        rows = [False] * (p + a - 1)
        rows[p - 1 :] = [True] * a  # row q predicts token q + 1: the action rows
        seen = observed_positions(rollout) if echo is not None else []
        for position in seen:
            rows[position - 1] = True  # observations lie in the prefix, before every action row
        wanted.append(rows)
        observed.append(len(seen))
    model.train()
    t0 = time.perf_counter()
    sequences = [r.prefix + r.action for r in rollouts]
    shared = shared_length(sequences) if share else 0
    decoder = invariant_decoder(model)
    if decoder is not None:
        found = invariant_selected(decoder, sequences, wanted, shared=shared)
    else:
        prefix = run_prefix(model, sequences[0][:shared]) if shared else None
        found = selected_logits(model, head, sequences, wanted, prefix=prefix)
    timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
    total: torch.Tensor | None = None
    out: list[tuple[float, EnvCe]] = []
    for rollout, (kl_weight, echo_weight), rows, targets, n in zip(
        rollouts, weights, found.split(found.rows), found.split(found.targets), observed, strict=True
    ):
        loss, per_position = top_k_reverse_kl(rows[n:], *rollout.scores)
        loss = loss * kl_weight
        env = None
        if n and echo is not None:
            term, env = echo_from_logits(rows[:n], targets[:n], echo.lam, echo_weight)
            loss = loss + term
        total = loss if total is None else total + loss
        out.append((float(per_position.detach().mean()), env))
    assert total is not None
    return total, out


def train_shares(
    model: Any,
    head: ModelHead | None,
    rollouts: list[Rollout],
    echo: Echo | None,
    width: int,
    timings: dict[str, float],
    backward: Callable[[torch.Tensor], float],
    group: DataParallel,
    *,
    share: bool = False,
) -> tuple[list[float], list[EnvCe], list[float | None]]:
    """Forward and ``backward`` of every non-empty rollout's share of its step's loss, ``width`` rollouts (a
    micro-batch) at a time -- the micro-batches of the rank ``group`` (micro-batch ``j`` is rank ``j mod
    world_size``'s; all of them in one process), each share weighted over the whole step; returns what ``backward``
    returned for each backward, and per rollout its ECHO ``(CE, tokens)`` and its mean KL (None: an empty rollout,
    one without an observation token (ECHO), or another rank's)."""
    weights = step_weights(rollouts, echo is not None)
    values: list[float] = []
    envs: list[EnvCe] = [None] * len(rollouts)
    kls: list[float | None] = [None] * len(rollouts)
    for j, start in enumerate(range(0, len(rollouts), width)):
        if not group.deals(j):
            continue
        live = [i for i in range(start, min(start + width, len(rollouts))) if rollouts[i].action]
        if len(live) > 1:
            loss, found = batch_loss(
                model, head, [rollouts[i] for i in live], [weights[i] for i in live], echo, timings, share=share
            )
            values.append(backward(loss))
            for i, (kl, env) in zip(live, found, strict=True):
                kls[i], envs[i] = kl, env
            continue
        for i in live:
            loss, kls[i], envs[i] = candidate_loss(model, rollouts[i], echo, weights[i], timings)
            values.append(backward(loss))
    return values, envs, kls


def gather_step(sync: StepSync, envs: list[EnvCe], kls: list[float | None]) -> tuple[list[EnvCe], list[float | None]]:
    """A step's per-rollout ECHO ``(CE, tokens)`` and mean KL (``train_shares``), each rollout's from the rank that
    trained it, on every rank (``StepSync.gather``; one process: as they are)."""
    if not sync.group.active:
        return envs, kls
    mine = [[i, kl, *(env or (None, 0))] for i, (kl, env) in enumerate(zip(kls, envs, strict=True)) if kl is not None]
    for rank in sync.gather(mine):
        for i, kl, ce, tokens in rank:
            kls[i], envs[i] = kl, None if ce is None else (ce, tokens)
    return envs, kls


# ----------------------------------------------------------------------------- the run


def run_opd(
    job: AdmittedOpd,
    *,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    on_checkpoint: OnCheckpoint | None = None,
) -> TrainResult:
    """Train, then publish adapter, receipt and manifest (or a failed receipt)."""
    run = OpdRun(job, progress=progress, cancel=cancel, on_checkpoint=on_checkpoint)
    try:
        return guarded(run)
    finally:
        if run.scorer is not None:
            run.scorer.close()


class OpdRun(RunProgress):
    """One run of an admitted OPD job; ``train`` reads setup -> loop over the steps of candidates -> publication."""

    def __init__(
        self,
        job: AdmittedOpd,
        *,
        progress: Progress | None,
        cancel: threading.Event | None,
        on_checkpoint: OnCheckpoint | None,
    ) -> None:
        self.job = job
        self.started = time.perf_counter()
        self.progress, self.cancel, self.on_checkpoint = progress, cancel, on_checkpoint
        self.loop = OpdLoop(items=len(job.candidates), per_step=job.per_step)
        self.delta_norms: list[JsonObject] = []
        self.cadence: Cadence | None = None
        self.scorer: TeacherScorer | None = None

    def train(self) -> TrainResult:
        job, cfg = self.job, self.job.config
        # setup: the pin, the policy, the rollout stream and loop restored, the teacher's scorer, the cadence
        check_pin(job.pre_scored.path if job.pin is not None else None, job.pin)
        policy = Policy(job, restore=restore_policy)
        model = policy.model
        if job.route == "prompts" and invariant_decoder(model) is None:
            from kiln.host.progress import note
            from kiln.model import Unsupported, decoder_for

            try:
                decoder_for(model)
            except Unsupported as why:  # the rollouts decode row by row, the losses use the model's own forward
                note(f"opd: the student has no invariant forward ({why}); rollouts decode one row at a time")
        if job.resume is not None:  # the rollout stream is a counter: its position is all there is to restore
            self.loop = OpdLoop.restore(len(job.candidates), job.resume.loop_state)
            self.loop.rollouts_sampled = job.resume.manifest["rng_states"][ROLLOUT_STREAM]["position"]
        loop = self.loop
        loop.timings = policy.timings
        if job.route == "prompts":
            from kiln.teachers import open_scorer

            self.scorer = open_scorer(job.teacher, registry_dir=job.registry, device=job.device)
        group = job.data_parallel
        sync = StepSync(group, policy.params, self.cancel)  # a data-parallel group's one collective per step
        self.cadence = cadence = Cadence(
            job, lambda: self._publish_checkpoint(policy), sync.cancel, self.on_checkpoint, sync=sync
        )
        total, width, per_step = job.total_steps, cfg.micro_batch_size, job.per_step
        slots = steps_per_epoch(len(job.candidates), per_step)
        order_epoch, order = -1, []
        where = partial(_optimizer_step, loop)
        # the loop: a step of candidates -- their rollouts from the policy at the step's start, then their losses;
        # over several ranks every rank decodes every rollout (one generator), scores and trains its micro-batches
        while loop.consumed < total:
            if order_epoch != loop.epoch_index:  # the order is drawn once per epoch, not per candidate
                order_epoch, order = loop.epoch_index, epoch_order(cfg.seed, loop.epoch_index, len(job.candidates))
            members = order[loop.cursor : loop.cursor + per_step]  # a step never spans two epochs
            position, first_step = loop.epoch_index * slots + loop.cursor // per_step, loop.global_step
            rollouts = [
                r
                for j, start in enumerate(range(0, len(members), width))
                for r in draw(job, model, loop, members[start : start + width], self.scorer if group.deals(j) else None)
            ]
            values, found, kls = train_shares(
                model,
                job.head,
                rollouts,
                cfg.echo,
                width,
                loop.timings,
                lambda loss: policy.accumulate(loss, where),
                group,
                share=job.sharing.policy,
            )
            # a group sums every step, also one of empty rollouts (where the ranks agree to stop), and gathers the
            # rollouts' KL and ECHO from the ranks that trained them
            value = sync.reduce(sum(values[1:], values[0]) if values else 0.0, where)
            found, kls = gather_step(sync, found, kls)
            seen = []
            for rollout, mean_kl in zip(rollouts, kls, strict=True):
                action = rollout.action
                text = job.loaded.tokenizer.decode(action, skip_special_tokens=False) if action else ""
                loop.action_tokens += len(action)
                loop.empty += 0 if action else 1
                seen.append((rollout, text, mean_kl))
            loop.env_tokens += sum(env[1] for env in found if env is not None)
            if any(r.action for r in rollouts):  # a step of empty rollouts takes no optimizer step (keeps its place)
                policy.apply(position=position)
                loop.echo.add(step_echo_ce(found))
                loop.losses.append(value)
            else:
                policy.optimizer.zero_grad(set_to_none=True)  # the group's zeros, summed
            for rollout, text, mean_kl in seen:
                loop.collapse.add(tokens=len(rollout.action), truncated=rollout.truncated, mean_kl=mean_kl, text=text)
                loop.settle()
                if self.progress:
                    step_loss = loop.losses[-1] if rollout.action else None
                    tokens = len(rollout.prefix) + len(rollout.action)
                    self.progress({"step": loop.consumed, "total": total, "loss": step_loss, "tokens": tokens})
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
        # publication: every rank holds the same weights; rank 0 publishes adapter, receipt and manifest
        sync.check_same()
        loop.snapshots.append(loop.collapse.snapshot(loop.global_step))
        self.delta_norms = lora_delta_norms(model)
        if not loop.losses:
            raise ZeroActionTokensError(
                "every rollout was empty: no optimizer step ran, so there is no adapter to publish"
            )
        return publish_adapter(
            job,
            model,
            lambda adapter_dir: self.receipt(adapter_dir=adapter_dir),
            losses=list(loop.losses),
            checkpoints=cadence.published,
        )

    def failed_receipt(self, failure: tuple[str, str], exc: BaseException) -> JsonObject:
        return self.receipt(failure=failure)

    def _publish_checkpoint(self, policy: Policy) -> PublishedCheckpoint:
        job, loop = self.job, self.loop

        def loop_document() -> JsonObject:
            loop.snapshots.append(loop.collapse.snapshot(loop.global_step))
            return loop.as_document(job)

        def stamp(manifest: JsonObject, loop_doc: JsonObject) -> CheckpointProgress:
            finished = loop_doc["candidates_consumed"] >= job.total_steps
            manifest["rng_states"]["epoch-order"]["position"] = loop_doc["epoch_index"]
            manifest["rng_states"][ROLLOUT_STREAM]["position"] = loop.rollouts_sampled
            manifest["auxiliary_state"]["candidates_consumed"] = loop_doc["candidates_consumed"]
            manifest["auxiliary_state"]["collapse_guardrail"] = loop_doc["collapse_guardrail"]
            order = [] if finished else epoch_order(job.config.seed, loop_doc["epoch_index"], loop.items)
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
            )
        except BaseException:
            if loop.snapshots and loop.snapshots[-1]["candidates_consumed"] == loop.consumed:
                loop.snapshots.pop()  # the snapshot belongs to a checkpoint that was not published
            raise

    def receipt(self, *, adapter_dir: Path | None = None, failure: tuple[str, str] | None = None) -> JsonObject:
        job, loop, cfg = self.job, self.loop, self.job.config
        out = envelope(
            job,
            KIND,
            training_data=job.source.training_data(),
            started=self.started,
            epochs=cfg.epochs,
            adapter_dir=adapter_dir,
            failure=failure,
            tokenize_ms=job.source.tokenize_ms,
            timings=loop.timings,
            delta_norms=self.delta_norms,
            grad_norms=[],
        )
        out["hyperparameters"]["shuffle"] = True
        opd: JsonObject = {
            "training_mode": cfg.training_mode,
            "objective": cfg.objective,
            "loss_granularity": cfg.loss,
            "teacher_id": job.teacher.alias,
            "teacher_content_revision": job.teacher_content_revision,
            "top_k": cfg.top_k,
            "samples_per_prompt": cfg.samples_per_prompt,
            "prefix_sharing": {"mode": cfg.prefix_sharing, "student": job.sharing.policy, "reason": job.sharing.reason},
            "action_tokens": loop.action_tokens,
            "env_tokens": loop.env_tokens,
            "echo_combined": cfg.echo is not None and loop.echo.contributed,
            "echo_lambda": cfg.echo.lam if cfg.echo is not None else None,
            "initial_opd_loss": loop.losses[0] if loop.losses else None,
            "final_opd_loss": loop.losses[-1] if loop.losses else None,
        }
        if job.teacher_identity is not None:
            opd["teacher_identity"] = job.teacher_identity
            opd["teacher_identity_revision"] = teacher_identity_revision(job.teacher_identity)
        if loop.snapshots:
            opd["collapse_diagnostics"] = [receipt_snapshot(s) for s in loop.snapshots]
        out["opd"] = opd
        out["echo"] = echo_block(cfg.echo, loop.echo)
        items = len(job.prompts.items) if job.route == "prompts" else len(job.pre_scored.rows)
        out["data"] = data_block(
            examples_read=items,
            examples_trained=loop.global_step,
            completions_read=loop.consumed,
            completions_trained=loop.global_step,
        )
        out["token_counts"] = token_counts_block(action=loop.action_tokens, env=loop.env_tokens)
        return out


# ----------------------------------------------------------------------------- how the command line describes a run


def _optimizer_step(loop: OpdLoop) -> str:
    return f"optimizer step {loop.global_step + 1}"


def _headline(job: AdmittedOpd) -> str:
    cfg = job.config
    return (
        f"Distilling teacher '{job.teacher.alias}' into adapter '{job.adapter_name}': {len(job.candidates)} "
        f"candidates x {cfg.epochs} epoch(s), top-K {cfg.top_k}, seed {cfg.seed}"
    )


def _success(job: AdmittedOpd, result: TrainResult) -> list[str]:
    receipt = result.receipt
    opd = receipt["opd"]
    return [
        f"✓ {len(result.losses)} optimizer steps over {job.total_steps} candidates in "
        f"{receipt['runtime']['wall_clock_ms'] / 1000:.1f} s, reverse KL "
        f"{opd['initial_opd_loss']:.4f} -> {opd['final_opd_loss']:.4f}",
        *artifact_lines(result),
        f"Effective seed: {job.config.seed}",
    ]


TEXTS = RunTexts(unit="candidate", metric="kl", headline=_headline, success=_success)


# ----------------------------------------------------------------------------- the loop's committed state


@dataclass
class OpdLoop:
    """The OPD loop's committed state; ``as_document`` is ``opd_loop_state.json``."""

    items: int
    per_step: int = 1  # candidates an optimizer step consumes
    epoch_index: int = 0
    cursor: int = 0
    consumed: int = 0
    empty: int = 0
    losses: list[float] = field(default_factory=list)
    action_tokens: int = 0
    env_tokens: int = 0
    collapse: CollapseAccumulator = field(default_factory=CollapseAccumulator)
    snapshots: list[JsonObject] = field(default_factory=list)
    echo: EchoAccumulator = field(default_factory=EchoAccumulator)
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

    def as_document(self, job: AdmittedOpd) -> JsonObject:
        steps = {"candidates_per_step": self.per_step} if self.per_step > 1 else {}  # absent: 1, as before batches
        return {
            "schema_version": 1,
            "state_type": "kiln.opd-loop-state.v1",
            "global_step": self.global_step,
            "epoch_index": self.epoch_index,
            "cursor_in_epoch": self.cursor,
            "candidates_consumed": self.consumed,
            **steps,
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
            "phase_timings": phase_timings(job.source.tokenize_ms, self.timings),
        }

    @classmethod
    def restore(cls, items: int, state: JsonObject) -> OpdLoop:
        loop = cls(items=items, per_step=state.get("candidates_per_step", 1))
        loop.epoch_index, loop.cursor = state["epoch_index"], state["cursor_in_epoch"]
        loop.consumed, loop.empty = state["candidates_consumed"], state["empty_rollouts"]
        loop.losses = list(state["loss_history"])
        loop.action_tokens, loop.env_tokens = state["action_tokens"], state["env_tokens"]
        loop.collapse = CollapseAccumulator.from_state(
            state["collapse_guardrail"], nonempty_rollouts=state["candidates_consumed"] - state["empty_rollouts"]
        )
        loop.snapshots = list(state["collapse_snapshots"])
        loop.echo = EchoAccumulator.from_loop_state(state["echo_metrics"])
        return loop
