"""Jobs -- training, evaluation and audit (``family``) -- in the SQLite store, the FIFO queue and the one worker.

Every job lives in memory (status reads never touch the disk) and is mirrored to SQLite on
each transition and, at most twice a second, on progress. A request's inline data is
stored once, by digest, and each job row refers to it, so a progress tick writes the small
job row and the new loss points, never the dataset again. On start the store is read back: queued jobs queue again in submission order; a job that was running when the
process died becomes ``failed`` with reason ``interrupted``, naming the newest checkpoint of
its adapter that resumes it -- or saying it published none, so only a fresh run continues it.

States: ``queued → running → completed | failed``. Cancelling a queued job fails it at
once (``cancelled: removed from the queue``); cancelling a running job sets its cancel
event: the trainer finishes the step, publishes a checkpoint and fails with reason
``cancelled``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sqlite3
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln.documents.digests import prefixed
from kiln.documents.jsonio import canonical_json
from kiln.errors import CapacityError, ConflictError, KilnError, NotFoundError

log = logging.getLogger("kiln.server.jobs")

TERMINAL = ("completed", "failed")
LOSS_HISTORY_LIMIT = 2000  # points kept per job; longer curves are thinned evenly
PROGRESS_WRITE_INTERVAL_S = 0.5


def _now_ms() -> int:
    return int(time.time() * 1000)


def _rfc3339(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


# each family -- the training kinds, evaluations, audits -- has its job-id prefix, its name and its listing route
FAMILIES = {"training": ("job", "training", "/v1/train/status"), "eval": ("eval", "evaluation", "/v1/eval/jobs"),
            "audit": ("audit", "audit", "/v1/audits")}  # fmt: skip


def family(job_type: str) -> str:
    """``eval`` and ``audit`` jobs are their own families; every other type is a training kind."""
    return job_type if job_type in ("eval", "audit") else "training"


@dataclass
class Job:
    """One training job; ``request`` is the replay request (every default resolved)."""

    job_id: str
    seq: int
    job_type: str
    adapter_name: str
    effective_seed: str
    request: dict[str, Any]
    fingerprint: dict[str, Any]
    auto_load: bool
    total_steps: int
    state: str = "queued"
    submitted_ms: int = field(default_factory=_now_ms)
    started_ms: int | None = None
    finished_ms: int | None = None
    progress: float = 0.0
    current_loss: float | None = None
    epoch: int | None = None
    error: str | None = None
    receipt_path: str | None = None
    adapter_path: str | None = None
    loss_history: list[dict[str, Any]] = field(default_factory=list)
    cancel_requested: bool = False
    tokens: int = 0
    # evaluation jobs (job_type "eval") and the gate of a training job
    role: str | None = None  # eval: standalone | baseline | candidate
    linked_training_job_id: str | None = None
    result: dict[str, Any] | None = None  # eval: the EvalResult
    linked_eval_job_ids: list[str] = field(default_factory=list)  # training: the gate's evaluations
    gate: dict[str, Any] | None = None  # training: the GateVerdict

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def elapsed_secs(self) -> float:
        if self.started_ms is None:
            return 0.0
        end = self.finished_ms if self.finished_ms is not None else _now_ms()
        return max(0.0, (end - self.started_ms) / 1000)

    def status(self) -> dict[str, Any]:
        """``TrainingStatus``."""
        out: dict[str, Any] = {
            "job_id": self.job_id,
            "state": self.state,
            "progress": min(1.0, max(0.0, self.progress)),
            "current_loss": self.current_loss,
            "adapter_name": self.adapter_name,
            "effective_seed": self.effective_seed,
            "started_at": _rfc3339(self.started_ms if self.started_ms is not None else self.submitted_ms),
            "elapsed_secs": round(self.elapsed_secs(), 3),
            "submitted_unix_ms": self.submitted_ms,
            "job_type": self.job_type,
        }
        return {**out, **self.ending()}

    def ending(self) -> dict[str, int | str]:
        """What every job body adds once the job ended: ``finished_unix_ms``, and ``error`` when it failed."""
        ended: dict[str, int | str] = {} if self.finished_ms is None else {"finished_unix_ms": self.finished_ms}
        return {**ended, "error": self.error} if self.state == "failed" and self.error else ended

    def record_loss(self, loss: float, step: int, total: int, rows_per_epoch: int, reward: float | None = None) -> None:
        """A committed step's point of the loss curve (``reward``: online GRPO's mean reward of the step)."""
        self.current_loss = loss
        self.progress = step / total if total else 1.0
        self.epoch = (step - 1) // rows_per_epoch + 1 if rows_per_epoch else 1
        elapsed = round(self.elapsed_secs(), 3)
        point = {"epoch": self.epoch, "progress": self.progress, "loss": loss, "elapsed_secs": elapsed}
        self.loss_history.append(point if reward is None else {**point, "reward": reward})
        if len(self.loss_history) > LOSS_HISTORY_LIMIT:  # keep every other point, and always the newest
            newest = self.loss_history[-1]
            self.loss_history = self.loss_history[::2]
            if self.loss_history[-1] is not newest:
                self.loss_history.append(newest)


INLINE_FIELDS = ("examples", "groups", "agentic_groups", "prompts")  # a request's inline data, stored by digest


@dataclass
class _Persisted:
    """What the store last wrote for one job: each inline list (by identity) with its digest, and the loss curve's
    length and last point (by identity), so the next save writes only what changed."""

    inline: dict[str, tuple[Any, str]] = field(default_factory=dict)
    points: int = 0
    last_point: Any = None


class JobStore:
    """SQLite mirror of the jobs.

    * ``jobs``: one row per job, the job as JSON without its inline data and its loss curve;
    * ``inline_data``: each inline list (``examples``, ``groups``, ``agentic_groups``, ``prompts``) once, as
      canonical JSON under its SHA-256, whatever number of jobs name it (``job_inline`` holds the references);
    * ``loss_points``: the loss curve, appended point by point (rewritten only when the curve is thinned).

    A save is one transaction; a progress tick therefore writes the small job row and the new loss points, never
    the dataset. ``load`` checks every inline blob against its digest before a job is rebuilt from it.
    """

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._persisted: dict[str, _Persisted] = {}
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        for table in (
            "jobs (job_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, state TEXT NOT NULL, doc TEXT NOT NULL)",
            "inline_data (sha256 TEXT PRIMARY KEY, body BLOB NOT NULL)",
            "job_inline (job_id TEXT NOT NULL, field TEXT NOT NULL, sha256 TEXT NOT NULL, "
            "PRIMARY KEY (job_id, field)) WITHOUT ROWID",
            "loss_points (job_id TEXT NOT NULL, position INTEGER NOT NULL, point TEXT NOT NULL, "
            "PRIMARY KEY (job_id, position)) WITHOUT ROWID",
        ):
            self._db.execute(f"CREATE TABLE IF NOT EXISTS {table}")

    def job_directory(self, job_id: str) -> Path:
        """Where a job's worker keeps its spec, events and log (``kiln.server._worker_process``)."""
        return self.path.parent / "jobs" / job_id

    def save(self, job: Job) -> None:
        with self._lock:
            before = self._persisted.get(job.job_id, _Persisted())
            after = _Persisted(points=before.points, last_point=before.last_point)
            request = {k: v for k, v in job.request.items() if k not in INLINE_FIELDS}
            blobs: list[tuple[str, bytes]] = []
            for key in INLINE_FIELDS:
                if key not in job.request:
                    continue
                value = job.request[key]
                known = before.inline.get(key)
                if known is not None and known[0] is value:
                    after.inline[key] = known
                    continue
                body = canonical_json(value)
                digest = prefixed(hashlib.sha256(body).hexdigest())
                after.inline[key] = (value, digest)
                blobs.append((digest, body))
            doc = {f.name: getattr(job, f.name) for f in fields(Job) if f.name != "loss_history"}
            doc["request"] = request
            doc["inline_data"] = {key: digest for key, (_, digest) in after.inline.items()}
            history = list(job.loss_history)
            appended = before.points <= len(history) and (
                before.points == 0 or history[before.points - 1] is before.last_point
            )
            start = before.points if appended else 0
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if blobs or set(after.inline) != set(before.inline):
                    self._db.execute("DELETE FROM job_inline WHERE job_id = ?", (job.job_id,))
                    for digest, body in blobs:
                        self._db.execute(
                            "INSERT OR IGNORE INTO inline_data (sha256, body) VALUES (?, ?)", (digest, body)
                        )
                    self._db.executemany(
                        "INSERT INTO job_inline (job_id, field, sha256) VALUES (?, ?, ?)",
                        [(job.job_id, key, digest) for key, (_, digest) in after.inline.items()],
                    )
                if not appended:
                    self._db.execute("DELETE FROM loss_points WHERE job_id = ?", (job.job_id,))
                self._db.executemany(
                    "INSERT INTO loss_points (job_id, position, point) VALUES (?, ?, ?)",
                    [(job.job_id, i, json.dumps(history[i], sort_keys=True)) for i in range(start, len(history))],
                )
                self._db.execute(
                    "INSERT INTO jobs (job_id, seq, state, doc) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(job_id) DO UPDATE SET state = excluded.state, doc = excluded.doc",
                    (job.job_id, job.seq, job.state, json.dumps(doc, sort_keys=True)),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            after.points = len(history)
            after.last_point = history[-1] if history else None
            self._persisted[job.job_id] = after

    def delete(self, job_id: str) -> bool:
        with self._lock:
            self._persisted.pop(job_id, None)
            self._db.execute("BEGIN IMMEDIATE")
            try:
                removed = self._db.execute("DELETE FROM jobs WHERE job_id = ?", (job_id,)).rowcount > 0
                self._db.execute("DELETE FROM loss_points WHERE job_id = ?", (job_id,))
                self._db.execute("DELETE FROM job_inline WHERE job_id = ?", (job_id,))
                self._db.execute("DELETE FROM inline_data WHERE sha256 NOT IN (SELECT sha256 FROM job_inline)")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return removed

    def load(self) -> tuple[list[Job], list[tuple[str, str]]]:
        """Every readable job in submission order, and (job_id, error) for rows that cannot be read."""
        jobs, broken = [], []
        with self._lock:
            rows = self._db.execute("SELECT job_id, doc FROM jobs ORDER BY seq").fetchall()
            refs: dict[str, dict[str, str]] = {}
            for job_id, key, digest in self._db.execute("SELECT job_id, field, sha256 FROM job_inline"):
                refs.setdefault(job_id, {})[key] = digest
            points: dict[str, list[str]] = {}
            for job_id, point in self._db.execute("SELECT job_id, point FROM loss_points ORDER BY job_id, position"):
                points.setdefault(job_id, []).append(point)
            blobs = {digest: self._inline(digest) for digest in {d for r in refs.values() for d in r.values()}}
            for job_id, doc in rows:
                try:
                    job = self._job(json.loads(doc), refs.get(job_id, {}), blobs, points.get(job_id))
                except (TypeError, ValueError) as exc:
                    broken.append((job_id, f"stored job record is unreadable: {exc}"))
                    continue
                history = job.loss_history
                self._persisted[job_id] = _Persisted(
                    inline={key: (job.request[key], digest) for key, digest in refs.get(job_id, {}).items()},
                    points=len(history) if points.get(job_id) is not None else 0,
                    last_point=history[-1] if history and points.get(job_id) is not None else None,
                )
                jobs.append(job)
        return jobs, broken

    def _inline(self, digest: str) -> Any:
        """One stored inline list, checked against its digest; a ``ValueError`` names what is wrong."""
        row = self._db.execute("SELECT body FROM inline_data WHERE sha256 = ?", (digest,)).fetchone()
        if row is None:
            return ValueError(f"inline data {digest} is missing")
        body = bytes(row[0])
        if prefixed(hashlib.sha256(body).hexdigest()) != digest:
            return ValueError(f"inline data {digest} does not match its digest")
        return json.loads(body)

    @staticmethod
    def _job(doc: dict[str, Any], refs: dict[str, str], blobs: dict[str, Any], points: list[str] | None) -> Job:
        declared = doc.pop("inline_data", {})
        if declared != refs:
            raise ValueError(f"inline data references {sorted(refs.items())} differ from the record's {declared}")
        for key, digest in refs.items():
            if isinstance(blobs[digest], ValueError):
                raise blobs[digest]
            doc["request"][key] = blobs[digest]
        if points is not None:
            doc["loss_history"] = [json.loads(p) for p in points]
        return Job(**doc)

    def writable(self) -> bool:
        try:
            with self._lock:
                self._db.execute("CREATE TABLE IF NOT EXISTS probe (x INTEGER)")
            return True
        except sqlite3.Error:
            return False

    def close(self) -> None:
        with self._lock:
            self._db.close()


@dataclass
class Outcome:
    """What the runner reports when a job ends."""

    state: str  # completed | failed
    error: str | None = None
    receipt_path: str | None = None
    adapter_path: str | None = None


Runner = Callable[[Job, threading.Event, Callable[[dict[str, Any]], None]], Outcome]


class JobManager:
    """The queue and its single worker thread. ``runner`` trains one job (and revalidates it first)."""

    def __init__(
        self,
        store: JobStore,
        *,
        max_queued: int,
        runner: Runner,
        on_terminal: Callable[[Job], None] | None = None,
        interrupted: Callable[[Job], str] | None = None,
    ):
        self.store = store
        self.max_queued = max_queued
        self.runner = runner
        self.on_terminal = on_terminal
        self.jobs: dict[str, Job] = {}
        self.queue: deque[str] = deque()
        self.running: str | None = None
        self.broken: dict[str, str] = {}
        self._cancel: threading.Event | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._seq = 0
        self._last_write = 0.0
        self.step_seconds: list[float] = []  # recent step durations, for /metrics
        self.checkpoint_seconds: list[float] = []
        self.tokens_per_second: float = 0.0
        self._interrupted = interrupted  # the reason of a job the server stopped under, with what continues it
        self._recover()
        self._thread = threading.Thread(target=self._work, name="kiln-training-worker", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def _recover(self) -> None:
        jobs, broken = self.store.load()
        self.broken = dict(broken)
        for job in jobs:
            self._seq = max(self._seq, job.seq)
            if job.state == "running":
                job.state = "failed"
                job.finished_ms = _now_ms()
                job.error = (
                    self._interrupted(job)
                    if self._interrupted
                    else "interrupted: the server stopped while this job was running"
                )
                self.store.save(job)
            self.jobs[job.job_id] = job
            if job.state == "queued":
                self.queue.append(job.job_id)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Ask a running job to stop at its next step (it publishes a checkpoint) and join the worker."""
        with self._cond:
            self._stopping = True
            if self._cancel is not None:
                self._cancel.set()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ submissions

    def check_capacity(self) -> None:
        with self._cond:
            if len(self.queue) >= self.max_queued:
                raise CapacityError(
                    f"the training queue is full ({len(self.queue)} of {self.max_queued} jobs waiting)",
                    code="queue_full",
                    hint="retry after 30 s, or raise training.max_queued_jobs",
                )

    def writer_of(self, adapter_name: str) -> Job | None:
        """The queued or running job that will write ``adapter_name``, if any (evaluations and audits write none)."""
        with self._cond:
            for job in self.jobs.values():
                if not job.terminal and family(job.job_type) == "training" and job.adapter_name == adapter_name:
                    return job
        return None

    def submit(self, **fields: Any) -> Job:
        """Queue an admitted job (raises ``queue_full`` or ``adapter_exists`` without queueing)."""
        with self._cond:
            self.check_capacity()
            clash = self.writer_of(fields["adapter_name"]) if family(fields["job_type"]) == "training" else None
            if clash is not None:
                raise ConflictError(
                    f"job {clash.job_id} ({clash.state}) already writes adapter {clash.adapter_name!r}",
                    code="adapter_exists",
                    hint="choose another config.output_name, or wait for that job to finish",
                )
            self._seq += 1
            prefix = FAMILIES[family(fields["job_type"])][0]
            job = Job(job_id=f"{prefix}-{uuid.uuid4().hex[:12]}", seq=self._seq, **fields)
            self.store.save(job)
            self.jobs[job.job_id] = job
            self.queue.append(job.job_id)
            self._cond.notify_all()
            return job

    def record_eval(self, training: Job, *, role: str, suite: str, adapter: str | None, entry: dict[str, Any]) -> Job:
        """A running evaluation job of ``training``'s gate (run by the worker in that job's slot, not queued)."""
        with self._cond:
            self._seq += 1
            job = Job(
                job_id=f"eval-{uuid.uuid4().hex[:12]}",
                seq=self._seq,
                job_type="eval",
                adapter_name=adapter or "",
                effective_seed="0",
                request={"suite": suite, **({"adapter": adapter} if adapter else {})},
                fingerprint={"suite_sha256": entry["suite_sha256"]},
                auto_load=False,
                total_steps=entry["example_count"],
                state="running",
                role=role,
                linked_training_job_id=training.job_id,
            )
            job.started_ms = job.submitted_ms
            self.jobs[job.job_id] = job
            self.store.save(job)
            return job

    def finish_eval(self, job: Job, result: dict[str, Any] | None, error: str | None) -> None:
        with self._cond:
            job.result, job.error = result, error
            job.state = "completed" if error is None else "failed"
            job.progress = 1.0 if error is None else job.progress
            job.finished_ms = _now_ms()
            self.store.save(job)

    def get(self, job_id: str, *, kind: str = "training") -> Job:
        """A job of the family ``kind`` (``training``, ``eval``, ``audit``); another family's is not found here."""
        job = self.jobs.get(job_id)
        if job is None or family(job.job_type) != kind:
            _, what, where = FAMILIES[kind]
            raise NotFoundError(f"no {what} job {job_id!r}", code="not_found", hint=f"list jobs with GET {where}")
        return job

    def cancel(self, job_id: str, *, kind: str = "training") -> str:
        """``cancelled`` for a queued job (removed now) or ``cancelling`` for the running one."""
        with self._cond:
            job = self.get(job_id, kind=kind)
            if job.state == "queued":
                self.queue.remove(job_id)
                job.state, job.finished_ms = "failed", _now_ms()
                job.error = "cancelled: removed from the queue before it started"
                self.store.save(job)
                self._terminal(job)
                return "cancelled"
            if job.state == "running":
                job.cancel_requested = True
                if self._cancel is not None:
                    self._cancel.set()
                self.store.save(job)
                return "cancelling"
        raise NotFoundError(
            f"job {job_id} is not queued or running (it ended {job.state}); there is nothing to cancel",
            code="not_found",
            hint=f"see GET /v1/train/jobs/{job_id}",
        )

    def forget(self, job_id: str) -> bool:
        with self._cond:
            job = self.get(job_id)
            if not job.terminal:
                raise ConflictError(
                    f"job {job_id} is {job.state}; only finished jobs can be deleted",
                    code="job_not_terminal",
                    hint=f"cancel it first: DELETE /v1/train/queue/{job_id}",
                )
            del self.jobs[job_id]
            shutil.rmtree(self.store.job_directory(job_id), ignore_errors=True)  # its worker's spec, events, log
            return self.store.delete(job_id)

    def ordered(self, *, kind: str | None = None) -> list[Job]:
        """Jobs in submission order: all, or one family's (``training``, ``eval``, ``audit``)."""
        with self._cond:
            jobs = sorted(self.jobs.values(), key=lambda j: j.seq)
        return jobs if kind is None else [j for j in jobs if family(j.job_type) == kind]

    def queued(self) -> list[Job]:
        with self._cond:
            return [self.jobs[i] for i in self.queue]

    # ------------------------------------------------------------------ the worker

    def _terminal(self, job: Job) -> None:
        if self.on_terminal is not None:
            try:
                self.on_terminal(job)
            except Exception:  # a notification must never take the worker down
                log.exception("terminal-state hook failed for %s", job.job_id)

    def _next(self) -> Job | None:
        with self._cond:
            while not self.queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            job = self.jobs[self.queue.popleft()]
            job.state, job.started_ms = "running", _now_ms()
            self.running = job.job_id
            self._cancel = threading.Event()
            self.store.save(job)
            return job

    def _progress(self, job: Job) -> Callable[[dict[str, Any]], None]:
        last = [time.perf_counter()]
        rows = max(1, job.total_steps // max(1, int(job.request.get("config", {}).get("epochs", 1))))

        def report(event: dict[str, Any]) -> None:
            now = time.perf_counter()
            if event.get("kind") == "checkpoint":
                self.checkpoint_seconds = [*self.checkpoint_seconds[-99:], event["seconds"]]
                return
            spent = now - last[0]
            last[0] = now
            self.step_seconds = [*self.step_seconds[-99:], spent]
            job.tokens += int(event.get("tokens", 0))
            self.tokens_per_second = event.get("tokens", 0) / spent if spent > 0 else 0.0
            reward = None if event.get("reward") is None else float(event["reward"])
            job.record_loss(float(event["loss"]), int(event["step"]), int(event["total"]), rows, reward)
            if now - self._last_write >= PROGRESS_WRITE_INTERVAL_S:
                self._last_write = now
                self.store.save(job)

        return report

    def _work(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            assert self._cancel is not None
            try:
                outcome = self.runner(job, self._cancel, self._progress(job))
            except KilnError as exc:
                outcome = Outcome("failed", f"{exc.code}: {exc.message}")
            except Exception as exc:  # the worker survives any job; the job records why it died
                log.exception("job %s crashed", job.job_id)
                outcome = Outcome("failed", f"internal_error: {type(exc).__name__}: {exc}")
            with self._cond:
                job.state = outcome.state
                job.error = outcome.error if outcome.state == "failed" else None
                job.receipt_path = outcome.receipt_path
                job.adapter_path = outcome.adapter_path
                job.finished_ms = _now_ms()
                if outcome.state == "completed":
                    job.progress = 1.0
                self.running = None
                self._cancel = None
                self.store.save(job)
            self._terminal(job)
