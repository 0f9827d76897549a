"""The OpenAI-compatible surface of ``kiln serve``: requests in, documents out, over one decoding loop.

Longer than 600 lines: chat and completions, each whole and streamed, share admission, sampling settings, the
choices' decoding and the log-probability layouts; in one module each route reads beside the other.

``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` translate between OpenAI's
(and vLLM's) request and response layouts and the generation engine
(``kiln.server._generation.Generator.pieces``, the one decoding loop); the teacher scoring
protocol's ``prompt_logprobs`` come from ``kiln.server._teacher_protocol``. docs/server.md
describes the surface; the rules in brief:

Unknown fields
    An OpenAI request object is open: an unknown field is ignored (as vLLM does). A known
    OpenAI field whose non-default value Kiln cannot honour (``tools``, a json
    ``response_format``, penalties, ``logit_bias``, ``best_of`` other than ``n``, ...) is
    refused with 400 naming it. The schemas say both (``x-kiln-unknown-field-policy``).
Weights
    ``model`` is the base model's id (base weights) or a registry adapter's name (that
    adapter); any other id is ``not_found`` (404). Kiln's ``adapter`` applies on top of the
    base id (or an absent ``model``); naming a different adapter in ``model`` and ``adapter``,
    or an adapter in ``model`` with ``base_model: true``, is ``inconsistent_fields``. A chat
    request without ``model`` uses the active adapter, else the base model.
Choices
    Choice i samples with seed ``seed + i`` (mod 2^64); stop sequences are matched on the
    decoded text, which is cut before the first one (``finish_reason`` ``stop``). Every
    choice of a request (of every prompt, on ``/v1/completions``) is submitted to the
    generator's scheduler before the first is read, so they decode together, beside other
    requests' sequences (``kiln.server._batching``), each exactly as it decodes alone. A
    stream interleaves its choices: each choice's role (or echo) chunk first, then one
    increment of each unfinished choice in turn, a choice's finish chunk when it ends.
Log-probabilities
    Raw (temperature 1, before ``top_p``); ties by ascending id. Prompt scores (``echo``,
    ``prompt_logprobs``) come from one forward of the prompt, whose last row also picks the
    first generated token, so a one-token scoring request runs exactly one forward.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import kiln_contracts

from kiln import contracts
from kiln.errors import ContractError, NotFoundError, Problem
from kiln.model import Sampling
from kiln.server._generation import SEEDS, Held, Outcome, Piece, Plan, TokenScore, checked

__all__ = [
    "admit",
    "chat_chunks",
    "chat_completion",
    "chat_messages",
    "completion",
    "completion_chunks",
    "model_card",
    "model_list",
]

CHAT = "ChatCompletionRequest"
COMPLETION = "CompletionRequest"
CHAT_MAX_TOKENS = 64  # default
COMPLETION_MAX_TOKENS = 16  # default, as OpenAI and vLLM
FRESH_SEEDS = 1 << 53  # a request without ``seed`` samples with a fresh one below this
REFUSED = (
    "presence_penalty", "frequency_penalty", "logit_bias", "tools", "functions", "tool_choice", "function_call",
    "response_format", "modalities", "audio", "prediction", "suffix", "best_of",
)  # fmt: skip


# --- admission ------------------------------------------------------------------------------


def admit(document: str, body: Any) -> dict[str, Any]:
    """Schema check; a refused OpenAI feature is named with what Kiln accepts instead. The body with canonical
    numbers (``"max_tokens": 16.0`` is 16, ``"temperature": 1`` is 1.0)."""
    found = contracts.problems(document, body)
    if not found:
        return contracts.canonical(document, body)
    props = kiln_contracts.load_bundle()["$defs"][document].get("properties", {})
    named = []
    for problem in found:
        field_name = problem.pointer.split("/")[1] if problem.pointer.count("/") >= 1 else ""
        if field_name in REFUSED and field_name in props and isinstance(body, dict):
            why = props[field_name]["description"]
            problem = Problem(
                problem.code, problem.pointer, f"`{field_name}` {body.get(field_name)!r} is not supported. {why}"
            )
        named.append(problem)
    raise ContractError(named, document=document)


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Admitted chat messages as the chat template reads them: ``developer`` is ``system``, text parts joined."""
    return [
        {
            "role": "system" if m["role"] == "developer" else m["role"],
            "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"]),
        }
        for m in messages
    ]


