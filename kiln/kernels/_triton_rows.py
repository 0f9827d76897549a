"""The Triton program of the ``triton_fused_linear_ce`` route: one program per supervised row of a logits chunk.

Only ``_triton_ce`` imports this module, and only inside a function, so ``import kiln.kernels`` never needs
triton.

Triton 3.8 reads ``TRITON_INTERPRET`` when ``triton.jit`` decorates a function: with it on the result is an
interpreted function (Python on numpy), otherwise a compiled one, and an interpreted kernel cannot call a
compiled function. Triton's own ``tl.sum`` and ``tl.max`` are ``@jit`` functions decorated when triton is
imported, so a kernel calling them runs in the interpreter only if the variable was set before that import.
This kernel therefore calls no ``@jit`` function: its body is decorated at the first launch in each mode
(``_kernel``), and it reduces with ``tl.reduce`` (a builtin) over two combine functions, which the interpreter
calls as plain Python whatever their kind. The interpreter then runs the kernel whenever
``TRITON_INTERPRET=1`` is set at launch, before or after triton was imported.

Each program reads one row ``z`` (fp32, the head's output with its bias) of the chunk's logits buffer:

1. applies the model's ``LogitMap``: ``y = s·z``, or ``y = c·tanh(s·z / c)`` with a soft-cap, where
   ``tanh(u) = sign(u)·(1 - e)/(1 + e)`` with ``e = exp(-2|u|)`` (no overflow for any ``u``);
2. walks the vocabulary in blocks of ``BLOCK`` with an online log-sum-exp (running max, rescaled sum);
3. writes the row's loss ``lse - y[target]``;
4. when asked, walks the vocabulary again and overwrites ``z`` in place with
   ``d loss / d z = (softmax(y) - onehot(target)) · y'(z) / count``, where ``y'(z) = s`` or
   ``s·(1 - tanh²(u)) = s·4e/(1 + e)²``, and ``count`` is the number of supervised rows of the whole call.

Masked lanes (past the vocabulary) enter the reductions as ``-inf`` and are never stored. No atomics: each
program owns its row.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

MIN_BLOCK = 16
MAX_BLOCK = 4096


@triton.jit
def _add(a: tl.tensor, b: tl.tensor) -> tl.tensor:
    return a + b


@triton.jit
def _max(a: tl.tensor, b: tl.tensor) -> tl.tensor:
    return tl.maximum(a, b)


def _row_cross_entropy(
    logits: torch.Tensor,
    row_stride: int,
    targets: torch.Tensor,
    losses: torch.Tensor,
    n_cols: int,
    scale: float,
    softcap: float,
    count: float,
    HAS_SOFTCAP: tl.constexpr,  # noqa: N803 -- triton's constexpr style
    WRITE_GRAD: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
) -> None:
    """One row: its loss into ``losses[row]`` and, with ``WRITE_GRAD``, d loss / d z over its logits in place."""
    row = tl.program_id(0).to(tl.int64)
    row_logits = logits + row * row_stride
    target = tl.load(targets + row)
    running_max = float("-inf")
    running_sum = 0.0
    target_logit = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        y = tl.load(row_logits + cols, mask=inside, other=0.0) * scale
        if HAS_SOFTCAP:
            u = y / softcap
            e = tl.exp(-2.0 * tl.abs(u))
            magnitude = (1.0 - e) / (1.0 + e)
            y = tl.where(u < 0.0, -magnitude, magnitude) * softcap
        y = tl.where(inside, y, float("-inf"))
        target_logit += tl.reduce(tl.where(cols == target, y, 0.0), 0, _add)
        new_max = tl.maximum(running_max, tl.reduce(y, 0, _max))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.reduce(tl.exp(y - new_max), 0, _add)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    tl.store(losses + row, lse - target_logit)
    if WRITE_GRAD:
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            y = tl.load(row_logits + cols, mask=inside, other=0.0) * scale
            slope = scale
            if HAS_SOFTCAP:
                u = y / softcap
                e = tl.exp(-2.0 * tl.abs(u))
                magnitude = (1.0 - e) / (1.0 + e)
                y = tl.where(u < 0.0, -magnitude, magnitude) * softcap
                slope = scale * (4.0 * e / ((1.0 + e) * (1.0 + e)))
            probs = tl.exp(tl.where(inside, y, float("-inf")) - lse)
            grad = (probs - tl.where(cols == target, 1.0, 0.0)) * slope / count
            tl.store(row_logits + cols, grad, mask=inside)


def interpreting() -> bool:
    """Whether triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), read now."""
    return bool(triton.knobs.runtime.interpret)


def launch_rows(
    logits: torch.Tensor,
    targets: torch.Tensor,
    losses: torch.Tensor,
    *,
    scale: float,
    softcap: float | None,
    count: int,
    write_grad: bool,
    block: int | None = None,
) -> None:
    """One program per row of ``logits`` [n, V] (fp32, contiguous rows): ``losses[i]`` and, with ``write_grad``,
    d loss / d z in place. ``block`` overrides the vocabulary block (a power of two; default ``block_size(V)``)."""
    rows, vocab = logits.shape
    block = block_size(vocab) if block is None else block
    _kernel(interpreting())[(rows,)](
        logits,
        logits.stride(0),
        targets,
        losses,
        vocab,
        float(scale),
        1.0 if softcap is None else float(softcap),
        float(count),
        HAS_SOFTCAP=softcap is not None,
        WRITE_GRAD=write_grad,
        BLOCK=block,
        num_warps=8 if block >= 2048 else 4,
    )


def block_size(vocab: int) -> int:
    """The vocabulary block one program loads at a time: the power of two covering ``vocab``, within [16, 4096]."""
    return min(MAX_BLOCK, max(MIN_BLOCK, triton.next_power_of_2(vocab)))


@functools.cache
def _kernel(interpret: bool) -> Any:
    """``_row_cross_entropy`` under ``triton.jit``, decorated (and cached) per interpreter mode.

    ``triton.jit`` reads ``TRITON_INTERPRET`` as it decorates, which is the mode of this launch. The kernel calls
    no helper ``@jit`` function (a callee is found by its global name, which holds one kind only), so the logit
    map is written out in both passes.
    """
    del interpret  # the cache key: triton.jit reads the same setting itself
    return triton.jit(_row_cross_entropy)
