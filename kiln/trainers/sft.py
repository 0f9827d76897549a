"""SFT trainer, profile ``native_online_lora_v1``.

Objective: mean next-token cross-entropy over the assistant tokens (assistant content plus
its closing end-of-turn token and newline) of the conversations of an optimizer step --
``micro_batch_size`` x ``gradient_accumulation_steps`` consecutive rows of the epoch order
(``kiln.batch_plan``; one by default) -- at the rate of ``lr_scheduler`` (constant by
default), no clipping. The mean is over every supervised token of the step, so how the step
is cut into micro-batches changes only the rounding. Only the LoRA A/B matrices train; the
base model, embeddings and LM head are frozen.

Read top to bottom: admission (config, seed, target, checkpoint, model, data, identity --
everything that can fail before training, publishing nothing; a resume is fully loaded
and compared here), setup (LoRA, optimizer, restored state), the loop (epochs in the
portable SplitMix64 Fisher-Yates order, a checkpoint every ``checkpoint_interval``
committed steps and on cancellation), publication (adapter, receipt, manifest). A
failure after admission writes a failed receipt with its category.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.artifacts.checkpoint_manifest import SFT_SOURCE_KIND
from kiln.batch_plan import rows_per_step, steps_per_epoch
from kiln.digests import json_sha256, raw_hex
from kiln.epoch_order import ALGORITHM_ID
from kiln.trainers._admission import AdmittedJob, TrainingContext, base_model, job_fields
from kiln.trainers._checkpointing import CheckpointProgress, manifest_head, publish_state, restore_policy
from kiln.trainers._kit import Cadence, FinalState, Policy, Progress, TrainResult, guarded, publish_adapter
from kiln.trainers._loop_states import SftLoop
from kiln.trainers._receipts import data_block, envelope, token_counts_block
from kiln.trainers._resume import claim_target, load_resume, resume_metadata
from kiln.trainers._sft_config import check_sft_data, effective_config, resolve_max_seq_len
from kiln.training import (
    LORA_INIT_ALGORITHM,
    DataParallel,
    StepSync,
    adapter_tensors,
    decoder_of,
    encode_tensors,
    lora_delta_norms,
    lora_grad_norms,
    model_head,
    optimizer_tensors,
    planning_identity,
)

KIND = "sft"

__all__ = ["AdmittedSft", "admit_request", "admit_sft", "effective_config", "run_sft"]


# ----------------------------------------------------------------------------- admission


@dataclass(kw_only=True)
class AdmittedSft(AdmittedJob):
    ingestion: Any
    tokenize_ms: float
    route: str
    loss_route: Any  # kiln.kernels.LossRouteChoice: route, fixed chunk size, implementation
    head: Any  # kiln.training.ModelHead: the head's bias and the model's logit post-processing, proven
    kind: str = field(default=KIND, init=False)

    @property
    def total_steps(self) -> int:
        return self.config["epochs"] * self.steps_per_epoch

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(len(self.ingestion.examples), self.rows_per_step)

    @property
    def rows_per_step(self) -> int:
        return rows_per_step(self.config, self.data_parallel.world_size)

    @property
    def data_sha256(self) -> str:
        return self.ingestion.corpus_sha256

    def fingerprint(self) -> dict[str, Any]:
        route = {"loss_route": self.loss_route.route, "loss_chunk_size": self.loss_route.chunk_size}
        return {**super().fingerprint(), **route}

    def resumed_history(self) -> list[dict[str, Any]]:
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

    def memory_estimate(self) -> int:
        """A private copy of the weights, LoRA with gradients and two optimizer slots, activations of a micro-batch
        of the longest row and the loss route's buffers, for each data-parallel rank."""
        model = self.loaded.model
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        config = model.config
        hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
        rank = int(self.config["lora_rank"])
        lora = (
            layers
            * len(self.config["lora_target_modules"])
            * rank
            * (hidden + int(getattr(config, "intermediate_size", hidden)))
            * 4
            * 4
        )
        longest = max(len(ex.input_ids) for ex in self.ingestion.examples) * self.config["micro_batch_size"]
        activations = longest * hidden * layers * 4 * 32
        vocab = int(config.vocab_size)
        loss = (self.loss_route.chunk_size or vocab) * vocab * 4 + longest * hidden * 4 * 2
        return (weights + lora + activations + loss) * self.data_parallel.world_size  # each rank holds all of it

    def identity_manifest(self, *, lora_init_position: int = 0) -> dict[str, Any]:
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
                "epoch-order": {"algorithm": ALGORITHM_ID, "seed": cfg["seed"], "position": 0},
                "lora-init": {"algorithm": LORA_INIT_ALGORITHM, "seed": cfg["seed"], "position": lora_init_position},
            },
            planning=planning_identity(
                device="cpu", sft_loss_route=self.route, data_parallel=self.data_parallel.plan()
            ),
            auxiliary={
                "ingestion_receipt_sha256": json_sha256(record),
                "valid_indices_sha256": json_sha256([ex.row_index for ex in examples]),
            },
        )


