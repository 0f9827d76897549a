"""Batched decoding: sequences that share steps give, bit for bit, what each gives decoded alone.

"Alone" is a sequence consumed to its end before the next one is submitted: the scheduler then runs the invariant
forward on that one row. "Together" is every sequence submitted before the first is read,
so the composition of each step is fixed by the test, not by thread timing; the scheduler's counters prove the
sequences shared their steps. Concurrency from threads is made deterministic the same way: the test holds the
model lock until every request has submitted its choices.
"""

from __future__ import annotations

import dataclasses
import gc
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from kiln.errors import AdapterError, InternalError
from kiln.model import Batch, Sampling, load_base_model
from kiln.server._batching import Lora
from kiln.server._generation import Generator, Outcome, Plan
from kiln.server._openai import chat_chunks, chat_completion, completion
from kiln.server._teacher_protocol import TeacherProtocol

TEXTS = (
    "hi",
    "How do I reset my password?",
    "Question: What is the capital of France? Answer: The capital of France is Paris. And of Italy?",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\nWhat does this print, line by line?",
)
GREEDY = Sampling()
SAMPLED = Sampling(temperature=1.0)
VLLM = Sampling(temperature=0.8, top_p=0.9, top_k=40, min_p=0.02, repetition_penalty=1.3, min_tokens=6)


@pytest.fixture
def gen(tmp_path, tiny_model_dir, trained_adapter):
    registry = tmp_path / "adapters"
    shutil.copytree(trained_adapter, registry / "bot")
    return Generator(load_base_model(tiny_model_dir), registry, "kiln-tiny")


def _plan(gen, text, *, adapter=None, sampling=GREEDY, seed=0, max_new=20):
    return Plan(gen._encode_prompt([{"role": "user", "content": text}]), max_new, sampling, seed, adapter, "kiln-tiny")


def _read(pieces, outcome):
    """What a route makes of a choice: its text, its tokens with their scores, how and after how many tokens it
    ended."""
    pieces = list(pieces)
    tokens = [t for p in pieces for t in p.tokens]
    return "".join(p.text for p in pieces), tokens, outcome.finish_reason, outcome.completion_tokens


def _alone(gen, plan, top_k=None, first=None):
    outcome = Outcome()
    return _read(gen.pieces(plan, outcome, top_k=top_k, first=first), outcome)


def _together(gen, plans, top_k=None):
    outcomes = [Outcome() for _ in plans]
    started = [gen.pieces(plan, outcome, top_k=top_k) for plan, outcome in zip(plans, outcomes, strict=True)]
    return [_read(pieces, outcome) for pieces, outcome in zip(started, outcomes, strict=True)]


def _poisoned(adapter):
    """``adapter`` with one LoRA B entry NaN: every forward through it gives NaN logits."""
    first, *rest = adapter.layers
    b = first.b.clone()
    b[0, 0] = float("nan")
    return dataclasses.replace(adapter, name="poisoned", layers=(Lora(first.path, first.a, b, first.scale), *rest))


# --- the guarantee, sequence by sequence ----------------------------------------------------------


def test_sequences_decoded_together_equal_each_decoded_alone_bit_for_bit(gen):
    bot = gen.adapter_named("bot")
    plans = [  # 40 tokens: the greedy base answer to TEXTS[1] ends with an end-of-turn token at its 40th
        _plan(gen, text, adapter=adapter, sampling=sampling, seed=seed, max_new=40)
        for seed, (text, adapter, sampling) in enumerate(
            (text, adapter, sampling)
            for text in TEXTS
            for adapter, sampling in ((None, GREEDY), (bot, SAMPLED), (None, VLLM), (bot, VLLM))
        )
    ]
    alone = [_alone(gen, plan, top_k=3) for plan in plans]
    assert gen.scheduler.widest == 1
    together = _together(gen, plans, top_k=3)
    assert gen.scheduler.widest == len(plans)  # every sequence was in the first decoding step
    assert together == alone
    assert {reason for _, _, reason, _ in alone} == {"stop", "length"}
    assert len({text for text, _, _, _ in alone}) > len(TEXTS)  # weights and sampling changed the answers
    assert all(t.logprob is not None and len(t.top) == 3 for _, tokens, _, _ in alone for t in tokens)


