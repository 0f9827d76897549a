"""Kiln's invariant operations: every op a decoder forward runs, computed so that a row's bits depend only on that
row -- not on the rows beside it, not on padding, not on whether its positions ran in one prefill or one at a time,
not on whether autograd records. ``docs/invariant.md`` explains the whole design.

The reduction structure (the same on every device; the tile sizes are each device's):

* ``linear(x, w, b)`` -- each output element is one row of ``x`` against one row of ``w``, reduced over ``K`` whole
  by one kernel whatever the number of rows (no split of ``K``); the bias is added after.
* ``attention(q, k, v, positions, scale, window)`` -- keys in chunks of ``KEY_CHUNK`` aligned at key position 0;
  query rows grouped per key/value head, in tiles of ``ROW_TILE``. Chunk by chunk, in order: the chunk's scores,
  the keys outside the query's view masked to -inf, the running maximum, ``exp`` of the scores less it, and the
  chunk's row sum and values product added to the running ones after rescaling them. A chunk a query sees nothing
  of leaves all three untouched (the update is skipped), so chunks past a query's position -- present in a
  prefill, absent when the query decodes -- change nothing, and the keys it sees are reduced in one order.
* ``rms_norm``, ``layer_norm``, ``log_softmax`` -- reductions along a row, by one fixed structure per row length;
  maxima (exact in any order).
* ``silu``, ``gelu_tanh``, ``tanh``, ``exp`` -- per element.

On the CPU (torch):

* products of the projections are oneDNN matmuls (``torch.ops.mkldnn._linear_pointwise``) on at least two rows --
  a lone row goes with a zero row beside it: oneDNN reduces one row by another kernel, and from two rows on by one
  kernel for any count (``tests/test_invariant_ops.py`` checks it). Without oneDNN, fixed-shape tiles:
  ``[ROW_TILE, K] x [K, block]`` items of one ``bmm`` of at least two items (a lone item goes twice: the matrix
  library takes another path for one);
* attention's products and the norms' sums are fixed-shape ``bmm`` items: ``[ROW_TILE, D] x [D, KEY_CHUNK]`` for a
  chunk's scores, ``[ROW_TILE, KEY_CHUNK] x [KEY_CHUNK, D + 1]`` for its values product and row sum together (a
  column of ones beside the values), ``[SUM_TILE, H] x [H, 1]`` for a norm's sum;
* the log-softmax's sum over the vocabulary is ``exact.tree_sum``, and every transcendental function is
  ``kiln.kernels.exact``'s, built from IEEE-754 basic operations only: torch's own round some elements differently
  in their vector and scalar paths, and which path an element takes depends on where it sits in the tensor.

On CUDA the same structure runs as Triton kernels (``_invariant_triton``): each program owns an output tile or a
row and reduces in a fixed loop (no split-K, no atomics); the number of rows never changes a program's work.
``triton_backend()`` runs them on CPU tensors in triton's interpreter (``TRITON_INTERPRET=1``: how the tests check
them). Elementwise functions on CUDA are torch's, whose one kernel computes every element alike.

Gradients: each op is one autograd node whose backward uses torch's ordinary kernels (a gradient need not be
invariant; a forward value must); with no gradient to record the forward runs directly, the same computation.

``IMPLEMENTATION`` names the structure and its CPU tile sizes; it changes whenever the numerics do.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator
from typing import Any

import torch

from . import exact as _exact
from .exact import rope_table

__all__ = [
    "COL_BLOCK",
    "IMPLEMENTATION",
    "KEY_CHUNK",
    "ROW_TILE",
    "attention",
    "backend_for",
    "exp",
    "gelu_tanh",
    "layer_norm",
    "linear",
    "log_softmax",
    "onednn_route",
    "pack",
    "rms_norm",
    "rope_table",
    "silu",
    "tanh",
    "triton_backend",
]

ROW_TILE = 8
COL_BLOCK = 128
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
KEY_CHUNK = 64

_FORCE_TRITON: list[bool] = []  # tests: the Triton kernels on CPU tensors (under TRITON_INTERPRET=1)


@contextlib.contextmanager
def triton_backend() -> Iterator[None]:
    """Run the Triton kernels whatever the device, for this block (tests, under ``TRITON_INTERPRET=1``)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton kernels run on CPU tensors only in triton's interpreter (TRITON_INTERPRET=1)")
    _FORCE_TRITON.append(True)
    try:
        yield
    finally:
        _FORCE_TRITON.pop()


