"""``kiln replay verify|show ADAPTER_DIR``: an adapter's request lineage (``replay.jsonl``, ``lineage.json``).

``verify`` checks the lineage of the adapter and of every warm-start ancestor, root to leaf, each parent resolved
as a sibling directory of the same registry (``kiln.artifacts.lineage.verify_lineage``): exit 0 with one line per
adapter and the statement that request-lineage integrity verifies -- no training and no output replay was
performed --, exit 1 naming the file, line and request of the first problem. ``show`` only prints: the lineage
and every record, of a published adapter or, for one that has none yet (a failed or cancelled run), of the log
its runs keep beside it. Both are local and read only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

__all__ = ["add_replay_parser"]

NOTE = "no training or output replay was performed"


def add_replay_parser(sub: Any) -> None:
    rp = sub.add_parser(
        "replay",
        help="verify or show an adapter's request lineage (replay.jsonl, lineage.json)",
        description="Every adapter Kiln publishes carries replay.jsonl (its training requests and their outcomes) "
        "and lineage.json (base model, parent adapter, replay_hash). verify checks their integrity from the root "
        "ancestor to ADAPTER_DIR; show prints them. Neither trains nor generates anything.",
    )
    verbs = rp.add_subparsers(dest="replay_verb", metavar="VERB")
    p = verbs.add_parser(
        "verify",
        help="check the request lineage of an adapter and its ancestors (exit 1 naming the first problem)",
        description="Walk from the root ancestor to ADAPTER_DIR (parents are sibling directories in the same "
        "registry; a cycle fails): each replay.jsonl reads strictly, its request records match lineage.json one "
        "by one, the parent link and replay_hash recompute, and the adapter manifest binds both files.",
    )
    p.add_argument("adapter_dir", help="the adapter's directory (in its registry, beside its parents)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    p.set_defaults(func=cmd_verify)
    p = verbs.add_parser("show", help="print an adapter's lineage and request log (nothing is checked)")
    p.add_argument("adapter_dir", help="the adapter's directory")
    p.add_argument("--json", action="store_true", help="print the lineage and records as one JSON object")
    p.set_defaults(func=cmd_show)
    rp.set_defaults(func=lambda _args: rp.print_help() or 2)


def _fail(args: argparse.Namespace, exc: KilnError) -> int:
    if args.json:
        print(json.dumps({"status": "failed", "code": exc.code, "error": exc.message}, ensure_ascii=False))
    else:
        print(f"✗ request lineage does not verify [{exc.code}]: {exc.message}", file=sys.stderr)
    return 1


def cmd_verify(args: argparse.Namespace) -> int:
    from kiln.artifacts.lineage import verify_lineage

    try:
        chain = verify_lineage(Path(args.adapter_dir))
    except KilnError as exc:
        return _fail(args, exc)
    if args.json:
        adapters = [
            {"name": a.name, "path": str(a.path), "parent": a.parent, "replay_hash": a.replay_hash,
             "requests": a.requests, "outcomes": a.outcomes}
            for a in chain
        ]  # fmt: skip
        print(json.dumps({"status": "ok", "adapters": adapters, "note": NOTE}, ensure_ascii=False))
        return 0
    for a in chain:
        parent = f" (parent {a.parent})" if a.parent else " (root)"
        print(f"✓ {a.name}{parent}: {a.requests} request(s), {a.outcomes} outcome(s), replay_hash {a.replay_hash}")
    print(f"request-lineage integrity verifies for {len(chain)} adapter(s), root to leaf; {NOTE}")
    return 0


def _records(directory: Path) -> tuple[Path, list[Any]]:
    from kiln.artifacts.replay_log import REPLAY_LOG, load_replay_log, pending_log

    path = directory / REPLAY_LOG
    if not path.exists():
        pending = pending_log(directory.parent, directory.name)
        path = pending if pending.exists() else path
    return path, load_replay_log(path)


def cmd_show(args: argparse.Namespace) -> int:
    from kiln.artifacts.lineage import LINEAGE_FILE
    from kiln.documents.jsonio import read_json_file

    directory = Path(args.adapter_dir)
    try:
        lineage = read_json_file(directory / LINEAGE_FILE) if (directory / LINEAGE_FILE).exists() else None
        path, lines = _records(directory)
    except KilnError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 1
    if args.json:
        records = [{"line": line.line, **line.record} for line in lines]
        print(json.dumps({"lineage": lineage, "log": str(path), "records": records}, indent=2, ensure_ascii=False))
        return 0
    if lineage is None:
        print(f"{directory.name}: no {LINEAGE_FILE} (no adapter published with a lineage)")
    else:
        parent = lineage.get("parent") or {}
        base = lineage.get("base_model") or {}
        print(f"{directory.name}: replay_hash {lineage.get('replay_hash')} ({lineage.get('hash_algorithm')})")
        print(
            f"  base model  {base.get('path')}  config {base.get('config_hash')}  weights {base.get('weights_sha256')}"
        )
        print(f"  parent      {parent.get('adapter_name', '-')}  {parent.get('replay_hash') or ''}".rstrip())
    print(f"log {path}:")
    for line in lines:
        r = line.record
        if line.is_request:
            resumed = r["resumed_from"]
            print(
                f"  {line.line:>3} request {r['request_id']}  {r['kind']}  seed {r['seed']}  at {r['submitted_at']}"
                f"  commit {r['commit'] or '-'}" + (f"  resumed from {resumed['checkpoint']}" if resumed else "")
            )
        else:
            reason = f" ({r['failure_reason']})" if r["failure_reason"] and r["status"] == "failed" else ""
            print(f"  {line.line:>3} outcome {r['request_id']}  {r['status']}{reason}  step {r['global_step']}"
                  f"  at {r['finished_at']}")  # fmt: skip
    return 0
