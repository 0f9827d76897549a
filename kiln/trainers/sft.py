"""SFT trainer, profile ``native_online_lora_v1``.

Objective: mean next-token cross-entropy over the assistant tokens of one conversation
(assistant content plus its closing end-of-turn token and newline), one conversation per
optimizer step, constant learning rate, no warmup, accumulation or clipping. Only the LoRA
A/B matrices train; the base model, embeddings and LM head are frozen.

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

Deliberate simplifications: batch size 1 (one conversation per step); the loss route is
chosen by capability; the divergence check runs at epoch boundaries only; a resumed run's
receipt reports the phase timings of its own process.
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
from kiln.artifacts.checkpoint_manifest import SFT_SOURCE_KIND
from kiln.artifacts.loop_state import loop_state_file_name
from kiln.checkpoints import (
    LoadedCheckpoint,
    checkpoint_id,
    list_checkpoints,
    load_checkpoint,
    publish_checkpoint,
    require_compatible,
)
from kiln.digests import json_sha256, raw_hex
from kiln.epoch_order import ALGORITHM_ID, epoch_order
from kiln.errors import CheckpointError, Problem, RequestError
from kiln.publish import (
    stage_adapter,
    write_adapter_manifest,
    write_train_receipt,
)
from kiln.trainers._resume import claim_target, optimizer_identity, resume_metadata
from kiln.trainers._sft_config import effective_config
from kiln.training import (
    TrainingFailedError,
    attach_lora,
    build_optimizer,
    classify_failure,
    lora_delta_norms,
    lora_parameters,
    resolve_seed,
)
from kiln.training._lora import module_of
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

KIND = "sft"
DIVERGENCE_RATIO = 8.0
DIVERGENCE_MARGIN = 5.0
LOOP_FILE = loop_state_file_name(KIND)

Progress = Callable[[dict[str, Any]], None]


@dataclass
class FinalState:
    """The trainer's state after the last step, encoded like a checkpoint (for proofs)."""

    adapter: bytes
    optimizer: bytes | None
    loop_state: dict[str, Any]


@dataclass
class SftResult:
    status: str
    adapter_dir: Path
    receipt_path: Path
    manifest_path: Path | None
    receipt: dict[str, Any]
    losses: list[float] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)
    cancelled: bool = False
    resumed_from: Path | None = None
    final_state: FinalState | None = None

    @property
    def latest_checkpoint(self) -> Path | None:
        return self.checkpoints[-1] if self.checkpoints else self.resumed_from


# ----------------------------------------------------------------------------- admission


@dataclass
class AdmittedSft:
    adapter_name: str
    registry: Path
    config: dict[str, Any]
    loaded: Any
    ingestion: Any
    tokenize_ms: float
    identity: Any = None
    precision: dict[str, Any] = field(default_factory=dict)
    route: str = ""
    resume: LoadedCheckpoint | None = None
    loss_route: Any = None  # kiln.kernels.LossRouteChoice: route, fixed chunk size, implementation

    @property
    def total_steps(self) -> int:
        return self.config["epochs"] * len(self.ingestion.examples)

    @property
    def start_step(self) -> int:
        return self.resume.manifest["progress"]["global_step"] if self.resume else 0


def _checkpoint_seed(config: dict[str, Any], manifest: dict[str, Any], name: str) -> int:
    """The checkpoint's ``lora-init`` seed is authoritative; a conflicting explicit seed is refused."""
    seed = manifest["rng_states"]["lora-init"]["seed"]
    asked = config.get("seed")
    if asked is not None:
        try:
            asked_value = resolve_seed(asked)
        except ValueError as exc:
            raise RequestError(str(exc), code="training_invalid_request") from None
        if asked_value != seed:
            message = f"effective_config.seed differs: {seed} (checkpoint's lora-init seed) != {asked_value} (this run)"
            raise CheckpointError(
                f"{name} cannot resume this run: {message}",
                problems=[Problem("effective_config.seed", "/effective_config/seed", message)],
                code="checkpoint_incompatible",
                reason="effective_config.seed",
                pointer="/effective_config/seed",
                hint="omit --seed when resuming: the checkpoint's seed is used",
            )
    return seed


