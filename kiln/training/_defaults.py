"""Request defaults, read from the schema: the one place each of them is written.

A field's default is the ``default`` keyword on its property; a default chosen by another
field of the same object (the learning rate by the optimizer's ``kind``) is the
``x-kiln-default-by`` keyword (docs/schemas.md, rule 12). Defaults that come from outside
the request -- a drawn seed, the model's context length, the server's settings -- are not
in the schema; the effective-config code resolves them.

``schema_defaults(definition)``                 ``{field: default}`` of an object definition
``schema_defaults(definition, variant=tag)``    the same for the branch of a ``oneOf`` union
                                                whose constant tag (``kind``, ``mode``) is ``tag``
``default_by(definition, field, resolved)``     a dependent default, looked up in ``resolved``

Values come back in the JSON type of their field -- a ``number`` as a float, an ``integer``
as an int -- so ``0`` and ``0.0`` in a schema file give the same effective configuration;
each call returns fresh copies, which the caller may keep or change.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import kiln_contracts

__all__ = ["default_by", "schema_defaults"]

_CASTS = {"number": float, "integer": int}


def _definitions() -> dict[str, Any]:
    return kiln_contracts.load_bundle()["$defs"]


def _resolve(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    while "$ref" in schema:
        schema = _definitions()[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _json_type(schema: Mapping[str, Any]) -> str | None:
    """The one non-null JSON type a property takes, or None when it is not a single plain type."""
    schema = _resolve(schema)
    if isinstance(schema.get("type"), str):
        return schema["type"]
    branches = [_resolve(b) for b in schema.get("anyOf", schema.get("oneOf", []))]
    types = {_json_type(b) for b in branches if b.get("type") != "null"}
    return types.pop() if len(types) == 1 else None


def _typed(schema: Mapping[str, Any], value: Any) -> Any:
    cast = _CASTS.get(_json_type(schema) or "")
    if cast is None or value is None or isinstance(value, bool):
        return copy.deepcopy(value)
    return cast(value)


def _object(definition: str, variant: str | None) -> Mapping[str, Any]:
    schema = _resolve(_definitions()[definition])
    if variant is None:
        return schema
    for branch in map(_resolve, schema.get("oneOf", [])):
        if any(p.get("const") == variant for p in branch.get("properties", {}).values()):
            return branch
    raise KeyError(f"{definition} has no variant {variant!r}")


def schema_defaults(definition: str, *, variant: str | None = None) -> dict[str, Any]:
    """``{field: default}`` for every property of ``definition`` (or of its ``variant`` branch) with a ``default``.

    Raises ``KeyError`` for an unknown definition or variant.
    """
    properties = _object(definition, variant).get("properties", {})
    return {name: _typed(prop, prop["default"]) for name, prop in properties.items() if "default" in prop}


def default_by(definition: str, field: str, resolved: Mapping[str, Any]) -> Any:
    """The ``x-kiln-default-by`` default of ``definition.field``, chosen by the value its pointer names in ``resolved``.

    ``resolved`` holds the object's fields with their own defaults applied (for the learning
    rate: ``{"optimizer": {"kind": "adam_w", ...}}``).
    """
    prop = _object(definition, None)["properties"][field]
    rule = prop["x-kiln-default-by"]
    value: Any = resolved
    for part in rule["pointer"].split("/")[1:]:
        value = value[part]
    return _typed(prop, rule["defaults"][value])