def admit_sft(
    *,
    adapter_name: str,
    registry: Path,
    config: dict[str, Any],
    examples: list[Any] | None = None,
    dataset_path: str | Path | None = None,
    model_path: str | None = None,
    loaded: Any = None,
    data_parallel: DataParallel | None = None,
) -> AdmittedSft:
    """Everything that can fail before training; raises ``KilnError`` and publishes nothing.

    ``loaded``: an already loaded base model (the server's) to admit against instead of
    loading ``model_path``; admission only reads it (tokenizer, head shape, paths).
    ``data_parallel``: the group this process trains in (a single process by default).
    """
    import torch

    from kiln.data import ingest_sft
    from kiln.kernels import choose_loss_route

    config = dict(config)
    checkpoint_path = resume_metadata(registry, adapter_name, config, KIND)
    cfg = effective_config(config, adapter_name)
    claim_target(registry, adapter_name, checkpoint_path)
    loaded = base_model(model_path, loaded)
    head_of_model = model_head(loaded.model)
    cfg = resolve_max_seq_len(cfg, loaded)
    start = time.perf_counter()
    ingestion = ingest_sft(
        tokenizer=loaded.tokenizer,
        examples=examples,
        dataset_path=None if dataset_path is None else str(Path(dataset_path).resolve()),
        invalid_row_policy=cfg["invalid_row_policy"],
        max_seq_len=cfg["max_seq_len"],
        overlong_row_policy=cfg["overlong_row_policy"],
    )
    tokenize_ms = (time.perf_counter() - start) * 1000
    check_sft_data(cfg, ingestion.examples, loaded)
    fields = job_fields(adapter_name, registry, cfg, loaded, data_parallel=data_parallel)
    head = loaded.model.get_output_embeddings().weight
    choice = choose_loss_route(
        "cpu",
        torch.float32,
        # a micro-batch's supervised rows, at most: its rows' supervised tokens, the largest first
        max_rows=sum(
            sorted((ex.supervised_tokens for ex in ingestion.examples), reverse=True)[: cfg["micro_batch_size"]]
        ),
        vocab=head.shape[0],
        hidden=head.shape[1],
    )
    job = AdmittedSft(
        **fields,
        ingestion=ingestion,
        tokenize_ms=tokenize_ms,
        route=choice.route,
        loss_route=choice,
        head=head_of_model,
    )
    job.resume = load_resume(checkpoint_path, job.identity_manifest())
    return job


def admit_request(request: dict[str, Any], *, adapter_name: str, context: TrainingContext) -> AdmittedSft:
    """An ``SftRequest`` body (inline ``examples`` or a ``dataset_path``) admitted in ``context``."""
    config = dict(request.get("config") or {})
    if config.get("checkpoint_interval") is None:
        config["checkpoint_interval"] = context.checkpoint_interval
    return admit_sft(
        adapter_name=adapter_name,
        registry=context.registry,
        config=config,
        examples=request.get("examples"),
        dataset_path=request.get("dataset_path"),
        model_path=context.model_path,
        loaded=context.loaded,
        data_parallel=context.data_parallel,
    )


