"""The adapter registry as listed: ``list_adapters`` and ``adapter_entry``.

Listing reports, per child directory of the registry (hidden entries and checkpoint
directories excluded), the facts ``GET /v1/adapters`` reports: files and sizes, the LoRA
config (rank, alpha, targets, base model), the canary result, and the manifest parsed
and validated -- or why it was rejected (a malformed manifest is surfaced, never hidden).
It never rehashes files: the weights digest shown is the manifest's. The directory itself
-- its file names, reading, publishing, demoting and deleting an adapter -- belongs to
``kiln.adapters._directory``.
"""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln.adapters._directory import (
    CANARY_FILE,
    CONFIG_FILE,
    MANIFEST_FILE,
    RECEIPT_FILE,
    WEIGHTS_FILE,
    holds_attempt_record_only,
    is_listed,
    problem_text,
    read_canary_status,
)
from kiln.artifacts.adapter_files import SIGNATURE_FILE
from kiln.documents.digests import raw_hex
from kiln.documents.jsonio import read_json_file
from kiln.errors import KilnError, Problem

__all__ = ["adapter_entry", "list_adapters"]


def _timestamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _config_facts(path: Path) -> tuple[dict[str, Any], str | None]:
    try:
        config = read_json_file(path)
    except KilnError as exc:
        return {}, f"{CONFIG_FILE} is unreadable: {problem_text(exc, count=False)}"
    if not isinstance(config, dict):
        return {}, f"{CONFIG_FILE} is not a JSON object"
    return config, None


def attempt_record(directory: Path) -> bool:
    """Whether ``directory`` is what a run that published no adapter leaves at its name: nothing, or only the receipt
    of a failed run or of a dry run (an adapter whose weights went missing is not one: it is invalid)."""
    if not holds_attempt_record_only(directory):
        return False
    if not (directory / RECEIPT_FILE).is_file():
        return True
    try:
        receipt = read_json_file(directory / RECEIPT_FILE)
    except KilnError:
        return False
    return isinstance(receipt, dict) and (receipt.get("status") == "failed" or _dry_run_record(directory))


def _dry_run_record(directory: Path) -> bool:
    """Whether a directory's lone receipt is a successful dry run's (read, never trusted)."""
    try:
        receipt = read_json_file(directory / RECEIPT_FILE)
    except KilnError:
        return False
    if not isinstance(receipt, dict):
        return False
    data = receipt.get("training_data")
    source = data.get("source") if isinstance(data, dict) else None
    return receipt.get("status") == "success" and isinstance(source, str) and source.endswith("_dry_run")


def _receipt_only(directory: Path) -> str:
    """Why a directory holds a receipt but no serving files, as its receipt tells it (read, never trusted)."""
    try:
        receipt = read_json_file(directory / RECEIPT_FILE)
    except KilnError:
        return f" (its {RECEIPT_FILE} is unreadable)"
    if not isinstance(receipt, dict):
        return ""
    if receipt.get("status") == "failed":
        return f" (a failed run, {receipt.get('failure_reason')}: only its receipt is kept)"
    return " (only a receipt is here)"


def _signature(directory: Path) -> dict[str, Any] | None:
    """The signature's facts as read (never verified: listing never rehashes); None when it is unreadable."""
    from kiln.adapters.signing import signature_facts

    try:
        return signature_facts(directory)
    except KilnError:
        return None


def adapter_entry(directory: Path, *, loaded: bool = False) -> dict[str, Any]:
    """One registry directory as ``AdapterDiskEntry`` (validated)."""
    files: list[str] = []
    size = 0
    for item in os.scandir(directory):
        st = item.stat(follow_symlinks=False)
        if stat.S_ISREG(st.st_mode):
            files.append(item.name)
            size += st.st_size
    files.sort()
    has_config, has_weights = CONFIG_FILE in files, WEIGHTS_FILE in files
    error = None
    if not has_config or not has_weights:
        missing = " and ".join(f for f, ok in ((CONFIG_FILE, has_config), (WEIGHTS_FILE, has_weights)) if not ok)
        error = f"missing {missing}" + (_receipt_only(directory) if RECEIPT_FILE in files else "")
    config: dict[str, Any] = {}
    if has_config:
        config, config_error = _config_facts(directory / CONFIG_FILE)
        error = error or config_error
    rank = config.get("r") if isinstance(config.get("r"), int) and not isinstance(config.get("r"), bool) else None
    alpha = config.get("lora_alpha")
    alpha = float(alpha) if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) else None
    targets = config.get("target_modules") or []
    targets = sorted([targets] if isinstance(targets, str) else [str(t) for t in targets])
    base = config.get("base_model_name_or_path")

    manifest = manifest_error = None
    if MANIFEST_FILE in files:
        try:
            value = read_json_file(directory / MANIFEST_FILE)
            found: list[Problem | KilnError] = list(contracts.problems("AdapterManifest", value))
        except KilnError as exc:
            value, found = None, [exc]
        if found:
            first = found[0]
            manifest_error = f"{MANIFEST_FILE}: " + (
                problem_text(first, count=False) if isinstance(first, KilnError) else str(first)
            )
        else:
            manifest = value
    canary: dict[str, Any] = {"status": "unknown", "failure_reason": None, "warnings": [], "checks": []}
    if CANARY_FILE in files:
        canary = read_canary_status(directory / CANARY_FILE)
    dry_run = not has_config and not has_weights and RECEIPT_FILE in files and _dry_run_record(directory)
    if dry_run:  # a dry run's receipt alone is what a dry run leaves, by design: not an invalid adapter
        error = None
    status = (
        "dry_run"
        if dry_run
        else "invalid"
        if error
        else "loaded"
        if loaded
        else "quarantined"
        if canary["status"] == "quarantined"
        else "available"
    )
    weights_size = (directory / WEIGHTS_FILE).stat().st_size if has_weights else None
    entry: dict[str, Any] = {
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
        "canary_status_path": str((directory / CANARY_FILE).resolve()) if CANARY_FILE in files else None,
        "adapter_manifest": manifest,
        "adapter_manifest_path": str((directory / MANIFEST_FILE).resolve()) if MANIFEST_FILE in files else None,
        "adapter_manifest_error": manifest_error,
        "last_load_error": None,
        "error": error,
    }
    signature = _signature(directory) if SIGNATURE_FILE in files else None
    if signature is not None:  # a Kiln extension of the entry: present only for a signed adapter
        entry["signature"] = signature
    unfit = contracts.problems("AdapterDiskEntry", entry)
    if unfit:  # a fact that does not fit the schema: report the directory as invalid, never hide it
        entry.update(status="invalid", error=f"cannot describe this directory: {unfit[0]}")
    return entry


def _adapter_dirs(registry: Path) -> list[Path]:
    if not registry.is_dir():
        return []
    return sorted((Path(entry.path) for entry in os.scandir(registry) if is_listed(entry)), key=lambda p: p.name)


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
