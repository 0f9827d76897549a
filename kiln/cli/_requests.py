"""The training request a file and the flags describe: what ``kiln train ... --local`` and the HTTP commands share.

The same flags build the same config either way (``training_config``); ``build_request`` adds the file's data and
``--adapter`` as ``config.output_name``. What differs between kinds is data the kind's parser sets (``inline_key``,
``whole_request``, ``file_config``) and the options it defines, never a branch on the kind. ``prepare`` runs such a step on an existing file and turns a refusal into
the CLI's error lines and exit status 2; ``resume_command`` spells out the command that continues a run from a
checkpoint (``--local`` or on the server). No torch, no SDK: the JSON reader is imported on use.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kiln.errors import ContractError, KilnError

__all__ = [
    "build_request",
    "flag_argv",
    "prepare",
    "print_refusal",
    "resume_command",
    "training_config",
    "training_flags",
]


# the training config members a `kiln train` flag sets: what a refusal names, said as the flag the person typed
FLAG_OF = {
    "output_name": "--adapter",
    "learning_rate": "--lr",
    "invalid_row_policy": "--invalid-row-policy",
    "max_seq_len": "--max-seq-len",
    "overlong_row_policy": "--overlong-row-policy",
    "lora_rank": "--lora-rank",
    "lora_alpha": "--lora-alpha",
    "lora_target_modules": "--lora-target-modules",
    "checkpoint_interval": "--checkpoint-interval",
    "resume_checkpoint": "--resume-checkpoint",
    "micro_batch_size": "--micro-batch-size",
    "gradient_accumulation_steps": "--gradient-accumulation-steps",
    "group_by_length": "--group-by-length",
    "epochs": "--epochs",
    "seed": "--seed",
    "precision": "--precision",
    "device": "--device",
    "gradient_checkpointing": "--gradient-checkpointing",
    "quantization": "--quantization",
    "max_tokens": "--max-tokens",
    "prefix_sharing": "--prefix-sharing",
}
_SET_TO = re.compile(r'set (\w+) to "([^"]*)"')
_POINTER = re.compile(r"/config/(\w+)")
_LEADING = re.compile(r"^(\w+):")


def in_cli_terms(text: str) -> str:
    """A refusal's text as the command line says it: ``/config/output_name`` is ``--adapter``, ``set
    invalid_row_policy to "skip"`` is ``pass --invalid-row-policy skip``, a message that starts with a member's name
    starts with its flag. Members without a flag stay as they are (the request's own words)."""
    text = _SET_TO.sub(lambda m: f"pass {FLAG_OF[m[1]]} {m[2]}" if m[1] in FLAG_OF else m[0], text)
    text = _POINTER.sub(lambda m: FLAG_OF.get(m[1], m[0]), text)
    return _LEADING.sub(lambda m: f"{FLAG_OF[m[1]]}:" if m[1] in FLAG_OF else m[0], text)


def print_refusal(exc: KilnError) -> int:
    """A request refused before it ran or was sent: ``error [<code>: <reason>]``, the problems, the hint -- in the
    command line's terms (``in_cli_terms``); exit 2."""
    reason = getattr(exc, "reason", exc.code)
    label = exc.code if reason == exc.code else f"{exc.code}: {reason}"
    problems = getattr(exc, "problems", [])
    if isinstance(exc, ContractError) and str(exc.document).endswith("Request"):
        # the request the flags and the file made: each problem at its flag, in its own words
        print(f"error [{label}]: the {exc.document} this command line makes is invalid", file=sys.stderr)
        for problem in problems:
            where = problem.pointer or "/"
            print(f"  {in_cli_terms(f'{where}: {problem.message}')}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {in_cli_terms(exc.hint)}", file=sys.stderr)
        return 2
    print(f"error [{label}]: {in_cli_terms(exc.message)}", file=sys.stderr)
    if exc.code == "checkpoint_incompatible" and len(problems) > 1:
        for problem in problems:
            print(f"  - {problem.message}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {in_cli_terms(exc.hint)}", file=sys.stderr)
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


def _holds_json_lines(path: Path) -> bool:
    """Whether a file is JSON lines: at least two non-blank lines, the first two each a JSON object."""
    try:
        with path.open("rb") as handle:
            lines = [line for line in (handle.readline() for _ in range(64)) if line.strip()][:2]
    except OSError:
        return False
    try:
        return len(lines) == 2 and all(isinstance(json.loads(line), dict) for line in lines)
    except ValueError:
        return False


def _read_file(path: Path, inline_key: str, whole_request: bool) -> dict[str, Any]:
    """The request a data file describes: a ``.jsonl`` file is sent as its absolute ``dataset_path``; a ``.json`` file
    holds a bare array sent under ``inline_key``, or a request object -- taken whole when ``whole_request`` (GRPO,
    OPD), else only its ``inline_key`` member (SFT: the file's conversations)."""
    if path.suffix == ".jsonl":
        return {"dataset_path": str(path.resolve())}
    from kiln.documents.jsonio import read_json_file

    try:
        value = read_json_file(path)
    except KilnError:
        if _holds_json_lines(path):
            raise ValueError(
                f"{path} holds one JSON value per line (JSON lines), but a .json file is read as one JSON document "
                f"(an array of {inline_key}); rename it to .jsonl to read it line by line"
            ) from None
        raise
    if isinstance(value, list):
        return {inline_key: value}
    if isinstance(value, dict) and whole_request:
        return dict(value)
    if isinstance(value, dict) and isinstance(value.get(inline_key), list):
        return {inline_key: value[inline_key]}
    what = "a JSON request object or an array" if whole_request else "a JSON array"
    raise ValueError(f"{path} must hold {what} of {inline_key} (or use a .jsonl file)")


def training_config(args: argparse.Namespace) -> dict[str, Any]:
    """The training config the flags of this command line describe: every option that has a value (an option of
    the kind's parser with a default -- SFT's epochs, rank, alpha, row policy, optimizer -- always has one)."""
    config: dict[str, Any] = {}
    for key, value in (
        ("epochs", getattr(args, "epochs", None)),
        ("lora_rank", args.lora_rank),
        ("lora_alpha", args.lora_alpha),
        ("invalid_row_policy", getattr(args, "invalid_row_policy", None)),
        ("optimizer", None if args.optimizer is None else {"kind": args.optimizer}),
        ("max_seq_len", getattr(args, "max_seq_len", None)),
        ("overlong_row_policy", getattr(args, "overlong_row_policy", None)),
        ("group_by_length", True if getattr(args, "group_by_length", False) else None),
    ):
        if value is not None:
            config[key] = value
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
        ("prefix_sharing", getattr(args, "prefix_sharing", None)),
        ("precision", getattr(args, "precision", None)),
        ("device", getattr(args, "device", None)),
        ("gradient_checkpointing", getattr(args, "gradient_checkpointing", None)),
        ("quantization", getattr(args, "quantization", None)),
        ("seed", args.seed),
        ("learning_rate", args.lr),
        ("checkpoint_interval", args.checkpoint_interval),
        ("resume_checkpoint", args.resume_checkpoint),
    ):
        if value is not None:
            config[key] = value
    return config


