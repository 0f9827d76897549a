"""Warm start: a new run's LoRA tensors copied from an existing PEFT adapter (``config.base_adapter``).

Weights only -- no optimizer state, no data cursor (that is what a checkpoint is for). The base adapter is a registry
name or an absolute path (``kiln.adapters.base_adapter_dir``); it must hold
``adapter_model.safetensors`` with a tensor of the same shape for every LoRA parameter of the new adapter (same rank
and target modules), else the run fails ``base_adapter_missing`` (no weights file), ``adapter_load_failed`` (a
weights file that is not readable safetensors) or ``shape_mismatch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.adapters import WEIGHTS_FILE, AdapterDirectory
from kiln.errors import AdapterLoadError, BaseAdapterMissingError, ShapeMismatchError

__all__ = ["warm_start"]


def warm_start(params: dict[str, Any], base_dir: Path) -> None:
    """Copy every LoRA A/B tensor of ``params`` from the adapter in ``base_dir``."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights = AdapterDirectory(base_dir).weights_path
    if not weights.is_file():
        raise BaseAdapterMissingError(f"base adapter {base_dir} has no {WEIGHTS_FILE}")
    try:
        saved = load_file(weights)
    except SafetensorError as exc:
        raise AdapterLoadError(f"base adapter {weights} could not be loaded: {exc}") from exc
    with torch.no_grad():
        for name, param in params.items():
            key = name.replace(".default.", ".")
            if key not in saved:
                raise ShapeMismatchError(f"base adapter {base_dir} has no tensor {key}")
            if tuple(saved[key].shape) != tuple(param.shape):
                raise ShapeMismatchError(
                    f"base adapter tensor {key} has shape {tuple(saved[key].shape)}, the new adapter needs "
                    f"{tuple(param.shape)} (rank and target modules must match)"
                )
            param.copy_(saved[key].to(param.dtype))
