"""Hypothesis properties per entry point, generated from the schemas themselves.

* every instance generated from the strict schema either loads and round-trips
  (load -> write -> load) unchanged, or is refused by a *semantic* rule with a declared code
  (generated data rarely satisfies recomputed digests); a schema-level refusal would mean
  the generator and the validator disagree, and fails the test;
* every mutation of a generated instance (unknown field, wrong const, wrong type, null where
  not nullable, absent required) raises a ``ContractError`` with the code and pointer the
  schema implies, and nothing else.

``KILN_CONFORMANCE_EXAMPLES`` sets the number of instances per entry point (default 200).
"""

from __future__ import annotations

import json
import os
import warnings

import kiln_contracts
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conformance.make_cases import mutations
from kiln import _contract, contracts
from kiln.errors import ContractError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from hypothesis_jsonschema import from_schema

EXAMPLES = int(os.environ.get("KILN_CONFORMANCE_EXAMPLES", "200"))
SEMANTIC_CODES = {"inconsistent_fields", "digest_mismatch", "unsafe_path"}
ENTRYPOINTS = sorted(kiln_contracts.ENTRYPOINTS)
PROPERTY_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def _strategy(name: str):
    schema = _contract.entry_schema(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return from_schema(schema)


@pytest.mark.slow
@pytest.mark.parametrize("name", ENTRYPOINTS)
def test_generated_instances_load_and_round_trip_or_fail_a_semantic_rule(name):
    strategy = _strategy(name)

    @PROPERTY_SETTINGS
    @given(instance=strategy)
    def check(instance):
        try:
            model = contracts.load(name, instance)
        except ContractError as exc:
            codes = {p.code for p in exc.problems}
            assert codes <= SEMANTIC_CODES, f"schema-valid instance refused structurally: {exc}"
            return
        data = contracts.render(name, model)
        assert json.loads(data) == instance
        again = contracts.load(name, data)
        assert json.loads(contracts.render(name, again)) == instance

    check()


@pytest.mark.slow
@pytest.mark.parametrize("name", ENTRYPOINTS)
def test_mutated_instances_raise_the_declared_error(name):
    strategy = _strategy(name)
    defs = kiln_contracts.load_bundle()["$defs"]
    reader_open = kiln_contracts.ENTRYPOINTS[name]["reader_open"]

    @PROPERTY_SETTINGS
    @given(instance=strategy, data=st.data())
    def check(instance, data):
        cases = mutations(name, instance, defs, reader_open)
        if not cases:
            return
        chosen = data.draw(st.lists(st.sampled_from(cases), min_size=1, max_size=3, unique_by=lambda c: c["description"]))
        for case in chosen:
            if case["valid"]:  # an unknown field inside an object that readers keep open
                try:
                    contracts.load(name, case["instance"])
                except ContractError as exc:
                    assert {p.code for p in exc.problems} <= SEMANTIC_CODES, str(exc)
                continue
            with pytest.raises(ContractError) as info:
                if case.get("mode") == "write":
                    contracts.render(name, case["instance"])
                else:
                    contracts.load(name, case["instance"])
            found = {(p.code, p.pointer) for p in info.value.problems}
            assert (case["error_code"], case["pointer"]) in found, f"{case['description']}: {sorted(found)}"

    check()
