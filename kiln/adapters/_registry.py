"""The adapter registry read and pruned locally: ``list_adapters`` and ``delete_adapter``.

``require_adapter_name`` is the registry's name rule (``kiln._fs.name_problem`` for the
``adapter`` kind) as every caller that is handed a name raises it: ``RequestError``
``training_invalid_request`` with the reason. ``read_canary_status`` reads an adapter's
serving-canary file, quarantining one that cannot be trusted.

Listing reports, per child directory of the registry (hidden entries and checkpoint
directories excluded), the facts ``GET /v1/adapters`` reports: files and sizes, the LoRA
config (rank, alpha, targets, base model), the canary result, and the manifest parsed
and validated -- or why it was rejected (a malformed manifest is surfaced, never hidden).
It never rehashes files: the weights digest shown is the manifest's.

Deletion removes the adapter directory and exactly the checkpoints it owns: the siblings
whose names parse strictly as ``<name>-checkpoint-step-<8 digits>.kiln-checkpoint``
(``kiln.checkpoints.parse_checkpoint_name``), and the hidden leftovers made from those names
(``.<checkpoint name>.incomplete-XXXXXXXX`` of an unfinished publication,
``.<checkpoint name>.deleting-XXXXXXXX`` of an interrupted deletion). A prefix never counts:
``victim`` owns nothing of ``victim-checkpoint-keep``. A name with nothing of its own is
``adapter_not_found`` and nothing is touched. A listed directory whose name the rule refuses
today (a demoted ``<name>.failed``, say) can still be deleted by that name; it owns no
checkpoint. Each directory is first renamed to a hidden name, then removed, so an
interrupted deletion never leaves something that looks like a valid adapter or checkpoint.
"""

from __future__ import annotations

import os
import shutil
import stat
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln._fs import fsync_dir, name_max_bytes, name_problem
from kiln._jsonio import read_json_file
from kiln.checkpoints import parse_checkpoint_name, parse_checkpoint_staging_name
from kiln.digests import raw_hex
from kiln.errors import KilnError, NotFoundError, RequestError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MANIFEST = "adapter_manifest.json"
CANARY = "adapter_canary_status.json"
CHECKPOINT_SUFFIX = ".kiln-checkpoint"

__all__ = ["adapter_entry", "delete_adapter", "list_adapters", "read_canary_status", "require_adapter_name"]


def require_adapter_name(name: str) -> str:
    """``name`` when it can name an adapter in the registry, else ``RequestError`` with the reason."""
    why = name_problem(name, kind="adapter")
    if why is not None:
        raise RequestError(
            f"adapter name {name!r} is refused by the registry name rule: {why}",
            code="training_invalid_request",
            hint=f"an adapter name is one plain, non-blank file name of at most {name_max_bytes('adapter')} UTF-8 "
            "bytes that no checkpoint, staging or demotion name can be mistaken for (docs/server.md, Names)",
        )
    return name


def _timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _problem_text(exc: KilnError) -> str:
    problems = getattr(exc, "problems", None)
    return str(problems[0]) if problems else exc.message


def _config_facts(path: Path) -> tuple[dict[str, Any], str | None]:
    try:
        config = read_json_file(path)
    except KilnError as exc:
        return {}, f"{CONFIG} is unreadable: {_problem_text(exc)}"
    if not isinstance(config, dict):
        return {}, f"{CONFIG} is not a JSON object"
    return config, None


def read_canary_status(path: Path) -> dict[str, Any]:
    """The canary result, or a quarantine when the file cannot be trusted (it never promotes)."""
    try:
        value = read_json_file(path)
        found = contracts.problems("AdapterCanaryStatus", value)
        why = str(found[0]) if found else None
    except KilnError as exc:
        value, why = None, _problem_text(exc)
    if why is None:
        return value
    return {
        "status": "quarantined",
        "failure_reason": f"{CANARY} is invalid ({why}); an unreadable canary never promotes",
        "warnings": [],
        "checks": [],
    }