def _inconsistent(document: str, pointer: str, message: str) -> ContractError:
    return ContractError([Problem("inconsistent_fields", pointer, message)], document=document)


def _weights(gen: Any, body: dict[str, Any], document: str) -> tuple[Any, str]:
    """(adapter or None, the id the answer names) for the request's ``model``/``adapter``/``base_model``."""
    model, adapter, base = body.get("model"), body.get("adapter"), body.get("base_model") is True
    if adapter is not None and base:
        raise _inconsistent(
            document, "/adapter", "`adapter` and `base_model: true` cannot be combined: choose one set of weights"
        )
    if model is None or model == gen._model_name:
        if adapter is not None:
            chosen = gen.adapter_named(adapter)
        else:
            chosen = None if (base or model is not None) else gen._active
        return chosen, model or (chosen.name if chosen else gen._model_name)
    try:  # an id nobody serves is not_found before any combination of fields is judged
        chosen = gen.adapter_named(model)
    except NotFoundError:
        raise NotFoundError(
            f"the model {model!r} does not exist: this server serves {gen._model_name!r} and its registry adapters",
            code="not_found",
            hint="GET /v1/models lists the model ids",
        ) from None
    if base:
        raise _inconsistent(
            document, "/base_model", f"`base_model: true` asks for the base weights but `model` names {model!r}"
        )
    if adapter is not None and adapter != model:
        raise _inconsistent(document, "/adapter", f"`model` names {model!r} but `adapter` names {adapter!r}")
    return chosen, model


@dataclass(frozen=True)
class _Sampled:
    """What every choice of a request shares: how many, how each picks its tokens, the seed, the stop strings."""

    n: int
    sampling: Sampling
    seed: int
    stops: list[str]


def _choices(body: dict[str, Any], max_tokens: int) -> _Sampled:
    """The request's sampling settings (vLLM's defaults when absent); without ``seed`` a fresh one, below 2^53 so
    any JSON client can send it back exactly. ``min_tokens`` is at most the token limit."""
    stop = body.get("stop")
    min_tokens = min(body.get("min_tokens") or 0, max_tokens)  # more than the limit: every choice runs to it
    top_k = body.get("top_k")
    sampling = Sampling(
        temperature=body.get("temperature") or 0.0,
        top_p=1.0 if body.get("top_p") is None else body["top_p"],
        top_k=0 if top_k is None or top_k < 0 else top_k,
        min_p=body.get("min_p") or 0.0,
        repetition_penalty=1.0 if body.get("repetition_penalty") is None else body["repetition_penalty"],
        min_tokens=min_tokens,
    )
    seed = body.get("seed")
    return _Sampled(
        n=body.get("n") or 1,
        sampling=sampling,
        seed=secrets.randbelow(FRESH_SEEDS) if seed is None else int(seed),  # a decimal string or an integer
        stops=[stop] if isinstance(stop, str) else list(stop or []),
    )


def fingerprint(sampled: _Sampled) -> dict[str, str]:
    """``system_fingerprint`` of an answer that sampled: the seed its first choice sampled with (choice i used
    seed + i); a greedy answer (temperature 0) used no seed and carries none, so its bytes do not vary per call."""
    return {"system_fingerprint": f"kiln-seed-{sampled.seed}"} if sampled.sampling.temperature > 0 else {}


def _stream_checks(document: str, body: dict[str, Any]) -> None:
    if body.get("stream_options") is not None and not body.get("stream"):
        raise _inconsistent(document, "/stream_options", "`stream_options` is only allowed with `stream: true`")


# --- one choice -----------------------------------------------------------------------------