def build_request(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    """The request body: the file's data (as the kind's parser says to read it), the flags' config, ``--adapter`` as
    ``config.output_name``, ``--teacher`` and ``--dry-run`` where the kind has them."""
    tasks = getattr(args, "tasks", None)
    request = (
        _online_request(args, Path(tasks))
        if tasks is not None
        else _read_file(path, args.inline_key, args.whole_request)
    )
    config = request.get("config") or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: config must be a JSON object")
    config = {**config, **training_config(args), "output_name": args.adapter}
    if args.no_auto_load:
        config["auto_load"] = False
    if "dataset_path" in request:
        config = {**args.file_config, **config}  # what a .jsonl file means for the kind (OPD: a pre-scored file)
    request["config"] = config
    if getattr(args, "dry_run", False):
        request["dry_run"] = True
    if getattr(args, "teacher", None) is not None:
        request["teacher"] = args.teacher
    return request


def _online_request(args: argparse.Namespace, tasks: Path) -> dict[str, Any]:
    """An online GRPO request: the tasks file (its absolute path with --local; its tasks inline for a server, which
    reads no file of the client's), the scorer, the group size, the passes and the request template's sampling."""
    online: dict[str, Any] = {"scorer": args.scorer}
    if args.local:
        online["tasks_path"] = str(tasks.resolve())
    else:
        lines = tasks.read_text(encoding="utf-8").splitlines()
        try:
            online["tasks"] = [json.loads(line) for line in lines if line.strip()]
        except ValueError as exc:
            raise ValueError(f"--tasks {tasks}: a line is not JSON ({exc})") from None
    if args.group_size is not None:
        online["group_size"] = args.group_size
    if args.passes is not None:
        online["passes"] = args.passes
    if args.request_template is not None:
        try:
            online["sampling"] = json.loads(Path(args.request_template).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"--request-template {args.request_template}: {exc}") from None
    return {"online": online}


def training_flags(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The training options of this command line as ``(flag, value)`` pairs (None: not given, or not an option of the
    kind), for the command that resumes it: every option the checkpoint's effective configuration binds must be given
    again."""
    targets = args.lora_target_modules
    return [
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
        ("--prefix-sharing", getattr(args, "prefix_sharing", None)),
        ("--invalid-row-policy", getattr(args, "invalid_row_policy", None)),
        ("--max-seq-len", getattr(args, "max_seq_len", None)),
        ("--overlong-row-policy", getattr(args, "overlong_row_policy", None)),
        ("--group-by-length", True if getattr(args, "group_by_length", False) else None),
        ("--precision", getattr(args, "precision", None)),
        ("--device", getattr(args, "device", None)),
        ("--gradient-checkpointing", getattr(args, "gradient_checkpointing", None)),
        ("--quantization", getattr(args, "quantization", None)),
    ]


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


def resume_command(args: argparse.Namespace, checkpoint: str, interval: int | None, *, local: bool = True) -> str:
    """The command that continues this run from ``checkpoint``: the same kind, file, adapter, teacher and training
    options, the run's checkpoint ``interval`` (the checkpoint binds it), no seed (the checkpoint has it); ``local``:
    with the same registry, model and ranks (a checkpoint resumes only at the world size it was written at), else
    against the same server."""
    argv = ["kiln", "train", args.train_kind, *(["--local"] if local else [])]
    argv += ["-f", str(Path(args.file).resolve()), "--adapter", args.adapter]
    where = (("--adapter-dir", args.adapter_dir), ("--model", args.model)) if local else (("--url", args.url),)
    teacher = (("--teacher", getattr(args, "teacher", None)),)
    argv += flag_argv((*teacher, *where, *training_flags(args), ("--checkpoint-interval", interval)))
    if local:
        argv += flag_argv(_rank_flags(args))
    if not local and args.no_auto_load:
        argv.append("--no-auto-load")
    return shlex.join([*argv, "--resume-checkpoint", checkpoint])
