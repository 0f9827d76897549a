"""The trainer kit: what every trainer's run does the same way, as small components.

* ``TrainResult``: the one result type of a run, successful or failed;
* ``Run`` and ``guarded``: a trainer's run is an object (``SftRun``, ``GrpoRun``, ``OpdRun``) whose ``train()``
  goes setup -> loop -> publication; ``guarded`` runs it under the failure contract -- any exception after admission
  becomes a failed receipt (``Run.failed_receipt``) whose ``failure_reason`` comes from the exception's type
  (``kiln.training.classify_failure``; a write the file system refused is ``storage_error`` naming the path);
  Ctrl-C without cooperative cancellation still writes that receipt, then propagates. When not even the receipt
  can be written, the run raises ``RegistryError`` (``registry_unwritable``) saying why the run failed and why its
  receipt is missing;
* ``publish_adapter``: the adapter, its request lineage (``replay.jsonl``, ``lineage.json``), its receipt and its
  manifest, staged together and made visible by one rename (``kiln.adapters.publish.publish_trained_adapter``;
  ``publish_receipt_only``: a successful run without an adapter);
* ``Policy``: the LoRA policy of a run -- adapter attached with the seeded initialisation, every decoder layer
  recomputed in the backward pass when activation checkpointing is on, optimizer built, state
  restored from a checkpoint or warm-started from ``base_adapter``, the run's request record appended to the
  adapter's request log (``kiln.trainers._lineage``; its outcome follows when the run ends); ``Policy.accumulate``
  and ``Policy.apply`` are one optimizer step with the non-finite-loss check and the phase timings;
* ``RunTexts``: how the command line describes a kind's run (``artifact_lines``: where a run's files are);
* ``Cadence``: when to publish a checkpoint (every ``checkpoint_interval`` steps, never at the final step -- the
  adapter is published instead) and cooperative cancellation (publish at the settled boundary unless a checkpoint
  of that step exists, then fail ``cancelled`` naming it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kiln.adapters import RECEIPT_FILE, base_adapter_dir
from kiln.adapters.publish import publish_receipt, publish_trained_adapter
from kiln.checkpoints import PublishedCheckpoint, checkpoint_name, list_checkpoints
from kiln.documents.jsonio import JsonObject
from kiln.errors import CancelledError, NonFiniteLossError, RegistryError, StorageFailureError, storage_condition
from kiln.trainers._admission import AdmittedJob
from kiln.trainers._lineage import close_request, open_request, published, stage_lineage
from kiln.training import (
    EffectiveConfig,
    StepSync,
    attach_lora,
    checkpoint_layers,
    classify_failure,
    lora_parameters,
    warm_start,
)

if TYPE_CHECKING:
    import torch

    from kiln.checkpoints import LoadedCheckpoint

__all__ = [
    "Cadence",
    "FinalState",
    "Policy",
    "Progress",
    "Run",
    "RunProgress",
    "RunTexts",
    "TrainResult",
    "artifact_lines",
    "check_pin",
    "guarded",
    "publish_adapter",
    "publish_receipt_only",
]

Job = AdmittedJob[EffectiveConfig]
Progress = Callable[[JsonObject], None]
OnCheckpoint = Callable[[PublishedCheckpoint], None]
Failure = tuple[str, str]  # (failure_reason, failure_message)
PHASES = ("policy_forward_ms", "reference_forward_ms", "backward_ms", "optimizer_ms")


@dataclass
class FinalState:
    """The trainer's state after the last step, encoded like a checkpoint (for proofs)."""

    adapter: bytes
    optimizer: bytes | None
    loop_state: JsonObject


@dataclass
class TrainResult:
    """How a run ended and where its artifacts are."""

    status: str  # "success" | "failed"
    adapter_dir: Path
    receipt_path: Path
    manifest_path: Path | None
    receipt: JsonObject
    losses: list[float] = field(default_factory=list)
    checkpoints: list[Path] = field(default_factory=list)
    cancelled: bool = False
    resumed_from: Path | None = None
    final_state: FinalState | None = None

    @property
    def latest_checkpoint(self) -> Path | None:
        return self.checkpoints[-1] if self.checkpoints else self.resumed_from


@dataclass(frozen=True)
class RunTexts:
    """How the command line describes a run of a kind: its progress ``unit`` and ``metric``, the ``headline`` printed
    before it trains, the lines after a success, and what a ``--json`` summary adds for the kind. Each takes the
    kind's admitted job (and its ``TrainResult``)."""

    unit: str
    metric: str
    headline: Callable[..., str]
    success: Callable[..., list[str]]
    summary: Callable[..., JsonObject] | None = None


def artifact_lines(result: TrainResult) -> list[str]:
    """Where a successful run's adapter, receipt and manifest are."""
    return [f"Adapter:  {result.adapter_dir}", f"Receipt:  {result.receipt_path}", f"Manifest: {result.manifest_path}"]


