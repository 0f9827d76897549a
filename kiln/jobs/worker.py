"""A training job in a process of its own: ``python -m kiln.jobs.worker SPEC``.

The server admits a job, then launches this entry point with a spec file (``kiln.worker-spec.v1``,
``kiln.artifacts.worker_spec``): the job's kind, adapter name and replay request, the fingerprint it was admitted
with, and the training context (registry, base model, teachers, checkpoint interval, data roots). The worker loads
the spec strictly (a malformed one is refused before anything else, naming the pointer), loads the base model
itself, re-admits the request (the dequeue revalidation: a changed input fails the job before anything trains),
trains through ``kiln.trainers.TRAINERS`` and publishes, exactly as the server's thread did.

The channel back is an append-only event file, one JSON object per line, written and flushed by this process
only; the server reads it and never writes it:

* ``{"event": "progress", ...}`` -- a trainer progress event (step, total, loss, tokens);
* ``{"event": "checkpoint", "seconds": s}`` -- a checkpoint landed;
* ``{"event": "outcome", "state": "completed" | "failed", "error", "receipt_path", "adapter_path", "activate"}`` --
  the last line, synced to disk before the process exits 0. ``activate`` says the run published an adapter
  (the server then runs its gate or ``auto_load``).

Data parallelism (SFT): a spec whose ``launch`` asks for more than one rank (``nproc_per_node`` processes on each
of ``nnodes`` nodes) makes the worker replace itself (``exec``, same process id) with ``torchrun`` running this
entry point once per rank. Every rank loads the model, re-admits the request against the fingerprint and joins the
``torch.distributed`` group (``kiln.training.DataParallel``); rank 0 alone writes the events and publishes. The
cancel signal goes to ``torchrun``, which forwards it to every rank; the ranks agree on the step they stop at.

The worker ends with the server: it asks the kernel for ``SIGKILL`` when its parent dies, so a crashed server
leaves no training behind it (what was published stays). ``torchrun`` inherits that request across its ``exec``, and
each rank asks for the same when ``torchrun`` dies. Cancellation is ``SIGTERM`` (or ``SIGINT``), which the worker turns into the trainers' cooperative cancel: the
step in flight finishes, a checkpoint is published, the cancelled receipt is written. A worker that dies without
an outcome line (killed, out of memory, a crash in native code) leaves the job to the server to classify
(``kiln.server._worker_process``); everything it published before stays, checksummed, resumable.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.artifacts.worker_spec import WorkerSpec, load_worker_spec
from kiln.documents.jsonio import JsonObject

if TYPE_CHECKING:
    from kiln_contracts.models.kiln_control_plane_v1_schema import WorkerLaunch

    from kiln.trainers import TrainingContext
    from kiln.training import DataParallel

PR_SET_PDEATHSIG = 1  # prctl(2)
FINGERPRINT_LABELS = {
    "data_sha256": "the training data",
    "teacher": "the teacher",
    "seed": "the effective seed",
    "loss_route": "the loss route",
    "loss_chunk_size": "the loss chunk size",
    "checkpoint": "the resume checkpoint",
}

FOLLOW_POLL_S = 0.05  # how often the launcher reads the event file and checks for a cancel
SHUTDOWN_TIMEOUT_S = 600  # how long torchrun waits for cancelled ranks to publish before it kills them

__all__ = [
    "FINGERPRINT_LABELS",
    "SHUTDOWN_TIMEOUT_S",
    "EventReader",
    "EventWriter",
    "changed",
    "follow",
    "launch_ranks",
    "main",
    "outcome_of",
    "revalidation_failed",
    "run_spec",
    "spec_context",
    "torchrun_argv",
    "train_admitted",
]


def changed(before: JsonObject, now: JsonObject) -> list[str]:
    """What differs between the fingerprint a job was admitted with and the one its re-admission gives."""
    return [
        f"{label} ({before.get(key)} → {now.get(key)})"
        for key, label in FINGERPRINT_LABELS.items()
        if before.get(key) != now.get(key)
    ]


class EventReader:
    """The reading half of the channel: the complete lines appended since the last read (a partial last line waits
    for its end)."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset, self._partial = path, 0, b""

    def read(self) -> Iterator[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)