def _refuse_later_checkpoints(registry: Path, adapter: str, start_step: int) -> None:
    later = [c for c in list_checkpoints(registry, adapter) if c.global_step > start_step]
    if later:
        first = later[0].path.name
        raise CheckpointError(
            f"adapter {adapter!r} already has checkpoint {first}"
            + (f" (and {len(later) - 1} more)" if len(later) > 1 else "")
            + f" past step {start_step}; this run would reach those names, and checkpoints are never overwritten",
            code="checkpoint_exists",
            reason="checkpoint_exists",
            hint=f"resume the newest one with --resume-checkpoint {later[-1].path.name}, or archive (move out of "
            f"{registry}) every checkpoint of {adapter!r} past step {start_step} before running again",
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
) -> AdmittedSft:
    """Everything that can fail before training; raises ``KilnError`` and publishes nothing.

    ``loaded``: an already loaded base model (the server's) to admit against instead of
    loading ``model_path``; admission only reads it (tokenizer, head shape, paths).
    """
    import torch

    from kiln.data import ingest_sft
    from kiln.kernels import choose_loss_route
    from kiln.model import capture_identity, load_base_model, resolve_model_path, training_precision

    config = dict(config)
    checkpoint_path = resume_metadata(registry, adapter_name, config, KIND)
    cfg = effective_config(config, adapter_name)
    claim_target(registry, adapter_name, checkpoint_path)
    if loaded is None:
        path, is_default = resolve_model_path(model_path)
        loaded = load_base_model(path, is_default=is_default)
    start = time.perf_counter()
    if dataset_path is not None:
        dataset_path = str(Path(dataset_path).resolve())
    ingestion = ingest_sft(
        tokenizer=loaded.tokenizer,
        examples=examples,
        dataset_path=dataset_path,
        invalid_row_policy=cfg["invalid_row_policy"],
    )
    tokenize_ms = (time.perf_counter() - start) * 1000
    torch.use_deterministic_algorithms(True)  # before the identity: provenance records it
    precision = training_precision(optimizer_kind=cfg["optimizer"]["kind"])
    identity = capture_identity(loaded.path, loaded.tokenizer, training_policy=precision)
    head = loaded.model.get_output_embeddings().weight
    choice = choose_loss_route(
        "cpu",
        torch.float32,
        max_rows=max(ex.supervised_tokens for ex in ingestion.examples),
        vocab=head.shape[0],
        hidden=head.shape[1],
    )
    job = AdmittedSft(adapter_name, registry, cfg, loaded, ingestion, tokenize_ms, identity, precision, choice.route)
    job.loss_route = choice
    if checkpoint_path is not None:
        job.resume = load_checkpoint(checkpoint_path)  # every byte hashed, loop state checked
        require_compatible(checkpoint_path.name, job.resume.manifest, identity_manifest(job))
    return job


# ----------------------------------------------------------------------------- checkpoint identity


def identity_manifest(job: AdmittedSft, *, lora_init_position: int = 0) -> dict[str, Any]:
    """The manifest of this run without progress, files and time: what a resume must match."""
    cfg, examples = job.config, job.ingestion.examples
    optimizer = cfg["optimizer"]
    stateful = optimizer["kind"] != "sgd"
    optimizer_block, scheduler_block = optimizer_identity(cfg)
    record = {k: v for k, v in job.ingestion.record.items() if k != "source_locator"}
    state_files = {"adapter_parameters": ADAPTER_FILE, "loss_history": LOOP_FILE}
    if stateful:
        state_files["optimizer_state"] = OPTIMIZER_FILE
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
            "source_kind": SFT_SOURCE_KIND,
            "content_sha256": raw_hex(job.ingestion.corpus_sha256),
            "item_count": len(examples),
        },
        "rng_states": {
            "epoch-order": {"algorithm": ALGORITHM_ID, "seed": cfg["seed"], "position": 0},
            "lora-init": {"algorithm": LORA_INIT_ALGORITHM, "seed": cfg["seed"], "position": lora_init_position},
        },
        "optimizer": optimizer_block,
        "scheduler": scheduler_block,
        "state_files": state_files,
        "auxiliary_state": {
            "loop_state_type": "kiln.sft-loop-state.v1",
            **auxiliary_identity(
                job.identity, job.precision, planning_identity(device="cpu", sft_loss_route=job.route)
            ),
            "training_runtime_planning_identity": planning_identity(device="cpu", sft_loss_route=job.route),
            "ingestion_receipt_sha256": json_sha256(record),
            "valid_indices_sha256": json_sha256([ex.row_index for ex in examples]),
        },
    }


