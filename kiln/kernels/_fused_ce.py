"""Fused chunked linear cross-entropy: one autograd node from hidden states to the loss.

With LoRA the head is frozen, so the loss path needs only two matrix products per
supervised row: the logits, and the gradient with respect to the hidden row. Both happen
in the forward pass, in one walk over the vocabulary:

* gather the ``A`` supervised rows (compute dtype: at least fp32, whatever the inputs);
* per vocabulary chunk of ``C`` head rows: ``z = rows @ W_c.T (+ b_c)`` ([A, C]), the model's
  logits ``y = cap(s · z)`` (``LogitMap``: scale ``s``, optional soft-cap ``c · tanh(·/c)``); an
  online log-sum-exp of ``y`` (running max and sum); the target's ``y``; and the unnormalised
  gradient ``G = Σ exp(y - running_max) · y'(z) · W_c``, rescaled by ``exp(old_max - new_max)``
  whenever a row's running max moves (the online-softmax trick applied to ``softmax @ W``).
  ``y'(z) = s · (1 - tanh²)`` with a soft-cap, ``s`` without. The scale is folded into the rows
  before the walk; the soft-cap is computed as ``c · tanh(u) = 2c · sigmoid(2u) - c`` (the
  constant cancels in the loss) with ``1 - tanh²(u) = 4 sigmoid(2u) (1 - sigmoid(2u))``, because
  sigmoid is several times cheaper than tanh on CPU;
* at the end ``d loss / d row = (G / sum - y'(z_target) · W[target]) / A``.

Backward only scales that stored ``[A, H]`` gradient by the incoming gradient and scatters
it to ``[T, H]``: no logits are recomputed. Neither ``[T, V]`` nor ``[A, V]`` ever exists:
the peak is ``O(A·H + A·C)`` (one more ``[A, C]`` buffer, reused, for the soft-cap's derivative). When
``hidden`` needs no gradient the ``G`` accumulation is skipped.

Every step is a deterministic op (matmul, elementwise, row reductions, gathers and
scatters onto distinct positions), so the same inputs give bit-identical loss and
gradients run after run. With the identity map the arithmetic is exactly that of the
route without post-processing (no extra operation runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ._logit_map import IDENTITY, LogitMap

IGNORE_INDEX = -100


def fused_chunked_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    bias: torch.Tensor | None = None,
    logit_map: LogitMap = IDENTITY,
) -> torch.Tensor:
    """Masked mean cross-entropy of ``logit_map(hidden @ weight.T + bias)`` against ``labels``, chunk by chunk.

    Raises ``ValueError`` for a trainable head or a chunk size below 1. With no supervised
    position the result is a 0.0 still connected to ``hidden`` (its gradient is zeros).
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError(
            "the fused_chunked_linear_ce loss route needs a frozen LM head (weight.requires_grad is True): Kiln trains LoRA adapters and never updates the head, so this route computes no head gradient; call weight.requires_grad_(False) or use the full_logits route"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return _FusedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size, bias, logit_map)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        bias: torch.Tensor | None,
        logit_map: LogitMap,
    ) -> torch.Tensor:
        compute = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        active = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        targets = labels.index_select(0, active)
        ctx.num_rows_total = hidden.shape[0]
        ctx.hidden_dtype = hidden.dtype
        count = active.numel()
        if count == 0:
            ctx.save_for_backward(active, hidden.new_empty((0, hidden.shape[1]), dtype=compute))
            return hidden.new_zeros((), dtype=compute)

        want_grad = ctx.needs_input_grad[0]
        rows = hidden.index_select(0, active).to(compute)
        scale, cap = float(logit_map.scale), logit_map.softcap
        # the map's input factor goes into the rows once: with a soft-cap the chunk holds v = 2 s z / c, whose
        # sigmoid gives c tanh(s z / c) = 2c sigmoid(v) - c (sigmoid is several times cheaper than tanh on CPU;
        # the constant -c cancels between the log-sum-exp and the target logit, so it is never applied)
        factor = scale if cap is None else 2.0 * scale / cap
        if factor != 1.0:
            rows.mul_(factor)
        running_max = rows.new_full((count,), float("-inf"))
        running_sum = rows.new_zeros(count)
        target_logit = rows.new_zeros(count)
        # with a soft-cap: sigmoid(v) (1 - sigmoid(v)), a quarter of the cap's derivative, at each row's target
        target_slope = rows.new_ones(count) if cap is not None else None
        slope_buffer = rows.new_empty(count * min(chunk_size, weight.shape[0])) if cap is not None else None
        # sum_j exp(y_j - running_max) * y'(z_j) * W_j, rescaled whenever the running max moves
        weighted = torch.zeros_like(rows) if want_grad else None
        for cols, hit, w, b in _chunks(weight, bias, targets, chunk_size, compute):
            logits = rows @ w.T  # [A, C]
            if b is not None:
                logits.add_(b if factor == 1.0 else b * factor)
            slope = None
            if cap is not None and slope_buffer is not None:
                sig = logits.sigmoid_()  # in place: the buffer now holds sigmoid(v)
                slope = torch.addcmul(sig, sig, sig, value=-1.0, out=slope_buffer[: sig.numel()].view(sig.shape))
                target_slope = torch.where(hit, slope.gather(1, cols).squeeze(1), target_slope)
                logits = sig.mul_(2.0 * cap)  # y + c, in the same buffer
            target_logit += torch.where(hit, logits.gather(1, cols).squeeze(1), 0.0)
            new_max = torch.maximum(running_max, logits.amax(dim=1))
            rescale = torch.exp(running_max - new_max)
            probs = logits.sub_(new_max.unsqueeze(1)).exp_()  # unnormalised, in place of the logits
            running_sum = running_sum * rescale + probs.sum(dim=1)
            if weighted is not None:
                weighted.mul_(rescale.unsqueeze(1)).addmm_(probs if slope is None else probs.mul_(slope), w)
            running_max = new_max
            del logits, probs, slope  # free this chunk before the next one is allocated
        lse = running_max + torch.log(running_sum)
        if weighted is None:
            grad_rows = rows.new_empty((0, rows.shape[1]))
        else:
            # d(mean CE)/d(row) = s (softmax(y) y' @ W - y'(target) W[target]) / A, y' = 1 or 4 sig (1 - sig)
            weighted.div_(running_sum.unsqueeze(1))
            target_rows = weight.index_select(0, targets).to(compute)
            if target_slope is not None:
                target_rows.mul_(target_slope.unsqueeze(1))
            weighted.sub_(target_rows)
            outer = scale if cap is None else 4.0 * scale
            if outer != 1.0:
                weighted.mul_(outer)
            grad_rows = weighted.div_(count)
        ctx.save_for_backward(active, grad_rows)
        return (lse - target_logit).sum() / count

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return stored_rows_backward(ctx, grad_loss), None, None, None, None, None


