"""``kiln train``: SFT, GRPO and OPD jobs on a server, job status and cancellation; ``kiln train sft|grpo|opd
--local`` and ``kiln models create-tiny`` run in-process (they import torch, on use).

Without ``--local`` a training command builds the request from the file and the flags (the same
flags build the same ``SftConfig`` as ``--local``, in ``kiln.cli._requests``), submits it with the
generated SDK and prints the job id and effective seed; ``--wait`` then follows the job with a
progress bar until it ends. The parsers and the local runs are here; the HTTP commands are in
``kiln.cli._jobs``, which imports nothing from this module.
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

from kiln.cli._client import DEFAULT_URL, add_client_options
from kiln.cli._jobs import cmd_train_cancel, cmd_train_status, submit
from kiln.cli._requests import build_request, prepare, read_examples, sft_resume_command, training_config
from kiln.errors import RequestError

OPTIMIZERS = ("muon", "adam_w", "sgd")


def add_train_parser(sub: Any) -> None:
    train = sub.add_parser(
        "train",
        help="train an adapter on a server (or in-process with --local); follow and cancel jobs",
        description="Submit SFT, GRPO and OPD jobs to a running `kiln serve` (--url, default $KILN_URL, else "
        f"{DEFAULT_URL}), list them and cancel them. `kiln train sft --local` trains in this process instead.",
    )
    kinds = train.add_subparsers(dest="train_kind", metavar="KIND")
    p = kinds.add_parser(
        "sft",
        help="supervised fine-tuning on a file of conversations",
        description="Train a LoRA adapter on conversations ({'messages': [...]} per JSONL line, or a JSON array). "
        "By default the job is submitted to the server: a .jsonl file is sent as its absolute dataset_path (the "
        "server reads it, so it must see the same file system), any other file as inline examples. "
        "With --local the job runs in this process and writes the adapter, train_receipt.json and "
        "adapter_manifest.json into the adapter registry.",
    )
    p.add_argument(
        "-f", "--file", required=True, help="a .jsonl file (sent as dataset_path) or a JSON array of examples"
    )
    p.add_argument("--adapter", required=True, help="output adapter name (path-safe)")
    p.add_argument("--local", action="store_true", help="run in-process instead of submitting to a server")
    p.add_argument("--adapter-dir", help="--local: adapter registry directory (default: $KILN_HOME/adapters)")
    p.add_argument(
        "--model", help="--local: base model directory (default: KILN_MODEL_PATH, else the built-in tiny model)"
    )
    p.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    p.add_argument("--seed", help="effective seed (default: a fresh random 64-bit seed, printed)")
    p.add_argument("--lr", type=float, help="learning rate (default: muon 1e-3, adam_w/sgd 1e-4)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="muon")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--invalid-row-policy", choices=("fail", "skip"), default="fail")
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        metavar="N",
        help="publish an exact-resume checkpoint every N optimizer steps (default: training.checkpoint_interval "
        "of kiln.toml or KILN_TRAINING_CHECKPOINT_INTERVAL -- the server's, without --local -- else none; "
        "Ctrl-C under --local always publishes one at the next step)",
    )
    p.add_argument(
        "--resume-checkpoint",
        metavar="BASENAME",
        help="continue an interrupted run from this checkpoint (basename in the adapter registry, or an "
        "absolute path directly inside it); every other option must match the original run",
    )
    _add_job_options(
        p,
        json_help="print the result as JSON: the server's TrainingResponse (the final "
        "TrainingJobDetail with --wait), or the local result with --local; no progress bar",
    )
    p.set_defaults(func=cmd_train_sft)

    p = kinds.add_parser(
        "grpo",
        help="GRPO on a file of scored groups (on a server, or in-process with --local)",
        description="Submit a GRPO job: a .jsonl file is sent as its absolute dataset_path (the streamed route), "
        "a .json file as the request object itself (or, for a bare array, as its groups). --adapter becomes "
        "config.output_name; the other flags override the file's config.",
    )
    _add_kind_options(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the streamed file end to end without training (needs a .jsonl dataset_path)",
    )
    p.set_defaults(func=cmd_train_grpo)

    p = kinds.add_parser(
        "opd",
        help="on-policy distillation from a registered teacher",
        description="Submit an OPD job: a .json file holding the request object or a bare array of prompts "
        "(sent as {'prompts': [...], 'teacher': ALIAS}); a .jsonl file is sent as its absolute dataset_path. "
        "--adapter becomes config.output_name; the other flags override the file's config. With --local it runs "
        "in-process against the local teacher registry (kiln teachers add); checkpoint_interval defaults to 25.",
    )
    _add_kind_options(p)
    p.add_argument(
        "--teacher", required=True, metavar="ALIAS", help="alias of a registered teacher (kiln teachers list)"
    )
    p.add_argument("--epochs", type=int, help="passes over the prompt x sample candidates")
    p.set_defaults(func=cmd_train_opd)

    p = kinds.add_parser(
        "status",
        help="all jobs as a table, or one job in detail",
        description="Without --job-id: every job (id, type, state, progress, loss, adapter). With --job-id: its "
        "state, progress, loss, seed, error and the checkpoint a failed run resumes from.",
    )
    p.add_argument("--job-id", metavar="ID", help="show this job in detail")
    add_client_options(p, json_help="print the server's TrainingStatus list (TrainingJobDetail with --job-id)")
    p.set_defaults(func=cmd_train_status)

    p = kinds.add_parser(
        "cancel",
        help="cancel a queued job, or ask a running one to stop at its next step",
        description="A queued job is removed at once; a running job finishes its step, publishes a checkpoint "
        "and ends failed with reason cancelled (resume it with --resume-checkpoint).",
    )
    p.add_argument("--job-id", required=True, metavar="ID", help="the job to cancel")
    add_client_options(p, json_help="print the server's CancelTrainingJobResponse")
    p.set_defaults(func=cmd_train_cancel)


def _add_job_options(p: argparse.ArgumentParser, *, json_help: str) -> None:
    """What every submission shares: activation, following the job, and the client options."""
    p.add_argument(
        "--no-auto-load",
        action="store_true",
        help="do not make the adapter active on the server when the job succeeds (config.auto_load false)",
    )
    p.add_argument(
        "--wait", action="store_true", help="follow the job until it ends; exit 0 if it completed, 1 if it failed"
    )
    add_client_options(p, json_help=json_help)


def _add_kind_options(p: argparse.ArgumentParser) -> None:
    """The options of ``kiln train grpo`` and ``kiln train opd`` (defaults are the server's)."""
    p.add_argument("-f", "--file", required=True, help="a .jsonl file (sent as dataset_path) or a .json request")
    p.add_argument("--adapter", required=True, help="output adapter name (path-safe): config.output_name")
    p.add_argument("--local", action="store_true", help="run in-process instead of on a server")
    p.add_argument("--model", help="--local: local Hugging Face model directory (default: the built-in tiny model)")
    p.add_argument("--adapter-dir", help="--local: adapter registry directory (default: $KILN_HOME/adapters)")
    p.add_argument("--seed", help="effective seed (default: a fresh random 64-bit seed, printed)")
    p.add_argument("--lr", type=float, help="learning rate (default: the optimizer's)")
    p.add_argument("--optimizer", choices=OPTIMIZERS)
    p.add_argument("--lora-rank", type=int)
    p.add_argument("--lora-alpha", type=float)
    p.add_argument("--checkpoint-interval", type=int, metavar="N", help="publish a checkpoint every N steps")
    p.add_argument("--resume-checkpoint", metavar="BASENAME", help="continue from this checkpoint")
    _add_job_options(p, json_help="print the server's TrainingResponse (the final TrainingJobDetail with --wait)")


def add_models_parser(sub: Any) -> None:
    models = sub.add_parser("models", help="built-in models")
    verbs = models.add_subparsers(dest="models_verb", metavar="VERB")
    p = verbs.add_parser("create-tiny", help="write a tiny model (same tokenizer as the default, weights from --seed)")
    p.add_argument("path", help="directory to create (must not exist)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (0 is the built-in default)")
    p.set_defaults(func=cmd_create_tiny)


def cmd_train_sft(args: argparse.Namespace) -> int:
    return cmd_train_sft_local(args) if args.local else submit(args, "sft")


def cmd_train_grpo(args: argparse.Namespace) -> int:
    return cmd_train_grpo_local(args) if args.local else submit(args, "grpo")


def cmd_train_opd(args: argparse.Namespace) -> int:
    return cmd_train_opd_local(args) if args.local else submit(args, "opd")


def _default_interval(value: Any) -> int | None:
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


def cmd_train_sft_local(args: argparse.Namespace) -> int:
    """``kiln train sft --local``: admit, train in this process under SIGINT/SIGTERM cancellation, print the result."""
    from kiln.config import config_value, configured_registry, load_config
    from kiln.trainers.sft import admit_sft, run_sft

    path = Path(args.file)

    def admit() -> Any:
        config = training_config(args, "sft")
        settings = load_config()
        if "checkpoint_interval" not in config:
            default_interval = _default_interval(config_value(settings, "training", "checkpoint_interval"))
            if default_interval is not None:
                config["checkpoint_interval"] = default_interval
        examples, dataset_path = read_examples(path)
        return admit_sft(
            adapter_name=args.adapter,
            registry=configured_registry(args.adapter_dir, settings),
            config=config,
            examples=examples,
            dataset_path=dataset_path,
            model_path=args.model or config_value(settings, "model", "path"),
        )

    job = prepare(path, admit)
    if isinstance(job, int):
        return job
    cfg = job.config
    if not args.json:
        print(
            f"Training SFT adapter '{args.adapter}' on {job.loaded.path.name} "
            f"({len(job.ingestion.examples)} conversations x {cfg['epochs']} epoch(s), seed {cfg['seed']})"
        )
        if job.resume is not None:
            print(f"Resuming from {job.resume.path.name} (step {job.start_step} of {job.total_steps}, verified)")
    bar = None
    if not args.json:
        from tqdm import tqdm

        bar = tqdm(total=job.total_steps, initial=job.start_step, unit="step", dynamic_ncols=True, file=sys.stderr)
    started = time.perf_counter()
    tokens = [0]

    def progress(event: dict[str, Any]) -> None:
        tokens[0] += event["tokens"]
        if bar is not None:
            rate = tokens[0] / max(time.perf_counter() - started, 1e-9)
            bar.set_postfix(loss=f"{event['loss']:.4f}", tok_s=f"{rate:,.0f}")
            bar.update(1)

    cancellation = _Cancellation(quiet=args.json)
    try:
        with cancellation:
            result = run_sft(job, progress=progress, cancel=cancellation.event)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        print("✗ aborted without a checkpoint; the last published checkpoint is intact", file=sys.stderr)
        return 130
    finally:
        if bar is not None:
            bar.close()
    receipt = result.receipt
    latest = result.latest_checkpoint
    resume = sft_resume_command(args, latest.name, cfg["checkpoint_interval"]) if latest is not None else None
    if args.json:
        print(
            json.dumps(
                {
                    "status": result.status,
                    "adapter_dir": str(result.adapter_dir),
                    "receipt": str(result.receipt_path),
                    "manifest": str(result.manifest_path) if result.manifest_path else None,
                    "effective_seed": str(cfg["seed"]),
                    "failure_reason": receipt["failure_reason"],
                    "failure_message": receipt.get("failure_message"),
                    "final_loss": result.losses[-1] if result.losses else None,
                    "cancelled": result.cancelled,
                    "checkpoints": [str(p) for p in result.checkpoints],
                    "resume_checkpoint": latest.name if latest is not None and result.status != "success" else None,
                    "resume_command": resume if result.status != "success" else None,
                },
                indent=2,
            )
        )
    elif result.status == "success":
        print(
            f"✓ trained {len(result.losses)} steps in {receipt['runtime']['wall_clock_ms'] / 1000:.1f} s, "
            f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}"
        )
        print(f"Adapter:  {result.adapter_dir}")
        print(f"Receipt:  {result.receipt_path}")
        print(f"Manifest: {result.manifest_path}")
        print(f"Effective seed: {cfg['seed']}   Loss route: {receipt['runtime']['sft_loss_route']}")
        if result.checkpoints:
            print(f"Checkpoints: {len(result.checkpoints)} published (newest {result.checkpoints[-1].name})")
    else:
        print(_failure_line("training", receipt), file=sys.stderr)
        print(f"Receipt: {result.receipt_path}", file=sys.stderr)
        if latest is not None:
            print(f"Checkpoint: {latest}", file=sys.stderr)
            print(f"Resume with:\n  {resume}", file=sys.stderr)
    if result.cancelled:
        return 128 + (cancellation.signum or signal.SIGINT)
    return 0 if result.status == "success" else 1


