"""Active-rows route: gather the supervised rows first, then dense cross-entropy on them.

Same numbers as the reference, with ``[A, V]`` logits instead of ``[T, V]`` (``A`` is the
number of supervised positions). The head must be frozen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 -- the conventional alias

from ._logit_map import IDENTITY, LogitMap

IGNORE_INDEX = -100


def active_rows_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    logit_map: LogitMap = IDENTITY,
) -> torch.Tensor:
    """Masked mean cross-entropy computed on the supervised rows of ``hidden`` only (the head's ``bias`` and
    the model's ``logit_map`` apply before the softmax).

    Raises ``ValueError`` for a trainable head. With no supervised position the result is
    a 0.0 still connected to ``hidden`` (its gradient is zeros).
    """
    if weight.requires_grad:
        raise ValueError(
            "the active_rows loss route needs a frozen LM head (weight.requires_grad is True): Kiln trains LoRA adapters and never updates the head; call weight.requires_grad_(False) or use the full_logits route"
        )
    compute = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    active = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    rows = hidden.index_select(0, active).to(compute)
    logits = logit_map.head_logits(rows, weight, bias)
    total = F.cross_entropy(logits, labels.index_select(0, active), reduction="sum")
    return total / max(active.numel(), 1)
