"""SFT trainer, profile ``native_online_lora_v1``.

Longer than 600 lines: one trainer read top to bottom -- its effective configuration, admission, the run (setup,
loop, checkpoints) and its receipt -- over the shared components of the kit.

Objective: mean next-token cross-entropy over the assistant tokens (assistant content plus
its closing end-of-turn token and newline) of the conversations of an optimizer step --
``micro_batch_size`` x ``gradient_accumulation_steps`` consecutive rows of the epoch order
(``kiln.documents.batch_plan``; one by default) -- at the rate of ``lr_scheduler`` (constant by
default), no clipping. The mean is over every supervised token of the step, so how the step
is cut into micro-batches changes only the rounding. Only the LoRA A/B matrices train; the
base model, embeddings and LM head are frozen.

Read top to bottom:

1. the effective configuration (``EffectiveSftConfig``, ``resolve_config``): the ``SftConfig`` model with the
   profile's refusals (MTP, shape conversion, anomaly detection, the smoke test), the members every kind resolves
   alike (``kiln.training.common_members``) and the SFT ones;
2. admission (``admit_request``, ``admit_sft``): config, seed, target, checkpoint, model, data, identity --
   everything that can fail before training, publishing nothing; a resume is fully loaded and compared here;
3. the run (``SftRun``): setup (LoRA, optimizer, restored state), the loop (epochs in the portable SplitMix64
   Fisher-Yates order, a checkpoint every ``checkpoint_interval`` committed steps and on cancellation), publication
   (adapter, receipt, manifest). A failure after admission writes a failed receipt with its category;
4. the loop's committed state (``SftLoop``: ``sft_loop_state.json``) and the receipt.

Checkpoint rules (spec/30): a checkpoint due at the end of an epoch is published at the
epoch boundary, pointing at the next epoch with cursor 0; none is published at the final
step (the adapter is). Cancellation is cooperative: the loop finishes the step in flight,
publishes a checkpoint (unless that boundary was just published) and fails with reason
``cancelled``. A cancellation that arrives after the last step changes nothing: the run
is complete and publishes its adapter.

A micro-batch of one row runs unpadded, exactly as before batching existed; a larger one is
right-padded with an attention mask and its loss is taken over the real positions only.

Deliberate simplifications: the loss route is chosen by capability; the divergence check
runs at epoch boundaries only; a resumed run's receipt reports the phase timings of its own
process.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kiln_contracts.models.kiln_control_plane_v1_schema import SftConfig, SftRequest

from kiln.artifacts.checkpoint_manifest import SFT_SOURCE_KIND
from kiln.checkpoints import PublishedCheckpoint
from kiln.documents.batch_plan import grouped_order, steps_per_epoch
from kiln.documents.digests import json_sha256, raw_hex
from kiln.documents.epoch_order import ALGORITHM_ID, epoch_order
from kiln.documents.jsonio import JsonObject
from kiln.errors import RequestError, TrainingFailedError
from kiln.model import device_memory_bytes, runtime_device
from kiln.trainers._admission import (
    AdmittedJob,
    TrainingContext,
    base_model,
    planned_model,
    run_identity,
    with_targets,
)
from kiln.trainers._checkpointing import CheckpointProgress, manifest_head, publish_state, restore_policy
from kiln.trainers._kit import (
    Cadence,
    FinalState,
    OnCheckpoint,
    Policy,
    Progress,
    RunProgress,
    RunTexts,
    TrainResult,
    artifact_lines,
    guarded,
    publish_adapter,
)
from kiln.trainers._receipts import data_block, envelope, token_counts_block
from kiln.trainers._requests import Request, dataset_path_of, parse_config, parse_request, refuse_gate
from kiln.trainers._resume import claim_target, load_resume, resume_metadata
from kiln.training import (
    LORA_INIT_ALGORITHM,
    SHARDING_RULE,
    DataParallel,
    EffectiveConfig,
    MemorySettings,
    StepSync,
    adapter_tensors,
    check_run_bounds,
    common_members,
    context_length,
    decoder_of,
    encode_tensors,
    lora_delta_norms,
    lora_grad_norms,
    model_head,
    optimizer_tensors,
    planning_identity,
)

if TYPE_CHECKING:
    import torch

    from kiln.data import SftExample, SftIngestion
    from kiln.kernels import LossRouteChoice
    from kiln.model import LoadedModel
    from kiln.training import ModelHead

KIND = "sft"
PROFILE = "native_online_lora_v1"  # the only SftTrainingProfile
DIVERGENCE_RATIO = 8.0
DIVERGENCE_MARGIN = 5.0

__all__ = [
    "AdmittedSft",
    "EffectiveSftConfig",
    "SftLoop",
    "SftRun",
    "admit_request",
    "admit_sft",
    "resolve_config",
    "run_sft",
]


# ----------------------------------------------------------------------------- the effective configuration


@dataclass(frozen=True, kw_only=True)
class EffectiveSftConfig(EffectiveConfig):
    """An SFT run's configuration with every default resolved: what its checkpoints, receipt and replay record."""

    training_profile: str
    invalid_row_policy: str
    epochs: int
    group_by_length: bool
    max_seq_len: int | None  # None until admission resolves it against the model's context length
    overlong_row_policy: str

    def to_json(self) -> JsonObject:
        return {
            **self.common_json(),
            "training_profile": self.training_profile,
            "invalid_row_policy": self.invalid_row_policy,
            "epochs": self.epochs,
            "group_by_length": self.group_by_length,
            "max_seq_len": self.max_seq_len,
            "overlong_row_policy": self.overlong_row_policy,
        }