def cmd_create_tiny(args: argparse.Namespace) -> int:
    from kiln.model import create_tiny

    try:
        path = create_tiny(args.path, seed=args.seed)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"✓ tiny model (seed {args.seed}) written to {path}")
    return 0


def _admit_local(args: argparse.Namespace, kind: str, path: Path, admit: Any, **extra: Any) -> Any:
    """The admitted job of a ``--local`` GRPO/OPD run, or the exit status when admission refused it."""
    from kiln.config import config_value, configured_registry, load_config

    def admitted() -> Any:
        request = build_request(args, kind, path)
        request["config"].pop("auto_load", None)  # nothing is served locally
        settings = load_config()
        return admit(
            adapter_name=args.adapter,
            registry=configured_registry(args.adapter_dir, settings),
            request=request,
            model_path=args.model or config_value(settings, "model", "path"),
            **extra,
        )

    return prepare(path, admitted)


def cmd_train_grpo_local(args: argparse.Namespace) -> int:
    """``kiln train grpo --local``: admit, train (or dry-run) in this process, print where things are."""
    from kiln.trainers.grpo import admit_grpo, run_grpo

    path = Path(args.file)
    job = _admit_local(args, "grpo", path, admit_grpo)
    if isinstance(job, int):
        return job
    groups = job.ingestion.groups
    completions = sum(len(g.completions) for g in groups)
    bar = None
    if not args.json and not job.dry_run:
        from tqdm import tqdm

        print(
            f"Training GRPO adapter '{args.adapter}' on {len(groups)} groups ({completions} completions), "
            f"seed {job.config['seed']}"
        )
        bar = tqdm(total=len(groups), unit="group", dynamic_ncols=True, file=sys.stderr)

    result, cancel = _run_with_bar(args, run_grpo, job, bar, "loss")
    receipt = result.receipt
    if args.json:
        _print_summary(result, job, dry_run=job.dry_run, groups_trained=receipt["data"]["groups_trained"])
    elif result.status == "success" and job.dry_run:
        data = receipt["data"]
        print(
            f"✓ dry run passed: {data['groups_read']} groups, {data['completions_read']} completions; "
            f"{data['groups_read'] - data['groups_filtered']} would train (no forward pass ran)"
        )
        print(f"Receipt: {result.receipt_path}")
    elif result.status == "success":
        print(
            f"✓ trained {receipt['data']['groups_trained']} groups in {receipt['runtime']['wall_clock_ms'] / 1000:.1f} s"
            + (f", loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}" if result.losses else "")
        )
        print(f"Adapter:  {result.adapter_dir}")
        print(f"Receipt:  {result.receipt_path}")
        print(f"Manifest: {result.manifest_path}")
        print(f"Effective seed: {job.config['seed']}")
    else:
        _print_failure("dry run" if job.dry_run else "training", "grpo", args, path, result)
    return _exit_code(result, cancel)


