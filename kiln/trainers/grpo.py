"""GRPO trainer: LoRA policy updates from groups of completions the user scored.

Longer than 600 lines: one trainer read top to bottom -- its effective configuration, admission, the plan, the run
and its receipt -- over the shared components of the kit, the forwards and the objective.

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

Read top to bottom:

1. the effective configuration (``EffectiveGrpoConfig``, ``resolve_config``) and the request rules
   (``check_request``): every refusal of spec/40, naming the field;
2. admission (``admit_request``, ``admit_grpo``): target, model, pinned source, ingestion with action/observation
   masks, identity -- everything that can fail before training;
3. the plan (``filter_groups``, ``step_plan``, ``step_weights``, ``rank_shares``): which groups train, in which
   order, each step's shares and a rank's part of them, decided before training from the rewards alone, so a checkpoint can bind the trainable order;
   nothing left is ``zero_groups``, ECHO-only training without an observation token ``zero_env_tokens`` -- failures
   of the run (a failed receipt), never refusals at admission;
4. the run (``GrpoRun``): forwards, loss (``completion_loss``, ``share_loss``), steps, audits, checkpoints, and
   publication (adapter, receipt with the ``grpo`` block and policy audit, manifest); the dry run (``DryRun``):
   every check, no forward pass, a receipt without weights -- data it finds bad is its failed receipt;
5. the loop's committed state (``GrpoLoop``: ``grpo_loop_state.json``) and the receipt.

Checkpoints (spec/30): every ``checkpoint_interval`` committed groups (never after the
last group: the adapter is published instead) and on cancellation. A checkpoint binds the
trainable group order, the streamed-source cursor (byte offset, lines consumed and their
digest), the EMA reference tensors and cadence, the optimizer slots and the audit
accumulators; resuming continues with the next trainable group and ends with exactly the
bytes of an uninterrupted run.

Data parallelism (``kiln.grpo-step-completions.v1``, ``rank_shares``; ``docs/grpo.md``): over several ranks a step
is still what one process takes. Under ``token_level`` each group of the step is split into the ranks' contiguous
blocks of its completions, under ``per_sample`` the step's completions are dealt in turn; a rank computes the
reference log-probabilities and the forwards of its own completions only, weighted over the whole step, and one
collective per step sums the gradients. The audits of the step are gathered to every rank and added in completion
order, so every rank's accumulators are one process's; rank 0 publishes.

Deliberate simplifications: one pass over the groups in source order (``GrpoConfig`` has
no epochs); one forward per completion with dense logits unless ``micro_batch_size`` > 1 (the fused SFT route is
not used here yet); no ``reward_filter_groups.json`` sidecar. The loss is reduced by the objective's
``aggregate`` and ECHO's cross-entropy by its ``echo_loss`` (the components the objective tests pin).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kiln_contracts.models.kiln_control_plane_v1_schema import GrpoConfig, GrpoRequest

from kiln.artifacts.checkpoint_manifest import GRPO_SOURCE_KINDS
from kiln.checkpoints import PublishedCheckpoint
from kiln.data import OnlineLog
from kiln.documents.digests import json_sha256, raw_hex
from kiln.documents.jsonio import JsonObject
from kiln.errors import (
    DataSchemaError,
    RequestError,
    TrainingDataError,
    TrainingFailedError,
    ZeroActionTokensError,
    ZeroEnvTokensError,
    ZeroGroupsError,
)
from kiln.host.fs import atomic_write_bytes
from kiln.rollouts import RequestTemplate, Scorer, Task
from kiln.rollouts import Timings as RolloutTimings
from kiln.trainers._admission import (
    AdmittedJob,
    TrainingContext,
    base_model,
    planned_model,
    run_identity,
    with_targets,
)
from kiln.trainers._checkpointing import (
    CheckpointProgress,
    manifest_head,
    phase_timings,
    publish_state,
    restore_policy,
)
from kiln.trainers._forwards import (
    BatchedForwards,
    PrefixPlan,
    ReferencePolicy,
    invariant_decoder,
    logprobs,
    plan_sharing,
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
    publish_receipt_only,
)
from kiln.trainers._receipts import data_block, echo_block, envelope
from kiln.trainers._requests import Request, dataset_path_of, parse_request, refuse_gate
from kiln.trainers._resume import claim_target, load_resume, resume_metadata
from kiln.training import (
    GRPO_SHARDING_RULE,
    LORA_INIT_ALGORITHM,
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
)
from kiln.training import grpo_objective as obj
from kiln.training.echo import EchoAccumulator, echo_loss, step_echo_ce

if TYPE_CHECKING:
    import torch

    from kiln.data import GrpoCompletion, GrpoGroup, GrpoIngestion
    from kiln.model import LoadedModel
    from kiln.training import ModelHead

KIND = "grpo"
REFERENCE_FILE = "reference.safetensors"
ROLLOUT_LOG_FILE = "rollouts.jsonl"  # an online run's rollout log, in its checkpoints and beside its adapter
ROLLOUT_STREAM = "rollout-sampling"  # online: a counter stream, its position the task visits sampled
ROLLOUT_ALGORITHM = "kiln.counter-draws.splitmix64.v1"
ONLINE_SEED_SALT = 0x6F6E6C696E657267  # separates online GRPO's draws from OPD's and the server's for one seed
PROGRESS_AUX = ("source_byte_offset", "source_lines_consumed", "consumed_lines_sha256", "ema_groups_since_refresh")

__all__ = [
    "AdmittedGrpo",
    "DryRun",
    "EffectiveGrpoConfig",
    "GrpoLoop",
    "GrpoRun",
    "KlReference",
    "admit_grpo",
    "admit_request",
    "check_request",
    "resolve_config",
    "run_grpo",
]


# ----------------------------------------------------------------------------- the effective configuration


@dataclass(frozen=True)
class KlReference:
    """The KL reference: the frozen base (``base_per_step``), an EMA of the LoRA tensors, or ``none``."""

    kind: str
    decay: float | None = None  # ema only
    refresh_every: int | None = None  # ema only

    def to_json(self) -> JsonObject:
        if self.kind != "ema":
            return {"kind": self.kind}
        return {"kind": self.kind, "decay": self.decay, "refresh_every": self.refresh_every}


@dataclass(frozen=True, kw_only=True)
class EffectiveGrpoConfig(EffectiveConfig):
    """A GRPO run's configuration with every default resolved: what its checkpoints, receipt and replay record."""

    kl_coeff: float
    clip_epsilon: float
    clip_eps_high: float | None
    cispo_max_weight: float
    advantage_mode: str
    loss_aggregation: str
    kl_estimator: str
    dynamic_sampling: bool
    is_level: str
    behavior_policy: str
    kl_reference_policy: KlReference
    entropy_aware_kl_quantile: float | None
    reward_saturation_threshold: float
    reward_low_variance_threshold: float
    reward_filter_var_min: float | None
    reward_filter_var_max: float | None
    reward_filter_min_groups: int
    reward_filter_on_empty: str
    echo: Echo | None  # loss.echo
    no_policy_loss: bool  # loss.no_policy_loss
    prefix_sharing: str  # auto | off

    @property
    def kl_on(self) -> bool:
        return self.kl_coeff > 0 and self.kl_estimator != "none"

    def to_json(self) -> JsonObject:
        return {
            **self.common_json(),
            "kl_coeff": self.kl_coeff,
            "clip_epsilon": self.clip_epsilon,
            "clip_eps_high": self.clip_eps_high,
            "cispo_max_weight": self.cispo_max_weight,
            "advantage_mode": self.advantage_mode,
            "loss_aggregation": self.loss_aggregation,
            "kl_estimator": self.kl_estimator,
            "dynamic_sampling": self.dynamic_sampling,
            "is_level": self.is_level,
            "behavior_policy": self.behavior_policy,
            "kl_reference_policy": self.kl_reference_policy.to_json(),
            "entropy_aware_kl_quantile": self.entropy_aware_kl_quantile,
            "reward_saturation_threshold": self.reward_saturation_threshold,
            "reward_low_variance_threshold": self.reward_low_variance_threshold,
            "reward_filter_var_min": self.reward_filter_var_min,
            "reward_filter_var_max": self.reward_filter_var_max,
            "reward_filter_min_groups": self.reward_filter_min_groups,
            "reward_filter_on_empty": self.reward_filter_on_empty,
            "loss": {"echo": None if self.echo is None else self.echo.to_json(), "no_policy_loss": self.no_policy_loss},
            "prefix_sharing": self.prefix_sharing,
        }


RECEIPT_CONFIG = (  # the effective-config members the receipt's grpo block repeats
    "kl_coeff", "clip_epsilon", "clip_eps_high", "cispo_max_weight", "dynamic_sampling", "advantage_mode",
    "loss_aggregation", "kl_estimator", "is_level", "behavior_policy", "kl_reference_policy",
    "entropy_aware_kl_quantile",
)  # fmt: skip


