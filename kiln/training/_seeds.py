"""The effective seed: the request's seed, or a fresh random u64, resolved once at admission."""

from __future__ import annotations

import secrets

U64_MAX = 2**64 - 1


def resolve_seed(seed: int | str | None) -> int:
    """Return the effective seed as an int in 0..2^64-1 (decimal strings accepted)."""
    if seed is None:
        return secrets.randbits(64)
    value = int(seed) if isinstance(seed, str) else seed
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MAX:
        raise ValueError(f"seed {seed!r} is not an unsigned 64-bit integer")
    return value