def _run_with_bar(args: argparse.Namespace, run: Any, job: Any, bar: Any, label: str) -> tuple[Any, _Cancellation]:
    """Run an admitted job under SIGINT/SIGTERM cancellation, one bar tick per progress event."""

    def progress(event: dict[str, Any]) -> None:
        if bar is not None:
            if event["loss"] is not None:  # an OPD candidate with an empty rollout has none
                bar.set_postfix({label: f"{event['loss']:.4f}"})
            bar.update(1)

    cancel = _Cancellation(quiet=args.json)
    try:
        with cancel:
            result = run(job, progress=progress, cancel=cancel.event)
    finally:
        if bar is not None:
            bar.close()
    return result, cancel


def _print_summary(result: Any, job: Any, **extra: Any) -> None:
    """``--json``: where the artifacts are and how the run ended."""
    receipt = result.receipt
    summary = {
        "status": result.status,
        "adapter_dir": str(result.adapter_dir),
        "receipt": str(result.receipt_path),
        "manifest": str(result.manifest_path) if result.manifest_path else None,
        "effective_seed": str(job.config["seed"]),
        "failure_reason": receipt["failure_reason"],
        "failure_message": receipt.get("failure_message"),
        **extra,
    }
    print(json.dumps(summary, indent=2))


def _failure_line(what: str, receipt: dict[str, Any]) -> str:
    """How a local run that did not succeed ended, in the receipt's own terms."""
    if receipt["failure_reason"] == "cancelled":
        return f"✗ {what} cancelled: its receipt records status failed, failure_reason cancelled"
    return f"✗ {what} failed ({receipt['failure_reason']}): {receipt.get('failure_message')}"