def resolve_config(
    config: GrpoConfig,
    adapter_name: str,
    *,
    seed: int | None = None,
    checkpoint_interval: int | None = None,
    memory: MemorySettings | None = None,
) -> EffectiveGrpoConfig:
    """The effective configuration of a (schema-valid) ``GrpoConfig``; refuses, naming the field, what Kiln does not
    execute: ``kl_reference_policy`` with its alias ``reference_policy``, a KL term against reference ``none``,
    ``reward_filter_var_min`` above ``reward_filter_var_max``, ``loss.opd``, ``loss.no_policy_loss`` without an ECHO
    term of positive ``lambda``, shape conversion, the smoke test, anomaly detection, the LoRA scale guardrail.

    ``seed``: a resumed checkpoint's (authoritative); ``checkpoint_interval``: what a config without one gets."""
    if config.allow_adapter_shape_conversion:
        refuse(
            "allow_adapter_shape_conversion", "Kiln never converts adapter shapes", code="training_backend_unsupported"
        )
    for flag in ("adapter_smoke_test", "adapter_smoke_prompts", "detect_anomaly"):
        if getattr(config, flag):
            refuse(flag, "not available for GRPO in this Kiln", code="training_backend_unsupported")
    common = common_members(
        config,
        "GrpoConfig",
        adapter_name=adapter_name,
        seed=seed,
        checkpoint_interval=checkpoint_interval,
        memory=memory,
    )
    reference = _reference(config)
    estimator = config.kl_estimator.value
    if reference.kind == "none" and config.kl_coeff > 0 and estimator != "none":
        refuse(
            "kl_reference_policy",
            f"reference 'none' needs the KL term off, but kl_coeff is {config.kl_coeff:g} with estimator {estimator!r}",
            hint='set "kl_coeff": 0 or "kl_estimator": "none", or choose a reference (base_per_step, ema)',
        )
    var_min = None if config.reward_filter_var_min is None else config.reward_filter_var_min.root
    var_max = None if config.reward_filter_var_max is None else config.reward_filter_var_max.root
    if var_min is not None and var_max is not None and var_min > var_max:
        refuse("reward_filter_var_min", f"{var_min:g} is above reward_filter_var_max {var_max:g}")
    loss = config.loss
    if loss.opd is not None:
        refuse("loss.opd", "an OPD term inside GRPO is not executed by Kiln", code="training_backend_unsupported")
    echo = Echo.resolve(loss.echo)
    if loss.no_policy_loss and (echo is None or echo.lam <= 0):
        default_lambda = GrpoConfig().loss.echo
        refuse(
            "loss.no_policy_loss",
            "training with the policy loss off needs an ECHO term with lambda > 0",
            hint=f'add "loss": {{"echo": {{"lambda": {default_lambda.lambda_ if default_lambda else 0.05:g}}}}} or '
            "drop no_policy_loss",
        )
    quantile = config.entropy_aware_kl_quantile
    return EffectiveGrpoConfig(
        **common,
        kl_coeff=config.kl_coeff,
        clip_epsilon=config.clip_epsilon,
        clip_eps_high=None if config.clip_eps_high is None else config.clip_eps_high.root,
        cispo_max_weight=config.cispo_max_weight,
        advantage_mode=config.advantage_mode.value,
        loss_aggregation=config.loss_aggregation.value,
        kl_estimator=estimator,
        dynamic_sampling=config.dynamic_sampling,
        is_level=config.is_level.value,
        behavior_policy=config.behavior_policy.value,
        kl_reference_policy=reference,
        entropy_aware_kl_quantile=None if quantile is None else quantile.root,
        reward_saturation_threshold=config.reward_saturation_threshold,
        reward_low_variance_threshold=config.reward_low_variance_threshold,
        reward_filter_var_min=var_min,
        reward_filter_var_max=var_max,
        reward_filter_min_groups=config.reward_filter_min_groups,
        reward_filter_on_empty=config.reward_filter_on_empty.value,
        echo=echo,
        no_policy_loss=loss.no_policy_loss,
        prefix_sharing=config.prefix_sharing.value,
    )


def _reference(config: GrpoConfig) -> KlReference:
    """``kl_reference_policy`` (or its alias ``reference_policy``, never both) with the ``ema`` members' defaults."""
    given = config.model_fields_set
    if "kl_reference_policy" in given and "reference_policy" in given:
        refuse(
            "reference_policy",
            "send either kl_reference_policy or its alias reference_policy, not both",
            hint="keep kl_reference_policy",
        )
    chosen = config.kl_reference_policy
    if "kl_reference_policy" not in given and config.reference_policy is not None:
        chosen = config.reference_policy
    if chosen.kind == "ema":
        return KlReference("ema", decay=chosen.decay, refresh_every=chosen.refresh_every)
    return KlReference(chosen.kind)


def check_request(request: Request[GrpoRequest]) -> None:
    """The request-level refusals of spec/40 that need no data or model (the schema and what the request may read
    have been checked at the door: ``kiln.trainers.Trainer.check_door``)."""
    model = request.model
    refuse_gate(model.post_eval)
    sources = [key for key in ("groups", "agentic_groups") if key in model.model_fields_set]
    if len(sources) > 1:
        raise RequestError("send groups or its alias agentic_groups, not both", code="training_invalid_request")
    given = sources + [key for key in ("dataset_path", "online") if getattr(model, key) is not None]
    if len(given) > 1:
        raise RequestError(
            f"send one data source, not {' and '.join(given)}",
            code="training_invalid_request",
            hint="inline groups, a dataset_path, or online (tasks Kiln samples and scores)",
        )
    if not given:
        raise RequestError(
            "a GRPO request needs groups, a dataset_path or online tasks", code="training_invalid_request"
        )
    if model.dry_run and model.dataset_path is None:
        raise RequestError(
            "dry_run checks a streamed file: it needs dataset_path",
            code="training_invalid_request",
            hint="write the groups to a .jsonl file (one group per line) and send its absolute path",
        )


# ----------------------------------------------------------------------------- admission


@dataclass(frozen=True)
class OnlinePlan:
    """An online run's tasks, scorer and sampling (``GrpoRequest.online``), read and checked at admission."""

    tasks: tuple[Task, ...]
    scorer: Scorer
    template: RequestTemplate
    group_size: int
    passes: int
    tasks_path: str | None
    model_identity: JsonObject  # the base model's identity the rollouts' provenance records
    prompt_lengths: tuple[int, ...] = ()  # each task's prompt tokens
    # an audit's re-execution: the run's recorded groups, used instead of sampling and scoring (``rescore``: the
    # scorer runs again on the recorded completions and must give the recorded rewards)
    replay: tuple[JsonObject, ...] | None = None
    rescore: bool = False
    definition: JsonObject = field(default_factory=dict)  # the request's ``online`` as sent, inline tasks left out

    @property
    def visits(self) -> int:
        return len(self.tasks) * self.passes

    def identity(self) -> JsonObject:
        """What decides the run's rollouts besides the policy and the seed (the checkpoint's data identity)."""
        return {
            "algorithm": "kiln.online-grpo.v1",
            "tasks": [task.fields for task in self.tasks],
            "template_messages": list(self.template.messages),
            "sampling": self.template.as_json(),
            "scorer": self.scorer.identity,
            "group_size": self.group_size,
            "passes": self.passes,
        }


def rollout_seed(seed: int) -> int:
    """The first draw seed of an online run: completion j of task visit v draws with
    ``DrawKey(rollout_seed(seed) + j, v, position)``."""
    return (seed ^ ONLINE_SEED_SALT) % 2**64


@dataclass(kw_only=True)
class AdmittedGrpo(AdmittedJob[EffectiveGrpoConfig]):
    """An admitted GRPO job: the ingested groups, the pinned source and, for a dry run, its data's refusal."""

    kind: ClassVar[str] = KIND
    sharding: ClassVar[str] = GRPO_SHARDING_RULE
    ingestion: GrpoIngestion
    tokenize_ms: float
    pin: str | None = None
    refused: TrainingFailedError | None = None  # a dry run's data refusal, recorded by its failed receipt
    head: ModelHead | None = None  # proven at admission when micro-batches read the logits themselves
    sharing: PrefixPlan = field(default_factory=PrefixPlan)  # which forwards run a group's prompt once
    online: OnlinePlan | None = None  # online GRPO: the groups are sampled and scored as the run goes

    @property
    def total_steps(self) -> int:
        if self.online is not None:  # a step per gradient_accumulation_steps task visits (fewer when filtered)
            return math.ceil(self.online.visits / self.config.gradient_accumulation_steps)
        kept, _ = plan_groups(self)
        return len(step_plan(kept, self.config.loss_aggregation, self.config.gradient_accumulation_steps))

    @property
    def data_sha256(self) -> str:
        """What the run trains on: the source's digest (online: the digest of the online definition)."""
        return json_sha256(self.online.identity()) if self.online is not None else self.ingestion.source_sha256

    def identity_manifest(self) -> JsonObject:
        cfg = self.config
        ema = cfg.kl_reference_policy.kind == "ema"
        files = {"reference_state": REFERENCE_FILE} if ema else {}
        if self.online is not None:  # the data is the online definition; the rollouts so far are a state file
            content, count = self.data_sha256, self.online.visits
            order = json_sha256(list(range(self.online.visits)))
            files["rollout_log"] = ROLLOUT_LOG_FILE
        else:
            kept, _ = plan_groups(self)
            content, count, order = self.ingestion.source_sha256, len(kept), json_sha256([g.index for g in kept])
        return manifest_head(
            self,
            KIND,
            total_steps=self.total_steps,
            data={
                "source_kind": GRPO_SOURCE_KINDS[self.ingestion.route],
                "content_sha256": raw_hex(content),
                "item_count": count,
            },
            rng_states={
                "lora-init": {"algorithm": LORA_INIT_ALGORITHM, "seed": cfg.seed, "position": 0},
                **(
                    {ROLLOUT_STREAM: {"algorithm": ROLLOUT_ALGORITHM, "seed": rollout_seed(cfg.seed), "position": 0}}
                    if self.online is not None
                    else {}
                ),
            },
            extra_state_files=files or None,
            auxiliary={
                "route": self.ingestion.route,
                "trainable_order_sha256": order,
                "reference_policy": cfg.kl_reference_policy.kind,
            },
        )


