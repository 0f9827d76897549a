"""``kiln train sft|grpo|opd --local``: one runner for every kind, through ``kiln.trainers.TRAINERS``.

The request is built from the file and the flags exactly as for a server (``kiln.cli._requests``), admitted in this
process (the configured registry, model, teacher registry and ``training.checkpoint_interval``), then trained under
SIGINT/SIGTERM cancellation -- the first signal asks for a checkpoint at the next step and a failed run with reason
``cancelled``, a second aborts without one -- with a progress bar; the result is printed as lines or, with
``--json``, one summary object. What differs between kinds is only how a run is described (``TEXTS``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kiln.cli._requests import build_request, flag_argv, prepare, sft_resume_command, training_flags
from kiln.errors import RequestError

__all__ = ["cmd_train_local"]


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


def _configured_interval(value: Any) -> int | None:
    """``training.checkpoint_interval`` from ``KILN_TRAINING_CHECKPOINT_INTERVAL`` or kiln.toml."""
    if value is None:
        return None
    try:
        interval = int(value)
    except (TypeError, ValueError):
        interval = 0
    if interval < 1 or isinstance(value, bool):
        raise RequestError(
            f"training.checkpoint_interval is {value!r}; it must be a positive integer",
            code="config_invalid",
            hint="fix KILN_TRAINING_CHECKPOINT_INTERVAL or [training] checkpoint_interval in kiln.toml",
        )
    return interval


# ----------------------------------------------------------------------------- how each kind is described


class _Sft:
    unit, label, what = "step", "loss", "training"

    @staticmethod
    def headline(args: argparse.Namespace, job: Any) -> str:
        cfg = job.config
        return (
            f"Training SFT adapter '{args.adapter}' on {job.loaded.path.name} "
            f"({len(job.ingestion.examples)} conversations x {cfg['epochs']} epoch(s), seed {cfg['seed']})"
        )

    @staticmethod
    def success(job: Any, result: Any) -> list[str]:
        receipt, losses = result.receipt, result.losses
        lines = [
            f"✓ trained {len(losses)} steps in {receipt['runtime']['wall_clock_ms'] / 1000:.1f} s, "
            f"loss {losses[0]:.4f} -> {losses[-1]:.4f}",
            *_where(result),
            f"Effective seed: {job.config['seed']}   Loss route: {receipt['runtime']['sft_loss_route']}",
        ]
        if result.checkpoints:
            lines.append(f"Checkpoints: {len(result.checkpoints)} published (newest {result.checkpoints[-1].name})")
        return lines

    @staticmethod
    def resume(args: argparse.Namespace, path: Path, job: Any, checkpoint: str) -> str:
        return sft_resume_command(args, checkpoint, job.config["checkpoint_interval"])

    @staticmethod
    def summary(job: Any, result: Any) -> dict[str, Any]:
        return {}


class _Grpo:
    unit, label, what = "group", "loss", "training"

    @staticmethod
    def headline(args: argparse.Namespace, job: Any) -> str:
        groups = job.ingestion.groups
        completions = sum(len(g.completions) for g in groups)
        return (
            f"Training GRPO adapter '{args.adapter}' on {len(groups)} groups ({completions} completions), "
            f"seed {job.config['seed']}"
        )

    @staticmethod
    def success(job: Any, result: Any) -> list[str]:
        data = result.receipt["data"]
        if job.dry_run:
            return [
                f"✓ dry run passed: {data['groups_read']} groups, {data['completions_read']} completions; "
                f"{data['groups_read'] - data['groups_filtered']} would train (no forward pass ran)",
                f"Receipt: {result.receipt_path}",
            ]
        seconds = result.receipt["runtime"]["wall_clock_ms"] / 1000
        losses = f", loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}" if result.losses else ""
        return [
            f"✓ trained {data['groups_trained']} groups in {seconds:.1f} s{losses}",
            *_where(result),
            f"Effective seed: {job.config['seed']}",
        ]

    @staticmethod
    def resume(args: argparse.Namespace, path: Path, job: Any, checkpoint: str) -> str:
        return _resume_command(args, "grpo", path, checkpoint)

    @staticmethod
    def summary(job: Any, result: Any) -> dict[str, Any]:
        return {"dry_run": job.dry_run, "groups_trained": result.receipt["data"]["groups_trained"]}


class _Opd:
    unit, label, what = "candidate", "kl", "training"

    @staticmethod
    def headline(args: argparse.Namespace, job: Any) -> str:
        cfg = job.config
        return (
            f"Distilling teacher '{job.teacher.alias}' into adapter '{args.adapter}': {len(job.candidates)} "
            f"candidates x {cfg['epochs']} epoch(s), top-K {cfg['top_k']}, seed {cfg['seed']}"
        )

    @staticmethod
    def success(job: Any, result: Any) -> list[str]:
        receipt = result.receipt
        opd = receipt["opd"]
        return [
            f"✓ {len(result.losses)} optimizer steps over {job.total_steps} candidates in "
            f"{receipt['runtime']['wall_clock_ms'] / 1000:.1f} s, reverse KL "
            f"{opd['initial_opd_loss']:.4f} -> {opd['final_opd_loss']:.4f}",
            *_where(result),
            f"Effective seed: {job.config['seed']}",
        ]

    @staticmethod
    def resume(args: argparse.Namespace, path: Path, job: Any, checkpoint: str) -> str:
        return _resume_command(args, "opd", path, checkpoint, teacher=args.teacher)

    @staticmethod
    def summary(job: Any, result: Any) -> dict[str, Any]:
        return {}


TEXTS: dict[str, Any] = {"sft": _Sft, "grpo": _Grpo, "opd": _Opd}


def _where(result: Any) -> list[str]:
    return [f"Adapter:  {result.adapter_dir}", f"Receipt:  {result.receipt_path}", f"Manifest: {result.manifest_path}"]


def _resume_command(
    args: argparse.Namespace, kind: str, path: Path, checkpoint: str, *, teacher: str | None = None
) -> str:
    argv = ["kiln", "train", kind, "--local", "-f", str(path), "--adapter", args.adapter]
    if teacher is not None:
        argv += ["--teacher", teacher]
    argv += flag_argv((("--adapter-dir", args.adapter_dir), ("--model", args.model), *training_flags(args, kind)))
    argv += ["--resume-checkpoint", checkpoint]
    if args.checkpoint_interval:
        argv += ["--checkpoint-interval", str(args.checkpoint_interval)]
    return shlex.join(argv)


def _failure_line(what: str, receipt: dict[str, Any]) -> str:
    """How a local run that did not succeed ended, in the receipt's own terms."""
    if receipt["failure_reason"] == "cancelled":
        return f"✗ {what} cancelled: its receipt records status failed, failure_reason cancelled"
    return f"✗ {what} failed ({receipt['failure_reason']}): {receipt.get('failure_message')}"


