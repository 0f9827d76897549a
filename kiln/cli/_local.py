"""``kiln train sft|grpo|opd --local``: one runner for every kind, through the training worker (``kiln.jobs.worker``).

The request is built from the file and the flags exactly as for a server (``kiln.cli._requests``), admitted in this
process (the configured registry, model, teacher registry and ``training.checkpoint_interval``; for SFT the world
size of ``--nproc-per-node`` x ``--nnodes``), then trained the way the server's workers train:

* one process: ``kiln.jobs.worker.train_admitted`` in this process, on the job admitted here;
* several ranks: the admitted job's replay request goes into a ``kiln.worker-spec.v1`` in a temporary directory and
  ``python -m kiln.jobs.worker`` runs it (as ``torchrun``, one process per rank); this process follows its event file
  and reads the outcome line rank 0 writes. On a multi-node run every node runs this command with the same flags
  and its own ``--node-rank``; the node that holds rank 0 (the c10d rendezvous assigns ranks) publishes and prints
  the result, the others report that their ranks finished.

Either way the run is under SIGINT/SIGTERM cancellation -- the first signal asks for a checkpoint at the next step
and a failed run with reason ``cancelled`` (forwarded to the ranks), a second aborts without one -- with a progress
bar; the result is printed as lines or, with ``--json``, one summary object. What differs between kinds is only how
a run is described, which comes from the trainer registry (``Trainer.texts``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.cli._requests import build_request, prepare, resume_command

__all__ = ["cmd_train_local", "rank_flags_problem"]


class _Cancellation:
    """SIGINT/SIGTERM during training: the first asks for a checkpoint at the next step, the second aborts."""

    def __init__(self, quiet: bool) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.quiet = quiet
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.signum = signum
        self.event.set()
        if not self.quiet:
            print(
                f"\n{signal.Signals(signum).name}: cancelling after the current step and publishing a checkpoint "
                "(press Ctrl-C again to abort without one)",
                file=sys.stderr,
            )

    def __enter__(self) -> _Cancellation:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _failure_line(what: str, receipt: dict[str, Any]) -> str:
    """How a local run that did not succeed ended, in the receipt's own terms."""
    if receipt["failure_reason"] == "cancelled":
        return f"✗ {what} cancelled: its receipt records status failed, failure_reason cancelled"
    return f"✗ {what} failed ({receipt['failure_reason']}): {receipt.get('failure_message')}"


# ----------------------------------------------------------------------------- the run


