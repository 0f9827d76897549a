"""Every semantic constraint the schemas declare is enforced and exercised.

* a ``document``-scope constraint has a registered rule under its id, or lists in
  ``enforced_by`` the registered rules of embedded definitions that cover it;
* every such constraint has at least one invalid conformance case;
* no rule is registered under an id the schemas do not declare;
* the generated case files are up to date with ``schemas/``.
"""

from __future__ import annotations

import json
from pathlib import Path

import kiln_contracts

import kiln.artifacts  # noqa: F401 - registers every rule
from conformance import make_cases
from kiln.documents.rules import registered_ids

CASES = Path(__file__).resolve().parent / "cases"


def _declared():
    for name, schema in kiln_contracts.load_bundle()["$defs"].items():
        for constraint in schema.get("x-kiln-semantic-constraints", []):
            yield name, constraint


def _registered():
    return registered_ids()


def test_every_document_constraint_is_enforced_by_a_rule():
    ids = {rule_id for _, rule_id in _registered()}
    missing = []
    for name, constraint in _declared():
        if constraint.get("scope", "document") != "document":
            continue
        covered = constraint["id"] in ids or (constraint.get("enforced_by") and set(constraint["enforced_by"]) <= ids)
        if not covered:
            missing.append(f"{name}: {constraint['id']}")
    assert not missing, missing


def test_no_rule_is_registered_under_an_undeclared_id():
    declared = {c["id"] for _, c in _declared()}
    undeclared = sorted(rule_id for _, rule_id in _registered() if rule_id not in declared)
    assert not undeclared, undeclared


def test_every_document_constraint_has_an_invalid_case():
    rules = {
        case["rule"]
        for path in CASES.glob("semantic-*.json")
        for case in json.loads(path.read_text(encoding="utf-8"))
        if not case["valid"]
    }
    uncovered = sorted(
        c["id"] for _, c in _declared() if c.get("scope", "document") == "document" and c["id"] not in rules
    )
    assert not uncovered, uncovered


def test_generated_case_files_are_up_to_date():
    for name, text in make_cases.build().items():
        assert (CASES / name).read_text(encoding="utf-8") == text, f"run `python -m conformance.make_cases` ({name})"
