"""Execution provenance (``kiln.execution-provenance.v1``): which interpreter, torch build,
BLAS/threads, device, model identity, precision and kernel contract produced a result.
Self-digested: ``provenance_sha256`` covers the record without itself.

``load_execution_provenance`` (strict), ``write_execution_provenance`` (canonical, atomic),
``seal_execution_provenance`` (fill in both digests of a record being built).
"""

from __future__ import annotations

import os
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kiln.documents import pipeline
from kiln.documents.digests import execution_provenance_digest, kernel_contract_digest
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

DOC = "ExecutionProvenanceV1"
MAX_TEXT_BYTES = 512

__all__ = ["load_execution_provenance", "seal_execution_provenance", "write_execution_provenance"]


@semantic_rule("ExecutionKernelIdentity", "execution-provenance.compiled-features-sorted")
def _features_sorted(kernels: dict[str, Any], at: str) -> Iterable[Problem]:
    features = kernels["compiled_features"]
    for i in range(1, len(features)):
        if features[i] <= features[i - 1]:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "compiled_features", i),
                f"compiled_features must be sorted and unique; {features[i]!r} follows {features[i - 1]!r}",
            )


@semantic_rule("ExecutionKernelIdentity", "execution-provenance.kernel-contract-digest", integrity=True)
def _kernel_digest(kernels: dict[str, Any], at: str) -> Iterable[Problem]:
    expected = kernel_contract_digest(kernels["versions"], kernels["compiled_features"])
    if kernels["contract_sha256"] != expected:
        yield Problem(
            "digest_mismatch",
            ptr(at, "contract_sha256"),
            f"kernel contract digest does not recompute: recorded {kernels['contract_sha256']}, computed {expected}",
        )


@semantic_rule(DOC, "execution-provenance.self-digest", integrity=True)
def _self_digest(record: dict[str, Any], at: str) -> Iterable[Problem]:
    expected = execution_provenance_digest(record)
    if record["provenance_sha256"] != expected:
        yield Problem(
            "digest_mismatch",
            ptr(at, "provenance_sha256"),
            f"provenance_sha256 does not recompute: recorded {record['provenance_sha256']}, computed {expected}",
        )


def _text_problem(value: Any) -> str | None:
    if not isinstance(value, str):
        return None
    if not value:
        return "is empty"
    if value != value.strip():
        return "has leading or trailing whitespace"
    if len(value.encode("utf-8")) > MAX_TEXT_BYTES:
        return f"is longer than {MAX_TEXT_BYTES} UTF-8 bytes"
    if not value.isprintable() and any(unicodedata.category(ch) == "Cc" for ch in value):
        return "contains a control character"
    return None


@semantic_rule(DOC, "execution-provenance.text-fields")
def _text_fields(record: dict[str, Any], at: str) -> Iterable[Problem]:
    candidates: list[tuple[str, Any]] = []
    for section, keys in (
        ("backend", ("name", "device")),
        ("build", ("package_version", "target", "git_commit")),
        ("precision", ("inference_dtype", "training_policy")),
    ):
        for key in keys:
            if key in record[section]:
                candidates.append((ptr(at, section, key), record[section][key]))
    for key, value in record["kernels"]["versions"].items():
        candidates.append((ptr(at, "kernels", "versions", key), key))
        candidates.append((ptr(at, "kernels", "versions", key), value))
    for i, feature in enumerate(record["kernels"]["compiled_features"]):
        candidates.append((ptr(at, "kernels", "compiled_features", i), feature))
    for pointer, value in candidates:
        why = _text_problem(value)
        if why:
            yield Problem("inconsistent_fields", pointer, f"provenance text {value!r} {why}")


def seal_execution_provenance(record: dict[str, Any]) -> dict[str, Any]:
    """Return a copy with ``kernels.contract_sha256`` and ``provenance_sha256`` computed."""
    out = dict(record)
    kernels = dict(out["kernels"])
    kernels["contract_sha256"] = kernel_contract_digest(kernels["versions"], kernels["compiled_features"])
    out["kernels"] = kernels
    out["provenance_sha256"] = execution_provenance_digest(out)
    return out


def load_execution_provenance(source: pipeline.Source) -> Any:
    return pipeline.load(DOC, source)


def write_execution_provenance(path: str | os.PathLike[str], record: Any) -> Path:
    return pipeline.write(DOC, path, record)
