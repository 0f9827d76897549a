"""What a model does to its logits after the head: ``LogitMap`` (scale, then soft-cap).

A causal LM's logits are ``y = cap(scale · (h @ W.T + b))`` where ``cap`` is the identity or the
soft-cap ``c · tanh(z / c)``. Gemma 2 and 3 soft-cap their final logits (``final_logit_softcapping``);
Granite divides them by ``logits_scaling`` (a scale of ``1 / logits_scaling``); Cohere multiplies them by
``logit_scale``. Every loss route applies the same map, so the loss Kiln optimises is the loss the model
defines. ``derivative`` gives ``dy/dz`` in terms of the capped value, which the fused route folds into its
single-pass gradient.
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class LogitMap:
    """``y = softcap · tanh(scale · z / softcap)`` (or ``scale · z`` without a soft-cap) of the head's output ``z``."""

    scale: float = 1.0
    softcap: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.scale, float | int) and math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"a logit scale must be a finite positive number, got {self.scale!r}")
        if self.softcap is not None and not (
            isinstance(self.softcap, float | int) and math.isfinite(self.softcap) and self.softcap > 0
        ):
            raise ValueError(f"a logit soft-cap must be a finite positive number or None, got {self.softcap!r}")

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's logits from the head's output (out of place; autograd follows it)."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def head_logits(self, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The model's logits of ``rows`` (already in the compute dtype): the head, its bias, then this map."""
        logits = rows @ weight.to(rows.dtype).T
        if bias is not None:
            logits = logits + bias.to(rows.dtype)
        return self.apply(logits)

    def as_record(self) -> dict[str, float | None]:
        return {"scale": float(self.scale), "softcap": None if self.softcap is None else float(self.softcap)}


IDENTITY = LogitMap()
