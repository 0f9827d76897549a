"""Sampling numerics over the whole schema range (issue "Serving that real clients can rely on"): no temperature in
[0, 2] and no top_p in (0, 1] makes ``pick_token`` see inf or NaN; a temperature so small that logits / temperature
overflows is greedy, as 0 is; every other temperature draws exactly as softmax(logits / temperature) does. Checked
as a property (fixed seed, derandomized) and end to end on the served model: chat, completions and a stream."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from kiln.model import Sampling, choose, pick_token

LOGITS = st.lists(st.floats(-1e4, 1e4, allow_nan=False, width=32), min_size=1, max_size=40)
TEMPERATURE = st.one_of(
    st.floats(0, 2, allow_subnormal=True),
    st.sampled_from([0.0, 5e-324, 1e-45, 1.2e-38, 1e-38, 1e-37, 1e-30, 2.0]),
)
TOP_P = st.one_of(st.floats(0, 1, exclude_min=True, allow_subnormal=True), st.sampled_from([5e-324, 1e-300, 1.0]))


@settings(max_examples=400, deadline=None, derandomize=True)
@given(logits=LOGITS, temperature=TEMPERATURE, top_p=TOP_P)
def test_every_schema_valid_setting_draws_a_token(logits, temperature, top_p):
    values = torch.tensor(logits, dtype=torch.float32)
    token = pick_token(values, temperature, top_p, torch.Generator().manual_seed(0))
    assert 0 <= token < len(logits)
    if temperature == 0 or not torch.isfinite((values / temperature).max()):
        assert token == int(torch.argmax(values))  # greedy: the first maximum


def test_ordinary_temperatures_draw_exactly_as_softmax_of_logits_over_temperature():
    values = torch.tensor([1.0, 0.5, -0.25, 2.0])
    for temperature in (0.3, 1.0, 1.7):
        drawn = [pick_token(values, temperature, 1.0, torch.Generator().manual_seed(s)) for s in range(50)]
        expected = [
            int(
                torch.multinomial(
                    torch.softmax(values / temperature, -1), 1, generator=torch.Generator().manual_seed(s)
                )
            )
            for s in range(50)
        ]
        assert drawn == expected


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
    token = choose(values, sampling, torch.Generator().manual_seed(0), seen=seen, produced=produced, stop_ids=stops)
    assert 0 <= token < len(logits)
    if produced < sampling.min_tokens and len(logits) > 2:
        assert token not in stops  # min_tokens holds the stop ids back


@settings(max_examples=200, deadline=None, derandomize=True)
@given(logits=LOGITS, temperature=TEMPERATURE, top_p=TOP_P, seed=st.integers(0, 2**32))
def test_default_settings_draw_exactly_what_pick_token_draws(logits, temperature, top_p, seed):
    values = torch.tensor(logits, dtype=torch.float32)
    sampling = Sampling(temperature=temperature, top_p=top_p)
    chosen = choose(values, sampling, torch.Generator().manual_seed(seed), seen=[0, 1], produced=0, stop_ids={0})
    assert chosen == pick_token(values, temperature, top_p, torch.Generator().manual_seed(seed))


def test_top_k_one_and_min_p_one_are_greedy_at_any_temperature():
    values = torch.tensor([0.1, 2.0, 1.9, -3.0])
    for seed in range(40):
        assert choose(values, Sampling(temperature=2.0, top_k=1), torch.Generator().manual_seed(seed)) == 1
        assert choose(values, Sampling(temperature=2.0, min_p=1.0), torch.Generator().manual_seed(seed)) == 1


def test_top_k_keeps_exactly_the_k_most_likely_tokens():
    values = torch.tensor([0.0, 3.0, 2.0, 1.0, 2.5])
    drawn = {choose(values, Sampling(temperature=2.0, top_k=2), torch.Generator().manual_seed(s)) for s in range(200)}
    assert drawn == {1, 4}


def test_min_p_drops_tokens_below_its_share_of_the_most_likely():
    values = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    drawn = {
        choose(values, Sampling(temperature=1.0, min_p=0.25), torch.Generator().manual_seed(s)) for s in range(300)
    }
    assert drawn == {0, 1, 2}  # 0.05 < 0.25 * 0.5


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    values = torch.tensor([2.0, 1.5, -1.0, -0.5])
    assert choose(values, Sampling(), None) == 0
    assert choose(values, Sampling(repetition_penalty=2.0), None, seen=[0]) == 1  # 2.0 / 2 = 1.0 < 1.5
    assert choose(torch.tensor([-1.0, -0.6]), Sampling(repetition_penalty=2.0), None, seen=[1]) == 0  # -1.2 < -1.0
    assert choose(values, Sampling(repetition_penalty=0.5), None, seen=[1]) == 1  # 1.5 / 0.5 = 3.0: encouraged


def test_min_tokens_masks_the_stop_ids_until_enough_tokens_then_lets_them_through():
    values = torch.tensor([5.0, 1.0, 0.5])
    assert choose(values, Sampling(min_tokens=2), None, produced=1, stop_ids={0}) == 1
    assert choose(values, Sampling(min_tokens=2), None, produced=2, stop_ids={0}) == 0
    assert choose(torch.tensor([5.0]), Sampling(min_tokens=2), None, produced=0, stop_ids={0}) == 0  # nothing else
