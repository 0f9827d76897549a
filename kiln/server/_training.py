"""Training requests over HTTP: admission before queueing, revalidation and the run.

Admission (``admit``) runs in the request thread and does everything that can fail
before any model work: the request schema, the features Kiln does not execute, the
dataset path, the trainer's own admission (config rules, effective seed, data ingestion,
full checkpoint load and compatibility when resuming, loss route) and a memory estimate.
Only the replay request (every default resolved, seed and learning rate filled in) and a
fingerprint of what was admitted are kept; the worker admits the replay request again at
dequeue and refuses to train when the fingerprint changed (data bytes, checkpoint,
seed, loss route), naming what changed.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln.errors import CapacityError, ContractError, Problem, RequestError
from kiln.server._jobs import Job, Outcome

log = logging.getLogger("kiln.server.training")

REQUEST_TYPES = {"sft": "SftRequest", "grpo": "GrpoRequest", "opd": "OpdRequest"}


@dataclass
class Engine:
    """What admission and the worker share: the base model (pristine training copy) and settings."""

    settings: Any  # kiln.server._settings.Settings
    base: Any  # kiln.model.LoadedModel: pristine weights and a tokenizer of their own, never served
    generator: Any = None  # kiln.server._generation.Generator (auto_load, canaries, evaluations)
    admission_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    base_sha256: str = ""  # the base-weight content aggregate (evaluation targets)
    jobs: Any = None  # kiln.server._jobs.JobManager (the gate records its evaluation jobs there)

    @property
    def registry(self) -> Path:
        return self.settings.registry


def check_request(kind: str, body: Any) -> None:
    """The request schema, every problem reported with its JSON pointer."""
    found = contracts.problems(REQUEST_TYPES[kind], body)
    if found:
        raise ContractError(found, document=REQUEST_TYPES[kind])


def _sft_source(body: dict[str, Any]) -> tuple[list[Any] | None, str | None]:
    if body.get("dataset") is not None or "dataset_split" in body:
        raise RequestError(
            "named datasets (dataset, dataset_split) are not supported: Kiln has no dataset registry",
            code="training_backend_unsupported",
            hint="send the rows inline as examples, or a server-local JSONL file as dataset_path",
        )
    path = body.get("dataset_path")
    if path is None:
        return body["examples"], None
    if not os.path.isabs(path) or ".." in Path(path).parts:
        raise ContractError(
            [Problem("unsafe_path", "/dataset_path", f"dataset_path {path!r} must be an absolute path without '..'")],
            document="SftRequest",
        )
    if not Path(path).is_file():
        raise RequestError(
            f"dataset_path {path} is not a readable regular file on the server", code="training_invalid_request"
        )
    return None, path


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fingerprint(admitted: Any) -> dict[str, Any]:
    resume = admitted.resume
    return {
        "data_sha256": admitted.ingestion.corpus_sha256,
        "seed": str(admitted.config["seed"]),
        "loss_route": admitted.loss_route.route,
        "loss_chunk_size": admitted.loss_route.chunk_size,
        "checkpoint": _checkpoint_fingerprint(resume),
    }


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def estimate_memory(model: Any, admitted: Any) -> int:
    """A coarse upper bound of the run's extra host memory: a private copy of the weights, LoRA with
    gradients and two optimizer slots, activations of the longest row and the loss route's buffers."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    config = model.config
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    rank = int(admitted.config["lora_rank"])
    lora = layers * 7 * rank * (hidden + int(getattr(config, "intermediate_size", hidden))) * 4 * 4
    longest = max(len(ex.input_ids) for ex in admitted.ingestion.examples)
    activations = longest * hidden * layers * 4 * 32
    vocab = int(config.vocab_size)
    loss = (admitted.loss_route.chunk_size or vocab) * vocab * 4 + longest * hidden * 4 * 2
    return weights + lora + activations + loss


def admit(engine: Engine, kind: str, body: Any, jobs: Any) -> dict[str, Any]:
    """Admit a submission; returns the fields of the ``Job`` to queue. Raises ``KilnError``.

    A ``post_eval`` gate is checked here (suite registered, held out from the training data)
    and kept in the replay request; the trainers never see it."""
    from kiln.server import _evals

    check_request(kind, body)
    jobs.check_capacity()  # cheap, before the expensive part
    if kind == "sft":
        _sft_source(body)  # named datasets are refused before the suite is read
    post, suite_sha256 = _evals.check_post_eval(engine, kind, body)
    trainer_body = _evals.without_gate(body)
    admit_kind = {"sft": _admit_sft, "grpo": _admit_grpo, "opd": _admit_opd}[kind]
    fields = admit_kind(engine, trainer_body, jobs)
    if post is not None:
        fields["request"]["post_eval"] = post
        fields["fingerprint"]["suite_sha256"] = suite_sha256
    return fields