def admit_request(request: Request[GrpoRequest], *, adapter_name: str, context: TrainingContext) -> AdmittedGrpo:
    """A ``GrpoRequest`` admitted in ``context`` (a dry run gets no default checkpoint interval); raises
    ``KilnError`` and publishes nothing."""
    from kiln.data import check_unchanged, dataset_sha256

    check_request(request)
    model = request.model
    config = model.config or GrpoConfig()
    registry = context.registry
    resume = None if config.resume_checkpoint is None else config.resume_checkpoint.root
    point = resume_metadata(registry, adapter_name, resume, None if config.seed is None else config.seed.root, KIND)
    cfg = resolve_config(
        config,
        adapter_name,
        seed=None if point is None else point.seed,
        checkpoint_interval=None if model.dry_run else context.checkpoint_interval,
        memory=context.memory,
    )
    if model.online is not None:
        cfg = _online_config(config, cfg, context, model.online.group_size)
    claim_target(registry, adapter_name, point)
    opened = base_model(context)  # tokenizer, config and weight headers: no weight is loaded before the plan
    path = dataset_path_of(model)
    pin = dataset_sha256(path) if path is not None else None
    start = time.perf_counter()
    online = _online_plan(request, opened, context) if model.online is not None else None
    if online is not None:
        ingestion, refused = _online_start(opened, cfg, online), None
    else:
        ingestion, refused = _ingest(request, opened, cfg, pin)
    tokenize_ms = (time.perf_counter() - start) * 1000
    if path is not None and pin is not None and refused is None:
        check_unchanged(path, pin, now=ingestion.source_sha256)  # the bytes read are those pinned
    completions = [c for group in ingestion.groups for c in group.completions]
    longest = max((len(c.input_ids) for c in completions), default=1)
    if online is not None:
        longest = max(online.prompt_lengths) + online.template.max_tokens + 2  # the template's closing tokens
    loaded, cfg, plan = planned_model(
        opened,
        cfg,
        context,
        tokens=longest,
        loss_logits=longest * cfg.micro_batch_size * opened.vocab_size,  # a micro-batch's selected positions, at most
        point=point,
        segments=None if config.grad_checkpoint_segments is None else config.grad_checkpoint_segments.root,
        check=not model.dry_run,
    )
    cfg = with_targets(cfg, loaded)
    job = AdmittedGrpo(
        adapter_name=adapter_name,
        registry=registry,
        config=cfg,
        loaded=loaded,
        run=run_identity(loaded, cfg.optimizer, context.data_parallel, cfg.precision),
        memory_plan=None if model.dry_run else plan,
        dry_run=bool(model.dry_run),
        ingestion=ingestion,
        tokenize_ms=tokenize_ms,
        refused=refused,
        pin=pin,
        head=model_head(loaded.model) if cfg.micro_batch_size > 1 else None,
        online=online,
    )
    if not job.dry_run:
        job.head, job.sharing = prefix_plan(cfg, loaded.model, job.head)
    _check_data(job)
    job.resume = load_resume(
        point,
        job.identity_manifest(),
        progress_auxiliary=PROGRESS_AUX,
        progress_streams=(ROLLOUT_STREAM,) if job.online is not None else (),
    )
    return job


def admit_grpo(
    *,
    adapter_name: str,
    registry: Path,
    request: JsonObject,
    model_path: str | None = None,
    loaded: LoadedModel | None = None,
    data_parallel: DataParallel | None = None,
) -> AdmittedGrpo:
    """``admit_request`` for a caller holding a ``GrpoRequest`` body as JSON (``data_parallel``: the one worker
    process it trains in, when not this one)."""
    context = TrainingContext(
        registry=registry, model_path=model_path, loaded=loaded, data_parallel=data_parallel or DataParallel()
    )
    return admit_request(parse_request(GrpoRequest, request), adapter_name=adapter_name, context=context)


# the failure a dry run records for training data refused at admission, by the refusal's reason
DRY_RUN_FAILURES: dict[str, type[TrainingFailedError]] = {
    "data_schema_error": DataSchemaError,
    "zero_action_tokens": ZeroActionTokensError,
    "zero_groups": ZeroGroupsError,
}


def _ingest(
    request: Request[GrpoRequest], loaded: LoadedModel, cfg: EffectiveGrpoConfig, pin: str | None
) -> tuple[GrpoIngestion, TrainingFailedError | None]:
    """``(ingestion, refusal)``: the request's groups read and tokenised (``kiln.data.read_groups``), and None. Data
    refused in a dry run gives an ingestion without groups (the pinned file's path and digest) and the failure the
    dry run's receipt records; any other run's refusal raises (nothing is written for a refused request)."""
    from kiln.data import read_groups, refused_ingestion

    model = request.model
    try:
        ingestion = read_groups(
            tokenizer=loaded.tokenizer,
            groups=request.rows("groups"),
            agentic_groups=request.rows("agentic_groups"),
            dataset_path=dataset_path_of(model),
            warning_filter=cfg.echo.warning_filter if cfg.echo else True,
            behavior_policy=cfg.behavior_policy,
        )
    except TrainingDataError as refused:
        path = dataset_path_of(model)
        if not model.dry_run or pin is None or path is None:
            raise
        return refused_ingestion(path, pin), DRY_RUN_FAILURES[refused.reason](refused.message)
    return ingestion, None


def _online_config(
    config: GrpoConfig, cfg: EffectiveGrpoConfig, context: TrainingContext, group_size: int
) -> EffectiveGrpoConfig:
    """An online run's configuration: ``token_level`` aggregation, one process, the behaviour policy ``recorded``
    (its default: the rollouts carry the sampler's log-probabilities) and, unless set, ``micro_batch_size`` the
    group size (one batched forward per group: the invariant forward gives every row its own bits however the rows
    are batched)."""
    if cfg.loss_aggregation != "token_level":
        refuse("loss_aggregation", "online GRPO trains each step's groups together: it needs token_level")
    if context.data_parallel.active:
        refuse(
            "online",
            "online GRPO samples on one process; it does not run over several ranks yet",
            code="training_backend_unsupported",
        )
    if "behavior_policy" not in config.model_fields_set:
        cfg = dataclasses.replace(cfg, behavior_policy="recorded")
    if "micro_batch_size" not in config.model_fields_set:  # a group's forwards batched: exact on the invariant forward
        cfg = dataclasses.replace(cfg, micro_batch_size=group_size)
    return cfg


def _online_plan(request: Request[GrpoRequest], opened: LoadedModel, context: TrainingContext) -> OnlinePlan:
    """The online definition read and checked: the tasks (inline or the tasks file), the sampling, the scorer (on
    a server only a builtin one: ``kiln.trainers._sources``), each task's prompt tokens."""
    from kiln.data.trajectory import TrajectoryTokenizer
    from kiln.rollouts import BehaviourPolicy, read_request_template, read_tasks, scorer_of, tasks_of

    online = request.model.online
    assert online is not None
    sent = request.sent.get("online") or {}
    template = read_request_template(sent.get("sampling"))
    tasks_path = None if online.tasks_path is None else str(getattr(online.tasks_path, "root", online.tasks_path))
    tasks = read_tasks(tasks_path, template) if tasks_path is not None else tasks_of(sent.get("tasks") or [], template)
    scorer = scorer_of(
        str(getattr(online.scorer, "root", online.scorer)),
        search=None if context.data_roots is not None else Path.cwd(),
    )
    tokens = TrajectoryTokenizer(opened.tokenizer, True)
    lengths = tuple(len(tokens.prefix(task.messages, [])[0]) for task in tasks)
    identity = BehaviourPolicy.model_identity(opened.path, opened.tokenizer, "")
    definition = online.model_dump(mode="json", exclude_unset=True, exclude={"tasks"})
    return OnlinePlan(
        tuple(tasks), scorer, template, online.group_size, online.passes, tasks_path, identity, lengths,
        definition=definition,
    )  # fmt: skip


def _online_start(opened: LoadedModel, cfg: EffectiveGrpoConfig, online: OnlinePlan) -> GrpoIngestion:
    """An online run's ingestion before any group is sampled (the rollout log empty)."""
    from kiln.data import online_ingestion

    warning_filter = cfg.echo.warning_filter if cfg.echo else True
    return online_ingestion([], tokenizer=opened.tokenizer, warning_filter=warning_filter, path=online.tasks_path)


def _check_data(job: AdmittedGrpo) -> None:
    """An admitted job within the run bounds: its optimizer steps and, per completion, the prompt + completion tokens
    against the model's context length (online: each task's prompt, with room for one token)."""
    per = "completions" if job.config.loss_aggregation == "per_sample" else "groups"
    if job.online is not None:
        check_run_bounds(
            total_steps=job.total_steps,
            steps_rule=f"one per {job.config.gradient_accumulation_steps} task visits",
            rows=((f"task {t.id!r}", n) for t, n in zip(job.online.tasks, job.online.prompt_lengths, strict=True)),
            context=context_length(job.loaded),
            margin=1,
        )
        return
    check_run_bounds(
        total_steps=job.total_steps,
        steps_rule=f"one per kept {per[:-1]}",
        rows=(
            (f"group {group.index + 1} completion {completion.index + 1}", len(completion.input_ids))
            for group in job.ingestion.groups
            for completion in group.completions
        ),
        context=context_length(job.loaded),
    )


def prefix_plan(cfg: EffectiveGrpoConfig, model: Any, head: ModelHead | None) -> tuple[ModelHead | None, PrefixPlan]:
    """``(head, plan)``: which forwards run a group's shared prompt once under ``prefix_sharing`` (``plan_sharing``):
    the policy forward needs ``token_level`` aggregation (one backward per group) and no activation checkpointing (a
    recomputed layer keeps no cache); the reference forward runs only with a KL term."""
    blockers = []
    if cfg.loss_aggregation != "token_level":
        blockers.append("per_sample aggregation steps after every completion, so its policy forwards cannot share")
    elif cfg.gradient_checkpointing == "on":
        blockers.append(
            "gradient_checkpointing recomputes each decoder layer without a key/value cache, so the policy forward "
            "runs every completion in full"
        )
    return plan_sharing(cfg.prefix_sharing, model, head, blockers=blockers, reference=cfg.kl_on)


