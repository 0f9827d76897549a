"""Resolve and load a local Hugging Face causal-LM directory (never the network)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import RequestError
from kiln.home import models_dir
from kiln.model._tiny import ensure_default_tiny, quiet_hub


@dataclass
class LoadedModel:
    path: Path
    model: Any
    tokenizer: Any
    is_default: bool


def resolve_model_path(
    cli_path: str | os.PathLike[str] | None = None, *, config_path: str | None = None
) -> tuple[Path, bool]:
    """(path, is_default): ``--model`` > ``KILN_MODEL_PATH`` > ``model.path`` > the tiny default."""
    for candidate in (cli_path, os.environ.get("KILN_MODEL_PATH"), config_path):
        if candidate:
            path = Path(candidate).expanduser()
            if not (path / "config.json").is_file():
                raise RequestError(
                    f"model path {path} is not a Hugging Face model directory (no config.json)",
                    code="training_invalid_request",
                    hint="pass --model with a local directory holding config.json, *.safetensors and tokenizer files",
                )
            return path.resolve(), False
    return ensure_default_tiny(models_dir()).resolve(), True


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