def rank_flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the data-parallel flags, or None."""
    nproc, nnodes = getattr(args, "nproc_per_node", 1), getattr(args, "nnodes", 1)
    node_rank, endpoint = getattr(args, "node_rank", 0), getattr(args, "rdzv_endpoint", None)
    if nproc < 1 or nnodes < 1:
        return f"--nproc-per-node ({nproc}) and --nnodes ({nnodes}) must be at least 1"
    if (nproc > 1 or nnodes > 1) and not args.local:
        return "--nproc-per-node and --nnodes train with --local; a server's ranks are its training.nproc_per_node"
    if not 0 <= node_rank < nnodes:
        return f"--node-rank {node_rank} is not one of the {nnodes} node(s) 0..{nnodes - 1}"
    if nnodes > 1 and not endpoint:
        return "--nnodes > 1 needs --rdzv-endpoint HOST:PORT, where every node meets (node 0's address)"
    return None


def precheck(args: argparse.Namespace, kind: str, path: Path) -> None:
    """Everything that needs no model, before torch is imported: the adapter name; the request the file and flags
    make, loaded strictly as the kind's request document (schema, config bounds, semantic rules); the target in the
    registry (an existing adapter); a resume checkpoint's name and metadata; and a ``dataset_path`` file's every
    line as the kind reads it without a tokenizer. Raises what admission would."""
    from kiln import contracts
    from kiln.adapters.publish import check_target
    from kiln.checkpoints import inspect_checkpoint, resolve_checkpoint_path
    from kiln.data import precheck_dataset_file
    from kiln.host.config import resolve_settings
    from kiln.host.fs import name_problem
    from kiln.model import check_model_dir

    why = name_problem(args.adapter, kind="adapter")
    if why is not None:
        raise ValueError(f"--adapter {args.adapter!r}: {why}")
    request = build_request(args, path)
    contracts.load(args.request_type, request, document=args.request_type)
    settings = resolve_settings({"model.path": args.model, "model.adapter_dir": args.adapter_dir})
    if settings.model.path is not None:
        check_model_dir(settings.model.path)
    registry = settings.registry
    check_target(registry, args.adapter)
    resume = request["config"].get("resume_checkpoint")
    if isinstance(resume, str):
        inspect_checkpoint(resolve_checkpoint_path(registry, resume, adapter=args.adapter))
    if isinstance(request.get("dataset_path"), str):
        precheck_dataset_file(kind, request["dataset_path"], request["config"])


def _ranks(args: argparse.Namespace) -> int:
    """The world size of the flags: ``--nproc-per-node`` x ``--nnodes`` (1 for the kinds without them)."""
    return int(getattr(args, "nproc_per_node", None) or 1) * int(getattr(args, "nnodes", None) or 1)


def _admit(args: argparse.Namespace, kind: str, path: Path) -> tuple[Any, dict[str, Any], Any]:
    """The admitted job, the replay request the ranks admit again, and the context it was admitted in."""
    from kiln.host.config import resolve_settings
    from kiln.teachers import teachers_root
    from kiln.trainers import TRAINERS, TrainingContext
    from kiln.training import DataParallel, MemorySettings

    settings = resolve_settings({"model.path": args.model, "model.adapter_dir": args.adapter_dir})
    request = build_request(args, path)
    request["config"].pop("auto_load", None)  # nothing is served locally
    context = TrainingContext(
        registry=settings.registry,
        model_path=settings.model.path,
        teachers_root=teachers_root(settings.home),
        checkpoint_interval=settings.training.checkpoint_interval,
        data_parallel=DataParallel.planned(_ranks(args), getattr(args, "nproc_per_node", 1)),
        memory=MemorySettings.of(settings.training),
    )
    job = TRAINERS[kind].admit(request, adapter_name=args.adapter, context=context)
    replay = job.replay_config(request["config"].get("resume_checkpoint"))
    return job, {**request, "config": replay}, context  # what the ranks admit again


def _result_of(outcome: dict[str, Any], target: Path) -> Any:
    """The ``TrainResult`` a worker's outcome line describes (its receipt read from where the run wrote it)."""
    from kiln.adapters import MANIFEST_FILE, RECEIPT_FILE
    from kiln.documents.jsonio import read_json_file
    from kiln.trainers import TrainResult

    receipt_path = Path(outcome["receipt_path"]) if outcome.get("receipt_path") else None
    adapter = Path(outcome["adapter_path"]) if outcome.get("adapter_path") else None
    checkpoints = [Path(p) for p in outcome.get("checkpoints", [])]
    latest = outcome.get("latest_checkpoint")
    return TrainResult(
        "success" if outcome["state"] == "completed" else "failed",
        adapter or target,
        receipt_path or target / RECEIPT_FILE,
        adapter / MANIFEST_FILE if adapter is not None else None,
        read_json_file(receipt_path) if receipt_path is not None else _no_receipt(outcome),
        losses=[float(x) for x in outcome.get("losses", [])],
        checkpoints=checkpoints,
        cancelled=bool(outcome.get("cancelled")),
        resumed_from=Path(latest) if latest and not checkpoints else None,  # so latest_checkpoint reads the same
    )


def _no_receipt(outcome: dict[str, Any]) -> dict[str, Any]:
    """A run that failed before any receipt (a rank refused its admission, a worker died): the failure as a receipt
    would name it."""
    reason, _, message = (outcome.get("error") or "training_error: no detail").partition(": ")
    return {"failure_reason": reason, "failure_message": message or None}


def _worker_spec(args: argparse.Namespace, kind: str, admitted: tuple[Any, dict[str, Any], Any], events: Path) -> Any:
    """The ``kiln.worker-spec.v1`` the ranks run: the admitted job's replay request, its fingerprint, the launch the
    data-parallel flags describe."""
    from kiln.artifacts.worker_spec import build_worker_spec

    job, replay, ctx = admitted
    return build_worker_spec(
        kind=kind,
        adapter_name=args.adapter,
        request=replay,
        fingerprint=job.fingerprint(),
        events=events,
        server_pid=os.getpid(),  # the ranks end when this command does
        launch={
            "nproc_per_node": int(args.nproc_per_node),
            "nnodes": int(args.nnodes),
            "node_rank": int(args.node_rank),
            "rdzv_endpoint": args.rdzv_endpoint,
            "rdzv_id": args.rdzv_id,
            "threads_per_rank": job.data_parallel.threads,
        },
        registry=ctx.registry,
        model_path=job.loaded.path,
        model_is_default=bool(job.loaded.is_default),
        teachers_root=ctx.teachers_root,
        checkpoint_interval=ctx.checkpoint_interval,
        data_roots=None,
        memory_limit_bytes=ctx.memory.memory_limit_bytes,
    )


def _run_ranks(
    args: argparse.Namespace,
    kind: str,
    admitted: tuple[Any, dict[str, Any], Any],
    emit: Callable[[dict[str, Any]], None],
    cancellation: _Cancellation,
) -> dict[str, Any] | None:
    """Train over several ranks: the worker (``torchrun``) in a session of its own, its events followed; returns
    rank 0's outcome line, or None when this node's ranks ended without one (rank 0 ran on another node). The
    workers' output goes to ``worker.log``, quoted when they end without an outcome."""
    from kiln.artifacts.worker_spec import write_worker_spec
    from kiln.jobs.worker import follow

    with tempfile.TemporaryDirectory(prefix="kiln-ranks-") as tmp:
        directory = Path(tmp)
        spec_path, events, log_path = directory / "spec.json", directory / "events.jsonl", directory / "worker.log"
        write_worker_spec(spec_path, _worker_spec(args, kind, admitted, events))
        proc, outcome = follow(
            spec_path,
            log_path,
            cancellation.event,
            lambda event: emit(event) if event.get("event") == "progress" else None,
            new_session=True,  # the terminal's Ctrl-C reaches this process, which forwards it once
        )
        if outcome is None and proc.returncode != 0:
            tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:].strip()
            return {
                "event": "outcome",
                "state": "failed",
                "error": f"training_error: the workers exited with status {proc.returncode} without an outcome. "
                f"Their last output: {tail}",
            }
        return outcome