def resolve_config(
    config: SftConfig,
    adapter_name: str,
    *,
    seed: int | None = None,
    checkpoint_interval: int | None = None,
    memory: MemorySettings | None = None,
) -> EffectiveSftConfig:
    """The effective configuration of a (schema-valid) ``SftConfig``; refuses what the profile does not execute.

    ``seed``: a resumed checkpoint's (authoritative); ``checkpoint_interval``: what a config without one gets."""
    for flag in ("train_mtp", "allow_adapter_shape_conversion", "detect_anomaly"):
        if getattr(config, flag):
            raise RequestError(f"{flag} is not supported by the {PROFILE} profile", code="training_backend_unsupported")
    if config.adapter_smoke_test or config.adapter_smoke_prompts:
        flag = "adapter_smoke_test" if config.adapter_smoke_test else "adapter_smoke_prompts"
        raise RequestError(
            f"{flag}: the post-training adapter smoke test is not available yet", code="training_backend_unsupported"
        )
    common = common_members(
        config,
        "SftConfig",
        adapter_name=adapter_name,
        seed=seed,
        checkpoint_interval=checkpoint_interval,
        memory=memory,
    )
    return EffectiveSftConfig(
        **common,
        training_profile=config.training_profile.value,
        invalid_row_policy=config.invalid_row_policy.value,
        epochs=config.epochs,
        group_by_length=config.group_by_length,
        max_seq_len=None if config.max_seq_len is None else config.max_seq_len.root,
        overlong_row_policy=config.overlong_row_policy.value,
    )


# ----------------------------------------------------------------------------- admission


