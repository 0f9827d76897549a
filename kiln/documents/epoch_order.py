"""The portable epoch order ``kiln.epoch-order.splitmix64-fisher-yates.v1`` (spec/40).

The order in which an epoch visits its items depends only on ``(seed, epoch, n)``, so any
implementation in any language reproduces it bit for bit:

* a SplitMix64 stream seeded with ``(seed XOR (epoch × 0x9E3779B97F4A7C15)) mod 2^64``;
* Fisher–Yates over ``[0, 1, ..., n-1]`` from ``i = n-1`` down to ``1``, swapping item ``i``
  with item ``j``, where ``j`` is uniform in ``[0, i]``: draw 64-bit outputs ``x`` until
  ``x < limit = 2^64 - (2^64 mod (i+1))`` (rejection sampling, no modulo bias), then
  ``j = x mod (i+1)``.

Pure Python integers (no torch, no numpy). Golden permutations:
``tests/golden/epoch_order.json``. A checkpoint records this identifier as the
``algorithm`` of its ``epoch-order`` random stream; its ``data_order`` is
``epoch_order(seed, position, item_count)``.
"""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["ALGORITHM_ID", "epoch_order", "epoch_stream_seed", "splitmix64"]

ALGORITHM_ID = "kiln.epoch-order.splitmix64-fisher-yates.v1"

GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_TWO_64 = 1 << 64


def _check_u64(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MASK:
        raise ValueError(f"{name} must be an integer in 0..2^64-1, got {value!r}")


def splitmix64(state: int) -> Iterator[int]:
    """The SplitMix64 outputs (each a 64-bit unsigned integer) of a generator seeded with ``state``."""
    _check_u64("state", state)
    while True:
        state = (state + GOLDEN_GAMMA) & _MASK
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        yield z ^ (z >> 31)


def epoch_stream_seed(seed: int, epoch: int) -> int:
    """``(seed XOR (epoch × 0x9E3779B97F4A7C15)) mod 2^64``: the SplitMix64 seed of one epoch."""
    _check_u64("seed", seed)
    _check_u64("epoch", epoch)
    return (seed ^ (epoch * GOLDEN_GAMMA)) & _MASK


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The visiting order of epoch ``epoch`` over ``n`` items: a permutation of ``0..n-1``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    stream = splitmix64(epoch_stream_seed(seed, epoch))
    order = list(range(n))
    for i in range(n - 1, 0, -1):
        j = _uniform_below(stream, i + 1)
        order[i], order[j] = order[j], order[i]
    return order


def _uniform_below(stream: Iterator[int], bound: int) -> int:
    """Uniform in ``[0, bound)``: reject 64-bit outputs ``>= 2^64 - (2^64 mod bound)``, then reduce."""
    limit = _TWO_64 - (_TWO_64 % bound)
    x = next(stream)
    while x >= limit:
        x = next(stream)
    return x % bound