# ----------------------------------------------------------------------------- loop state


@dataclass
class _Loop:
    """The loop's committed state; ``as_document`` is ``sft_loop_state.json``."""

    items: int
    epochs: int
    seed: int
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
    def total(self) -> int:
        return self.epochs * self.items

    def refresh_order(self) -> None:
        self.order = epoch_order(self.seed, self.epoch_index, self.items) if self.global_step < self.total else []

    def commit(self, loss: float, norms: dict[str, float]) -> bool:
        """Record one optimizer step; True when it ended an epoch."""
        self.losses.append(loss)
        self.global_step += 1
        self.cursor += 1
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
        mean = self.epoch_sum / self.items
        if self.first_epoch_loss is None:
            self.first_epoch_loss = self.best_epoch_loss = mean
        else:
            _check_divergence(self.epoch_index + 1, mean, self.first_epoch_loss, self.best_epoch_loss)
            self.best_epoch_loss = min(self.best_epoch_loss, mean)
        self.epoch_index += 1
        self.cursor = 0
        self.epoch_sum = 0.0
        self.refresh_order()
        return True

    def as_document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema_version": 1,
            "state_type": "kiln.sft-loop-state.v1",
            "global_step": self.global_step,
            "epoch_index": self.epoch_index,
            "cursor_in_epoch": self.cursor,
            "loss_history": list(self.losses),
            "last_loss": self.losses[-1] if self.losses else None,
            "current_epoch_loss_sum": self.epoch_sum,
            "current_epoch_items": self.cursor,
            "lora_grad_norms": [
                {"module": m, "sample_count": int(a[0]), "sum": a[1], "min": a[2], "max": a[3]}
                for m, a in sorted(self.grad_norms.items())
            ],
        }
        if self.epoch_index > 0:
            doc["first_epoch_loss"] = self.first_epoch_loss
            doc["best_epoch_loss"] = self.best_epoch_loss
        return doc

    @classmethod
    def restore(cls, doc: dict[str, Any], items: int, epochs: int, seed: int) -> _Loop:
        loop = cls(items, epochs, seed)
        loop.global_step, loop.epoch_index, loop.cursor = doc["global_step"], doc["epoch_index"], doc["cursor_in_epoch"]
        loop.losses = list(doc["loss_history"])
        loop.epoch_sum = doc["current_epoch_loss_sum"]
        loop.first_epoch_loss = doc.get("first_epoch_loss")
        loop.best_epoch_loss = doc.get("best_epoch_loss")
        loop.grad_norms = {
            g["module"]: [g["sample_count"], g["sum"], g["min"], g["max"]] for g in doc["lora_grad_norms"]
        }
        loop.refresh_order()
        return loop


def _check_divergence(epoch_number: int, mean: float, first: float, best: float) -> None:
    if mean > DIVERGENCE_RATIO * first and mean > best + DIVERGENCE_MARGIN:
        raise TrainingFailedError(
            "training_error",
            f"training diverged: epoch {epoch_number} mean loss {mean:.4f} exceeds {DIVERGENCE_RATIO:g}x the "
            f"first epoch ({first:.4f}) and the best epoch ({best:.4f}) by more than {DIVERGENCE_MARGIN:g}",
        )


