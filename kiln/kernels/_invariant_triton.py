"""The invariant operations as Triton kernels (CUDA; CPU tensors in triton's interpreter): the reduction structure of
``kiln.kernels.invariant``, with each program owning its output and reducing in a fixed order.

* ``linear``: one program per ``[BLOCK_M, BLOCK_N]`` output tile; ``K`` reduced whole, ``BLOCK_K`` at a time, in
  order, into an fp32 accumulator (``tl.dot``; fp32 inputs at IEEE precision, bf16 on the tensor cores) -- no split
  of ``K``, no atomics. The number of rows only changes how many programs run, never what one computes.
* ``attention``: one program per (batch row and key/value head, ``BLOCK_M`` query rows); the keys in chunks of
  ``KEY_CHUNK`` aligned at position 0, in order, with an online softmax whose running maximum, sum and values
  product are left untouched by a chunk the query sees nothing of. So a query's bits do not depend on the other
  queries, on padding, or on chunks past its position (present in a prefill, absent when it decodes).
* ``rms_norm``, ``layer_norm``: one program per row, the row's sums by one fixed reduction tree (``tl.reduce``).
* ``log_softmax``: one program per row; the maximum, then the sum of ``exp`` block by block in order.

As in ``_triton_rows``, every kernel is decorated at its first launch in each mode (``triton.jit`` reads
``TRITON_INTERPRET`` as it decorates) and reduces with ``tl.reduce`` over triton's own combine functions (which the
interpreter recognises, whatever the import order), never calling another ``@jit`` function. Only ``invariant`` imports this module,
inside a function.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from ._triton_rows import interpreting

# triton's own combine functions: the compiler reduces with them like tl.sum / tl.max, and the interpreter
# recognises them and reduces with numpy (a custom combine function there is a slow element-by-element loop)
_add = tl.standard._sum_combine
_max = tl.standard._elementwise_max

BLOCK_M = 32
BLOCK_N = 64
BLOCK_K = 32
ATTENTION_ROWS = 16
ROW_BLOCK = 4096  # log_softmax: columns per block
KEY_CHUNK = 64  # the same alignment as the torch structure


def _linear_kernel(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    rows: int,
    cols: int,
    depth: int,
    sxm: int,
    sxk: int,
    swn: int,
    swk: int,
    som: int,
    IEEE: tl.constexpr,  # noqa: N803 -- triton's constexpr style
    BM: tl.constexpr,  # noqa: N803
    BN: tl.constexpr,  # noqa: N803
    BK: tl.constexpr,  # noqa: N803
) -> None:
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.full((BM, BN), 0.0, tl.float32)
    for start in range(0, depth, BK):
        rk = start + tl.arange(0, BK)
        a = tl.load(
            x + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < rows) & (rk[None, :] < depth), other=0.0
        )
        b = tl.load(
            w + rn[None, :] * swn + rk[:, None] * swk, mask=(rn[None, :] < cols) & (rk[:, None] < depth), other=0.0
        )
        if IEEE:  # noqa: SIM108 -- a constexpr branch: each compiled kernel holds one of the two products
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    tl.store(
        out + rm[:, None] * som + rn[None, :],
        acc.to(out.dtype.element_ty),
        mask=(rm[:, None] < rows) & (rn[None, :] < cols),
    )


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` (``w`` ``[N, K]``, any strides) in ``x``'s dtype, by the tiled kernel."""
    rows = x.reshape(-1, x.shape[-1])
    count, depth = rows.shape
    cols = w.shape[0]
    out = torch.empty((count, cols), dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(count, BLOCK_M), triton.cdiv(cols, BLOCK_N))
    _kernel(_linear_kernel, interpreting())[grid](
        rows, w, out, count, cols, depth, rows.stride(0), rows.stride(1), w.stride(0), w.stride(1), out.stride(0),
        IEEE=x.dtype == torch.float32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
    )  # fmt: skip
    return out.view(*x.shape[:-1], cols)


