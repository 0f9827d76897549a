"""The training job type on the server: admission before queueing, then the run (revalidation, training,
activation).

Admission (``admit``) runs in the request thread and does everything that can fail before any model work: the
request parsed into its kind's model at the door, what it may read, the ``post_eval`` gate, the trainer's own
admission (config rules, effective seed, data ingestion, full checkpoint load and compatibility when resuming, loss
route, the memory plan). Only the replay request (every default resolved, seed and learning rate filled in)
and a fingerprint of what was admitted are kept; the worker admits the replay request again at dequeue and refuses
to train when the fingerprint changed (data bytes, checkpoint, seed, loss route, teacher), naming what changed. Every
kind goes through the same path: ``kiln.trainers.TRAINERS[kind]`` admits and runs it. After a successful run the
gate (``kiln.server._evals.run_gate``) or ``auto_load`` decides what is served; the queue (``kiln.server._jobs``)
calls ``run`` for every training kind, and ``kiln.server._evals.run_job`` for evaluation jobs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifacts.worker_spec import WorkerSpec, build_worker_spec
from kiln.documents.jsonio import JsonObject
from kiln.errors import ConflictError
from kiln.jobs.worker import run_spec
from kiln.server._jobs import Job, Outcome
from kiln.trainers import TRAINERS, TrainingContext

log = logging.getLogger("kiln.server.training")


@dataclass
class Engine:
    """What admission and the worker share: the base model (pristine training copy) and settings."""

    settings: Any  # kiln.host.config.Settings
    base: Any  # kiln.model.LoadedModel: pristine weights and a tokenizer of their own, never served
    generator: Any = None  # kiln.server._generation.Generator (auto_load, canaries, evaluations)
    admission_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    base_sha256: str = ""  # the base-weight content aggregate (evaluation targets)
    jobs: Any = None  # kiln.server._jobs.JobManager (the gate records its evaluation jobs there)
    model_path: Path | None = None  # where the base model lies (a training worker loads it from there)
    model_is_default: bool = False  # the built-in tiny model
    serving: Any = None  # kiln.server._serving.Serving: the serving copy, released beside a job when the policy says

    @property
    def registry(self) -> Path:
        return self.settings.registry

    def ranks(self, kind: str) -> int:
        """The data-parallel ranks a job of ``kind`` trains with: ``training.nproc_per_node`` for a kind that trains
        over several ranks (SFT) in worker processes, else 1."""
        if self.settings.training.worker == "thread" or not TRAINERS[kind].data_parallel:
            return 1  # a thread of the server is one process
        return self.settings.training.nproc_per_node

    def worker_threads(self) -> int:
        """The intra-op threads of a training worker process: ``training.worker_threads``, else all of this
        process's but one (at least 1), so the server keeps a core while a job trains."""
        import torch

        configured = self.settings.training.worker_threads
        return configured if configured is not None else max(1, torch.get_num_threads() - 1)

    def context(self, kind: str | None = None) -> TrainingContext:
        """Where the trainers admit and run: the server's registry, its base model, teachers and interval, and for
        ``kind`` the worker processes (ranks, threads) it will train in."""
        from kiln.teachers import teachers_root
        from kiln.training import DataParallel, MemorySettings

        in_workers = kind is not None and self.settings.training.worker == "process"
        memory = MemorySettings.of(self.settings.training)
        if self.serving is not None:  # the planner counts the serving copy beside the job
            memory = dataclasses.replace(memory, serving_copy=self.serving.planned())
        return TrainingContext(
            data_parallel=DataParallel.planned(self.ranks(kind), threads=self.worker_threads())
            if kind is not None and in_workers
            else DataParallel(),
            registry=self.registry,
            loaded=self.base,
            teachers_root=teachers_root(self.settings.home),
            checkpoint_interval=self.settings.training.checkpoint_interval,
            data_roots=self.settings.data_roots,
            memory=memory,
        )

    def job_device(self, job: Job) -> str:
        """Where ``job`` trains: its config's ``device`` (admission wrote the server's ``training.device`` there when
        the request set none), resolved on this machine as the worker resolves it."""
        from kiln.model import resolve_device

        config = job.request.get("config")
        setting = config.get("device") if isinstance(config, dict) else None
        return resolve_device(str(setting or self.settings.training.device))


def admit(engine: Engine, kind: str, body: JsonObject, jobs: Any) -> JsonObject:
    """Admit a submission; returns the fields of the ``Job`` to queue. Raises ``KilnError``.

    The body becomes its kind's request model at the door (``Trainer.parse``: schema, canonical numbers, every
    problem with its pointer); then, cheap checks first: the queue's capacity, what the request may read
    (``Trainer.check_door``, before anything opens a file it names), the ``post_eval`` gate (suite registered, held
    out from the training data; kept in the replay request, never seen by the trainer), the adapter's writer, and
    the trainer's own admission against the server's pristine base model (with its memory plan)."""
    from kiln.server import _evals

    trainer = TRAINERS[kind]
    request = trainer.parse(body)
    jobs.check_capacity()
    context = engine.context(kind)
    trainer.check_door(request, context)
    post, suite_sha256 = _evals.check_post_eval(engine, kind, request.sent)
    config = trainer.config_of(request)
    adapter = config.output_name.root if config.output_name is not None else f"{kind}-{uuid.uuid4().hex[:8]}"
    _writer_conflict(jobs, adapter)
    with engine.admission_lock:
        admitted = trainer.admit_request(request.without_gate(), adapter_name=adapter, context=context)
    replay = {k: v for k, v in request.sent.items() if k not in ("config", "post_eval")}  # the data as sent
    if replay.get("dataset_path") is not None:
        replay["dataset_path"] = str(Path(replay["dataset_path"]).resolve())
    resume = None if config.resume_checkpoint is None else config.resume_checkpoint.root
    # the replay names the device setting (the request's, else the server's training.device): the worker resolves it
    replay["config"] = {**admitted.replay_config(resume), "auto_load": config.auto_load}
    history = admitted.resumed_history()
    total = admitted.total_steps
    fields: JsonObject = {
        "job_type": kind,
        "adapter_name": adapter,
        "effective_seed": str(admitted.config.seed),
        "request": replay,
        "fingerprint": admitted.fingerprint(),
        "auto_load": config.auto_load and not admitted.dry_run,
        "total_steps": max(1, total),
        "progress": admitted.start_step / total if total else 0.0,
        "current_loss": history[-1]["loss"] if history else None,
        "loss_history": history,
    }
    if post is not None:
        fields["request"]["post_eval"] = post
        fields["fingerprint"]["suite_sha256"] = suite_sha256
    return fields