@dataclass
class _Choice:
    """One choice decoding (submitted when created): text increments cut at the first stop sequence, with their
    tokens."""

    gen: Any
    plan: Plan
    stops: list[str]
    top_k: int | None = None
    first: Any = None
    outcome: Outcome = field(default_factory=Outcome)

    def __post_init__(self) -> None:
        self._pieces = self.gen.pieces(self.plan, self.outcome, top_k=self.top_k, first=self.first)

    def increments(self) -> Iterator[Piece]:
        hold = max((len(s) for s in self.stops), default=1) - 1
        buffer, pending = "", []
        try:
            for piece in self._pieces:
                buffer += piece.text
                pending += piece.tokens
                cuts = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
                if cuts and self.outcome.completion_tokens >= self.plan.sampling.min_tokens:  # as vLLM: none before
                    self.outcome.finish_reason = "stop"
                    yield Piece(buffer[: min(cuts)], pending)
                    return
                ready = buffer[: len(buffer) - hold] if hold else buffer
                if ready or (pending and not hold):
                    yield Piece(ready, pending)
                    buffer, pending = buffer[len(ready) :], []
        finally:
            self.close()
        if buffer or pending:
            yield Piece(buffer, pending)

    def close(self) -> None:
        """Stop decoding this choice (its sequence leaves the scheduler); a no-op once it ended."""
        self._pieces.close()


@contextmanager
def _closing(choices: list[_Choice]) -> Iterator[list[_Choice]]:
    """The choices, each closed when the answer is done or abandoned (a client that went away)."""
    try:
        yield choices
    finally:
        for choice in choices:
            choice.close()


def _round_robin(choices: list[_Choice]) -> Iterator[tuple[int, Piece | None]]:
    """``(index, increment)`` of each unfinished choice in turn, ``(index, None)`` when one ends: an order that
    depends only on each choice's increments, never on which sequences shared a step."""
    streams = [choice.increments() for choice in choices]
    live = list(range(len(streams)))
    while live:
        for index in list(live):
            piece = next(streams[index], None)
            if piece is None:
                live.remove(index)
            yield index, piece


