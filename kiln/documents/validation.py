"""Schema layer of the strict loaders: compiled validators and error mapping.

Every loader validates raw JSON against the bundled Draft 2020-12 schema (compiled with
jsonschema-rs, exact JSON Schema semantics with format checking) *before* the typed
pydantic model sees it; the model is the typed view, not the validator (generated models
drop keywords pydantic cannot express, such as ``not``).
"""

from __future__ import annotations

import importlib
import json
import re
from functools import cache
from typing import Any

import jsonschema_rs
import kiln_contracts
from pydantic import BaseModel

from kiln.errors import ContractError, Problem, UnknownDocumentTypeError

ENVELOPE_CODES = ("unsupported_schema_version", "wrong_type_tag")
_TAG_FIELDS = ("receipt_type", "manifest_type", "provenance_type", "state_type", "sidecar_type", "schema")
_RANGE = {"Minimum", "Maximum", "ExclusiveMinimum", "ExclusiveMaximum", "MultipleOf"}
_LENGTH = {"MinLength", "MaxLength", "MinItems", "MaxItems", "MinProperties", "MaxProperties"}


def entrypoint(name: str) -> dict[str, Any]:
    try:
        return kiln_contracts.ENTRYPOINTS[name]
    except KeyError:
        known = ", ".join(sorted(kiln_contracts.ENTRYPOINTS))
        raise UnknownDocumentTypeError(
            [Problem("unknown_document_type", "", f"unknown document type {name!r}; known types: {known}")]
        ) from None


@cache
def reachable_definitions(name: str) -> tuple[str, ...]:
    """Names of the definitions reachable from ``name`` (itself included), sorted."""
    definitions = kiln_contracts.load_bundle()["$defs"]
    todo, found = [name], set()
    while todo:
        current = todo.pop()
        if current in found:
            continue
        found.add(current)
        stack: list[Any] = [definitions[current]]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str):
                    todo.append(ref.rsplit("/", 1)[1])
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
    return tuple(sorted(found))


def entry_schema(name: str, *, reader: bool = False) -> dict[str, Any]:
    """A self-contained schema for one entry point (only the reachable definitions)."""
    entrypoint(name)
    definitions = kiln_contracts.load_bundle(reader)["$defs"]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": f"#/$defs/{name}",
        "$defs": {k: definitions[k] for k in reachable_definitions(name)},
    }


def fragment_validator(fragment: dict[str, Any], *, reader: bool = False) -> Any:
    """The compiled validator of a schema fragment of the strict (or reader) bundle, built once per fragment."""
    key = (reader, json.dumps(fragment, sort_keys=True))
    v = _FRAGMENTS.get(key)
    if v is None:
        ref = fragment.get("$ref")
        root = ref.rsplit("/", 1)[1] if isinstance(ref, str) else None
        defs = kiln_contracts.load_bundle(reader)["$defs"]
        names = reachable_definitions(root) if root else tuple(defs)
        v = jsonschema_rs.validator_for({**fragment, "$defs": {k: defs[k] for k in names}}, validate_formats=True)
        _FRAGMENTS[key] = v
    return v


def fragment_valid(fragment: dict[str, Any], value: Any) -> bool:
    """Whether ``value`` satisfies a schema fragment of the strict bundle (used to pick union branches)."""
    return bool(fragment_validator(fragment).is_valid(value))


_FRAGMENTS: dict[tuple[bool, str], Any] = {}


@cache
def validator(name: str, *, reader: bool = False) -> Any:
    return jsonschema_rs.validator_for(entry_schema(name, reader=reader), validate_formats=True)


@cache
def model_class(name: str) -> type[BaseModel]:
    module = importlib.import_module(f"kiln_contracts.models.{entrypoint(name)['module']}")
    found: type[BaseModel] = getattr(module, name)
    return found


def _pointer(parts: Any) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


_INDEX_LIKE = re.compile(r"\+?[0-9]+")


def _same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _key_paths(node: Any, segments: list[Any], target: Any) -> list[list[Any]]:
    """Every concrete path below ``node`` that ``segments`` may stand for, ending at a value equal to ``target``.

    jsonschema-rs reports an object key that parses as an unsigned integer (``"007"``, ``"+7"``, ``"7"``) as the
    integer ``7``, so its path alone cannot tell such keys apart; the instance itself can.
    """
    if not segments:
        return [[]] if _same_json(node, target) else []
    head, rest = segments[0], segments[1:]
    if isinstance(node, list):
        if isinstance(head, int) and 0 <= head < len(node):
            return [[head, *tail] for tail in _key_paths(node[head], rest, target)]
        return []
    if isinstance(node, dict):
        if isinstance(head, str):
            keys = [head] if head in node else []
        else:
            keys = [k for k in node if _INDEX_LIKE.fullmatch(k) and int(k) == head]
        return [[key, *tail] for key in keys for tail in _key_paths(node[key], rest, target)]
    return []


