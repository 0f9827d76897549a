"""Every case file under ``cases/`` runs through the real strict loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln import contracts
from kiln.errors import ContractError

CASES_DIR = Path(__file__).resolve().parent / "cases"
CASES = [
    pytest.param(case, id=f"{path.stem}:{index}:{case['rule']}")
    for path in sorted(CASES_DIR.glob("*.json"))
    for index, case in enumerate(json.loads(path.read_text(encoding="utf-8")))
]


def _run(case):
    if case.get("mode") == "write":
        return contracts.render(case["type"], case["instance"])
    return contracts.load(case["type"], case["instance"])


@pytest.mark.parametrize("case", CASES)
def test_case_outcome_matches_its_declaration(case):
    if case["valid"]:
        _run(case)
        return
    with pytest.raises(ContractError) as info:
        _run(case)
    found = {(p.code, p.pointer) for p in info.value.problems}
    codes = {p.code for p in info.value.problems}
    assert case["error_code"] in codes, f"{case['description']}: expected {case['error_code']}, got {sorted(found)}"
    if "pointer" in case:
        assert (case["error_code"], case["pointer"]) in found, f"{case['description']}: got {sorted(found)}"


def test_case_files_are_well_formed():
    keys = {"description", "rule", "type", "instance", "valid", "error_code"}
    for param in CASES:
        case = param.values[0]
        assert keys <= set(case), case.get("description")
        assert isinstance(case["valid"], bool)
        assert (case["error_code"] is None) == case["valid"]
