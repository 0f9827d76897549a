"""The training request a file and the flags describe: what ``kiln train ... --local`` and the HTTP commands share.

The same flags build the same config either way (``training_config``); ``build_request`` adds the file's data and
``--adapter`` as ``config.output_name``. ``prepare`` runs such a step on an existing file and turns a refusal into
the CLI's error lines and exit status 2; ``sft_resume_command`` spells out the command that continues an SFT run
from a checkpoint (``--local`` or on the server). No torch, no SDK: the JSON reader is imported on use.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

__all__ = [
    "build_request",
    "flag_argv",
    "prepare",
    "print_refusal",
    "read_examples",
    "sft_resume_command",
    "training_config",
    "training_flags",
]


def print_refusal(exc: KilnError) -> int:
    """A request refused before it ran or was sent: ``error [<code>: <reason>]``, the problems, the hint; exit 2."""
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


def prepare(path: Path, step: Callable[[], Any]) -> Any:
    """``step()`` when ``path`` is a file; else, or when it refuses (``KilnError``, ``ValueError``), exit status 2."""
    if not path.is_file():
        print(f"error: {path} is not a file", file=sys.stderr)
        return 2
    try:
        return step()
    except KilnError as exc:
        return print_refusal(exc)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def read_examples(path: Path) -> tuple[list[Any] | None, str | None]:
    """SFT data: ``(None, absolute path)`` for a .jsonl file, else ``(examples, None)`` from a JSON array."""
    if path.suffix == ".jsonl":
        return None, str(path.resolve())
    from kiln._jsonio import read_json_file

    value = read_json_file(path)
    if isinstance(value, dict) and "examples" in value:
        value = value["examples"]
    if not isinstance(value, list):
        raise ValueError(f"{path} must hold a JSON array of examples (or use a .jsonl file)")
    return value, None


def _read_request(path: Path, list_key: str) -> dict[str, Any]:
    """A .json file holding a request object, or a bare array sent under ``list_key``."""
    from kiln._jsonio import read_json_file

    value = read_json_file(path)
    if isinstance(value, list):
        return {list_key: value}
    if not isinstance(value, dict):
        raise ValueError(f"{path} must hold a JSON request object or an array of {list_key} (or use a .jsonl file)")
    return dict(value)


def training_config(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """The training config the flags describe: every SFT flag (with its default), only the given ones otherwise."""
    config: dict[str, Any] = {}
    if kind == "sft":
        config.update(
            epochs=args.epochs,
            lora_rank=args.lora_rank,
            lora_alpha=args.lora_alpha,
            invalid_row_policy=args.invalid_row_policy,
            optimizer={"kind": args.optimizer},
        )
        for key, value in (
            ("max_seq_len", args.max_seq_len),
            ("overlong_row_policy", args.overlong_row_policy),
            ("group_by_length", True if args.group_by_length else None),
        ):
            if value is not None:
                config[key] = value
    else:
        for key, value in (
            ("epochs", getattr(args, "epochs", None)),
            ("lora_rank", args.lora_rank),
            ("lora_alpha", args.lora_alpha),
        ):
            if value is not None:
                config[key] = value
        if args.optimizer is not None:
            config["optimizer"] = {"kind": args.optimizer}
    schedule = {
        key: value
        for key, value in (
            ("kind", args.lr_scheduler),
            ("warmup_steps", args.warmup_steps),
            ("warmup_ratio", args.warmup_ratio),
            ("min_lr_ratio", args.min_lr_ratio),
        )
        if value is not None
    }
    if schedule:
        config["lr_scheduler"] = {"kind": "constant", **schedule}
    for key, value in (
        ("lora_target_modules", args.lora_target_modules),
        ("micro_batch_size", getattr(args, "micro_batch_size", None)),
        ("gradient_accumulation_steps", getattr(args, "gradient_accumulation_steps", None)),
        ("seed", args.seed),
        ("learning_rate", args.lr),
        ("checkpoint_interval", args.checkpoint_interval),
        ("resume_checkpoint", args.resume_checkpoint),
    ):
        if value is not None:
            config[key] = value
    return config


def build_request(args: argparse.Namespace, kind: str, path: Path) -> dict[str, Any]:
    """The request body: the file's data, the flags' config, ``--adapter`` as ``config.output_name``."""
    if kind == "sft":
        examples, dataset_path = read_examples(path)
        request: dict[str, Any] = {"dataset_path": dataset_path} if dataset_path else {"examples": examples}
    elif path.suffix == ".jsonl":
        request = {"dataset_path": str(path.resolve())}
    else:
        request = _read_request(path, "groups" if kind == "grpo" else "prompts")
    config = request.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config must be a JSON object")
    config = {**config, **training_config(args, kind), "output_name": args.adapter}
    if args.no_auto_load:
        config["auto_load"] = False
    request["config"] = config
    if kind == "grpo" and args.dry_run:
        request["dry_run"] = True
    if kind == "opd":
        request["teacher"] = args.teacher
        if "dataset_path" in request:  # a .jsonl file is a pre-scored teacher file
            config.setdefault("training_mode", "off_policy")
    return request


def training_flags(args: argparse.Namespace, kind: str) -> list[tuple[str, Any]]:
    """The training options of this command line as ``(flag, value)`` pairs (None: not given), for the command
    that resumes it: every option the checkpoint's effective configuration binds must be given again."""
    targets = args.lora_target_modules
    flags = [
        ("--epochs", getattr(args, "epochs", None)),
        ("--lr", args.lr),
        ("--optimizer", args.optimizer),
        ("--lora-rank", args.lora_rank),
        ("--lora-alpha", args.lora_alpha),
        ("--lora-target-modules", None if targets is None else ",".join(targets)),
        ("--lr-scheduler", args.lr_scheduler),
        ("--warmup-steps", args.warmup_steps),
        ("--warmup-ratio", args.warmup_ratio),
        ("--min-lr-ratio", args.min_lr_ratio),
        ("--micro-batch-size", getattr(args, "micro_batch_size", None)),
        ("--gradient-accumulation-steps", getattr(args, "gradient_accumulation_steps", None)),
    ]
    if kind == "sft":
        flags += [
            ("--invalid-row-policy", args.invalid_row_policy),
            ("--max-seq-len", args.max_seq_len),
            ("--overlong-row-policy", args.overlong_row_policy),
            ("--group-by-length", True if args.group_by_length else None),
        ]
    return flags