class TrainingCancelledError(TrainingFailedError):
    def __init__(self, message: str):
        super().__init__("cancelled", message)


# ----------------------------------------------------------------------------- the run


def run_sft(
    job: AdmittedSft,
    *,
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    keep_final_state: bool = False,
    on_checkpoint: Callable[[Any], None] | None = None,
) -> SftResult:
    """Train, then publish adapter, receipt and manifest (or a failed receipt).

    ``cancel``: when set, the loop stops at the next committed step, publishes a
    checkpoint there and fails with reason ``cancelled``. ``on_checkpoint`` receives each
    ``PublishedCheckpoint`` (path, manifest, phase timings) as it lands.
    """
    import torch

    from kiln.kernels import sft_loss

    started = time.perf_counter()
    cfg, examples = job.config, job.ingestion.examples
    adapter_dir = job.registry / job.adapter_name
    loop = _Loop(len(examples), cfg["epochs"], cfg["seed"])
    timings = dict.fromkeys(("policy_forward_ms", "backward_ms", "optimizer_ms"), 0.0)
    delta_norms: list[dict[str, Any]] = []
    published: list[Path] = []
    interval = cfg["checkpoint_interval"]
    try:
        torch.manual_seed(0)  # nothing should draw from the global RNG; pin it anyway
        model = attach_lora(job.loaded.model, rank=cfg["lora_rank"], alpha=cfg["lora_alpha"], seed=cfg["seed"])
        params = lora_parameters(model)
        lora_init_position = 0 if cfg["base_adapter"] else sum(".lora_A." in name for name in params)
        optimizer = build_optimizer(cfg["optimizer"], list(params.values()), cfg["learning_rate"])
        if job.resume is not None:
            manifest = job.resume.manifest
            restore_adapter(params, job.resume.blobs[manifest["state_files"]["adapter_parameters"]])
            state_file = manifest["optimizer"].get("state_file")
            restore_optimizer(optimizer, params, job.resume.blobs[state_file] if state_file else None)
            loop = _Loop.restore(job.resume.loop_state, len(examples), cfg["epochs"], cfg["seed"])
            lora_init_position = manifest["rng_states"]["lora-init"]["position"]
        else:
            if cfg["base_adapter"]:
                _warm_start(params, base_adapter_dir(job.registry, cfg["base_adapter"]))
            loop.refresh_order()
        causal = model.get_base_model()
        body, head = causal.get_decoder(), causal.get_output_embeddings()
        tensors = [
            (torch.tensor(ex.input_ids, dtype=torch.long).unsqueeze(0), torch.tensor(ex.labels[1:], dtype=torch.long))
            for ex in examples
        ]

        def publish() -> Path:
            done = _publish_checkpoint(job, loop, params, optimizer, lora_init_position)
            published.append(done.path)
            if on_checkpoint is not None:
                on_checkpoint(done)
            return done.path

        while loop.global_step < loop.total:
            index = loop.order[loop.cursor]
            ids, targets = tensors[index]
            t0 = time.perf_counter()
            hidden = body(input_ids=ids).last_hidden_state[0, :-1]
            loss = sft_loss(job.route, hidden, head.weight, targets, chunk_size=job.loss_route.chunk_size)
            t1 = time.perf_counter()
            value = float(loss.detach())
            if not torch.isfinite(loss.detach()):
                raise TrainingFailedError(
                    "nan_loss",
                    f"non-finite loss {value} at step {loop.global_step + 1} "
                    f"(epoch {loop.epoch_index + 1}, row {examples[index].row_index})",
                )
            loss.backward()
            t2 = time.perf_counter()
            norms = _grad_norms(params)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            timings["policy_forward_ms"] += (t1 - t0) * 1000
            timings["backward_ms"] += (t2 - t1) * 1000
            timings["optimizer_ms"] += (t3 - t2) * 1000
            loop.commit(value, norms)
            if progress:
                progress({"step": loop.global_step, "total": loop.total, "loss": value, "tokens": int(ids.shape[1])})
            if loop.global_step >= loop.total:
                break
            just_published = None
            if interval and loop.global_step % interval == 0:
                just_published = publish()
            if cancel is not None and cancel.is_set():
                where = just_published or publish()
                raise TrainingCancelledError(
                    f"cancelled after step {loop.global_step} of {loop.total}; resume from {where.name}"
                )
        delta_norms = lora_delta_norms(model)
        final = _final_state(params, optimizer, loop) if keep_final_state else None
        adapter_dir = stage_adapter(model, job.registry, job.adapter_name)
        receipt = _receipt(job, loop, timings, delta_norms, started, adapter_dir=adapter_dir)
        receipt_path = write_train_receipt(adapter_dir, receipt)
        manifest_path = write_adapter_manifest(adapter_dir, receipt)
        return SftResult(
            "success",
            adapter_dir,
            receipt_path,
            manifest_path,
            receipt,
            list(loop.losses),
            published,
            resumed_from=job.resume.path if job.resume else None,
            final_state=final,
        )
    except BaseException as exc:
        reason, message = classify_failure(exc)
        receipt = _receipt(job, loop, timings, delta_norms, started, failure=(reason, message))
        receipt_path = write_train_receipt(adapter_dir, receipt)
        if isinstance(exc, KeyboardInterrupt):
            raise
        return SftResult(
            "failed",
            adapter_dir,
            receipt_path,
            None,
            receipt,
            list(loop.losses),
            published,
            cancelled=reason == "cancelled",
            resumed_from=job.resume.path if job.resume else None,
        )


