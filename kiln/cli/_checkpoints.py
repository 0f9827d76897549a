"""``kiln checkpoints list|inspect|verify``: read-only views of exact-resume checkpoints.

No torch here: these commands read manifests and hash files, nothing more. ``inspect``
is the metadata-only read (bounded, flat cost); ``verify`` is the full strict load that a
resume performs, and exits 0 only when every file's size and SHA-256 match.
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
        help="list, inspect and verify exact-resume checkpoints",
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


def _registry(args: argparse.Namespace) -> Path:
    from kiln.config import configured_registry

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
    orphans = orphaned_staging_dirs(registry)
    if orphans:
        print(
            f"\n{len(orphans)} unfinished publication(s) left by an interrupted run (hidden, never loaded, "
            "safe to delete):"
        )
        for orphan in orphans:
            print(f"  {orphan}")
    return 0


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
