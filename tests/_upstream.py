"""The reference implementation's published contracts, for compatibility tests.

They lie in ``../shared/upstream/contracts`` beside the checkout; a user's clone has no ``../shared``, so every test
that reads them carries ``needs_upstream`` and skips cleanly without them.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

UPSTREAM = Path(__file__).resolve().parent.parent.parent / "shared" / "upstream" / "contracts"

needs_upstream = pytest.mark.skipif(not UPSTREAM.is_dir(), reason="reference contracts not present (../shared absent)")


@cache
def _loaded() -> tuple[dict[str, Any], Registry]:
    docs = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in UPSTREAM.glob("*.schema.json")}
    registry = Registry().with_resources(
        (d["$id"], Resource.from_contents(d, default_specification=DRAFT202012)) for d in docs.values()
    )
    return docs, registry


def upstream() -> tuple[dict[str, Any], Registry]:
    """Every reference schema document by file name, and a registry resolving their cross-file ``$ref``s."""
    return _loaded()


def upstream_definition(defname: str) -> dict[str, Any]:
    """The reference's ``$defs`` entry ``defname`` (from whichever document holds it)."""
    for doc in upstream()[0].values():
        if defname in doc.get("$defs", {}):
            return doc["$defs"][defname]
    raise AssertionError(f"{defname} not in the reference contracts")


def upstream_validator(defname: str) -> tuple[jsonschema.Draft202012Validator, dict[str, Any]]:
    """A format-checking validator of the reference's ``defname``, and the document holding it."""
    docs, registry = upstream()
    for doc in docs.values():
        if defname in doc.get("$defs", {}):
            schema = {"$schema": doc["$schema"], "$ref": f"{doc['$id']}#/$defs/{defname}"}
            return jsonschema.Draft202012Validator(
                schema, registry=registry, format_checker=jsonschema.FormatChecker()
            ), doc
    raise AssertionError(f"{defname} not in the reference contracts")