def backend_for(device: torch.device) -> str:
    """``triton`` on CUDA (or when ``triton_backend`` forces it), ``torch`` elsewhere."""
    return "triton" if _FORCE_TRITON or device.type == "cuda" else "torch"


@functools.cache
def _triton() -> Any:
    from . import _invariant_triton

    return _invariant_triton


# ----------------------------------------------------------------------------- matrix products (torch)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _row_tiles(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[M, K]`` as ``[T, ROW_TILE, K]`` in a fresh contiguous buffer, zero rows filling the last tile."""
    count = rows.shape[0]
    tiles = max(1, -(-count // ROW_TILE))
    padded = torch.nn.functional.pad(rows, (0, 0, 0, tiles * ROW_TILE - count))
    return padded.reshape(tiles, ROW_TILE, rows.shape[1])


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm`` on at least two items (a lone item is sent twice; see the module docstring)."""
    if a.shape[0] == 1:
        return torch.bmm(a.expand(2, -1, -1), b.expand(2, -1, -1))[:1]
    return torch.bmm(a, b)


@functools.cache
def column_block(n: int) -> int:
    """The column block of a weight with ``n`` output columns: the largest divisor of ``n`` between 8 and
    ``min(COL_BLOCK, n / 2)`` -- so a product over the blocks has at least two items --, else ``COL_BLOCK`` (or
    ``n`` when smaller) with one narrower last block."""
    for width in range(min(COL_BLOCK, n // 2), 7, -1):
        if n % width == 0:
            return width
    return min(n, COL_BLOCK)


def _tiled_products(tiles: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``[T, ROW_TILE, N]``: every tile times ``w.T`` (``w`` ``[N, K]``, any strides), one fixed-shape product
    ``[ROW_TILE, K] x [K, block]`` per (tile, column block)."""
    count = tiles.shape[0]
    n, k = w.shape
    block = column_block(n)
    full = n // block * block
    nb = full // block
    blocks = w[:full].reshape(nb, block, k).transpose(1, 2)  # [nb, K, block], a view
    if count == 1:  # one tile: one product over every block
        out = _bmm(tiles.expand(nb, -1, -1), blocks).transpose(0, 1).reshape(1, ROW_TILE, full)
    elif count <= nb:  # few tiles: one product per tile over every block
        out = torch.stack(
            [_bmm(tiles[t].expand(nb, -1, -1), blocks).transpose(0, 1).reshape(ROW_TILE, full) for t in range(count)]
        )
    else:  # many tiles: one product per block over every tile
        out = torch.cat([_bmm(tiles, blocks[j].expand(count, -1, -1)) for j in range(nb)], dim=-1)
    if full < n:
        out = torch.cat([out, _bmm(tiles, w[full:].t().expand(count, -1, -1))], dim=-1)
    return out


@functools.cache
def onednn_products() -> bool:
    """Whether this torch runs CPU products through oneDNN's matmul (its x86 and Arm builds do): decided once per
    process, so every product of a run takes the same route."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


IMPLEMENTATION = (
    f"kiln.invariant.v1 (cpu: {'onednn' if onednn_products() else 'tiled'} products, rows {ROW_TILE}, "
    f"keys {KEY_CHUNK}; cuda: triton)"
)


def _linear_forward(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    if backend_for(x.device) == "triton":
        out: torch.Tensor = _triton().linear(x, w)
        return out
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    if onednn_route(w):
        if count == 1:  # oneDNN reduces a lone row another way; with a zero row beside it, as every batch
            rows = torch.nn.functional.pad(rows, (0, 0, 0, 1))
        out = torch.ops.mkldnn._linear_pointwise(rows, w if packed is None else packed, None, "none", [], "")
    else:
        out = _tiled_products(_row_tiles(rows), w).view(-1, w.shape[0])
    if out.shape[0] != count:
        out = out[:count]
    return out.view(*x.shape[:-1], w.shape[0])


SMALL_WEIGHT = 1 << 16  # weights of at most this many elements take the tiles on the CPU (oneDNN's call costs more)


def onednn_route(w: torch.Tensor) -> bool:
    """Whether the CPU products with ``w`` run through oneDNN (else through fixed-shape tiles): a function of the
    weight's shape and dtype only, so every product with one weight takes one route."""
    return onednn_products() and w.dtype in ONEDNN_DTYPES and w.shape[0] * w.shape[1] > SMALL_WEIGHT


def pack(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked layout of a frozen CPU weight ``w`` ``[N, K]`` (a copy), which its products read without
    reordering ``w`` at each call -- the same bits as with ``w`` itself (``tests/test_invariant_ops.py``) --, or
    None when ``w``'s products do not take oneDNN."""
    if w.device.type != "cpu" or not onednn_route(w):
        return None
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), 8)
    return packed


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        out = _linear_forward(x, w)
        return out if b is None else out + b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        grad_x = grad @ w if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ w.T + b`` (``w`` ``[N, K]``; a transposed view serves GPT-2's ``Conv1D``), in ``x``'s dtype, by the
    structure of the module docstring. ``x`` is cast to ``w``'s dtype first when they differ. ``packed``:
    ``pack(w)``, read instead of ``w`` when no gradient is recorded (the same bits, faster)."""
    if x.dtype != w.dtype:
        x = x.to(w.dtype)
    if b is not None and b.dtype != w.dtype:
        b = b.to(w.dtype)
    if _needs_grad(x, w, b):
        out: torch.Tensor = _Linear.apply(x, w, b)
        return out
    out = _linear_forward(x, w, packed)
    return out if b is None else out + b


SUM_TILE = 4  # rows per product of ``_row_sums``: a padded row tile is two items, never a lone one


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension, as fixed-shape products ``[SUM_TILE, K] x [K, 1]`` of the rows (padded to
    whole row tiles) and a column of ones: the same reduction whatever the number of rows."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    tiles = _row_tiles(rows).view(-1, SUM_TILE, width)
    ones = torch.ones((1, width, 1), dtype=x.dtype, device=x.device).expand(tiles.shape[0], -1, -1)
    sums = torch.bmm(tiles, ones).view(-1)
    return (sums[: rows.shape[0]] if sums.shape[0] != rows.shape[0] else sums).view(x.shape[:-1])


# ----------------------------------------------------------------------------- attention (torch)


def _torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, window: int, lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out [B, Hkv, R, D], lse [B, Hkv, R] or None)`` for query rows ``q`` ``[B, Hkv, R, D]`` (float32), keys and
    values ``[B, Hkv, L, D]``, and each row's position ``positions`` ``[B, R]`` (a key j is seen when
    ``position - window < j <= position``; ``window`` 0: no lower bound)."""
    batch, heads, rows, dim = q.shape
    tiles = max(1, -(-rows // ROW_TILE))
    qt = torch.nn.functional.pad(q, (0, 0, 0, tiles * ROW_TILE - rows)).reshape(-1, ROW_TILE, dim)
    where = torch.nn.functional.pad(positions, (0, tiles * ROW_TILE - rows), value=-1)
    where = where.view(batch, 1, tiles, ROW_TILE, 1)
    chunks = -(-(int(positions.max()) + 1) // KEY_CHUNK) if positions.numel() else 0
    width = chunks * KEY_CHUNK  # keys in whole chunks: zeros past L (finite, and never visible)
    k = k[:, :, :width]
    if k.shape[2] < width:
        k = torch.nn.functional.pad(k, (0, 0, 0, width - k.shape[2]))
    # the values with a column of ones beside them: p @ [V | 1] is the values product and the row sum of p at once
    v = torch.nn.functional.pad(v[:, :, :width], (0, 1, 0, width - min(v.shape[2], width)))
    v[..., dim] = 1.0
    shape = (batch, heads, tiles, ROW_TILE)
    offsets = torch.arange(KEY_CHUNK, device=q.device)

    def products(a: torch.Tensor, b: torch.Tensor, width: int) -> torch.Tensor:
        """``[B, H, T, ROW_TILE, width]``: each row tile of ``a`` ``[B*H*T, ROW_TILE, n]`` times its (b, h)'s
        ``b`` ``[B, H, n, width]``, one fixed-shape item each; with several tiles per (b, h), one product per (b, h)
        whose shared operand is broadcast, not copied per tile."""
        n = b.shape[2]
        if tiles == 1:
            return _bmm(a, b.reshape(batch * heads, n, width)).view(*shape, width)
        per = a.view(batch * heads, tiles, ROW_TILE, n)
        flat = b.reshape(batch * heads, n, width)
        out = a.new_empty((batch * heads, tiles, ROW_TILE, width))
        for i in range(batch * heads):
            out[i] = _bmm(per[i], flat[i].expand(tiles, n, width))
        return out.view(*shape, width)

    m = total = acc = None
    for c in range(chunks):
        start = c * KEY_CHUNK
        kc, vc = k[:, :, start : start + KEY_CHUNK], v[:, :, start : start + KEY_CHUNK]
        scores = products(qt, kc.transpose(2, 3), KEY_CHUNK) * scale
        keys = start + offsets
        visible = keys <= where  # [B, 1, T, ROW_TILE, KEY_CHUNK]
        if window:
            visible = visible & (keys > where - window)
        scores = torch.where(visible, scores, -math.inf)
        top = scores.amax(-1)
        if m is None and not window:  # the first chunk: every query sees its key 0 (padding rows are dropped)
            p = _exact.exp(scores - top.unsqueeze(-1))
            pv = products(p.reshape(-1, ROW_TILE, KEY_CHUNK), vc, dim + 1)
            m, total, acc = top, pv[..., dim], pv[..., :dim]
            continue
        if m is None or total is None or acc is None:  # a window: a row may see nothing of the first chunks
            m, total, acc = q.new_full(shape, -math.inf), q.new_zeros(shape), q.new_zeros((*shape, dim))
        any_visible = visible.any(-1)
        m_new = torch.maximum(m, top)
        # subtractions of finite values only (a row that has seen nothing takes 0s): no NaN is ever made
        finite_new = torch.where(any_visible, m_new, 0.0)
        alpha = _exact.exp(torch.where(any_visible & (m > -math.inf), m - finite_new, -math.inf))
        p = _exact.exp(torch.where(visible, scores - finite_new.unsqueeze(-1), -math.inf))
        pv = products(p.reshape(-1, ROW_TILE, KEY_CHUNK), vc, dim + 1)
        total = torch.where(any_visible, total * alpha + pv[..., dim], total)
        acc = torch.where(any_visible.unsqueeze(-1), acc * alpha.unsqueeze(-1) + pv[..., :dim], acc)
        m = torch.where(any_visible, m_new, m)
    if m is None or total is None or acc is None:
        return q.new_zeros(q.shape), (q.new_full(q.shape[:-1], -math.inf) if lse else None)
    out = (acc / total.unsqueeze(-1)).reshape(batch, heads, tiles * ROW_TILE, dim)[:, :, :rows]
    if not lse:
        return out, None
    return out, (m + _exact.log(total)).reshape(batch, heads, tiles * ROW_TILE)[:, :, :rows]


def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, window: int, lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if backend_for(q.device) == "triton":
        out, found = _triton().attention(q, k, v, positions, scale, window)
        return out, found if lse else None
    return _torch_attention(q, k, v, positions, scale, window, lse)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float, window: int
    ) -> torch.Tensor:
        out, lse = _attention_forward(q, k, v, positions, scale, window, True)
        ctx.save_for_backward(q, k, v, positions, out, lse)
        ctx.scale, ctx.window = scale, window
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, positions, out, lse = ctx.saved_tensors
        keys = torch.arange(k.shape[2], device=q.device)[None, None, None, :]
        visible = keys <= positions[:, None, :, None]
        if ctx.window:
            visible = visible & (keys > positions[:, None, :, None] - ctx.window)
        scores = (q @ k.transpose(2, 3)) * ctx.scale
        p = torch.where(visible, torch.exp(scores - lse.unsqueeze(-1)), 0.0)
        grad_v = p.transpose(2, 3) @ grad
        grad_p = grad @ v.transpose(2, 3)
        delta = (grad * out).sum(-1, keepdim=True)
        grad_s = p * (grad_p - delta) * ctx.scale
        return grad_s @ k, grad_s.transpose(2, 3) @ q, grad_v, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention by the chunked structure of the module docstring.

    ``q`` ``[B, Hq, Tq, D]``; ``k``, ``v`` ``[B, Hkv, L, D]`` with key j of row b at index j (a cache laid out by
    position; ``Hq`` a multiple of ``Hkv``); ``positions`` ``[B, Tq]``: each query's position, which sees keys
    ``0..position`` (the last ``window`` of them with a sliding window). Returns ``[B, Hq, Tq, D]`` in ``q``'s
    dtype, computed in float32. Keys past every query's position are never read, but must be finite (zeros where
    nothing was written)."""
    batch, q_heads, length, dim = q.shape
    kv_heads = k.shape[1]
    group = q_heads // kv_heads
    dtype = q.dtype
    rows = q.float().reshape(batch, kv_heads, group * length, dim)  # row g * Tq + t: head g of the group, query t
    row_positions = positions.unsqueeze(1).expand(batch, group, length).reshape(batch, group * length)
    keys, values = k.float(), v.float()
    if _needs_grad(q, k, v):
        out: torch.Tensor = _Attention.apply(rows, keys, values, row_positions, float(scale), int(window or 0))
    else:
        out = _attention_forward(rows, keys, values, row_positions, float(scale), int(window or 0), False)[0]
    return out.reshape(batch, q_heads, length, dim).to(dtype)


# ----------------------------------------------------------------------------- row reductions and elementwise


def _norm_forward(x: torch.Tensor, eps: float, centred: bool) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` when ``centred`` (LayerNorm), else ``x / sqrt(mean(x²) + eps)`` (RMSNorm),
    along the last dimension of float32 ``x``; each sum a fixed-shape product (``_row_sums``)."""
    if backend_for(x.device) == "triton":
        out: torch.Tensor = _triton().layer_norm(x, eps) if centred else _triton().rms_norm(x, eps)
        return out
    width = x.shape[-1]
    if centred:
        x = x - (_row_sums(x) / width).unsqueeze(-1)
    variance = _row_sums(x * x) / width
    return x * (1.0 / torch.sqrt(variance + eps)).unsqueeze(-1)


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, eps: float, centred: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.eps, ctx.centred = eps, centred
        return _norm_forward(x, eps, centred)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (x,) = ctx.saved_tensors
        if ctx.centred:
            x = x - x.mean(-1, keepdim=True)
            grad = grad - grad.mean(-1, keepdim=True)
        inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
        y = x * inv
        return inv * (grad - y * (grad * y).mean(-1, keepdim=True)), None, None


def _norm(x: torch.Tensor, eps: float, centred: bool) -> torch.Tensor:
    if _needs_grad(x):
        out: torch.Tensor = _Norm.apply(x, float(eps), centred)
        return out
    return _norm_forward(x, float(eps), centred)


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x²) + eps)`` of float32 ``x`` along its last dimension (no weight: callers apply it)."""
    return _norm(x, eps, centred=False)


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` of float32 ``x`` along its last dimension (no weight or bias)."""
    return _norm(x, eps, centred=True)


def _log_softmax_forward(x: torch.Tensor) -> torch.Tensor:
    if backend_for(x.device) == "triton":
        out: torch.Tensor = _triton().log_softmax(x)
        return out
    top = x.amax(-1, keepdim=True)
    shifted = x - torch.where(torch.isfinite(top), top, 0.0)
    return shifted - _exact.log(_exact.tree_sum(_exact.exp(shifted))).unsqueeze(-1)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        out = _log_softmax_forward(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (out,) = ctx.saved_tensors
        return grad - torch.exp(out) * grad.sum(-1, keepdim=True)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Log-softmax of float32 ``x`` along its last dimension: ``(x - max) - log(tree_sum(exp(x - max)))`` (the
    sum by ``_exact.tree_sum``: a row is as long as the vocabulary, and the tree needs no matrix library)."""
    if _needs_grad(x):
        out: torch.Tensor = _LogSoftmax.apply(x)
        return out
    return _log_softmax_forward(x)


_TORCH_ELEMENTWISE = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "tanh": torch.tanh,
    "exp": torch.exp,
}


def _elementwise_forward(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.device.type == "cuda":  # one CUDA kernel computes every element alike
        out: torch.Tensor = _TORCH_ELEMENTWISE[name](x)
        return out
    found: torch.Tensor = getattr(_exact, name)(x)
    return found


class _Elementwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, name: str) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.name = name
        return _elementwise_forward(x, name)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            probe = x.detach().requires_grad_(True)
            (derivative,) = torch.autograd.grad(_TORCH_ELEMENTWISE[ctx.name](probe), probe, grad)
        return derivative, None


def _elementwise(x: torch.Tensor, name: str) -> torch.Tensor:
    if _needs_grad(x):
        out: torch.Tensor = _Elementwise.apply(x, name)
        return out
    return _elementwise_forward(x, name)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU of float32 ``x``, per element."""
    return _elementwise(x, "silu")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU (tanh form) of float32 ``x``, per element."""
    return _elementwise(x, "gelu_tanh")


def tanh(x: torch.Tensor) -> torch.Tensor:
    """tanh of float32 ``x``, per element."""
    return _elementwise(x, "tanh")


def exp(x: torch.Tensor) -> torch.Tensor:
    """exp of float32 ``x``, per element."""
    return _elementwise(x, "exp")
