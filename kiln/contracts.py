"""Public entry to every Kiln contract: strict load, problem listing, canonical write.

``load(type, source)``        strict loader for any document type (returns the generated model)
``problems(type, value)``     every problem, without raising
``canonical(type, value)``    the value with canonical numbers: what a caller that keeps or hashes a body stores
``write(type, path, value)``  strict writer: validate, canonical JSON, crash-atomic
``validate_path(path)``       what ``kiln validate`` runs
``document_types()``          the loadable document types and their type tags
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kiln_contracts

import kiln.artifacts  # noqa: F401 - registers every semantic rule the loaders apply
from kiln.documents import pipeline
from kiln.documents.jsonio import read_json_file
from kiln.errors import KilnError, Problem

__all__ = [
    "ValidationReport",
    "canonical",
    "detect_type",
    "document_types",
    "load",
    "problems",
    "render",
    "validate_path",
    "write",
]

load = pipeline.load
write = pipeline.write
render = pipeline.render
detect_type = pipeline.detect_type


def problems(doc_type: str, value: Any, *, reader: bool | None = None) -> list[Problem]:
    return pipeline.problems_of(doc_type, value, reader=reader)


def canonical(doc_type: str, value: Any, *, reader: bool | None = None) -> Any:
    """``value`` with every number spelt as its schema position says (docs/contracts.md, "Numbers"): an integral
    float at an integer position is the int, an int at a number position the float, a number equal to a ``const``
    or ``enum`` member that member. Store or hash this, not the body as sent: ``3.0`` and ``3`` are one value.
    ``value`` itself is never modified. Raises ``ContractError`` (``out_of_range``) where an int at a number position
    is beyond the float range; ``problems`` reports the same."""
    return pipeline.canonical(doc_type, value, reader=reader)


def document_types() -> dict[str, dict[str, Any]]:
    return dict(sorted(kiln_contracts.ENTRYPOINTS.items()))


@dataclass
class ValidationReport:
    valid: bool
    type: str | None
    errors: list[Problem] = field(default_factory=list)
    path: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"valid": self.valid, "type": self.type, "errors": [p.as_dict() for p in self.errors]}


CHECKPOINT_DIRECTORY = "TrainingCheckpoint"  # the report type of a checkpoint directory


def _validate_checkpoint(directory: Path, report_path: Path, report_type: str) -> ValidationReport:
    """The full checkpoint load (what a resume and ``kiln checkpoints verify`` run)."""
    from kiln.checkpoints import error_problems, load_checkpoint
    from kiln.errors import CheckpointError

    try:
        load_checkpoint(directory)
    except CheckpointError as exc:
        return ValidationReport(valid=False, type=report_type, errors=error_problems(exc), path=str(report_path))
    return ValidationReport(valid=True, type=report_type, path=str(report_path))


def validate_path(path: str | os.PathLike[str], *, doc_type: str | None = None) -> ValidationReport:
    """Read ``path``, detect or take its type, and collect every problem.

    A directory is validated as a checkpoint directory; a ``checkpoint_manifest.json`` that
    sits in a checkpoint directory is validated with its directory (the manifest's
    file-scope rules need the files it lists).
    """
    from kiln.checkpoints import parse_checkpoint_name

    p = Path(path)
    if p.is_dir() and doc_type is None:
        return _validate_checkpoint(p, p, CHECKPOINT_DIRECTORY)
    if (
        p.name == "checkpoint_manifest.json"
        and doc_type in (None, "TrainingCheckpointManifest")
        and parse_checkpoint_name(p.parent.name) is not None
    ):
        return _validate_checkpoint(p.parent, p, "TrainingCheckpointManifest")
    try:
        value = read_json_file(p)
        name = doc_type or detect_type(value)
        found = problems(name, value)
    except KilnError as exc:
        found = list(getattr(exc, "problems", None) or [Problem(exc.code, exc.pointer or "", exc.message)])
        return ValidationReport(valid=False, type=doc_type, errors=found, path=str(p))
    return ValidationReport(valid=not found, type=name, errors=found, path=str(p))