def prefix_receipt(job: AdmittedGrpo, kept: list[GrpoGroup]) -> JsonObject:
    """The receipt's ``grpo.prefix_sharing``: the plan, and over the trainable groups the prompts that ran once."""
    plan = job.sharing
    lengths = [shared_length([c.input_ids for c in g.completions]) for g in kept] if plan.any else []
    shared = [n for n in lengths if n > 0]
    reason = plan.reason
    if len(shared) < len(lengths):
        missing = f"{len(lengths) - len(shared)} of {len(lengths)} groups have no prompt all their completions share"
        reason = missing if reason is None else f"{reason}; {missing}"
    return {
        "mode": job.config.prefix_sharing,
        "policy": plan.policy,
        "reference": plan.reference,
        "shared_groups": len(shared),
        "shared_prompt_tokens": sum(shared),
        "reason": reason,
    }


# ----------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class FilterCounts:
    """The groups the filters dropped: equal rewards (dynamic sampling), and the reward-variance filter."""

    dynamic: int = 0
    variance: int = 0


def filter_groups(job: AdmittedGrpo) -> tuple[list[GrpoGroup], FilterCounts]:
    """The groups that train, and the counts of those dropped (dynamic sampling, variance filter)."""
    cfg = job.config
    kept: list[GrpoGroup] = []
    dynamic = variance = 0
    for group in job.ingestion.groups:
        keep, reason = obj.keep_group(
            [c.reward for c in group.completions],
            dynamic_sampling=cfg.dynamic_sampling,
            var_min=cfg.reward_filter_var_min,
            var_max=cfg.reward_filter_var_max,
        )
        if keep:
            kept.append(group)
        elif reason == obj.DROP_EQUAL_REWARDS:
            dynamic += 1
        else:
            variance += 1
    counts = FilterCounts(dynamic, variance)
    filtering = cfg.reward_filter_var_min is not None or cfg.reward_filter_var_max is not None
    if filtering and len(kept) < cfg.reward_filter_min_groups:
        if cfg.reward_filter_on_empty == "fail":
            raise ZeroGroupsError(
                f"the reward-variance filter kept {len(kept)} group(s), fewer than reward_filter_min_groups "
                f"{cfg.reward_filter_min_groups}",
                _as_counts(counts),
            )
        if cfg.reward_filter_on_empty == "train-all":
            kept = [g for g in job.ingestion.groups if not (cfg.dynamic_sampling and equal_rewards(g))]
            counts = FilterCounts(dynamic, 0)
        else:  # skip: finish without an update
            kept = []
    elif not kept:
        raise ZeroGroupsError("every group was filtered out; nothing would train", _as_counts(counts))
    if cfg.no_policy_loss and not any(c.observation_tokens for g in kept for c in g.completions):
        raise ZeroEnvTokensError(
            "loss.no_policy_loss trains the ECHO term alone, but no group that would train has an observation "
            "token; nothing would train",
            _as_counts(counts),
        )
    return kept, counts


def _as_counts(counts: FilterCounts) -> dict[str, int]:
    """The counts a ``ZeroGroupsError``/``ZeroEnvTokensError`` carries to the failed receipt."""
    return {"dynamic": counts.dynamic, "variance": counts.variance}


def _from_counts(counts: dict[str, int] | None) -> FilterCounts | None:
    """The filter counts a zero-groups failure carries (None: it carries none, e.g. a file without a group)."""
    return FilterCounts(counts["dynamic"], counts["variance"]) if counts else None


def equal_rewards(group: GrpoGroup) -> bool:
    """Every completion of the group got the same reward (what dynamic sampling drops)."""
    rewards = [c.reward for c in group.completions]
    return max(rewards) == min(rewards)


def plan_groups(job: AdmittedGrpo) -> tuple[list[GrpoGroup], FilterCounts]:
    """The trainable groups in order (empty when the filters leave nothing) and the filter counts."""
    try:
        return filter_groups(job)
    except (ZeroGroupsError, ZeroEnvTokensError) as exc:
        return [], _from_counts(exc.counts) or FilterCounts()


Share = tuple[int, list[int]]  # (group number from 1, completion indices)


def step_plan(kept: list[GrpoGroup], aggregation: str, accumulation: int) -> list[list[Share]]:
    """The run's optimizer steps in order, each a list of shares ``(group number from 1, completion indices)``: one
    backward each, their gradients added up before the step.

    ``token_level``: ``accumulation`` consecutive groups, a share per group with all its completions (the last step
    takes what is left). ``per_sample``: ``accumulation`` consecutive completions of one group, a share per
    completion; a step never spans two groups, so every group ends on a step boundary."""
    if aggregation == "token_level":
        numbered = [(n, list(range(len(g.completions)))) for n, g in enumerate(kept, start=1)]
        return [numbered[i : i + accumulation] for i in range(0, len(numbered), accumulation)]
    return [
        [(n, [i]) for i in range(start, min(start + accumulation, len(g.completions)))]
        for n, g in enumerate(kept, start=1)
        for start in range(0, len(g.completions), accumulation)
    ]


def step_weights(kept: list[GrpoGroup], shares: list[Share], aggregation: str) -> list[tuple[float, float]]:
    """Per share of a step, ``(loss weight, ECHO weight)``: the factors that turn the share's own reduction (the
    token mean over its action tokens) and its ECHO term (λ times its observation-token mean) into its part of the
    step's loss -- the token mean over all the step's action tokens (``per_sample``: the mean of the per-completion
    means) plus λ times the mean cross-entropy over all its observation tokens. A step of one share has weights
    (1, 1): today's arithmetic exactly."""
    if len(shares) == 1:
        return [(1.0, 1.0)]

    def count(number: int, indices: list[int], mask: str) -> int:
        return sum(sum(bool(m) for m in getattr(kept[number - 1].completions[i], mask)) for i in indices)

    actions = [count(n, idx, "action_mask") for n, idx in shares]
    observed = [count(n, idx, "observation_mask") for n, idx in shares]
    total, total_obs = max(sum(actions), 1), max(sum(observed), 1)
    per_sample = aggregation == "per_sample"
    return [
        (1.0 / len(shares) if per_sample else a / total, o / total_obs) for a, o in zip(actions, observed, strict=True)
    ]


Dealt = tuple[list[int], tuple[float, float]]  # a rank's completions of a share, and their (loss, ECHO) weights


def rank_shares(kept: list[GrpoGroup], shares: list[Share], aggregation: str, group: DataParallel) -> list[Dealt]:
    """Per share of a step, in order: the completions the rank ``group`` trains of it and their weights -- the rule
    ``kiln.grpo-step-completions.v1`` (``kiln.training.GRPO_SHARDING_RULE``), under which the ranks' weighted parts
    add up to one process's step loss.

    One process trains every share whole, weighted by ``step_weights``. Over several ranks, ``token_level`` splits
    each share (a group) into the ranks' contiguous blocks of its completions (``DataParallel.block``: a rank's
    completions share their prompt) weighted by ``step_weights`` over all the ranks' blocks -- each block's action
    and observation tokens over the step's, so a group's blocks add up to its own weights; ``per_sample`` deals the
    step's shares (a completion each) to the ranks in turn, each with its own weights. A rank's part of a share may
    be empty (weights 0): it trains nothing of it."""
    if not group.active:
        return list(zip((indices for _, indices in shares), step_weights(kept, shares, aggregation), strict=True))
    if aggregation == "per_sample":
        weights = step_weights(kept, shares, aggregation)
        return [
            (indices if group.deals(j) else [], weight)
            for j, ((_, indices), weight) in enumerate(zip(shares, weights, strict=True))
        ]
    blocks = [[[indices[i] for i in rank.block(len(indices))] for rank in group.ranks()] for _, indices in shares]
    parts = [
        (number, block) for (number, _), per_rank in zip(shares, blocks, strict=True) for block in per_rank if block
    ]
    weighed = iter(step_weights(kept, parts, aggregation))
    dealt = [[(block, next(weighed)) if block else (block, (0.0, 0.0)) for block in per_rank] for per_rank in blocks]
    return [per_rank[group.rank] for per_rank in dealt]


# ----------------------------------------------------------------------------- the loss of a completion and a share


CompletionAudit = tuple[JsonObject, JsonObject | None]  # a completion's importance-sampling and KL audits
KeptAudit = tuple[int, int, JsonObject, JsonObject | None]  # group number, completion index, its audits


@dataclass
class Audits:
    """The run's audit accumulators: importance sampling, KL reference, ECHO.

    ``pending``: None for one process, which adds each completion's audits as it goes; a rank of a data-parallel
    group keeps its completions' ``[group number, completion index, importance, KL]`` of the step instead, for
    ``add_step`` to add every rank's in completion order -- the order one process adds them in."""

    importance: obj.ImportanceSamplingAccumulator = field(default_factory=obj.ImportanceSamplingAccumulator)
    kl: obj.KlReferenceAccumulator = field(default_factory=obj.KlReferenceAccumulator)
    echo: EchoAccumulator = field(default_factory=EchoAccumulator)
    pending: list[KeptAudit] | None = None

    def record(self, number: int, index: int, audit: CompletionAudit) -> None:
        """Completion ``index`` of group ``number``: its audits, added now or kept for the step's gather."""
        if self.pending is not None:
            self.pending.append((number, index, *audit))
            return
        self.add(audit)

    def add(self, audit: CompletionAudit) -> None:
        importance, kl = audit
        self.importance.add(importance)
        if kl is not None:
            self.kl.add(kl)

    def add_step(self, gathered: list[list[KeptAudit]]) -> None:
        """Every rank's kept audits of a step (``pending``, gathered: JSON arrays), added in completion order."""
        for _, _, importance, kl in sorted((a for rank in gathered for a in rank), key=lambda a: (a[0], a[1])):
            self.add((importance, kl))
        self.pending = []


Terms = tuple["torch.Tensor", "torch.Tensor", "torch.Tensor", "torch.Tensor"]
Keyed = tuple[tuple[int, int], tuple[float, int] | None]  # a share's (group number, first completion), its ECHO


