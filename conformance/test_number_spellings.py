"""The two layers agree on every spelling of a number, for every entry point (docs/contracts.md, "Numbers").

An instance generated from the entry point's schema has some of its numbers respelt:

* ``float``: an int as the equal float (``3`` -> ``3.0``), where the position is typed;
* ``int``: an integral float as the int (``3.0`` -> ``3``), where the position is typed;
* ``negative zero``: a zero as ``-0.0``, where the position takes integers only;
* ``large``: the number replaced by a large integer (2**53+1, 2**63, 2**64, 2**70, 2**1024 and their negatives).

The first three keep the value; the last changes it. Where a position is typed, and whether it takes integers only,
is found by probing the schema layer alone (a string there is refused; a half-step away is refused), never from the
canonicalizer under test. Then:

* ``contracts.problems`` is empty exactly when ``contracts.load`` accepts; when both refuse, they list the same
  problems, and the loader raises ``ContractError`` -- never a pydantic ``ValidationError`` or anything else;
* an accepted instance's model dumps to exactly ``contracts.canonical`` of it (types and ``-0.0`` included), and
  when the respelling kept every value, it renders to the same bytes as the instance as generated.

Derandomized like every property here (``conformance/_hypothesis_profiles.py``); ``KILN_NUMBER_EXAMPLES`` sets
the instances per entry point (default 8, five times that under the ``explore`` profile).
"""

from __future__ import annotations

import math
import os
from typing import Any

import kiln_contracts
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance._strategies import object_instances
from kiln import contracts
from kiln.documents import validation
from kiln.documents.jsonio import canonical_json
from kiln.errors import ContractError

EXPLORING = os.environ.get("KILN_HYPOTHESIS_PROFILE") == "explore"
EXAMPLES = int(os.environ.get("KILN_NUMBER_EXAMPLES", "40" if EXPLORING else "8"))
LARGE = tuple(s * n for n in (2**53 + 1, 2**63, 2**64, 2**70, 2**1024) for s in (1, -1))
RESPELLINGS = ("float", "int", "negative zero", "large")
ENTRYPOINTS = sorted(kiln_contracts.ENTRYPOINTS)

Where = tuple[str | int, ...]  # the keys and indices that lead to a value


def _numbers(value: Any, at: Where = ()) -> list[tuple[Where, int | float]]:
    """Every number in ``value`` with its path, in document order."""
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [(at, value)]
    if isinstance(value, dict):
        return [found for key, item in value.items() for found in _numbers(item, (*at, key))]
    if isinstance(value, list):
        return [found for index, item in enumerate(value) for found in _numbers(item, (*at, index))]
    return []


def _replaced(value: Any, path: Where, new: Any) -> Any:
    """``value`` with ``new`` at ``path``, copying only the containers along the way."""
    if not path:
        return new
    head, rest = path[0], path[1:]
    copy = value.copy()
    copy[head] = _replaced(value[head], rest, new)
    return copy


class _Probe:
    """What the schema layer alone says about a number position of a valid instance."""

    def __init__(self, name: str, instance: Any):
        self.valid = validation.validator(name).is_valid
        self.instance = instance

    def accepts(self, path: Where, new: Any) -> bool:
        return bool(self.valid(_replaced(self.instance, path, new)))

    def typed(self, path: Where) -> bool:
        return not self.accepts(path, "a string")

    def integers_only(self, path: Where, value: float) -> bool:
        return self.typed(path) and not self.accepts(path, value + 0.5) and not self.accepts(path, value - 0.5)


def _respell(kind: str, value: int | float, path: Where, probe: _Probe) -> int | float | None:
    """The respelt number, or None where this respelling does not apply to this position."""
    if kind == "float" and isinstance(value, int) and abs(value) <= 2**53 and probe.typed(path):
        return float(value)
    is_integral_float = isinstance(value, float) and value.is_integer() and math.copysign(1.0, value) > 0
    if kind == "int" and is_integral_float and probe.typed(path):
        return int(value)
    if kind == "negative zero" and value == 0 and probe.integers_only(path, value):
        return -0.0
    return None


def _listed(problems: list[Any]) -> list[tuple[str, str, str]]:
    return [(p.code, p.pointer, p.message) for p in problems]


def _load(name: str, value: Any) -> tuple[Any, ContractError | None]:
    """The loaded model, or the ``ContractError`` the loader raised (any other exception escapes)."""
    try:
        return contracts.load(name, value), None
    except ContractError as exc:
        return None, exc


def _check(name: str, original: Any, respelt: Any, kept_values: bool) -> None:
    found = contracts.problems(name, respelt)
    if kept_values:  # a respelling never changes the verdict
        assert _listed(found) == _listed(contracts.problems(name, original))
    model, refusal = _load(name, respelt)
    if refusal is not None:
        assert found, f"the loader refused what problems() accepts: {refusal}"
        assert _listed(refusal.problems) == _listed(found)
        return
    assert not found, f"problems() lists {found} but the loader accepted"
    dumped = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert canonical_json(dumped) == canonical_json(contracts.canonical(name, respelt))
    if kept_values:
        assert contracts.render(name, model) == contracts.render(name, contracts.load(name, original))


@pytest.mark.parametrize("name", ENTRYPOINTS)
def test_every_spelling_of_a_number_is_judged_alike_by_both_layers_and_loads_as_its_canonical_form(name):
    @settings(max_examples=EXAMPLES)
    @given(instance=object_instances(name), data=st.data())
    def check(instance: Any, data: st.DataObject) -> None:
        numbers = _numbers(instance)
        probe = _Probe(name, instance)
        respelt, kept_values = instance, True
        if numbers:
            picks = data.draw(st.lists(st.integers(0, len(numbers) - 1), max_size=6, unique=True))
            for index in picks:
                path, value = numbers[index]
                kind = data.draw(st.sampled_from(RESPELLINGS))
                new = data.draw(st.sampled_from(LARGE)) if kind == "large" else _respell(kind, value, path, probe)
                if new is not None:
                    respelt = _replaced(respelt, path, new)
                    kept_values = kept_values and kind != "large"
        _check(name, instance, respelt, kept_values)

    check()
