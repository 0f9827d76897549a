"""Codegen: generated/ is a fresh build product, stamped, and the source rules are enforced."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from codegen import __main__ as codegen_main
from codegen._bundle import SchemaSourceError, bundle_definitions, load_sources

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated" / "kiln_contracts"


def test_generated_tree_is_up_to_date(capsys):
    assert codegen_main.main(["--check"]) == 0, capsys.readouterr().out


def test_a_hand_edit_to_generated_code_is_caught_with_a_diff(tmp_path, capsys):
    out = tmp_path / "generated"
    shutil.copytree(ROOT / "generated", out, ignore=shutil.ignore_patterns("__pycache__"))
    module = out / "kiln_contracts" / "models" / "kiln_common_v1_schema.py"
    module.write_text(module.read_text(encoding="utf-8") + "\n# hand edit\n", encoding="utf-8")
    assert codegen_main.main(["--check", "--out", str(out)]) == 1
    assert "-# hand edit" in capsys.readouterr().out


def test_every_generated_model_names_its_schema_and_digest():
    for path in sorted((GENERATED / "models").glob("kiln_*.py")):
        head = path.read_text(encoding="utf-8").splitlines()[:3]
        source = head[0].rsplit("schemas/", 1)[1]
        digest = "sha256:" + hashlib.sha256((ROOT / "schemas" / source).read_bytes()).hexdigest()
        assert head[1] == f"# schema digest: {digest}", path.name
        assert "Do not edit" in head[2]
    bundle = json.loads((GENERATED / "bundle.json").read_text(encoding="utf-8"))
    assert set(bundle["x-kiln-generated"]["schemas"]) == {p.name for p in (ROOT / "schemas").glob("*.schema.json")}


def _schema_dir(tmp_path, defs, *, extra=None):
    d = tmp_path / "schemas"
    d.mkdir()
    doc = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://schemas.kiln.dev/v1/kiln-test-v1.schema.json",
        "$defs": defs,
        **(extra or {}),
    }
    (d / "kiln-test-v1.schema.json").write_text(json.dumps(doc), encoding="utf-8")
    return d


@pytest.mark.parametrize(
    ("defs", "message"),
    [
        ({"A": {"type": "object", "unevaluatedProperties": False}}, "outside the allowed subset"),
        ({"A": {"type": "string", "pattern": "^(?!x)"}}, "look-around"),
        ({"A": {"if": {"type": "string"}}}, "outside the allowed subset"),
        ({"A": {"$ref": "#/definitions/B"}}, "unsupported \\$ref"),
    ],
)
def test_schema_sources_outside_the_subset_are_refused(tmp_path, defs, message):
    with pytest.raises(SchemaSourceError, match=message):
        load_sources(_schema_dir(tmp_path, defs))


def test_recursive_references_are_refused(tmp_path):
    d = _schema_dir(tmp_path, {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}})
    assert codegen_main.main(["--schemas", str(d), "--out", str(tmp_path / "out")]) == 2


def test_dangling_references_are_refused(tmp_path):
    docs = load_sources(_schema_dir(tmp_path, {"A": {"$ref": "kiln-other-v1.schema.json#/$defs/B"}}))
    with pytest.raises(SchemaSourceError, match="unknown schema file"):
        bundle_definitions(docs)
