"""Base-weight shard manifest (``kiln.base-weight-shards.v1``): the authoritative identity
of a model's weights -- every ``*.safetensors`` shard with its size and SHA-256, plus the
name- and order-independent ``kiln.base-model-content.v1`` aggregate.

``load_base_weight_manifest`` (strict), ``write_base_weight_manifest`` (canonical, atomic),
``build_base_weight_manifest`` (hash a model directory, shards in parallel, streamed; with a ``cache_dir``, an
unchanged shard's digest comes from ``kiln.host.digest_cache``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kiln.documents import pipeline
from kiln.documents.digests import BASE_MODEL_CONTENT_ALGORITHM, base_model_content_aggregate, prefixed
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem
from kiln.host.digest_cache import cached_file_sha256

DOC = "BaseWeightShardManifest"

__all__ = ["build_base_weight_manifest", "load_base_weight_manifest", "write_base_weight_manifest"]


@semantic_rule(DOC, "base-weight-shards.filenames-sorted-unique")
def _sorted_unique(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    names = [s["filename"] for s in doc["shards"]]
    for i in range(1, len(names)):
        if names[i] <= names[i - 1]:
            what = "duplicate" if names[i] == names[i - 1] else "out of order"
            yield Problem(
                "inconsistent_fields",
                ptr(at, "shards", i, "filename"),
                f"shard file name {names[i]!r} is {what}: names must be unique and sorted",
            )


@semantic_rule(DOC, "base-weight-shards.total-size")
def _total(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    total = sum(s["size_bytes"] for s in doc["shards"])
    if doc["total_size_bytes"] != total:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "total_size_bytes"),
            f"total_size_bytes is {doc['total_size_bytes']} but the shards add up to {total}",
        )


@semantic_rule(DOC, "base-weight-shards.aggregate-recomputes", integrity=True)
def _aggregate(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    expected = base_model_content_aggregate((s["sha256"], s["size_bytes"]) for s in doc["shards"])
    if doc["aggregate_sha256"] != expected:
        yield Problem(
            "digest_mismatch",
            ptr(at, "aggregate_sha256"),
            f"aggregate_sha256 does not recompute from the shards: recorded {doc['aggregate_sha256']}, computed {expected}",
        )


def load_base_weight_manifest(source: pipeline.Source) -> Any:
    return pipeline.load(DOC, source)


def write_base_weight_manifest(path: str | os.PathLike[str], manifest: Any) -> Path:
    return pipeline.write(DOC, path, manifest)


def build_base_weight_manifest(
    model_dir: str | os.PathLike[str], *, workers: int | None = None, cache_dir: Path | None = None
) -> dict[str, Any]:
    """Hash every ``*.safetensors`` shard of ``model_dir`` (threads; hashlib releases the GIL). ``cache_dir``: the
    file-digest cache to consult and fill (``kiln.host.digest_cache``); None hashes every shard."""
    shards = sorted(p for p in Path(model_dir).glob("*.safetensors") if p.is_file())
    if not shards:
        raise FileNotFoundError(f"no *.safetensors shards in {model_dir}")
    with ThreadPoolExecutor(max_workers=workers or min(8, len(shards))) as pool:
        hashed = list(pool.map(lambda shard: cached_file_sha256(shard, cache_dir), shards))
    entries = [
        {"filename": p.name, "size_bytes": size, "sha256": prefixed(digest)}
        for p, (digest, size) in zip(shards, hashed, strict=True)
    ]
    return {
        "schema_version": 1,
        "manifest_type": "kiln.base-weight-shards.v1",
        "aggregate_algorithm": BASE_MODEL_CONTENT_ALGORITHM,
        "aggregate_sha256": base_model_content_aggregate((prefixed(digest), size) for digest, size in hashed),
        "total_size_bytes": sum(size for _, size in hashed),
        "shards": entries,
    }
