"""The reference route: dense ``[T, V]`` logits, then standard cross-entropy.

Every other route is checked against this one. It is the only route that accepts a
trainable head (plain autograd handles the weight gradient), and the most memory hungry:
the logits, their log-softmax and their gradient are each ``[T, V]`` in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812 -- the conventional alias

from ._logit_map import IDENTITY, LogitMap

IGNORE_INDEX = -100


def full_logits_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    logit_map: LogitMap = IDENTITY,
) -> torch.Tensor:
    """Masked mean next-token cross-entropy over all ``T`` rows of ``hidden``.

    Logits are computed from operands upcast to the compute dtype (at least fp32), so a
    bf16 model gets fp32 logits, softmax and reduction. With no supervised position the
    result is a 0.0 that is still connected to ``hidden`` (its gradient is zeros). The head's ``bias`` and the
    model's ``logit_map`` apply before the softmax.
    """
    compute = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
    logits = logit_map.head_logits(hidden.to(compute), weight, bias)
    total = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    supervised = (labels != IGNORE_INDEX).sum().clamp_min(1)
    return total / supervised
