"""Hypothesis properties per entry point, generated from the schemas themselves.

For every instance generated from an entry point's strict schema:

* it either loads and round-trips (load -> write -> load) unchanged, or is refused by a
  *semantic* rule with a declared code (generated data rarely satisfies recomputed
  digests); a schema-level refusal would mean the generator and the validator disagree,
  and fails the test;
* up to three mutations of it (unknown field, wrong const, wrong type, null where not
  nullable, absent required) each raise a ``ContractError`` carrying the code and pointer
  that the schema implies -- and nothing else escapes.

``KILN_CONFORMANCE_EXAMPLES`` sets the number of instances per entry point (default 200; 1,000 under the
``explore`` Hypothesis profile). The draws are derandomized unless that profile is chosen (see
``conformance/_hypothesis_profiles.py``): every run checks the same instances, and exploration's finds become committed cases.
"""

from __future__ import annotations

import json
import os

import kiln_contracts
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance._strategies import instances
from conformance.make_cases import mutations
from kiln import contracts
from kiln.errors import ContractError

EXPLORING = os.environ.get("KILN_HYPOTHESIS_PROFILE") == "explore"
EXAMPLES = int(os.environ.get("KILN_CONFORMANCE_EXAMPLES", "1000" if EXPLORING else "200"))
SEMANTIC_CODES = {"inconsistent_fields", "digest_mismatch", "unsafe_path"}
ENTRYPOINTS = sorted(kiln_contracts.ENTRYPOINTS)


def _load_outcome(name, instance):
    """Load ``instance``; return the set of error codes (empty when it loaded)."""
    try:
        contracts.load(name, instance)
    except ContractError as exc:
        return {p.code for p in exc.problems}, exc
    return set(), None


def _check_round_trip(name, instance):
    codes, exc = _load_outcome(name, instance)
    if exc is not None:
        assert codes <= SEMANTIC_CODES, f"schema-valid instance refused structurally: {exc}"
        return
    data = contracts.render(name, contracts.load(name, instance))
    assert json.loads(data) == instance
    again = contracts.load(name, data)
    assert json.loads(contracts.render(name, again)) == instance


def _refusal(name, case):
    """The ContractError a mutated instance raises (None if it loaded)."""
    try:
        if case.get("mode") == "write":
            contracts.render(name, case["instance"])
        else:
            contracts.load(name, case["instance"])
    except ContractError as exc:
        return exc
    return None


def _check_mutation(name, case):
    exc = _refusal(name, case)
    if case["valid"]:  # an unknown field inside an object that readers keep open
        assert exc is None or {p.code for p in exc.problems} <= SEMANTIC_CODES, str(exc)
        return
    assert exc is not None, f"{case['description']}: the mutated instance was accepted"
    found = {(p.code, p.pointer) for p in exc.problems}
    assert (case["error_code"], case["pointer"]) in found, f"{case['description']}: {sorted(found)}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ENTRYPOINTS)
def test_generated_instances_round_trip_and_their_mutations_raise_declared_errors(name):
    defs = kiln_contracts.load_bundle()["$defs"]
    reader_open = kiln_contracts.ENTRYPOINTS[name]["reader_open"]
    seen = []

    @settings(max_examples=EXAMPLES)
    @given(instance=instances(name), data=st.data())
    def check(instance, data):
        seen.append(1)
        _check_round_trip(name, instance)
        cases = mutations(name, instance, defs, reader_open)
        if cases:
            picks = st.lists(st.sampled_from(cases), min_size=1, max_size=3, unique_by=lambda c: c["description"])
            for case in data.draw(picks):
                _check_mutation(name, case)

    check()
    # Hypothesis stops early only when a schema has fewer distinct instances than asked for
    # (tiny constant bodies); every entry point of any size gets the full count.
    assert len(seen) >= min(EXAMPLES, 25), f"only {len(seen)} instances were generated for {name}"
