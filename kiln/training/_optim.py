"""Optimizers of the native profile: ``muon``, ``adam_w``, ``sgd``.

The learning rate of each step comes from the run's schedule (``kiln.training._schedule``; ``Policy``
sets it before every step); no accumulation, no clipping. AdamW and SGD run their
single-tensor (non-foreach, non-fused) implementations so numerics do not change between
runs. Muon is ``torch.optim.Muon`` (Newton-Schulz orthogonalised momentum) on the 2-D LoRA
matrices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiln.training._defaults import schema_defaults

__all__ = ["build_optimizer", "effective_optimizer"]


def effective_optimizer(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The optimizer object with every default of its kind filled in (what the effective config records).

    ``spec`` is the config's ``optimizer`` with its own default applied (``{"kind": "muon"}``
    when the request left it out); each kind's settings and their defaults are the schema's
    ``SgdOptimizer``, ``AdamWOptimizer`` and ``MuonOptimizer``.
    """
    kind = spec.get("kind")
    try:
        defaults = schema_defaults("Optimizer", variant=kind) if isinstance(kind, str) else None
    except KeyError:
        defaults = None
    if defaults is None:
        raise ValueError(f"unknown optimizer kind {kind!r}; choose muon, adam_w or sgd")
    unknown = set(spec) - {"kind"} - set(defaults)
    if unknown:
        raise ValueError(f"optimizer {kind} does not take {sorted(unknown)}")
    given = {k: v for k, v in spec.items() if k != "kind"}
    # one canonical number type per member, so ``0`` and ``0.0`` give the same effective config
    # (JSON writers such as JavaScript's drop the ``.0``); the schema has already checked ranges
    typed = {k: type(defaults[k])(v) if not isinstance(v, bool) else v for k, v in given.items()}
    return {"kind": kind, **defaults, **typed}


def build_optimizer(optimizer: dict[str, Any], params: list[Any], learning_rate: float) -> Any:
    import torch

    kind = optimizer["kind"]
    if kind == "muon":
        return torch.optim.Muon(
            params,
            lr=learning_rate,
            weight_decay=optimizer["weight_decay"],
            momentum=optimizer["momentum"],
            nesterov=optimizer["nesterov"],
            ns_steps=optimizer["ns_iters"],
        )
    if kind == "adam_w":
        return torch.optim.AdamW(
            params,
            lr=learning_rate,
            betas=(optimizer["beta1"], optimizer["beta2"]),
            eps=optimizer["eps"],
            weight_decay=optimizer["weight_decay"],
            foreach=False,
            fused=False,
        )
    return torch.optim.SGD(params, lr=learning_rate, momentum=0.0, foreach=False)
