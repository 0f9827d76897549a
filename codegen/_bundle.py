"""Read the schema files and fold them into one self-contained definition map."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

SCHEMA_SUFFIX = ".schema.json"
DIALECT = "https://json-schema.org/draft/2020-12/schema"
FORBIDDEN_KEYWORDS = frozenset(
    {
        "unevaluatedProperties",
        "unevaluatedItems",
        "prefixItems",
        "dependentSchemas",
        "$dynamicRef",
        "$dynamicAnchor",
        "$recursiveRef",
        "if",
        "then",
        "else",
    }
)
# the one extension keyword for defaults: a default chosen by another field of the same object
DEFAULT_BY = "x-kiln-default-by"


class SchemaSourceError(Exception):
    """A schema file breaks one of the rules in docs/schemas.md."""


def _check_default_by(prop: dict[str, Any], siblings: set[str], where: str) -> None:
    """``x-kiln-default-by``: a default chosen by a sibling field (docs/schemas.md, rule 12)."""
    rule = prop[DEFAULT_BY]
    if "default" in prop:
        raise SchemaSourceError(f"{where}: a property has either default or {DEFAULT_BY}, not both")
    if not isinstance(rule, dict) or set(rule) != {"pointer", "defaults"}:
        raise SchemaSourceError(f"{where}: {DEFAULT_BY} takes exactly the members pointer and defaults")
    pointer, defaults = rule["pointer"], rule["defaults"]
    if not isinstance(pointer, str) or not pointer.startswith("/") or pointer[1:].split("/")[0] not in siblings:
        raise SchemaSourceError(f"{where}: {DEFAULT_BY} pointer {pointer!r} must start at a sibling property")
    if not isinstance(defaults, dict) or not defaults:
        raise SchemaSourceError(f"{where}: {DEFAULT_BY} defaults must map each value of {pointer} to a default")


def file_digest(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def load_sources(schema_dir: Path) -> dict[str, dict[str, Any]]:
    """Return ``{file name: parsed schema}`` for every ``*.schema.json`` file, sorted."""
    docs: dict[str, dict[str, Any]] = {}
    for path in sorted(schema_dir.glob("*" + SCHEMA_SUFFIX)):
        doc = json.loads(path.read_text(encoding="utf-8"))
        if doc.get("$schema") != DIALECT:
            raise SchemaSourceError(f"{path.name}: must declare $schema {DIALECT}")
        if not str(doc.get("$id", "")).endswith("/" + path.name):
            raise SchemaSourceError(f"{path.name}: $id must end with /{path.name}")
        _check_keywords(doc, path.name, "")
        docs[path.name] = doc
    if not docs:
        raise SchemaSourceError(f"no schema files in {schema_dir}")
    return docs


def _check_keywords(node: Any, file: str, pointer: str) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in FORBIDDEN_KEYWORDS:
                raise SchemaSourceError(f"{file}#{pointer}/{key}: keyword outside the allowed subset")
            if key == "pattern" and isinstance(value, str):
                for bad in ("(?=", "(?!", "(?<=", "(?<!"):
                    if bad in value:
                        raise SchemaSourceError(f"{file}#{pointer}: look-around in pattern {value!r}")
            if key == "$ref" and isinstance(value, str):
                _split_ref(value, file)
            if key == "properties" and isinstance(value, dict):
                for name, prop in value.items():
                    if isinstance(prop, dict) and DEFAULT_BY in prop:
                        _check_default_by(prop, set(value), f"{file}#{pointer}/properties/{name}")
            _check_keywords(value, file, f"{pointer}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            _check_keywords(value, file, f"{pointer}/{index}")


def _split_ref(ref: str, current_file: str) -> tuple[str, str]:
    """Split ``[file]#/$defs/Name`` into ``(file, Name)``."""
    target, _, fragment = ref.partition("#")
    if not fragment.startswith("/$defs/") or fragment.count("/") != 2:
        raise SchemaSourceError(f"{current_file}: unsupported $ref {ref!r} (use [file]#/$defs/Name)")
    return (target or current_file), fragment[len("/$defs/") :]


def _rewrite_refs(node: Any, current_file: str, seen: list[tuple[str, str]]) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                target_file, name = _split_ref(value, current_file)
                seen.append((target_file, name))
                out[key] = f"#/$defs/{name}"
            else:
                out[key] = _rewrite_refs(value, current_file, seen)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(value, current_file, seen) for value in node]
    return node


def bundle_definitions(docs: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """Fold all ``$defs`` of all files into one map with local refs.

    Returns ``(definitions, owner)`` where ``owner[name]`` is the schema file defining ``name``.
    Definition names must be unique across files.
    """
    definitions: dict[str, Any] = {}
    owner: dict[str, str] = {}
    refs: list[tuple[str, str, str]] = []
    for file, doc in docs.items():
        for name, schema in doc.get("$defs", {}).items():
            if name in definitions:
                raise SchemaSourceError(f"definition {name!r} is defined in both {owner[name]} and {file}")
            seen: list[tuple[str, str]] = []
            definitions[name] = _rewrite_refs(schema, file, seen)
            owner[name] = file
            refs.extend((file, target_file, target) for target_file, target in seen)
    for file, target_file, target in refs:
        if target_file not in docs:
            raise SchemaSourceError(f"{file}: $ref into unknown schema file {target_file!r}")
        if owner.get(target) != target_file:
            raise SchemaSourceError(f"{file}: $ref to {target_file}#/$defs/{target} does not resolve")
    return definitions, owner


def _transformed(definitions: dict[str, Any], change: Any) -> dict[str, Any]:
    """A deep copy of ``definitions`` with ``change(node)`` applied to every schema object."""
    out = copy.deepcopy(definitions)
    stack: list[Any] = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            change(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def writer_variant(definitions: dict[str, Any]) -> dict[str, Any]:
    """Add ``x-kiln-writer-required`` fields to ``required``: always written, tolerated as missing on read."""

    def change(node: dict[str, Any]) -> None:
        extra = node.get("x-kiln-writer-required")
        if extra:
            required = node.get("required", [])
            node["required"] = [*required, *[f for f in extra if f not in required]]

    return _transformed(definitions, change)


def reader_variant(definitions: dict[str, Any]) -> dict[str, Any]:
    """Open every object marked ``x-kiln-reader-policy: open`` (the train receipt's own objects)."""

    def change(node: dict[str, Any]) -> None:
        if node.get("x-kiln-reader-policy") == "open":
            node.pop("additionalProperties", None)

    return _transformed(definitions, change)


def reachable(definitions: dict[str, Any], root: str) -> dict[str, Any]:
    """The definitions reachable from ``root`` (``root`` included), in name order."""
    todo, found = [root], set()
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        stack = [definitions[name]]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref.startswith("#/$defs/"):
                    todo.append(ref[len("#/$defs/") :])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return {name: definitions[name] for name in sorted(found)}