# ----------------------------------------------------------------------------- the run


def run_sft(
    job: AdmittedSft,
    *,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    keep_final_state: bool = False,
    on_checkpoint: Callable[[Any], None] | None = None,
) -> TrainResult:
    """Train, then publish adapter, receipt and manifest (or a failed receipt).

    ``cancel``: when set, the loop stops at the next committed step, publishes a
    checkpoint there and fails with reason ``cancelled``. ``on_checkpoint`` receives each
    ``PublishedCheckpoint`` (path, manifest, phase timings) as it lands.
    """
    started = time.perf_counter()
    cfg, examples = job.config, job.ingestion.examples
    micro = cfg["micro_batch_size"]
    lengths = [len(ex.input_ids) for ex in examples] if cfg["group_by_length"] else None
    group = job.data_parallel
    loop = SftLoop(len(examples), cfg["epochs"], cfg["seed"], job.rows_per_step, lengths)
    state: dict[str, Any] = {"timings": {}, "delta_norms": [], "cadence": None}

    def train() -> TrainResult:
        import torch

        from kiln.kernels import sft_loss

        policy = Policy(job, restore=restore_policy)
        state["timings"] = policy.timings
        params = policy.params
        lora_init_position = 0 if cfg["base_adapter"] else sum(".lora_A." in name for name in params)
        if job.resume is not None:
            loop.restore(job.resume.loop_state)
            lora_init_position = job.resume.manifest["rng_states"]["lora-init"]["position"]
        else:
            loop.refresh_order()
        sync = StepSync(group, params, cancel)  # a data-parallel group's one collective per step
        cadence = state["cadence"] = Cadence(
            job, lambda: _publish(job, loop, policy, lora_init_position), sync.cancel, on_checkpoint, sync=sync
        )
        causal = policy.model.get_base_model()
        body, head = decoder_of(causal), causal.get_output_embeddings()
        logit_map = job.head.logit_map
        rows_of = [(ex.input_ids, torch.tensor(ex.labels[1:], dtype=torch.long)) for ex in examples]
        while loop.global_step < loop.total:
            step_rows = loop.step_rows()
            supervised = sum(examples[i].supervised_tokens for i in step_rows)
            value, norms = 0.0, {}
            for batch in group.micro_batches(step_rows, micro):  # all of them in a single process
                t0 = time.perf_counter()
                hidden, targets = _forward(body, [rows_of[i] for i in batch])
                loss = sft_loss(
                    job.route,
                    hidden,
                    head.weight,
                    targets,
                    chunk_size=job.loss_route.chunk_size,
                    bias=head.bias,
                    logit_map=logit_map,
                )
                if len(batch) < len(step_rows):  # this micro-batch's share of the step's mean
                    loss = loss * (sum(examples[i].supervised_tokens for i in batch) / supervised)
                policy.timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
                value += policy.accumulate(
                    loss, lambda rows=step_rows: _where(loop, [examples[i].row_index for i in rows])
                )
            value = sync.reduce(value, lambda rows=step_rows: _where(loop, [examples[i].row_index for i in rows]))
            policy.apply(before_step=lambda found=norms: found.update(lora_grad_norms(params)))
            loop.commit(value, norms, len(step_rows))
            if progress:
                tokens = sum(len(rows_of[i][0]) for i in step_rows)
                progress({"step": loop.global_step, "total": loop.total, "loss": value, "tokens": tokens})
            cadence.settled(
                loop.global_step,
                last=loop.global_step >= loop.total,
                due=cadence.due(loop.global_step),
                cancelled=lambda name: f"cancelled after step {loop.global_step} of {loop.total}; resume from {name}",
            )
        sync.check_same()
        state["delta_norms"] = lora_delta_norms(policy.model)
        final = _final_state(policy, loop) if keep_final_state else None
        return publish_adapter(
            job,
            policy.model,
            lambda adapter_dir: _receipt(job, loop, state, started, adapter_dir=adapter_dir),
            losses=list(loop.losses),
            checkpoints=cadence.published,
            final_state=final,
        )

    return guarded(
        job,
        train,
        lambda failure, _exc: _receipt(job, loop, state, started, failure=failure),
        lambda: {
            "losses": list(loop.losses),
            "checkpoints": state["cadence"].published if state["cadence"] else [],
        },
    )


