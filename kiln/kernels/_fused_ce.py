"""Fused chunked linear cross-entropy: one autograd node from hidden states to the loss.

Forward gathers the ``A`` supervised rows, walks the vocabulary in chunks of ``C`` rows of
the head, computes each chunk's logits in the compute dtype (at least fp32) and keeps an
online log-sum-exp and the target logit per row. It saves the gathered rows, their
log-sum-exp, targets and indices (and a reference to the frozen head), never logits.

Backward recomputes each chunk's logits, turns them into ``(softmax - one_hot) * g / A``
in place and accumulates ``d(hidden_active) += chunk @ W_chunk`` in the compute dtype,
then scatters the rows back to ``[T, H]`` (zeros for ignored rows). Neither ``[T, V]``
nor ``[A, V]`` ever exists: the peak is ``O(A·H + A·C)``.

Every step is a deterministic op (matmul, elementwise, row reductions, gathers and
scatters onto distinct positions), so the same inputs give bit-identical loss and
gradients run after run.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100


def fused_chunked_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
) -> torch.Tensor:
    """Masked mean cross-entropy of ``hidden @ weight.T`` against ``labels``, vocabulary chunk by chunk.

    Raises ``ValueError`` for a trainable head or a chunk size below 1. With no supervised
    position the result is a 0.0 still connected to ``hidden`` (its gradient is zeros).
    """
    if weight.requires_grad:
        raise ValueError(
            "the fused_chunked_linear_ce loss route needs a frozen LM head (weight.requires_grad is True): Kiln trains LoRA adapters and never updates the head, so this route computes no head gradient; call weight.requires_grad_(False) or use the full_logits route"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return _FusedLinearCrossEntropy.apply(hidden, weight, labels, chunk_size)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size):
        compute = torch.promote_types(torch.promote_types(hidden.dtype, weight.dtype), torch.float32)
        active = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        targets = labels.index_select(0, active)
        rows_in = hidden.index_select(0, active)
        ctx.num_rows_total = hidden.shape[0]
        ctx.chunk_size = chunk_size
        ctx.compute = compute
        count = active.numel()
        if count == 0:
            ctx.save_for_backward(rows_in, active, targets, rows_in.new_empty(0, dtype=compute), weight)
            return hidden.new_zeros((), dtype=compute)

        rows = rows_in.to(compute)
        running_max = rows.new_full((count,), float("-inf"))
        running_sum = rows.new_zeros(count)
        target_logit = rows.new_zeros(count)
        for cols, hit, w in _chunks(weight, targets, chunk_size, compute):
            logits = rows @ w.T  # [A, C]
            target_logit += torch.where(hit, logits.gather(1, cols).squeeze(1), 0.0)
            new_max = torch.maximum(running_max, logits.amax(dim=1))
            running_sum = running_sum * torch.exp(running_max - new_max)
            running_sum += logits.sub_(new_max.unsqueeze(1)).exp_().sum(dim=1)
            running_max = new_max
            del logits  # free this chunk before the next one is allocated
        lse = running_max + torch.log(running_sum)
        ctx.save_for_backward(rows_in, active, targets, lse, weight)
        return (lse - target_logit).sum() / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        rows_in, active, targets, lse, weight = ctx.saved_tensors
        compute = ctx.compute
        grad_hidden = rows_in.new_zeros((ctx.num_rows_total, rows_in.shape[1]))
        count = active.numel()
        if count == 0:
            return grad_hidden, None, None, None

        rows = rows_in.to(compute)
        scale = grad_loss.to(compute) / count
        grad_rows = torch.zeros_like(rows)
        lse = lse.unsqueeze(1)
        for cols, hit, w in _chunks(weight, targets, ctx.chunk_size, compute):
            probs = (rows @ w.T).sub_(lse).exp_()  # softmax restricted to this chunk, [A, C]
            probs.scatter_add_(1, cols, hit.to(compute).neg().unsqueeze(1))  # - one_hot(target)
            probs.mul_(scale)
            grad_rows.addmm_(probs, w)
            del probs
        grad_hidden.index_copy_(0, active, grad_rows.to(grad_hidden.dtype))
        return grad_hidden, None, None, None


def _chunks(weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, compute: torch.dtype):
    """Yield ``(cols, hit, w)`` per vocabulary chunk.

    ``w`` is the chunk of the head in the compute dtype (a view when no cast is needed),
    ``hit`` marks the rows whose target falls in the chunk and ``cols`` ([A, 1]) is the
    target's column within the chunk (clamped, meaningful only where ``hit``).
    """
    vocab = weight.shape[0]
    for start in range(0, vocab, chunk_size):
        stop = min(start + chunk_size, vocab)
        local = targets - start
        hit = (local >= 0) & (local < stop - start)
        cols = local.clamp(0, stop - start - 1).unsqueeze(1)
        yield cols, hit, weight[start:stop].to(compute)
