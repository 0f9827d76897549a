"""What a sequence samples with, and the token ids that end it.

``Sampling`` holds one sequence's settings (vLLM's meanings); ``kiln.model.next_tokens`` draws a batch's tokens
under them (``kiln.model._draw``: the portable rule). ``stop_token_ids`` are the model's end-of-sequence ids plus
the end-of-turn specials its tokenizer declares; ``max_positions`` the context length its config declares.
"""

from __future__ import annotations

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
