"""Elementwise functions and reductions built only from IEEE-754 basic operations, so their bits are fixed by Kiln.

Every value here is computed by separate torch operations that IEEE-754 rounds correctly -- add, subtract,
multiply, divide, square root, round to integer -- or that are exact -- comparisons, selects, integer arithmetic,
bit reinterpretation. Such an operation gives the same bits in a vector lane or a scalar tail, on one row or a
thousand, on the CPU or on a GPU: nothing depends on how a backend's kernel handles the tensor around an element
(torch's own ``exp`` or ``tanh`` does: on x86 its vector and scalar paths round differently, and which path an
element takes depends on where it falls in the tensor). No fused multiply-add is used: each ``a * b + c`` is a
multiply, then an add, two roundings.

* ``exp``, ``log``, ``tanh``, ``sigmoid``, ``silu``, ``gelu_tanh``: float32 in, float32 out, with Cephes'
  single-precision polynomials (about 1 ulp); ``exp(-inf) = 0`` and ``exp(0) = 1`` exactly, and ``exp`` is 0
  below ``EXP_FLUSH`` (results too small to matter beside 1, never subnormal).
* ``tree_sum(x)``: the sum over the last dimension as a pairwise tree whose shape depends only on that
  dimension's length -- padded with zeros to a power of two (blocks of ``SUM_BLOCK`` first for long rows), then
  halved: element i is added to element i + n/2 until one is left. Zeros appended at the end never change the
  result (a level adds them to the first half unchanged), which is what lets a row's partial sums agree
  however far the row was padded.
* ``prefix_sum(x)``: an inclusive scan over the last dimension in ``ceil(log2 n)`` shifted adds (Hillis-Steele).
* ``rope_table(inv_freq, positions, scale)``: ``cos`` and ``sin`` of ``position * inv_freq`` (the product
  rounded to float32, as the models compute it), evaluated in float64 with a Cody-Waite reduction by pi/2 and
  Cephes' double-precision polynomials, then rounded to float32 once.

All functions take tensors on any device and keep them there.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "EXP_CEILING",
    "EXP_FLUSH",
    "SUM_BLOCK",
    "exp",
    "gelu_tanh",
    "log",
    "prefix_sum",
    "rope_table",
    "sigmoid",
    "silu",
    "tanh",
    "tree_sum",
]

SUM_BLOCK = 1024  # rows longer than this are summed in blocks of this many (then the blocks' sums)

_LOG2E = 1.44269504088896341
_LN2_HI = 0.693359375  # 9 significant bits: n * _LN2_HI is exact for |n| < 2**15
_LN2_LO = -2.12194440e-4
EXP_CEILING = 88.72  # exp is held at its value here above (float32 overflows just past it)
EXP_FLUSH = -86.5  # exp is 0 below (about 2.6e-38: the rest of float32's range is subnormal or nearly)
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)
_LOG_POLY = (
    7.0376836292e-2,
    -1.1514610310e-1,
    1.1676998740e-1,
    -1.2420140846e-1,
    1.4249322787e-1,
    -1.6668057665e-1,
    2.0000714765e-1,
    -2.4999993993e-1,
    3.3333331174e-1,
)
_SQRT_HALF = 0.707106781186547524
_TANH_POLY = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1)
_TANH_SMALL = 0.625
_GELU_C = math.sqrt(2.0 / math.pi)


def _horner(x: torch.Tensor, coefficients: tuple[float, ...]) -> torch.Tensor:
    """``((c0·x + c1)·x + c2)...``: one multiply and one add per coefficient after the first."""
    p = x * coefficients[0]
    for c in coefficients[1:-1]:
        p = (p + c) * x
    return p + coefficients[-1]


def exp(x: torch.Tensor) -> torch.Tensor:
    """``e**x`` of a float32 tensor (Cephes ``expf``): ``x = n·ln2 + r`` with ``|r| <= ln2/2``, a degree-7
    polynomial of ``r``, then the exact power of two ``2**n``. Kiln's definition at the ends of the range: below
    ``EXP_FLUSH`` (results under about 2.6e-38, subnormal or nearly) it is 0 -- so ``exp(-inf) = 0`` --, above
    ``EXP_CEILING`` it is ``exp(EXP_CEILING)`` (finite); ``exp(0) = 1`` exactly; NaN stays NaN."""
    if x.dtype != torch.float32:
        raise TypeError(f"kiln.kernels exact exp takes float32, got {x.dtype}")
    clamped = x.clamp(EXP_FLUSH, EXP_CEILING)
    n = torch.round(clamped * _LOG2E)  # in [-125, 128]
    r = clamped - n * _LN2_HI
    r = r - n * _LN2_LO
    z = r * r
    y = r * _EXP_POLY[0]
    for c in _EXP_POLY[1:-1]:
        y.add_(c).mul_(r)
    y.add_(_EXP_POLY[-1]).mul_(z).add_(r).add_(1.0)
    y = y + y  # times 2**(n - 1), a normal power of two for every n here
    y.mul_(((n.to(torch.int32) + 126) << 23).view(torch.float32))
    return torch.where(x < EXP_FLUSH, 0.0, y)


def log(x: torch.Tensor) -> torch.Tensor:
    """Natural logarithm of a float32 tensor of positive normal numbers (Cephes ``logf``): ``x = m·2**e`` from the
    bits, ``m`` in [sqrt(1/2), sqrt(2)), a degree-9 polynomial of ``m - 1``. 0 gives ``-inf``, ``+inf`` gives
    ``+inf``; negative numbers, NaN and subnormals give NaN."""
    if x.dtype != torch.float32:
        raise TypeError(f"kiln.kernels exact log takes float32, got {x.dtype}")
    bits = x.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 126
    m = ((bits & 0x007FFFFF) | 0x3F000000).view(torch.float32)  # in [0.5, 1)
    low = m < _SQRT_HALF
    e = (e - low.to(torch.int32)).to(torch.float32)
    m = torch.where(low, m + m, m) - 1.0
    z = m * m
    y = _horner(m, _LOG_POLY) * m * z
    y = y + e * _LN2_LO
    y = y - z * 0.5
    y = (m + y) + e * _LN2_HI
    normal = (x >= torch.finfo(torch.float32).tiny) & (x < math.inf)
    y = torch.where(normal, y, torch.full_like(y, math.nan))
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    return torch.where(x == math.inf, torch.full_like(y, math.inf), y)


def tanh(x: torch.Tensor) -> torch.Tensor:
    """Hyperbolic tangent of a float32 tensor (Cephes ``tanhf``): an odd polynomial below 0.625 in magnitude,
    ``1 - 2 / (e**(2|x|) + 1)`` with the sign of ``x`` above."""
    if x.dtype != torch.float32:
        raise TypeError(f"kiln.kernels exact tanh takes float32, got {x.dtype}")
    a = x.abs()
    large = 1.0 - 2.0 / (exp(a + a) + 1.0)
    large = torch.where(x < 0, -large, large)
    z = x * x
    small = _horner(z, _TANH_POLY) * z * x + x
    return torch.where(a < _TANH_SMALL, small, large)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + e**-x)`` of a float32 tensor."""
    return 1.0 / (exp(-x) + 1.0)


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x · sigmoid(x)`` of a float32 tensor, computed as ``x / (1 + e**-x)``."""
    return x / (exp(-x) + 1.0)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh form (GPT-2's ``gelu_new``, ``gelu_pytorch_tanh``) of a float32 tensor:
    ``0.5·x·(1 + tanh(sqrt(2/pi)·(x + 0.044715·x³)))``, the cube as two products."""
    inner = (x + x * x * x * 0.044715) * _GELU_C
    return x * 0.5 * (tanh(inner) + 1.0)


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _halve(x: torch.Tensor) -> torch.Tensor:
    """The pairwise tree over a last dimension whose length is a power of two: element i plus element i + n/2."""
    width = x.shape[-1]
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension by Kiln's fixed tree (this module's docstring); the result drops that
    dimension. An empty dimension sums to 0."""
    n = x.shape[-1]
    if n <= SUM_BLOCK:
        width = _next_power_of_two(n)
        if width != n:
            x = torch.nn.functional.pad(x, (0, width - n))
        return _halve(x)
    blocks = -(-n // SUM_BLOCK)
    if blocks * SUM_BLOCK != n:
        x = torch.nn.functional.pad(x, (0, blocks * SUM_BLOCK - n))
    partial = _halve(x.reshape(*x.shape[:-1], blocks, SUM_BLOCK))
    return tree_sum(partial)


def prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """The inclusive scan over the last dimension: after the step with shift s each element holds the sum of the
    2s elements ending at it (the first ones: of all before them)."""
    n = x.shape[-1]
    shift = 1
    while shift < n:
        x = torch.cat([x[..., :shift], x[..., shift:] + x[..., :-shift]], dim=-1)
        shift *= 2
    return x


# pi/2 in two pieces (fdlibm's pio2_1, 33 bits, so k * _PIO2_1 is exact for k < 2**20, and its tail), and Cephes'
# double-precision sin/cos polynomials on [-pi/4, pi/4].
_PIO2_1 = 1.57079632673412561417e0
_PIO2_1T = 6.07710050650619224932e-11
_TWO_OVER_PI = 0.63661977236758134308
_SIN_POLY = (
    1.58962301576546568060e-10,
    -2.50507477628578072866e-8,
    2.75573136213857245213e-6,
    -1.98412698295895385996e-4,
    8.33333333332211858878e-3,
    -1.66666666666666307295e-1,
)
_COS_POLY = (
    -1.13585365213876817300e-11,
    2.08757008419747316778e-9,
    -2.75573141792967388112e-7,
    2.48015872888517045348e-5,
    -1.38888888888730564116e-3,
    4.16666666666665929218e-2,
)
MAX_ROPE_ARGUMENT = 2.0**20  # the reduction by pi/2 stays exact below this


def _sin_cos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sin x, cos x)`` of float64 ``x`` with ``|x| < MAX_ROPE_ARGUMENT``: ``x = k·pi/2 + r`` (Cody-Waite, the
    first product exact), polynomials of ``r``, and the quadrant ``k mod 4`` choosing and signing them."""
    k = torch.round(x * _TWO_OVER_PI)
    r = x - k * _PIO2_1
    r = r - k * _PIO2_1T
    z = r * r
    sin_r = r + r * z * _horner(z, _SIN_POLY)
    cos_r = 1.0 - z * 0.5 + z * z * _horner(z, _COS_POLY)
    quadrant = torch.remainder(k, 4.0)
    swap = (quadrant == 1) | (quadrant == 3)
    sin_x = torch.where(swap, cos_r, sin_r)
    cos_x = torch.where(swap, sin_r, cos_r)
    sin_x = torch.where(quadrant >= 2, -sin_x, sin_x)
    cos_x = torch.where((quadrant == 1) | (quadrant == 2), -cos_x, cos_x)
    return sin_x, cos_x


def rope_table(inv_freq: torch.Tensor, positions: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[positions, 2·len(inv_freq)]`` float32: row p is ``f(p · inv_freq)`` twice over (the
    rotate-half layout), times ``scale``; ``p · inv_freq`` is rounded to float32 first, as the models round it."""
    if positions * float(inv_freq.abs().max()) >= MAX_ROPE_ARGUMENT:
        raise ValueError(f"rotary arguments up to {positions} x {float(inv_freq.abs().max()):g} are out of range")
    freqs = torch.arange(positions, dtype=torch.float32, device=inv_freq.device)[:, None] * inv_freq.float()[None]
    sin64, cos64 = _sin_cos64(freqs.double())
    if scale != 1.0:
        sin64, cos64 = sin64 * scale, cos64 * scale
    cos32, sin32 = cos64.float(), sin64.float()
    return torch.cat([cos32, cos32], dim=-1), torch.cat([sin32, sin32], dim=-1)
