"""Optimizers of the native profile: ``muon`` (default), ``adam_w``, ``sgd``.

Constant learning rate, no warmup, no accumulation, no clipping. AdamW and SGD run their
single-tensor (non-foreach, non-fused) implementations so numerics do not change between
runs. Muon is ``torch.optim.Muon`` (Newton-Schulz orthogonalised momentum) on the 2-D LoRA
matrices.
"""

from __future__ import annotations

from typing import Any

DEFAULT_LEARNING_RATES = {
    "sft": {"muon": 1e-3, "adam_w": 1e-4, "sgd": 1e-4},
    "grpo": {"muon": 2e-3, "adam_w": 1e-5, "sgd": 1e-5},
    "opd": {"muon": 2e-3, "adam_w": 1e-5, "sgd": 1e-5},
}
_DEFAULTS = {
    "muon": {"momentum": 0.95, "nesterov": True, "ns_iters": 5, "weight_decay": 0.0},
    "adam_w": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0},
    "sgd": {},
}


def effective_optimizer(spec: dict[str, Any] | None) -> dict[str, Any]:
    """The optimizer object with every default filled in (what the effective config records)."""
    spec = dict(spec or {"kind": "muon"})
    kind = spec.get("kind", "muon")
    if kind not in _DEFAULTS:
        raise ValueError(f"unknown optimizer kind {kind!r}; choose muon, adam_w or sgd")
    unknown = set(spec) - {"kind"} - set(_DEFAULTS[kind])
    if unknown:
        raise ValueError(f"optimizer {kind} does not take {sorted(unknown)}")
    given = {k: v for k, v in spec.items() if k != "kind"}
    # one canonical number type per member, so ``0`` and ``0.0`` give the same effective config
    # (JSON writers such as JavaScript's drop the ``.0``); the schema has already checked ranges
    typed = {k: type(_DEFAULTS[kind][k])(v) if not isinstance(v, bool) else v for k, v in given.items()}
    return {"kind": kind, **_DEFAULTS[kind], **typed}


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
