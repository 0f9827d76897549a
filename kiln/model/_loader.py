"""Resolve and load a local Hugging Face causal-LM directory (never the network).

Before transformers opens anything, the weight files it will read are checked: every shard the
``model.safetensors.index.json`` maps a tensor to, or else ``model.safetensors``. A missing one (a renamed or
deleted shard) is refused naming the file, never left to a traceback from inside transformers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.documents.jsonio import read_json_file
from kiln.errors import KilnError, RequestError
from kiln.host.config import Settings, resolve_settings
from kiln.model._tiny import ensure_default_tiny, quiet_hub

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


@dataclass
class LoadedModel:
    path: Path
    model: Any
    tokenizer: Any
    is_default: bool


def resolve_model_path(
    path: str | os.PathLike[str] | None = None, *, settings: Settings | None = None
) -> tuple[Path, bool]:
    """(path, is_default): ``path`` (``--model``), else ``model.path`` of the configuration (``settings``, else the
    configuration resolved now: ``KILN_MODEL_PATH`` > ``kiln.toml``), else the tiny default under its home."""
    if not path:
        configured = settings or resolve_settings()
        if configured.model.path is None:
            return ensure_default_tiny(configured.models_dir).resolve(), True
        path = configured.model.path
    directory = Path(path).expanduser()
    if not (directory / "config.json").is_file():
        raise RequestError(
            f"model path {directory} is not a Hugging Face model directory (no config.json)",
            code="training_invalid_request",
            hint="pass --model with a local directory holding config.json, *.safetensors and tokenizer files",
        )
    return directory.resolve(), False


def load_base_model(path: Path, *, is_default: bool = False, dtype: str = "float32") -> LoadedModel:
    """Load model and tokenizer from a local directory; base weights are frozen."""
    quiet_hub()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not any(path.glob("*.safetensors")):
        raise RequestError(
            f"model directory {path} has no *.safetensors weights (Kiln never loads pickled weights)",
            code="training_invalid_request",
        )
    missing = _missing_weights(path)
    if missing is not None:
        raise RequestError(
            missing,
            code="training_invalid_request",
            hint="restore the named file under that name, or use a complete copy of the model",
        )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(f"the tokenizer in {path} has no chat template", code="training_invalid_request")
    model = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=getattr(torch, dtype), use_safetensors=True
    )
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return LoadedModel(path=path, model=model, tokenizer=tokenizer, is_default=is_default)


def _missing_weights(path: Path) -> str | None:
    """Why the weight files transformers will open are not all in ``path``; None when they are."""
    index = path / WEIGHTS_INDEX
    if not index.is_file():
        if (path / WEIGHTS_FILE).is_file():
            return None
        found = ", ".join(sorted(p.name for p in path.glob("*.safetensors")))
        return (
            f"model directory {path} has no {WEIGHTS_FILE} (and no {WEIGHTS_INDEX} naming its shards); "
            f"it holds {found}, which is not read under another name"
        )
    try:
        weight_map = read_json_file(index)
    except KilnError as exc:
        return f"{index} is unreadable: {exc.message}"
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    shards = set(weight_map.values()) if isinstance(weight_map, dict) else set()
    if not shards or not all(isinstance(s, str) and s and Path(s).name == s for s in shards):
        return f"{index} has no weight_map from tensor names to shard files beside it"
    missing = sorted(s for s in shards if not (path / s).is_file())
    if not missing:
        return None
    more = f" (and {len(missing) - 1} more of its {len(shards)} shards)" if len(missing) > 1 else ""
    return f"model directory {path} is missing weight shard {missing[0]}{more}, which {WEIGHTS_INDEX} lists"
