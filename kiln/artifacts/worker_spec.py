"""Worker spec (``kiln.worker-spec.v1``, ``spec.json`` of a training job): what a worker process trains.

The server writes one for each job it starts in a worker process (and builds one for its in-process thread), and
``kiln train --local`` for a run over several ranks; ``python -m kiln.jobs.worker SPEC`` loads it strictly. Its
``request`` is the replay request, which the worker admits again against its kind's request definition; its
``fingerprint`` is what that admission must give again. The schema is closed at every level and has no cross-field
rule.

``build_worker_spec`` (the one builder, from typed parts), ``load_worker_spec`` (strict), ``write_worker_spec``
(canonical, atomic).
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln_contracts.models.kiln_control_plane_v1_schema import WorkerSpec

from kiln.documents import pipeline
from kiln.documents.jsonio import JsonObject

DOC = "WorkerSpec"
SCHEMA = "kiln.worker-spec.v1"

__all__ = ["SCHEMA", "WorkerSpec", "build_worker_spec", "load_worker_spec", "write_worker_spec"]


def build_worker_spec(
    *,
    kind: str,
    adapter_name: str,
    request: JsonObject,
    fingerprint: JsonObject,
    events: Path | None,
    server_pid: int,
    launch: JsonObject,
    registry: Path,
    model_path: Path,
    model_is_default: bool,
    teachers_root: Path | None,
    checkpoint_interval: int | None,
    data_roots: tuple[Path, ...] | None,
    memory_limit_bytes: int | None = None,
    serving_copy: JsonObject | None = None,
) -> WorkerSpec:
    """The spec of one job, checked like a loaded one (schema, numbers, model). ``serving_copy``: a server's serving
    copy beside the job (``WorkerServingCopy``), which the worker's memory plan counts."""
    context: JsonObject = {
        "registry": str(registry),
        "model_path": str(model_path),
        "model_is_default": model_is_default,
        "teachers_root": None if teachers_root is None else str(teachers_root),
        "checkpoint_interval": checkpoint_interval,
        "data_roots": None if data_roots is None else [str(root) for root in data_roots],
        "memory_limit_bytes": memory_limit_bytes,
    }
    if serving_copy is not None:
        context["serving_copy"] = serving_copy
    spec = {
        "schema": SCHEMA,
        "kind": kind,
        "adapter_name": adapter_name,
        "request": request,
        "fingerprint": fingerprint,
        "events": None if events is None else str(events),
        "server_pid": server_pid,
        "launch": launch,
        "context": context,
    }
    loaded: WorkerSpec = pipeline.load(DOC, spec, document=DOC)
    return loaded


def load_worker_spec(path: str | os.PathLike[str]) -> WorkerSpec:
    """Read and strictly validate a worker spec."""
    loaded: WorkerSpec = pipeline.load(DOC, Path(path))
    return loaded


def write_worker_spec(path: str | os.PathLike[str], spec: WorkerSpec) -> Path:
    """Write a worker spec crash-atomically in canonical JSON."""
    return pipeline.write(DOC, path, spec)