def _receipt_only(directory: Path) -> str:
    """Why a directory holds a receipt but no serving files, as its receipt tells it (read, never trusted)."""
    try:
        receipt = read_json_file(directory / "train_receipt.json")
    except KilnError:
        return " (its train_receipt.json is unreadable)"
    if not isinstance(receipt, dict):
        return ""
    source = (
        (receipt.get("training_data") or {}).get("source") if isinstance(receipt.get("training_data"), dict) else None
    )
    if receipt.get("status") == "success" and isinstance(source, str) and source.endswith("_dry_run"):
        return " (a dry run: its receipt only, no weights by design)"
    if receipt.get("status") == "failed":
        return f" (a failed run, {receipt.get('failure_reason')}: only its receipt is kept)"
    return " (only a receipt is here)"


def adapter_entry(directory: Path, *, loaded: bool = False) -> dict[str, Any]:
    """One registry directory as ``AdapterDiskEntry`` (validated)."""
    files: list[str] = []
    size = 0
    for entry in os.scandir(directory):
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            files.append(entry.name)
            size += st.st_size
    files.sort()
    has_config, has_weights = CONFIG in files, WEIGHTS in files
    error = None
    if not has_config or not has_weights:
        missing = " and ".join(f for f, ok in ((CONFIG, has_config), (WEIGHTS, has_weights)) if not ok)
        error = f"missing {missing}" + (_receipt_only(directory) if "train_receipt.json" in files else "")
    config: dict[str, Any] = {}
    if has_config:
        config, config_error = _config_facts(directory / CONFIG)
        error = error or config_error
    rank = config.get("r") if isinstance(config.get("r"), int) and not isinstance(config.get("r"), bool) else None
    alpha = config.get("lora_alpha")
    alpha = float(alpha) if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) else None
    targets = config.get("target_modules") or []
    targets = sorted([targets] if isinstance(targets, str) else [str(t) for t in targets])
    base = config.get("base_model_name_or_path")

    manifest = manifest_error = None
    if MANIFEST in files:
        try:
            value = read_json_file(directory / MANIFEST)
            found = contracts.problems("AdapterManifest", value)
        except KilnError as exc:
            value, found = None, [exc]
        if found:
            first = found[0]
            manifest_error = f"{MANIFEST}: " + (_problem_text(first) if isinstance(first, KilnError) else str(first))
        else:
            manifest = value
    canary: dict[str, Any] = {"status": "unknown", "failure_reason": None, "warnings": [], "checks": []}
    if CANARY in files:
        canary = read_canary_status(directory / CANARY)
    status = (
        "invalid"
        if error
        else "loaded"
        if loaded
        else "quarantined"
        if canary["status"] == "quarantined"
        else "available"
    )
    weights_size = (directory / WEIGHTS).stat().st_size if has_weights else None
    entry = {
        "name": directory.name,
        "has_config": has_config,
        "has_weights": has_weights,
        "size_bytes": size,
        "modified_at": _timestamp(directory.stat().st_mtime),
        "files": files,
        "path": str(directory.resolve()),
        "status": status,
        "adapter_model_sha256": raw_hex(manifest["safetensors_hash"]) if manifest else None,
        "adapter_model_size_bytes": weights_size,
        "rank": rank,
        "alpha": alpha,
        "alpha_over_rank": alpha / rank if alpha is not None and rank else None,
        "target_modules": targets,
        "base_model_name_or_path": base if isinstance(base, str) and base else None,
        "parent_adapter_metadata": None,
        "canary_status": canary["status"],
        "canary_failure_reason": canary["failure_reason"],
        "canary_warnings": list(canary["warnings"]),
        "canary_checks": list(canary["checks"]),
        "canary_status_path": str((directory / CANARY).resolve()) if CANARY in files else None,
        "adapter_manifest": manifest,
        "adapter_manifest_path": str((directory / MANIFEST).resolve()) if MANIFEST in files else None,
        "adapter_manifest_error": manifest_error,
        "last_load_error": None,
        "error": error,
    }
    found = contracts.problems("AdapterDiskEntry", entry)
    if found:  # a fact that does not fit the schema: report the directory as invalid, never hide it
        entry.update(status="invalid", error=f"cannot describe this directory: {found[0]}")
    return entry


def _is_listed(entry: os.DirEntry[str]) -> bool:
    """Whether listing shows this registry entry as an adapter directory."""
    hidden_or_checkpoint = entry.name.startswith(".") or entry.name.endswith(CHECKPOINT_SUFFIX)
    return not hidden_or_checkpoint and entry.is_dir(follow_symlinks=False)


