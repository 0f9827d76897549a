"""The OpenAI-compatible surface driven with the official ``openai`` client: models, chat and
completions, non-streaming and streaming, against an in-process server on the tiny model whose
registry holds the trained adapter ``bot``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

BASE = "kiln-tiny"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "How do I reset my password?"},
]
TEXT = "Open Settings, choose Security, then"
REFERENCE = Path(__file__).resolve().parents[1] / ".." / "shared" / "upstream" / "contracts"


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir, trained_adapter):
    from fastapi.testclient import TestClient

    from kiln.host.config import resolve_settings
    from kiln.server._app import build_server, create_app

    home = tmp_path_factory.mktemp("serve") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(home))
        settings = resolve_settings({"paths.home": str(home), "model.path": str(tiny_model_dir)})
        settings.registry.mkdir(parents=True)
        shutil.copytree(trained_adapter, settings.registry / "bot")
        server = build_server(settings)
        with TestClient(create_app(server)) as http:
            yield server, http


@pytest.fixture(scope="module")
def client(served):
    _, http = served
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _chat(client, **fields):
    return client.chat.completions.create(model=fields.pop("model", BASE), messages=MESSAGES, **fields)


def _ids(server, text):
    return server.generator._tokenizer(text, add_special_tokens=False)["input_ids"]


# --- models ---------------------------------------------------------------------------------


def test_models_list_the_base_model_and_every_loadable_adapter(client, server):
    cards = {card.id: card for card in client.models.list()}
    assert list(cards) == [BASE, "bot"]
    base, bot = cards[BASE], cards["bot"]
    assert base.object == bot.object == "model"
    assert base.owned_by == bot.owned_by == "kiln"
    assert isinstance(base.created, int)
    assert isinstance(bot.created, int)
    assert base.max_model_len == bot.max_model_len == server.generator._max_positions
    assert (base.parent, base.root) == (None, BASE)
    assert (bot.parent, bot.root) == (BASE, BASE)
    assert base.teacher_identity["served_model_id"] == BASE
    assert "teacher_identity" not in bot.model_extra


def test_models_retrieve_answers_one_card_or_not_found(client):
    assert client.models.retrieve("bot").parent == BASE
    assert client.models.retrieve(BASE).max_model_len > 0
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("gpt-4o-mini")
    assert refused.value.status_code == 404
    assert "gpt-4o-mini" in str(refused.value)


def test_a_quarantined_adapter_is_not_listed(served, client):
    server, _ = served
    target = server.registry / "held"
    shutil.copytree(server.registry / "bot", target)
    try:
        assert [card.id for card in client.models.list()] == [BASE, "bot", "held"]
        (target / "adapter_canary_status.json").write_text("not json")  # an unreadable canary counts as quarantined
        assert [card.id for card in client.models.list()] == [BASE, "bot"]
    finally:
        shutil.rmtree(target)


@pytest.mark.skipif(not REFERENCE.is_dir(), reason="the reference contracts (../shared) are not present")
def test_model_cards_carry_what_the_reference_models_response_requires(client):
    schema = json.loads((REFERENCE / "kiln-observability-v1.schema.json").read_text(encoding="utf-8"))
    info = schema["$defs"]["ModelInfo"]
    listing = client.models.list()
    assert listing.object == schema["$defs"]["ModelsResponse"]["properties"]["object"]["const"]
    for card in listing.data:
        doc = card.model_dump()
        for name in info["required"]:
            assert name in doc, name
            const = info["properties"][name].get("const")
            assert const is None or doc[name] == const, name


# --- chat -----------------------------------------------------------------------------------


def test_chat_greedy_choices_are_equal_and_usage_counts_the_rendered_prompt(client, server):
    answer = _chat(client, n=2, max_tokens=12)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].message.content == answer.choices[1].message.content
    assert answer.choices[0].message.content
    prompt = server.generator._encode_prompt(MESSAGES)
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens <= 24
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    assert answer.model == BASE
    assert answer.model_extra["kiln"] == {"adapter": None, "adapter_manifest_sha256": None}


def test_chat_seeds_make_sampling_reproducible_and_choice_i_uses_seed_plus_i(client):
    one = _chat(client, temperature=1.0, seed=5, max_tokens=12, n=2)
    again = _chat(client, temperature=1.0, seed=5, max_tokens=12, n=2)
    assert [c.message.content for c in one.choices] == [c.message.content for c in again.choices]
    second = _chat(client, temperature=1.0, seed=6, max_tokens=12)
    assert one.choices[1].message.content == second.choices[0].message.content
    draws = {_chat(client, temperature=1.0, seed=s, max_tokens=12).choices[0].message.content for s in range(4)}
    assert len(draws) > 1


def test_an_unseeded_sampled_answer_reports_its_seed_and_the_seed_reproduces_it(client):
    raw = client.chat.completions.with_raw_response.create(
        model=BASE, messages=MESSAGES, temperature=1.0, max_tokens=12
    )
    answer = raw.parse()
    seed = raw.headers["x-kiln-seed"]
    assert answer.system_fingerprint == f"kiln-seed-{seed}"
    again = _chat(client, temperature=1.0, max_tokens=12, seed=int(seed))
    assert again.choices[0].message.content == answer.choices[0].message.content
    greedy = client.chat.completions.with_raw_response.create(model=BASE, messages=MESSAGES, max_tokens=4)
    assert "x-kiln-seed" not in greedy.headers
    assert greedy.parse().system_fingerprint is None
    stream = client.completions.with_raw_response.create(
        model=BASE, prompt="The capital of", temperature=0.7, max_tokens=4, stream=True
    )
    chunks = list(stream.parse())
    assert {c.system_fingerprint for c in chunks} == {f"kiln-seed-{stream.headers['x-kiln-seed']}"}


def test_chat_stop_cuts_the_text_before_the_stop_sequence(client):
    full = _chat(client, max_tokens=24).choices[0].message.content
    assert len(full) >= 6
    stop = full[3:5]
    cut = full[: full.index(stop)]
    answer = _chat(client, max_tokens=24, stop=stop)
    assert answer.choices[0].message.content == cut
    assert answer.choices[0].finish_reason == "stop"
    listed = _chat(client, max_tokens=24, stop=["never-in-the-text", stop])
    assert listed.choices[0].message.content == cut
    assert answer.usage.completion_tokens < 24


def test_chat_max_completion_tokens_bounds_the_answer(client):
    answer = _chat(client, max_completion_tokens=3)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 3
    assert _chat(client, max_completion_tokens=3, max_tokens=20).usage.completion_tokens == 3  # the newer name wins


def test_chat_logprobs_give_each_content_token_with_its_top_alternatives(client):
    answer = _chat(client, max_tokens=8, logprobs=True, top_logprobs=3)
    choice = answer.choices[0]
    content = choice.logprobs.content
    assert len(content) == answer.usage.completion_tokens - (choice.finish_reason == "stop")
    assert "".join(t.token for t in content) == choice.message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        values = [alt.logprob for alt in token.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert token.logprob == values[0]  # greedy picks the most likely token
        assert token.token == token.top_logprobs[0].token
        assert bytes(token.bytes) == token.token.encode("utf-8")
        assert all(v <= 0 for v in values)
    assert _chat(client, max_tokens=8).choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        _chat(client, max_tokens=8, top_logprobs=2)


def test_chat_streams_every_choice_and_a_final_usage_chunk(client):
    whole = _chat(client, max_tokens=10, n=2)
    chunks = list(_chat(client, max_tokens=10, n=2, stream=True, stream_options={"include_usage": True}))
    texts = {0: "", 1: ""}
    finished = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finished == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    plain = list(_chat(client, max_tokens=10, stream=True))
    assert all(chunk.usage is None for chunk in plain)


def test_chat_streams_logprobs_and_stops(client):
    whole = _chat(client, max_tokens=16, logprobs=True, top_logprobs=2)
    text = whole.choices[0].message.content
    stop = text[4:6]
    streamed = list(_chat(client, max_tokens=16, stream=True, stop=stop, logprobs=True, top_logprobs=2))
    joined = "".join(c.choices[0].delta.content or "" for c in streamed)
    assert joined == text[: text.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"
    tokens = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in tokens] == [t.token for t in whole.choices[0].logprobs.content[: len(tokens)]]


def test_chat_model_names_an_adapter_like_vllm_and_unknown_models_are_not_found(client, trained_adapter):
    from safetensors.torch import load_file

    weights = load_file(trained_adapter / "adapter_model.safetensors")
    assert any(float(t.abs().sum()) > 0 for k, t in weights.items() if ".lora_B." in k)  # the adapter changes output
    base = _chat(client, max_tokens=6, logprobs=True)
    bot = _chat(client, model="bot", max_tokens=6, logprobs=True)
    assert bot.model == "bot"
    assert bot.model_extra["kiln"]["adapter"] == "bot"
    assert bot.model_extra["kiln"]["adapter_manifest_sha256"].startswith("sha256:")
    assert [t.logprob for t in bot.choices[0].logprobs.content] != [t.logprob for t in base.choices[0].logprobs.content]
    extension = _chat(client, max_tokens=6, logprobs=True, extra_body={"adapter": "bot"})
    assert extension.model_extra["kiln"]["adapter"] == "bot"
    assert extension.choices[0].logprobs.content == bot.choices[0].logprobs.content
    with pytest.raises(openai.NotFoundError, match="gpt-4o-mini"):
        _chat(client, model="gpt-4o-mini")
    with pytest.raises(openai.BadRequestError, match="inconsistent_fields"):
        _chat(client, model="bot", extra_body={"adapter": "other"})
    with pytest.raises(openai.BadRequestError, match="inconsistent_fields"):
        _chat(client, model="bot", extra_body={"base_model": True})


def test_chat_ignores_unknown_fields_and_refuses_features_it_cannot_honour(client):
    plain = _chat(client, max_tokens=4)
    extra = _chat(client, max_tokens=4, user="someone", extra_body={"some_vendor_field": {"x": 1}})
    assert extra.choices[0].message.content == plain.choices[0].message.content
    assert _chat(client, max_tokens=4, presence_penalty=0, frequency_penalty=0.0).choices
    for fields, name in (
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ):
        with pytest.raises(openai.BadRequestError, match=name) as refused:
            _chat(client, max_tokens=4, **fields)
        assert refused.value.status_code == 400
        assert refused.value.body["pointer"].startswith("/" + name)


def test_chat_accepts_text_parts_and_developer_messages(client):
    plain = _chat(client, max_tokens=6)
    parts = client.chat.completions.create(
        model=BASE,
        max_tokens=6,
        messages=[
            {"role": "developer", "content": "You are terse."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "How do I reset "}, {"type": "text", "text": "my password?"}],
            },
        ],
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content


# --- completions ----------------------------------------------------------------------------


def _complete(client, prompt, **fields):
    return client.completions.create(model=fields.pop("model", BASE), prompt=prompt, **fields)


def test_completions_generate_the_same_text_from_text_and_token_prompts(client, server):
    ids = _ids(server, TEXT)
    text = _complete(client, TEXT, max_tokens=8)
    tokens = _complete(client, ids, max_tokens=8)
    assert text.choices[0].text == tokens.choices[0].text
    assert text.usage.prompt_tokens == len(ids)
    assert text.usage.completion_tokens == 8 or text.choices[0].finish_reason == "stop"
    assert text.object == "text_completion"
    assert _complete(client, TEXT).usage.completion_tokens <= 16  # the default, as OpenAI's


def test_completions_answer_n_choices_per_prompt_in_prompt_order(client, server):
    prompts = [TEXT, "Yes: Settings, Account,"]
    answer = _complete(client, prompts, max_tokens=5, n=2)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    assert answer.choices[0].text == answer.choices[1].text  # greedy
    for i, prompt in enumerate(prompts):
        assert answer.choices[2 * i].text == _complete(client, prompt, max_tokens=5).choices[0].text
    assert answer.usage.prompt_tokens == sum(len(_ids(server, p)) for p in prompts)
    token_lists = _complete(client, [_ids(server, p) for p in prompts], max_tokens=5)
    assert [c.text for c in token_lists.choices] == [answer.choices[0].text, answer.choices[2].text]
    sampled = _complete(client, TEXT, max_tokens=8, n=2, temperature=1.0, seed=9)
    assert [c.text for c in sampled.choices] == [
        c.text for c in _complete(client, TEXT, max_tokens=8, n=2, temperature=1.0, seed=9).choices
    ]
    assert sampled.choices[1].text == _complete(client, TEXT, max_tokens=8, temperature=1.0, seed=10).choices[0].text


def test_completions_stop_cuts_the_text(client):
    full = _complete(client, TEXT, max_tokens=16).choices[0].text
    stop = full[3:5]
    answer = _complete(client, TEXT, max_tokens=16, stop=[stop])
    assert answer.choices[0].text == full[: full.index(stop)]
    many = [f"never-{i}" for i in range(10)] + [stop]  # more than OpenAI's 4, as harnesses send to vLLM
    assert _complete(client, TEXT, max_tokens=16, stop=many).choices[0].text == answer.choices[0].text
    assert answer.choices[0].finish_reason == "stop"


def test_completions_logprobs_use_the_legacy_layout(client):
    answer = _complete(client, TEXT, max_tokens=6, logprobs=2)
    choice = answer.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == answer.usage.completion_tokens - (choice.finish_reason == "stop")
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens, strict=False))
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert max(top.values()) == value  # greedy
        assert top[token] == value
        assert 1 <= len(top) <= 3
    assert _complete(client, TEXT, max_tokens=6).choices[0].logprobs is None


def test_echo_with_zero_max_tokens_scores_the_prompt_like_the_teacher_protocol(client, server):
    ids = _ids(server, TEXT)
    answer = _complete(client, TEXT, max_tokens=0, echo=True, logprobs=1, temperature=0)  # lm-eval's loglikelihood
    choice = answer.choices[0]
    assert choice.text == TEXT
    assert answer.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == answer.usage.prompt_tokens
    assert lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    teacher = _complete(client, ids, max_tokens=0, extra_body={"prompt_logprobs": 1})
    scores = teacher.choices[0].model_extra["prompt_logprobs"]
    assert scores[0] is None
    assert lp.token_logprobs[1:] == [scores[p][str(ids[p])]["logprob"] for p in range(1, len(ids))]
    assert all(math.isfinite(v) and v <= 0 for v in lp.token_logprobs[1:])
    for p in range(1, len(ids)):  # the one alternative is the most likely token at that position
        best = min(scores[p].values(), key=lambda e: e["rank"])
        assert max(lp.top_logprobs[p].values()) == best["logprob"]
        assert lp.top_logprobs[p][lp.tokens[p]] == lp.token_logprobs[p]


def test_echo_with_generation_prefixes_the_prompt(client):
    plain = _complete(client, TEXT, max_tokens=4, logprobs=0)
    echoed = _complete(client, TEXT, max_tokens=4, echo=True, logprobs=0)
    choice = echoed.choices[0]
    assert choice.text == TEXT + plain.choices[0].text
    n_prompt = echoed.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[n_prompt:] == plain.choices[0].logprobs.token_logprobs
    assert choice.logprobs.text_offset[n_prompt] == len(TEXT)


def test_completions_stream_text_logprobs_and_a_final_usage_chunk(client):
    whole = _complete(client, TEXT, max_tokens=8, n=2, logprobs=1, echo=True)
    chunks = list(
        _complete(
            client, TEXT, max_tokens=8, n=2, logprobs=1, echo=True, stream=True, stream_options={"include_usage": True}
        )
    )
    texts, token_logprobs, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs:
                token_logprobs[choice.index] += choice.logprobs.token_logprobs
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert token_logprobs == {c.index: c.logprobs.token_logprobs for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == []
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_completions_select_adapters_and_refuse_what_they_cannot_do(client):
    base = _complete(client, TEXT, max_tokens=0, echo=True, logprobs=0)
    bot = _complete(client, TEXT, model="bot", max_tokens=0, echo=True, logprobs=0)
    assert bot.model == "bot"
    assert bot.choices[0].logprobs.token_logprobs != base.choices[0].logprobs.token_logprobs
    with pytest.raises(openai.NotFoundError):
        _complete(client, TEXT, model="gpt-3.5-turbo-instruct")
    with pytest.raises(openai.BadRequestError, match="best_of"):
        _complete(client, TEXT, best_of=2)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        _complete(client, TEXT, suffix="after")
    with pytest.raises(openai.BadRequestError, match="out_of_range"):
        _complete(client, [10**6])
    assert _complete(client, TEXT, max_tokens=1, best_of=1, extra_body={"vendor_knob": 3}).choices


def test_streams_arrive_as_server_sent_events_over_a_real_socket(tmp_path, tiny_model_dir, client):
    from _server import ServerProcess

    with ServerProcess(tmp_path / "home", tiny_model_dir) as proc:
        remote = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
        chat = list(
            remote.chat.completions.create(
                model=BASE, messages=MESSAGES, max_tokens=6, stream=True, stream_options={"include_usage": True}
            )
        )
        text = list(_complete(remote, TEXT, max_tokens=6, stream=True, stream_options={"include_usage": True}))
        remote.close()
    assert (
        "".join(c.choices[0].delta.content or "" for c in chat[:-1])
        == _chat(client, max_tokens=6).choices[0].message.content
    )
    assert chat[-1].usage.completion_tokens == 6 or chat[-2].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in text[:-1]) == _complete(client, TEXT, max_tokens=6).choices[0].text
    assert text[-1].choices == []
    assert text[-1].usage.prompt_tokens == _complete(client, TEXT, max_tokens=6).usage.prompt_tokens


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_failure_after_the_stream_started_reaches_the_openai_client_as_an_error(served, client, monkeypatch, route):
    """The stream used to stop after its first chunk with no error and no [DONE]: the client saw one chunk with
    finish_reason None and no exception. Now the stream ends with an error event, then [DONE]."""
    from kiln.server import _openai

    name = "chat_chunks" if route == "chat" else "completion_chunks"
    original = getattr(_openai, name)

    def failing(*args, **kwargs):
        chunks = original(*args, **kwargs)
        yield next(chunks)
        raise RuntimeError("injected failure mid-stream")

    monkeypatch.setattr(_openai, name, failing)
    stream = (
        client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=6, stream=True)
        if route == "chat"
        else client.completions.create(model=BASE, prompt=TEXT, max_tokens=6, stream=True)
    )
    with pytest.raises(openai.APIError) as info:
        list(stream)
    assert "injected failure mid-stream" in str(info.value)
    _, http = served
    body = {"model": BASE, "max_tokens": 6, "stream": True}
    body |= {"messages": MESSAGES} if route == "chat" else {"prompt": TEXT}
    raw = http.post("/v1/chat/completions" if route == "chat" else "/v1/completions", json=body)
    events = [line.removeprefix("data: ") for line in raw.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["type"], error["param"]) == ("internal_error", "server_error", None)


def test_errors_carry_openais_type_and_param_for_the_official_client(client, served):
    """Kiln's pointer is mapped to OpenAI's ``param`` and the status to its ``type``: ``e.param`` and ``e.type``
    used to be None."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=BASE, messages=MESSAGES, temperature=5)
    assert (info.value.type, info.value.param, info.value.code) == (
        "invalid_request_error",
        "temperature",
        "out_of_range",
    )
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert missing.value.type == "not_found_error"
    _, http = served
    own = http.post("/v1/train/sft", json={"config": {"epochs": 0}}).json()["error"]
    assert "type" not in own  # Kiln's own routes keep Kiln's envelope
    assert "param" not in own


@pytest.mark.parametrize(
    ("document", "body", "code", "pointer", "words"),
    [
        ("ChatCompletionRequest", {"seed": -1}, "out_of_range", "/seed", "less than the minimum of 0"),
        ("ChatCompletionRequest", {"stop": ["a"] * 17}, "invalid_length", "/stop", "more than 16 items"),
        ("CompletionRequest", {"prompt": ["x"] * 65}, "invalid_length", "/prompt", "more than 64 items"),
        (
            "ChatCompletionRequest",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "wrong_const",
            "/messages/0/content/0/type",
            '"text" was expected',
        ),
    ],
)
def test_a_union_refusal_names_the_rule_of_the_branch_the_value_belongs_to(document, body, code, pointer, words):
    """These used to say '... is not of type "string"': the union's string branch, which the value never was."""
    from kiln import contracts

    base = (
        {"model": BASE, "messages": MESSAGES} if document == "ChatCompletionRequest" else {"model": BASE, "prompt": "x"}
    )
    found = {(p.code, p.pointer): p.message for p in contracts.problems(document, {**base, **body})}
    assert words in found[(code, pointer)]
    assert not any("is not of type" in message for message in found.values())
