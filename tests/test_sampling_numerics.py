"""The portable draw rule (``kiln.model.next_tokens``) over the whole schema range: no temperature in [0, 2] and no
top_p in (0, 1] draws anything but a vocabulary id; a temperature so small that logits / temperature overflows is
greedy, as 0 is; every other temperature samples softmax(logits / temperature). The draws are a function of the
logits and the key alone: the same in a batch as alone, at any thread count, never from a random generator's
state. Checked as a property (fixed seed, derandomized) and end to end on the served model: chat and a stream."""

from __future__ import annotations

import subprocess
import sys

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kiln.model import DrawKey, Sampling, next_tokens

LOGITS = st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=40)
TEMPERATURE = st.one_of(
    st.floats(0, 2, allow_subnormal=True),
    st.sampled_from([0.0, 5e-324, 1e-45, 1.2e-38, 1e-38, 1e-37, 1e-30, 2.0]),
)
TOP_P = st.one_of(st.floats(0, 1, exclude_min=True, allow_subnormal=True), st.sampled_from([5e-324, 1e-300, 1.0]))


def choose(values, sampling, seed=0, *, seen=(), produced=0, stop_ids=(), position=0):
    """One row's token under ``sampling`` with the key ``(seed, 0, position)``."""
    mask = torch.zeros((1, values.shape[-1]), dtype=torch.bool)
    for i in seen:
        if i < values.shape[-1]:
            mask[0, i] = True
    token = next_tokens(
        values.unsqueeze(0),
        [sampling],
        [DrawKey(seed, 0, position)],
        seen=mask,
        produced=[produced],
        stop_ids=stop_ids,
    )
    return int(token[0])


@settings(max_examples=400, deadline=None, derandomize=True)
@given(logits=LOGITS, temperature=TEMPERATURE, top_p=TOP_P)
def test_every_schema_valid_setting_draws_a_token(logits, temperature, top_p):
    values = torch.tensor(logits, dtype=torch.float32)
    token = choose(values, Sampling(temperature=temperature, top_p=top_p))
    assert 0 <= token < len(logits)
    if temperature == 0 or not torch.isfinite((values / temperature).max()):
        assert token == int(torch.argmax(values))  # greedy: the first maximum


def test_ordinary_temperatures_sample_softmax_of_logits_over_temperature():
    values = torch.tensor([1.0, 0.5, -0.25, 2.0])
    draws = 6000
    rows = values.expand(draws, -1).contiguous()
    for temperature in (0.3, 1.0, 1.7):
        keys = [DrawKey(11, 0, position) for position in range(draws)]
        tokens = next_tokens(rows, [Sampling(temperature=temperature)] * draws, keys)
        counts = torch.bincount(tokens, minlength=4).double()
        p = torch.softmax(values.double() / temperature, -1)
        z = (counts - draws * p) / (draws * p * (1 - p)).sqrt().clamp_min(1e-9)
        assert z.abs().max() < 4.5, (temperature, counts.tolist(), (draws * p).tolist())  # fixed keys: deterministic


def test_a_draw_is_a_function_of_its_logits_and_key_alone():
    torch.manual_seed(0)
    logits = torch.randn(6, 3000) * 4
    samplings = [Sampling(temperature=t, top_p=p, top_k=k) for t, p, k in
                 ((1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 1.0, 50), (0.0, 1.0, 0), (1.0, 0.5, 10), (2.0, 1.0, 0))]  # fmt: skip
    keys = [DrawKey(7, row, 3) for row in range(6)]
    together = next_tokens(logits, samplings, keys).tolist()
    alone = [int(next_tokens(logits[r : r + 1], samplings[r : r + 1], keys[r : r + 1])[0]) for r in range(6)]
    assert together == alone
    reordered = next_tokens(logits.flip(0), samplings[::-1], keys[::-1]).tolist()
    assert reordered[::-1] == together
    other_position = next_tokens(logits, samplings, [DrawKey(7, row, 4) for row in range(6)]).tolist()
    assert other_position != together  # the key moves the draw: the comparison can fail
    assert DrawKey(7, 1, 3).uniforms() == DrawKey(7, 1, 3).uniforms() != DrawKey(7, 2, 3).uniforms()


def test_draws_are_the_same_at_any_thread_count():
    script = (
        "import torch, sys\n"
        "torch.set_num_threads(int(sys.argv[1]))\n"
        "from kiln.model import DrawKey, Sampling, next_tokens\n"
        "g = torch.Generator().manual_seed(3)\n"
        "logits = torch.randn(8, 40000, generator=g) * 3\n"
        "s = [Sampling(temperature=0.9, top_p=0.95, top_k=0, min_p=0.01)] * 8\n"
        "print(next_tokens(logits, s, [DrawKey(5, r, 9) for r in range(8)]).tolist())\n"
    )
    found = {
        subprocess.run([sys.executable, "-c", script, str(n)], capture_output=True, text=True, check=True).stdout
        for n in (1, 2)
    }
    assert len(found) == 1


