"""``kiln.model.sample_batch``: several rollouts in one left-padded, KV-cached decode give each row exactly what it
would get alone (greedy), and a batch of one draws exactly what ``sample`` draws."""

from __future__ import annotations

import _architectures as arch
import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.model import load_base_model, sample, sample_batch


def _prefixes(vocab: int) -> list[list[int]]:
    # different lengths, so the batch is left-padded; ids away from the special tokens at the start of the vocabulary
    return [[(11 + 7 * i + 3 * k) % (vocab - 20) + 20 for i in range(3 + 6 * k)] for k in range(4)]


def _greedy_agrees(model, prefixes, limits, stop):
    alone = [
        sample(model, p, max_new=n, temperature=0, top_p=1.0, generator=torch.Generator(), stop_ids=stop)
        for p, n in zip(prefixes, limits, strict=True)
    ]
    together = sample_batch(
        model, prefixes, max_new=limits, temperature=0, top_p=1.0, generator=torch.Generator(), stop_ids=stop
    )
    assert together == alone
    return together


def test_a_batch_decodes_every_row_as_if_it_ran_alone(tiny_model_dir):
    model = load_base_model(tiny_model_dir).model.eval()
    prefixes = _prefixes(model.config.vocab_size)
    found = _greedy_agrees(model, prefixes, [12, 5, 12, 0], frozenset({-1}))
    assert [len(ids) for ids, _ in found] == [12, 5, 12, 0]
    assert [truncated for _, truncated in found] == [True, True, True, False]
    # a row that samples a stop id ends there, keeping it, while the others go on
    stop = frozenset({found[0][0][3]})
    ended = _greedy_agrees(model, prefixes, [12, 12, 12, 12], stop)
    assert ended[0] == (found[0][0][:4], False)


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_left_padding_keeps_each_row_s_positions_on_other_architectures(family, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(arch.build(family, tmp_path / family), dtype=torch.float32).eval()
    _greedy_agrees(model, _prefixes(model.config.vocab_size), [8, 8, 3, 8], frozenset({-1}))


def test_a_batch_of_one_draws_what_sample_draws(tiny_model_dir):
    model = load_base_model(tiny_model_dir).model.eval()
    prefix = _prefixes(model.config.vocab_size)[2]
    one = sample(model, prefix, max_new=16, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(5),
                 stop_ids=frozenset({-1}))  # fmt: skip
    batch = sample_batch(model, [prefix], max_new=[16], temperature=1.0, top_p=0.9,
                         generator=torch.Generator().manual_seed(5), stop_ids=frozenset({-1}))  # fmt: skip
    assert batch == [one]
    other = sample(model, prefix, max_new=16, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(6),
                   stop_ids=frozenset({-1}))  # fmt: skip
    assert other != one  # the draws depend on the generator: the comparison can fail