def _publish_checkpoint(job: AdmittedSft, loop: _Loop, params: Any, optimizer: Any, lora_init_position: int) -> Any:
    stateful = job.config["optimizer"]["kind"] != "sgd"

    def capture() -> tuple[Any, Any, dict[str, Any]]:
        return (
            adapter_tensors(params),
            optimizer_tensors(optimizer, params) if stateful else None,
            loop.as_document(),
        )

    def encode(snapshot: tuple[Any, Any, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, tuple[str, bytes]]]:
        adapter, slots, loop_doc = snapshot
        manifest = identity_manifest(job, lora_init_position=lora_init_position)
        step = loop_doc["global_step"]
        manifest["checkpoint_id"] = checkpoint_id(KIND, step)
        manifest["created_at"] = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        manifest["progress"] = {
            "global_step": step,
            "total_steps": loop.total,
            "epoch_index": loop_doc["epoch_index"],
            "cursor_in_epoch": loop_doc["cursor_in_epoch"],
            "data_order": list(loop.order),
        }
        manifest["rng_states"]["epoch-order"]["position"] = loop_doc["epoch_index"]
        manifest["optimizer"]["step"] = step
        manifest["scheduler"]["step"] = step
        files = {
            ADAPTER_FILE: ("adapter-parameters", encode_tensors(adapter)),
            LOOP_FILE: ("loss-history", contracts.render("SftLoopState", loop_doc)),
        }
        if slots is not None:
            files[OPTIMIZER_FILE] = ("optimizer-state", encode_tensors(slots))
        return manifest, files

    return publish_checkpoint(job.registry, capture, encode)


def _final_state(params: Any, optimizer: Any, loop: _Loop) -> FinalState:
    slots = optimizer_tensors(optimizer, params)
    return FinalState(
        encode_tensors(adapter_tensors(params)), encode_tensors(slots) if slots else None, loop.as_document()
    )


def base_adapter_dir(registry: Path, base_adapter: str) -> Path:
    """A registry name or an absolute path of a PEFT adapter directory."""
    path = Path(base_adapter)
    return path if path.is_absolute() else registry / base_adapter


