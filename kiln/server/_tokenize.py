"""vLLM's tokenizer routes on ``kiln serve``: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

They let a remote client tokenize exactly as the server does without downloading the tokenizer (lm-evaluation-harness
asks ``/tokenizer_info`` and ``/tokenize`` first and, when they answer, needs no ``tokenizer=`` argument).

``/tokenize``
    A text ``prompt`` is tokenized with the served tokenizer, with its special tokens unless ``add_special_tokens`` is
    false (vLLM's default; ``POST /v1/completions`` tokenizes text prompts without them). A conversation in
    ``messages`` is rendered and tokenized exactly as ``POST /v1/chat/completions`` does it -- the same ids the model
    sees, message text that spells a special token kept as text -- with the generation prompt unless
    ``add_generation_prompt`` is false. ``count`` is the number of ids, ``max_model_len`` the context length;
    ``token_strs`` are the tokenizer's own spellings with ``return_token_strs``.
``/detokenize``
    The text of the ids, special tokens included and spaces as the tokenizer wrote them (no clean-up); an id not below
    the model's vocabulary size (the bound ``/v1/completions`` and the served ``/openapi.json`` state) is
    ``out_of_range`` naming its position; an id of the model's vocabulary the tokenizer has no text for reads as "".
``/tokenizer_info``
    The special tokens, the chat template, the context length and the vocabulary size.

``model`` is optional; given, it must be an id ``GET /v1/models`` lists (``not_found`` otherwise): adapters share
the base model's tokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.errors import ContractError, Problem
from kiln.server._generation import checked
from kiln.server._openai import admit, chat_messages, model_card

if TYPE_CHECKING:
    from kiln.documents.jsonio import JsonObject
    from kiln.server._app import Server

__all__ = ["detokenize", "tokenize", "tokenizer_info"]


def _model(server: Server, body: JsonObject) -> None:
    model = body.get("model")
    if model is not None and model != server.generator._model_name:
        model_card(server, model)  # not_found for an id the server does not list


def tokenize(server: Server, body: object) -> JsonObject:
    """``TokenizeRequest`` → ``TokenizeResponse``."""
    body = admit("TokenizeRequest", body)
    _model(server, body)
    gen = server.generator
    if "messages" in body:
        generation = body.get("add_generation_prompt") is not False
        ids = gen._encode_prompt(chat_messages(body["messages"]), generation=generation)
    else:
        special = body.get("add_special_tokens") is not False
        ids = [int(i) for i in gen._tokenizer(body["prompt"], add_special_tokens=special)["input_ids"]]
    strings = None
    if body.get("return_token_strs"):
        strings = [str(s) for s in gen._tokenizer.convert_ids_to_tokens(ids)]
    answer = {"count": len(ids), "max_model_len": gen._max_positions, "tokens": ids, "token_strs": strings}
    return checked("TokenizeResponse", answer)


def detokenize(server: Server, body: object) -> JsonObject:
    """``DetokenizeRequest`` → ``DetokenizeResponse``."""
    body = admit("DetokenizeRequest", body)
    _model(server, body)
    tokenizer = server.generator._tokenizer
    size = server.teacher_protocol.vocab_size  # the bound /v1/completions and the served OpenAPI document state
    outside = [
        Problem("out_of_range", f"/tokens/{i}", f"token id {token} is not below the vocabulary size {size}")
        for i, token in enumerate(body["tokens"])
        if token >= size
    ]
    if outside:
        raise ContractError(outside[:20], document="DetokenizeRequest")
    text = tokenizer.decode(body["tokens"], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return checked("DetokenizeResponse", {"prompt": text})


def tokenizer_info(server: Server) -> JsonObject:
    """``TokenizerInfo`` of the served tokenizer."""
    gen = server.generator
    tokenizer = gen._tokenizer

    def special(name: str) -> str | None:
        value = getattr(tokenizer, name, None)
        return None if value is None else str(value)

    template = getattr(tokenizer, "chat_template", None)
    info = {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": special("eos_token"),
        "bos_token": special("bos_token"),
        "pad_token": special("pad_token"),
        "unk_token": special("unk_token"),
        "chat_template": template if isinstance(template, str) else None,
        "model_max_length": gen._max_positions,
        "vocab_size": len(tokenizer),
    }
    return checked("TokenizerInfo", info)
