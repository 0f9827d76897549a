"""The load / validate / write engine shared by every artifact module.

load:  strict JSON -> schema (jsonschema-rs) -> canonical numbers -> semantic rules -> generated pydantic model
write: model or dict -> canonical numbers -> strict (writer) schema -> semantic rules -> canonical JSON -> atomic rename

Numbers are canonical (``kiln.documents.numbers``) wherever a document is judged past its schema, modelled or written, so the
problem listing, the loader and every writer agree on one value for ``3``, ``3.0`` and ``3e0``.
"""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path
from typing import Any

import kiln_contracts
from pydantic import BaseModel, ValidationError

from kiln.documents import numbers, validation
from kiln.documents.jsonio import canonical_json, parse_json, read_json_file
from kiln.documents.rules import RULES, ptr, require_complete
from kiln.errors import ContractError, IntegrityError, Problem, UnknownDocumentTypeError
from kiln.host.fs import atomic_write_bytes

Source = bytes | str | os.PathLike[str] | dict[str, Any] | list[Any]


def read_source(source: Source, *, document: str | None = None) -> tuple[Any, str | None]:
    """Turn a path, bytes, text or already-parsed value into a JSON value (a parsed scalar -- null, a number, a
    boolean -- is itself: the schema refuses it, never a ``TypeError``)."""
    if isinstance(source, (dict, list)) or source is None or isinstance(source, (bool, int, float)):
        return source, document
    if isinstance(source, os.PathLike):
        return read_json_file(source), document or str(source)
    return parse_json(source, source=document), document


def _occurrences(definitions: dict[str, Any], name: str, value: Any, at: str, out: list[tuple[str, Any, str]]) -> None:
    """Collect ``(definition, value, pointer)`` for every definition the value passes through."""
    schema = definitions[name]
    out.append((name, value, at))
    _walk(definitions, schema, value, at, out)


def _walk(definitions: dict[str, Any], schema: Any, value: Any, at: str, out: list[tuple[str, Any, str]]) -> None:
    if not isinstance(schema, dict) or not _leads_to_rules(schema):
        return
    ref = schema.get("$ref")
    if isinstance(ref, str):
        _occurrences(definitions, ref.rsplit("/", 1)[1], value, at, out)
        return
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key, ()):
            if value is None:
                break
            if _leads_to_rules(branch) and validation.fragment_valid(branch, value):
                _walk(definitions, branch, value, at, out)
                break
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            sub = props.get(k, extra if isinstance(extra, dict) else None)
            if sub is not None and _leads_to_rules(sub):
                _walk(definitions, sub, v, ptr(at, k), out)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict) and _leads_to_rules(schema["items"]):
        for i, v in enumerate(value):
            _walk(definitions, schema["items"], v, ptr(at, i), out)


_LEADS: dict[int, bool] = {}


def _leads_to_rules(schema: Any) -> bool:
    """Whether a schema node (of the cached bundle) can reach a definition that has rules."""
    key = id(schema)
    known = _LEADS.get(key)
    if known is None:
        refs: list[str] = []
        stack = [schema]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                if isinstance(node.get("$ref"), str):
                    refs.append(node["$ref"].rsplit("/", 1)[1])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
        known = _LEADS[key] = any(_has_rules_below(r) for r in refs)
    return known


@cache
def _has_rules_below(name: str) -> bool:
    require_complete()
    return any(d in RULES for d in validation.reachable_definitions(name))


def semantic_problems(name: str, value: Any) -> list[Problem]:
    """Run the semantic rules of every definition in the document; integrity failures raise at once."""
    require_complete()
    if not _has_rules_below(name):
        return []
    occurrences: list[tuple[str, Any, str]] = []
    _occurrences(kiln_contracts.load_bundle()["$defs"], name, value, "", occurrences)
    problems: list[Problem] = []
    for definition, sub, at in occurrences:
        for rule in RULES.get(definition, ()):
            found = list(rule.fn(sub, at))
            if found and rule.integrity:
                raise IntegrityError(found)
            problems.extend(found)
    return problems


def _reads_open(name: str, reader: bool | None) -> bool:
    """Whether ``name`` is judged by its reader bundle (``reader`` None: the entry point's own policy)."""
    return bool(validation.entrypoint(name)["reader_open"]) if reader is None else reader


def canonical(name: str, value: Any, *, reader: bool | None = None) -> Any:
    """``value`` with every number in the canonical form of its schema position (``kiln.documents.numbers``)."""
    return numbers.canonical(name, value, reader=_reads_open(name, reader))


def problems_of(name: str, value: Any, *, reader: bool | None = None) -> list[Problem]:
    """All problems of ``value`` as a ``name`` document, without raising (integrity included).

    The semantic rules judge the canonical value, exactly as ``load`` does."""
    use_reader = _reads_open(name, reader)
    problems = validation.schema_problems(name, value, reader=use_reader)
    if problems:
        return problems
    try:
        return semantic_problems(name, numbers.canonical(name, value, reader=use_reader))
    except ContractError as exc:  # out_of_range numbers, or an integrity rule
        return exc.problems


def load(name: str, source: Source, *, reader: bool | None = None, document: str | None = None) -> Any:
    """Strictly load a document of type ``name`` and return its generated model."""
    value, document = read_source(source, document=document)
    use_reader = _reads_open(name, reader)
    validation.check_schema(name, value, reader=use_reader, document=document)
    value = numbers.canonical(name, value, reader=use_reader, document=document)
    problems = semantic_problems(name, value)
    if problems:
        raise ContractError(problems, document=document)
    return to_model(name, value, document=document)


def to_model(name: str, value: Any, *, document: str | None = None) -> Any:
    cls = validation.model_class(name)
    try:
        return cls.model_validate(value)
    except ValidationError as exc:  # the schema accepted what the model refuses: a contract bug
        first = exc.errors()[0]
        pointer = "".join(f"/{p}" for p in first.get("loc", ()))
        raise ContractError(
            [Problem("schema_violation", pointer, f"typed model refused a schema-valid value: {first.get('msg')}")],
            document=document,
        ) from None


def to_json(value: Any) -> Any:
    """A model (or plain value) as JSON data, keeping exactly the fields that were set."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return value


def render(name: str, value: Any) -> bytes:
    """Validate ``value`` against the strict writer contract and return its canonical bytes (canonical numbers
    included)."""
    data = numbers.canonical(name, to_json(value))
    validation.check_schema(name, data, reader=False)
    problems = semantic_problems(name, data)
    if problems:
        raise ContractError(problems)
    return canonical_json(data)


def write(name: str, path: str | os.PathLike[str], value: Any) -> Path:
    """Write a document crash-atomically in canonical JSON after strict validation."""
    data = render(name, value)
    target = Path(path)
    atomic_write_bytes(target, data)
    return target


def detect_type(value: Any) -> str:
    """The entry point whose type tag the document carries."""
    if isinstance(value, dict):
        for name, entry in sorted(kiln_contracts.ENTRYPOINTS.items()):
            tag = entry.get("type_tag")
            if tag and value.get(tag["field"]) == tag["value"]:
                return name
    raise UnknownDocumentTypeError(
        [
            Problem(
                "unknown_document_type",
                "",
                "the document carries no known type tag (receipt_type, manifest_type, provenance_type, "
                "schema, state_type); pass --type",
            )
        ]
    )