class EventWriter:
    """The worker's half of the channel: one JSON line per event, appended and flushed; ``outcome`` also syncs."""

    def __init__(self, path: Path) -> None:
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the whole run
        self._lock = threading.Lock()

    def send(self, event: dict[str, Any], *, sync: bool = False) -> None:
        line = json.dumps(event, separators=(",", ":"), allow_nan=False) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
            if sync:
                os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def follow(
    spec_path: Path,
    log_path: Path,
    cancel: threading.Event,
    on_event: Callable[[dict[str, Any]], object],
    *,
    cwd: Path | None = None,
    new_session: bool = False,
) -> tuple[subprocess.Popen[bytes], dict[str, Any] | None]:
    """Run ``python -m kiln.jobs.worker SPEC`` with this interpreter until it exits, its output to ``log_path``: each
    event it appends to the spec's event file goes to ``on_event`` as it lands, ``cancel`` becomes one ``SIGTERM``
    (the cooperative cancel; ``torchrun`` hands it to every rank). Returns the ended process and the outcome line
    (None when it left none). ``new_session``: the worker in a session of its own, which an interrupt of the caller
    (``KeyboardInterrupt``) kills whole before re-raising."""
    events = load_worker_spec(spec_path).events
    if events is None:
        raise ValueError(f"{spec_path} names no event file: a worker process reports through one")
    reader = EventReader(Path(events.root))
    outcome: dict[str, Any] | None = None

    def drain() -> None:
        nonlocal outcome
        for event in reader.read():
            if event.get("event") == "outcome":
                outcome = event
            on_event(event)

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.jobs.worker", str(spec_path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=None if cwd is None else str(cwd),
            start_new_session=new_session,
        )
        signalled = False
        try:
            while True:
                drain()
                if cancel.is_set() and not signalled:
                    proc.send_signal(signal.SIGTERM)
                    signalled = True
                try:
                    proc.wait(timeout=FOLLOW_POLL_S)
                    break
                except subprocess.TimeoutExpired:
                    continue
        except KeyboardInterrupt:
            if new_session:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
            proc.wait()
            raise
    drain()
    return proc, outcome


def revalidation_failed(differences: list[str]) -> str:
    """The error of a job whose re-admission found its inputs changed."""
    return (
        "revalidation_failed: changed since the job was admitted: "
        + "; ".join(differences)
        + ". Nothing was trained; submit the job again"
    )


def launch_ranks(spec: WorkerSpec) -> int:
    """How many ranks a spec's ``launch`` asks for in all (``nproc_per_node x nnodes``)."""
    return spec.launch.nproc_per_node * (spec.launch.nnodes or 1)


def torchrun_argv(spec_path: str, launch: WorkerLaunch) -> list[str]:
    """The ``torchrun`` command that runs this entry point once per rank for ``launch``: one node stands alone
    (a rendezvous on a free local port); several meet at ``rdzv_endpoint`` (c10d) under ``rdzv_id``."""
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={launch.nproc_per_node}"]
    nnodes = launch.nnodes or 1
    endpoint = None if launch.rdzv_endpoint is None else launch.rdzv_endpoint.root
    if nnodes == 1 and not endpoint:
        argv.append("--standalone")
    else:
        argv += [
            f"--nnodes={nnodes}",
            f"--node-rank={launch.node_rank or 0}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={launch.rdzv_id.root if launch.rdzv_id is not None else 'kiln'}",
        ]
    argv += ["--max-restarts=0", f"--shutdown-timeout={SHUTDOWN_TIMEOUT_S}", "-m", "kiln.jobs.worker", spec_path]
    return argv


