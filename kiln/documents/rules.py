"""Registry of semantic rules: the ``x-kiln-semantic-constraints`` of the schemas.

A rule is registered under the *definition* it constrains and the constraint id the schema
lists. It runs wherever that definition occurs in a document -- at the root or embedded
(a provenance record inside a receipt is checked exactly like a stand-alone one).
Rules see only schema-valid data. Integrity rules (recomputed digests) fail fast.

A rule function takes ``(value, at)`` -- the value of the definition and the JSON pointer
where it sits -- and yields ``Problem``s with absolute pointers (use ``at + "/field"``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kiln.errors import Problem

RuleFn = Callable[[Any, str], Iterable[Problem]]


@dataclass(frozen=True)
class Rule:
    definition: str
    rule_id: str
    fn: RuleFn
    integrity: bool


RULES: dict[str, list[Rule]] = {}
_complete = False  # set once kiln.artifacts, which holds every rule, is imported


def mark_complete() -> None:
    """Every rule is registered (the last line of ``kiln/artifacts/__init__.py``)."""
    global _complete
    _complete = True


def require_complete() -> None:
    """Refuse to judge a document while rules may be missing: a partial registry would pass what it should not."""
    if not _complete:
        raise RuntimeError("the semantic rules are not registered yet: import kiln.contracts or kiln.artifacts first")


def semantic_rule(definition: str, rule_id: str, *, integrity: bool = False) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        RULES.setdefault(definition, []).append(Rule(definition, rule_id, fn, integrity))
        return fn

    return register


def registered_ids() -> set[tuple[str, str]]:
    return {(r.definition, r.rule_id) for rules in RULES.values() for r in rules}


def ptr(base: str, *parts: object) -> str:
    """Join JSON-pointer tokens onto ``base`` with RFC 6901 escaping."""
    return base + "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)