class Run(Protocol):
    """A trainer's run of one admitted job: ``train`` is the whole run; ``failed_receipt`` the receipt of a run that
    stopped with ``failure`` (raised as ``exc``); ``losses`` and ``checkpoints`` what it has done so far."""

    @property
    def job(self) -> Job: ...

    def train(self) -> TrainResult: ...

    def failed_receipt(self, failure: Failure, exc: BaseException) -> JsonObject: ...

    @property
    def losses(self) -> list[float]: ...

    @property
    def checkpoints(self) -> list[Path]: ...


class RunProgress:
    """What every run object reports the same way: the losses of its loop so far and the checkpoints its cadence
    published (none before the cadence exists)."""

    loop: Any  # the kind's loop state, with its losses
    cadence: Cadence | None

    @property
    def losses(self) -> list[float]:
        return list(self.loop.losses)

    @property
    def checkpoints(self) -> list[Path]:
        return self.cadence.published if self.cadence is not None else []


def guarded(run: Run) -> TrainResult:
    """``run.train()``; on any exception write ``run.failed_receipt(...)`` and return a failed result carrying the
    losses and checkpoints so far. ``KeyboardInterrupt`` is re-raised after the receipt; a receipt the file system
    refuses raises ``RegistryError`` instead."""
    job = run.job
    try:
        return run.train()
    except BaseException as raised:
        exc = _as_failure(raised, job)
        failure = classify_failure(exc)
        receipt = run.failed_receipt(failure, exc)
        close_request(job, failure)
        if job.data_parallel.publishes:
            receipt_path = _write_failed_receipt(job, receipt, failure)
        else:  # rank 0 writes the run's receipt; this rank's failure ends the group, which rank 0 reports
            receipt_path = job.registry / job.adapter_name / RECEIPT_FILE
        if isinstance(exc, KeyboardInterrupt):
            raise
        return TrainResult(
            "failed",
            job.registry / job.adapter_name,
            receipt_path,
            None,
            receipt,
            losses=list(run.losses),
            checkpoints=list(run.checkpoints),
            cancelled=failure[0] == "cancelled",
            resumed_from=job.resume.path if job.resume is not None else None,
        )


def _as_failure(exc: BaseException, job: Job) -> BaseException:
    """A write the file system refused anywhere in the run, as the storage failure it is (naming its path)."""
    if isinstance(exc, OSError):
        return StorageFailureError.from_os_error(exc, doing=f"training adapter {job.adapter_name!r}") or exc
    return exc


def _write_failed_receipt(job: Job, receipt: JsonObject, failure: Failure) -> Path:
    target = job.registry / job.adapter_name
    try:
        return publish_receipt(job.registry, job.adapter_name, receipt)
    except OSError as exc:
        where = exc.filename if exc.filename is not None else target / RECEIPT_FILE  # a refused write names no file
        condition = storage_condition(exc.errno) if exc.errno is not None else str(exc)
        raise RegistryError(
            f"the run of adapter {job.adapter_name!r} failed ({failure[0]}: {failure[1]}), and its failed receipt "
            f"could not be written to {target}: {condition} at {where}",
            hint=f"make {job.registry} writable (or free space there), then run again; checkpoints published "
            "before the failure are kept and resume it",
        ) from exc


def check_pin(path: str | Path | None, pin: str | None) -> None:
    """A pinned dataset file still holds the bytes admitted; one that changed fails the run, naming it."""
    if pin is not None and path is not None:
        from kiln.data import check_unchanged

        check_unchanged(path, pin)


def publish_adapter(
    job: Job,
    model: Any,
    receipt: Callable[[Path], JsonObject],
    *,
    losses: list[float],
    checkpoints: list[Path],
    final_state: FinalState | None = None,
) -> TrainResult:
    """Publish the trained adapter with its receipt (``receipt(staged adapter directory)``) and manifest (rank 0 of
    a data-parallel group; the other ranks publish nothing and return where rank 0 publishes)."""
    if not job.data_parallel.publishes:
        target = job.registry / job.adapter_name
        return TrainResult(
            "success", target, target / RECEIPT_FILE, None, {}, losses=losses, checkpoints=checkpoints,
            final_state=final_state,
        )  # fmt: skip

    def staged(directory: Path) -> JsonObject:  # the request lineage is staged first; the receipt links it
        link = stage_lineage(job, directory)
        return receipt(directory) if link is None else {**receipt(directory), "request_lineage": link}

    done = publish_trained_adapter(model, job.registry, job.adapter_name, staged)
    published(job)
    return TrainResult(
        "success",
        done.path,
        done.receipt_path,
        done.manifest_path,
        done.receipt,
        losses=losses,
        checkpoints=checkpoints,
        resumed_from=job.resume.path if job.resume is not None else None,
        final_state=final_state,
    )


def publish_receipt_only(job: Job, receipt: JsonObject, *, losses: list[float] | None = None) -> TrainResult:
    """A successful run that publishes no adapter (a dry run; a filter that left nothing to train): its receipt
    (written by rank 0 of a data-parallel group; the other ranks write nothing)."""
    close_request(job, None)
    if not job.data_parallel.publishes:
        target = job.registry / job.adapter_name
        return TrainResult("success", target, target / RECEIPT_FILE, None, receipt, losses=list(losses or []))
    path = publish_receipt(job.registry, job.adapter_name, receipt)
    return TrainResult("success", job.registry / job.adapter_name, path, None, receipt, losses=list(losses or []))