def flag_argv(flags: Iterable[tuple[str, Any]]) -> list[str]:
    """Command-line words for ``(flag, value)`` pairs: None leaves the flag out, True gives the bare flag."""
    argv: list[str] = []
    for flag, value in flags:
        if value is True:
            argv.append(flag)
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _rank_flags(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """The data-parallel flags of a local SFT run, those that differ from one process on one node."""
    nproc, nnodes = getattr(args, "nproc_per_node", 1) or 1, getattr(args, "nnodes", 1) or 1
    return (
        ("--nproc-per-node", nproc if nproc > 1 else None),
        ("--nnodes", nnodes if nnodes > 1 else None),
        ("--rdzv-endpoint", getattr(args, "rdzv_endpoint", None)),
        ("--rdzv-id", getattr(args, "rdzv_id", None)),
    )


def sft_resume_command(args: argparse.Namespace, checkpoint: str, interval: int | None, *, local: bool = True) -> str:
    """The command that continues this run from ``checkpoint`` (same options, no seed: the checkpoint has it)."""
    argv = ["kiln", "train", "sft", *(["--local"] if local else [])]
    argv += ["-f", str(Path(args.file).resolve()), "--adapter", args.adapter]
    where = (("--adapter-dir", args.adapter_dir), ("--model", args.model)) if local else (("--url", args.url),)
    argv += flag_argv((*where, *training_flags(args, "sft"), ("--checkpoint-interval", interval)))
    if local:  # a checkpoint resumes only at the world size it was written at
        argv += flag_argv(_rank_flags(args))
    if not local and args.no_auto_load:
        argv.append("--no-auto-load")
    return shlex.join([*argv, "--resume-checkpoint", checkpoint])
