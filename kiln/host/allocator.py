"""How the C heap hands memory back: a fixed mmap threshold, so a training process's peak stays where its tensors are.

glibc's malloc serves a large request with its own ``mmap`` (returned to the system when freed) and a small one from
the heap, which a process keeps. The boundary, ``M_MMAP_THRESHOLD``, starts at 128 KiB but moves: each time a
mapped block is freed, the threshold rises to its size, up to 32 MiB. A training step frees gigabytes of activation
blocks, so from the second step on, blocks of up to 32 MiB come from the heap instead. The freed heap stays in the
process and fragments, and the second step's peak grows by the size of the first step's activations. On a
Qwen2.5-0.5B-shaped model at 500-token rows the peak RSS went from 4.9 GB after step 1 to 7.1 GB in step 2
(bench/README.md, "Real size").

``fix_mmap_threshold()`` sets the threshold explicitly, which also stops glibc from moving it. Activation-sized
blocks then always come from ``mmap`` and go back to the system when freed, and the peak stays at step 1's. It does
nothing where the C library has no ``mallopt`` (musl, macOS). It changes no number a run computes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

__all__ = ["MMAP_THRESHOLD_BYTES", "fix_mmap_threshold"]

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, kept fixed
_done: list[bool] = []


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at 128 KiB for this process (idempotent); False where there is no ``mallopt``."""
    if _done:
        return _done[0]
    applied = False
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = getattr(libc, "mallopt", None)
            if mallopt is not None:
                applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
        except OSError:
            applied = False
    _done.append(applied)
    return applied
