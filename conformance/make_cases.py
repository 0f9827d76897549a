"""Regenerate ``cases/schema-mutations.json`` and ``cases/examples.json`` from ``schemas/``.

    python -m conformance.make_cases [--check]

For every example of every entry point, and for every closed object inside it, one case per
mutation class: unknown field, wrong const, wrong type, null where not nullable, absent
required. The expected code and pointer follow from the schema alone, not from the loader.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

import kiln_contracts

ROOT = Path(__file__).resolve().parent.parent
CASES = Path(__file__).resolve().parent / "cases"
TAG_FIELDS = ("receipt_type", "manifest_type", "provenance_type", "state_type", "sidecar_type", "schema")
UNKNOWN_KEY = "x_kiln_conformance_unknown"
WRONG_VALUES = {"string": 12345, "integer": "12345", "number": "1.5", "boolean": "true", "object": [], "array": {}}


def _deref(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema and len(schema) >= 1:
        schema = defs[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _nullable_inner(schema: dict[str, Any], defs: dict[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """(accepts null, the single non-null branch if the schema is X or [X, null])."""
    schema = _deref(schema, defs)
    union = schema.get("anyOf") or schema.get("oneOf")
    if union and "properties" not in schema:
        branches = [_deref(b, defs) for b in union]
        nulls = [b for b in branches if b.get("type") == "null"]
        rest = [b for b in branches if b.get("type") != "null"]
        return bool(nulls), (rest[0] if len(rest) == 1 else None)
    t = schema.get("type")
    if t == "null" or (isinstance(t, list) and "null" in t):
        return True, None
    if not schema or set(schema) <= {"description", "title"}:
        return True, None  # AnyJson accepts everything
    return False, schema


def _simple_type(schema: dict[str, Any] | None, defs: dict[str, Any]) -> str | None:
    if schema is None:
        return None
    schema = _deref(schema, defs)
    if any(k in schema for k in ("anyOf", "oneOf", "allOf", "not", "enum", "const")):
        return None
    t = schema.get("type")
    return t if isinstance(t, str) and t in WRONG_VALUES else None


def _pointer(parts: list[Any]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _get(doc: Any, parts: list[Any]) -> Any:
    for p in parts:
        doc = doc[p]
    return doc


def _objects(value: Any, schema: dict[str, Any], defs: dict[str, Any], path: list[Any]):
    """Yield (path, object schema) for every object instance governed by a plain object schema.

    ``X | null`` unions are followed into ``X``; other unions are left to the properties.
    """
    schema = _deref(schema, defs)
    if "properties" not in schema:
        union = schema.get("anyOf") or schema.get("oneOf")
        if union:
            rest = [b for b in (_deref(b, defs) for b in union) if b.get("type") != "null"]
            if value is not None and len(rest) == 1:
                yield from _objects(value, rest[0], defs, path)
            return
    if isinstance(value, dict) and "properties" in schema:
        yield path, schema
        for key, sub in schema["properties"].items():
            if key in value:
                yield from _objects(value[key], sub, defs, [*path, key])
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key in sorted(value):
            yield from _objects(value[key], schema["additionalProperties"], defs, [*path, key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value[:1]):
            yield from _objects(item, schema["items"], defs, [*path, index])


def mutations(doc_type: str, example: Any, defs: dict[str, Any], reader_open: bool) -> list[dict[str, Any]]:
    cases = []
    root = defs[doc_type]

    def case(rule: str, description: str, instance: Any, code: str, pointer: str, mode: str = "read") -> None:
        cases.append(
            {
                "description": description,
                "rule": rule,
                "type": doc_type,
                "mode": mode,
                "instance": instance,
                "valid": False,
                "error_code": code,
                "pointer": pointer,
            }
        )

    for path, schema in _objects(example, root, defs, []):
        where = _pointer(path) or "/"
        obj = _get(example, path)
        closed = schema.get("additionalProperties") is False
        props = schema["properties"]
        required = [k for k in schema.get("required", []) if k in obj]
        if closed:
            m = copy.deepcopy(example)
            _get(m, path)[UNKNOWN_KEY] = 1
            opened = reader_open and schema.get("x-kiln-reader-policy") == "open"
            if opened:
                cases.append(
                    {
                        "description": f"{doc_type}: readers ignore an unknown field in {where}",
                        "rule": "mutation.unknown-field-reader",
                        "type": doc_type,
                        "mode": "read",
                        "instance": m,
                        "valid": True,
                        "error_code": None,
                    }
                )
            case(
                "mutation.unknown-field",
                f"{doc_type}: unknown field in closed object {where}",
                m,
                "unknown_field",
                _pointer([*path, UNKNOWN_KEY]),
                mode="write" if opened else "read",
            )
        for key in sorted(props):
            if key in obj and "const" in _deref(props[key], defs):
                const = _deref(props[key], defs)["const"]
                m = copy.deepcopy(example)
                _get(m, path)[key] = (
                    (const + 1) if isinstance(const, int) and not isinstance(const, bool) else f"{const}-other"
                )
                code = "wrong_const"
                if not path and key == "schema_version":
                    code = "unsupported_schema_version"
                elif not path and key in TAG_FIELDS:
                    code = "wrong_type_tag"
                case(
                    "mutation.wrong-const",
                    f"{doc_type}: wrong constant {key} in {where}",
                    m,
                    code,
                    _pointer([*path, key]),
                )
                break
        for key in sorted(props):
            if key not in obj:
                continue
            nullable, inner = _nullable_inner(props[key], defs)
            t = _simple_type(inner, defs)
            if t is not None:
                m = copy.deepcopy(example)
                _get(m, path)[key] = WRONG_VALUES[t]
                case(
                    "mutation.wrong-type",
                    f"{doc_type}: wrong type for {key} in {where}",
                    m,
                    "wrong_type",
                    _pointer([*path, key]),
                )
                break
        for key in sorted(required):
            nullable, inner = _nullable_inner(props[key], defs)
            if not nullable and inner is not None:
                m = copy.deepcopy(example)
                _get(m, path)[key] = None
                case(
                    "mutation.null-not-nullable",
                    f"{doc_type}: null for non-nullable {key} in {where}",
                    m,
                    "null_not_allowed",
                    _pointer([*path, key]),
                )
                break
        for key in sorted(required):
            m = copy.deepcopy(example)
            del _get(m, path)[key]
            writer_only = key in schema.get("x-kiln-writer-required", [])
            case(
                "mutation.absent-required",
                f"{doc_type}: required {key} absent in {where}" + (" (writers must write it)" if writer_only else ""),
                m,
                "missing_field",
                _pointer([*path, key]),
                mode="write" if writer_only else "read",
            )
            break
    return cases


def build(schema_dir: Path = ROOT / "schemas") -> dict[str, str]:
    defs = kiln_contracts.load_bundle()["$defs"]
    examples, mutated = [], []
    for path in sorted(schema_dir.glob("*.schema.json")):
        doc = json.loads(path.read_text(encoding="utf-8"))
        for doc_type in doc.get("x-kiln-entrypoints", []):
            entry = kiln_contracts.ENTRYPOINTS[doc_type]
            for index, example in enumerate(doc.get("x-kiln-examples", {}).get(doc_type, [])):
                examples.append(
                    {
                        "description": f"{doc_type}: schema example {index}",
                        "rule": "example.valid",
                        "type": doc_type,
                        "mode": "read",
                        "instance": example,
                        "valid": True,
                        "error_code": None,
                    }
                )
                if index == 0:
                    mutated.extend(mutations(doc_type, example, defs, entry["reader_open"]))
    return {
        "examples.json": json.dumps(examples, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
        "schema-mutations.json": json.dumps(mutated, indent=1, sort_keys=True, ensure_ascii=False) + "\n",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conformance.make_cases")
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed case files are stale")
    parser.add_argument("--schemas", type=Path, default=ROOT / "schemas")
    args = parser.parse_args(argv)
    files = build(args.schemas)
    stale = [
        n for n, text in files.items() if not (CASES / n).exists() or (CASES / n).read_text(encoding="utf-8") != text
    ]
    if args.check:
        for n in stale:
            print(f"conformance/cases/{n} is stale; run `python -m conformance.make_cases`", file=sys.stderr)
        return 1 if stale else 0
    CASES.mkdir(exist_ok=True)
    for n, text in files.items():
        (CASES / n).write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} case files: " + ", ".join(f"{n} ({len(json.loads(t))} cases)" for n, t in files.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