def completion_loss(
    cfg: EffectiveGrpoConfig,
    c: GrpoCompletion,
    advantage: float,
    ref: torch.Tensor | None,
    taken: torch.Tensor,
    spread: torch.Tensor | None,
) -> tuple[Terms, CompletionAudit]:
    """One completion: its per-token policy(+KL) loss and action mask ``[1, T-1]``, and the log-probabilities of its
    taken tokens with their observation mask ``[T-1]`` (ECHO); and its audits. ``taken``/``spread``: the policy's
    log-probabilities of the taken tokens and its per-position entropy (None unless the KL is entropy-aware); ``ref``:
    the reference's."""
    import torch

    device = taken.device  # the policy's: every tensor of the loss is made where its log-probabilities are
    mask = torch.tensor(c.action_mask, dtype=torch.bool, device=device).unsqueeze(0)
    new = taken.unsqueeze(0)
    behavior = None
    if cfg.behavior_policy == "recorded":
        behavior = torch.zeros_like(new)
        behavior[mask] = torch.tensor(c.recorded_logprobs, dtype=new.dtype, device=device)
    per_token, is_audit = obj.policy_loss(
        new,
        behavior,
        torch.tensor([[advantage]], dtype=new.dtype, device=device),
        mask,
        is_level=cfg.is_level,
        clip_low=cfg.clip_epsilon,
        clip_high=cfg.clip_eps_high,
        cispo_max_weight=cfg.cispo_max_weight,
    )
    kl_audit: JsonObject | None = None
    if cfg.no_policy_loss:
        per_token = torch.zeros_like(per_token)
    if cfg.kl_on and ref is not None:
        entropy = None if spread is None else spread.detach().unsqueeze(0)
        kl, kl_audit = obj.kl_estimate(
            new,
            ref.unsqueeze(0),
            mask,
            cfg.kl_estimator,
            entropy=entropy,
            entropy_quantile=cfg.entropy_aware_kl_quantile,
        )
        per_token = per_token + cfg.kl_coeff * kl
    terms = (per_token, mask, taken, torch.tensor(c.observation_mask, dtype=torch.bool, device=device))
    return terms, (is_audit, kl_audit)


def share_loss(
    parts: list[Terms], weight: float, echo_weight: float, echo: Echo | None
) -> tuple[torch.Tensor, tuple[float, int] | None]:
    """A share's part of its step's loss (``step_weights``): the policy loss reduced over the parts' action tokens,
    plus ECHO's λ·CE over their observation tokens, each scaled by its weight; and ``(CE, observation tokens)``, None
    without ECHO or without an observation token."""
    import torch

    width = max(p.shape[-1] for p, _, _, _ in parts)
    per_token = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p, _, _, _ in parts])
    mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[-1])) for _, m, _, _ in parts])
    loss = obj.aggregate(per_token, mask, "token_level")
    if weight != 1.0:
        loss = loss * weight
    found = None
    if echo is not None:
        observation = torch.cat([o for _, _, _, o in parts])
        term, env_ce = echo_loss(torch.cat([t for _, _, t, _ in parts]), observation, echo.lam)
        if env_ce is not None:
            loss = loss + (term if echo_weight == 1.0 else term * echo_weight)
            found = (env_ce, int(observation.sum()))
    return loss, found


# ----------------------------------------------------------------------------- the run


def run_grpo(
    job: AdmittedGrpo,
    *,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    on_checkpoint: OnCheckpoint | None = None,
) -> TrainResult:
    """Train, then publish adapter, receipt and manifest (or a failed receipt); a dry run checks and writes its
    receipt only."""
    if job.dry_run:
        return guarded(DryRun(job))
    return guarded(GrpoRun(job, progress=progress, cancel=cancel, on_checkpoint=on_checkpoint))


class DryRun:
    """Every check of a real run without a forward or backward pass; a receipt without weights."""

    def __init__(self, job: AdmittedGrpo) -> None:
        self.job = job
        self.started = time.perf_counter()
        self.kept: list[GrpoGroup] = []
        self.counts = FilterCounts()

    @property
    def losses(self) -> list[float]:
        return []  # a dry run takes no step

    @property
    def checkpoints(self) -> list[Path]:
        return []

    def train(self) -> TrainResult:
        job = self.job
        check_pin(job.ingestion.path, job.pin)
        if job.refused is not None:
            raise job.refused
        self.kept, self.counts = filter_groups(job)
        return publish_receipt_only(job, receipt(job, self.started, self.kept, self.counts, None, dry_run=True))

    def failed_receipt(self, failure: tuple[str, str], exc: BaseException) -> JsonObject:
        if isinstance(exc, (ZeroGroupsError, ZeroEnvTokensError)):
            self.counts = _from_counts(exc.counts) or self.counts
        return receipt(self.job, self.started, self.kept, self.counts, None, failure=failure, dry_run=True)