def _print_failure(what: str, kind: str, args: argparse.Namespace, path: Path, result: Any) -> None:
    """A failed local run: the reason, the receipt, and the exact command that resumes it."""
    receipt = result.receipt
    print(_failure_line(what, receipt), file=sys.stderr)
    print(f"Receipt: {result.receipt_path}", file=sys.stderr)
    if result.checkpoints:
        newest = result.checkpoints[-1].name
        extra = f" --teacher {shlex.quote(args.teacher)}" if kind == "opd" else ""
        print(f"Checkpoint: {result.checkpoints[-1]}", file=sys.stderr)
        print(
            f"Resume with:\n  kiln train {kind} --local -f {shlex.quote(str(path))} --adapter {args.adapter}{extra} "
            f"--resume-checkpoint {newest}"
            + (f" --checkpoint-interval {args.checkpoint_interval}" if args.checkpoint_interval else ""),
            file=sys.stderr,
        )


def _exit_code(result: Any, cancel: _Cancellation) -> int:
    if cancel.signum is not None and result.status != "success":
        return 128 + cancel.signum
    return 0 if result.status == "success" else 1


def cmd_train_opd_local(args: argparse.Namespace) -> int:
    """``kiln train opd --local``: admit against the local teacher registry, train in this process."""
    from kiln.home import kiln_home
    from kiln.teachers import teachers_root
    from kiln.trainers.opd import admit_opd, run_opd

    path = Path(args.file)
    job = _admit_local(args, "opd", path, admit_opd, teachers_root=teachers_root(kiln_home()))
    if isinstance(job, int):
        return job
    total = job.total_steps
    bar = None
    if not args.json:
        from tqdm import tqdm

        print(
            f"Distilling teacher '{job.teacher.alias}' into adapter '{args.adapter}': {len(job.candidates)} "
            f"candidates x {job.config['epochs']} epoch(s), top-K {job.config['top_k']}, seed {job.config['seed']}"
        )
        bar = tqdm(total=total, unit="candidate", dynamic_ncols=True, file=sys.stderr)

    result, cancel = _run_with_bar(args, run_opd, job, bar, "kl")
    receipt = result.receipt
    if args.json:
        _print_summary(
            result, job, optimizer_steps=len(result.losses), checkpoints=[str(c) for c in result.checkpoints]
        )
    elif result.status == "success":
        opd = receipt["opd"]
        print(
            f"✓ {len(result.losses)} optimizer steps over {total} candidates in "
            f"{receipt['runtime']['wall_clock_ms'] / 1000:.1f} s, reverse KL "
            f"{opd['initial_opd_loss']:.4f} -> {opd['final_opd_loss']:.4f}"
        )
        print(f"Adapter:  {result.adapter_dir}")
        print(f"Receipt:  {result.receipt_path}")
        print(f"Manifest: {result.manifest_path}")
        print(f"Effective seed: {job.config['seed']}")
    else:
        _print_failure("training", "opd", args, path, result)
    return _exit_code(result, cancel)
