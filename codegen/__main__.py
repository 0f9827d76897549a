"""``python -m codegen [--check] [--schemas DIR] [--out DIR]``."""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from codegen._bundle import (
    SchemaSourceError,
    bundle_definitions,
    load_sources,
    reachable,
    reader_variant,
    writer_variant,
)
from codegen._client import generate_client
from codegen._models import generate_models, module_name
from codegen._openapi import build_openapi

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "kiln_contracts"
TYPE_TAG_FIELDS = ("receipt_type", "manifest_type", "provenance_type", "state_type", "sidecar_type", "schema")
CONTRACTS_VERSION = "1"

INIT_TEMPLATE = '''\
"""Kiln contracts: generated from ``schemas/`` by ``python -m codegen``. Do not edit.

``models``            pydantic v2 models, one module per schema file (the typed view)
``load_bundle()``     all definitions in one self-contained JSON Schema map (strict/writer)
``load_bundle(reader=True)`` the same with the train receipt opened for readers
``ENTRYPOINTS``       loadable documents: definition name -> schema file, module, type tag
``openapi_document()`` the OpenAPI 3.1 document of the HTTP routes
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

SCHEMA_DIGESTS: dict[str, str] = {schema_digests}

__all__ = ["ENTRYPOINTS", "SCHEMA_DIGESTS", "load_bundle", "openapi_document"]


def _read(name: str) -> Any:
    return json.loads(resources.files(__name__).joinpath(name).read_text(encoding="utf-8"))


@cache
def load_bundle(reader: bool = False) -> dict[str, Any]:
    """Return ``{{"$defs": ...}}`` for every definition (``reader=True``: lenient receipt view)."""
    return _read("bundle_reader.json" if reader else "bundle.json")


@cache
def openapi_document() -> dict[str, Any]:
    return _read("openapi.json")


ENTRYPOINTS: dict[str, dict[str, Any]] = _read("entrypoints.json")
'''


def _canonical(value: Any) -> str:
    return json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def _check_acyclic(definitions: dict[str, Any]) -> None:
    def refs_of(node: Any, out: set[str]) -> set[str]:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                out.add(ref[len("#/$defs/") :])
            for value in node.values():
                refs_of(value, out)
        elif isinstance(node, list):
            for value in node:
                refs_of(value, out)
        return out

    graph = {name: refs_of(schema, set()) for name, schema in definitions.items()}
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == 2:
            return
        if state.get(name) == 1:
            raise SchemaSourceError("recursive $ref: " + " -> ".join([*path, name]))
        state[name] = 1
        for target in sorted(graph[name]):
            visit(target, [*path, name])
        state[name] = 2

    for name in sorted(graph):
        visit(name, [])


def _type_tag(schema: dict[str, Any]) -> dict[str, Any] | None:
    props = schema.get("properties", {})
    for field in TYPE_TAG_FIELDS:
        if "const" in props.get(field, {}):
            return {"field": field, "value": props[field]["const"]}
    return None


def _union_root_model(name: str, schema: dict[str, Any], module_text: str) -> str:
    """A RootModel for an entry point that is a union of named definitions.

    ``--collapse-root-models`` inlines such unions where they are used; an entry point
    still needs a class of its own to parse a stand-alone document.
    """
    branches = schema.get("oneOf") or schema.get("anyOf") or []
    names = [b.get("$ref", "").rsplit("/", 1)[-1] for b in branches]
    if not names or not all(n and f"\nclass {n}(" in module_text for n in names):
        raise SchemaSourceError(
            f"no generated class for entry point {name}; make it an object or a union of named definitions"
        )
    union = " | ".join(names)
    doc = " ".join(str(schema.get("description", name)).split())
    return f'\n\nclass {name}(RootModel[{union}]):\n    """{doc}"""\n\n    root: {union}\n'


def _quiet(_: str) -> None:
    pass