class GrpoRun(RunProgress):
    """One run of an admitted GRPO job; ``train`` reads setup -> loop over the planned steps -> publication."""

    def __init__(
        self,
        job: AdmittedGrpo,
        *,
        progress: Progress | None,
        cancel: threading.Event | None,
        on_checkpoint: OnCheckpoint | None,
    ) -> None:
        self.job = job
        self.started = time.perf_counter()
        self.progress, self.cancel, self.on_checkpoint = progress, cancel, on_checkpoint
        self.audits = Audits()
        self.loop = GrpoLoop(job.ingestion.route)
        self.kept: list[GrpoGroup] = []
        self.counts = FilterCounts()
        self.delta_norms: list[JsonObject] = []
        self.cadence: Cadence | None = None
        self.group_refs: dict[int, list[tuple[GrpoCompletion, float, torch.Tensor | None]]] = {}
        self.online_log: OnlineLog | None = None  # online: every sampled group, in task-visit order
        self.rollout_timings = RolloutTimings()

    def train(self) -> TrainResult:
        job, cfg, loop = self.job, self.job.config, self.loop
        # setup: the plan, the policy, the reference, the restored state, the checkpoint cadence
        check_pin(job.ingestion.path, job.pin)
        if job.online is None:
            self.kept, self.counts = filter_groups(job)
        policy = Policy(job, restore=restore_policy)
        loop.timings = policy.timings
        reference = cfg.kl_reference_policy
        ema = (
            obj.EmaReference(policy.params, decay=reference.decay, refresh_every=reference.refresh_every)
            if reference.kind == "ema" and reference.decay is not None and reference.refresh_every is not None
            else None
        )
        reference_logp = ReferencePolicy(policy.model, policy.params, ema, policy.timings)
        if job.resume is not None:
            loop.restore(job.resume, ema, self.audits)
            if job.online is not None:
                self._restore_online(job.resume)
        group = job.data_parallel
        sync = StepSync(group, policy.params, self.cancel)  # a data-parallel group's one collective per step
        if group.active:
            self.audits.pending = []  # each step's audits are gathered from every rank
        self.cadence = cadence = Cadence(
            job, lambda: self._publish_checkpoint(policy, ema), sync.cancel, self.on_checkpoint, sync=sync
        )
        entropy_kl = cfg.kl_on and cfg.entropy_aware_kl_quantile is not None
        forwards = BatchedForwards(
            policy.model,
            job.head,
            reference_logp,
            cfg.micro_batch_size,
            echo=cfg.echo is not None,
            entropy=entropy_kl,
            sharing=job.sharing,
            decoder=invariant_decoder(policy.model) if sampled_by_invariant_forward(job) else None,
        )
        step = partial(self._step, policy, forwards, sync, ema, entropy_kl)
        if job.online is not None:
            self._online(policy, step)
        else:
            self._offline(step)
        # publication: every rank holds the same weights; rank 0 publishes adapter, receipt and manifest
        sync.check_same()
        self.delta_norms = lora_delta_norms(policy.model)
        if not self.kept:  # reward_filter_on_empty "skip", or an online run whose every group was filtered
            return publish_receipt_only(job, self.receipt(None), losses=list(loop.losses))
        return publish_adapter(
            job,
            policy.model,
            self.receipt,
            losses=list(loop.losses),
            checkpoints=cadence.published,
        )

    def _offline(self, step: Callable[[list[Share], list[Dealt], dict[int, list[int]]], bool]) -> None:
        """The planned steps over the given groups, each a backward per share (this rank's part of it) and one
        optimizer step, checkpoints at their cadence."""
        cfg, loop, kept, cadence = self.job.config, self.loop, self.kept, self.cadence
        assert cadence is not None
        plan = step_plan(kept, cfg.loss_aggregation, cfg.gradient_accumulation_steps)
        dealt = [rank_shares(kept, shares, cfg.loss_aggregation, self.job.data_parallel) for shares in plan]
        owned: dict[int, list[int]] = {}  # per group, the completions this rank trains (all of them: one process)
        for shares, parts_of_step in zip(plan, dealt, strict=True):
            for (number, _), (mine, _) in zip(shares, parts_of_step, strict=True):
                owned.setdefault(number, []).extend(mine)
        settled_at = loop.groups_committed
        for shares, parts_of_step in zip(plan, dealt, strict=True):
            if shares[-1][0] <= loop.groups_committed:
                continue  # resumed: committed before the checkpoint (checkpoints land on step boundaries)
            if not step(shares, parts_of_step, owned):
                continue  # per_sample, a step inside a group
            cadence.settled(
                len(loop.losses),
                last=loop.groups_committed >= len(kept),
                # every checkpoint_interval groups, published at the end of the step that reaches it
                due=any(cadence.due(n) for n in range(settled_at + 1, loop.groups_committed + 1)),
                cancelled=partial(_cancelled_after_group, loop.groups_committed, len(kept)),
            )
            settled_at = loop.groups_committed

    def _step(
        self,
        policy: Policy,
        forwards: BatchedForwards,
        sync: StepSync,
        ema: obj.EmaReference | None,
        entropy_kl: bool,
        shares: list[Share],
        parts_of_step: list[Dealt],
        owned: dict[int, list[int]],
    ) -> bool:
        """One optimizer step over ``shares`` (this rank's ``parts_of_step``); False for a ``per_sample`` step
        inside a group (its group goes on in the next step)."""
        cfg, loop, kept = self.job.config, self.loop, self.kept
        values: list[float] = []
        found: list[Keyed] = []
        value: float | None = None
        for (number, indices), (mine, weights) in zip(shares, parts_of_step, strict=True):
            terms = self._group_terms(number, forwards, owned[number])
            if mine:
                parts = self._parts(policy, forwards, number, mine, entropy_kl)
                loss, share_found = share_loss(parts, *weights, cfg.echo)
                values.append(policy.accumulate(loss, lambda: f"optimizer step {len(loop.losses) + 1}"))
                found.append(((number, mine[0]), share_found))
            if indices[-1] + 1 < len(terms):
                continue  # per_sample: the group goes on in the next step
            if number == shares[-1][0]:
                value = self._commit(policy, sync, values, found)
            if ema is not None:
                ema.update(policy.params, number)
            loop.groups_committed = number
            loop.completions += len(terms)
            if self.progress:
                total = len(kept) if self.job.online is None else self.job.online.visits
                done = number if self.job.online is None else loop.visits
                event: JsonObject = {
                    "step": done,
                    "total": total,
                    "loss": value,
                    "tokens": kept[number - 1].prompt_tokens,
                }
                if self.job.online is not None:
                    rewards = [c.reward for c in kept[number - 1].completions]
                    event["reward"] = sum(rewards) / len(rewards)
                self.progress(event)
        if value is None:  # per_sample, a step inside a group
            self._commit(policy, sync, values, found)
            return False
        return True

    # -- online GRPO: each step's groups sampled from the policy, scored, then trained

    def _online(self, policy: Policy, step: Callable[[list[Share], list[Dealt], dict[int, list[int]]], bool]) -> None:
        """Every step: the next ``gradient_accumulation_steps`` task visits sampled from the policy as it is now
        (``kiln.rollouts.sample_groups``; visit v draws with ``DrawKey(rollout_seed(seed) + j, v, position)`` for
        completion j), scored, appended to the rollout log, filtered like any group, then trained as one step with
        their recorded log-probabilities. A checkpoint binds the log; resuming re-reads it and goes on."""
        from kiln.rollouts import BehaviourPolicy, sample_groups

        job, cfg, loop, online = self.job, self.job.config, self.loop, self.job.online
        cadence = self.cadence
        assert online is not None
        assert cadence is not None
        tokenizer = job.loaded.tokenizer
        behaviour = BehaviourPolicy.of(
            policy.model,
            tokenizer,
            {**online.model_identity, "precision": cfg.precision, "adapter": f"{job.adapter_name} (this run's policy)"},
        )
        seeds = [(rollout_seed(cfg.seed) + j) % 2**64 for j in range(online.group_size)]
        width = cfg.gradient_accumulation_steps
        log = self._log()
        while loop.visits < online.visits:
            visits = list(range(loop.visits, min(loop.visits + width, online.visits)))
            tasks = [online.tasks[v % len(online.tasks)] for v in visits]
            if online.replay is not None:
                added = log.extend(_replayed(online, visits, tasks))
            else:
                sampled = sample_groups(
                    behaviour, tasks, seeds, online.template, online.scorer, timings=self.rollout_timings,
                    sequence_of=visits,
                )  # fmt: skip
                added = log.extend([g.value for g in sampled])
            numbers = [len(self.kept) for group in added if self._settle(group)]
            loop.visits = visits[-1] + 1
            if numbers:
                shares = [(n, list(range(len(self.kept[n - 1].completions)))) for n in numbers]
                dealt = rank_shares(self.kept, shares, cfg.loss_aggregation, job.data_parallel)
                step(shares, dealt, dict(shares))
            elif self.progress:
                self.progress({"step": loop.visits, "total": online.visits, "loss": None, "tokens": 0})
            cadence.settled(
                len(loop.losses),
                last=loop.visits >= online.visits,
                due=numbers != [] and any(cadence.due(n) for n in numbers),
                cancelled=partial(_cancelled_after_visit, loop.visits, online.visits),
            )
        job.ingestion = log.ingestion()
        if not self.kept:
            raise ZeroGroupsError(
                f"every one of the {online.visits} sampled groups was filtered out (equal or too spread rewards); "
                "nothing trained",
                _as_counts(self.counts),
            )

    def _restore_online(self, resume: Any) -> None:
        """The rollout log of the checkpoint resumed from, checked against its cursor, read back, and the kept
        groups and filter counts it implies."""
        job = self.job
        manifest = resume.manifest
        blob = resume.blobs[manifest["state_files"]["rollout_log"]]
        lines = blob.splitlines(keepends=True)
        aux = manifest["auxiliary_state"]
        log = self._log()
        log.extend([json.loads(line) for line in lines])
        position = log.positions[-1] if log.positions else None
        found = (len(blob), len(lines), position.consumed_lines_sha256 if position else json_sha256([]))
        wanted = (aux["source_byte_offset"], aux["source_lines_consumed"], aux["consumed_lines_sha256"])
        if found != wanted or log.data() != blob:
            raise TrainingFailedError(
                f"the checkpoint's rollout log ({found[0]} bytes, {found[1]} lines, {found[2]}) is not the one its "
                f"cursor records ({wanted[0]} bytes, {wanted[1]} lines, {wanted[2]})"
            )
        if len(lines) != manifest["progress"]["cursor_in_epoch"]:
            raise TrainingFailedError(
                f"the checkpoint's rollout log holds {len(lines)} task visits but its cursor is at "
                f"{manifest['progress']['cursor_in_epoch']}"
            )
        job.ingestion = log.ingestion()
        self.loop.visits = len(lines)
        for group in log.groups:
            self._settle(group)
        self.loop.groups_committed = len(self.kept)

    def _settle(self, group: GrpoGroup) -> bool:
        """An online group through the reward filters: kept (True) or counted as dropped."""
        cfg = self.job.config
        keep, reason = obj.keep_group(
            [c.reward for c in group.completions],
            dynamic_sampling=cfg.dynamic_sampling,
            var_min=cfg.reward_filter_var_min,
            var_max=cfg.reward_filter_var_max,
        )
        if keep:
            self.kept.append(group)
        else:
            dynamic = reason == obj.DROP_EQUAL_REWARDS
            self.counts = FilterCounts(self.counts.dynamic + dynamic, self.counts.variance + (not dynamic))
        return keep

    def _log(self) -> OnlineLog:
        """The online run's rollout log (made on first use)."""
        if self.online_log is None:
            job = self.job
            self.online_log = OnlineLog(
                tokenizer=job.loaded.tokenizer,
                warning_filter=job.config.echo.warning_filter if job.config.echo else True,
                path=job.online.tasks_path if job.online is not None else None,
            )
        return self.online_log

    def _sync_online(self) -> None:
        """An online run's ingestion brought up to its log (checkpoints and receipts read it)."""
        if self.job.online is not None:
            self.job.ingestion = self._log().ingestion()

    def _group_terms(
        self, number: int, forwards: BatchedForwards, owned: list[int]
    ) -> list[tuple[GrpoCompletion, float, torch.Tensor | None]]:
        """The completions of group ``number`` with their advantages (from every reward of the group) and the
        reference log-probabilities of the ``owned`` ones (this rank's; None for the others), computed once when the
        group starts (an EMA reference is swapped into the LoRA tensors, which must not happen between a policy
        forward and its backward)."""
        import torch

        if number not in self.group_refs:
            self.group_refs.clear()
            completions = self.kept[number - 1].completions
            rewards = torch.tensor([c.reward for c in completions], dtype=torch.float64)
            adv = obj.advantages(rewards, self.job.config.advantage_mode).tolist()
            refs: list[torch.Tensor | None] = [None] * len(completions)
            if self.job.config.kl_on and owned:
                for i, ref in zip(owned, forwards.references([completions[i] for i in owned]), strict=True):
                    refs[i] = ref
            self.group_refs[number] = [(c, adv[i], refs[i]) for i, c in enumerate(completions)]
        return self.group_refs[number]

    def _parts(
        self, policy: Policy, forwards: BatchedForwards, number: int, mine: list[int], entropy_kl: bool
    ) -> list[Terms]:
        """The loss terms of completions ``mine`` of group ``number`` (``token_level``: a batched forward of them
        when configured; ``per_sample``: one completion, its own forward)."""
        terms = self.group_refs[number]
        if self.job.config.loss_aggregation == "token_level" or forwards.decoder is not None:
            completions = self.kept[number - 1].completions
            batched = forwards.policy([completions[i] for i in mine], self.loop.timings)
            return [self._completion(policy, number, *terms[i], batched[j], entropy_kl) for j, i in enumerate(mine)]
        return [self._completion(policy, number, *terms[i], None, entropy_kl) for i in mine]

    def _completion(
        self,
        policy: Policy,
        number: int,
        c: GrpoCompletion,
        advantage: float,
        ref: torch.Tensor | None,
        found: tuple[torch.Tensor, torch.Tensor | None] | None,
        entropy_kl: bool,
    ) -> Terms:
        """One completion (of group ``number``): its loss terms (``completion_loss``), its audits recorded;
        ``found``: its ``(taken, entropy)`` from a batched forward; None runs its own forward."""
        import torch

        if found is None:
            t0 = time.perf_counter()
            logp_all, taken = logprobs(policy.model, torch.tensor(c.input_ids, dtype=torch.long))
            self.loop.timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
            with torch.no_grad():
                found = (taken, -(logp_all.exp() * logp_all).sum(-1) if entropy_kl else None)
        terms, audit = completion_loss(self.job.config, c, advantage, ref, *found)
        self.audits.record(number, c.index, audit)
        return terms

    def _commit(self, policy: Policy, sync: StepSync, values: list[float], found: list[Keyed]) -> float:
        """The optimizer step of the accumulated shares; its loss and ECHO cross-entropy are recorded. Over several
        ranks the gradients and loss shares are summed first (``StepSync.reduce``), and every rank's audits and
        ECHO cross-entropies of the step gathered and added in completion order."""
        local = sum(values[1:], values[0]) if values else 0.0  # a rank may have no part of a step
        value = sync.reduce(local, lambda: f"optimizer step {len(self.loop.losses) + 1}")
        crosses: list[tuple[float, int] | None] = [share for _, share in found]
        if sync.group.active:
            sent = {"audits": self.audits.pending, "echo": [[*key, *share] for key, share in found if share]}
            gathered = sync.gather(sent)
            self.audits.add_step([rank["audits"] for rank in gathered])
            echoes = sorted((e for rank in gathered for e in rank["echo"]), key=lambda e: (e[0], e[1]))
            crosses = [(ce, tokens) for _, _, ce, tokens in echoes]
        policy.apply()
        self.audits.echo.add(step_echo_ce(crosses))
        self.loop.losses.append(value)
        return value

    def _publish_checkpoint(self, policy: Policy, ema: obj.EmaReference | None) -> PublishedCheckpoint:
        self._sync_online()
        job, loop, kept = self.job, self.loop, self.kept

        def stamp(manifest: JsonObject, loop_doc: JsonObject) -> CheckpointProgress:
            consumed = loop.consumed(kept)
            manifest["auxiliary_state"].update(grpo_cursor(job.ingestion, consumed, ema, loop.groups_committed))
            if job.online is not None:  # the cursor counts task visits, the order is the visits' own
                manifest["rng_states"][ROLLOUT_STREAM]["position"] = loop.visits
                order = list(range(job.online.visits))
                return CheckpointProgress(loop_doc["global_step"], job.total_steps, 0, loop.visits, order)
            return CheckpointProgress(
                loop_doc["global_step"], job.total_steps, 0, loop.groups_committed, list(range(len(kept)))
            )

        def reference() -> dict[str, tuple[str, dict[str, torch.Tensor]]]:
            return {REFERENCE_FILE: ("reference-state", ema.state_dict())} if ema is not None else {}

        def rollout_log() -> dict[str, tuple[str, bytes]]:
            if job.online is None:
                return {}
            return {ROLLOUT_LOG_FILE: ("rollout-log", self._log().data())}

        return publish_state(
            job,
            KIND,
            policy.params,
            policy.optimizer,
            loop_document=lambda: loop.as_document(job, kept, ema, self.audits),
            stamp=stamp,
            extra_tensors=reference,
            extra_files=rollout_log,
        )

    def failed_receipt(self, failure: tuple[str, str], exc: BaseException) -> JsonObject:
        if isinstance(exc, (ZeroGroupsError, ZeroEnvTokensError)):
            self.counts = _from_counts(exc.counts) or self.counts
        self._sync_online()
        out = receipt(
            self.job, self.started, self.kept, self.counts, self.audits, failure=failure, timings=self.loop.timings,
            delta_norms=self.delta_norms,
        )  # fmt: skip
        return self._online_receipt(out, None)

    def receipt(self, adapter_dir: Path | None) -> JsonObject:
        self._sync_online()
        out = receipt(
            self.job, self.started, self.kept, self.counts, self.audits, adapter_dir=adapter_dir,
            timings=self.loop.timings, delta_norms=self.delta_norms,
        )  # fmt: skip
        return self._online_receipt(out, adapter_dir)

    def _online_receipt(self, out: JsonObject, adapter_dir: Path | None) -> JsonObject:
        """An online run's receipt: its ``grpo.online`` block, and its rollout log written into the staged adapter
        directory (published with the adapter)."""
        if self.job.online is not None:
            log = self._log().data()
            if adapter_dir is not None:  # the staged adapter directory: the log is published with the adapter
                atomic_write_bytes(adapter_dir / ROLLOUT_LOG_FILE, log)
            wall_ms = (time.perf_counter() - self.started) * 1000
            out["grpo"]["online"] = online_block(
                self.job, self._log().values, log, self.rollout_timings, self.audits, wall_ms
            )
        return out