@dataclass(kw_only=True)
class AdmittedSft(AdmittedJob[EffectiveSftConfig]):
    """An admitted SFT job: the kept rows, the loss route and the model's proven head."""

    kind: ClassVar[str] = KIND
    sharding: ClassVar[str] = SHARDING_RULE
    ingestion: SftIngestion
    tokenize_ms: float
    loss_route: LossRouteChoice  # route, fixed chunk size, implementation
    head: ModelHead  # the head's bias and the model's logit post-processing, proven

    @property
    def route(self) -> str:
        return self.loss_route.route

    @property
    def total_steps(self) -> int:
        return self.config.epochs * self.steps_per_epoch

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(len(self.ingestion.examples), self.rows_per_step)

    @property
    def rows_per_step(self) -> int:
        return self.config.rows_per_step * self.data_parallel.world_size

    @property
    def data_sha256(self) -> str:
        return self.ingestion.corpus_sha256

    def fingerprint(self) -> JsonObject:
        route = {"loss_route": self.loss_route.route, "loss_chunk_size": self.loss_route.chunk_size}
        return {**super().fingerprint(), **route}

    def resumed_history(self) -> list[JsonObject]:
        if self.resume is None:
            return []
        per_epoch = self.steps_per_epoch
        return [
            {
                "epoch": (step - 1) // per_epoch + 1,
                "progress": step / self.total_steps,
                "loss": loss,
                "elapsed_secs": 0.0,
            }
            for step, loss in enumerate(self.resume.loop_state["loss_history"], start=1)
        ]

    def identity_manifest(self, *, lora_init_position: int = 0) -> JsonObject:
        cfg, examples = self.config, self.ingestion.examples
        record = {k: v for k, v in self.ingestion.record.items() if k != "source_locator"}
        return manifest_head(
            self,
            KIND,
            total_steps=self.total_steps,
            data={
                "source_kind": SFT_SOURCE_KIND,
                "content_sha256": raw_hex(self.ingestion.corpus_sha256),
                "item_count": len(examples),
            },
            rng_states={
                "epoch-order": {"algorithm": ALGORITHM_ID, "seed": cfg.seed, "position": 0},
                "lora-init": {"algorithm": LORA_INIT_ALGORITHM, "seed": cfg.seed, "position": lora_init_position},
            },
            planning=planning_identity(
                device=runtime_device(self.device),
                device_bytes=device_memory_bytes(self.device),
                sft_loss_route=self.route,
                data_parallel=self.data_parallel_plan,
                segments=self.checkpoint_segments,
            ),
            auxiliary={
                "ingestion_receipt_sha256": json_sha256(record),
                "valid_indices_sha256": json_sha256([ex.row_index for ex in examples]),
            },
        )


def _loss_logits(choice: LossRouteChoice, max_rows: int, vocab: int) -> int:
    """The float32 logits the loss holds at once: the torch fused route a chunk of the vocabulary for every supervised
    row, the Triton route every column for a chunk of rows, the others every column for every row."""
    from kiln.kernels import TRITON_FUSED_LINEAR_CE

    if choice.chunk_size is None:
        return max_rows * vocab
    if choice.route == TRITON_FUSED_LINEAR_CE:
        return min(max_rows, choice.chunk_size) * vocab
    return max_rows * min(vocab, choice.chunk_size)


def admit_request(request: Request[SftRequest], *, adapter_name: str, context: TrainingContext) -> AdmittedSft:
    """An ``SftRequest`` (inline ``examples`` or a ``dataset_path``) admitted in ``context``; raises ``KilnError``
    and publishes nothing. A resume is fully loaded and compared with this run here."""
    import torch

    from kiln.data import ingest_sft
    from kiln.kernels import choose_loss_route
    from kiln.model import resolve_device, resolve_precision

    refuse_gate(request.model.post_eval)
    config = request.model.config or SftConfig()
    registry = context.registry
    point = resume_metadata(registry, adapter_name, _resume_value(config), _seed_value(config), KIND)
    cfg = resolve_config(
        config,
        adapter_name,
        seed=None if point is None else point.seed,
        checkpoint_interval=context.checkpoint_interval,
        memory=context.memory,
    )
    claim_target(registry, adapter_name, point)
    opened = base_model(context)  # tokenizer, config and weight headers: no weight is loaded before the plan
    cfg = _with_max_seq_len(cfg, opened)
    start = time.perf_counter()
    ingestion = ingest_sft(
        tokenizer=opened.tokenizer,
        examples=request.rows("examples"),
        dataset_path=None
        if request.model.dataset_path is None
        else str(Path(str(dataset_path_of(request.model))).resolve()),
        invalid_row_policy=cfg.invalid_row_policy,
        max_seq_len=cfg.max_seq_len,
        overlong_row_policy=cfg.overlong_row_policy,
    )
    tokenize_ms = (time.perf_counter() - start) * 1000
    _check_data(cfg, ingestion.examples, opened)
    vocab = opened.vocab_size
    # a micro-batch's supervised rows, at most: its rows' supervised tokens, the largest first
    max_rows = sum(sorted((ex.supervised_tokens for ex in ingestion.examples), reverse=True)[: cfg.micro_batch_size])
    dtype = torch.bfloat16 if resolve_precision(cfg.precision, opened) == "bf16" else torch.float32
    device = resolve_device(cfg.device)  # the route is the device's (planned_model resolves it the same way)
    choice = choose_loss_route(device, dtype, max_rows=max_rows, vocab=vocab, hidden=opened.hidden_size)
    loaded, cfg, plan = planned_model(
        opened,
        cfg,
        context,
        tokens=max(len(ex.input_ids) for ex in ingestion.examples),
        loss_logits=_loss_logits(choice, max_rows, vocab),
        point=point,
        segments=None if config.grad_checkpoint_segments is None else config.grad_checkpoint_segments.root,
        seq_len_field="max_seq_len",
    )
    head_of_model = model_head(loaded.model)
    cfg = with_targets(cfg, loaded)
    job = AdmittedSft(
        adapter_name=adapter_name,
        registry=registry,
        config=cfg,
        loaded=loaded,
        run=run_identity(loaded, cfg.optimizer, context.data_parallel, cfg.precision),
        memory_plan=plan,
        ingestion=ingestion,
        tokenize_ms=tokenize_ms,
        loss_route=choice,
        head=head_of_model,
    )
    job.resume = load_resume(point, job.identity_manifest())
    return job