def test_a_request_with_n_choices_decodes_them_together_as_n_requests_decode_alone(gen):
    body = {"messages": [{"role": "user", "content": TEXTS[1]}], "max_tokens": 16, "min_tokens": 16}
    fields = {"temperature": 0.9, "top_k": 50, "repetition_penalty": 1.1, "logprobs": True, "top_logprobs": 2}
    batched = chat_completion(gen, {**body, **fields, "n": 4, "seed": 11})
    assert (gen.scheduler.steps, gen.scheduler.stepped, gen.scheduler.widest) == (15, 60, 4)  # one forward a step
    for i, choice in enumerate(batched["choices"]):
        alone = chat_completion(gen, {**body, **fields, "seed": 11 + i})["choices"][0]
        assert choice == {**alone, "index": i}
    assert gen.scheduler.widest == 4
    assert len({c["message"]["content"] for c in batched["choices"]}) > 1


def test_every_choice_of_every_prompt_of_a_completions_request_decodes_together(gen):
    loaded = SimpleNamespace(model=gen._model, tokenizer=gen._tokenizer)
    protocol = TeacherProtocol(gen, loaded.tokenizer, "kiln-tiny", None, 627, 4096, 0)
    server = SimpleNamespace(generator=gen, teacher_protocol=protocol)
    prompts = ["Open Settings, choose", "The quick brown fox", "Question: What is the capital of"]
    body = {
        "model": "kiln-tiny",
        "max_tokens": 10,
        "temperature": 1.0,
        "echo": True,
        "logprobs": 2,
    }  # `first` picks token 0
    batched = completion(server, {**body, "prompt": prompts, "n": 2, "seed": 5})
    assert gen.scheduler.widest == 6
    for index, choice in enumerate(batched["choices"]):
        prompt, i = divmod(index, 2)
        alone = completion(server, {**body, "prompt": prompts[prompt], "seed": 5 + i})["choices"][0]
        assert choice == {**alone, "index": index}


def test_a_sequence_admitted_mid_decode_equals_it_decoded_alone(gen):
    early = _plan(gen, TEXTS[2], sampling=SAMPLED, seed=3, max_new=30)
    late = _plan(gen, TEXTS[0], adapter=gen.adapter_named("bot"), sampling=VLLM, seed=4)
    expected = [_alone(gen, early, top_k=1), _alone(gen, late, top_k=1)]
    outcomes = [Outcome(), Outcome()]
    first = gen.pieces(early, outcomes[0], top_k=1)
    head = [next(first) for _ in range(3)]  # `early` decodes alone for a few steps
    assert gen.scheduler.running() == 1
    second = gen.pieces(late, outcomes[1], top_k=1)
    got = [_read([*head, *first], outcomes[0]), _read(second, outcomes[1])]
    assert gen.scheduler.widest == 2
    assert got == expected


