"""LoRA modules (peft) with Kiln's own seeded initialisation.

Targets: ``lora_target_modules`` when a request names them (leaf module names inside the
decoder layers, checked against the model), else every linear projection of the decoder
layers -- attention and MLP, ``nn.Linear`` or GPT-2's Conv1D (``c_attn c_proj c_fc``) --
except expert routers; the output head and the embeddings are never adapted (the SFT
loss routes read the head's weight directly). Initialisation comes from the ``lora-init`` stream: parameters are visited in sorted name
order; every A is uniform in ``±sqrt(1/in_features)``, every B is zero -- so the same seed
gives the same bytes on any machine of the same build.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from kiln.errors import RequestError

# The usual order of the projections, used to order a model's default targets; others follow in first-seen order.
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
# Linear layers inside the decoder layers that route tokens between experts; adapting them is not a projection
ROUTERS = frozenset({"gate", "router"})
MAX_LISTED = 24


def layer_projections(model: Any) -> list[str]:
    """Leaf names of the linear projections inside the model's decoder layers (``nn.Linear`` and the Conv1D of
    GPT-2-style models), never the output head or the embeddings: known projection names first in their usual
    order, the others in the order the model declares them."""
    import torch
    from transformers.pytorch_utils import Conv1D

    seen: dict[str, None] = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if isinstance(module, torch.nn.Linear | Conv1D) and any(part.isdigit() for part in parts[:-1]):
            seen.setdefault(parts[-1], None)
    known = [name for name in TARGET_CANDIDATES if name in seen]
    return known + [name for name in seen if name not in known]


def target_modules(model: Any, requested: list[str] | None = None) -> list[str]:
    """The LoRA targets of ``model``: ``requested`` (leaf module names, checked) or, when None, every projection
    of its decoder layers except expert routers. A name that matches no projection inside the decoder layers is
    refused naming the ones the model has."""
    found = layer_projections(model)
    listed = ", ".join(found[:MAX_LISTED]) + (f" and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else "")
    if requested is None:
        chosen = [name for name in found if name not in ROUTERS]
        if not chosen:
            raise RequestError(
                f"{type(model).__name__} has no linear projections inside its decoder layers to adapt"
                + (f" (only expert routers: {listed})" if found else ""),
                code="training_backend_unsupported",
            )
        return chosen
    missing = [name for name in requested if name not in found]
    if missing:
        raise RequestError(
            f"lora_target_modules: {', '.join(repr(m) for m in missing)} "
            f"{'matches' if len(missing) == 1 else 'match'} no linear projection inside the decoder layers of "
            f"{type(model).__name__}; it has {listed or 'none'}",
            code="training_invalid_request",
            pointer="/config/lora_target_modules",
            hint="name leaf modules of the decoder layers (the output head and embeddings are never adapted), "
            "or omit lora_target_modules for all of them",
        )
    return list(requested)


def attach_lora(model: Any, *, rank: int, alpha: float, seed: int, targets: list[str] | None = None) -> Any:
    """Wrap ``model`` with LoRA adapters on ``targets`` (default: ``target_modules(model)``) and initialise them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    targets = target_modules(model) if targets is None else list(targets)
    chosen = set(targets)
    # GPT-2's Conv1D stores its weight transposed: peft adapts it with fan_in_fan_out (and corrects the flag
    # per module, with a warning, when a model mixes the two kinds)
    conv = any(isinstance(m, Conv1D) and name.rsplit(".", 1)[-1] in chosen for name, m in model.named_modules())
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
        init_lora_weights=True,
        fan_in_fan_out=conv,
    )
    with warnings.catch_warnings():
        # peft 0.21 asks transformers 5 for a renamed attribute; the deprecation is theirs, not ours
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        warnings.filterwarnings("ignore", message="fan_in_fan_out is set to", category=UserWarning)
        peft_model = get_peft_model(model, config)
    # peft keeps the names as a set and writes list(set) into adapter_config.json, whose order follows the
    # process's string hashing; the injected modules are fixed now, so keep the targets in their given order
    peft_model.peft_config["default"].target_modules = targets
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


def lora_grad_norms(params: dict[str, Any]) -> dict[str, float]:
    """L2 norm of the LoRA gradients of each target module (after a step's backward, before its optimizer step)."""
    import torch

    named = [(name, param.grad) for name, param in params.items() if param.grad is not None]
    if not named:
        return {}
    # one host transfer per step for every parameter's squared norm
    values = torch.stack([grad.detach().pow(2).sum() for _, grad in named]).tolist()
    squares: dict[str, float] = {}
    for (name, _), value in zip(named, values, strict=True):
        module = module_of(name)
        squares[module] = squares.get(module, 0.0) + value
    return {module: sq**0.5 for module, sq in squares.items()}
