"""Canonical numbers: one spelling per number, decided by the schema position it sits in.

JSON Schema tells an integer from a number by value (``3.0`` is an integer), while Python, canonical JSON and the
typed models tell them by type (``3.0`` and ``3`` are typed, spelt and hashed differently). Every document is
therefore brought to one canonical form before it is judged, modelled, stored or hashed:

* where the schema allows ``integer`` but not ``number``, an integral float is the int (``3.0`` -> ``3``,
  ``-0.0`` -> ``0``, ``1e3`` -> ``1000``); a fractional float stays, and the schema refuses it;
* where the schema allows ``number``, an int is the float (``1`` -> ``1.0``), what the typed model (``StrictFloat``)
  holds; a float is never rewritten (``-0.0`` stays ``-0.0``); an int beyond the float range has no float and is
  refused (``out_of_range``) -- the schema layer would accept it and the typed model would not;
* where the schema says ``const`` or ``enum``, a number equal to a member is that member (``0.0`` -> ``0`` for
  ``"const": 0``);
* in a union (``anyOf``/``oneOf``) the first branch that validates the value decides; ``allOf`` applies each branch;
* a position without a type (``AnyJson``, ``JsonObject``, an unknown member of an open object) keeps its value.

Each definition compiles once per bundle (strict or reader) into a tree of small functions; a subtree without a
numeric position compiles to nothing and is never walked. Containers are copied only where a number changes, so the
value given is never modified and an already canonical document comes back as the very same object.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import kiln_contracts

from kiln import _contract
from kiln._rules import ptr
from kiln.errors import ContractError, Problem

Canon = Callable[[Any], Any]
Key = str | int


def canonical(name: str, value: Any, *, reader: bool = False, document: str | None = None) -> Any:
    """``value`` as a ``name`` document with every number in its canonical form.

    Raises ``ContractError`` (``out_of_range``, one problem per position) where an int at a number position is
    beyond the float range, the one number that has no canonical form.
    """
    canon = _compiler(reader).definition(name)
    if canon is None:
        return value
    try:
        return canon(value)
    except _Unrepresentable as exc:
        raise ContractError(exc.problems(), document=document) from None


class _Unrepresentable(Exception):  # noqa: N818 -- internal signal, turned into a ContractError by ``canonical``
    """Ints that no float holds, each with its path (innermost key first while the signal travels up)."""

    def __init__(self, value: int):
        super().__init__()
        self.found: list[tuple[list[Key], int]] = [([], value)]

    def under(self, key: Key, earlier: _Unrepresentable | None) -> _Unrepresentable:
        """This signal one level up, at ``key``, merged into the ``earlier`` one of the same container."""
        for path, _ in self.found:
            path.append(key)
        if earlier is None:
            return self
        earlier.found.extend(self.found)
        return earlier

    def problems(self) -> list[Problem]:
        return [
            Problem(
                "out_of_range",
                ptr("", *reversed(path)),
                f"an integer of {len(str(abs(value)))} digits is beyond the range of a number (a 64-bit float, "
                "about 1.8e308)",
            )
            for path, value in self.found
        ]


# --- leaves -----------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _to_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _to_float(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise _Unrepresentable(value) from None
    return value


def _same_number(a: float, b: float) -> bool:
    return type(a) is type(b) and str(a) == str(b)


def _members(members: tuple[float, ...]) -> Canon:
    def canon(value: Any) -> Any:
        if _is_number(value):
            for member in members:
                if value == member:
                    return value if _same_number(value, member) else member
        return value

    return canon


# --- containers -------------------------------------------------------------------------


def _rewrite(container: Any, pairs: Iterable[tuple[Key, Canon]]) -> Any:
    """``container`` with ``fn`` applied at each ``key``; copied only where a value changes."""
    out: Any = None
    bad: _Unrepresentable | None = None
    for key, fn in pairs:
        old = container[key]
        try:
            new = fn(old)
        except _Unrepresentable as exc:
            bad = exc.under(key, bad)
            continue
        if new is not old:
            if out is None:
                out = container.copy()
            out[key] = new
    if bad is not None:
        raise bad
    return container if out is None else out


def _object(properties: tuple[tuple[str, Canon], ...], extra: Canon | None, known: frozenset[str]) -> Canon:
    def canon(value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        pairs: list[tuple[Key, Canon]] = [(key, fn) for key, fn in properties if key in value]
        if extra is not None:
            pairs.extend((key, extra) for key in value if key not in known)
        return _rewrite(value, pairs)

    return canon


def _array(item: Canon) -> Canon:
    def canon(value: Any) -> Any:
        if not isinstance(value, list):
            return value
        return _rewrite(value, ((index, item) for index in range(len(value))))

    return canon


def _chain(steps: tuple[Canon, ...]) -> Canon:
    def canon(value: Any) -> Any:
        for step in steps:
            value = step(value)
        return value

    return canon


_JSON_TYPES = {
    type(None): "null",
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    dict: "object",
    list: "array",
}


def _json_type(value: Any) -> str:
    return next((_JSON_TYPES[t] for t in type(value).__mro__ if t in _JSON_TYPES), "other")


@dataclass
class _Branch:
    """One branch of a union: the JSON types it can admit (None: any), its canonicalizer, its validator."""

    schema: dict[str, Any]
    admits: frozenset[str] | None
    canon: Canon | None
    reader: bool
    _validator: Any = field(default=None, repr=False)

    def valid(self, value: Any) -> bool:
        if self._validator is None:
            self._validator = _contract.fragment_validator(self.schema, reader=self.reader)
        return bool(self._validator.is_valid(value))


def _union(branches: tuple[_Branch, ...]) -> Canon:
    def canon(value: Any) -> Any:
        kind = _json_type(value)
        candidates = [b for b in branches if b.admits is None or kind in b.admits]
        if len(candidates) == 1:  # the only branch that can validate it
            chosen: _Branch | None = candidates[0]
        else:
            chosen = next((b for b in candidates if b.valid(value)), None)
        if chosen is None or chosen.canon is None:
            return value
        return chosen.canon(value)

    return canon


# --- the compiler -----------------------------------------------------------------------


_JSON_TYPE_OF_SCHEMA_TYPE = {"integer": "number"}


class _Compiler:
    """Compiles schema nodes of one bundle; each definition once."""

    def __init__(self, reader: bool):
        self.reader = reader
        self.defs: dict[str, Any] = kiln_contracts.load_bundle(reader)["$defs"]
        self.compiled: dict[str, Canon | None] = {}
        self.admitted: dict[str, frozenset[str] | None] = {}

    def definition(self, name: str) -> Canon | None:
        if name not in self.compiled:
            self.compiled[name] = self.node(self.defs[name])
        return self.compiled[name]

    def node(self, schema: Any) -> Canon | None:
        """The canonicalizer of a schema node, or None when nothing below it is numeric."""
        if not isinstance(schema, dict):
            return None
        steps: list[Canon | None] = []
        ref = schema.get("$ref")
        if isinstance(ref, str):
            steps.append(self.definition(ref.rsplit("/", 1)[1]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                steps.append(self.union(schema[key]))
        steps.extend(self.node(sub) for sub in schema.get("allOf", ()))
        types = schema.get("type")
        types = {types} if isinstance(types, str) else set(types or ())
        if "number" in types:
            steps.append(_to_float)
        elif "integer" in types:
            steps.append(_to_int)
        members = [*schema.get("enum", ()), *([schema["const"]] if "const" in schema else [])]
        numeric = tuple(m for m in members if _is_number(m))
        if numeric:
            steps.append(_members(numeric))
        steps.append(self.object(schema))
        items = schema.get("items")
        if isinstance(items, dict):
            item = self.node(items)
            steps.append(None if item is None else _array(item))
        present = tuple(s for s in steps if s is not None)
        if not present:
            return None
        return present[0] if len(present) == 1 else _chain(present)

    def object(self, schema: dict[str, Any]) -> Canon | None:
        properties = schema.get("properties", {})
        compiled = tuple((key, fn) for key, sub in properties.items() if (fn := self.node(sub)) is not None)
        extra_schema = schema.get("additionalProperties")
        extra = self.node(extra_schema) if isinstance(extra_schema, dict) else None
        if not compiled and extra is None:
            return None
        return _object(compiled, extra, frozenset(properties))

    def union(self, schemas: list[Any]) -> Canon | None:
        branches = tuple(_Branch(s, self.admits(s), self.node(s), self.reader) for s in schemas)
        if all(b.canon is None for b in branches):
            return None
        return _union(branches)

    def admits(self, schema: Any) -> frozenset[str] | None:
        """The JSON types a node can accept (None: any), read from ``type``, ``const``, ``enum`` and references."""
        if not isinstance(schema, dict):
            return None
        found: frozenset[str] | None = None

        def narrow(types: frozenset[str] | None) -> None:
            nonlocal found
            if types is not None:
                found = types if found is None else found & types

        ref = schema.get("$ref")
        if isinstance(ref, str):
            name = ref.rsplit("/", 1)[1]
            if name not in self.admitted:
                self.admitted[name] = self.admits(self.defs[name])
            narrow(self.admitted[name])
        types = schema.get("type")
        if types is not None:
            listed = [types] if isinstance(types, str) else types
            narrow(frozenset(_JSON_TYPE_OF_SCHEMA_TYPE.get(t, t) for t in listed))
        if "const" in schema:
            narrow(frozenset({_json_type(schema["const"])}))
        if "enum" in schema:
            narrow(frozenset(_json_type(m) for m in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                each = [self.admits(s) for s in schema[key]]
                narrow(None if any(e is None for e in each) else frozenset().union(*each))
        for sub in schema.get("allOf", ()):
            narrow(self.admits(sub))
        return found


@cache
def _compiler(reader: bool) -> _Compiler:
    return _Compiler(reader)