@pytest.mark.cuda
def test_a_draw_on_cuda_is_the_draw_on_the_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(1)
    logits = torch.randn(16, 50000) * 3
    samplings = [
        Sampling(temperature=0.2 + 0.1 * r, top_p=0.9, top_k=40 if r % 2 else 0, min_p=0.02) for r in range(16)
    ]
    keys = [DrawKey(9, r, r) for r in range(16)]
    cpu = next_tokens(logits, samplings, keys).tolist()
    cuda = next_tokens(logits.cuda(), samplings, keys).cpu().tolist()
    assert cpu == cuda


@pytest.mark.parametrize("temperature", [1e-40, 1.1e-38, 5e-324])
def test_a_tiny_temperature_answers_greedily_on_chat_and_its_stream(
    trained_adapter, tiny_model_dir, tmp_path, temperature
):
    import shutil

    from kiln.model import load_base_model
    from kiln.server._generation import Generator
    from kiln.server._openai import chat_chunks, chat_completion

    registry = tmp_path / "adapters"
    shutil.copytree(trained_adapter, registry / "bot")
    gen = Generator(load_base_model(tiny_model_dir), registry, "kiln-tiny")
    body = {"messages": [{"role": "user", "content": "How do I reset my password?"}], "max_tokens": 6}
    greedy = chat_completion(gen, {**body, "temperature": 0})["choices"][0]["message"]["content"]
    tiny = chat_completion(gen, {**body, "temperature": temperature, "seed": 3})["choices"][0]["message"]["content"]
    assert tiny == greedy
    chunks = list(chat_chunks(gen, {**body, "temperature": temperature, "stream": True}))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == greedy
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


# --- every sampling setting a serving request can give (vLLM's top_k, min_p, min_tokens, repetition_penalty) ---

SETTINGS = st.builds(
    Sampling,
    temperature=TEMPERATURE,
    top_p=TOP_P,
    top_k=st.integers(0, 50),
    min_p=st.floats(0, 1),
    repetition_penalty=st.one_of(st.floats(0.01, 100), st.sampled_from([0.01, 1.0, 100.0])),
    min_tokens=st.integers(0, 5),
)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(logits=LOGITS, sampling=SETTINGS, seen=st.lists(st.integers(0, 45), max_size=8), produced=st.integers(0, 5))
def test_every_schema_valid_setting_of_every_field_draws_a_token(logits, sampling, seen, produced):
    values = torch.tensor(logits, dtype=torch.float32)
    stops = {0, 1}
    token = choose(values, sampling, seen=seen, produced=produced, stop_ids=stops)
    assert 0 <= token < len(logits)
    if produced < sampling.min_tokens and len(logits) > 2:
        assert token not in stops  # min_tokens holds the stop ids back


def test_top_k_one_and_min_p_one_are_greedy_at_any_temperature():
    values = torch.tensor([0.1, 2.0, 1.9, -3.0])
    for seed in range(40):
        assert choose(values, Sampling(temperature=2.0, top_k=1), seed) == 1
        assert choose(values, Sampling(temperature=2.0, min_p=1.0), seed) == 1


def test_top_k_keeps_exactly_the_k_most_likely_tokens():
    values = torch.tensor([0.0, 3.0, 2.0, 1.0, 2.5])
    drawn = {choose(values, Sampling(temperature=2.0, top_k=2), s) for s in range(200)}
    assert drawn == {1, 4}


def test_top_p_keeps_the_nucleus_and_always_the_most_likely_token():
    values = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert {choose(values, Sampling(temperature=1.0, top_p=0.7), s) for s in range(300)} == {0, 1}
    assert {choose(values, Sampling(temperature=1.0, top_p=1e-9), s) for s in range(50)} == {0}


def test_min_p_drops_tokens_below_its_share_of_the_most_likely():
    values = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    drawn = {choose(values, Sampling(temperature=1.0, min_p=0.25), s) for s in range(300)}
    assert drawn == {0, 1, 2}  # 0.05 < 0.25 * 0.5


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    values = torch.tensor([2.0, 1.5, -1.0, -0.5])
    assert choose(values, Sampling()) == 0
    assert choose(values, Sampling(repetition_penalty=2.0), seen=[0]) == 1  # 2.0 / 2 = 1.0 < 1.5
    assert choose(torch.tensor([-1.0, -0.6]), Sampling(repetition_penalty=2.0), seen=[1]) == 0  # -1.2 < -1.0
    assert choose(values, Sampling(repetition_penalty=0.5), seen=[1]) == 1  # 1.5 / 0.5 = 3.0: encouraged


def test_min_tokens_masks_the_stop_ids_until_enough_tokens_then_lets_them_through():
    values = torch.tensor([5.0, 1.0, 0.5])
    assert choose(values, Sampling(min_tokens=2), produced=1, stop_ids={0}) == 1
    assert choose(values, Sampling(min_tokens=2), produced=2, stop_ids={0}) == 0
    assert choose(torch.tensor([5.0]), Sampling(min_tokens=2), produced=0, stop_ids={0}) == 0  # nothing else