def test_a_sequence_whose_logits_turn_non_finite_fails_alone_and_the_others_decode_on(gen):
    import torch

    bot = gen.adapter_named("bot")
    poisoned = _poisoned(bot)
    healthy = [_plan(gen, TEXTS[1]), _plan(gen, TEXTS[3], adapter=bot, sampling=SAMPLED, seed=8)]
    expected = [_alone(gen, plan, top_k=2) for plan in healthy]
    prompt = healthy[0].prompt_ids
    with torch.inference_mode():  # finite log-probabilities of the first token (what prompt scoring hands over)
        first = torch.log_softmax(gen._model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    sick = [_plan(gen, TEXTS[1], adapter=poisoned), _plan(gen, TEXTS[2], adapter=poisoned)]
    outcomes = [Outcome() for _ in range(4)]
    streams = [
        gen.pieces(healthy[0], outcomes[0], top_k=2),
        gen.pieces(sick[0], outcomes[1], first=first),  # joins the batch, then its first step's logits are NaN
        gen.pieces(sick[1], outcomes[2]),  # its prompt's logits are NaN
        gen.pieces(healthy[1], outcomes[3], top_k=2),
    ]
    for failing in streams[1:3]:
        with pytest.raises(AdapterError, match="'poisoned' produced non-finite logits") as caught:
            list(failing)
        assert caught.value.code == "adapter_invalid"
    assert gen.scheduler.widest == 3  # the poisoned row's failing step was shared with both healthy rows
    assert [_read(streams[0], outcomes[0]), _read(streams[3], outcomes[3])] == expected


def test_a_forward_that_raises_ends_the_sequences_it_carried_and_decoding_goes_on(gen, monkeypatch):
    plans = [_plan(gen, TEXTS[0]), _plan(gen, TEXTS[1], adapter=gen.adapter_named("bot"))]
    expected = [_alone(gen, plan) for plan in plans]

    def broken(self, tokens, weights=None):
        raise RuntimeError("the step broke")

    with monkeypatch.context() as patched:
        patched.setattr(Batch, "step", broken)
        streams = [gen.pieces(plan, Outcome()) for plan in plans]
        for stream in streams:
            with pytest.raises(InternalError, match="decoding failed: RuntimeError: the step broke"):
                list(stream)
    assert gen.scheduler.running() == 0
    assert _together(gen, plans) == expected  # nothing of the failed step is left behind


def test_a_consumer_that_stops_reading_never_stalls_the_others(gen):
    slow, quick = _plan(gen, TEXTS[3], sampling=SAMPLED, seed=1), _plan(gen, TEXTS[1], max_new=30)
    expected = [_alone(gen, slow), _alone(gen, quick)]
    outcomes = [Outcome(), Outcome()]
    waiting, reading = gen.pieces(slow, outcomes[0]), gen.pieces(quick, outcomes[1])
    head = next(waiting)
    assert _read(reading, outcomes[1]) == expected[1]  # decoded to its end while `slow` was not read
    assert gen.scheduler.widest == 2
    assert _read([head, *waiting], outcomes[0]) == expected[0]  # its tokens waited for it


def test_a_closed_or_dropped_consumer_frees_its_row(gen):
    plans = [_plan(gen, text, max_new=40, sampling=Sampling(min_tokens=40)) for text in TEXTS[:3]]
    streams = [gen.pieces(plan, Outcome()) for plan in plans]
    for stream in streams:
        next(stream)
    assert gen.scheduler.running() == 3
    streams[1].close()  # a client that disconnects: the generator chain is closed
    assert gen.scheduler.running() == 2
    del streams[0]  # or dropped
    gc.collect()
    assert gen.scheduler.running() == 1
    never_read = gen.pieces(_plan(gen, TEXTS[0]), Outcome())  # submitted, then dropped before any step
    del never_read
    gc.collect()
    steps, stepped = gen.scheduler.steps, gen.scheduler.stepped
    list(streams[-1])
    assert gen.scheduler.steps - steps > 0
    assert gen.scheduler.stepped - stepped == gen.scheduler.steps - steps  # every step advanced the reader's row only
    assert gen.scheduler.running() == 0


def test_concurrent_requests_from_threads_answer_as_sequential_calls(gen, monkeypatch):
    bot = "bot"
    bodies = [
        {"messages": [{"role": "user", "content": text}], "max_tokens": 12, "min_tokens": 12, "n": 2, "seed": i}
        | ({"adapter": bot, "temperature": 0.7} if i % 2 else {"logprobs": True, "top_logprobs": 1})
        for i, text in enumerate(TEXTS)
    ]
    expected = [chat_completion(gen, body) for body in bodies]
    submitted = threading.Semaphore(0)
    submit = gen.scheduler.submit

    def counted(*args, **kwargs):
        stream = submit(*args, **kwargs)
        submitted.release()
        return stream

    monkeypatch.setattr(gen.scheduler, "submit", counted)
    with ThreadPoolExecutor(len(bodies)) as pool:
        with gen.lock:  # no forward runs until every request has submitted its choices
            futures = [pool.submit(chat_completion, gen, body) for body in bodies]
            for _ in range(2 * len(bodies)):
                assert submitted.acquire(timeout=120)
        answers = [future.result(timeout=300) for future in futures]
    assert gen.scheduler.widest == 2 * len(bodies)
    for answer, alone in zip(answers, expected, strict=True):
        assert (answer["choices"], answer["usage"], answer["kiln"]) == (alone["choices"], alone["usage"], alone["kiln"])


def test_a_stream_interleaves_its_choices_in_a_fixed_turn_order(gen):
    body = {"messages": [{"role": "user", "content": TEXTS[1]}], "max_tokens": 12, "temperature": 1.0, "seed": 2}
    whole = chat_completion(gen, {**body, "n": 3})
    chunks = list(chat_chunks(gen, {**body, "n": 3, "stream": True, "stream_options": {"include_usage": True}}))
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
    assert all(c["choices"][0]["delta"] == {"role": "assistant", "content": ""} for c in chunks[:3])
    assert "kiln" in chunks[0]
    assert all("kiln" not in c for c in chunks[1:])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == whole["usage"]
    texts, finished, order = {0: "", 1: "", 2: ""}, {}, []
    for chunk in chunks[3:-1]:
        (choice,) = chunk["choices"]
        assert choice["index"] not in finished  # nothing after a choice's finish chunk
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finished[choice["index"]] = choice["finish_reason"]
        order.append(choice["index"])
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert finished == {c["index"]: c["finish_reason"] for c in whole["choices"]}
    assert order[:3] == [0, 1, 2]  # one increment of each choice in turn
    again = list(chat_chunks(gen, {**body, "n": 3, "stream": True, "stream_options": {"include_usage": True}}))
    assert [c["choices"] for c in again] == [c["choices"] for c in chunks]


def test_a_model_without_an_invariant_forward_decodes_each_sequence_alone_with_its_own_weights(
    tmp_path, tiny_model_dir, trained_adapter
):
    """A family the invariant forward does not implement (Phi) falls back, visibly: each row runs alone through the
    model's own forward, with its own cache and its adapter's hooks."""
    from _architectures import build

    directory = build("phi", tmp_path / "phi")
    loaded = load_base_model(directory)
    registry = tmp_path / "adapters"
    registry.mkdir()
    gen = Generator(loaded, registry, "phi")
    assert gen.scheduler.fallback is not None
    assert "Phi" in gen.scheduler.fallback
    plans = [_plan(gen, TEXTS[1]), _plan(gen, TEXTS[2], sampling=SAMPLED, seed=1), _plan(gen, TEXTS[0], seed=2)]
    alone = [_alone(gen, plan, top_k=1) for plan in plans]
    assert _together(gen, plans, top_k=1) == alone
    assert gen.scheduler.widest == len(plans)


# --- the batch under it -----------------------------------------------------------------------------


def _lone_logits(model, prompt, tokens):
    """The logits of each step of ``prompt`` decoded alone in a batch of its own, fed ``tokens``."""
    import torch

    batch = Batch(model)
    with torch.inference_mode():
        rows = [batch.join([(0, prompt, None)])[0]]
        for token in tokens[:-1]:
            rows.append(batch.step([token])[0])
    return rows


def _full_logits(model, prompt, tokens):
    """The same positions from one forward of the whole sequence (what a trainer runs): row p predicts token p+1."""
    import torch

    from kiln.model import decoder_for

    decoder = decoder_for(model)
    with torch.no_grad():
        hidden = decoder.hidden(torch.tensor([prompt + tokens[:-1]]))[0]
        logits = decoder.logits(hidden)
    return [logits[len(prompt) - 1 + i] for i in range(len(tokens))]


def _staggered(model, prompts, tokens):
    """Each prompt joins one ``Batch`` one step after the previous one, the second leaves half-way; returns every
    row's logits per step and how many rows the widest step held."""
    import torch

    batch, got, widest = Batch(model), {r: [] for r in range(len(prompts))}, 0
    with torch.inference_mode():
        for step in range(len(tokens[0]) + len(prompts)):
            if batch.rows:
                widest = max(widest, len(batch.rows))
                rows = list(batch.rows)
                for r, logits in zip(rows, batch.step([tokens[r][len(got[r]) - 1] for r in rows]), strict=True):
                    got[r].append(logits)
            keep = {r for r in batch.rows if len(got[r]) < (len(tokens[r]) if r != 1 else len(tokens[r]) // 2)}
            batch.retain(keep)
            if step < len(prompts):
                got[step].append(batch.join([(step, prompts[step], None)])[0])
    return got, widest


def _same_bits(model, steps=10, lengths=(3, 11, 26, 7, 70)):
    import torch

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 600, (n,), generator=generator).tolist() for n in lengths]
    tokens = [torch.randint(0, 600, (steps,), generator=generator).tolist() for _ in lengths]
    got, widest = _staggered(model, prompts, tokens)
    assert widest == len(prompts)
    for r, prompt in enumerate(prompts):
        lone = _lone_logits(model, prompt, tokens[r])
        full = _full_logits(model, prompt, tokens[r])
        assert len(got[r]) > 1
        assert all(torch.equal(a, b) for a, b in zip(got[r], lone, strict=False)), f"row {r} differs from alone"
        assert all(torch.equal(a, b) for a, b in zip(lone, full, strict=True)), f"row {r} differs from one forward"


def test_batch_logits_are_the_lone_and_the_full_forward_logits_bit_for_bit_on_the_tiny_model(tiny_model_dir):
    _same_bits(load_base_model(tiny_model_dir).model)


@pytest.mark.parametrize("architecture", ["gpt2", "llama", "qwen3"])
def test_batch_logits_are_the_lone_and_the_full_forward_logits_bit_for_bit_on_other_architectures(architecture):
    """GPT-2 normalises with LayerNorm and activates with tanh; Qwen3 normalises its queries and keys; the
    70-token prompt crosses a key chunk of the attention."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if architecture == "gpt2":
        config = GPT2Config(vocab_size=627, n_positions=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                            eos_token_id=0)  # fmt: skip
        model = GPT2LMHeadModel(config)
    elif architecture == "llama":
        config = LlamaConfig(vocab_size=627, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
        model = LlamaForCausalLM(config)
    else:
        config = Qwen3Config(vocab_size=627, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
        model = Qwen3ForCausalLM(config)
    _same_bits(model.eval())