# ----------------------------------------------------------------------------- the run


def _admit(args: argparse.Namespace, kind: str, path: Path) -> Any:
    from kiln.config import config_value, configured_registry, load_config
    from kiln.home import kiln_home
    from kiln.teachers import teachers_root
    from kiln.trainers import TRAINERS, TrainingContext

    settings = load_config()
    request = build_request(args, kind, path)
    request["config"].pop("auto_load", None)  # nothing is served locally
    context = TrainingContext(
        registry=configured_registry(args.adapter_dir, settings),
        model_path=args.model or config_value(settings, "model", "path"),
        teachers_root=teachers_root(kiln_home()),
        checkpoint_interval=_configured_interval(config_value(settings, "training", "checkpoint_interval")),
    )
    return TRAINERS[kind].admit(request, adapter_name=args.adapter, context=context)


def cmd_train_local(args: argparse.Namespace, kind: str) -> int:
    """Admit, train in this process, print where the adapter, receipt and manifest are (or why it failed)."""
    from kiln.trainers import TRAINERS

    path = Path(args.file)
    text = TEXTS[kind]
    job = prepare(path, lambda: _admit(args, kind, path))
    if isinstance(job, int):
        return job
    bar = None
    if not args.json and not job.dry_run:
        from tqdm import tqdm

        print(text.headline(args, job))
        if job.resume is not None:
            print(f"Resuming from {job.resume.path.name} (step {job.start_step} of {job.total_steps}, verified)")
        bar = tqdm(unit=text.unit, dynamic_ncols=True, file=sys.stderr)
    started = time.perf_counter()
    tokens = [0]

    def progress(event: dict[str, Any]) -> None:
        tokens[0] += event.get("tokens", 0)
        if bar is not None:
            bar.total, bar.n = event["total"], event["step"] - 1
            postfix = {"tok_s": f"{tokens[0] / max(time.perf_counter() - started, 1e-9):,.0f}"}
            if event["loss"] is not None:  # an OPD candidate with an empty rollout has none
                postfix = {text.label: f"{event['loss']:.4f}", **postfix}
            bar.set_postfix(postfix)
            bar.update(1)

    cancellation = _Cancellation(quiet=args.json)
    try:
        with cancellation:
            result = TRAINERS[kind].run(job, progress=progress, cancel=cancellation.event)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        print("✗ aborted without a checkpoint; the last published checkpoint is intact", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
    latest = result.latest_checkpoint
    failed = result.status != "success"
    resume = text.resume(args, path, job, latest.name) if latest is not None and failed else None
    receipt = result.receipt
    if args.json:
        summary = {
            "status": result.status,
            "adapter_dir": str(result.adapter_dir),
            "receipt": str(result.receipt_path),
            "manifest": str(result.manifest_path) if result.manifest_path else None,
            "effective_seed": str(job.config["seed"]),
            "failure_reason": receipt["failure_reason"],
            "failure_message": receipt.get("failure_message"),
            "final_loss": result.losses[-1] if result.losses else None,
            "optimizer_steps": len(result.losses),
            "cancelled": result.cancelled,
            "checkpoints": [str(p) for p in result.checkpoints],
            "resume_checkpoint": latest.name if resume is not None else None,
            "resume_command": resume,
            **text.summary(job, result),
        }
        print(json.dumps(summary, indent=2))
    elif not failed:
        for line in text.success(job, result):
            print(line)
    else:
        print(_failure_line("dry run" if job.dry_run else text.what, receipt), file=sys.stderr)
        print(f"Receipt: {result.receipt_path}", file=sys.stderr)
        if resume is not None:
            print(f"Checkpoint: {latest}", file=sys.stderr)
            print(f"Resume with:\n  {resume}", file=sys.stderr)
    if cancellation.signum is not None and failed:
        return 128 + cancellation.signum
    return 1 if failed else 0