def spec_context(spec: WorkerSpec, data_parallel: DataParallel | None = None) -> TrainingContext:
    """The ``TrainingContext`` a spec describes, its base model opened from disk -- its weights are loaded by the
    trainer's admission, in the precision the job resolved (``data_parallel``: the group this process trains in)."""
    from kiln.model import open_base_model
    from kiln.trainers import TrainingContext
    from kiln.training import DataParallel, MemorySettings, ServingCopy

    ctx = spec.context
    limit = ctx.memory_limit_bytes
    copy = ctx.serving_copy
    serving = (
        None
        if copy is None
        else ServingCopy(device=copy.device, bytes=copy.bytes, policy=copy.policy.value, resident=copy.resident)
    )
    return TrainingContext(
        registry=Path(ctx.registry),
        loaded=open_base_model(Path(ctx.model_path), is_default=ctx.model_is_default),
        memory=MemorySettings(memory_limit_bytes=None if limit is None else limit.root, serving_copy=serving),
        teachers_root=None if ctx.teachers_root is None else Path(ctx.teachers_root.root),
        checkpoint_interval=None if ctx.checkpoint_interval is None else ctx.checkpoint_interval.root,
        data_roots=None if ctx.data_roots is None else tuple(Path(p.root) for p in ctx.data_roots),
        data_parallel=data_parallel or DataParallel(),
    )


def run_spec(
    spec: WorkerSpec,
    emit: Callable[..., object],
    cancel: threading.Event,
    *,
    context: Any = None,
    admission_lock: Any = None,
    private_weights: Callable[[Any], None] | None = None,
    data_parallel: Any = None,
) -> dict[str, Any]:
    """Re-admit and train the job ``spec`` describes, sending its events to ``emit``; returns the outcome.

    A worker process passes nothing else: the context comes from the spec, with the base model opened from disk.
    The server's in-process mode (``training.worker = "thread"``) passes its context (the pristine base it admits
    against), its admission lock, and ``private_weights`` to give the admitted job a copy of its own to train. A rank
    of a data-parallel group passes its ``data_parallel`` group."""
    from kiln.errors import KilnError
    from kiln.trainers import TRAINERS

    try:
        context = spec_context(spec, data_parallel) if context is None else context
        trainer = TRAINERS[spec.kind.value]
        request = spec.request.model_dump(mode="json", by_alias=True)
        with admission_lock if admission_lock is not None else contextlib.nullcontext():
            admitted = trainer.admit(request, adapter_name=spec.adapter_name, context=context)
        fingerprint = spec.fingerprint.model_dump(mode="json", by_alias=True, exclude_unset=True)
        differences = changed(fingerprint, admitted.fingerprint())
        if differences:
            return _failed(revalidation_failed(differences))
        if private_weights is not None and not admitted.dry_run:
            private_weights(admitted)
        return train_admitted(trainer, admitted, emit, cancel)
    except KilnError as exc:
        return _failed(f"{exc.code}: {exc.message}")


def train_admitted(trainer: Any, admitted: Any, emit: Callable[..., object], cancel: threading.Event) -> dict[str, Any]:
    """Train an admitted job, its progress and checkpoints sent to ``emit`` as events; returns the outcome line.
    ``kiln train --local`` on one process calls this directly, having admitted the job itself."""
    from kiln.errors import KilnError

    def progress(event: dict[str, Any]) -> None:
        if event.get("loss") is not None:  # an OPD candidate with an empty rollout settles without a loss
            emit({"event": "progress", **event})

    def checkpoint_landed(published: Any) -> None:
        t = published.timings
        emit({"event": "checkpoint", "seconds": (t.capture_ms + t.encode_ms + t.write_ms) / 1000})

    try:
        result = trainer.run(admitted, progress=progress, cancel=cancel, on_checkpoint=checkpoint_landed)
    except KilnError as exc:
        return _failed(f"{exc.code}: {exc.message}")
    finally:
        admitted.release_model()  # drop the trained weights now, not when the job goes
    return outcome_of(result)


