"""Triton fused linear cross-entropy (the ``triton_fused_linear_ce`` route): row chunks, one Triton program per row.

Liger's structure, for a frozen head (LoRA never updates it, so no head gradient is computed):

* gather the ``A`` supervised rows in fp32 (bf16 and fp16 inputs are cast; fp64 is refused -- the kernel
  computes in fp32, and ``fused_chunked_linear_ce`` serves fp64);
* per chunk of ``R`` rows (``rows_per_chunk``; the last chunk is ragged), with one ``[R, V]`` fp32 buffer
  reused by every chunk:

  1. ``z = rows @ W.T + b`` into the buffer (torch matmul in fp32). An fp32 head is used as it is; a narrower
     head is cast to fp32 a slice of head rows at a time, each slice no larger than the buffer, so no fp32
     copy of the whole head ever exists;
  2. one Triton program per row (``_triton_rows``): the model's ``LogitMap`` (scale, soft-cap), an online
     log-sum-exp over the vocabulary in blocks, the row's loss ``lse - y[target]``, and
     ``d loss / d z = (softmax(y) - onehot) · y'(z) / A`` written over ``z`` in place;
  3. ``d loss / d rows = (d loss / d z) @ W`` (torch matmul), stored for backward;

* the loss is the sum of the ``A`` row losses divided by ``A``.

Backward only scales the stored ``[A, H]`` gradient by the incoming gradient and scatters it to ``[T, H]``
(as ``fused_chunked_linear_ce`` does); nothing is recomputed. The peak is ``O(A·H + R·V)`` (plus one cast head
slice of at most ``R·V`` values for a narrower head). When ``hidden`` needs no gradient the kernel skips its
second pass and no gradient matmul runs.

There are no atomics: each program owns its row, the row losses are reduced by one ``torch.sum``, and the
chunks run in order, so the result is bit-identical run after run whenever the matmuls are (cuBLAS is, for
fixed shapes on one GPU model). The chunk size and the head slices change the matmul shapes, so a run fixes
``rows_per_chunk`` once (``choose_loss_route``) and receipts record it.

The kernels run on CUDA tensors, or on CPU tensors in triton's interpreter (``TRITON_INTERPRET=1``, how the
tests run them; fp32 only, the interpreter has no bf16 arithmetic). ``triton`` is imported inside functions
only, so this module imports without it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from ._fused_ce import IGNORE_INDEX, stored_rows_backward
from ._logit_map import IDENTITY, LogitMap

COMPUTE = torch.float32


@functools.cache
def triton_available() -> bool:
    """Whether ``triton`` imports here (checked once per process)."""
    try:
        import triton  # noqa: F401 -- only whether it imports
    except ImportError:
        return False
    return True


def check_triton_device(device: torch.device | str) -> None:
    """Raise ``ValueError`` unless the ``triton_fused_linear_ce`` route can run its kernels on ``device``.

    It can on a CUDA device when triton imports, and on the CPU when triton's interpreter is on
    (``TRITON_INTERPRET=1``, read now).
    """
    device = torch.device(device)
    if not triton_available():
        raise ValueError(
            f"the triton_fused_linear_ce loss route needs the triton package, which does not import here (device {device}); install triton or use the fused_chunked_linear_ce route"
        )
    if device.type == "cuda":
        return
    from ._triton_rows import interpreting

    if device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"the triton_fused_linear_ce loss route runs its Triton kernels on CUDA devices (or on the CPU under TRITON_INTERPRET=1), not on device {device}; use the fused_chunked_linear_ce route there"
    )


def triton_fused_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    rows_per_chunk: int,
    bias: torch.Tensor | None = None,
    logit_map: LogitMap = IDENTITY,
    *,
    block: int | None = None,
) -> torch.Tensor:
    """Masked mean cross-entropy of ``logit_map(hidden @ weight.T + bias)`` against ``labels``, ``rows_per_chunk``
    supervised rows at a time.

    Raises ``ValueError`` for a trainable head, a chunk below 1 row, fp64 inputs, or a device the kernels cannot
    run on (``check_triton_device``). With no supervised position the result is a 0.0 still connected to
    ``hidden`` (its gradient is zeros). ``block`` overrides the kernel's vocabulary block (a power of two; the
    default covers the vocabulary up to 4096 columns).
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError(
            "the triton_fused_linear_ce loss route needs a frozen LM head (weight.requires_grad is True): Kiln trains LoRA adapters and never updates the head, so this route computes no head gradient; call weight.requires_grad_(False) or use the full_logits route"
        )
    if isinstance(rows_per_chunk, bool) or not isinstance(rows_per_chunk, int) or rows_per_chunk < 1:
        raise ValueError(f"chunk_size (supervised rows per chunk) must be a positive int, got {rows_per_chunk!r}")
    if block is not None and (block < 1 or block & (block - 1)):
        raise ValueError(f"block must be a power of two, got {block!r}")
    dtypes = [hidden.dtype, weight.dtype] + ([] if bias is None else [bias.dtype])
    if torch.float64 in dtypes:
        raise ValueError(
            "the triton_fused_linear_ce loss route computes in fp32 and does not take float64 inputs; use the fused_chunked_linear_ce route for float64"
        )
    check_triton_device(hidden.device)
    return _TritonLinearCrossEntropy.apply(hidden, weight, labels, rows_per_chunk, bias, logit_map, block)