def _publish(job: AdmittedSft, loop: SftLoop, policy: Policy, lora_init_position: int) -> Any:
    def stamp(manifest: dict[str, Any], loop_doc: dict[str, Any]) -> CheckpointProgress:
        manifest["rng_states"]["lora-init"]["position"] = lora_init_position
        manifest["rng_states"]["epoch-order"]["position"] = loop_doc["epoch_index"]
        return CheckpointProgress(
            loop_doc["global_step"], loop.total, loop_doc["epoch_index"], loop_doc["cursor_in_epoch"], loop.order
        )

    return publish_state(job, KIND, policy.params, policy.optimizer, loop_document=loop.as_document, stamp=stamp)


def _forward(body: Any, rows: list[tuple[list[int], Any]]) -> tuple[Any, Any]:
    """The decoder's hidden states at every position that predicts a next token, and those tokens' labels, for a
    micro-batch: one row unpadded; several right-padded into one forward with an attention mask, the padding left
    out (the rows' positions in order, as if each had run alone)."""
    import torch

    if len(rows) == 1:
        ids, targets = rows[0]
        return body(input_ids=torch.tensor(ids, dtype=torch.long).unsqueeze(0)).last_hidden_state[0, :-1], targets
    from kiln.model import right_padded

    ids, mask = right_padded([row_ids for row_ids, _ in rows])
    hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
    return hidden[mask[:, 1:].bool()], torch.cat([targets for _, targets in rows])


def _where(loop: SftLoop, rows: list[int]) -> str:
    what = f"row {rows[0]}" if len(rows) == 1 else f"rows {', '.join(map(str, rows))}"
    return f"step {loop.global_step + 1} (epoch {loop.epoch_index + 1}, {what})"


def _final_state(policy: Policy, loop: SftLoop) -> FinalState:
    slots = optimizer_tensors(policy.optimizer, policy.params)
    return FinalState(
        encode_tensors(adapter_tensors(policy.params)), encode_tensors(slots) if slots else None, loop.as_document()
    )


# ----------------------------------------------------------------------------- the receipt


def _receipt(job, loop, state, started, *, adapter_dir=None, failure=None) -> dict[str, Any]:
    cfg, record = job.config, job.ingestion.record
    examples = job.ingestion.examples
    per_epoch_action = sum(ex.supervised_tokens for ex in examples)
    per_epoch_context = sum(len(ex.input_ids) - 1 for ex in examples) - per_epoch_action
    epochs_done = (
        cfg["epochs"] if failure is None else min(cfg["epochs"], -(-loop.rows_consumed // max(len(examples), 1)))
    )
    receipt = envelope(
        job,
        KIND,
        training_data={
            "source": record["source"],
            "path": record.get("source_locator"),
            "sha256": record["kept_corpus_sha256"],
        },
        started=started,
        epochs=cfg["epochs"],
        adapter_dir=adapter_dir,
        failure=failure,
        tokenize_ms=job.tokenize_ms,
        timings=state["timings"],
        delta_norms=state["delta_norms"],
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
        examples_trained=record["rows_kept"] * cfg["epochs"] if failure is None else loop.rows_consumed,
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
    if job.data_parallel.active:
        receipt["runtime"]["data_parallel"] = job.data_parallel.plan()
    return receipt
