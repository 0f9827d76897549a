"""The SFT batch plan: which rows of an epoch make up each optimizer step, and how a step splits into micro-batches.

An optimizer step consumes ``rows_per_step = micro_batch_size x gradient_accumulation_steps x world_size``
consecutive rows of the epoch's order (``world_size``: the data-parallel ranks, 1 for a single process); the last step of an epoch takes what is left (fewer rows when the row count is not a multiple),
and no step spans two epochs, so an epoch has ``ceil(items / rows_per_step)`` steps. A step's rows are cut, in
order, into micro-batches of ``micro_batch_size`` rows (one forward and backward each); the step's loss is the mean
over every supervised token of the step, whatever the cut.

The epoch's order is the portable seeded order (``kiln.documents.epoch_order``); with ``group_by_length`` it is rearranged
inside windows of ``GROUP_WINDOW_STEPS x rows_per_step`` consecutive positions, longest row first (ties keep their
seeded order), so a micro-batch pads little while every window still holds the rows the seeded order put there.
A checkpoint's ``data_order`` is this order, and a reader can check it without the row lengths: each window is a
permutation of the same window of the seeded order.

Pure Python; the checkpoint rules and the trainer read the same functions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "GROUP_WINDOW_STEPS",
    "group_window",
    "grouped_order",
    "rows_per_step",
    "steps_per_epoch",
]

GROUP_WINDOW_STEPS = 50  # optimizer steps per length-grouping window (the Hugging Face sampler's megabatch factor)


def rows_per_step(config: Mapping[str, Any], world_size: int = 1) -> int:
    """Rows per optimizer step of an effective SFT config (members absent: 1, as before batching existed) trained by
    ``world_size`` data-parallel ranks (``kiln.training.DataParallel``): each rank takes its share of the step's
    micro-batches, so a step is ``world_size`` times as many rows."""
    return int(config.get("micro_batch_size", 1)) * int(config.get("gradient_accumulation_steps", 1)) * world_size


def steps_per_epoch(items: int, rows: int) -> int:
    """Optimizer steps of one epoch of ``items`` rows at ``rows`` rows per step (the last one may be short)."""
    return -(-items // rows)


def group_window(rows: int) -> int:
    """Positions per length-grouping window."""
    return GROUP_WINDOW_STEPS * rows


def grouped_order(order: Sequence[int], lengths: Sequence[int], rows: int) -> list[int]:
    """``order`` rearranged window by window, longest row first (a stable sort, so ties keep their order)."""
    window = group_window(rows)
    grouped: list[int] = []
    for start in range(0, len(order), window):
        grouped.extend(sorted(order[start : start + window], key=lambda index: -lengths[index]))
    return grouped