Restore = Callable[["LoadedCheckpoint", dict[str, "torch.nn.Parameter"], "torch.optim.Optimizer"], None]


class Policy:
    """The LoRA policy of a run: model, trainable parameters by stable name, optimizer, phase timings."""

    def __init__(self, job: Job, *, restore: Restore | None = None) -> None:
        import torch

        cfg = job.config
        torch.manual_seed(0)  # nothing should draw from the global RNG; pin it anyway
        self.model = attach_lora(
            job.loaded.model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed, targets=cfg.targets
        )
        if cfg.gradient_checkpointing == "on":  # after the LoRA modules are in place: they are recomputed too
            checkpoint_layers(self.model.get_base_model())
        self.params = lora_parameters(self.model)
        self.optimizer = cfg.optimizer.build(list(self.params.values()), cfg.learning_rate)
        self.timings: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        # in a data-parallel group the finiteness of the step's summed loss is checked on every rank alike
        # (kiln.training.StepSync.reduce), so no rank stops alone and leaves the others waiting
        self.local_check = not job.data_parallel.active
        # the schedule: the rate of a step follows from its position alone (kiln.training.Schedule)
        self.schedule, self.base_rate, self.planned = cfg.lr_scheduler, cfg.learning_rate, job.schedule_steps
        self.steps_taken = job.start_step
        if job.resume is not None and restore is not None:
            restore(job.resume, self.params, self.optimizer)
        elif cfg.base_adapter:
            warm_start(self.params, base_adapter_dir(job.registry, cfg.base_adapter))
        open_request(job, self)  # the request record is on disk before the first optimizer step

    def accumulate(self, loss: torch.Tensor, where: Callable[[], str]) -> float:
        """Backward of one micro-batch's share of a step's loss, its gradients added to those already there; a
        non-finite loss fails the run ``nan_loss`` (``where()`` says where) before anything is added."""
        import torch

        value = float(loss.detach())
        if self.local_check and not torch.isfinite(loss.detach()):
            raise NonFiniteLossError(f"non-finite loss {value} at {where()}")
        t0 = time.perf_counter()
        loss.backward()
        self.timings["backward_ms"] += (time.perf_counter() - t0) * 1000
        return value

    def apply(self, before_step: Callable[[], None] | None = None, *, position: int | None = None) -> None:
        """One optimizer step with the accumulated gradients at the scheduled rate of ``position`` (default: the
        optimizer steps taken so far), then the gradients cleared."""
        t1 = time.perf_counter()
        if before_step is not None:
            before_step()
        rate = self.schedule.rate(self.base_rate, self.steps_taken if position is None else position, self.planned)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        self.optimizer.step()
        self.steps_taken += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.timings["optimizer_ms"] += (time.perf_counter() - t1) * 1000


class Cadence:
    """Checkpoint publication and cooperative cancellation after each settled step of a run."""

    def __init__(
        self,
        job: Job,
        publish: Callable[[], PublishedCheckpoint],
        cancel: threading.Event | None,
        on_checkpoint: OnCheckpoint | None = None,
        *,
        sync: StepSync | None = None,
    ) -> None:
        self.interval = job.config.checkpoint_interval
        self.publishes, self.sync = job.data_parallel.publishes, sync  # the step sync of a data-parallel group
        self.adapter_name = job.adapter_name
        self._publish = publish
        self.cancel = cancel
        self.on_checkpoint = on_checkpoint
        self.published: list[Path] = []
        # a checkpoint of a step may already exist: published by the run this one resumed from
        self.steps = {c.global_step for c in list_checkpoints(job.registry, job.adapter_name)}

    def publish(self, step: int) -> Path | None:
        """Publish a checkpoint of ``step`` (rank 0 of a group, once every rank is proven to hold its weights)."""
        if self.sync is not None:
            self.sync.check_same()
        if not self.publishes:
            self.steps.add(step)
            return None
        done = self._publish()
        self.published.append(done.path)
        self.steps.add(step)
        if self.on_checkpoint is not None:
            self.on_checkpoint(done)
        return done.path

    def settled(self, step: int, *, last: bool, due: bool, cancelled: Callable[[str], str]) -> None:
        """After a settled step (``step`` optimizer steps committed): publish when ``due``; on cancellation make
        sure a checkpoint of ``step`` exists and fail ``cancelled`` with ``cancelled(checkpoint name)``. Nothing
        happens after the last step: the run is complete and publishes its adapter."""
        if last:
            return
        if due:
            self.publish(step)
        if self.cancel is not None and self.cancel.is_set():
            if step not in self.steps:
                self.publish(step)
            raise CancelledError(cancelled(checkpoint_name(self.adapter_name, step)))

    def due(self, step: int) -> bool:
        """Every ``checkpoint_interval`` optimizer steps."""
        return self.interval is not None and self.interval > 0 and step % self.interval == 0
