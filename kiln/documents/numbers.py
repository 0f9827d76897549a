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
numeric position compiles to nothing and is never walked, and each compiled position knows the Python types it can
change (an integer position: ``float``), so a canonical document costs one type check per numeric position. Values
are JSON data (``dict``, ``list``, ``str``, ``int``, ``float``, ``bool``, ``None``, matched by exact type: ``True`` is
never the number 1). Containers are copied only where a number changes, so the value given is never modified and an
already canonical document comes back as the very same object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import kiln_contracts

from kiln.documents import validation
from kiln.documents.rules import ptr
from kiln.errors import ContractError, Problem

Canon = Callable[[Any], Any]
Key = str | int


@dataclass(frozen=True)
class _Node:
    """A compiled position: ``canon`` rewrites a value; only values of a type in ``touches`` can change."""

    canon: Canon
    touches: frozenset[type]


def canonical(name: str, value: Any, *, reader: bool = False, document: str | None = None) -> Any:
    """``value`` as a ``name`` document with every number in its canonical form.

    Raises ``ContractError`` (``out_of_range``, one problem per position) where an int at a number position is
    beyond the float range, the one number that has no canonical form.
    """
    node = _compiler(reader).definition(name)
    if node is None or type(value) not in node.touches:
        return value
    try:
        return node.canon(value)
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
                f"an integer of {len(str(abs(value)))} digits is too large for a number (a 64-bit float holds "
                "at most about 1.8e308)",
            )
            for path, value in self.found
        ]


# --- leaves (values are JSON data: dict, list, str, int, float, bool, None) ----------------


def _to_int(value: Any) -> Any:
    return int(value) if value.is_integer() else value  # only floats reach it (``touches``)


def _to_float(value: Any) -> Any:
    try:
        return float(value)  # only ints reach it (``touches``)
    except OverflowError:
        raise _Unrepresentable(value) from None


_INTEGER = _Node(_to_int, frozenset({float}))
_NUMBER = _Node(_to_float, frozenset({int}))


def _members(members: tuple[float, ...]) -> _Node:
    def canon(value: Any) -> Any:
        for member in members:
            if value == member:
                return value if type(value) is type(member) and str(value) == str(member) else member
        return value

    return _Node(canon, frozenset({int, float}))


# --- containers -------------------------------------------------------------------------


def _rewrite(container: Any, pairs: Sequence[tuple[Key, Canon]]) -> Any:
    """``container`` with ``canon`` applied at each ``key``; copied only where a value changes."""
    out: Any = None
    bad: _Unrepresentable | None = None
    for key, canon in pairs:
        old = container[key]
        try:
            new = canon(old)
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


def _object(properties: tuple[tuple[str, _Node], ...], extra: _Node | None, known: frozenset[str]) -> _Node:
    checks = tuple((key, n.canon, n.touches) for key, n in properties)  # an absent key reads None: never touched

    def canon(value: Any) -> Any:
        pairs = [(key, fn) for key, fn, touches in checks if type(value.get(key)) in touches]
        if extra is not None:
            fn, touches = extra.canon, extra.touches
            pairs.extend((key, fn) for key, v in value.items() if type(v) in touches and key not in known)
        return _rewrite(value, pairs) if pairs else value

    return _Node(canon, frozenset({dict}))


def _array(item: _Node) -> _Node:
    fn, touches = item.canon, item.touches

    def canon(value: Any) -> Any:
        pairs = [(index, fn) for index, v in enumerate(value) if type(v) in touches]
        return _rewrite(value, pairs) if pairs else value

    return _Node(canon, frozenset({list}))


def _chain(steps: tuple[_Node, ...]) -> _Node:
    def canon(value: Any) -> Any:
        for step in steps:
            if type(value) in step.touches:
                value = step.canon(value)
        return value

    return _Node(canon, frozenset().union(*(step.touches for step in steps)))


_JSON_TYPES = {
    type(None): "null",
    bool: "boolean",
    int: "number",
    float: "number",
    str: "string",
    dict: "object",
    list: "array",
}


