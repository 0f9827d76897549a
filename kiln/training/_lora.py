"""LoRA modules (peft) with Kiln's own seeded initialisation.

Targets: the linear projections present among ``q_proj k_proj v_proj o_proj gate_proj
up_proj down_proj`` (and ``in_proj_qkv in_proj_z out_proj`` on hybrid-attention models).
Initialisation comes from the ``lora-init`` stream: parameters are visited in sorted name
order; every A is uniform in ``±sqrt(1/in_features)``, every B is zero -- so the same seed
gives the same bytes on any machine of the same build.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

TARGET_CANDIDATES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
)


def target_modules(model: Any) -> list[str]:
    import torch

    present = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    found = [name for name in TARGET_CANDIDATES if name in present]
    if not found:
        raise ValueError("the model has none of the LoRA target projections " + ", ".join(TARGET_CANDIDATES))
    return found


def attach_lora(model: Any, *, rank: int, alpha: float, seed: int) -> Any:
    """Wrap ``model`` with LoRA adapters on every target projection and initialise them."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules(model),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=True,
    )
    with warnings.catch_warnings():
        # peft 0.21 asks transformers 5 for a renamed attribute; the deprecation is theirs, not ours
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in lora_parameters(peft_model).items():
            if ".lora_A." in name:
                bound = math.sqrt(1.0 / param.shape[1])
                param.copy_(torch.rand(param.shape, generator=generator, dtype=torch.float32) * (2 * bound) - bound)
            else:
                param.zero_()
    return peft_model


def lora_parameters(peft_model: Any) -> dict[str, Any]:
    """The trainable LoRA tensors by stable parameter name, sorted."""
    return {
        name: param
        for name, param in sorted(peft_model.named_parameters())
        if (".lora_A." in name or ".lora_B." in name) and param.requires_grad
    }


def module_of(name: str) -> str:
    """The target projection a LoRA parameter belongs to (``q_proj``, ``down_proj``, ...)."""
    return name.split(".lora_")[0].rsplit(".", 1)[-1]


def lora_delta_norms(peft_model: Any) -> list[dict[str, Any]]:
    """Per target module: L2 norms of A and B and the bound ``|A|·|B|`` on each pair's update."""
    params = lora_parameters(peft_model)
    pairs: dict[str, dict[str, list[float]]] = {}
    for name, param in params.items():
        if ".lora_A." not in name:
            continue
        b = params[name.replace(".lora_A.", ".lora_B.")]
        a_norm, b_norm = float(param.detach().norm()), float(b.detach().norm())
        entry = pairs.setdefault(module_of(name), {"a": [], "b": [], "d": []})
        entry["a"].append(a_norm)
        entry["b"].append(b_norm)
        entry["d"].append(a_norm * b_norm)
    out = []
    for module in sorted(pairs):
        e = pairs[module]
        n = len(e["a"])
        out.append(
            {
                "module": module,
                "pair_count": n,
                "a_l2_mean": sum(e["a"]) / n,
                "a_l2_max": max(e["a"]),
                "b_l2_mean": sum(e["b"]) / n,
                "b_l2_max": max(e["b"]),
                "delta_l2_upper_bound_mean": sum(e["d"]) / n,
                "delta_l2_upper_bound_max": max(e["d"]),
            }
        )
    return out
