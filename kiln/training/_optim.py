"""Optimizers of the native profile: ``muon``, ``adam_w``, ``sgd``.

The learning rate of each step comes from the run's schedule (``kiln.training.Schedule``; ``Policy`` sets it
before every step); no accumulation, no clipping. AdamW and SGD run their single-tensor (non-foreach, non-fused)
implementations so numerics do not change between runs. Muon is ``torch.optim.Muon`` (Newton-Schulz orthogonalised
momentum) on the 2-D LoRA matrices. Each kind's settings and their defaults are the schema's ``MuonOptimizer``,
``AdamWOptimizer`` and ``SgdOptimizer``, which the generated models carry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from kiln_contracts.models.kiln_control_plane_v1_schema import AdamWOptimizer, MuonOptimizer, SgdOptimizer

from kiln.documents.jsonio import JsonObject

if TYPE_CHECKING:
    import torch

__all__ = ["AdamW", "Muon", "Optimizer", "Sgd", "resolve_optimizer"]


@dataclass(frozen=True)
class Muon:
    """``torch.optim.Muon`` (Newton-Schulz orthogonalised momentum) on the 2-D LoRA matrices."""

    kind: ClassVar[Literal["muon"]] = "muon"
    stateful: ClassVar[bool] = True
    momentum: float
    nesterov: bool
    ns_iters: int
    weight_decay: float

    def to_json(self) -> JsonObject:
        return {
            "kind": self.kind,
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "ns_iters": self.ns_iters,
            "weight_decay": self.weight_decay,
        }

    def build(self, params: list[Any], learning_rate: float) -> torch.optim.Optimizer:
        import torch

        return torch.optim.Muon(
            params,
            lr=learning_rate,
            weight_decay=self.weight_decay,
            momentum=self.momentum,
            nesterov=self.nesterov,
            ns_steps=self.ns_iters,
        )


@dataclass(frozen=True)
class AdamW:
    """``torch.optim.AdamW``, single-tensor (neither foreach nor fused), so numerics never depend on the batch."""

    kind: ClassVar[Literal["adam_w"]] = "adam_w"
    stateful: ClassVar[bool] = True
    beta1: float
    beta2: float
    eps: float
    weight_decay: float

    def to_json(self) -> JsonObject:
        return {
            "kind": self.kind,
            "beta1": self.beta1,
            "beta2": self.beta2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }

    def build(self, params: list[Any], learning_rate: float) -> torch.optim.Optimizer:
        import torch

        return torch.optim.AdamW(
            params,
            lr=learning_rate,
            betas=(self.beta1, self.beta2),
            eps=self.eps,
            weight_decay=self.weight_decay,
            foreach=False,
            fused=False,
        )


@dataclass(frozen=True)
class Sgd:
    """Plain SGD without momentum: no state to checkpoint."""

    kind: ClassVar[Literal["sgd"]] = "sgd"
    stateful: ClassVar[bool] = False

    def to_json(self) -> JsonObject:
        return {"kind": self.kind}

    def build(self, params: list[Any], learning_rate: float) -> torch.optim.Optimizer:
        import torch

        return torch.optim.SGD(params, lr=learning_rate, momentum=0.0, foreach=False)


Optimizer = Muon | AdamW | Sgd


def resolve_optimizer(model: MuonOptimizer | AdamWOptimizer | SgdOptimizer) -> Optimizer:
    """The optimizer of a config's ``optimizer``, every member of its kind filled in (the schema's defaults)."""
    if isinstance(model, MuonOptimizer):
        return Muon(
            momentum=model.momentum, nesterov=model.nesterov, ns_iters=model.ns_iters, weight_decay=model.weight_decay
        )
    if isinstance(model, AdamWOptimizer):
        return AdamW(beta1=model.beta1, beta2=model.beta2, eps=model.eps, weight_decay=model.weight_decay)
    return Sgd()
