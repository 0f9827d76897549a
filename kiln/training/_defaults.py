"""The one request default the generated models cannot carry: a default chosen by another field.

A field's default is the ``default`` keyword on its property, and the generated model carries it as the field's
Python default (codegen), so the effective-config resolvers read it from the loaded model. A default chosen by
another field of the same object (the learning rate by the optimizer's ``kind``) is the ``x-kiln-default-by``
keyword (docs/schemas.md, rule 12), which no model expresses: ``default_by(definition, field, resolved)`` looks it
up in the bundle. Defaults that come from outside the request -- a drawn seed, the model's context length, the
server's settings -- are not in the schema; the resolvers take them from their caller.

The value comes back in the JSON type of its field -- a ``number`` as a float, an ``integer`` as an int.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import kiln_contracts

__all__ = ["default_by"]

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


def default_by(definition: str, field: str, resolved: Mapping[str, Any]) -> Any:
    """The ``x-kiln-default-by`` default of ``definition.field``, chosen by the value its pointer names in ``resolved``.

    ``resolved`` holds the object's fields with their own defaults applied (for the learning
    rate: ``{"optimizer": {"kind": "adam_w", ...}}``).
    """
    prop = _resolve(_definitions()[definition])["properties"][field]
    rule = prop["x-kiln-default-by"]
    value: Any = resolved
    for part in rule["pointer"].split("/")[1:]:
        value = value[part]
    return _typed(prop, rule["defaults"][value])