def _attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    heads: int,
    rows: int,
    keys: int,
    dim: int,
    scale: float,
    window: int,
    sq_b: int,
    sq_r: int,
    sk_b: int,
    sk_l: int,
    sv_b: int,
    sv_l: int,
    sp_b: int,
    so_b: int,
    so_r: int,
    sl_b: int,
    HAS_WINDOW: tl.constexpr,  # noqa: N803
    BM: tl.constexpr,  # noqa: N803
    KC: tl.constexpr,  # noqa: N803
    BD: tl.constexpr,  # noqa: N803
) -> None:
    bh = tl.program_id(0).to(tl.int64)  # batch row * heads + key/value head
    batch = bh // heads
    r = tl.program_id(1).to(tl.int64) * BM + tl.arange(0, BM)
    d = tl.arange(0, BD)
    inside = r < rows
    qt = tl.load(q + bh * sq_b + r[:, None] * sq_r + d[None, :], mask=inside[:, None] & (d[None, :] < dim), other=0.0)
    where = tl.load(positions + batch * sp_b + r, mask=inside, other=-1)
    m = tl.full((BM,), float("-inf"), tl.float32)
    total = tl.full((BM,), 0.0, tl.float32)
    acc = tl.full((BM, BD), 0.0, tl.float32)
    for start in range(0, keys, KC):
        kk = start + tl.arange(0, KC)
        present = kk < keys
        kt = tl.load(
            k + bh * sk_b + kk[:, None] * sk_l + d[None, :], mask=present[:, None] & (d[None, :] < dim), other=0.0
        )
        vt = tl.load(
            v + bh * sv_b + kk[:, None] * sv_l + d[None, :], mask=present[:, None] & (d[None, :] < dim), other=0.0
        )
        scores = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale
        visible = (kk[None, :] <= where[:, None]) & present[None, :]
        if HAS_WINDOW:
            visible = visible & (kk[None, :] > where[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        seen = tl.reduce(visible.to(tl.int32), 1, _max) > 0
        m_new = tl.maximum(m, tl.reduce(scores, 1, _max))
        # every subtraction below is of finite values (a row that sees nothing yet takes 0s): no NaN is ever made
        finite_new = tl.where(seen, m_new, 0.0)
        alpha = tl.exp(tl.where(seen & (m > float("-inf")), m - finite_new, float("-inf")))
        p = tl.exp(tl.where(visible, scores - finite_new[:, None], float("-inf")))
        total = tl.where(seen, total * alpha + tl.reduce(p, 1, _add), total)
        acc = tl.where(seen[:, None], acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee"), acc)
        m = tl.where(seen, m_new, m)
    some = total > 0.0  # rows past the queries see nothing; they are never stored
    tl.store(
        out + bh * so_b + r[:, None] * so_r + d[None, :],
        acc / tl.where(some, total, 1.0)[:, None],
        mask=inside[:, None] & (d[None, :] < dim),
    )
    tl.store(lse + bh * sl_b + r, m + tl.log(tl.where(some, total, 1.0)), mask=inside)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, Hkv, R, D], lse [B, Hkv, R])`` for float32 query rows ``q`` ``[B, Hkv, R, D]``, keys and values
    ``[B, Hkv, L, D]`` and row positions ``[B, R]`` (see ``invariant.attention``)."""
    batch, heads, rows, dim = q.shape
    q, k, v = q.contiguous(), k.float().contiguous(), v.float().contiguous()
    positions = positions.to(torch.int64).contiguous()
    keys = min(k.shape[2], int(positions.max()) + 1) if positions.numel() else 0
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads, rows), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(dim))
    grid = (batch * heads, triton.cdiv(rows, ATTENTION_ROWS))
    _kernel(_attention_kernel, interpreting())[grid](
        q, k, v, positions, out, lse, heads, rows, keys, dim, float(scale), int(window),
        q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2), positions.stride(0),
        out.stride(1), out.stride(2), lse.stride(1),
        HAS_WINDOW=bool(window), BM=ATTENTION_ROWS, KC=KEY_CHUNK, BD=block_d,
    )  # fmt: skip
    return out, lse


def _norm_kernel(
    x: torch.Tensor,
    out: torch.Tensor,
    width: int,
    eps: float,
    sx: int,
    so: int,
    CENTRED: tl.constexpr,  # noqa: N803
    BLOCK: tl.constexpr,  # noqa: N803
) -> None:
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    values = tl.load(x + row * sx + cols, mask=inside, other=0.0)
    if CENTRED:
        values = tl.where(inside, values - tl.reduce(values, 0, _add) / width, 0.0)
    variance = tl.reduce(values * values, 0, _add) / width
    tl.store(out + row * so + cols, values * (1.0 / tl.sqrt_rn(variance + eps)), mask=inside)


def _norm(x: torch.Tensor, eps: float, centred: bool) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    _kernel(_norm_kernel, interpreting())[(rows.shape[0],)](
        rows, out, rows.shape[1], float(eps), rows.stride(0), out.stride(0),
        CENTRED=centred, BLOCK=max(16, triton.next_power_of_2(rows.shape[1])),
    )  # fmt: skip
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, eps, centred=False)


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm(x, eps, centred=True)


def _log_softmax_kernel(x: torch.Tensor, out: torch.Tensor, width: int, sx: int, so: int, BLOCK: tl.constexpr) -> None:  # noqa: N803
    row = tl.program_id(0).to(tl.int64)
    top = float("-inf")
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        top = tl.maximum(top, tl.reduce(tl.load(x + row * sx + cols, mask=cols < width, other=float("-inf")), 0, _max))
    shift = tl.where((top > float("-inf")) & (top < float("inf")), top, 0.0)
    total = 0.0
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.load(x + row * sx + cols, mask=cols < width, other=float("-inf"))
        total += tl.reduce(tl.exp(values - shift), 0, _add)
    norm = tl.log(total)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        values = tl.load(x + row * sx + cols, mask=cols < width, other=0.0)
        tl.store(out + row * so + cols, (values - shift) - norm, mask=cols < width)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    block = min(ROW_BLOCK, max(16, triton.next_power_of_2(rows.shape[1])))
    _kernel(_log_softmax_kernel, interpreting())[(rows.shape[0],)](
        rows, out, rows.shape[1], rows.stride(0), out.stride(0), BLOCK=block
    )
    return out.view(x.shape)


@functools.cache
def _kernel(function: Any, interpret: bool) -> Any:
    """``function`` under ``triton.jit``, decorated (and cached) per interpreter mode."""
    del interpret  # the cache key: triton.jit reads the same setting itself
    return triton.jit(function)
