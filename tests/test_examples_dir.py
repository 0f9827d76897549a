"""The files in examples/ stay valid: docs examples run as tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.contracts import validate_path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TYPES = {
    "sft_request.json": "SftRequest",
    "opd_prompts.json": "OpdRequest",
    "gated_sft_request.json": "SftRequest",
    "online_json_request.json": "GrpoRequest",
}


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.json")), ids=lambda p: p.name)
def test_example_file_is_valid(path):
    report = validate_path(path, doc_type=TYPES.get(path.name))
    assert report.valid, [str(p) for p in report.errors]
