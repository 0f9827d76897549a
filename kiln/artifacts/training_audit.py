"""Training audit record (``kiln.training-audit.v1``): what ``kiln audit`` re-executed and found.

``load_training_audit`` (strict: schema, numbers, the rules below, typed model) and ``write_training_audit``
(canonical JSON, atomic). The rules bind the verdict to what backs it: ``not_reproduced`` exactly when a first
difference is named and some segment is not reproduced, ``cannot_audit`` exactly when its reason is given,
``reproduced`` only with a reproduced segment; a seed exactly for a spot check. The audit request
(``POST /v1/audits``) takes a seed only with segments.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kiln.documents import pipeline
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

DOC = "TrainingAudit"
SCHEMA = "kiln.training-audit.v1"

__all__ = ["DOC", "SCHEMA", "load_training_audit", "write_training_audit"]


@semantic_rule(DOC, "training-audit.verdict")
def _verdict(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    verdict, outcomes = doc["verdict"], [s["outcome"] for s in doc["segments"]]
    differs = "not_reproduced" in outcomes
    if (verdict == "not_reproduced") != (doc["first_difference"] is not None):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "first_difference"),
            f"verdict {verdict!r} with first_difference {'set' if doc['first_difference'] else 'null'}: only "
            "not_reproduced names a first difference, and it always does",
        )
    elif (verdict == "not_reproduced") != differs:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "segments"),
            f"verdict {verdict!r} but {'a' if differs else 'no'} segment is not_reproduced",
        )
    if (verdict == "cannot_audit") != (doc["cannot_audit"] is not None):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "cannot_audit"),
            f"verdict {verdict!r} with cannot_audit {'set' if doc['cannot_audit'] else 'null'}: only cannot_audit "
            "gives a reason, and it always does",
        )
    if verdict == "reproduced" and "reproduced" not in outcomes:
        yield Problem("inconsistent_fields", ptr(at, "segments"), "verdict 'reproduced' but no segment is reproduced")


@semantic_rule(DOC, "training-audit.mode")
def _mode(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if (doc["mode"] == "spot_check") != (doc["seed"] is not None):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "seed"),
            f"mode {doc['mode']!r} with seed {doc['seed']!r}: a spot check records its seed, a full audit has none",
        )


@semantic_rule("AuditRequest", "audit-request.seed")
def _request_seed(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if doc.get("seed") is not None and doc.get("segments") is None:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "seed"),
            "seed draws spot-check segments; give segments with it (a full audit draws nothing)",
        )


def load_training_audit(source: pipeline.Source) -> Any:
    return pipeline.load(DOC, source)


def write_training_audit(path: str | os.PathLike[str], record: Any) -> Path:
    return pipeline.write(DOC, path, record)
