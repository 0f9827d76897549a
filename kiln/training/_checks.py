"""Checks the objectives share: a mask's shape against the values it selects, a loop-state block's members."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["active_mask", "check_members"]


def active_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``mask`` as booleans, refused unless it has the shape of ``like`` (the values it selects)."""
    if tuple(mask.shape) != tuple(like.shape):
        raise ValueError(f"mask is {tuple(mask.shape)}, the log-probabilities are {tuple(like.shape)}")
    return mask.bool()


def check_members(state: Mapping[str, Any], keys: Iterable[str], what: str) -> None:
    """Refuse a loop-state block (``what``) whose members are not exactly ``keys``."""
    expected = set(keys)
    if set(state) != expected:
        raise ValueError(f"{what} has members {sorted(state)}, expected exactly {sorted(expected)}")
