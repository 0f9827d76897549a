"""The typed models agree with the JSON Schema layer on the conformance cases.

The schema layer is the validator; the generated models are the typed view. They must
never contradict each other: every valid case parses into its model, and every
structural mutation the models can express (unknown field, wrong type -- strings are
never coerced to numbers --, wrong constant, absent required field, null) is refused by
the model too. The one known gap is documented in docs/contracts.md: a field that
readers tolerate as absent (``x-kiln-writer-required``) is ``X | None`` in the typed view.
"""

from __future__ import annotations

import json
from pathlib import Path

import kiln_contracts
import pytest
from pydantic import ValidationError

from kiln.documents import validation

CASES = Path(__file__).resolve().parent / "cases"
ALL = [c for p in sorted(CASES.glob("*.json")) for c in json.loads(p.read_text(encoding="utf-8"))]
DEFS = kiln_contracts.load_bundle()["$defs"]


def _writer_only_fields() -> set[str]:
    return {f for d in DEFS.values() if isinstance(d, dict) for f in d.get("x-kiln-writer-required", [])}


def test_every_valid_case_parses_into_its_model():
    for case in ALL:
        if case["valid"]:
            validation.model_class(case["type"]).model_validate(case["instance"])


@pytest.mark.parametrize(
    "rule",
    [
        "mutation.unknown-field",
        "mutation.wrong-type",
        "mutation.wrong-const",
        "mutation.absent-required",
        "mutation.null-not-nullable",
    ],
)
def test_structural_mutations_are_refused_by_the_model_too(rule):
    writer_only = _writer_only_fields()
    accepted = []
    for case in ALL:
        if case["rule"] != rule or case["valid"] or case.get("mode") != "read":
            continue
        if rule == "mutation.null-not-nullable" and case["pointer"].rsplit("/", 1)[1] in writer_only:
            continue
        try:
            validation.model_class(case["type"]).model_validate(case["instance"])
        except ValidationError:
            continue
        accepted.append(case["description"])
    assert not accepted, accepted
