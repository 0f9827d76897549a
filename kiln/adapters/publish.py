"""Publication of a training result into the adapter registry.

* ``check_target``: the adapter name is one (``kiln.adapters.require_adapter_name``) and holds nothing a publication
  would have to destroy: the name is free, or its directory holds only an earlier attempt's receipt (a failed run,
  a dry run) -- which the publication supersedes -- or nothing;
* ``publish_trained_adapter``: the whole adapter directory -- ``adapter_config.json``,
  ``adapter_model.safetensors``, ``train_receipt.json`` and ``adapter_manifest.json`` (the names and the protocol are
  ``kiln.adapters``') -- built in one hidden staging directory of the registry and made visible by one rename
  (``kiln.adapters.staged_adapter``): the receipt is computed from
  the staged files, written, then the manifest binds the files and the receipt's digest, all inside the staging
  directory. Before the rename nothing of this run is visible at ``<registry>/<adapter>``; after it the adapter is
  complete. An earlier attempt's receipt there is superseded in that same rename;
* ``publish_receipt``: the receipt of an attempt that publishes no weights (a failed run, a dry run) alone in
  ``<registry>/<adapter>/``, where the listing shows it as that attempt (``invalid``, "a failed run ... only its
  receipt is kept"); written crash-atomically, never over a directory that holds serving files;
* ``bind_adapter_manifest``: build the manifest binding the serving files and the receipt of a successful run to
  their SHA-256 digests, with lineage copied from the receipt, and write it
  (``kiln.artifacts.adapter_manifest.write_adapter_manifest`` writes a given manifest).

A write the file system refuses while publishing (read-only, permission denied, no space or quota left, a name too
long) raises ``kiln.errors.StorageFailureError`` naming the path, so the run's failed receipt says
``storage_error`` and where.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln.adapters import (
    BINDINGS,
    MANIFEST_FILE,
    RECEIPT_FILE,
    SERVING_FILES,
    WEIGHTS_FILE,
    holds_attempt_record_only,
    require_adapter_name,
    staged_adapter,
)
from kiln.documents.digests import file_sha256, prefixed
from kiln.errors import STORAGE_ERRNOS, ConflictError, KilnError, StorageFailureError, storage_condition
from kiln.host.config import resolve_settings
from kiln.host.fs import file_mode

__all__ = [
    "PublishedAdapter",
    "adapter_file_receipt",
    "bind_adapter_manifest",
    "check_target",
    "publish_receipt",
    "publish_trained_adapter",
]


@dataclass(frozen=True)
class PublishedAdapter:
    """A complete adapter directory in the registry and the receipt it holds."""

    path: Path
    receipt_path: Path
    manifest_path: Path
    receipt: dict[str, Any]


def _delete_hint(registry: Path, name: str) -> str:
    """The command that deletes ``name``: ``--local`` in the configured registry (what the README shows),
    ``--adapter-dir`` only for another one."""
    try:
        configured = resolve_settings().registry
    except KilnError:  # a broken configuration must not hide the refusal being explained
        configured = None
    same = configured is not None and os.path.realpath(configured) == os.path.realpath(registry)
    where = "--local" if same else f"--adapter-dir {shlex.quote(str(registry))}"
    return (
        f"choose another adapter name, or delete it first: on this machine "
        f"`kiln adapters delete {shlex.quote(name)} {where}`, "
        f"through a server `kiln adapters delete {shlex.quote(name)}` (both also delete its checkpoints)"
    )


def check_target(registry: Path, name: str) -> Path:
    """Refuse, before any model work, a name that is not path-safe or whose directory a publication could not
    supersede (anything but an earlier attempt's receipt)."""
    target = registry / require_adapter_name(name)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ConflictError(f"{target} exists and is not an adapter directory", code="adapter_exists")
    if not target.exists() or holds_attempt_record_only(target):
        return target
    if any((target / f).exists() for f in SERVING_FILES):
        raise ConflictError(
            f"adapter {name!r} already exists in {registry}", code="adapter_exists", hint=_delete_hint(registry, name)
        )
    others = sorted(e for e in os.listdir(target) if e != RECEIPT_FILE and not e.startswith("."))
    raise ConflictError(
        f"{target} holds {', '.join(others)}, which is not an earlier attempt's {RECEIPT_FILE}; "
        "publishing an adapter there would replace it",
        code="adapter_exists",
        hint=_delete_hint(registry, name) + f", or move those files out of {target}",
    )


@contextlib.contextmanager
def _storage(doing: str, where: list[Path]) -> Iterator[None]:
    """A refused write inside the block as ``StorageFailureError`` naming its path (else ``where[-1]``)."""
    try:
        yield
    except OSError as exc:
        failure = StorageFailureError.from_os_error(exc, doing=doing, path=where[-1])
        if failure is None:
            raise
        raise failure from exc


_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors (Rust std::io::Error) names the errno


def _safetensors_refusal(exc: Exception, doing: str, path: Path) -> StorageFailureError | None:
    """A ``SafetensorError`` whose I/O error is a storage condition ("... No space left on device (os error 28)"),
    as ``StorageFailureError`` naming ``path`` and the condition; None for anything else (not the file system's)."""
    found = _OS_ERROR.search(str(exc))
    if found is None or int(found[1]) not in STORAGE_ERRNOS:
        return None
    err = int(found[1])
    return StorageFailureError(
        f"{doing}: {storage_condition(err)} at {path} (safetensors: {exc})", path=str(path), errno=err
    )


def _save_adapter_files(peft_model: Any, directory: Path, doing: str, where: list[Path]) -> None:
    """The two PEFT files of the adapter, with the mode ``open()`` would give them."""
    from safetensors import SafetensorError

    where.append(directory / WEIGHTS_FILE)
    try:
        peft_model.save_pretrained(directory, safe_serialization=True)
    except SafetensorError as exc:  # the library writes the weights itself; its I/O errors carry no errno
        failure = _safetensors_refusal(exc, doing, where[-1])
        if failure is None:
            raise
        raise failure from exc
    for extra in directory.iterdir():  # peft adds a model card; the adapter is exactly its two files
        if extra.name not in SERVING_FILES:
            extra.unlink()
    for file_name in SERVING_FILES:  # safetensors writes 0600: give the files the mode open() would
        os.chmod(directory / file_name, file_mode())


def publish_trained_adapter(
    peft_model: Any, registry: Path, name: str, receipt: Callable[[Path], dict[str, Any]]
) -> PublishedAdapter:
    """Stage the adapter files, its receipt (``receipt(staged directory)``) and its manifest, then rename the
    directory into place as ``<registry>/<name>``, superseding an earlier attempt's receipt there."""
    target = registry / name
    doing = f"publishing adapter {name!r} to {target}"
    where = [registry]
    with _storage(doing, where):
        registry.mkdir(parents=True, exist_ok=True)
    check_target(registry, name)  # nothing appeared at the name since admission that this would replace
    with _storage(doing, where), staged_adapter(registry, name) as staging:
        where.append(staging)
        _save_adapter_files(peft_model, staging, doing, where)
        body = receipt(staging)
        body["adapters"]["output"]["path"] = str(target)  # hashed from the staged files, published at the target
        where.append(staging / RECEIPT_FILE)
        contracts.write("TrainReceipt", staging / RECEIPT_FILE, body)
        where.append(staging / MANIFEST_FILE)
        bind_adapter_manifest(staging, body)
        where.append(target)  # what remains: fsync the staged tree, the rename, fsync the registry
    return PublishedAdapter(target, target / RECEIPT_FILE, target / MANIFEST_FILE, body)


def publish_receipt(registry: Path, name: str, receipt: dict[str, Any]) -> Path:
    """Write the receipt of an attempt without weights to ``<registry>/<name>/train_receipt.json`` (crash-atomic;
    it replaces an earlier attempt's receipt). A directory holding serving files is never written into."""
    target = registry / name
    if os.path.lexists(target) and not holds_attempt_record_only(target):
        raise ConflictError(
            f"{target} holds an adapter (or files other than a receipt); the receipt of this run "
            f"({receipt['status']}{': ' + receipt['failure_reason'] if receipt.get('failure_reason') else ''}) "
            "is not written over it",
            code="adapter_exists",
            hint=_delete_hint(registry, name),
        )
    created = not os.path.lexists(target)
    target.mkdir(parents=True, exist_ok=True)
    try:
        return contracts.write("TrainReceipt", target / RECEIPT_FILE, receipt)
    except BaseException:
        if created:  # a refused receipt leaves no empty directory at the adapter's name
            with contextlib.suppress(OSError):
                target.rmdir()
        raise


def adapter_file_receipt(adapter_dir: Path | None) -> dict[str, Any]:
    """``{path, adapter_model_sha256, adapter_model_bytes}`` of ``adapter_model.safetensors``."""
    weights = adapter_dir / WEIGHTS_FILE if adapter_dir else None
    if weights is None or not weights.is_file():
        return {
            "path": str(adapter_dir) if adapter_dir else None,
            "adapter_model_sha256": None,
            "adapter_model_bytes": None,
        }
    digest, size = file_sha256(weights)
    return {"path": str(adapter_dir), "adapter_model_sha256": prefixed(digest), "adapter_model_bytes": size}


def bind_adapter_manifest(adapter_dir: Path, receipt: dict[str, Any]) -> Path:
    """Hash the serving files and the receipt of a successful run in ``adapter_dir`` and write the manifest that
    binds them, with the lineage its receipt records; returns the manifest's path."""
    if receipt["status"] != "success":
        raise ValueError("an adapter manifest is written only for a successful run")
    runtime = receipt["runtime"]
    manifest: dict[str, Any] = {
        "schema_version": 1,
        "manifest_type": "kiln_adapter_manifest",
        "adapter_name": receipt["adapter_name"],
        **{binding.field: _digest(adapter_dir / binding.file_name) for binding in BINDINGS},
        "parent_adapter": receipt["config"].get("base_adapter"),
        "model_config_hash": receipt["model"]["config_hash"],
        "kiln_commit": receipt["kiln"]["git_commit"],
        "training_data_hash": receipt["training_data"]["sha256"],
        "training_data_source": receipt["training_data"]["source"],
        "training_data_path": receipt["training_data"]["path"],
        "files": {binding.role: binding.file_name for binding in BINDINGS},
    }
    template = receipt["tokenizer"].get("training_chat_template_hash")
    if template:
        manifest["training_chat_template_hash"] = template
    if receipt["model"].get("base_weight_shard_manifest"):
        manifest["base_weight_shard_manifest"] = receipt["model"]["base_weight_shard_manifest"]
    if runtime.get("execution_provenance"):
        manifest["execution_provenance"] = runtime["execution_provenance"]
    if runtime.get("training_precision"):
        manifest["training_precision"] = runtime["training_precision"]
    if runtime.get("data_parallel"):
        manifest["data_parallel"] = runtime["data_parallel"]
    return contracts.write("AdapterManifest", adapter_dir / MANIFEST_FILE, manifest)


def _digest(path: Path) -> str:
    return prefixed(file_sha256(path)[0])
