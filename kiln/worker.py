"""A training job in a process of its own: ``python -m kiln.worker SPEC``.

The server admits a job, then launches this entry point with a spec file (``kiln.worker-spec.v1``): the job's
kind, adapter name and replay request, the fingerprint it was admitted with, and the training context (registry,
base model, teachers, checkpoint interval, data roots). The worker loads the base model itself, re-admits the
request (the dequeue revalidation: a changed input fails the job before anything trains), trains through
``kiln.trainers.TRAINERS`` and publishes, exactly as the server's thread did.

The channel back is an append-only event file, one JSON object per line, written and flushed by this process
only; the server reads it and never writes it:

* ``{"event": "progress", ...}`` -- a trainer progress event (step, total, loss, tokens);
* ``{"event": "checkpoint", "seconds": s}`` -- a checkpoint landed;
* ``{"event": "outcome", "state": "completed" | "failed", "error", "receipt_path", "adapter_path", "activate"}`` --
  the last line, synced to disk before the process exits 0. ``activate`` says the run published an adapter
  (the server then runs its gate or ``auto_load``).

The worker ends with the server: it asks the kernel for ``SIGKILL`` when its parent dies, so a crashed server
leaves no training behind it (what was published stays). Cancellation is ``SIGTERM`` (or ``SIGINT``), which the worker turns into the trainers' cooperative cancel: the
step in flight finishes, a checkpoint is published, the cancelled receipt is written. A worker that dies without
an outcome line (killed, out of memory, a crash in native code) leaves the job to the server to classify
(``kiln.server._worker_process``); everything it published before stays, checksummed, resumable.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPEC_SCHEMA = "kiln.worker-spec.v1"
PR_SET_PDEATHSIG = 1  # prctl(2)
FINGERPRINT_LABELS = {
    "data_sha256": "the training data",
    "teacher": "the teacher",
    "seed": "the effective seed",
    "loss_route": "the loss route",
    "loss_chunk_size": "the loss chunk size",
    "checkpoint": "the resume checkpoint",
}

__all__ = [
    "FINGERPRINT_LABELS",
    "SPEC_SCHEMA",
    "EventWriter",
    "changed",
    "main",
    "revalidation_failed",
    "run_spec",
    "spec_context",
]


def changed(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between the fingerprint a job was admitted with and the one its re-admission gives."""
    return [
        f"{label} ({before.get(key)} → {now.get(key)})"
        for key, label in FINGERPRINT_LABELS.items()
        if before.get(key) != now.get(key)
    ]


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


def revalidation_failed(differences: list[str]) -> str:
    """The error of a job whose re-admission found its inputs changed."""
    return (
        "revalidation_failed: changed since the job was admitted: "
        + "; ".join(differences)
        + ". Nothing was trained; submit the job again"
    )


def spec_context(spec: dict[str, Any]) -> Any:
    """The ``TrainingContext`` a spec describes, its base model loaded from disk."""
    from kiln.model import load_base_model
    from kiln.trainers import TrainingContext

    ctx = spec["context"]
    return TrainingContext(
        registry=Path(ctx["registry"]),
        loaded=load_base_model(Path(ctx["model_path"]), is_default=bool(ctx["model_is_default"])),
        teachers_root=Path(ctx["teachers_root"]) if ctx.get("teachers_root") else None,
        checkpoint_interval=ctx.get("checkpoint_interval"),
        data_roots=tuple(Path(p) for p in ctx["data_roots"]) if ctx.get("data_roots") is not None else None,
    )


def run_spec(
    spec: dict[str, Any],
    emit: Callable[..., None],
    cancel: threading.Event,
    *,
    context: Any = None,
    admission_lock: Any = None,
    private_weights: Callable[[Any], None] | None = None,
) -> dict[str, Any]:
    """Re-admit and train the job ``spec`` describes, sending its events to ``emit``; returns the outcome.

    A worker process passes nothing else: the context comes from the spec, with the base model loaded from disk.
    The server's in-process mode (``training.worker = "thread"``) passes its context (the pristine base it admits
    against), its admission lock, and ``private_weights`` to give the admitted job a copy of its own to train."""
    from kiln.errors import KilnError
    from kiln.trainers import TRAINERS

    if spec.get("schema") != SPEC_SCHEMA:
        raise ValueError(f"not a {SPEC_SCHEMA} spec: schema {spec.get('schema')!r}")
    try:
        context = spec_context(spec) if context is None else context
        trainer = TRAINERS[spec["kind"]]
        with admission_lock if admission_lock is not None else contextlib.nullcontext():
            admitted = trainer.admit(spec["request"], adapter_name=spec["adapter_name"], context=context)
        differences = changed(spec["fingerprint"], admitted.fingerprint())
        if differences:
            return _failed(revalidation_failed(differences))
        if private_weights is not None and not admitted.dry_run:
            private_weights(admitted)

        def progress(event: dict[str, Any]) -> None:
            if event.get("loss") is not None:  # an OPD candidate with an empty rollout settles without a loss
                emit({"event": "progress", **event})

        def checkpoint_landed(published: Any) -> None:
            t = published.timings
            emit({"event": "checkpoint", "seconds": (t.capture_ms + t.encode_ms + t.write_ms) / 1000})

        result = trainer.run(admitted, progress=progress, cancel=cancel, on_checkpoint=checkpoint_landed)
        admitted.loaded = None  # drop the trained weights now, not when the job goes
    except KilnError as exc:
        return _failed(f"{exc.code}: {exc.message}")
    if result.status != "success":
        receipt = result.receipt
        error = f"{receipt['failure_reason']}: {receipt.get('failure_message') or 'no detail'}"
        return {**_failed(error), "receipt_path": str(result.receipt_path)}
    published = result.manifest_path is not None  # a dry run, or filters that left nothing, publish no adapter
    return {
        "event": "outcome",
        "state": "completed",
        "error": None,
        "receipt_path": str(result.receipt_path),
        "adapter_path": str(result.adapter_dir) if published else None,
        "activate": published,
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
        print("usage: python -m kiln.worker SPEC.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    die_with_parent(spec.get("server_pid"))
    cancel = threading.Event()

    def on_signal(_signum: int, _frame: Any) -> None:
        cancel.set()  # the trainers notice it after the step in flight

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    events = EventWriter(Path(spec["events"]))
    try:
        outcome = run_spec(spec, events.send, cancel)
    except Exception as exc:  # noqa: BLE001 - an outcome line even for a bug, so the job says what happened
        traceback.print_exc()  # into worker.log
        outcome = _failed(f"internal_error: {type(exc).__name__}: {exc}")
    events.send(outcome, sync=True)
    events.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
