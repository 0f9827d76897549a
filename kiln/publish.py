"""Publication of a training result into the adapter registry.

* ``check_target``: the adapter name is one (``kiln.adapters.require_adapter_name``) and
  holds no adapter yet;
* ``stage_adapter``: write the PEFT files into a hidden staging directory inside the
  registry, then rename it to ``<registry>/<adapter>`` (``kiln._fs.publish_dir``: the
  canonical name is absent before the rename and complete after it);
* ``write_train_receipt``: the receipt of every attempt, success or failure, written
  crash-atomically (canonical JSON, temp file, fsync, rename) after strict validation;
* ``bind_adapter_manifest``: on success only, build the manifest binding the serving files
  and the receipt to their SHA-256 digests, with lineage copied from the receipt, and write
  it (``kiln.artifacts.adapter_manifest.write_adapter_manifest`` writes a given manifest).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln._fs import file_mode, publish_dir
from kiln.adapters import require_adapter_name
from kiln.digests import file_sha256, prefixed
from kiln.errors import ConflictError

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
RECEIPT = "train_receipt.json"
MANIFEST = "adapter_manifest.json"

__all__ = ["adapter_file_receipt", "bind_adapter_manifest", "check_target", "stage_adapter", "write_train_receipt"]


def check_target(registry: Path, name: str) -> Path:
    """Refuse, before any model work, a name that is not path-safe or already holds an adapter."""
    target = registry / require_adapter_name(name)
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise ConflictError(f"{target} exists and is not an adapter directory", code="adapter_exists")
    if any((target / f).exists() for f in ADAPTER_FILES):
        raise ConflictError(
            f"adapter {name!r} already exists in {registry}",
            code="adapter_exists",
            hint=(
                f"choose another adapter name, or delete it first: on this machine "
                f"`kiln adapters delete {shlex.quote(name)} --adapter-dir {shlex.quote(str(registry))}`, "
                f"through a server `kiln adapters delete {shlex.quote(name)}` (both also delete its checkpoints)"
            ),
        )
    return target


def stage_adapter(peft_model: Any, registry: Path, name: str) -> Path:
    """Save the adapter files and move them into place as ``<registry>/<name>``."""
    registry.mkdir(parents=True, exist_ok=True)
    target = check_target(registry, name)
    # overwrite: a directory left by an earlier failed run holds only its receipt (check_target refuses the rest)
    with publish_dir(target, overwrite=True) as staging:
        peft_model.save_pretrained(staging, safe_serialization=True)
        for extra in staging.iterdir():  # peft adds a model card; the adapter is exactly its two files
            if extra.name not in ADAPTER_FILES:
                extra.unlink()
        for file_name in ADAPTER_FILES:  # safetensors writes 0600: give the files the mode open() would
            os.chmod(staging / file_name, file_mode())
    return target


def adapter_file_receipt(adapter_dir: Path | None) -> dict[str, Any]:
    """``{path, adapter_model_sha256, adapter_model_bytes}`` of ``adapter_model.safetensors``."""
    weights = adapter_dir / "adapter_model.safetensors" if adapter_dir else None
    if weights is None or not weights.is_file():
        return {
            "path": str(adapter_dir) if adapter_dir else None,
            "adapter_model_sha256": None,
            "adapter_model_bytes": None,
        }
    digest, size = file_sha256(weights)
    return {"path": str(adapter_dir), "adapter_model_sha256": prefixed(digest), "adapter_model_bytes": size}


def write_train_receipt(adapter_dir: Path, receipt: dict[str, Any]) -> Path:
    adapter_dir.mkdir(parents=True, exist_ok=True)
    return contracts.write("TrainReceipt", adapter_dir / RECEIPT, receipt)


def bind_adapter_manifest(adapter_dir: Path, receipt: dict[str, Any]) -> Path:
    """Hash the serving files and the receipt of a successful run in ``adapter_dir`` and write the manifest that
    binds them, with the lineage its receipt records; returns the manifest's path."""
    if receipt["status"] != "success":
        raise ValueError("an adapter manifest is written only for a successful run")
    digests = {}
    for file_name in (*ADAPTER_FILES, RECEIPT):
        digests[file_name] = prefixed(file_sha256(adapter_dir / file_name)[0])
    runtime = receipt["runtime"]
    manifest = {
        "schema_version": 1,
        "manifest_type": "kiln_adapter_manifest",
        "adapter_name": receipt["adapter_name"],
        "safetensors_hash": digests["adapter_model.safetensors"],
        "config_hash": digests["adapter_config.json"],
        "receipt_hash": digests[RECEIPT],
        "parent_adapter": receipt["config"].get("base_adapter"),
        "model_config_hash": receipt["model"]["config_hash"],
        "kiln_commit": receipt["kiln"]["git_commit"],
        "training_data_hash": receipt["training_data"]["sha256"],
        "training_data_source": receipt["training_data"]["source"],
        "training_data_path": receipt["training_data"]["path"],
        "files": {
            "adapter_model": "adapter_model.safetensors",
            "adapter_config": "adapter_config.json",
            "train_receipt": RECEIPT,
        },
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
    return contracts.write("AdapterManifest", adapter_dir / MANIFEST, manifest)
