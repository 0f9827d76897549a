"""``kiln.model.decode``: rollouts decoded together in one ``Batch`` give each row exactly what it gets alone --
greedy or sampled, since each row's draws are keyed by its own ``(seed, sequence, position)`` -- on the invariant
forward and on the fallback (a family without one decodes each row alone through its own forward)."""

from __future__ import annotations

import _architectures as arch
import pytest
import torch
from transformers import AutoModelForCausalLM

from kiln.model import Sampling, decode, load_base_model

GREEDY = Sampling()
SAMPLED = Sampling(temperature=1.0, top_p=0.9)


def _prefixes(vocab: int) -> list[list[int]]:
    # different lengths; ids away from the special tokens at the start of the vocabulary
    return [[(11 + 7 * i + 3 * k) % (vocab - 20) + 20 for i in range(3 + 6 * k)] for k in range(4)]


def _agree(model, prefixes, limits, stop, sampling=GREEDY):
    def run(rows):
        return decode(
            model,
            [prefixes[i] for i in rows],
            max_new=[limits[i] for i in rows],
            sampling=sampling,
            seed=5,
            sequences=list(rows),
            stop_ids=stop,
            logprobs=True,
        )

    together = run(range(len(prefixes)))
    alone = [run([i])[0] for i in range(len(prefixes))]
    assert together == alone
    return together


def test_a_batch_decodes_every_row_as_if_it_ran_alone(tiny_model_dir):
    model = load_base_model(tiny_model_dir).model.eval()
    prefixes = _prefixes(model.config.vocab_size)
    found = _agree(model, prefixes, [12, 5, 12, 0], frozenset({-1}))
    assert [len(d.ids) for d in found] == [12, 5, 12, 0]
    assert [d.truncated for d in found] == [True, True, True, False]
    # a row that samples a stop id ends there, keeping it, while the others go on
    stop = frozenset({found[0].ids[3]})
    ended = _agree(model, prefixes, [12, 12, 12, 12], stop)
    assert (ended[0].ids, ended[0].truncated) == (found[0].ids[:4], False)
    sampled = _agree(model, prefixes, [16, 16, 16, 16], frozenset({-1}), SAMPLED)
    assert [d.ids for d in sampled] != [d.ids for d in _agree(model, prefixes, [16] * 4, frozenset({-1}))]


@pytest.mark.parametrize("family", ["gpt2", "gemma2"])
def test_every_row_decodes_as_alone_on_other_architectures(family, tmp_path):
    """GPT-2 runs the invariant forward; Gemma 2 (sliding windows, soft-capped attention) falls back to its own
    forward, one row at a time."""
    model = AutoModelForCausalLM.from_pretrained(arch.build(family, tmp_path / family), dtype=torch.float32).eval()
    _agree(model, _prefixes(model.config.vocab_size), [8, 8, 3, 8], frozenset({-1}), SAMPLED)


def test_the_log_probability_of_each_sampled_token_is_the_full_forward_s(tiny_model_dir):
    from kiln.model import sequence_logprobs

    model = load_base_model(tiny_model_dir).model.eval()
    prefixes = _prefixes(model.config.vocab_size)
    found = _agree(model, prefixes, [10, 10, 10, 10], frozenset({-1}), SAMPLED)
    for prefix, decoded in zip(prefixes, found, strict=True):
        with torch.no_grad():
            full = sequence_logprobs(model, prefix + decoded.ids)
        rows = full[len(prefix) - 1 : -1].gather(1, torch.tensor(decoded.ids).unsqueeze(1)).squeeze(1)
        assert rows.tolist() == decoded.logprobs
