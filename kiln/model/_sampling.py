"""Token sampling shared by serving and OPD rollouts.

``pick_token`` draws one id from logits: greedy at temperature 0 (and at a temperature so small that
logits / temperature overflows), else softmax(logits / temperature) with nucleus filtering to ``top_p``
(a stable descending sort; the most likely token is always kept) and one draw from an explicit
``torch.Generator``. No schema-valid temperature or top_p gives a NaN.
``choose`` is the same draw under every setting a serving request can give (``Sampling``): a repetition
penalty over the ids already seen, stop ids masked until ``min_tokens``, then temperature, ``top_k``,
``top_p`` and ``min_p``. With the defaults it is ``pick_token`` exactly (the same operations, the same bytes).
``stop_token_ids`` are the model's end-of-sequence ids plus the end-of-turn specials its
tokenizer declares. ``sample(...)`` runs a KV-cached rollout with them; ``sample_batch(...)`` runs several
together (one left-padded prefill, then one cached step for all unfinished rows per token), drawing each step's
tokens row by row, in batch order, from the one generator -- so a batch of one draws exactly what ``sample`` does.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from kiln.errors import InternalError

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


@dataclass(frozen=True)
class Sampling:
    """How one sequence picks its tokens (vLLM's meanings; every default leaves the draw unchanged).

    ``repetition_penalty``: each id already in the prompt or the output has its logit divided by the penalty when
    positive and multiplied by it otherwise (1: off). ``min_tokens``: the stop ids cannot be drawn before this many
    tokens. ``top_k``: keep the k most likely ids (0: all; ties by ascending id). ``min_p``: keep the ids whose
    probability is at least ``min_p`` times the most likely one's (0: all). The penalty and the stop mask also apply
    to greedy decoding; ``top_k``, ``top_p`` and ``min_p`` cannot change a greedy choice."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0


def pick_token(logits: Any, temperature: float, top_p: float, generator: Any) -> int:
    """One id from ``logits``: the first maximum at temperature 0, else a draw from softmax(logits / temperature)
    cut to the nucleus ``top_p``. Finite for every temperature in [0, 2] and top_p in (0, 1]: when logits /
    temperature overflows (a temperature below about 1e-37), the logits are first shifted so their maximum is 0 --
    every scaled value is then 0 or -inf, never +inf or NaN -- and such a temperature is greedy (the first maximum),
    as temperature 0 is. Any other temperature draws exactly as softmax(logits / temperature) does."""
    return _draw(logits, Sampling(temperature, top_p), generator)


def choose(
    logits: Any,
    sampling: Sampling,
    generator: Any,
    *,
    seen: Collection[int] = (),
    produced: int = 0,
    stop_ids: Collection[int] = (),
) -> int:
    """One id from ``logits`` under ``sampling``: ``seen`` are the ids the repetition penalty applies to (the
    prompt's and the output's), ``produced`` how many tokens this sequence already generated, ``stop_ids`` what
    ``min_tokens`` holds back. Never NaN: a penalty keeps finite logits finite up to float32 overflow, which
    ``_draw`` treats as it treats a tiny temperature (greedy); a mask that would leave no id is not applied."""
    import torch

    if sampling.repetition_penalty != 1 and seen:
        ids = torch.tensor(sorted(set(seen)), dtype=torch.long, device=logits.device)
        ids = ids[ids < logits.shape[-1]]
        picked = logits.double()[ids]
        picked = torch.where(picked > 0, picked / sampling.repetition_penalty, picked * sampling.repetition_penalty)
        logits = logits.clone()
        logits[ids] = picked.clamp(-3.0e38, 3.0e38).to(logits.dtype)
    if produced < sampling.min_tokens and stop_ids:
        ids = torch.tensor(sorted(stop_ids), dtype=torch.long, device=logits.device)
        ids = ids[ids < logits.shape[-1]]
        if len(ids) < logits.shape[-1]:
            logits = logits.clone()
            logits[ids] = float("-inf")
    return _draw(logits, sampling, generator)


def _draw(logits: Any, sampling: Sampling, generator: Any) -> int:
    import torch

    top = logits.max()
    if sampling.temperature == 0 or not bool(torch.isfinite(top)):
        return int(torch.argmax(logits))
    scaled = logits / sampling.temperature
    if not bool(torch.isfinite(scaled.max())):  # the temperature underflows: all the mass is on the maximum
        return int(torch.argmax(logits))
    if 0 < sampling.top_k < scaled.shape[-1]:
        _, order = torch.sort(scaled, descending=True, stable=True)
        scaled = scaled.clone()
        scaled[order[sampling.top_k :]] = float("-inf")
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1:
        ordered, order = torch.sort(probs, descending=True, stable=True)
        keep = (torch.cumsum(ordered, dim=-1) - ordered) < sampling.top_p
        keep[0] = True  # the most likely token is always kept, however small top_p is
        probs = torch.zeros_like(probs).scatter(0, order, ordered * keep)
    if sampling.min_p > 0:
        probs = torch.where(probs >= probs.max() * sampling.min_p, probs, torch.zeros_like(probs))
    return int(torch.multinomial(probs, 1, generator=generator))


def special_tokens(tokenizer: Any) -> tuple[str, ...]:
    specials = {str(t) for t in getattr(tokenizer, "all_special_tokens", ())}
    for token in getattr(tokenizer, "added_tokens_decoder", {}).values():
        if getattr(token, "special", False):
            specials.add(str(token.content))
    return tuple(sorted(s for s in specials if s))


def stop_token_ids(model: Any, tokenizer: Any, specials: tuple[str, ...]) -> frozenset[int]:
    found: set[int] = set()
    for value in (
        getattr(tokenizer, "eos_token_id", None),
        getattr(getattr(model, "generation_config", None), "eos_token_id", None),
        getattr(model.config, "eos_token_id", None),
    ):
        for item in value if isinstance(value, list | tuple) else [value]:
            if isinstance(item, int) and not isinstance(item, bool):
                found.add(item)
    for token in END_OF_TURN_TOKENS:
        if token in specials:
            token_id = tokenizer.convert_tokens_to_ids(token)
            if isinstance(token_id, int) and token_id >= 0:
                found.add(token_id)
    if not found:
        raise InternalError("the served model's tokenizer declares no end-of-sequence token")
    return frozenset(found)


def max_positions(config: Any, tokenizer: Any) -> int:
    """The context length a model's transformers ``config`` declares (else its tokenizer's)."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10**7:
        return value
    raise InternalError("the model declares no context length (max_position_embeddings)")


def sample(
    model: Any,
    prefix: list[int],
    *,
    max_new: int,
    temperature: float,
    top_p: float,
    generator: Any,
    stop_ids: frozenset[int],
) -> tuple[list[int], bool]:
    """Up to ``max_new`` sampled ids after ``prefix`` (a sampled stop id is kept and ends the
    rollout); returns ``(ids, truncated)`` where ``truncated`` means the limit, not a stop
    id, ended it. Non-finite logits raise ``FloatingPointError``. Each draw runs on the host (the logits of the last
    position are copied there), so ``generator`` is a CPU generator whatever the model's device."""
    import torch

    ids: list[int] = []
    if max_new <= 0:
        return ids, False
    cache = None
    device = next(model.parameters()).device
    step = torch.tensor([prefix], dtype=torch.long, device=device)
    with torch.no_grad():
        for _ in range(max_new):
            out = model(input_ids=step, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[0, -1].float().cpu()
            if not bool(torch.isfinite(logits).all()):
                raise FloatingPointError(f"non-finite student logits after {len(ids)} rollout tokens")
            token = pick_token(logits, temperature, top_p, generator)
            ids.append(token)
            if token in stop_ids:
                return ids, False
            step = torch.tensor([[token]], dtype=torch.long, device=device)
    return ids, True


def sample_batch(
    model: Any,
    prefixes: list[list[int]],
    *,
    max_new: list[int],
    temperature: float,
    top_p: float,
    generator: Any,
    stop_ids: frozenset[int],
) -> list[tuple[list[int], bool]]:
    """``sample`` for several prefixes at once: per prefix ``(ids, truncated)`` with its own ``max_new`` limit.

    The prefixes are left-padded into one prefill with an attention mask and position ids that start at 0 on each
    row's first real token, so every row sees exactly its own prefix; each later step feeds every row its last
    token through the shared KV cache (a finished row's further tokens are computed and discarded). One prefix is
    ``sample`` itself."""
    import torch

    if len(prefixes) == 1:
        return [
            sample(
                model,
                prefixes[0],
                max_new=max_new[0],
                temperature=temperature,
                top_p=top_p,
                generator=generator,
                stop_ids=stop_ids,
            )
        ]
    width = max(len(p) for p in prefixes)
    ids = torch.zeros((len(prefixes), width), dtype=torch.long)
    mask = torch.zeros((len(prefixes), width), dtype=torch.long)
    for r, prefix in enumerate(prefixes):
        ids[r, width - len(prefix) :] = torch.tensor(prefix, dtype=torch.long)
        mask[r, width - len(prefix) :] = 1
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    outputs: list[list[int]] = [[] for _ in prefixes]
    truncated = [limit > 0 for limit in max_new]
    active = [limit > 0 for limit in max_new]
    cache = None
    with torch.no_grad():
        while any(active):
            out = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
            )
            cache = out.past_key_values
            last = out.logits[:, -1].float().cpu()  # drawn on the host, from the CPU generator
            step = torch.zeros((len(prefixes), 1), dtype=torch.long)
            for r in range(len(prefixes)):
                if not active[r]:
                    continue
                if not bool(torch.isfinite(last[r]).all()):
                    raise FloatingPointError(f"non-finite student logits after {len(outputs[r])} rollout tokens")
                token = pick_token(last[r], temperature, top_p, generator)
                outputs[r].append(token)
                step[r, 0] = token
                if token in stop_ids:
                    active[r], truncated[r] = False, False
                elif len(outputs[r]) >= max_new[r]:
                    active[r] = False
            ids = step.to(device)
            mask = torch.cat([mask, torch.ones((len(prefixes), 1), dtype=torch.long, device=device)], dim=1)
            positions = positions[:, -1:] + 1
    return list(zip(outputs, truncated, strict=True))
