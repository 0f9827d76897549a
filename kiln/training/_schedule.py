"""Learning-rate schedules: ``constant``, ``linear`` and ``cosine``, each with an optional linear warmup.

The rate of the optimizer step at position ``k`` (0-based; the first step is ``k = 0``) out of ``N`` is the base
rate times a factor that depends on ``k`` alone -- so a resumed run continues the same schedule exactly, with no
scheduler state beyond the step count. The factors are those of the Hugging Face schedules
(``get_constant_schedule_with_warmup``, ``get_linear_schedule_with_warmup``,
``get_cosine_with_min_lr_schedule_with_warmup``), which TRL and most fine-tuning recipes use:

* warmup (``k < W``): ``k / W`` -- the first step of a warmup runs at rate 0, as there;
* ``constant``: 1 after the warmup;
* ``linear``: ``max(0, (N - k) / max(1, N - W))``, lifted to ``min_lr_ratio + (1 - min_lr_ratio) · f``;
* ``cosine``: ``0.5 · (1 + cos(π · (k - W) / max(1, N - W)))``, lifted the same way.

``W`` is ``warmup_steps``, or ``ceil(warmup_ratio · N)``, or 0. The schedule's ``N`` is the run's planned
optimizer steps (SFT: epochs × rows; GRPO: the planned steps; OPD: the candidates, a candidate without action
tokens taking no step but keeping its position).
"""

from __future__ import annotations

import math
from typing import Any

from kiln.errors import RequestError

__all__ = ["KINDS", "effective_schedule", "schedule_state", "scheduled_rate", "warmup_steps"]

KINDS = ("constant", "linear", "cosine")
DEFAULT = {"kind": "constant", "warmup_steps": None, "warmup_ratio": None, "min_lr_ratio": 0.0}


def effective_schedule(spec: dict[str, Any] | None) -> dict[str, Any]:
    """The ``lr_scheduler`` object with every member filled in (the schema has checked types and ranges)."""
    merged = {**DEFAULT, **(spec or {})}
    if merged["warmup_steps"] is not None and merged["warmup_ratio"] is not None:
        raise RequestError(
            "lr_scheduler: give warmup_steps or warmup_ratio, not both",
            code="training_invalid_request",
            pointer="/config/lr_scheduler/warmup_ratio",
        )
    if merged["kind"] == "constant" and merged["min_lr_ratio"]:
        raise RequestError(
            f"lr_scheduler: min_lr_ratio {merged['min_lr_ratio']:g} applies to the linear and cosine schedules; a "
            "constant schedule never decays",
            code="training_invalid_request",
            pointer="/config/lr_scheduler/min_lr_ratio",
        )
    return {
        "kind": merged["kind"],
        "warmup_steps": None if merged["warmup_steps"] is None else int(merged["warmup_steps"]),
        "warmup_ratio": None if merged["warmup_ratio"] is None else float(merged["warmup_ratio"]),
        "min_lr_ratio": float(merged["min_lr_ratio"]),
    }


def warmup_steps(schedule: dict[str, Any], total: int) -> int:
    if schedule["warmup_steps"] is not None:
        return schedule["warmup_steps"]
    if schedule["warmup_ratio"] is not None:
        return math.ceil(schedule["warmup_ratio"] * total)
    return 0


def scheduled_rate(schedule: dict[str, Any], base: float, step: int, total: int) -> float:
    """The learning rate of the optimizer step at position ``step`` (0-based) of ``total``."""
    warmup = warmup_steps(schedule, total)
    if step < warmup:
        return base * (step / warmup)
    kind, floor = schedule["kind"], schedule["min_lr_ratio"]
    if kind == "constant":
        return base
    span = max(1, total - warmup)
    if kind == "linear":
        factor = max(0.0, (total - step) / span)
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / span)))
    return base * (floor + (1.0 - floor) * factor)


def schedule_state(schedule: dict[str, Any], base: float, total: int) -> dict[str, Any]:
    """The checkpoint manifest's ``scheduler.state``: what the rate of every step follows from."""
    if schedule["kind"] == "constant" and warmup_steps(schedule, total) == 0:
        return {"learning_rate": base}  # what a constant schedule has always recorded
    return {
        "learning_rate": base,
        "warmup_steps": warmup_steps(schedule, total),
        "total_steps": total,
        "min_lr_ratio": schedule["min_lr_ratio"],
    }
