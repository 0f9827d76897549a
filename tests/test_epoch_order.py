"""The portable epoch order (spec/40): golden permutations in tests/golden/epoch_order.json,
SplitMix64 against its published reference outputs, and the seeding and rejection
sampling spelled out independently of kiln.documents.epoch_order.

Regenerate the goldens only for a deliberate algorithm change (and call it out):
``KILN_UPDATE_GOLDEN=1 python -m pytest tests/test_epoch_order.py``.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from kiln.documents import epoch_order as eo

GOLDEN_PATH = Path(__file__).parent / "golden" / "epoch_order.json"
MASK = (1 << 64) - 1

# SplitMix64 seeded with 0: the first outputs of Vigna's reference splitmix64.c.
SPLITMIX64_SEED0 = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC]


def _golden():
    if os.environ.get("KILN_UPDATE_GOLDEN") == "1":
        doc = json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))
        for case in doc["cases"]:
            case["order"] = eo.epoch_order(case["seed"], case["epoch"], case["n"])
        GOLDEN_PATH.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return json.loads(GOLDEN_PATH.read_text(encoding="utf-8"))


def test_epoch_orders_match_the_committed_golden_permutations():
    golden = _golden()
    assert golden["algorithm"] == eo.ALGORITHM_ID == "kiln.epoch-order.splitmix64-fisher-yates.v1"
    assert {case["n"] for case in golden["cases"]} >= {0, 1}
    assert max(case["seed"] for case in golden["cases"]) == MASK
    for case in golden["cases"]:
        assert eo.epoch_order(case["seed"], case["epoch"], case["n"]) == case["order"], case


def test_every_golden_order_is_a_permutation_of_its_items():
    for case in _golden()["cases"]:
        assert sorted(case["order"]) == list(range(case["n"]))


def test_splitmix64_seeded_with_zero_gives_the_reference_outputs():
    assert list(itertools.islice(eo.splitmix64(0), 4)) == SPLITMIX64_SEED0


def test_splitmix64_first_output_derived_by_hand():
    state = (0 + 0x9E3779B97F4A7C15) & MASK
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    z ^= z >> 31
    assert z == SPLITMIX64_SEED0[0]
    assert next(eo.splitmix64(0)) == z


def test_the_epoch_seed_xors_the_seed_with_epoch_times_the_golden_gamma_mod_2_64():
    assert eo.epoch_stream_seed(42, 0) == 42
    assert eo.epoch_stream_seed(0, 1) == 0x9E3779B97F4A7C15
    assert eo.epoch_stream_seed(MASK, 3) == MASK ^ ((3 * 0x9E3779B97F4A7C15) % 2**64)
    assert eo.epoch_stream_seed(5, MASK) == 5 ^ ((MASK * 0x9E3779B97F4A7C15) % 2**64)


def test_a_three_item_order_follows_fisher_yates_from_the_top_index_down():
    x1, x2 = SPLITMIX64_SEED0[:2]
    order = [0, 1, 2]
    # i = 2: bound 3, limit 2^64 - (2^64 mod 3) = 2^64 - 1; x1 is below it.
    assert x1 < 2**64 - 1
    j = x1 % 3
    order[2], order[j] = order[j], order[2]
    # i = 1: bound 2 divides 2^64, nothing is rejected.
    j = x2 % 2
    order[1], order[j] = order[j], order[1]
    assert eo.epoch_order(0, 0, 3) == order


def test_rejection_sampling_redraws_outputs_at_or_above_the_limit():
    # bound 3: 2^64 mod 3 == 1, so the only rejected output is 2^64 - 1.
    assert eo._uniform_below(iter([2**64 - 1, 7]), 3) == 7 % 3
    assert eo._uniform_below(iter([2**64 - 2]), 3) == (2**64 - 2) % 3
    # a power-of-two bound divides 2^64: nothing is rejected.
    assert eo._uniform_below(iter([2**64 - 1]), 4) == 3


def test_different_epochs_and_seeds_give_different_orders():
    assert eo.epoch_order(42, 0, 20) != eo.epoch_order(42, 1, 20)
    assert eo.epoch_order(42, 0, 20) != eo.epoch_order(43, 0, 20)


@pytest.mark.parametrize(
    ("seed", "epoch", "n"),
    [(-1, 0, 3), (2**64, 0, 3), (0, -1, 3), (0, 2**64, 3), (0, 0, -1), (True, 0, 3), (0, 0, 2.0)],
)
def test_out_of_range_inputs_are_refused(seed, epoch, n):
    with pytest.raises(ValueError):
        eo.epoch_order(seed, epoch, n)
