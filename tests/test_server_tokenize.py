"""vLLM's tokenizer routes against a live ``kiln serve``: ``/tokenize`` gives the ids the generation routes feed
the model, ``/detokenize`` inverts it, ``/tokenizer_info`` describes the tokenizer -- and lm-evaluation-harness's
``local-completions`` model, given no ``tokenizer=`` argument, finds them and scores through them.
"""

from __future__ import annotations

import pytest
from _server import ServerProcess

from kiln import contracts
from kiln.model import load_base_model
from kiln.server._generation import Generator

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Spell <|im_end|> for me, then stop."},
]


def _valid(definition, doc):
    assert contracts.problems(definition, doc) == [], definition
    return doc


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """The live server and a client of it."""
    with ServerProcess(tmp_path_factory.mktemp("serve") / "home", tiny_model_dir) as proc, proc.client() as client:
        yield proc, client


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def http(served):
    return served[1]


@pytest.fixture(scope="module")
def model_id(http):
    return http.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def local(tiny_model_dir, tmp_path_factory):
    return Generator(load_base_model(tiny_model_dir), tmp_path_factory.mktemp("registry"), "kiln-tiny")


def _ok(http, path, body, definition):
    answer = http.post(path, json=body)
    assert answer.status_code == 200, answer.text
    return _valid(definition, answer.json())


def _refused(http, path, body, status, code):
    answer = http.post(path, json=body)
    assert answer.status_code == status, answer.text
    error = _valid("ErrorEnvelope", answer.json())["error"]
    assert error["code"] == code, error
    assert "type" in error
    assert "param" in error
    return error


def test_tokenize_gives_the_ids_the_chat_route_feeds_the_model(http, local):
    answer = _ok(http, "/tokenize", {"messages": MESSAGES}, "TokenizeResponse")
    expected = local._encode_prompt(MESSAGES)
    assert answer["tokens"] == expected
    assert answer["count"] == len(expected)
    assert answer["token_strs"] is None
    assert answer["max_model_len"] == local._max_positions
    chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == answer["count"]
    bare = _ok(http, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, "TokenizeResponse")
    assert bare["tokens"] == local._encode_prompt(MESSAGES, generation=False)
    assert bare["tokens"] != answer["tokens"]


def test_tokenize_a_text_prompt_as_completions_does_and_detokenize_inverts_it(http, local, model_id):
    text = "Reset your password from the account page."
    plain = _ok(http, "/tokenize", {"prompt": text, "add_special_tokens": False}, "TokenizeResponse")
    assert plain["tokens"] == local._tokenizer(text, add_special_tokens=False)["input_ids"]
    completion = http.post("/v1/completions", json={"model": model_id, "prompt": text, "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == plain["count"]
    default = _ok(http, "/tokenize", {"prompt": text, "return_token_strs": True}, "TokenizeResponse")
    assert default["tokens"] == local._tokenizer(text)["input_ids"]  # vLLM's default: special tokens added
    assert default["token_strs"] == local._tokenizer.convert_ids_to_tokens(default["tokens"])
    back = _ok(http, "/detokenize", {"tokens": plain["tokens"]}, "DetokenizeResponse")
    assert back["prompt"] == text
    named = _ok(http, "/detokenize", {"model": model_id, "tokens": [], "extra": 1}, "DetokenizeResponse")
    assert named["prompt"] == ""


def test_tokenizer_info_describes_the_served_tokenizer(http, local):
    answer = http.get("/tokenizer_info")
    assert answer.status_code == 200, answer.text
    info = _valid("TokenizerInfo", answer.json())
    tokenizer = local._tokenizer
    assert info["eos_token"] == tokenizer.eos_token
    assert info["chat_template"] == tokenizer.chat_template
    assert info["vocab_size"] == len(tokenizer)
    assert info["model_max_length"] == local._max_positions
    assert info["tokenizer_class"] == type(tokenizer).__name__


def test_tokenizer_routes_refuse_what_they_cannot_honour_naming_the_field(http, local):
    size = local._model.config.vocab_size
    error = _refused(http, "/detokenize", {"tokens": [1, size, 2, size + 5]}, 400, "out_of_range")
    assert error["pointer"] == "/tokens/1"
    assert error["param"] == "tokens.1"
    _refused(http, "/tokenize", {"prompt": "a", "model": "no-such-model"}, 404, "not_found")
    _refused(http, "/detokenize", {"tokens": [1], "model": "no-such-model"}, 404, "not_found")
    both = _refused(http, "/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "inconsistent_fields")
    assert "prompt" in both["message"]
    assert "messages" in both["message"]
    _refused(http, "/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "wrong_const")
    _refused(http, "/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "wrong_const")
    _refused(http, "/tokenize", {"messages": []}, 400, "invalid_length")
    assert http.get("/tokenize").status_code == 405


def test_the_served_openapi_document_bounds_token_ids_by_the_served_model(http, local):
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["TokenId"]["maximum"] == local._model.config.vocab_size - 1
    assert schemas["TokenIdPrompt"]["maxItems"] == local._max_positions


def test_lm_eval_local_completions_needs_no_tokenizer_argument(server, local, model_id):
    """lm-evaluation-harness 0.4.13 asks ``/tokenizer_info`` and ``/tokenize`` when it gets no ``tokenizer=``; its
    log-likelihoods through the server equal the served model's own, computed here."""
    import torch  # lm-eval is a dev dependency (pip install -e '.[dev]'): no skip
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(model=model_id, base_url=f"{server.url}/v1/completions", num_concurrent=1, max_retries=1)
    assert lm.tokenizer_backend == "remote"
    pairs = [("How do I reset my password?", " Open settings."), ("The capital of France is", " Paris")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    scores = lm.loglikelihood(requests, disable_tqdm=True)
    model = local._model
    for (context, continuation), (logprob, _greedy) in zip(pairs, scores, strict=True):
        ctx = local._tokenizer(context, add_special_tokens=False)["input_ids"]
        cont = local._tokenizer(continuation, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ctx + cont])).logits[0].float()
        rows = torch.log_softmax(logits, dim=-1)[len(ctx) - 1 : -1]
        expected = float(rows.gather(1, torch.tensor(cont).unsqueeze(1)).sum())
        assert logprob == pytest.approx(expected, abs=1e-4)
    generated = lm.generate_until(
        [
            Instance(
                request_type="generate_until",
                doc={},
                arguments=("Q: How do I reset my password?\nA:", {"until": ["\n"], "max_gen_toks": 8}),
                idx=0,
            )
        ],
        disable_tqdm=True,
    )
    assert len(generated) == 1
    assert isinstance(generated[0], str)