def admit_sft(
    *,
    adapter_name: str,
    registry: Path,
    config: JsonObject,
    examples: list[JsonObject] | None = None,
    dataset_path: str | Path | None = None,
    model_path: str | None = None,
    loaded: LoadedModel | None = None,
    data_parallel: DataParallel | None = None,
) -> AdmittedSft:
    """``admit_request`` for a caller holding the parts of a request as JSON: a config, the rows or a file.

    ``loaded``: an already loaded base model (the server's) to admit against instead of loading ``model_path``;
    admission only reads it (tokenizer, head shape, paths). ``data_parallel``: the group this process trains in (a
    single process by default)."""
    data: JsonObject = {"examples": examples} if examples is not None else {}
    if dataset_path is not None:
        data["dataset_path"] = str(dataset_path)
    parsed = parse_request(SftRequest, data)
    config_model = parse_config(SftConfig, config, "SFT")
    request = Request(parsed.model.model_copy(update={"config": config_model}), {**parsed.sent, "config": config})
    context = TrainingContext(
        registry=registry, model_path=model_path, loaded=loaded, data_parallel=data_parallel or DataParallel()
    )
    return admit_request(request, adapter_name=adapter_name, context=context)


def _resume_value(config: SftConfig) -> str | None:
    return None if config.resume_checkpoint is None else config.resume_checkpoint.root


def _seed_value(config: SftConfig) -> int | str | None:
    return None if config.seed is None else config.seed.root


def _with_max_seq_len(cfg: EffectiveSftConfig, loaded: LoadedModel) -> EffectiveSftConfig:
    """``cfg`` with ``max_seq_len`` resolved: the request's (at most the model's context length) or the context
    length itself (None when the model declares none)."""
    import dataclasses

    context = context_length(loaded)
    requested = cfg.max_seq_len
    if requested is not None and context is not None and requested > context:
        raise RequestError(
            f"max_seq_len {requested} exceeds the model's context length of {context} tokens",
            code="training_invalid_request",
            pointer="/config/max_seq_len",
            hint=f"use at most {context}, or omit max_seq_len for the context length",
        )
    return dataclasses.replace(cfg, max_seq_len=context if requested is None else requested)