class _TritonLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        rows_per_chunk: int,
        bias: torch.Tensor | None,
        logit_map: LogitMap,
        block: int | None,
    ) -> torch.Tensor:
        active = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        ctx.num_rows_total = hidden.shape[0]
        ctx.hidden_dtype = hidden.dtype
        count = active.numel()
        width = hidden.shape[1]
        if count == 0:
            ctx.save_for_backward(active, hidden.new_empty((0, width), dtype=COMPUTE))
            return hidden.new_zeros((), dtype=COMPUTE)

        from ._triton_rows import launch_rows

        want_grad = ctx.needs_input_grad[0]
        targets = labels.index_select(0, active)
        rows = hidden.index_select(0, active).to(COMPUTE)
        vocab = weight.shape[0]
        chunk = min(rows_per_chunk, count)
        # a narrower head is cast a slice at a time, each slice holding at most as many values as the buffer
        head_slice = vocab if weight.dtype == COMPUTE else max(1, chunk * vocab // max(width, 1))
        buffer = rows.new_empty((chunk, vocab))
        losses = rows.new_empty(count)
        grad_rows = rows.new_empty((count if want_grad else 0, width))
        for start in range(0, count, chunk):
            stop = min(start + chunk, count)
            logits = buffer[: stop - start]
            for cols, w, b in _head_slices(weight, bias, head_slice):
                if b is None:
                    torch.mm(rows[start:stop], w.T, out=logits[:, cols])
                else:
                    torch.addmm(b, rows[start:stop], w.T, out=logits[:, cols])
            launch_rows(
                logits,
                targets[start:stop],
                losses[start:stop],
                scale=float(logit_map.scale),
                softcap=None if logit_map.softcap is None else float(logit_map.softcap),
                count=count,
                write_grad=want_grad,
                block=block,
            )
            if want_grad:  # the buffer now holds d loss / d z
                grad = grad_rows[start:stop]
                for index, (cols, w, _) in enumerate(_head_slices(weight, None, head_slice)):
                    if index == 0:
                        torch.mm(logits[:, cols], w, out=grad)
                    else:
                        grad.addmm_(logits[:, cols], w)
        ctx.save_for_backward(active, grad_rows)
        return losses.sum() / count

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return stored_rows_backward(ctx, grad_loss), None, None, None, None, None, None


def _head_slices(
    weight: torch.Tensor, bias: torch.Tensor | None, size: int
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor | None]]:
    """Yield ``(cols, w, b)`` per slice of ``size`` head rows: the slice in fp32 (a view when it already is) and
    its bias (or None); ``cols`` selects the slice's columns of the logits."""
    vocab = weight.shape[0]
    for start in range(0, vocab, size):
        cols = slice(start, min(start + size, vocab))
        yield cols, weight[cols].to(COMPUTE), None if bias is None else bias[cols].to(COMPUTE)