def _admit_sft(engine: Engine, body: dict[str, Any], jobs: Any) -> dict[str, Any]:
    from kiln.trainers.sft import admit_sft

    kind = "sft"
    examples, dataset_path = _sft_source(body)
    config = dict(body.get("config") or {})
    auto_load = bool(config.pop("auto_load", True))
    adapter = config.get("output_name") or f"sft-{uuid.uuid4().hex[:8]}"
    config["output_name"] = adapter
    if config.get("checkpoint_interval") is None:
        config["checkpoint_interval"] = engine.settings.get("training", "checkpoint_interval")
    resume = config.get("resume_checkpoint")
    _writer_conflict(jobs, adapter)
    with engine.admission_lock:
        admitted = admit_sft(
            adapter_name=adapter,
            registry=engine.registry,
            config=config,
            examples=examples,
            dataset_path=dataset_path,
            loaded=engine.base,
        )
    need, have = estimate_memory(engine.base.model, admitted), _available_memory()
    if have is not None and need > have:
        raise CapacityError(
            f"the job needs about {need / 2**30:.1f} GiB of host memory and {have / 2**30:.1f} GiB is available",
            code="memory_budget_exceeded",
            hint="use shorter conversations, a smaller lora_rank, or free memory on the server",
        )
    replay_config = {**admitted.config, "auto_load": auto_load}
    if resume is not None:
        replay_config["resume_checkpoint"] = resume
    replay: dict[str, Any] = {"config": replay_config}
    if dataset_path is not None:
        replay["dataset_path"] = str(Path(dataset_path).resolve())
    else:
        replay["examples"] = examples
    start = admitted.start_step
    history: list[dict[str, Any]] = []
    if admitted.resume is not None:
        rows = len(admitted.ingestion.examples)
        for step, loss in enumerate(admitted.resume.loop_state["loss_history"], start=1):
            history.append(
                {
                    "epoch": (step - 1) // rows + 1,
                    "progress": step / admitted.total_steps,
                    "loss": loss,
                    "elapsed_secs": 0.0,
                }
            )
    return {
        "job_type": kind,
        "adapter_name": adapter,
        "effective_seed": str(admitted.config["seed"]),
        "request": replay,
        "fingerprint": _fingerprint(admitted),
        "auto_load": auto_load,
        "total_steps": admitted.total_steps,
        "progress": start / admitted.total_steps if admitted.total_steps else 0.0,
        "current_loss": history[-1]["loss"] if history else None,
        "loss_history": history,
    }


def _writer_conflict(jobs: Any, adapter: str) -> None:
    writer = jobs.writer_of(adapter)
    if writer is not None:
        from kiln.errors import ConflictError

        raise ConflictError(
            f"job {writer.job_id} ({writer.state}) already writes adapter {adapter!r}",
            code="adapter_exists",
            hint="choose another config.output_name, or wait for that job to finish",
        )


def _with_config(body: dict[str, Any], config: dict[str, Any], document: str) -> dict[str, Any]:
    """The request a GRPO or OPD trainer admits: a path-safe ``dataset_path`` and the given config."""
    path = body.get("dataset_path")
    if path is not None and (not os.path.isabs(path) or ".." in Path(path).parts):
        raise ContractError(
            [Problem("unsafe_path", "/dataset_path", f"dataset_path {path!r} must be an absolute path without '..'")],
            document=document,
        )
    return {**body, "config": config}