def cmd_train_local(args: argparse.Namespace, kind: str) -> int:
    """Admit, train (in this process, or over several ranks), print where the adapter, receipt and manifest are (or
    why it failed). Mistakes that need no model -- the flags, the file, an SFT file's rows -- are answered before
    torch is imported."""
    path = Path(args.file)
    problem = rank_flags_problem(args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    refused = prepare(path, lambda: precheck(args, kind, path))
    if refused is not None:  # the exit status of a refusal
        return int(refused)

    from kiln.jobs.worker import train_admitted
    from kiln.trainers import TRAINERS

    text = TRAINERS[kind].texts
    admitted = prepare(path, lambda: _admit(args, kind, path))
    if isinstance(admitted, int):
        return admitted
    job = admitted[0]
    ranks = _ranks(args)
    bar = None
    if not args.json and not job.dry_run:
        from kiln.host.progress import counter

        print(text.headline(job))
        if ranks > 1:
            print(f"Data parallel: {ranks} ranks ({args.nnodes} node(s) x {args.nproc_per_node}), backend "
                  f"{job.data_parallel.backend}")  # fmt: skip
        if job.resume is not None:
            print(f"Resuming from {job.resume.path.name} (step {job.start_step} of {job.total_steps}, verified)")
        bar = counter(unit=text.unit)
    started = time.perf_counter()
    tokens = [0]

    def progress(event: dict[str, Any]) -> None:
        tokens[0] += event.get("tokens", 0)
        if bar is not None:
            bar.total, bar.n = event["total"], event["step"] - 1
            postfix = {"tok_s": f"{tokens[0] / max(time.perf_counter() - started, 1e-9):,.0f}"}
            if event["loss"] is not None:  # an OPD candidate with an empty rollout has none
                postfix = {text.metric: f"{event['loss']:.4f}", **postfix}
            if event.get("reward") is not None:  # online GRPO: the mean reward of the group just trained
                postfix = {"reward": f"{event['reward']:.3f}", **postfix}
            bar.set_postfix(postfix)
            bar.update(1)

    cancellation = _Cancellation(quiet=args.json)
    target = job.registry / job.adapter_name
    try:
        with cancellation:
            if ranks > 1:
                found = _run_ranks(args, kind, admitted, progress, cancellation)
            else:
                found = train_admitted(
                    TRAINERS[kind], job, lambda e: progress(e) if e["event"] == "progress" else None, cancellation.event
                )
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        print("✗ aborted without a checkpoint; the last published checkpoint is intact", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
    if found is None:
        print(
            f"✓ node {args.node_rank}: its ranks finished; rank 0, on another node, publishes adapter '{args.adapter}'"
        )
        return 0
    result = _result_of(found, target)
    latest = result.latest_checkpoint
    failed = result.status != "success"
    resume = (
        resume_command(args, latest.name, job.config.checkpoint_interval) if latest is not None and failed else None
    )
    receipt = result.receipt
    if args.json:
        summary = {
            "status": result.status,
            "adapter_dir": str(result.adapter_dir),
            "receipt": str(result.receipt_path),
            "manifest": str(result.manifest_path) if result.manifest_path else None,
            "effective_seed": str(job.config.seed),
            "failure_reason": receipt["failure_reason"],
            "failure_message": receipt.get("failure_message"),
            "final_loss": result.losses[-1] if result.losses else None,
            "optimizer_steps": len(result.losses),
            "cancelled": result.cancelled,
            "checkpoints": [str(p) for p in result.checkpoints],
            "resume_checkpoint": latest.name if resume is not None else None,
            "resume_command": resume,
            "world_size": ranks,
            **(text.summary(job, result) if text.summary is not None else {}),
        }
        print(json.dumps(summary, indent=2))
    elif not failed:
        for line in text.success(job, result):
            print(line)
    else:
        print(_failure_line("dry run" if job.dry_run else "training", receipt), file=sys.stderr)
        print(f"Receipt: {result.receipt_path}", file=sys.stderr)
        if resume is not None:
            print(f"Checkpoint: {latest}", file=sys.stderr)
            print(f"Resume with:\n  {resume}", file=sys.stderr)
    if cancellation.signum is not None and failed:
        return 128 + cancellation.signum
    return 1 if failed else 0
