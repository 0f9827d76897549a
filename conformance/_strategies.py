"""Hypothesis strategies of schema-valid instances, one per entry point (hypothesis-jsonschema over the strict
bundle), shared by the properties of this suite."""

from __future__ import annotations

import warnings
from typing import Any

from hypothesis import strategies as st

from kiln.documents import validation

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import hypothesis_jsonschema._from_schema as _hjs
    from hypothesis_jsonschema import from_schema


def _memoize_subschema_strategies() -> None:
    """Build each sub-schema's strategy once instead of on every draw.

    hypothesis-jsonschema 0.23.1 re-canonicalises an object's property sub-schemas every
    time it draws a value for them, which makes large documents (receipts, registry
    listings) 2-10x slower to generate than they need to be. The sub-schema dicts live as
    long as the parent strategy, so a cache keyed by their identity (holding a reference,
    so the identity cannot be reused) returns the same strategy the library would build.
    """
    original = getattr(_hjs, "__from_schema", None)
    if original is None or getattr(original, "_kiln_memoized", False):
        return
    cache: dict[tuple[int, int, int], tuple[object, object]] = {}

    def memoized(schema, *, alphabet, custom_formats):
        key = (id(schema), id(alphabet), id(custom_formats))
        hit = cache.get(key)
        if hit is not None and hit[0] is schema:
            return hit[1]
        strategy = original(schema, alphabet=alphabet, custom_formats=custom_formats)
        cache[key] = (schema, strategy)
        return strategy

    memoized._kiln_memoized = True
    setattr(_hjs, "__from_schema", memoized)


_memoize_subschema_strategies()


def instances(name: str) -> st.SearchStrategy[Any]:
    """Instances of entry point ``name`` drawn from its strict schema."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return from_schema(validation.entry_schema(name))


def object_instances(name: str) -> st.SearchStrategy[Any]:
    """Instances of entry point ``name``, built faster for objects whose root adds constraint-only applicators.

    hypothesis-jsonschema merges a root ``oneOf``/``anyOf``/``allOf``/``not`` (the request bodies' "exactly one
    data source" rules) into a copy of the whole object schema per branch, which takes most of the time spent
    building the strategy (GrpoRequest: 25 s of CPU, 5 s without). For a root that has ``properties``, those
    applicators are left out of the generator and applied as a filter by the full schema instead: every instance
    still satisfies the entry point's schema.
    """
    schema = validation.entry_schema(name)
    root = schema["$defs"][name]
    if "properties" not in root:
        return instances(name)
    plain = {k: v for k, v in root.items() if k not in ("oneOf", "anyOf", "allOf", "not")}
    valid = validation.validator(name).is_valid
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return from_schema({**schema, "$defs": {**schema["$defs"], name: plain}}).filter(valid)