class _PathResolver:
    """Turns a validator's instance path back into the instance's own keys (keys are keys, whatever they look like)."""

    def __init__(self, root: Any):
        self._root = root
        self._claimed: dict[str, int] = {}

    def __call__(self, error: Any) -> list[Any]:
        path = list(error.instance_path)
        if not any(isinstance(p, int) for p in path):
            return path
        candidates = _key_paths(self._root, path, error.instance)
        if not candidates:
            return path
        if len(candidates) == 1:
            return candidates[0]
        # Several keys hold equal values where this error points (say "7" and "007"): each such error of the
        # validator takes the next one in key order.
        claim = f"{path!r}|{type(error.kind).__name__}|{error.message}"
        n = self._claimed.get(claim, 0)
        self._claimed[claim] = n + 1
        return candidates[min(n, len(candidates) - 1)]


def _branch_score(errors: list[Any], path: list[Any]) -> tuple[int, int, int]:
    """How far a failed branch of an ``anyOf``/``oneOf`` is from what was sent (lower is closer): a branch of
    another type than the value (a type error at the union's own place) is farthest -- its "is not of type string"
    says nothing about a -1 seed, 17 stop strings or an image part, which the branch of the right type explains --
    then the branches whose tags do not match, then the number of problems."""
    wrong_kind = any(type(e.kind).__name__ == "Type" and list(e.instance_path) == path for e in errors)
    constant_misses = sum(1 for e in errors if type(e.kind).__name__ == "Constant")
    return (int(wrong_kind), constant_misses, len(errors))


def _is_null_branch(errors: list[Any], path: list[Any]) -> bool:
    """The branch of ``X | null`` that only says "this is not null"."""
    if len(errors) != 1 or type(errors[0].kind).__name__ != "Type":
        return False
    return list(errors[0].instance_path) == path and list(errors[0].kind.types) == ["null"]


def _excluded_fields(schema: Any, instance: Any) -> list[str]:
    """The fields a ``not: {required: [...]}`` -- the schema's way to say "these fields cannot be given together",
    optionally with the values that exclude them in ``properties`` -- found in ``instance``; empty for any other
    ``not``."""
    if not isinstance(schema, dict) or not isinstance(instance, dict):
        return []
    if set(schema) - {"required", "description", "properties"} or not schema.get("required"):
        return []
    return [name for name in schema.get("required", []) if name in instance]


def _schema_at(root: dict[str, Any], schema_path: list[Any]) -> Any:
    """The schema node at ``schema_path`` of ``root`` (following ``$ref`` into its ``$defs``), or None."""
    node: Any = root
    for part in schema_path:
        if isinstance(node, dict) and "$ref" in node and part not in node:
            node = root["$defs"].get(str(node["$ref"]).rsplit("/", 1)[1], {})
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return None
    return node


def _map_error(error: Any, out: list[Problem], resolve: _PathResolver, root: dict[str, Any]) -> None:
    kind = type(error.kind).__name__
    if kind == "AnyOf":
        path = list(error.schema_path)
        node = _schema_at(root, path[:-1]) if path and path[-1] == "anyOf" else None
        rule = node.get("x-kiln-rule") if isinstance(node, dict) else None
        if isinstance(rule, str):  # an implication: the fields are fine alone but not together; say which rule
            mapped: list[Problem] = []
            for sub in list(error.kind.context)[-1]:  # the consequent, the last branch
                _map_error(sub, mapped, resolve, root)
            for problem in mapped or [Problem("schema_violation", resolve_pointer(resolve, error), error.message)]:
                out.append(Problem("inconsistent_fields", problem.pointer, f"{problem.message}: {rule}"))
            return
    _map_error_plain(error, out, resolve, root)


def resolve_pointer(resolve: _PathResolver, error: Any) -> str:
    return _pointer(resolve(error))