def _warm_start(params: dict[str, Any], base_dir: Path) -> None:
    """Copy A/B from a PEFT adapter (weights only: no optimizer state, no data cursor)."""
    import torch
    from safetensors.torch import load_file

    weights = base_dir / "adapter_model.safetensors"
    if not weights.is_file():
        raise TrainingFailedError("base_adapter_missing", f"base adapter {base_dir} has no adapter_model.safetensors")
    saved = load_file(weights)
    with torch.no_grad():
        for name, param in params.items():
            key = name.replace(".default.", ".")
            if key not in saved:
                raise TrainingFailedError("shape_mismatch", f"base adapter {base_dir} has no tensor {key}")
            if tuple(saved[key].shape) != tuple(param.shape):
                raise TrainingFailedError(
                    "shape_mismatch",
                    f"base adapter tensor {key} has shape {tuple(saved[key].shape)}, the new adapter needs "
                    f"{tuple(param.shape)} (rank and target modules must match)",
                )
            param.copy_(saved[key].to(param.dtype))


def _grad_norms(params: dict[str, Any]) -> dict[str, float]:
    """L2 norm of the LoRA gradients of each target module at this step."""
    import torch

    named = [(name, param.grad) for name, param in params.items() if param.grad is not None]
    if not named:
        return {}
    # one host transfer per step for every parameter's squared norm
    values = torch.stack([grad.detach().pow(2).sum() for _, grad in named]).tolist()
    squares: dict[str, float] = {}
    for (name, _), value in zip(named, values, strict=True):
        module = module_of(name)
        squares[module] = squares.get(module, 0.0) + value
    return {module: sq**0.5 for module, sq in squares.items()}


# ----------------------------------------------------------------------------- the receipt


def _receipt(job, loop, timings, delta_norms, started, *, adapter_dir=None, failure=None) -> dict[str, Any]:
    cfg, record = job.config, job.ingestion.record
    examples = job.ingestion.examples
    per_epoch_action = sum(ex.supervised_tokens for ex in examples)
    per_epoch_context = sum(len(ex.input_ids) - 1 for ex in examples) - per_epoch_action
    epochs_done = (
        cfg["epochs"] if failure is None else min(cfg["epochs"], -(-loop.global_step // max(len(examples), 1)))
    )
    grad_norms = [
        {"module": m, "sample_count": int(a[0]), "min": a[2], "mean": a[1] / a[0], "max": a[3]}
        for m, a in sorted(loop.grad_norms.items())
    ]
    receipt = receipt_base(
        mode="sft",
        adapter_name=job.adapter_name,
        cfg=cfg,
        identity=job.identity,
        precision=job.precision,
        training_data={
            "source": record["source"],
            "path": record.get("source_locator"),
            "sha256": record["kept_corpus_sha256"],
        },
        started=started,
        epochs=cfg["epochs"],
        base_adapter_dir=base_adapter_dir(job.registry, cfg["base_adapter"]) if cfg["base_adapter"] else None,
        adapter_dir=adapter_dir,
        failure=failure,
        tokenize_ms=job.tokenize_ms,
        timings=timings,
        delta_norms=delta_norms,
        grad_norms=grad_norms,
    )
    receipt["hyperparameters"].update(shuffle=True, epoch_order_algorithm=ALGORITHM_ID)
    receipt["tokenizer"]["training_chat_template_hash"] = job.identity.training_chat_template_hash
    receipt["data"] = {
        "examples_read": record["rows_read"],
        "examples_filtered": record["rows_rejected"],
        "examples_trained": record["rows_kept"] * cfg["epochs"] if failure is None else loop.global_step,
        "groups_read": 0,
        "groups_filtered": 0,
        "groups_trained": 0,
        "completions_read": 0,
        "completions_trained": 0,
        "reward_groups_filtered": 0,
        "reward_groups_kept": 0,
        "sft_ingestion": record,
    }
    receipt["token_counts"] = {
        "action_tokens": per_epoch_action * epochs_done,
        "env_tokens": 0,
        "env_tokens_before_warning_filter": 0,
        "env_tokens_after_warning_filter": 0,
        "warning_tokens_filtered": 0,
        "context_tokens": per_epoch_context * epochs_done,
    }
    receipt["runtime"].update(
        sft_loss_route=job.route,
        sft_loss_chunk_size=job.loss_route.chunk_size,
        sft_loss_implementation=job.loss_route.implementation,
    )
    return receipt
