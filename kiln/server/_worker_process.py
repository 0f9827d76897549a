"""The server's half of a training worker: launch ``python -m kiln.jobs.worker``, read its events, cancel it, and say
why it died when it dies.

``launch(engine, job, spec, cancel, report)`` writes the job's spec (``kiln.worker-spec.v1``) into its directory
(``<home>/server/jobs/<job_id>/``; ``events_file`` is where its events go), starts the worker with the server's own interpreter, forwards each progress and
checkpoint event to ``report`` as the worker appends it to ``events.jsonl``, turns ``cancel`` into one ``SIGTERM``
(the worker's cooperative cancel), and returns the worker's outcome line. A worker that exits without one -- a
``SIGKILL``, the kernel's OOM killer, a segfault, a bug before the event file opened -- fails the job with a
category: ``oom`` when the kernel's OOM killer fired while it ran (the cgroup's ``memory.events`` ``oom_kill`` count
rose), else ``training_error``; the message names the exit status and the checkpoint that resumes the job (the
worker's checkpoints are published atomically, so the newest one is whole). The worker's standard output and error
go to ``worker.log`` beside the events.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.artifacts.worker_spec import WorkerSpec, write_worker_spec
from kiln.jobs.worker import follow

LOG_TAIL = 2000  # characters of worker.log a failure message quotes

__all__ = ["classify_exit", "continuation", "events_file", "forward", "launch", "oom_kills"]


def oom_kills(events_file: Path | None = None) -> int | None:
    """The kernel's OOM-kill count for this process's cgroup (v2 ``memory.events``, else v1 ``memory.oom_control``);
    None when neither can be read."""
    candidates = [events_file] if events_file is not None else _cgroup_files()
    for path in candidates:
        try:
            for line in path.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            continue
    return None


def _cgroup_files() -> list[Path]:
    files = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, relative = line.split(":", 2)
            root = Path("/sys/fs/cgroup")
            if controllers == "":  # v2: the unified hierarchy
                files.append(root / relative.lstrip("/") / "memory.events")
            elif "memory" in controllers.split(","):
                files.append(root / "memory" / relative.lstrip("/") / "memory.oom_control")
    except (OSError, ValueError):
        pass
    return files


def continuation(registry: Path, adapter_name: str) -> str:
    """What continues a job that stopped: its adapter's newest checkpoint, or a fresh submission."""
    from kiln.checkpoints import latest_checkpoint
    from kiln.errors import CheckpointError

    try:
        checkpoint = latest_checkpoint(registry, adapter_name)
    except (CheckpointError, OSError) as exc:
        return f"its checkpoints cannot be read ({exc}): see checkpoint_error in the job detail"
    if checkpoint is None:
        return (
            "it published no checkpoint to resume from; submit its replay_request again (without "
            "config.resume_checkpoint) to train it from the start"
        )
    return (
        f"its newest checkpoint {checkpoint['resume_checkpoint']} (step {checkpoint['global_step']}/"
        f"{checkpoint['total_steps']}) resumes it: submit its replay_request with config.resume_checkpoint set to "
        "that name"
    )


def classify_exit(returncode: int, oom_before: int | None, oom_after: int | None, *, ranks: int = 1) -> tuple[str, str]:
    """``(category, how it ended)`` for a worker that exited without an outcome. A worker of several ranks is
    ``torchrun``, which ends with status 1 when a rank died (it then stops the others): with the OOM count risen,
    that rank was the kernel's victim."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        how = f"killed by {name} (exit status {returncode})"
    else:
        how = f"exited with status {returncode}"
    killed_for_memory = oom_before is not None and oom_after is not None and oom_after > oom_before
    if killed_for_memory and (returncode == -signal.SIGKILL or (ranks > 1 and returncode > 0)):
        return "oom", f"{how}: the kernel's OOM killer ended it (the cgroup's oom_kill count rose)"
    return "training_error", how


def events_file(engine: Any, job: Any) -> Path:
    """Where the worker of ``job`` appends its events: ``events.jsonl`` in the job's directory, made empty (a job runs
    once; a stale file would replay old events)."""
    directory = engine.jobs.store.job_directory(job.job_id)
    directory.mkdir(parents=True, exist_ok=True)
    events = directory / "events.jsonl"
    events.unlink(missing_ok=True)
    return events


def launch(
    engine: Any,
    job: Any,
    spec: WorkerSpec,
    cancel: threading.Event,
    report: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Train ``job`` in a worker process running ``spec``; returns the worker's outcome, or the failure the server
    classified when it left none."""
    directory = engine.jobs.store.job_directory(job.job_id)
    write_worker_spec(directory / "spec.json", spec)
    oom_before = oom_kills()
    proc, outcome = follow(
        directory / "spec.json", directory / "worker.log", cancel, lambda event: forward(event, report), cwd=directory
    )
    ranks = spec.launch.nproc_per_node * (spec.launch.nnodes or 1)
    if outcome is not None and outcome["state"] == "failed" and ranks > 1 and proc.returncode != 0:
        # rank 0 reported the group's end (a collective that broke); torchrun's status says a rank died
        category, how = classify_exit(proc.returncode, oom_before, oom_kills(), ranks=ranks)
        outcome = {**outcome, "error": f"{outcome['error']}; torchrun {how} ({category}: a rank died, each "
                   f"rank's end is in {directory / 'worker.log'}); {continuation(engine.registry, job.adapter_name)}"}  # fmt: skip
    if outcome is not None:
        return outcome
    category, how = classify_exit(proc.returncode, oom_before, oom_kills(), ranks=ranks)
    tail = (directory / "worker.log").read_text(encoding="utf-8", errors="replace")[-LOG_TAIL:].strip()
    error = (
        f"{category}: the training worker (pid {proc.pid}) {how}"
        f"{' without reporting an outcome' if proc.returncode >= 0 else ''}; "
        f"{continuation(engine.registry, job.adapter_name)}"
    )
    if tail:
        error += f". Its last output: {tail}"
    return {"event": "outcome", "state": "failed", "error": error, "receipt_path": None, "adapter_path": None,
            "activate": False}  # fmt: skip


def forward(event: dict[str, Any], report: Callable[[dict[str, Any]], None]) -> dict[str, Any] | None:
    """Hand a worker event to the job's ``report``; returns it when it is the outcome."""
    kind = event.get("event")
    if kind == "outcome":
        return event
    if kind == "checkpoint":
        report({"kind": "checkpoint", "seconds": event["seconds"]})
    elif kind == "progress":
        report({k: v for k, v in event.items() if k != "event"})
    return None
