"""The invariant forward's key/value cache: each decoding row's keys and values laid out by position.

Per layer one tensor ``[slots, kv_heads, capacity, head_dim]`` for the keys and one for the values: row ``slot``'s
key at position j sits at index j, so a decoding step reads every row's keys in place, whatever their lengths, and
the attention's key chunks (aligned at position 0) are the same for a row whether its keys came from one prefill or
one step at a time. Storage is zero-filled and grows by doubling; a slot is zeroed when a row takes it (the
attention multiplies unread positions by 0, so they must hold finite values, never a previous row's NaN).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.kernels import invariant as inv

__all__ = ["KVCache"]


class KVCache:
    """Keys and values of decoding rows by position: per layer ``[slots, kv_heads, capacity, head_dim]``, row
    ``slot``'s key j at index j. Storage grows (by doubling, zero-filled) as rows or positions need it."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.shape = (layers, kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots = 0
        self.capacity = 0

    def reserve(self, slots: int, positions: int) -> None:
        """Room for ``slots`` rows of ``positions`` positions each."""
        if slots <= self.slots and positions <= self.capacity:
            return
        new_slots = max(slots, self.slots, 1)
        new_capacity = max(positions, self.capacity, inv.KEY_CHUNK)
        if slots > self.slots:
            new_slots = max(new_slots, 2 * self.slots)
        if positions > self.capacity:
            new_capacity = max(new_capacity, 2 * self.capacity)
        layers, heads, dim = self.shape
        shape = (new_slots, heads, new_capacity, dim)
        for store in (self.keys, self.values):
            grown = []
            for i in range(layers):
                fresh = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if store:
                    fresh[: self.slots, :, : self.capacity] = store[i]
                grown.append(fresh)
            store[:] = grown
        self.slots, self.capacity = new_slots, new_capacity

    def clear(self, slot: int) -> None:
        """Zero a slot (a row that joins must never read what its slot's last row left)."""
        for store in (self.keys, self.values):
            for tensor in store:
                tensor[slot].zero_()

    def move(self, source: int, target: int) -> None:
        """Copy slot ``source`` over slot ``target`` (rows stay packed in the first slots)."""
        for store in (self.keys, self.values):
            for tensor in store:
                tensor[target].copy_(tensor[source])

    def copy(self, source: int, targets: Sequence[int]) -> None:
        """Copy slot ``source`` into each of ``targets`` (choices that share a prompt)."""
        for store in (self.keys, self.values):
            for tensor in store:
                for target in targets:
                    tensor[target].copy_(tensor[source])