def _adapter_dirs(registry: Path) -> list[Path]:
    if not registry.is_dir():
        return []
    return sorted((Path(entry.path) for entry in os.scandir(registry) if _is_listed(entry)), key=lambda p: p.name)


def _stat_key(directory: Path) -> tuple[Any, ...] | None:
    """What stat says about a directory and its files: changes whenever any file does."""
    try:
        st = directory.stat(follow_symlinks=False)
        files = []
        for entry in os.scandir(directory):
            fst = entry.stat(follow_symlinks=False)
            files.append((entry.name, fst.st_mode, fst.st_size, fst.st_mtime_ns, fst.st_ino))
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, tuple(sorted(files)))


def list_adapters(
    registry: str | os.PathLike[str],
    *,
    loaded: dict[str, Any] | None = None,
    cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The registry as ``AdaptersResponse``. ``loaded`` is the server's ``LoadedAdapterIdentity``
    (the served adapter is also the active one); locally nothing is loaded.

    ``cache`` (a dict the caller keeps between calls) reuses an entry while stat reports
    the same directory and files (inode, size, mtime of each), so a poll of a large,
    unchanged registry reads no file. Entries are shared between answers: treat them as
    read-only.
    """
    root = Path(registry)
    name = loaded["name"] if loaded else None
    available = []
    for path in _adapter_dirs(root):
        if cache is None or path.name == name:
            available.append(adapter_entry(path, loaded=path.name == name))
            continue
        key, hit = _stat_key(path), cache.get(path.name)
        if key is not None and hit is not None and hit[0] == key:
            available.append(hit[1])
            continue
        entry = adapter_entry(path)
        if key is not None:
            cache[path.name] = (key, entry)
        available.append(entry)
    if cache is not None:
        for gone in set(cache) - {p["name"] for p in available}:
            del cache[gone]
    return {
        "active_adapter": name,
        "active": name,
        "loaded_adapter": name,
        "loaded_adapter_identity": loaded,
        "loaded_adapters": [name] if name else [],
        "adapter_dir": str(root.resolve()),
        "available": available,
        "available_adapters": available,
    }


def _owned_by(entry_name: str, name: str) -> bool:
    """Whether a registry entry is one of ``name``'s checkpoints or a hidden leftover made from one's name."""
    parsed = parse_checkpoint_staging_name(entry_name) if entry_name.startswith(".") else None
    owner = parsed[0] if parsed else (parse_checkpoint_name(entry_name) or (None,))[0]
    return owner == name


def _doomed(registry: Path, name: str, *, owns_checkpoints: bool) -> list[Path]:
    """The adapter directory (when listing shows it), its checkpoints and their hidden leftovers."""
    found = []
    for entry in os.scandir(registry):
        if entry.name == name:
            if _is_listed(entry):
                found.append(Path(entry.path))
        elif owns_checkpoints and _owned_by(entry.name, name) and entry.is_dir(follow_symlinks=False):
            found.append(Path(entry.path))
    return sorted(found)


def delete_adapter(registry: str | os.PathLike[str], name: str, *, dry_run: bool = False) -> list[Path]:
    """Remove ``name`` and exactly the checkpoints it owns; return what was (or would be) removed.

    A name the registry rule refuses is ``training_invalid_request`` unless listing shows a directory of that
    name (which is then removed alone); a name with nothing to remove is ``adapter_not_found``.
    """
    root = Path(registry)
    if name_problem(name, kind="file") is not None:  # not even one plain directory entry: never near the disk
        require_adapter_name(name)
    target = root / name
    if target.is_symlink():
        raise RequestError(
            f"{target} is a symlink, not an adapter directory; remove it by hand", code="training_invalid_request"
        )
    valid = name_problem(name, kind="adapter") is None
    doomed = _doomed(root, name, owns_checkpoints=valid) if root.is_dir() else []
    if not valid and not doomed:
        require_adapter_name(name)  # the rule, named
    if not doomed:
        raise NotFoundError(f"no adapter {name!r} (and no checkpoints of it) in {root}", code="adapter_not_found")
    if dry_run:
        return doomed
    for path in doomed:
        hidden = root / f".{path.name}.deleting-{uuid.uuid4().hex[:8]}"
        os.rename(path, hidden)
        fsync_dir(root)
        shutil.rmtree(hidden)
    return doomed
