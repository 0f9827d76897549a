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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.documents.jsonio import JsonObject
from kiln.errors import RequestError

if TYPE_CHECKING:
    from kiln_contracts.models.kiln_control_plane_v1_schema import LrScheduler

__all__ = ["KINDS", "Schedule"]

KINDS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class Schedule:
    """The ``lr_scheduler`` of a run: kind, warmup (in steps or as a ratio of the planned steps) and the floor."""

    kind: str  # one of KINDS
    warmup_steps: int | None
    warmup_ratio: float | None
    min_lr_ratio: float

    @classmethod
    def resolve(cls, model: LrScheduler) -> Schedule:
        """The schedule of a config's ``lr_scheduler`` with every member filled in (the schema has checked types
        and ranges); refuses both warmups at once, and a floor under a constant schedule."""
        if model.warmup_steps is not None and model.warmup_ratio is not None:
            raise RequestError(
                "lr_scheduler: give warmup_steps or warmup_ratio, not both",
                code="training_invalid_request",
                pointer="/config/lr_scheduler/warmup_ratio",
            )
        kind = model.kind.value
        if kind == "constant" and model.min_lr_ratio:
            raise RequestError(
                f"lr_scheduler: min_lr_ratio {model.min_lr_ratio:g} applies to the linear and cosine schedules; a "
                "constant schedule never decays",
                code="training_invalid_request",
                pointer="/config/lr_scheduler/min_lr_ratio",
            )
        return cls(
            kind=kind,
            warmup_steps=None if model.warmup_steps is None else model.warmup_steps.root,
            warmup_ratio=None if model.warmup_ratio is None else model.warmup_ratio.root,
            min_lr_ratio=model.min_lr_ratio,
        )

    def to_json(self) -> JsonObject:
        return {
            "kind": self.kind,
            "warmup_steps": self.warmup_steps,
            "warmup_ratio": self.warmup_ratio,
            "min_lr_ratio": self.min_lr_ratio,
        }

    def warmup(self, total: int) -> int:
        """The warmup in optimizer steps of a run of ``total`` planned steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_ratio is not None:
            return math.ceil(self.warmup_ratio * total)
        return 0

    def rate(self, base: float, step: int, total: int) -> float:
        """The learning rate of the optimizer step at position ``step`` (0-based) of ``total``."""
        warmup = self.warmup(total)
        if step < warmup:
            return base * (step / warmup)
        if self.kind == "constant":
            return base
        span = max(1, total - warmup)
        if self.kind == "linear":
            factor = max(0.0, (total - step) / span)
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / span)))
        return base * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * factor)

    def state(self, base: float, total: int) -> JsonObject:
        """The checkpoint manifest's ``scheduler.state``: what the rate of every step follows from."""
        if self.kind == "constant" and self.warmup(total) == 0:
            return {"learning_rate": base}  # what a constant schedule has always recorded
        return {
            "learning_rate": base,
            "warmup_steps": self.warmup(total),
            "total_steps": total,
            "min_lr_ratio": self.min_lr_ratio,
        }