def _check_data(cfg: EffectiveSftConfig, examples: tuple[SftExample, ...], loaded: LoadedModel) -> None:
    """The SFT bounds that need the data: epochs x steps per epoch, and each kept row's tokens against the context."""
    rows = cfg.rows_per_step
    per_epoch = steps_per_epoch(len(examples), rows)
    rule = f"{cfg.epochs} epochs x {len(examples)} rows"
    if rows > 1:
        rule = f"{cfg.epochs} epochs x {per_epoch} steps of {rows} of the {len(examples)} rows"
    check_run_bounds(
        total_steps=cfg.epochs * per_epoch,
        steps_rule=rule,
        rows=((f"row {ex.row_index + 1}", len(ex.input_ids)) for ex in examples),
        context=context_length(loaded),
    )


# ----------------------------------------------------------------------------- the run


def run_sft(
    job: AdmittedSft,
    *,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    keep_final_state: bool = False,
    on_checkpoint: OnCheckpoint | None = None,
) -> TrainResult:
    """Train, then publish adapter, receipt and manifest (or a failed receipt).

    ``cancel``: when set, the loop stops at the next committed step, publishes a
    checkpoint there and fails with reason ``cancelled``. ``on_checkpoint`` receives each
    ``PublishedCheckpoint`` (path, manifest, phase timings) as it lands.
    """
    run = SftRun(job, progress=progress, cancel=cancel, keep_final_state=keep_final_state, on_checkpoint=on_checkpoint)
    return guarded(run)


