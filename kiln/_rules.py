"""Registry of semantic rules: the ``x-kiln-semantic-constraints`` of the schemas.

A rule is a function ``(document) -> iterable of Problem`` registered under the entry
point it constrains and the constraint id the schema lists. Rules run only on documents
that already passed schema validation. Integrity rules (recomputed digests) fail fast.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kiln.errors import Problem

RuleFn = Callable[[dict[str, Any]], Iterable[Problem]]


@dataclass(frozen=True)
class Rule:
    entry: str
    rule_id: str
    fn: RuleFn
    integrity: bool


RULES: dict[str, list[Rule]] = {}


def semantic_rule(entry: str, rule_id: str, *, integrity: bool = False) -> Callable[[RuleFn], RuleFn]:
    def register(fn: RuleFn) -> RuleFn:
        RULES.setdefault(entry, []).append(Rule(entry, rule_id, fn, integrity))
        return fn

    return register


def registered_ids() -> set[tuple[str, str]]:
    return {(r.entry, r.rule_id) for rules in RULES.values() for r in rules}