def _grpo_request(body: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    return _with_config(body, config, "GrpoRequest")


def _checkpoint_fingerprint(resume: Any) -> dict[str, Any] | None:
    if resume is None:
        return None
    return {"name": resume.path.name, "manifest_sha256": _file_sha256(resume.path / "checkpoint_manifest.json")}


def _grpo_fingerprint(admitted: Any) -> dict[str, Any]:
    resume = admitted.resume
    return {
        "data_sha256": admitted.ingestion.source_sha256,
        "seed": str(admitted.config["seed"]),
        "checkpoint": _checkpoint_fingerprint(resume),
    }


def _admit_grpo(engine: Engine, body: dict[str, Any], jobs: Any) -> dict[str, Any]:
    """GRPO admission: the trainer's own (request and config rules, pinned source, every group
    tokenised with its masks, identity); the fingerprint is the source digest and the seed."""
    from kiln.trainers.grpo import admit_grpo

    config = dict(body.get("config") or {})
    auto_load = bool(config.pop("auto_load", True))
    adapter = config.get("output_name") or f"grpo-{uuid.uuid4().hex[:8]}"
    config["output_name"] = adapter
    if config.get("checkpoint_interval") is None and not body.get("dry_run"):
        config["checkpoint_interval"] = engine.settings.get("training", "checkpoint_interval")
    _writer_conflict(jobs, adapter)
    with engine.admission_lock:
        admitted = admit_grpo(
            adapter_name=adapter, registry=engine.registry, request=_grpo_request(body, config), loaded=engine.base
        )
    replay = {k: v for k, v in body.items() if k != "config"}
    replay["config"] = {**admitted.config, "auto_load": auto_load}
    return {
        "job_type": "grpo",
        "adapter_name": adapter,
        "effective_seed": str(admitted.config["seed"]),
        "request": replay,
        "fingerprint": _grpo_fingerprint(admitted),
        "auto_load": auto_load and not admitted.dry_run,
        "total_steps": max(1, len(admitted.ingestion.groups)),
    }


def _run_grpo(engine: Engine, job: Job, cancel: threading.Event, report: Callable[[dict[str, Any]], None]) -> Outcome:
    from kiln.trainers.grpo import admit_grpo, run_grpo

    config = dict(job.request["config"])
    config.pop("auto_load", None)
    with engine.admission_lock:
        admitted = admit_grpo(
            adapter_name=job.adapter_name,
            registry=engine.registry,
            request=_grpo_request(without_gate(job.request), config),
            loaded=engine.base,
        )
    changed = _changed(job.fingerprint, _grpo_fingerprint(admitted))
    if changed:
        return _revalidation_failed(changed)
    if not admitted.dry_run:
        admitted.loaded = dataclasses.replace(engine.base, model=copy.deepcopy(engine.base.model))
    result = run_grpo(admitted, progress=report, cancel=cancel)
    admitted.loaded = None
    if result.status != "success":
        return _run_failed(result)
    if result.manifest_path is not None:
        _activate(engine, job, cancel)
    return Outcome(
        "completed", None, str(result.receipt_path), str(result.adapter_dir) if result.manifest_path else None
    )


def _opd_request(body: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    return _with_config(body, config, "OpdRequest")


def _opd_fingerprint(admitted: Any) -> dict[str, Any]:
    resume = admitted.resume
    source = admitted.source
    return {
        "data_sha256": source.source_sha256 if admitted.route == "prompts" else source.sha256,
        "seed": str(admitted.config["seed"]),
        "teacher": f"{admitted.teacher.alias} identity {admitted.teacher_identity_revision} "
        f"content {admitted.teacher_content_revision}",
        "checkpoint": _checkpoint_fingerprint(resume),
    }


def _admit_opd_with(engine: Engine, adapter: str, body: dict[str, Any], config: dict[str, Any]) -> Any:
    from kiln.teachers import teachers_root
    from kiln.trainers.opd import admit_opd

    with engine.admission_lock:
        return admit_opd(
            adapter_name=adapter,
            registry=engine.registry,
            request=_opd_request(body, config),
            teachers_root=teachers_root(engine.settings.home),
            loaded=engine.base,
            server_checkpoint_interval=engine.settings.get("training", "checkpoint_interval"),
        )


def _admit_opd(engine: Engine, body: dict[str, Any], jobs: Any) -> dict[str, Any]:
    """OPD admission: the trainer's own (request and config rules, the teacher looked up and
    re-probed, vocabulary agreement, prompts or the pre-scored file, identity, resume); the
    fingerprint adds the teacher's pinned revisions to the source digest and seed."""
    config = dict(body.get("config") or {})
    auto_load = bool(config.pop("auto_load", True))
    adapter = config.get("output_name") or f"opd-{uuid.uuid4().hex[:8]}"
    config["output_name"] = adapter
    _writer_conflict(jobs, adapter)
    admitted = _admit_opd_with(engine, adapter, body, config)
    replay = {k: v for k, v in body.items() if k != "config"}
    replay["config"] = {**admitted.config, "auto_load": auto_load}
    if config.get("resume_checkpoint") is not None:
        replay["config"]["resume_checkpoint"] = config["resume_checkpoint"]
    return {
        "job_type": "opd",
        "adapter_name": adapter,
        "effective_seed": str(admitted.config["seed"]),
        "request": replay,
        "fingerprint": _opd_fingerprint(admitted),
        "auto_load": auto_load,
        "total_steps": admitted.total_steps,
    }


def _run_opd(engine: Engine, job: Job, cancel: threading.Event, report: Callable[[dict[str, Any]], None]) -> Outcome:
    """Re-admit at dequeue (which re-probes the teacher), train on a private copy, then auto-load."""
    from kiln.trainers.opd import run_opd

    config = dict(job.request["config"])
    config.pop("auto_load", None)
    admitted = _admit_opd_with(engine, job.adapter_name, without_gate(job.request), config)
    changed = _changed(job.fingerprint, _opd_fingerprint(admitted))
    if changed:
        return _revalidation_failed(changed)
    admitted.loaded = dataclasses.replace(engine.base, model=copy.deepcopy(engine.base.model))

    def progress(event: dict[str, Any]) -> None:
        if event.get("loss") is not None:  # an empty rollout settles its candidate without a loss
            report(event)

    result = run_opd(admitted, progress=progress, cancel=cancel)
    admitted.loaded = None
    if result.status != "success":
        return _run_failed(result)
    _activate(engine, job, cancel)
    return Outcome("completed", None, str(result.receipt_path), str(result.adapter_dir))


def _revalidation_failed(changed: list[str]) -> Outcome:
    return Outcome(
        "failed",
        "revalidation_failed: changed since the job was admitted: "
        + "; ".join(changed)
        + ". Nothing was trained; submit the job again",
    )


def _run_failed(result: Any) -> Outcome:
    """A trainer's failed result as the job's outcome: reason and message, the failed receipt."""
    receipt = result.receipt
    error = f"{receipt['failure_reason']}: {receipt.get('failure_message') or 'no detail'}"
    return Outcome("failed", error, str(result.receipt_path), None)


def _changed(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    labels = {
        "data_sha256": "the training data",
        "teacher": "the teacher",
        "seed": "the effective seed",
        "loss_route": "the loss route",
        "loss_chunk_size": "the loss chunk size",
        "checkpoint": "the resume checkpoint",
    }
    return [f"{labels[k]} ({before.get(k)} → {now.get(k)})" for k in labels if before.get(k) != now.get(k)]


def run(engine: Engine, job: Job, cancel: threading.Event, report: Callable[[dict[str, Any]], None]) -> Outcome:
    """Revalidate the job at dequeue, train it on a private copy of the weights, then auto-load."""
    from kiln.server import _evals
    from kiln.trainers.sft import admit_sft, run_sft

    if job.job_type == "eval":
        return _evals.run_job(engine, job, cancel)
    active = engine.generator.active() if engine.generator is not None else None
    job.active_before = active["name"] if active else None
    if job.job_type == "grpo":
        return _run_grpo(engine, job, cancel, report)
    if job.job_type == "opd":
        return _run_opd(engine, job, cancel, report)
    body = _evals.without_gate(job.request)
    config = dict(body["config"])
    config.pop("auto_load", None)
    with engine.admission_lock:
        admitted = admit_sft(
            adapter_name=job.adapter_name,
            registry=engine.registry,
            config=config,
            examples=body.get("examples"),
            dataset_path=body.get("dataset_path"),
            loaded=engine.base,
        )
    changed = _changed(job.fingerprint, _fingerprint(admitted))
    if changed:
        return _revalidation_failed(changed)
    admitted.loaded = dataclasses.replace(engine.base, model=copy.deepcopy(engine.base.model))

    def checkpoint_landed(published: Any) -> None:
        t = published.timings
        report({"kind": "checkpoint", "seconds": (t.capture_ms + t.encode_ms + t.write_ms) / 1000})

    result = run_sft(admitted, progress=report, cancel=cancel, on_checkpoint=checkpoint_landed)
    admitted.loaded = None  # drop the private weights now, not when the job record goes
    if result.status != "success":
        return _run_failed(result)
    _activate(engine, job, cancel)
    return Outcome("completed", None, str(result.receipt_path), str(result.adapter_dir))


def without_gate(body: dict[str, Any]) -> dict[str, Any]:
    from kiln.server._evals import without_gate as strip

    return strip(body)


def _activate(engine: Engine, job: Job, cancel: threading.Event) -> None:
    """After a successful run: the gate decides when the request has one, else ``auto_load``."""
    if engine.generator is None:
        return
    if job.request.get("post_eval") is not None:
        from kiln.server._evals import run_gate

        try:
            job.gate = run_gate(engine, job, cancel, getattr(job, "active_before", None))
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