def render(schema_dir: Path, say: Callable[[str], None] = _quiet) -> dict[str, str]:
    """Return ``{relative path under generated/: text}`` for the whole generated tree; ``say`` hears each step."""
    say(f"reading the schemas in {schema_dir}")
    docs = load_sources(schema_dir)
    say(f"bundling the definitions of {len(docs)} schema files and building the OpenAPI document")
    digests = {name: "sha256:" + hashlib.sha256((schema_dir / name).read_bytes()).hexdigest() for name in docs}
    definitions, owner = bundle_definitions(docs)
    _check_acyclic(definitions)
    combined = hashlib.sha256("".join(f"{k}={v}\n" for k, v in sorted(digests.items())).encode()).hexdigest()
    stamp = {"generator": "python -m codegen", "schemas": digests}
    files: dict[str, str] = {}
    base = f"{PACKAGE}/"
    files[base + "bundle.json"] = _canonical({"x-kiln-generated": stamp, "$defs": writer_variant(definitions)})
    files[base + "bundle_reader.json"] = _canonical({"x-kiln-generated": stamp, "$defs": reader_variant(definitions)})

    entrypoints: dict[str, Any] = {}
    for file, doc in docs.items():
        for name in doc.get("x-kiln-entrypoints", []):
            if owner.get(name) != file:
                raise SchemaSourceError(f"{file}: entry point {name} is not defined in this file")
            schema = definitions[name]
            open_reader = any(
                isinstance(d, dict) and d.get("x-kiln-reader-policy") == "open"
                for d in reachable(definitions, name).values()
            )
            entrypoints[name] = {
                "schema_file": file,
                "module": module_name(file),
                "type_tag": _type_tag(schema),
                "reader_open": open_reader,
                "closed": schema.get("additionalProperties") is False,
                "semantic_constraints": [c["id"] for c in schema.get("x-kiln-semantic-constraints", [])],
            }
    files[base + "entrypoints.json"] = _canonical(dict(sorted(entrypoints.items())))

    routes: list[dict[str, Any]] = []
    route_files: list[str] = []
    for file, doc in docs.items():
        routes.extend(doc.get("x-kiln-routes", []))
        if doc.get("x-kiln-routes"):
            route_files.append(file)
    openapi = build_openapi(definitions, routes, CONTRACTS_VERSION)
    openapi["x-kiln-generated"] = stamp
    files[base + "openapi.json"] = _canonical(openapi)

    say("generating the typed models (datamodel-code-generator)")
    models = generate_models(docs)
    module_docs = {module_name(name) + ".py": name for name in docs}
    for module_file, text in models.items():
        source = module_docs.get(module_file)
        if source is None:
            raise SchemaSourceError(f"datamodel-codegen produced an unexpected module {module_file}")
        header = (
            f"# Generated by `python -m codegen` from schemas/{source}\n"
            f"# schema digest: {digests[source]}\n"
            "# Do not edit: change the schema or the generator, then regenerate.\n"
        )
        files[base + "models/" + module_file] = header + text
    for name, spec in entrypoints.items():
        key = base + "models/" + spec["module"] + ".py"
        text = files.get(key, "")
        if f"\nclass {name}(" not in text:
            files[key] = text + _union_root_model(name, definitions[name], text)
    say("generating the client")
    model_texts = {spec[: -len(".py")]: files[base + "models/" + spec] for spec in models}
    files[base + "client.py"] = generate_client(routes, route_files, owner, model_texts, digests)
    init_lines = [f'"""Generated pydantic models (schemas set {combined[:16]}). Do not edit."""', ""]
    for module_file in sorted(models):
        init_lines.append(f"from . import {module_file[:-3]}")
    init_lines += ["", "__all__ = [" + ", ".join(f'"{m[:-3]}"' for m in sorted(models)) + "]", ""]
    files[base + "models/__init__.py"] = "# Generated by `python -m codegen`. Do not edit.\n" + "\n".join(init_lines)
    files[base + "__init__.py"] = "# Generated by `python -m codegen`. Do not edit.\n" + INIT_TEMPLATE.format(
        schema_digests=json.dumps(digests, indent=4, sort_keys=True)
    )
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codegen", description="Regenerate generated/ from schemas/.")
    parser.add_argument(
        "--check", action="store_true", help="regenerate in memory; exit 1 with a diff if generated/ is stale"
    )
    parser.add_argument("--schemas", type=Path, default=ROOT / "schemas")
    parser.add_argument("--out", type=Path, default=ROOT / "generated")
    args = parser.parse_args(argv)
    try:
        files = render(args.schemas, lambda step: print(f"codegen: {step}…", file=sys.stderr, flush=True))
    except SchemaSourceError as exc:
        print(f"codegen: {exc}", file=sys.stderr)
        return 2
    existing = (
        {
            str(p.relative_to(args.out)): p.read_text(encoding="utf-8")
            for p in (args.out / PACKAGE).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }
        if (args.out / PACKAGE).exists()
        else {}
    )
    if args.check:
        stale = False
        for rel in sorted(set(files) | set(existing)):
            old, new = existing.get(rel, ""), files.get(rel, "")
            if old != new:
                stale = True
                sys.stdout.writelines(
                    difflib.unified_diff(
                        old.splitlines(True),
                        new.splitlines(True),
                        f"generated/{rel}",
                        f"generated/{rel} (from schemas)",
                    )
                )
        if stale:
            print("codegen: generated/ is stale; run `python -m codegen`", file=sys.stderr)
            return 1
        print(f"codegen: generated/ is up to date ({len(files)} files)")
        return 0
    for rel in set(existing) - set(files):
        (args.out / rel).unlink()
    for rel, text in files.items():
        path = args.out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if existing.get(rel) != text:
            path.write_text(text, encoding="utf-8")
    print(f"codegen: wrote {len(files)} files under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
