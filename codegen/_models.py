"""Run datamodel-code-generator over a prepared copy of the schemas."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

DATAMODEL_ARGS = [
    "--input-file-type",
    "jsonschema",
    "--output-model-type",
    "pydantic_v2.BaseModel",
    "--use-annotated",
    "--field-constraints",
    "--strict-types",  # no coercion: "1" is not an int, "1.5" is not a float (a JSON 1 is still a float)
    "str",
    "int",
    "float",
    "bool",
    "--use-double-quotes",
    "--target-python-version",
    "3.11",
    "--disable-timestamp",
    "--use-schema-description",
    "--use-field-description",
    "--formatters",
    "ruff-format",
    "--collapse-root-models",
    "--strict-nullable",  # a field with a default is not Optional unless the schema says it may be null
    "--set-default-enum-member",  # an enum field's default is its member, so a typed reader sees one type
]

_APPLICATORS = ("anyOf", "oneOf", "allOf", "not")


def _constraint_only(branch: Any, own_properties: set[str]) -> bool:
    """A branch that only restricts the enclosing object's own fields (no new shape)."""
    if not isinstance(branch, dict) or "type" in branch or "$ref" in branch:
        return False
    if not set(branch.get("properties", {})) <= own_properties:
        return False
    nested = [
        b
        for key in _APPLICATORS
        for b in (branch[key] if isinstance(branch.get(key), list) else [branch[key]] if key in branch else [])
    ]
    return all(_constraint_only(b, own_properties) for b in nested)


def module_name(schema_file: str) -> str:
    """``kiln-artifacts-v1.schema.json`` -> ``kiln_artifacts_v1_schema`` (datamodel-codegen's rule)."""
    return schema_file.removesuffix(".json").replace("-", "_").replace(".", "_")


def _prepare(node: Any) -> Any:
    """Shape a schema for the typed view.

    * ``format`` is dropped: timestamps stay strings so a round trip keeps their text
      (the JSON Schema validator still checks the format);
    * objects that do not close themselves, and objects opened for readers, get
      ``additionalProperties: true`` so that the model keeps unknown members
      (pydantic would otherwise silently drop them);
    * examples are dropped (they are data, not types);
    * a ``null`` default is dropped: every optional field of the typed view already
      defaults to None, and the generator would otherwise push it into the root model of
      an inline ``anyOf`` branch (``root: float = None``);
    * applicators that only restrict an object's own fields (``oneOf`` of required sets,
      ``not``) are dropped: they are validation, which the JSON Schema layer does, and
      the generator would otherwise turn them into spurious model variants.
    """
    if isinstance(node, dict):
        out = {}
        own = set(node.get("properties", {})) if isinstance(node.get("properties"), dict) else None
        for key, value in node.items():
            if key in ("format", "x-kiln-examples") or (key == "default" and value is None):
                continue
            if own is not None and key in _APPLICATORS:
                branches = value if isinstance(value, list) else [value]
                if all(_constraint_only(b, own) for b in branches):
                    continue  # a cross-field rule: the JSON Schema validator enforces it
            out[key] = _prepare(value)
        is_object = out.get("type") == "object" or "properties" in out
        if is_object and (out.get("x-kiln-reader-policy") == "open" or "additionalProperties" not in out):
            out["additionalProperties"] = True
        return out
    if isinstance(node, list):
        return [_prepare(value) for value in node]
    return node


def generate_models(docs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Return ``{module file name: source text}`` (without our header)."""
    with tempfile.TemporaryDirectory(prefix="kiln-codegen-") as tmp:
        src, out = Path(tmp, "in"), Path(tmp, "out")
        src.mkdir()
        for name, doc in docs.items():
            prepared = _prepare(copy.deepcopy(doc))
            (src / name).write_text(json.dumps(prepared, indent=2, sort_keys=True), encoding="utf-8")
        cmd = [
            sys.executable,
            "-m",
            "datamodel_code_generator",
            "--input",
            str(src),
            "--output",
            str(out),
            *DATAMODEL_ARGS,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"datamodel-codegen failed:\n{proc.stdout}\n{proc.stderr}")
        result = {}
        for path in sorted(out.glob("*.py")):
            if path.name == "__init__.py":
                continue
            lines = path.read_text(encoding="utf-8").splitlines()
            while lines and (lines[0].startswith("#") or not lines[0].strip()):
                lines.pop(0)
            result[path.name] = "\n".join(lines) + "\n"
        return result