def _cancelled_after_group(group: int, groups: int, checkpoint: str) -> str:
    return f"cancelled after group {group} of {groups}; resume from {checkpoint}"


def _replayed(online: OnlinePlan, visits: list[int], tasks: list[Task]) -> list[JsonObject]:
    """The recorded groups of ``visits`` (an audit's re-execution), each checked to be its task's; with
    ``rescore`` the scorer scores the recorded completions again and must give the recorded rewards."""
    from kiln.rollouts import ScoreRequest

    assert online.replay is not None
    if visits[-1] >= len(online.replay):
        raise TrainingFailedError(
            f"the recorded rollout log holds {len(online.replay)} task visits; the run needs {visits[-1] + 1}"
        )
    out = []
    for v, task in zip(visits, tasks, strict=True):
        value = online.replay[v]
        if value.get("task_id") != task.id or value.get("messages") != task.messages:
            raise TrainingFailedError(f"recorded task visit {v + 1} is not task {task.id!r}'s group")
        if online.rescore:
            completions = value["completions"]
            requests = [ScoreRequest(task.fields, task.id, task.messages, c["text"]) for c in completions]
            for j, (c, scored) in enumerate(zip(completions, online.scorer.score(requests), strict=True)):
                if scored.reward != c["reward"]:
                    raise TrainingFailedError(
                        f"rescore: {online.scorer.name} gives {scored.reward!r} for completion {j + 1} of task visit "
                        f"{v + 1} (task {task.id!r}); the run recorded {c['reward']!r}"
                    )
        out.append(value)
    return out


def _cancelled_after_visit(visit: int, visits: int, checkpoint: str) -> str:
    return f"cancelled after task visit {visit} of {visits}; resume from {checkpoint}"


# ----------------------------------------------------------------------------- how the command line describes a run


def _headline(job: AdmittedGrpo) -> str:
    online = job.online
    if online is not None:
        return (
            f"Training GRPO adapter '{job.adapter_name}' online: {len(online.tasks)} tasks x {online.passes} "
            f"pass(es), {online.group_size} completions per task visit, scorer {online.scorer.name}, "
            f"seed {job.config.seed}"
        )
    groups = job.ingestion.groups
    completions = sum(len(g.completions) for g in groups)
    return (
        f"Training GRPO adapter '{job.adapter_name}' on {len(groups)} groups ({completions} completions), "
        f"seed {job.config.seed}"
    )


