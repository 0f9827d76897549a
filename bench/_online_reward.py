"""The reward function ``bench_online_grpo.py`` gives both sides: TRL calls it as a reward function, Kiln as its
``module:function`` scorer (the same call)."""

from __future__ import annotations

from typing import Any


def digit_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 for a completion that holds a digit, else 0.0 (conversational or plain completions)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if any(ch.isdigit() for ch in text) else 0.0 for text in texts]
