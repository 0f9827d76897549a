"""Adapter manifest (``kiln_adapter_manifest``, ``adapter_manifest.json``): binds a completed
adapter's serving files (weights, config and, when there is one, the train receipt) to their
digests by plain file name beside the manifest, and carries the lineage copied from the
receipt (parent adapter, model config and training-template digests, base-weight shard
manifest, execution provenance, training precision, commit, training data).

``manifest.embedded-records`` is enforced by the rules of the embedded definitions, which
run wherever they occur: ``base_weight_shard_manifest`` (sorted unique shards, total size,
aggregate digest) and ``execution_provenance`` (self-digest, kernel-contract digest, sorted
features, text fields); ``training_precision`` has no rules beyond its closed schema.
``manifest.file-hashes`` needs the files and is checked by restore, verify and load, not here.
``manifest.file-names``: each named file is one plain file name (``kiln.host.fs.name_problem``,
kind ``file``), not the manifest's own, and no file is named twice.

``load_adapter_manifest`` (strict), ``write_adapter_manifest`` (canonical, atomic).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kiln.artifacts.adapter_files import MANIFEST_FILE
from kiln.documents import pipeline
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem
from kiln.host.fs import name_problem

DOC = "AdapterManifest"
FILE_ROLES = ("adapter_model", "adapter_config", "train_receipt")

__all__ = ["MANIFEST_FILE", "load_adapter_manifest", "write_adapter_manifest"]


def unsafe_file_name(name: str) -> str | None:
    """Why ``name`` is not a plain file name in the manifest's directory, or None when it is one."""
    why = name_problem(name, kind="file")
    if why is not None:
        return f"is not a plain file name: {why}"
    if name == MANIFEST_FILE:
        return f"is the manifest's own name {MANIFEST_FILE!r}"
    return None


@semantic_rule(DOC, "manifest.file-names")
def _file_names(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    seen: dict[str, str] = {}
    for role in FILE_ROLES:
        name = doc["files"][role]
        if name is None:
            continue
        pointer = ptr(at, "files", role)
        why = unsafe_file_name(name)
        if why:
            yield Problem("unsafe_path", pointer, f"files.{role} {name!r} {why}")
        if name in seen:
            yield Problem("inconsistent_fields", pointer, f"files.{role} {name!r} is also files.{seen[name]}")
        seen.setdefault(name, role)


@semantic_rule(DOC, "manifest.receipt-presence")
def _receipt_presence(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    receipt_file, receipt_hash = doc["files"]["train_receipt"], doc["receipt_hash"]
    if (receipt_file is None) != (receipt_hash is None):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "receipt_hash"),
            f"receipt_hash is {receipt_hash!r} but files.train_receipt is {receipt_file!r}: both are null or neither",
        )


@semantic_rule(DOC, "manifest.template-digest")
def _template_digest(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    provenance = doc.get("execution_provenance")
    if provenance is None or "training_chat_template_hash" not in doc:
        return
    recorded = provenance["model"].get("training_chat_template_sha256")
    if recorded is not None and recorded != doc["training_chat_template_hash"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "training_chat_template_hash"),
            f"training_chat_template_hash is {doc['training_chat_template_hash']} but "
            f"execution_provenance.model.training_chat_template_sha256 is {recorded}",
        )


def load_adapter_manifest(source: pipeline.Source) -> Any:
    return pipeline.load(DOC, source)


def write_adapter_manifest(path: str | os.PathLike[str], manifest: Any) -> Path:
    return pipeline.write(DOC, path, manifest)
