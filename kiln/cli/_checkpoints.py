"""``kiln checkpoints list|inspect|verify|clean``: views of exact-resume checkpoints, and cleanup.

No torch here: these commands read manifests and hash files, nothing more. ``inspect``
is the metadata-only read (bounded, flat cost); ``verify`` is the full strict load that a
resume performs, and exits 0 only when every file's size and SHA-256 match. ``clean``
removes the hidden staging directories of publications that can no longer complete
(``kiln.checkpoints.clean_unfinished_publications``) and never touches a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kiln.errors import CheckpointError, KilnError


def add_checkpoints_parser(sub: Any) -> None:
    cp = sub.add_parser(
        "checkpoints",
        help="list, inspect, verify and clean up exact-resume checkpoints",
        description="Exact-resume checkpoints live in the adapter registry as "
        "<adapter>-checkpoint-step-<8 digits>.kiln-checkpoint directories. They are immutable: never edit one.",
    )
    verbs = cp.add_subparsers(dest="checkpoints_verb", metavar="VERB")
    p = verbs.add_parser("list", help="checkpoints in the adapter registry, oldest first")
    p.add_argument("--adapter", help="only this adapter's checkpoints")
    p.add_argument("--adapter-dir", help="adapter registry directory (default: $KILN_HOME/adapters)")
    p.add_argument("--json", action="store_true", help="print a JSON array")
    p.set_defaults(func=cmd_list)
    for verb, text in (
        ("inspect", "metadata-only strict read: manifest, file set and sizes (no tensor hashing)"),
        ("verify", "full strict load, as a resume does: every file's size and SHA-256; exit 0 valid, 1 invalid"),
    ):
        p = verbs.add_parser(verb, help=text, description=text)
        p.add_argument("path", help="checkpoint directory, or its basename in the adapter registry")
        p.add_argument("--adapter-dir", help="registry to look a basename up in (default: $KILN_HOME/adapters)")
        p.add_argument("--json", action="store_true", help="print the result as JSON")
        p.set_defaults(func=cmd_inspect if verb == "inspect" else cmd_verify)
    text = (
        "remove the hidden staging directories that killed publications left behind: those whose checkpoint name "
        "was published since, and those nothing changed in for --older-than seconds (a live publication writes "
        "steadily and renames within seconds). Checkpoints, adapters and younger staging directories stay."
    )
    p = verbs.add_parser(
        "clean", help="remove leftovers of checkpoint publications that can no longer complete", description=text
    )
    p.add_argument("--adapter", help="only this adapter's leftovers")
    p.add_argument("--adapter-dir", help="adapter registry directory (default: $KILN_HOME/adapters)")
    p.add_argument("--dry-run", action="store_true", help="print what would be removed; remove nothing")
    p.add_argument(
        "--older-than",
        type=float,
        default=None,
        metavar="SECONDS",
        help="idle time after which a staging directory counts as abandoned (default: 3600); 0 takes every one, "
        "which is right only while no job publishes into this registry",
    )
    p.add_argument("--json", action="store_true", help="print {removed, kept, errors} as JSON")
    p.set_defaults(func=cmd_clean)


def _registry(args: argparse.Namespace) -> Path:
    from kiln.host.config import configured_registry

    return configured_registry(args.adapter_dir)


def _target(args: argparse.Namespace) -> Path:
    path = Path(args.path)
    if path.exists() or path.is_symlink() or "/" in args.path:
        return path
    return _registry(args) / args.path


def _print_error(exc: KilnError, path: Path) -> None:
    reason = getattr(exc, "reason", exc.code)
    label = exc.code if reason == exc.code else f"{exc.code}: {reason}"
    print(f"✗ {path}: {label}", file=sys.stderr)
    print(f"  {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"  hint: {exc.hint}", file=sys.stderr)


def _error_json(exc: KilnError) -> dict[str, Any]:
    return {
        "code": exc.code,
        "reason": getattr(exc, "reason", exc.code),
        "message": exc.message,
        "hint": exc.hint,
        "problems": [p.as_dict() for p in getattr(exc, "problems", [])],
    }


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n:,} B"


def cmd_list(args: argparse.Namespace) -> int:
    from kiln.checkpoints import list_checkpoints, orphaned_staging_dirs

    try:
        registry = _registry(args)
    except KilnError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 2
    found = list_checkpoints(registry, args.adapter)
    if args.json:
        out = []
        for c in found:
            entry: dict[str, Any] = {"path": str(c.path), "adapter": c.adapter, "global_step": c.global_step}
            entry["valid"] = c.info is not None
            entry["summary"] = c.info.summary if c.info else None
            entry["error"] = _error_json(c.error) if c.error else None
            out.append(entry)
        print(json.dumps(out, indent=2))
        return 0
    if not found:
        print(f"no checkpoints in {registry}" + (f" for adapter {args.adapter!r}" if args.adapter else ""))
    else:
        print(f"{'CHECKPOINT':60} {'STEP':>15} {'NEXT EPOCH/CURSOR':>18}  {'CREATED':24} STATUS")
        for c in found:
            if c.info is None:
                reason = getattr(c.error, "reason", "invalid")
                print(f"{c.path.name:60} {'?':>15} {'?':>18}  {'?':24} INVALID ({reason})")
                continue
            s = c.info.summary
            step = f"{s['global_step']}/{s['total_steps']}"
            nxt = f"{s['next_epoch_index']}/{s['next_cursor_in_epoch']}"
            print(f"{c.path.name:60} {step:>15} {nxt:>18}  {s['created_at']:24} ok (metadata)")
        print("\nStatus is a metadata-only read; `kiln checkpoints verify PATH` hashes every file.")
    orphans = orphaned_staging_dirs(registry, args.adapter)
    if orphans:
        print(
            f"\n{len(orphans)} unfinished publication(s) (hidden, never loaded; "
            "`kiln checkpoints clean` removes those that can no longer complete):"
        )
        for orphan in orphans:
            print(f"  {orphan}")
    return 0


def _idle(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.0f} s"


def _unfinished_json(u: Any) -> dict[str, Any]:
    return {
        "path": str(u.path),
        "checkpoint": u.checkpoint,
        "adapter": u.adapter,
        "global_step": u.global_step,
        "idle_seconds": round(u.idle_seconds, 3),
        "superseded": u.superseded,
        "sentinel": u.sentinel,
    }


def cmd_clean(args: argparse.Namespace) -> int:
    from kiln.checkpoints import ABANDONED_AFTER_SECONDS, clean_unfinished_publications

    older_than = ABANDONED_AFTER_SECONDS if args.older_than is None else args.older_than
    if older_than < 0:
        print("error: --older-than is a number of seconds, 0 or more", file=sys.stderr)
        return 2
    try:
        registry = _registry(args)
    except KilnError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 2
    result = clean_unfinished_publications(registry, args.adapter, older_than=older_than, dry_run=args.dry_run)
    if args.json:
        body = {
            "dry_run": args.dry_run,
            "older_than_seconds": older_than,
            "removed": [_unfinished_json(u) for u in result.removed],
            "kept": [_unfinished_json(u) for u in result.kept],
            "errors": [{**_unfinished_json(u), "error": why} for u, why in result.errors],
        }
        print(json.dumps(body, indent=2, ensure_ascii=False))
        return 1 if result.errors else 0
    verb = "would remove" if args.dry_run else "removed"
    for u in result.removed:
        why = "its name was published since" if u.superseded else f"idle {_idle(u.idle_seconds)}"
        print(f"{verb} {u.path} (unfinished publication of {u.checkpoint}; {why})")
    for u in result.kept:
        print(
            f"kept {u.path} (changed {_idle(u.idle_seconds)} ago: a publication may still be writing it; "
            "--older-than 0 takes it once no job is publishing)"
        )
    for u, why in result.errors:
        print(f"✗ could not remove {u.path}: {why}", file=sys.stderr)
    if not (result.removed or result.kept or result.errors):
        print(f"no unfinished publications in {registry}" + (f" for adapter {args.adapter!r}" if args.adapter else ""))
    return 1 if result.errors else 0


def _read(reader: Any, path: Path, as_json: bool) -> Any:
    """``reader(path)``, or None after reporting the refusal (JSON or human lines)."""
    try:
        return reader(path)
    except CheckpointError as exc:
        if as_json:
            print(json.dumps({"valid": False, "path": str(path), "error": _error_json(exc)}, indent=2))
        else:
            _print_error(exc, path)
        return None


def cmd_inspect(args: argparse.Namespace) -> int:
    from kiln.checkpoints import inspect_checkpoint

    path = _target(args)
    info = _read(inspect_checkpoint, path, args.json)
    if info is None:
        return 1
    m, s = info.manifest, info.summary
    if args.json:
        print(json.dumps({"valid": True, "path": str(path), "summary": s, "files": m["files"]}, indent=2))
        return 0
    cfg = m["effective_config"]
    print(f"{info.name}  ({m['checkpoint_id']}, {m['training_kind']})")
    print(f"  adapter          {m['adapter_name']}")
    print(f"  created          {m['created_at']}")
    print(f"  progress         step {s['global_step']} of {s['total_steps']}; next: epoch {s['next_epoch_index']}, "
          f"item {s['next_cursor_in_epoch']} of {s['data_item_count']}")  # fmt: skip
    print(f"  data             {s['data_source_kind']}, {s['data_item_count']} items, {s['data_content_sha256']}")
    print(f"  optimizer        {m['optimizer']['kind']}, learning rate {cfg.get('learning_rate')}")
    print(f"  seed             {m['rng_states']['lora-init']['seed']}")
    print(
        f"  loss route       {m['auxiliary_state'].get('training_runtime_planning_identity', {}).get('sft_loss_route', '-')}"
    )
    print("  files")
    for rel, entry in sorted(m["files"].items()):
        print(f"    {rel:28} {entry['role']:20} {_mb(entry['size_bytes']):>12}  sha256 {entry['sha256'][:16]}…")
    print("Metadata only: sizes checked, digests not. `kiln checkpoints verify` hashes every file.")
    print(f"Resume with: --resume-checkpoint {info.name}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from kiln.checkpoints import load_checkpoint

    path = _target(args)
    loaded = _read(load_checkpoint, path, args.json)
    if loaded is None:
        return 1
    total = sum(len(b) for b in loaded.blobs.values())
    if args.json:
        print(json.dumps({"valid": True, "path": str(path), "summary": loaded.info.summary}, indent=2))
    else:
        s = loaded.info.summary
        print(
            f"✓ {loaded.info.name}: verified {len(loaded.blobs)} files ({_mb(total)}), manifest and loop state; "
            f"step {s['global_step']} of {s['total_steps']}"
        )
    return 0
