"""What differs between a published artifact and its re-execution: the first difference, named.

``compare_checkpoints`` reads both checkpoint directories' own bytes (nothing the publisher's manifest says about
them is taken on trust): every state file byte for byte -- a safetensors file that differs is opened and its first
differing tensor named with the largest absolute difference, a JSON file its first differing field -- then the
manifests field by field, apart from ``created_at``. ``compare_adapters`` does the same for the published adapter's
serving files and the receipt's measured fields (``UNMEASURED`` lists what a receipt records about the occasion,
not the computation: times, paths, memory budgets, request ids; ``STATE_OCCASION`` the loop-state timings a
checkpoint carries for the receipt).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.documents.jsonio import JsonValue

__all__ = ["UNMEASURED", "Difference", "compare_adapters", "compare_checkpoints", "first_field_difference"]

# receipt members that describe the occasion of a run, not what it computed
UNMEASURED = (
    "produced_at",
    "phase_timings",
    "runtime.wall_clock_ms",
    "runtime.peak_host_memory_mib",
    "runtime.peak_vram_mib",
    "runtime.memory_plan.budget_bytes",
    "runtime.memory_plan.budget_source",
    "runtime.memory_plan.serving_copy_bytes",  # a server's serving copy beside the job: the occasion's, like the budget
    "runtime.execution_provenance.configuration",  # where it was configured (home, server settings) ...
    "runtime.execution_provenance.provenance_sha256",  # ... which this digest covers too
    "request_lineage",
    "adapters.output.path",
    "model.path",
    "training_data.path",
    "data.sft_ingestion.source_locator",
    "grpo.online.generation_ms",  # an online run's time shares (an audit replays its rollouts: no generation)
    "grpo.online.scoring_ms",
    "grpo.online.training_ms",
)
# loop-state members that time the run: carried across a resume for the receipt, not computed by it
STATE_OCCASION = ("phase_timings", "writer_timings")
# checkpoint manifest members that describe the occasion
MANIFEST_OCCASION = (
    "created_at",
    "auxiliary_state.execution_provenance.configuration",
    "auxiliary_state.execution_provenance.provenance_sha256",
    "auxiliary_state.training_runtime_planning_identity.effective_memory",
)


@dataclass(frozen=True)
class Difference:
    """The first thing that differs: the file, the tensor or field inside it, and by how much."""

    file: str
    item: str | None = None  # a tensor name or a field path
    published: Any = None
    replayed: Any = None
    max_abs_difference: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "item": self.item,
            "published": _short(self.published),
            "replayed": _short(self.replayed),
            "max_abs_difference": self.max_abs_difference,
        }

    def describe(self) -> str:
        where = self.file + (f" {self.item}" if self.item else "")
        if self.max_abs_difference is not None:
            return f"{where} differs (max abs difference {self.max_abs_difference:.3g})"
        if self.published is None and self.replayed is None:
            return f"{where} differs"
        return f"{where} differs: published {_short(self.published)}, re-executed {_short(self.replayed)}"


def _short(value: Any) -> Any:
    text = json.dumps(value, sort_keys=True)
    return value if len(text) <= 200 else text[:197] + "..."


def first_field_difference(a: Any, b: Any, path: str = "", skip: tuple[str, ...] = ()) -> tuple[str, Any, Any] | None:
    """The first field (dotted path, list positions as numbers) where two JSON values differ, skipping ``skip``."""
    if path in skip:
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if path else key
            if key not in a or key not in b:
                if sub not in skip:
                    return sub, a.get(key), b.get(key)
                continue
            found = first_field_difference(a[key], b[key], sub, skip)
            if found is not None:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            found = first_field_difference(x, y, f"{path}.{index}" if path else str(index), skip)
            if found is not None:
                return found
        return None
    if type(a) is type(b) and a == b:
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return path, a, b


def _tensor_difference(name: str, published: Path, replayed: Path) -> Difference:
    from safetensors.numpy import load_file

    a, b = load_file(str(published)), load_file(str(replayed))
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            return Difference(name, key, key in a, key in b)
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype != y.dtype:
            return Difference(name, key, f"{x.dtype}{list(x.shape)}", f"{y.dtype}{list(y.shape)}")
        if x.tobytes() != y.tobytes():
            gap = float(abs(x.astype("float64") - y.astype("float64")).max()) if x.size else 0.0
            return Difference(name, key, max_abs_difference=gap)
    return Difference(name, "(file metadata)")


def _file_difference(name: str, published: Path, replayed: Path) -> Difference | None:
    if not published.is_file() or not replayed.is_file():
        return Difference(name, None, published.is_file(), replayed.is_file())
    if published.read_bytes() == replayed.read_bytes():
        return None
    if name.endswith(".safetensors"):
        return _tensor_difference(name, published, replayed)
    if name.endswith(".json"):
        found = first_field_difference(_json(published), _json(replayed), skip=STATE_OCCASION)
        return None if found is None else Difference(name, *found)
    return Difference(name)


def _json(path: Path) -> JsonValue:
    return json.loads(path.read_bytes())


def compare_checkpoints(published: Path, replayed: Path) -> Difference | None:
    """The first difference between two checkpoints of one step, or None when they hold the same state."""
    names = sorted({p.name for p in published.iterdir()} | {p.name for p in replayed.iterdir()})
    for name in names:
        if name == "checkpoint_manifest.json":
            continue
        found = _file_difference(name, published / name, replayed / name)
        if found is not None:
            return found
    manifest = "checkpoint_manifest.json"
    # a JSON state file was compared field by field above; its recorded digest and size follow its timings
    timed = tuple(f"files.{n}.{k}" for n in names if n.endswith(".json") for k in ("sha256", "size_bytes"))
    field = first_field_difference(
        _json(published / manifest), _json(replayed / manifest), skip=MANIFEST_OCCASION + timed
    )
    return None if field is None else Difference(manifest, *field)


def compare_adapters(
    published: Path, replayed: Path, files: tuple[str, ...], receipt: str, *, skip: tuple[str, ...] = ()
) -> Difference | None:
    """The first difference between a published adapter and its re-execution: the serving ``files`` byte for byte,
    then the receipt's measured fields."""
    for name in files:
        found = _file_difference(name, published / name, replayed / name)
        if found is not None:
            return found
    field = first_field_difference(_json(published / receipt), _json(replayed / receipt), skip=UNMEASURED + skip)
    return None if field is None else Difference(receipt, *field)