def stored_rows_backward(ctx: Any, grad_loss: torch.Tensor) -> torch.Tensor:
    """The backward of a fused route whose forward saved ``(active, grad_rows)``: the supervised rows' gradient
    ``[A, H]``, scaled by the incoming gradient and scattered to ``[T, H]`` (``ctx.num_rows_total`` rows of
    ``ctx.hidden_dtype``); the other rows' gradient is zero."""
    active, grad_rows = ctx.saved_tensors
    grad_hidden = grad_rows.new_zeros((ctx.num_rows_total, grad_rows.shape[1]), dtype=ctx.hidden_dtype)
    if active.numel():
        grad_hidden.index_copy_(0, active, (grad_rows * grad_loss.to(grad_rows.dtype)).to(ctx.hidden_dtype))
    return grad_hidden


def _chunks(
    weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, chunk_size: int, compute: torch.dtype
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Yield ``(cols, hit, w, b)`` per vocabulary chunk.

    ``w`` is the chunk of the head in the compute dtype (a view when no cast is needed), ``b`` its bias (or None),
    ``hit`` marks the rows whose target falls in the chunk and ``cols`` ([A, 1]) is the
    target's column within the chunk (clamped, meaningful only where ``hit``).
    """
    vocab = weight.shape[0]
    for start in range(0, vocab, chunk_size):
        stop = min(start + chunk_size, vocab)
        local = targets - start
        hit = (local >= 0) & (local < stop - start)
        cols = local.clamp(0, stop - start - 1).unsqueeze(1)
        yield cols, hit, weight[start:stop].to(compute), None if bias is None else bias[start:stop].to(compute)