class _Texts:
    """Token id → its text, decoded alone with special tokens kept (cached per request)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._seen: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._seen.get(token)
        if text is None:
            text = self._seen[token] = self._tokenizer.decode(
                [token], skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        return text


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _kiln(adapter: Any) -> dict[str, str | None]:
    if adapter is None:
        return {"adapter": None, "adapter_manifest_sha256": None}
    return {"adapter": adapter.name, "adapter_manifest_sha256": adapter.manifest_sha256}


# --- chat -----------------------------------------------------------------------------------


@dataclass
class _ChatJob:
    plans: list[Plan]
    stops: list[str]
    sampled: _Sampled
    top_k: int | None
    model: str
    adapter: Any


def _chat_job(gen: Any, body: Any) -> _ChatJob:
    body = admit(CHAT, body)
    _stream_checks(CHAT, body)
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise _inconsistent(CHAT, "/top_logprobs", "`top_logprobs` needs `logprobs: true`")
    adapter, model = _weights(gen, body, CHAT)
    prompt = gen._encode_prompt(chat_messages(body["messages"]))
    room = gen._max_positions - len(prompt)
    if room < 1:
        raise ContractError(
            [
                Problem(
                    "out_of_range",
                    "/messages",
                    f"the prompt is {len(prompt)} tokens and the model's context is {gen._max_positions}: no room to generate; shorten the conversation",
                )
            ],
            document=CHAT,
        )
    limit = body.get("max_completion_tokens") or body.get("max_tokens") or CHAT_MAX_TOKENS
    sampled = _choices(body, limit)
    plans = [
        Plan(prompt, min(limit, room), sampled.sampling, (sampled.seed + i) % SEEDS, adapter, model)
        for i in range(sampled.n)
    ]
    top_k = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
    return _ChatJob(plans, sampled.stops, sampled, top_k, model, adapter)


def _chat_logprobs(texts: _Texts, tokens: list[TokenScore]) -> dict[str, Any]:
    def alt(token: int, logprob: float) -> dict[str, Any]:
        text = texts(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**alt(t.token, t.logprob), "top_logprobs": [alt(i, v) for i, v in t.top or []]}
            for t in tokens
            if t.logprob is not None
        ]
    }


def chat_completion(gen: Any, body: Any) -> dict[str, Any]:
    """``ChatCompletionRequest`` → ``ChatCompletionResponse``, holding the served model until it is answered."""
    with gen.serving():
        return _chat_completion(gen, body)


def _chat_completion(gen: Any, body: Any) -> dict[str, Any]:
    job = _chat_job(gen, body)
    created, texts = int(time.time()), _Texts(gen._tokenizer)
    choices, generated = [], 0
    with _closing([_Choice(gen, plan, job.stops, job.top_k) for plan in job.plans]) as runs:
        for index, choice in enumerate(runs):
            pieces = list(choice.increments())
            scored = [t for p in pieces for t in p.tokens]
            choices.append(
                {
                    "index": index,
                    "message": {"role": "assistant", "content": "".join(p.text for p in pieces)},
                    "finish_reason": choice.outcome.finish_reason,
                    "logprobs": None if job.top_k is None else _chat_logprobs(texts, scored),
                }
            )
            generated += choice.outcome.completion_tokens
    response = {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion",
        "created": created,
        "model": job.model,
        **fingerprint(job.sampled),
        "choices": choices,
        "usage": _usage(len(job.plans[0].prompt_ids), generated),
        "kiln": _kiln(job.adapter),
    }
    return checked("ChatCompletionResponse", response)


def chat_chunks(gen: Any, body: Any) -> Iterator[dict[str, Any]]:
    """``ChatCompletionRequest`` → ``ChatCompletionChunk`` documents (admitted before the first one), holding the
    served model until the last."""
    release = gen.hold()
    try:
        job = _chat_job(gen, body)
    except BaseException:
        release()
        raise
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return Held(_chat_stream(gen, job, usage, "chatcmpl-" + secrets.token_hex(12), int(time.time())), release)


def _chat_stream(gen: Any, job: _ChatJob, usage: bool, completion_id: str, created: int) -> Iterator[dict[str, Any]]:
    texts = _Texts(gen._tokenizer)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": job.model,
            **fingerprint(job.sampled),
        }
        return checked("ChatCompletionChunk", {**body, "choices": choices, **extra})

    generated = 0
    with _closing([_Choice(gen, plan, job.stops, job.top_k) for plan in job.plans]) as runs:
        for index in range(len(runs)):
            first = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            yield chunk([first], **({"kiln": _kiln(job.adapter)} if index == 0 else {}))
        for index, piece in _round_robin(runs):
            choice = runs[index]
            if piece is None:
                yield chunk([{"index": index, "delta": {}, "finish_reason": choice.outcome.finish_reason}])
                generated += choice.outcome.completion_tokens
            elif piece.text or (job.top_k is not None and piece.tokens):
                scored = None if job.top_k is None else _chat_logprobs(texts, piece.tokens)
                increment = {"index": index, "delta": {"content": piece.text}, "finish_reason": None}
                yield chunk([{**increment, "logprobs": scored}])
    if usage:
        yield chunk([], usage=_usage(len(job.plans[0].prompt_ids), generated))


# --- completions ----------------------------------------------------------------------------


@dataclass
class _Prompt:
    ids: list[int]
    text: str | None  # as sent, for a text prompt


@dataclass
class _CompletionJob:
    prompts: list[_Prompt]
    sampled: _Sampled
    max_tokens: int
    top_n: int | None  # prompt_logprobs
    logprobs: int | None
    echo: bool
    model: str
    adapter: Any


def _prompts(gen: Any, prompt: Any) -> list[_Prompt]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt[0], str):
        return [
            _Prompt([int(i) for i in gen._tokenizer(text, add_special_tokens=False)["input_ids"]], text)
            for text in prompt
        ]
    if isinstance(prompt[0], list):
        return [_Prompt(list(ids), None) for ids in prompt]
    return [_Prompt(list(prompt), None)]


def _completion_job(server: Any, body: Any) -> _CompletionJob:
    gen, protocol = server.generator, server.teacher_protocol
    body = admit(COMPLETION, body)
    _stream_checks(COMPLETION, body)
    adapter, model = _weights(gen, body, COMPLETION)
    max_tokens = body.get("max_tokens")
    max_tokens = COMPLETION_MAX_TOKENS if max_tokens is None else max_tokens
    sampled = _choices(body, max_tokens)
    prompts = _prompts(gen, body["prompt"])
    top_n = body.get("prompt_logprobs")
    problems: list[Problem] = []
    listed = isinstance(body["prompt"], list) and isinstance(body["prompt"][0], str | list)  # several prompts
    for i, prompt in enumerate(prompts):
        pointer = f"/prompt/{i}" if listed else "/prompt"
        if not prompt.ids:
            problems.append(Problem("out_of_range", pointer, "the prompt is empty: there is nothing to complete"))
        problems.extend(protocol.prompt_problems(prompt.ids, pointer))
    problems.extend(protocol.top_n_problems(top_n))
    if problems:
        raise ContractError(problems, document=COMPLETION)
    return _CompletionJob(
        prompts=prompts,
        sampled=sampled,
        max_tokens=max_tokens,
        top_n=top_n,
        logprobs=body.get("logprobs"),
        echo=bool(body.get("echo")),
        model=model,
        adapter=adapter,
    )


@dataclass
class _Scored:
    """One prompt's forward: what the choices of that prompt share."""

    prompt: _Prompt
    echo_text: str
    echo_tokens: list[TokenScore]  # the prompt's tokens with their scores (first: no score), for echo
    prompt_logprobs: list[Any] | None
    last: Any  # log-probabilities after the prompt, or None when no forward ran