def _map_error_plain(error: Any, out: list[Problem], resolve: _PathResolver, root: dict[str, Any]) -> None:
    kind = type(error.kind).__name__
    path = resolve(error)
    pointer = _pointer(path)
    instance = error.instance
    if kind == "AdditionalProperties":
        for key in error.kind.unexpected:
            out.append(Problem("unknown_field", f"{pointer}/{key}", f"unknown field {key!r}: this object is closed"))
    elif kind == "Required":
        prop = error.kind.property
        out.append(Problem("missing_field", f"{pointer}/{prop}", f"required field {prop!r} is absent"))
    elif kind == "Type":
        if instance is None:
            out.append(Problem("null_not_allowed", pointer, "null is not allowed here"))
        elif list(error.kind.types) == ["null"]:  # a field accepted only as null: its description says why
            node = _schema_at(root, list(error.schema_path)[:-1])
            why = node.get("description") if isinstance(node, dict) else None
            out.append(Problem("wrong_type", pointer, f"{error.message}: {why}" if why else error.message))
        else:
            out.append(Problem("wrong_type", pointer, error.message))
    elif kind == "Constant":
        field = str(path[-1]) if path else ""
        if instance is None:
            out.append(Problem("null_not_allowed", pointer, "null is not allowed here"))
        elif len(path) == 1 and field == "schema_version":
            out.append(
                Problem(
                    "unsupported_schema_version", pointer, f"unsupported schema_version {instance!r}: {error.message}"
                )
            )
        elif len(path) == 1 and field in _TAG_FIELDS:
            out.append(Problem("wrong_type_tag", pointer, f"wrong type tag {instance!r}: {error.message}"))
        else:
            out.append(Problem("wrong_const", pointer, error.message))
    elif kind == "Enum":
        code = "null_not_allowed" if instance is None else "value_not_allowed"
        out.append(Problem(code, pointer, error.message))
    elif kind == "Not" and _excluded_fields(error.kind.schema, instance):
        for name in _excluded_fields(error.kind.schema, instance):
            why = error.kind.schema.get("description") or f"field {name!r} cannot be combined with the fields given"
            out.append(Problem("inconsistent_fields", f"{pointer}/{name}", str(why)))
    elif kind in ("Pattern", "Not", "PropertyNames"):
        node = _schema_at(root, list(error.schema_path)[:-1])
        named = node.get("x-kiln-code") if isinstance(node, dict) else None
        if isinstance(named, str):  # the definition names its own refusal and says why
            out.append(Problem(named, pointer, f"{json.dumps(instance)} is refused: {node.get('description', '')}"))
        else:
            out.append(Problem("pattern_mismatch", pointer, error.message))
    elif kind == "Format":
        out.append(Problem("invalid_format", pointer, error.message))
    elif kind in _RANGE:
        out.append(Problem("out_of_range", pointer, error.message))
    elif kind in _LENGTH:
        out.append(Problem("invalid_length", pointer, error.message))
    elif kind in ("AnyOf", "OneOfNotValid"):
        branches = [list(b) for b in error.kind.context]
        non_null = [b for b in branches if not _is_null_branch(b, list(error.instance_path))]
        if instance is None and len(non_null) == len(branches):
            out.append(Problem("null_not_allowed", pointer, "null is not allowed here"))
        elif non_null:
            before = len(out)
            for sub in min(non_null, key=lambda branch: _branch_score(branch, list(error.instance_path))):
                _map_error(sub, out, resolve, root)
            if len(out) == before:
                out.append(Problem("schema_violation", pointer, error.message))
        else:
            out.append(Problem("schema_violation", pointer, error.message))
    else:
        out.append(Problem("schema_violation", pointer, error.message))


def schema_problems(name: str, instance: Any, *, reader: bool = False) -> list[Problem]:
    """Every schema problem of ``instance`` as a document of type ``name`` (empty if valid)."""
    v = validator(name, reader=reader)
    if v.is_valid(instance):
        return []
    problems: list[Problem] = []
    resolve = _PathResolver(instance)
    root = entry_schema(name, reader=reader)
    for error in v.iter_errors(instance):
        _map_error(error, problems, resolve, root)
    unique = list(dict.fromkeys(problems))
    unique.sort(key=lambda p: (p.code not in ENVELOPE_CODES, p.pointer))
    return unique


def check_schema(name: str, instance: Any, *, reader: bool = False, document: str | None = None) -> None:
    problems = schema_problems(name, instance, reader=reader)
    if problems:
        raise ContractError(problems, document=document)
