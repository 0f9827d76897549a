"""``kiln rollout-generate``: sample each task ``--seeds`` times with a behaviour policy, score every completion, and
publish GRPO groups whose completions carry ``kiln.rollout-provenance.v1`` (``kiln.rollouts``), plus a summary.

Runs locally on the configured (or ``--model``) base model, with a registry adapter or ``--adapter base``. Both
files appear whole or not at all (written beside their targets, then renamed); an existing file is not replaced
without ``--overwrite``. A scorer failure stops the command before anything is written, naming the task and the
scorer with its stderr tail.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from kiln.cli._requests import print_refusal
from kiln.errors import KilnError

__all__ = ["add_rollout_parser", "cmd_rollout_generate"]


def add_rollout_parser(sub: Any) -> None:
    p = sub.add_parser(
        "rollout-generate",
        help="sample, score and publish GRPO groups with recorded behaviour log-probabilities",
        description="Sample every task --seeds times (seeds --seed-start ... --seed-start + N - 1) with the request "
        "template's sampling settings, score each completion with --scorer, and write the GRPO groups (one per "
        "task, JSON lines) whose completions carry kiln.rollout-provenance.v1: the behaviour log-probability of "
        "every action token. Train them with behavior_policy recorded.",
    )
    p.add_argument("--adapter", default="base", help="registry adapter that samples, or base (default: base)")
    p.add_argument("--tasks", required=True, help="JSONL file: one task per line ({messages} or {prompt}, id, ...)")
    p.add_argument("--seeds", type=int, default=8, help="completions per task (default 8)")
    p.add_argument("--seed-start", type=int, default=0, help="the first completion's seed (default 0)")
    p.add_argument(
        "--request-template",
        help="JSON file: temperature, top_p, top_k, min_p, repetition_penalty, min_tokens, max_tokens and messages "
        "put before every task's (default: temperature 1, 64 tokens)",
    )
    p.add_argument(
        "--scorer",
        required=True,
        help="builtin:exact|regex|json, a Python module:function (TRL's reward-function call), an http(s) URL, "
        "or an executable (JSON lines in and out)",
    )
    p.add_argument("--scorer-timeout", type=float, help="seconds per scorer call (default 60; HTTP: per attempt, 30)")
    p.add_argument("--output", required=True, help="where the scored groups go (JSON lines)")
    p.add_argument("--summary-output", help="where the summary goes (default: rollout_summary.json beside --output)")
    p.add_argument("--overwrite", action="store_true", help="replace --output and --summary-output if they exist")
    p.add_argument("--model", help="base model directory (default: KILN_MODEL_PATH, else the built-in tiny model)")
    p.add_argument("--adapter-dir", help="adapter registry directory (default: $KILN_HOME/adapters)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto", help="(default auto)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto (default cpu)")
    p.add_argument("--batch-tasks", type=int, default=16, help="tasks decoded together (default 16)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_rollout_generate)


def _refuse(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cmd_rollout_generate(args: argparse.Namespace) -> int:
    output = Path(args.output)
    summary_path = Path(args.summary_output) if args.summary_output else output.parent / "rollout_summary.json"
    if args.seeds < 1 or args.seeds > 1024:
        return _refuse("--seeds must be from 1 to 1024 (a GRPO group holds 1 to 1024 completions)")
    if args.seed_start < 0 or args.seed_start + args.seeds > 2**64:
        return _refuse("--seed-start must be from 0 and leave room for --seeds seeds below 2^64")
    if args.batch_tasks < 1:
        return _refuse("--batch-tasks must be at least 1")
    for path in (output, summary_path):
        if path.exists() and not args.overwrite:
            return _refuse(f"{path} exists; pass --overwrite to replace it")
        if not path.parent.is_dir():
            return _refuse(f"{path.parent} is not a directory")
    try:
        return _generate(args, output, summary_path)
    except KilnError as exc:
        return print_refusal(exc)


def _generate(args: argparse.Namespace, output: Path, summary_path: Path) -> int:
    from kiln.documents.digests import file_sha256, json_sha256, prefixed
    from kiln.host.config import resolve_settings
    from kiln.host.fs import atomic_write_bytes
    from kiln.host.progress import counter
    from kiln.model import resolve_model_path
    from kiln.rollouts import (
        BehaviourPolicy,
        Timings,
        read_request_template,
        read_tasks,
        sample_groups,
        scorer_of,
        summary_of,
    )

    template_value = None
    if args.request_template:
        try:
            template_value = json.loads(Path(args.request_template).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return _refuse(f"--request-template {args.request_template}: {exc}")
    template = read_request_template(template_value)
    tasks = read_tasks(args.tasks, template)
    scorer = scorer_of(args.scorer, timeout=args.scorer_timeout, search=Path.cwd())
    settings = resolve_settings({"model.path": args.model, "model.adapter_dir": args.adapter_dir})
    adapter = None if args.adapter == "base" else args.adapter
    policy = BehaviourPolicy.load(
        resolve_model_path(args.model, settings=settings), adapter=adapter, registry=Path(settings.registry),
        precision=args.precision, device=args.device,
    )  # fmt: skip
    seeds = list(range(args.seed_start, args.seed_start + args.seeds))
    timings = Timings()
    started = time.perf_counter()
    groups = []
    bar = None if args.json else counter(unit="task", total=len(tasks), desc="rollout-generate")
    for start in range(0, len(tasks), args.batch_tasks):
        part = tasks[start : start + args.batch_tasks]
        groups.extend(sample_groups(policy, part, seeds, template, scorer, timings=timings))
        if bar is not None:
            bar.update(len(part))
    if bar is not None:
        bar.close()
    data = "".join(json.dumps(g.value, ensure_ascii=False, allow_nan=False) + "\n" for g in groups).encode()
    summary = summary_of(
        groups,
        timings=timings,
        extra={
            "seeds": args.seeds,
            "seed_start": args.seed_start,
            "tasks_sha256": prefixed(file_sha256(args.tasks)[0]),
            "request_template": template.as_json() | {"messages": list(template.messages)},
            "request_template_sha256": json_sha256(template_value) if template_value is not None else None,
            "behavior_policy": policy.identity,
            "scorer": scorer.identity,
            "output": str(output),
            "output_sha256": prefixed(hashlib.sha256(data).hexdigest()),
            "wall_ms": round((time.perf_counter() - started) * 1000, 3),
        },
    )
    atomic_write_bytes(output, data)
    atomic_write_bytes(summary_path, (json.dumps(summary, indent=2, allow_nan=False) + "\n").encode())
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    reward = summary["reward"]["mean"]
    print(
        f"✓ rollout-generate completed: {summary['groups']} group(s), {summary['completions']} completion(s), "
        f"mean reward {reward:.4f}, total tokens {summary['completion_tokens']}, wrote {output}"
    )
    print(f"summary: {summary_path}")
    return 0
