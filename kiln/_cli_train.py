"""``kiln train sft --local`` and ``kiln models create-tiny``: in-process commands (they import torch)."""

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

from kiln.errors import KilnError, RequestError


def add_train_parser(sub: Any) -> None:
    train = sub.add_parser("train", help="train an adapter (SFT now; GRPO and OPD later)")
    kinds = train.add_subparsers(dest="train_kind", metavar="KIND")
    p = kinds.add_parser(
        "sft",
        help="supervised fine-tuning on a file of conversations",
        description="Train a LoRA adapter on conversations ({'messages': [...]} per JSONL line, or a JSON array). "
        "With --local the job runs in this process and writes the adapter, train_receipt.json and "
        "adapter_manifest.json into the adapter registry.",
    )
    p.add_argument(
        "-f", "--file", required=True, help="a .jsonl file (sent as dataset_path) or a JSON array of examples"
    )
    p.add_argument("--adapter", required=True, help="output adapter name (path-safe)")
    p.add_argument("--local", action="store_true", help="run in-process instead of submitting to a server")
    p.add_argument("--adapter-dir", help="adapter registry directory (default: $KILN_HOME/adapters)")
    p.add_argument("--model", help="base model directory (default: KILN_MODEL_PATH, else the built-in tiny model)")
    p.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    p.add_argument("--seed", help="effective seed (default: a fresh random 64-bit seed, printed)")
    p.add_argument("--lr", type=float, help="learning rate (default: muon 1e-3, adam_w/sgd 1e-4)")
    p.add_argument("--optimizer", choices=("muon", "adam_w", "sgd"), default="muon")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-alpha", type=float, default=32.0)
    p.add_argument("--invalid-row-policy", choices=("fail", "skip"), default="fail")
    p.add_argument(
        "--checkpoint-interval",
        type=int,
        metavar="N",
        help="publish an exact-resume checkpoint every N optimizer steps (default: training.checkpoint_interval "
        "of kiln.toml or KILN_TRAINING_CHECKPOINT_INTERVAL, else none; Ctrl-C always publishes one at the next step)",
    )
    p.add_argument(
        "--resume-checkpoint",
        metavar="BASENAME",
        help="continue an interrupted run from this checkpoint (basename in the adapter registry, or an "
        "absolute path directly inside it); every other option must match the original run",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON (no progress bar)")
    p.set_defaults(func=cmd_train_sft)


def add_models_parser(sub: Any) -> None:
    models = sub.add_parser("models", help="built-in models")
    verbs = models.add_subparsers(dest="models_verb", metavar="VERB")
    p = verbs.add_parser("create-tiny", help="write a tiny model (same tokenizer as the default, weights from --seed)")
    p.add_argument("path", help="directory to create (must not exist)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (0 is the built-in default)")
    p.set_defaults(func=cmd_create_tiny)


def _error(exc: KilnError) -> int:
    reason = getattr(exc, "reason", exc.code)
    label = exc.code if reason == exc.code else f"{exc.code}: {reason}"
    print(f"error [{label}]: {exc.message}", file=sys.stderr)
    problems = getattr(exc, "problems", [])
    if exc.code == "checkpoint_incompatible" and len(problems) > 1:
        for problem in problems:
            print(f"  - {problem.message}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)
    return 2


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


def _resume_command(args: argparse.Namespace, checkpoint: str, interval: int | None) -> str:
    """The command that continues this run from ``checkpoint`` (same options, no seed: the checkpoint has it)."""
    argv = ["kiln", "train", "sft", "--local", "-f", str(Path(args.file).resolve()), "--adapter", args.adapter]
    for flag, value in (
        ("--adapter-dir", args.adapter_dir),
        ("--model", args.model),
        ("--epochs", args.epochs),
        ("--lr", args.lr),
        ("--optimizer", args.optimizer),
        ("--lora-rank", args.lora_rank),
        ("--lora-alpha", args.lora_alpha),
        ("--invalid-row-policy", args.invalid_row_policy),
        ("--checkpoint-interval", interval),
    ):
        if value is not None:
            argv += [flag, str(value)]
    return shlex.join([*argv, "--resume-checkpoint", checkpoint])


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


def _read_examples(path: Path) -> tuple[list[Any] | None, str | None]:
    if path.suffix == ".jsonl":
        return None, str(path.resolve())
    from kiln._jsonio import read_json_file

    value = read_json_file(path)
    if isinstance(value, dict) and "examples" in value:
        value = value["examples"]
    if not isinstance(value, list):
        raise ValueError(f"{path} must hold a JSON array of examples (or use a .jsonl file)")
    return value, None


def cmd_train_sft(args: argparse.Namespace) -> int:
    if not args.local:
        print("error: submitting to a server is not available yet; run with --local", file=sys.stderr)
        return 2
    from kiln.config import config_value, configured_registry, load_config
    from kiln.trainers.sft import admit_sft, run_sft

    path = Path(args.file)
    if not path.is_file():
        print(f"error: {path} is not a file", file=sys.stderr)
        return 2
    config: dict[str, Any] = {
        "epochs": args.epochs,
        "lora_rank": args.lora_rank,
        "lora_alpha": args.lora_alpha,
        "invalid_row_policy": args.invalid_row_policy,
        "optimizer": {"kind": args.optimizer},
    }
    if args.seed is not None:
        config["seed"] = args.seed
    if args.lr is not None:
        config["learning_rate"] = args.lr
    if args.checkpoint_interval is not None:
        config["checkpoint_interval"] = args.checkpoint_interval
    if args.resume_checkpoint is not None:
        config["resume_checkpoint"] = args.resume_checkpoint
    try:
        settings = load_config()
        if "checkpoint_interval" not in config:
            default_interval = _default_interval(config_value(settings, "training", "checkpoint_interval"))
            if default_interval is not None:
                config["checkpoint_interval"] = default_interval
        examples, dataset_path = _read_examples(path)
        job = admit_sft(
            adapter_name=args.adapter,
            registry=configured_registry(args.adapter_dir, settings),
            config=config,
            examples=examples,
            dataset_path=dataset_path,
            model_path=args.model or config_value(settings, "model", "path"),
        )
    except KilnError as exc:
        return _error(exc)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
    resume = _resume_command(args, latest.name, cfg["checkpoint_interval"]) if latest is not None else None
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
        print(f"✗ training failed ({receipt['failure_reason']}): {receipt.get('failure_message')}", file=sys.stderr)
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