def _score(server: Any, job: _CompletionJob, prompt: _Prompt) -> _Scored:
    gen, protocol = server.generator, server.teacher_protocol
    scoring = job.top_n is not None or (job.echo and job.logprobs is not None)
    rows = protocol.logprobs(prompt.ids, job.adapter) if scoring else None
    echo_tokens: list[TokenScore] = []
    if job.echo and job.logprobs is not None and rows is not None:
        top = protocol.top(rows[: len(prompt.ids) - 1], prompt.ids[1:], job.logprobs)
        echo_tokens = [TokenScore(prompt.ids[0])] + [
            TokenScore(token, logprob, alternatives)
            for token, (logprob, alternatives) in zip(prompt.ids[1:], top, strict=True)
        ]
    echo_text = ""
    if job.echo:
        echo_text = (
            prompt.text
            if prompt.text is not None
            else gen._tokenizer.decode(prompt.ids, clean_up_tokenization_spaces=False)
        )
    return _Scored(
        prompt=prompt,
        echo_text=echo_text,
        echo_tokens=echo_tokens,
        prompt_logprobs=None if job.top_n is None else protocol.prompt_logprobs(rows, prompt.ids, job.top_n),
        last=None if rows is None else rows[len(prompt.ids) - 1],
    )


def _legacy_logprobs(texts: _Texts, tokens: list[TokenScore], offset: int) -> dict[str, Any]:
    """OpenAI's legacy layout for ``tokens``; ``offset`` is the choice text's length before them."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        text = texts(t.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(t.logprob)
        top: dict[str, float] | None = None
        if t.logprob is not None:
            top = {}
            for i, v in [*(t.top or []), (t.token, t.logprob)]:  # descending: two ids that read alike keep the likelier
                top.setdefault(texts(i), v)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _choice_runs(server: Any, job: _CompletionJob) -> list[tuple[_Scored, _Choice]]:
    """Every prompt scored, then every choice of every prompt submitted: they all decode together."""
    gen = server.generator
    runs = []
    for scored in [_score(server, job, prompt) for prompt in job.prompts]:
        room = gen._max_positions - len(scored.prompt.ids) + 1  # the first token needs no new position
        for i in range(job.sampled.n):
            plan = Plan(
                scored.prompt.ids,
                max(0, min(job.max_tokens, room)),
                job.sampled.sampling,
                (job.sampled.seed + i) % SEEDS,
                job.adapter,
                job.model,
            )
            runs.append((scored, _Choice(gen, plan, job.sampled.stops, job.logprobs, scored.last)))
    return runs


def completion(server: Any, body: Any) -> dict[str, Any]:
    """``CompletionRequest`` → ``CompletionResponse``, holding the served model until it is answered."""
    with server.generator.serving():
        return _completion(server, body)


def _completion(server: Any, body: Any) -> dict[str, Any]:
    gen = server.generator
    job = _completion_job(server, body)
    texts = _Texts(gen._tokenizer)
    choices: list[dict[str, Any]] = []
    prompt_tokens, generated = sum(len(prompt.ids) for prompt in job.prompts), 0
    runs = _choice_runs(server, job)
    with _closing([choice for _, choice in runs]):
        for scored, choice in runs:
            pieces = list(choice.increments())
            text = "".join(p.text for p in pieces)
            logprobs = None
            if job.logprobs is not None:
                tokens = [t for p in pieces for t in p.tokens]
                logprobs = _legacy_logprobs(texts, scored.echo_tokens, 0)
                more = _legacy_logprobs(texts, tokens, len(scored.echo_text))
                logprobs = {key: logprobs[key] + more[key] for key in logprobs}
            choices.append(
                {
                    "index": len(choices),
                    "text": scored.echo_text + text,
                    "finish_reason": choice.outcome.finish_reason,
                    "logprobs": logprobs,
                    "prompt_logprobs": scored.prompt_logprobs,
                }
            )
            generated += choice.outcome.completion_tokens
    response = {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": job.model,
        **fingerprint(job.sampled),
        "choices": choices,
        "usage": _usage(prompt_tokens, generated),
    }
    return checked("CompletionResponse", response)


def completion_chunks(server: Any, body: Any) -> Iterator[dict[str, Any]]:
    """``CompletionRequest`` with ``stream`` → ``CompletionChunk`` documents (admitted before the first), holding
    the served model until the last."""
    release = server.generator.hold()
    try:
        job = _completion_job(server, body)
    except BaseException:
        release()
        raise
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    chunks = _completion_stream(server, job, usage, f"cmpl-{secrets.token_hex(12)}", int(time.time()))
    return Held(chunks, release)


def _completion_stream(
    server: Any, job: _CompletionJob, usage: bool, completion_id: str, created: int
) -> Iterator[dict[str, Any]]:
    gen = server.generator
    texts = _Texts(gen._tokenizer)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": job.model,
            **fingerprint(job.sampled),
        }
        return checked("CompletionChunk", {**body, "choices": choices, **extra})

    def increment(index: int, text: str, tokens: list[TokenScore], offset: int) -> dict[str, Any]:
        scored = None if job.logprobs is None else _legacy_logprobs(texts, tokens, offset)
        return chunk([{"index": index, "text": text, "finish_reason": None, "logprobs": scored}])

    prompt_tokens, generated = sum(len(prompt.ids) for prompt in job.prompts), 0
    runs = _choice_runs(server, job)
    offsets = [len(scored.echo_text) for scored, _ in runs]  # each choice's text so far
    with _closing([choice for _, choice in runs]) as choices:
        if job.echo:
            for index, (scored, _) in enumerate(runs):
                yield increment(index, scored.echo_text, scored.echo_tokens, 0)
        for index, piece in _round_robin(choices):
            if piece is None:
                finish = choices[index].outcome.finish_reason
                yield chunk([{"index": index, "text": "", "finish_reason": finish, "logprobs": None}])
                generated += choices[index].outcome.completion_tokens
            else:
                yield increment(index, piece.text, piece.tokens, offsets[index])
                offsets[index] += len(piece.text)
    if usage:
        yield chunk([], usage=_usage(prompt_tokens, generated))


# --- models ---------------------------------------------------------------------------------


def model_list(server: Any) -> dict[str, Any]:
    """``ModelList``: the base model's card, then every loadable registry adapter's, by name (a listed directory
    whose name the registry rule refuses, such as a demoted ``<name>.failed``, is never loaded)."""
    from kiln.adapters import list_adapters
    from kiln.host.fs import name_problem

    base = server.teacher_protocol.card()
    cards = [base]
    with server.adapter_lock:
        listing = list_adapters(server.registry, loaded=server.generator.active(), cache=server.adapter_cache)
    for entry in sorted(listing["available"], key=lambda e: e["name"]):
        loadable = entry["status"] in ("available", "loaded") and name_problem(entry["name"], kind="adapter") is None
        if loadable and entry["name"] != base["id"]:
            path = server.registry / entry["name"]
            try:
                created = int(path.stat().st_mtime)
            except OSError:
                continue  # removed since it was listed
            cards.append(
                {
                    "id": entry["name"],
                    "object": "model",
                    "created": created,
                    "owned_by": "kiln",
                    "max_model_len": base["max_model_len"],
                    "parent": base["id"],
                    "root": base["id"],
                }
            )
    return checked("ModelList", {"object": "list", "data": cards})


def model_card(server: Any, model_id: str) -> dict[str, Any]:
    """One ``ModelCard`` of ``model_list`` by id, or ``not_found``."""
    for card in model_list(server)["data"]:
        if card["id"] == model_id:
            return card
    raise NotFoundError(
        f"the model {model_id!r} does not exist", code="not_found", hint="GET /v1/models lists the model ids"
    )