def _success(job: AdmittedGrpo, result: TrainResult) -> list[str]:
    data = result.receipt["data"]
    if job.dry_run:
        return [
            f"✓ dry run passed: {data['groups_read']} groups, {data['completions_read']} completions; "
            f"{data['groups_read'] - data['groups_filtered']} would train (no forward pass ran)",
            f"Receipt: {result.receipt_path}",
        ]
    seconds = result.receipt["runtime"]["wall_clock_ms"] / 1000
    losses = f", loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}" if result.losses else ""
    online = result.receipt["grpo"].get("online")
    if online is not None:  # the reward of the first and the last tenth of the steps
        steps = online["steps"]
        tenth = max(len(steps) // 10, 1)
        first, last = (sum(s["reward_mean"] for s in part) / len(part) for part in (steps[:tenth], steps[-tenth:]))
        gap = online["max_behavior_logprob_gap"]
        losses += f", mean reward {first:.3f} -> {last:.3f} (first and last {tenth} step(s))"
        losses += "" if gap is None else f", behaviour/trainer gap {gap:g}"
    return [
        f"✓ trained {data['groups_trained']} groups in {seconds:.1f} s{losses}",
        *artifact_lines(result),
        f"Effective seed: {job.config.seed}",
    ]


def _summary(job: AdmittedGrpo, result: TrainResult) -> JsonObject:
    return {"dry_run": job.dry_run, "groups_trained": result.receipt["data"]["groups_trained"]}


TEXTS = RunTexts(unit="group", metric="loss", headline=_headline, success=_success, summary=_summary)


# ----------------------------------------------------------------------------- the loop's committed state


def grpo_token_counts(groups: list[GrpoGroup]) -> dict[str, int]:
    """``token_counts`` of the completions of ``groups``."""
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


def grpo_cursor(
    ingestion: GrpoIngestion, consumed: int, ema: obj.EmaReference | None, committed: int, *, loop: bool = False
) -> JsonObject:
    """The progress-dependent members shared by the GRPO loop state and ``auxiliary_state``: the streamed source's
    byte offset, lines consumed (and, in the manifest, their digest) and the EMA reference's cadence."""
    out: JsonObject = {}
    if ingestion.route in ("jsonl", "online"):
        position = ingestion.positions[consumed - 1] if consumed else None
        out["source_byte_offset"] = position.source_byte_offset if position else 0
        out["source_lines_consumed"] = position.source_lines_consumed if position else 0
        if not loop:
            out["consumed_lines_sha256"] = position.consumed_lines_sha256 if position else json_sha256([])
    if ema is not None:
        out["ema_groups_since_refresh"] = ema.groups_since_refresh(committed)
    return out


@dataclass
class GrpoLoop:
    """The GRPO loop's committed state; ``as_document`` is ``grpo_loop_state.json``."""

    route: str
    timings: dict[str, float] = field(default_factory=dict)
    groups_committed: int = 0  # trainable groups done (the cursor into the trainable order)
    losses: list[float] = field(default_factory=list)
    completions: int = 0
    visits: int = 0  # online: task visits sampled, scored and settled (the rollout log's lines)

    def consumed(self, kept: list[GrpoGroup]) -> int:
        """Groups of the source read so far (the trainable ones done and those filtered before them; online: every
        group of the rollout log)."""
        if self.route == "online":
            return self.visits
        return kept[self.groups_committed - 1].index + 1 if self.groups_committed else 0

    def as_document(
        self, job: AdmittedGrpo, kept: list[GrpoGroup], ema: obj.EmaReference | None, audits: Audits
    ) -> JsonObject:
        groups = job.ingestion.groups
        consumed = self.consumed(kept)
        done = kept[: self.groups_committed]
        filtered = consumed - self.groups_committed
        dynamic = (
            sum(1 for g in groups[:consumed] if g not in done and equal_rewards(g))
            if job.config.dynamic_sampling
            else 0
        )
        doc: JsonObject = {
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
            "token_counts": grpo_token_counts(done),
            "dynamic_groups_filtered": min(dynamic, filtered),
            "echo_metrics": audits.echo.loop_state(),
            "lora_grad_norms": [],
            "policy_audit": {
                "importance_sampling": audits.importance.loop_state(),
                "kl_reference": audits.kl.loop_state(),
                "recorded_provenance": {
                    "completion_count": 0,
                    "sampled_action_tokens": 0,
                    "forced_action_tokens": 0,
                    "behavior_sources": [],
                },
            },
            "phase_timings": phase_timings(job.tokenize_ms, self.timings),
            "writer_timings": {"gpu_writer_wait_ms": 0.0, "gpu_writer_held_ms": 0.0, "gpu_writer_acquisitions": 0},
        }
        doc.update(grpo_cursor(job.ingestion, consumed, ema, self.groups_committed, loop=True))
        return doc

    def restore(self, resume: Any, ema: obj.EmaReference | None, audits: Audits) -> None:
        """The committed state, audits and EMA reference of the checkpoint a run resumes from."""
        from safetensors.torch import load as load_tensors

        manifest, state = resume.manifest, resume.loop_state
        if ema is not None:
            ema.load_state_dict(load_tensors(resume.blobs[manifest["state_files"]["reference_state"]]))
        self.losses.extend(state["loss_history"])
        self.completions = state["processed_completions"]
        self.groups_committed = manifest["progress"]["cursor_in_epoch"]
        audit = state["policy_audit"]
        audits.importance = obj.ImportanceSamplingAccumulator.from_loop_state(audit["importance_sampling"])
        audits.kl = obj.KlReferenceAccumulator.from_loop_state(audit["kl_reference"])
        audits.echo = EchoAccumulator.from_loop_state(state["echo_metrics"])


# ----------------------------------------------------------------------------- the receipt

INVARIANT_BACKEND = "kiln.invariant-forward"  # kiln.model.generation_backend of a model with the invariant forward
BEHAVIOR_SOURCE_MEMBERS = ("behavior_policy", "tokenizer", "template_invocation", "sampling", "generation_backend")


def online_block(
    job: AdmittedGrpo, values: list[JsonObject], log: bytes, timings: RolloutTimings, audits: Audits, wall_ms: float
) -> JsonObject:
    """The receipt's ``grpo.online``: the run's definition, each step's rewards (from the rollout log), where the
    time went and the behaviour/trainer gap (from the importance ratios, each taken at its step's start)."""
    import hashlib

    from kiln.documents.digests import prefixed

    online, cfg = job.online, job.config
    assert online is not None
    width = cfg.gradient_accumulation_steps
    steps: list[JsonObject] = []
    for number, start in enumerate(range(0, len(values), width), start=1):
        groups = values[start : start + width]
        rewards = [float(c["reward"]) for g in groups for c in g["completions"]]
        mean = sum(rewards) / len(rewards)
        trained = sum(
            1
            for g in groups
            if obj.keep_group(
                [float(c["reward"]) for c in g["completions"]],
                dynamic_sampling=cfg.dynamic_sampling,
                var_min=cfg.reward_filter_var_min,
                var_max=cfg.reward_filter_var_max,
            )[0]
        )
        steps.append(
            {
                "step": number,
                "task_visits": len(groups),
                "groups_trained": trained,
                "reward_mean": mean,
                "reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
                "reward_min": min(rewards),
                "reward_max": max(rewards),
            }
        )
    ratios = [r for r in (audits.importance.min_ratio, audits.importance.max_ratio) if r is not None]
    first = values[0]["completions"][0].get("provenance", {}) if values else {}
    return {
        "definition": online.definition,
        "tasks": len(online.tasks),
        "passes": online.passes,
        "group_size": online.group_size,
        "task_visits": len(values),
        "scorer": online.scorer.identity,
        "sampling": online.template.as_json(),
        "generation_backend": str(first.get("generation_backend") or "none sampled"),
        "rollout_log_sha256": prefixed(hashlib.sha256(log).hexdigest()),
        "steps": steps,
        "generation_ms": round(timings.generation_ms, 3),
        "scoring_ms": round(timings.scoring_ms, 3),
        "training_ms": round(max(wall_ms - timings.generation_ms - timings.scoring_ms, 0.0), 3),
        "max_behavior_logprob_gap": max(abs(math.log(r)) for r in ratios) if ratios else None,
    }


def sampled_by_invariant_forward(job: AdmittedGrpo) -> bool:
    """Whether the run trains rollouts Kiln's generator sampled with the invariant forward, against their recorded
    log-probabilities: then the run's forwards are the invariant forward too, and a step's ratios start at 1."""
    if job.online is not None:
        return job.config.behavior_policy == "recorded"  # its groups are sampled by the run's own decoder
    completions = [c for g in job.ingestion.groups for c in g.completions]
    return (
        job.config.behavior_policy == "recorded"
        and bool(completions)
        and all(
            isinstance(c.provenance, dict)
            and str(c.provenance.get("generation_backend", "")).startswith(INVARIANT_BACKEND)
            for c in completions
        )
    )


def recorded_provenance(kept: list[GrpoGroup]) -> JsonObject:
    """The policy audit's ``recorded_provenance``: the trained completions whose provenance lists action tokens,
    their sampled and forced tokens, and each distinct behaviour source (``kiln.grpo-behavior-source.v1``: the
    digest of its five identity members)."""
    sources: dict[str, JsonObject] = {}
    totals = {"completion_count": 0, "sampled_action_tokens": 0, "forced_action_tokens": 0}
    for group in kept:
        for c in group.completions:
            record = c.provenance
            tokens = record.get("action_tokens") if isinstance(record, dict) else None
            if not isinstance(record, dict) or not isinstance(tokens, list):
                continue
            forced = sum(1 for t in tokens if isinstance(t, dict) and t.get("forced") is True)
            identity: JsonObject = {
                key: record.get(key) if isinstance(record.get(key), dict) else {} for key in BEHAVIOR_SOURCE_MEMBERS[:4]
            }
            identity["generation_backend"] = str(record.get("generation_backend") or "unknown")
            digest = json_sha256({"algorithm": "kiln.grpo-behavior-source.v1", **identity})
            source = sources.setdefault(
                digest,
                {"behavior_source_sha256": digest, "completion_count": 0, "sampled_action_tokens": 0,
                 "forced_action_tokens": 0, **identity},
            )  # fmt: skip
            for block in (source, totals):
                block["completion_count"] += 1
                block["sampled_action_tokens"] += len(tokens) - forced
                block["forced_action_tokens"] += forced
    out: JsonObject = {**totals, "unique_behavior_sources": len(sources)}
    if sources:
        listed = [sources[d] for d in sorted(sources)]
        out["behavior_source_manifest_sha256"] = json_sha256(
            {"algorithm": "kiln.grpo-behavior-source-manifest.v1", "sources": sorted(sources)}
        )
        out["behavior_sources"] = listed
    return out


def receipt(
    job: AdmittedGrpo,
    started: float,
    kept: list[GrpoGroup],
    counts: FilterCounts,
    audits: Audits | None,
    *,
    adapter_dir: Path | None = None,
    failure: tuple[str, str] | None = None,
    dry_run: bool = False,
    timings: dict[str, float] | None = None,
    delta_norms: list[JsonObject] | None = None,
) -> JsonObject:
    """The train receipt of a run (or a dry run: ``audits`` None) of ``job``."""
    cfg, ingestion = job.config, job.ingestion
    rewards = obj.RewardStatsAccumulator(
        saturation_threshold=cfg.reward_saturation_threshold,
        low_variance_threshold=cfg.reward_low_variance_threshold,
    )
    for group in ingestion.groups:
        rewards.add_group([c.reward for c in group.completions])
    out = envelope(
        job,
        KIND,
        training_data=ingestion.training_data(dry_run=dry_run),
        started=started,
        epochs=1,
        adapter_dir=adapter_dir,
        failure=failure,
        tokenize_ms=job.tokenize_ms,
        timings=timings or {},
        delta_norms=delta_norms or [],
        grad_norms=[],
    )
    out["hyperparameters"]["shuffle"] = False  # groups train once, in source order
    config = cfg.to_json()
    grpo: JsonObject = {key: config[key] for key in RECEIPT_CONFIG}
    grpo["dynamic_groups_filtered"] = counts.dynamic
    if not dry_run:
        grpo["prefix_sharing"] = prefix_receipt(job, kept)
    if audits and (audits.importance.ratio_observations or audits.kl.token_observations):
        grpo["policy_audit"] = obj.policy_audit_receipt(audits.importance, audits.kl, recorded_provenance(kept))
    out["grpo"] = grpo
    out["echo"] = echo_block(cfg.echo, audits.echo if audits else EchoAccumulator())
    out["no_policy_loss"] = cfg.no_policy_loss
    trained = len(kept) if failure is None and not dry_run else 0
    out["data"] = data_block(
        groups_read=len(ingestion.groups),
        groups_filtered=counts.dynamic + counts.variance,
        groups_trained=trained,
        completions_read=sum(len(g.completions) for g in ingestion.groups),
        completions_trained=sum(len(g.completions) for g in kept) if trained else 0,
        reward_groups_filtered=counts.variance,
        reward_groups_kept=len(ingestion.groups) - counts.variance,
    )
    out["rewards"] = rewards.as_receipt()
    out["token_counts"] = ingestion.counts.token_counts()
    return out
