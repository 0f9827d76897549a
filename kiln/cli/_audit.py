"""``kiln audit PATH``: re-execute a published run between its checkpoints and compare the bytes (``kiln.audit``).

Exit status: 0 ``reproduced``, 1 ``not_reproduced`` (the first difference named), 2 ``cannot_audit`` (why, naming
the field) or a mistake in the command line. ``--json`` prints the ``kiln.training-audit.v1`` record; ``--out``
writes it (strictly checked, atomically).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from kiln.documents.jsonio import JsonObject
from kiln.errors import KilnError

__all__ = ["add_audit_parser"]

EXIT = {"reproduced": 0, "not_reproduced": 1, "cannot_audit": 2}
POLL_S = 0.5  # how often --url asks the server about the job


def add_audit_parser(sub: Any) -> None:
    p = sub.add_parser(
        "audit",
        help="re-execute a published run and check it reproduces its checkpoints and adapter, byte for byte",
        description="Re-execute the run that published PATH (an adapter directory or one of its checkpoints) from "
        "its recorded configuration and sources, in the same execution envelope, and compare every published "
        "checkpoint on the way and the adapter at the end with what the re-execution computes. Full by default "
        "(about the cost of the run); --segments K replays K randomly drawn segments between consecutive "
        "checkpoints, each from the published checkpoint that starts it (about K/N of the cost). Exit 0 "
        "reproduced, 1 not reproduced (the first difference: file, tensor or field, step), 2 cannot audit (the "
        "envelope, a source or a checkpoint differs or is missing; never reported as a mismatch).",
    )
    p.add_argument("path", metavar="PATH", help="a published adapter directory, or a checkpoint of its run")
    p.add_argument(
        "--segments",
        type=int,
        metavar="K",
        help="spot-check K segments drawn at random instead of re-executing the whole run (default: the whole run)",
    )
    p.add_argument(
        "--seed",
        type=int,
        metavar="N",
        help="the seed that draws the spot-check segments (default: drawn now, recorded in the result)",
    )
    p.add_argument(
        "--from",
        dest="start",
        metavar="CHECKPOINT",
        help="a full audit starting at this published checkpoint of the run instead of step 0",
    )
    p.add_argument(
        "-f",
        "--file",
        metavar="FILE",
        help="the run's data, when it was sent inline or its recorded path no longer holds it (the same bytes: a "
        "changed file is 'cannot audit'); .jsonl or .json as kiln train reads it",
    )
    p.add_argument("--model", metavar="DIR", help="the base model directory (default: the path the run recorded)")
    p.add_argument("--teacher", metavar="ALIAS", help="OPD: the teacher alias (default: the one the run recorded)")
    p.add_argument(
        "--rescore",
        action="store_true",
        help="online GRPO: run the scorer again on the recorded completions and require the recorded rewards (by "
        "default the recorded rewards train and no scorer runs)",
    )
    p.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="intra-op threads to re-execute with: the run's own count (its receipt's execution_provenance.backend."
        "device says it; a server's training workers use training.worker_threads); default: torch's for this machine",
    )
    p.add_argument("--json", action="store_true", help="print the kiln.training-audit.v1 record")
    p.add_argument("--out", metavar="FILE", help="also write the record to FILE (atomically)")
    p.add_argument(
        "--url",
        metavar="URL",
        help="audit on this Kiln server instead (PATH is then an adapter name in its registry): queued as an audit "
        "job, run in a worker process of its own, followed here until it ends (Ctrl-C stops watching)",
    )
    p.add_argument("--api-key", metavar="KEY", help="bearer key of the server (default: $KILN_API_KEY)")
    p.set_defaults(func=cmd_audit)


def cmd_audit(args: argparse.Namespace) -> int:
    if args.threads is not None and args.threads < 1:
        print(f"error: --threads {args.threads}: must be at least 1", file=sys.stderr)
        return 2
    if args.segments is not None and args.segments < 1:
        print(f"error: --segments {args.segments}: must be at least 1", file=sys.stderr)
        return 2
    if args.start is not None and args.segments is not None:
        print("error: --from starts a full audit; spot checks (--segments) draw their own starts", file=sys.stderr)
        return 2
    if args.url is not None:
        return _on_server(args)
    path = Path(args.path)
    if not path.exists():
        print(f"error: {path} does not exist", file=sys.stderr)
        return 2
    if args.file is not None and not Path(args.file).is_file():
        print(f"error: --file {args.file}: not a file", file=sys.stderr)
        return 2
    from kiln.audit import AuditSources, audit

    sources = AuditSources(
        data_file=None if args.file is None else Path(args.file),
        model=args.model,
        teacher=args.teacher,
        rescore=args.rescore,
    )
    previous = signal.signal(signal.SIGTERM, _stop)  # a terminated audit still removes its temporary registry
    try:
        record = audit(
            path, segments=args.segments, seed=args.seed, start=args.start, sources=sources, threads=args.threads
        )
    except KilnError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("✗ audit stopped before a verdict; nothing of it remains", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return _report(args, record)


def _stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _report(args: argparse.Namespace, record: JsonObject) -> int:
    if args.out is not None:
        from kiln.artifacts.training_audit import write_training_audit

        write_training_audit(args.out, record)
    if args.json:
        print(json.dumps(record, indent=2, ensure_ascii=False))
    else:
        _print(record)
    return EXIT[record["verdict"]]


def _on_server(args: argparse.Namespace) -> int:
    """``kiln audit NAME --url URL``: submit an audit job, follow it, report its record as a local audit would."""
    from kiln.cli._client import Interrupt, body, run

    local = (args.start, args.file, args.model, args.teacher, args.threads)
    if any(value is not None for value in local):
        print("error: --from, --file, --model, --teacher and --threads audit locally; a server audits with its own",
              file=sys.stderr)  # fmt: skip
        return 2

    def follow(client: Any) -> int:
        request: JsonObject = {"adapter": args.path}
        if args.segments is not None:
            request["segments"] = args.segments
        if args.seed is not None:
            request["seed"] = args.seed
        job = body(client.submit_audit(request))
        print(f"audit job {job['job_id']} queued for adapter {args.path!r}", file=sys.stderr)
        with Interrupt() as interrupt:
            while job["state"] not in ("completed", "failed") and not interrupt.event.is_set():
                interrupt.event.wait(POLL_S)
                job = body(client.get_audit(job["job_id"]))
        if job["state"] == "completed":
            return _report(args, job["record"])
        if job["state"] == "failed":
            print(f"error: audit job {job['job_id']} failed: {job.get('error')}", file=sys.stderr)
            return 2
        print(f"stopped watching; audit job {job['job_id']} keeps running on the server", file=sys.stderr)
        return 130

    return int(run(args, follow))


def _print(record: JsonObject) -> None:
    target = record["target"]
    what = f"{target['kind'] or 'target'} {target['path']}"
    ran = "a full re-execution" if record["mode"] == "full" else f"a spot check (seed {record['seed']})"
    for segment in record["segments"]:
        end = segment["to_step"] if segment["to_step"] is not None else "end"
        print(f"  steps {segment['from_step']:>6} to {end!s:<6} {segment['outcome']}")
    took = f"{record['seconds']:.1f} s"
    if record["original_training_seconds"]:
        took += f"; the run took {record['original_training_seconds']:.1f} s"
    if record["verdict"] == "reproduced":
        print(f"✓ reproduced: {what} ({record['training_kind']}), by {ran} ({took})")
    elif record["verdict"] == "not_reproduced":
        difference = record["first_difference"]
        at = f"at step {difference['step']}" if difference["step"] is not None else "at the end of the run"
        print(f"✗ not reproduced: {what}: {at}, {difference['description']} ({took})")
    else:
        why = record["cannot_audit"]
        print(f"? cannot audit: {what}: {why['field']}: {why['message']}", file=sys.stderr)