@dataclass
class _Branch:
    """One branch of a union: the JSON types it can admit (None: any), its compiled node, its validator."""

    schema: dict[str, Any]
    admits: frozenset[str] | None
    node: _Node | None
    reader: bool
    _validator: Any = field(default=None, repr=False)

    def valid(self, value: Any) -> bool:
        if self._validator is None:
            self._validator = validation.fragment_validator(self.schema, reader=self.reader)
        return bool(self._validator.is_valid(value))


def _first_valid(branches: tuple[_Branch, ...]) -> Canon:
    def canon(value: Any) -> Any:
        chosen = next((b for b in branches if b.valid(value)), None)
        if chosen is None or chosen.node is None or type(value) not in chosen.node.touches:
            return value
        return chosen.node.canon(value)

    return canon


def _union(branches: tuple[_Branch, ...]) -> _Node:
    """The first branch that validates decides; decided once per JSON type where only one branch can admit it."""
    plan: dict[type, Canon | None] = {}
    for python_type, kind in _JSON_TYPES.items():
        candidates = tuple(b for b in branches if b.admits is None or kind in b.admits)
        if not any(b.node is not None and python_type in b.node.touches for b in candidates):
            continue  # no branch can change a value of this type
        only = candidates[0].node if len(candidates) == 1 else None
        plan[python_type] = only.canon if only is not None else _first_valid(candidates)

    def canon(value: Any) -> Any:
        step = plan.get(type(value))
        return value if step is None else step(value)

    return _Node(canon, frozenset(plan))


# --- the compiler -----------------------------------------------------------------------


_JSON_TYPE_OF_SCHEMA_TYPE = {"integer": "number"}


class _Compiler:
    """Compiles schema nodes of one bundle; each definition once."""

    def __init__(self, reader: bool):
        self.reader = reader
        self.defs: dict[str, Any] = kiln_contracts.load_bundle(reader)["$defs"]
        self.compiled: dict[str, _Node | None] = {}
        self.admitted: dict[str, frozenset[str] | None] = {}

    def definition(self, name: str) -> _Node | None:
        if name not in self.compiled:
            self.compiled[name] = self.node(self.defs[name])
        return self.compiled[name]

    def node(self, schema: Any) -> _Node | None:
        """The compiled node of a schema position, or None when nothing below it is numeric."""
        if not isinstance(schema, dict):
            return None
        steps: list[_Node | None] = []
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
            steps.append(_NUMBER)
        elif "integer" in types:
            steps.append(_INTEGER)
        members = [*schema.get("enum", ()), *([schema["const"]] if "const" in schema else [])]
        numeric = tuple(m for m in members if type(m) in (int, float))
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

    def object(self, schema: dict[str, Any]) -> _Node | None:
        properties = schema.get("properties", {})
        compiled = tuple((key, n) for key, sub in properties.items() if (n := self.node(sub)) is not None)
        extra_schema = schema.get("additionalProperties")
        extra = self.node(extra_schema) if isinstance(extra_schema, dict) else None
        if not compiled and extra is None:
            return None
        return _object(compiled, extra, frozenset(properties))

    def union(self, schemas: list[Any]) -> _Node | None:
        branches = tuple(_Branch(s, self.admits(s), self.node(s), self.reader) for s in schemas)
        if all(b.node is None for b in branches):
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
            narrow(frozenset({_JSON_TYPES.get(type(schema["const"]), "other")}))
        if "enum" in schema:
            narrow(frozenset(_JSON_TYPES.get(type(m), "other") for m in schema["enum"]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                each = [self.admits(s) for s in schema[key]]
                known = [e for e in each if e is not None]
                narrow(None if len(known) < len(each) else frozenset().union(*known))
        for sub in schema.get("allOf", ()):
            narrow(self.admits(sub))
        return found


@cache
def _compiler(reader: bool) -> _Compiler:
    return _Compiler(reader)