def _writer_conflict(jobs: Any, adapter: str) -> None:
    writer = jobs.writer_of(adapter)
    if writer is not None:
        raise ConflictError(
            f"job {writer.job_id} ({writer.state}) already writes adapter {adapter!r}",
            code="adapter_exists",
            hint="choose another config.output_name, or wait for that job to finish",
        )


def job_spec(engine: Engine, job: Job, events: Path | None, context: TrainingContext | None = None) -> WorkerSpec:
    """The ``kiln.worker-spec.v1`` that trains ``job``: its replay request (the gate taken out: it is the server's)
    and where it trains (``context``, by default the engine's)."""
    context = engine.context(job.job_type) if context is None else context
    assert engine.model_path is not None
    return build_worker_spec(
        kind=job.job_type,
        adapter_name=job.adapter_name,
        request={k: v for k, v in job.request.items() if k != "post_eval"},
        fingerprint=job.fingerprint,
        events=events,
        server_pid=os.getpid(),  # the worker ends when this process does
        # more than 1 rank: torchrun, one process per rank, each with the threads admission recorded for it
        launch={"nproc_per_node": engine.ranks(job.job_type), "threads_per_rank": context.data_parallel.threads},
        registry=context.registry,
        model_path=engine.model_path,
        model_is_default=engine.model_is_default,
        teachers_root=context.teachers_root,
        checkpoint_interval=context.checkpoint_interval,
        data_roots=context.data_roots,
        memory_limit_bytes=context.memory.memory_limit_bytes,
        serving_copy=None if context.memory.serving_copy is None else dataclasses.asdict(context.memory.serving_copy),
    )


def run(engine: Engine, job: Job, cancel: threading.Event, report: Callable[[dict[str, Any]], None]) -> Outcome:
    """Train the job -- in a worker process (``training.worker = "process"``, the default) or in this thread
    (``"thread"``); either way the same ``kiln.jobs.worker.run_spec`` revalidates it at dequeue, trains and publishes --
    then activate what it published. The serving copy is released around the training when ``training.serving_copy``
    says so (``kiln.server._serving``), and is back on its device before the activation."""
    active = engine.generator.active() if engine.generator is not None else None
    with engine.serving.beside(engine.job_device(job)) if engine.serving is not None else contextlib.nullcontext():
        found = _train(engine, job, cancel, report)
    outcome = Outcome(found["state"], found["error"], found["receipt_path"], found["adapter_path"])
    if outcome.state == "completed" and found["activate"]:
        _activate(engine, job, cancel, active["name"] if active else None)
    return outcome


def _train(engine: Engine, job: Job, cancel: threading.Event, report: Callable[[dict[str, Any]], None]) -> JsonObject:
    """The worker's outcome of ``job`` (``kiln.jobs.worker.outcome_of``), in a process or a thread of the server."""
    from kiln.server import _worker_process

    if engine.settings.training.worker == "thread":

        def private_weights(admitted: Any) -> None:
            # the server's pristine base is never trained; weights admission loaded for the job (another precision)
            # are the job's own already
            if admitted.loaded.model is engine.base.model:
                admitted.loaded = dataclasses.replace(admitted.loaded, model=copy.deepcopy(engine.base.model))

        context = engine.context()
        found = run_spec(
            job_spec(engine, job, None, context=context),
            lambda event: _worker_process.forward(event, report),
            cancel,
            context=context,
            admission_lock=engine.admission_lock,
            private_weights=private_weights,
        )
        return found
    spec = job_spec(engine, job, _worker_process.events_file(engine, job))
    return _worker_process.launch(engine, job, spec, cancel, report)


def _activate(engine: Engine, job: Job, cancel: threading.Event, active_before: str | None) -> None:
    """After a successful run: the gate decides when the request has one (against ``active_before``, the adapter
    served when the job started), else ``auto_load``."""
    if engine.generator is None:
        return
    if job.request.get("post_eval") is not None:
        from kiln.server._evals import run_gate

        try:
            job.gate = run_gate(engine, job, cancel, active_before)
        except Exception:  # the training job succeeded; a broken gate must not fail it
            log.exception("the gate of job %s failed", job.job_id)
        return
    if job.auto_load:
        _auto_load(engine, job.adapter_name)


def _auto_load(engine: Engine, name: str) -> None:
    """Serve the new adapter once its canary passes; a quarantined adapter is never activated."""
    try:
        status = engine.generator.run_canary(name)
        if status["status"] == "passed":
            engine.generator.load(name)
        else:
            log.warning("adapter %s quarantined by its canary: %s", name, status["failure_reason"])
    except Exception:  # the training job succeeded; serving it is a separate, reported concern
        log.exception("auto_load of adapter %s failed", name)