def outcome_of(result: Any) -> dict[str, Any]:
    """The outcome line of a finished run (a ``TrainResult``): its state, where its receipt and adapter are, and what
    a caller prints -- the loss history, the checkpoints, whether it was cancelled."""
    run = {
        "losses": list(result.losses),
        "checkpoints": [str(p) for p in result.checkpoints],
        "latest_checkpoint": None if result.latest_checkpoint is None else str(result.latest_checkpoint),
        "cancelled": result.cancelled,
    }
    if result.status != "success":
        receipt = result.receipt
        error = f"{receipt['failure_reason']}: {receipt.get('failure_message') or 'no detail'}"
        return {**_failed(error), "receipt_path": str(result.receipt_path), **run}
    published = result.manifest_path is not None  # a dry run, or filters that left nothing, publish no adapter
    return {
        "event": "outcome",
        "state": "completed",
        "error": None,
        "receipt_path": str(result.receipt_path),
        "adapter_path": str(result.adapter_dir) if published else None,
        "activate": published,
        **run,
    }


def _failed(error: str) -> dict[str, Any]:
    return {"event": "outcome", "state": "failed", "error": error, "receipt_path": None, "adapter_path": None,
            "activate": False}  # fmt: skip


def die_with_parent(parent: int | None) -> None:
    """End this process when the server that started it ends (Linux ``PR_SET_PDEATHSIG``): a worker never trains on
    unwatched, where a restarted server could not tell it from a dead one. Already orphaned: exit now."""
    if parent is None:
        return
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the server died before the request above took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m kiln.jobs.worker SPEC.json", file=sys.stderr)
        return 2
    from kiln.errors import KilnError

    try:
        spec = load_worker_spec(args[0])
    except KilnError as exc:  # before anything else: a malformed spec says where, in worker.log
        print(f"error: {args[0]} is not a valid worker spec: {exc}", file=sys.stderr)
        return 2
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if launch_ranks(spec) > 1 and not under_torchrun:
        die_with_parent(spec.server_pid)  # inherited by torchrun through the exec below
        argv = torchrun_argv(str(Path(args[0]).resolve()), spec.launch)
        sys.stdout.flush()
        os.execv(argv[0], argv)  # noqa: S606 - the argv is ours: this interpreter running torchrun
    die_with_parent(os.getppid() if under_torchrun else spec.server_pid)
    from kiln.training import DataParallel

    threads = spec.launch.threads_per_rank
    config = spec.request.model_dump(mode="json", by_alias=True).get("config") or {}
    device = str(config.get("device") or "cpu")  # a replay always names its device setting
    group = DataParallel.from_environment(threads=None if threads is None else threads.root, device=device)
    cancel = threading.Event()

    def on_signal(_signum: int, _frame: Any) -> None:
        cancel.set()  # the trainers notice it after the step in flight

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if spec.events is None:
        print(f"error: {args[0]} names no event file: a worker process reports through one", file=sys.stderr)
        return 2
    events = EventWriter(Path(spec.events.root)) if group.publishes else None  # rank 0 speaks for the group
    try:
        outcome = run_spec(spec, events.send if events else _silent, cancel, data_parallel=group)
    except Exception as exc:  # noqa: BLE001 - an outcome line even for a bug, so the job says what happened
        traceback.print_exc()  # into worker.log
        outcome = _failed(f"internal_error: {type(exc).__name__}: {exc}")
    if events is not None:
        events.send(outcome, sync=True)
        events.close()
    elif outcome["state"] != "completed":  # rank 0 reports the group's outcome; this rank's own reason goes to the log
        print(f"rank {group.rank}: {outcome['error']}", file=sys.stderr)
    group.leave()
    return 0


def _silent(_event: dict[str, Any], *, sync: bool = False) -> None:
    """The events of a rank other than 0: rank 0 reports the group's."""


if __name__ == "__main__":
    raise SystemExit(main())
