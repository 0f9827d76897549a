"""Token sampling shared by serving and OPD rollouts.

``pick_token`` draws one id from logits: greedy at temperature 0, else softmax(logits /
temperature) with nucleus filtering to ``top_p`` (a stable descending sort; the most
likely token is always kept) and one draw from an explicit ``torch.Generator``.
``stop_token_ids`` are the model's end-of-sequence ids plus the end-of-turn specials its
tokenizer declares. ``sample(...)`` runs a KV-cached rollout with them.
"""

from __future__ import annotations

from typing import Any

from kiln.errors import InternalError

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def pick_token(logits: Any, temperature: float, top_p: float, generator: Any) -> int:
    import torch

    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1:
        ordered, order = torch.sort(probs, descending=True, stable=True)
        keep = (torch.cumsum(ordered, dim=-1) - ordered) < top_p  # always keeps the most likely token
        probs = torch.zeros_like(probs).scatter(0, order, ordered * keep)
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


def max_positions(model: Any, tokenizer: Any) -> int:
    config = model.config
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
    id, ended it. Non-finite logits raise ``FloatingPointError``."""
    import torch

    ids: list[int] = []
    if max_new <= 0:
        return ids, False
    cache = None
    step = torch.tensor([prefix], dtype=torch.long)
    with torch.no_grad():
        for _ in range(max_new):
            out = model(input_ids=step, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[0, -1].float()
            if not bool(torch.isfinite(logits).all()):
                raise FloatingPointError(f"non-finite student logits after {len(ids)} rollout tokens")
            token = pick_token(logits, temperature, top_p, generator)
            ids.append(token)
            if token in stop_ids:
                return ids, False
            step = torch.tensor([[token]], dtype=torch.long)
    return ids, True