class SftRun(RunProgress):
    """One run of an admitted SFT job; ``train`` reads setup -> loop -> publication."""

    def __init__(
        self,
        job: AdmittedSft,
        *,
        progress: Progress | None,
        cancel: threading.Event | None,
        keep_final_state: bool,
        on_checkpoint: OnCheckpoint | None,
    ) -> None:
        self.job = job
        self.started = time.perf_counter()
        self.progress, self.cancel, self.on_checkpoint = progress, cancel, on_checkpoint
        self.keep_final_state = keep_final_state
        cfg, examples = job.config, job.ingestion.examples
        lengths = [len(ex.input_ids) for ex in examples] if cfg.group_by_length else None
        self.loop = SftLoop(len(examples), cfg.epochs, cfg.seed, job.rows_per_step, lengths)
        self.timings: dict[str, float] = {}
        self.delta_norms: list[JsonObject] = []
        self.cadence: Cadence | None = None

    def train(self) -> TrainResult:
        import torch

        from kiln.kernels import check_route_device, sft_loss

        job, loop, cfg, examples = self.job, self.loop, self.job.config, self.job.ingestion.examples
        try:  # a route recorded for another machine (a replay, a resume) fails here, before anything allocates
            check_route_device(job.route, job.device)
        except ValueError as exc:
            raise RequestError(f"loss route: {exc}", code="training_backend_unsupported") from None
        # setup: the policy (fresh, warm-started or restored), the loop's position, the checkpoint cadence
        policy = Policy(job, restore=restore_policy)
        self.timings = policy.timings
        lora_init_position = 0 if cfg.base_adapter else sum(".lora_A." in name for name in policy.params)
        if job.resume is not None:
            loop.restore(job.resume.loop_state)
            lora_init_position = job.resume.manifest["rng_states"]["lora-init"]["position"]
        else:
            loop.refresh_order()
        group = job.data_parallel
        sync = StepSync(group, policy.params, self.cancel)  # a data-parallel group's one collective per step
        self.cadence = cadence = Cadence(
            job,
            lambda: self._publish_checkpoint(policy, lora_init_position),
            sync.cancel,
            self.on_checkpoint,
            sync=sync,
        )
        causal = policy.model.get_base_model()
        body, head = decoder_of(causal), causal.get_output_embeddings()
        on = next(body.parameters()).device  # the labels live where the loss reads them
        rows_of = [(list(ex.input_ids), torch.tensor(ex.labels[1:], dtype=torch.long, device=on)) for ex in examples]
        # the loop: one optimizer step over a step's rows, cut into micro-batches
        while loop.global_step < loop.total:
            step_rows = loop.step_rows()
            supervised = sum(examples[i].supervised_tokens for i in step_rows)
            norms: dict[str, float] = {}
            value = 0.0
            for batch in group.micro_batches(step_rows, cfg.micro_batch_size):  # all of them in a single process
                t0 = time.perf_counter()
                hidden, targets = _forward(body, [rows_of[i] for i in batch])
                loss = sft_loss(
                    job.route,
                    hidden,
                    head.weight,
                    targets,
                    chunk_size=job.loss_route.chunk_size,
                    bias=head.bias,
                    logit_map=job.head.logit_map,
                )
                if len(batch) < len(step_rows):  # this micro-batch's share of the step's mean
                    loss = loss * (sum(examples[i].supervised_tokens for i in batch) / supervised)
                policy.timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
                value += policy.accumulate(loss, partial(self._where, step_rows))
            value = sync.reduce(value, partial(self._where, step_rows))
            policy.apply(before_step=partial(_record_grad_norms, norms, policy))
            loop.commit(value, norms, len(step_rows))
            if self.progress:
                tokens = sum(len(rows_of[i][0]) for i in step_rows)
                self.progress({"step": loop.global_step, "total": loop.total, "loss": value, "tokens": tokens})
            cadence.settled(
                loop.global_step,
                last=loop.global_step >= loop.total,
                due=cadence.due(loop.global_step),
                cancelled=lambda name: f"cancelled after step {loop.global_step} of {loop.total}; resume from {name}",
            )
        # publication: every rank holds the same weights; rank 0 publishes adapter, receipt and manifest
        sync.check_same()
        self.delta_norms = lora_delta_norms(policy.model)
        return publish_adapter(
            job,
            policy.model,
            lambda adapter_dir: self.receipt(adapter_dir=adapter_dir),
            losses=list(loop.losses),
            checkpoints=cadence.published,
            final_state=self._final_state(policy) if self.keep_final_state else None,
        )

    def failed_receipt(self, failure: tuple[str, str], exc: BaseException) -> JsonObject:
        return self.receipt(failure=failure)

    def _publish_checkpoint(self, policy: Policy, lora_init_position: int) -> PublishedCheckpoint:
        loop = self.loop

        def stamp(manifest: JsonObject, loop_doc: JsonObject) -> CheckpointProgress:
            manifest["rng_states"]["lora-init"]["position"] = lora_init_position
            manifest["rng_states"]["epoch-order"]["position"] = loop_doc["epoch_index"]
            return CheckpointProgress(
                loop_doc["global_step"], loop.total, loop_doc["epoch_index"], loop_doc["cursor_in_epoch"], loop.order
            )

        return publish_state(
            self.job, KIND, policy.params, policy.optimizer, loop_document=loop.as_document, stamp=stamp
        )

    def _where(self, rows: list[int]) -> str:
        loop, examples = self.loop, self.job.ingestion.examples
        numbers = [examples[i].row_index for i in rows]
        what = f"row {numbers[0]}" if len(numbers) == 1 else f"rows {', '.join(map(str, numbers))}"
        return f"step {loop.global_step + 1} (epoch {loop.epoch_index + 1}, {what})"

    def _final_state(self, policy: Policy) -> FinalState:
        slots = optimizer_tensors(policy.optimizer, policy.params)
        return FinalState(
            encode_tensors(adapter_tensors(policy.params)),
            encode_tensors(slots) if slots else None,
            self.loop.as_document(),
        )

    def receipt(self, *, adapter_dir: Path | None = None, failure: tuple[str, str] | None = None) -> JsonObject:
        job, loop = self.job, self.loop
        cfg, record, examples = job.config, job.ingestion.record, job.ingestion.examples
        per_epoch_action = sum(ex.supervised_tokens for ex in examples)
        per_epoch_context = sum(len(ex.input_ids) - 1 for ex in examples) - per_epoch_action
        epochs_done = (
            cfg.epochs if failure is None else min(cfg.epochs, -(-loop.rows_consumed // max(len(examples), 1)))
        )
        receipt = envelope(
            job,
            KIND,
            training_data={
                "source": record["source"],
                "path": record.get("source_locator"),
                "sha256": record["kept_corpus_sha256"],
            },
            started=self.started,
            epochs=cfg.epochs,
            adapter_dir=adapter_dir,
            failure=failure,
            tokenize_ms=job.tokenize_ms,
            timings=self.timings,
            delta_norms=self.delta_norms,
            grad_norms=[
                {"module": m, "sample_count": int(a[0]), "min": a[2], "mean": a[1] / a[0], "max": a[3]}
                for m, a in sorted(loop.grad_norms.items())
            ],
        )
        receipt["hyperparameters"].update(shuffle=True, epoch_order_algorithm=ALGORITHM_ID)
        receipt["tokenizer"]["training_chat_template_hash"] = job.identity.training_chat_template_hash
        receipt["data"] = data_block(
            examples_read=record["rows_read"],
            examples_filtered=record["rows_rejected"],
            examples_trained=record["rows_kept"] * cfg.epochs if failure is None else loop.rows_consumed,
            sft_ingestion=record,
        )
        receipt["token_counts"] = token_counts_block(
            action=per_epoch_action * epochs_done, context=per_epoch_context * epochs_done
        )
        receipt["runtime"].update(
            sft_loss_route=job.route,
            sft_loss_chunk_size=job.loss_route.chunk_size,
            sft_loss_implementation=job.loss_route.implementation,
            sft_logits=job.head.as_record(),
        )
        return receipt


def _record_grad_norms(norms: dict[str, float], policy: Policy) -> None:
    """The per-module gradient norms of the step about to be applied (read before the optimizer step)."""
    norms.update(lora_grad_norms(policy.params))


def _forward(body: Any, rows: list[tuple[list[int], torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's hidden states at every position that predicts a next token, and those tokens' labels, for a
    micro-batch: one row unpadded; several right-padded into one forward with an attention mask, the padding left
    out (the rows' positions in order, as if each had run alone)."""
    import torch

    device = next(body.parameters()).device
    if len(rows) == 1:
        ids, targets = rows[0]
        single = torch.tensor(ids, dtype=torch.long, device=device).unsqueeze(0)
        return body(input_ids=single).last_hidden_state[0, :-1], targets
    from kiln.model import right_padded

    ids, mask = right_padded([row_ids for row_ids, _ in rows], device)
    hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    return hidden[mask[:, 1:].bool()], torch.cat([targets for _, targets in rows])


# ----------------------------------------------------------------------------- how the command line describes a run


def _headline(job: AdmittedSft) -> str:
    cfg = job.config
    return (
        f"Training SFT adapter '{job.adapter_name}' on {job.loaded.path.name} "
        f"({len(job.ingestion.examples)} conversations x {cfg.epochs} epoch(s), seed {cfg.seed})"
    )


def _success(job: AdmittedSft, result: TrainResult) -> list[str]:
    receipt, losses = result.receipt, result.losses
    lines = [
        f"✓ trained {len(losses)} steps in {receipt['runtime']['wall_clock_ms'] / 1000:.1f} s, "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
        *artifact_lines(result),
        f"Effective seed: {job.config.seed}   Loss route: {receipt['runtime']['sft_loss_route']}",
    ]
    if result.checkpoints:
        lines.append(f"Checkpoints: {len(result.checkpoints)} published (newest {result.checkpoints[-1].name})")
    return lines


TEXTS = RunTexts(unit="step", metric="loss", headline=_headline, success=_success)


# ----------------------------------------------------------------------------- the loop's committed state


@dataclass
class SftLoop:
    """The SFT loop's committed state; ``as_document`` is ``sft_loop_state.json``.

    ``rows`` is the rows per optimizer step and ``lengths`` the row lengths when the order is grouped by length
    (``kiln.documents.batch_plan``); ``order`` is the current epoch's order and ``cursor`` the position of its next row.
    """

    items: int
    epochs: int
    seed: int
    rows: int = 1
    lengths: list[int] | None = None
    global_step: int = 0
    epoch_index: int = 0
    cursor: int = 0
    losses: list[float] = field(default_factory=list)
    epoch_sum: float = 0.0
    first_epoch_loss: float | None = None
    best_epoch_loss: float | None = None
    grad_norms: dict[str, list[float]] = field(default_factory=dict)  # module -> [count, sum, min, max]
    order: list[int] = field(default_factory=list)

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.items, self.rows)

    @property
    def total(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def rows_consumed(self) -> int:
        """Rows trained so far, over all epochs."""
        return self.epoch_index * self.items + self.cursor

    def step_rows(self) -> list[int]:
        """The row indices of the next optimizer step."""
        return self.order[self.cursor : self.cursor + self.rows]

    def refresh_order(self) -> None:
        if self.global_step >= self.total:
            self.order = []
            return
        order = epoch_order(self.seed, self.epoch_index, self.items)
        self.order = order if self.lengths is None else grouped_order(order, self.lengths, self.rows)

    def commit(self, loss: float, norms: dict[str, float], rows: int = 1) -> bool:
        """Record one optimizer step over ``rows`` rows; True when it ended an epoch."""
        self.losses.append(loss)
        self.global_step += 1
        self.cursor += rows
        self.epoch_sum += loss
        for module, value in sorted(norms.items()):
            acc = self.grad_norms.get(module)
            if acc is None:
                self.grad_norms[module] = [1, value, value, value]
            else:
                acc[0] += 1
                acc[1] += value
                acc[2] = min(acc[2], value)
                acc[3] = max(acc[3], value)
        if self.cursor < self.items:
            return False
        mean = self.epoch_sum / self.steps_per_epoch
        if self.first_epoch_loss is None or self.best_epoch_loss is None:
            self.first_epoch_loss = self.best_epoch_loss = mean
        else:
            _check_divergence(self.epoch_index + 1, mean, self.first_epoch_loss, self.best_epoch_loss)
            self.best_epoch_loss = min(self.best_epoch_loss, mean)
        self.epoch_index += 1
        self.cursor = 0
        self.epoch_sum = 0.0
        self.refresh_order()
        return True

    def as_document(self) -> JsonObject:
        doc: JsonObject = {
            "schema_version": 1,
            "state_type": "kiln.sft-loop-state.v1",
            "global_step": self.global_step,
            "epoch_index": self.epoch_index,
            "cursor_in_epoch": self.cursor,
        }
        if self.rows > 1:
            doc["rows_per_step"] = self.rows
        doc.update(
            {
                "loss_history": list(self.losses),
                "last_loss": self.losses[-1] if self.losses else None,
                "current_epoch_loss_sum": self.epoch_sum,
                "current_epoch_items": self.cursor,
                "lora_grad_norms": [
                    {"module": m, "sample_count": int(a[0]), "sum": a[1], "min": a[2], "max": a[3]}
                    for m, a in sorted(self.grad_norms.items())
                ],
            }
        )
        if self.epoch_index > 0:
            doc["first_epoch_loss"] = self.first_epoch_loss
            doc["best_epoch_loss"] = self.best_epoch_loss
        return doc

    def restore(self, doc: JsonObject) -> None:
        """Take the committed state of a checkpoint's loop-state document (same plan: rows, lengths, seed)."""
        self.global_step, self.epoch_index, self.cursor = doc["global_step"], doc["epoch_index"], doc["cursor_in_epoch"]
        self.losses = list(doc["loss_history"])
        self.epoch_sum = doc["current_epoch_loss_sum"]
        self.first_epoch_loss = doc.get("first_epoch_loss")
        self.best_epoch_loss = doc.get("best_epoch_loss")
        self.grad_norms = {
            g["module"]: [g["sample_count"], g["sum"], g["min"], g["max"]] for g in doc["lora_grad_norms"]
        }
        self.refresh_order()


def _check_divergence(epoch_number: int, mean: float, first: float, best: float) -> None:
    if mean > DIVERGENCE_RATIO * first and mean > best + DIVERGENCE_MARGIN:
        raise TrainingFailedError(
            f"training diverged: epoch {epoch_number} mean loss {mean:.4f} exceeds {DIVERGENCE_RATIO:g}x the "
            f"first epoch ({first:.4f}) and the best epoch ({best:.4f}) by more than {DIVERGENCE_MARGIN:g}",
        )
