"""Resolve and load a local Hugging Face causal-LM directory (never the network).

Before transformers opens anything, the weight files it will read are checked: every shard the
``model.safetensors.index.json`` maps a tensor to, or else ``model.safetensors``. A missing one (a renamed or
deleted shard) is refused naming the file, never left to a traceback from inside transformers.

Loading has two halves so a trainer can plan before it spends memory: ``open_base_model`` reads the tokenizer, the
config and the weight files' headers (seconds, whatever the model's size); ``load_weights`` then loads the frozen
weights in the precision the run resolved -- ``fp32``, ``bf16`` (``resolve_precision``: ``auto`` keeps the
checkpoint's own dtype) -- or quantized to NF4 through bitsandbytes. ``load_base_model`` does both.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.documents.jsonio import read_json_file
from kiln.errors import KilnError, RequestError
from kiln.host.config import Settings, resolve_settings
from kiln.host.progress import human_bytes, stage
from kiln.model._tiny import ensure_default_tiny, quiet_hub
from kiln.model._weights import WeightsInfo, read_weights_info

WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"


PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}  # a training precision -> the torch dtype of the base weights
QUANTIZATIONS = ("none", "nf4")
MIN_BITSANDBYTES = (0, 47)  # the first release whose CPU backend quantizes to NF4


@dataclass
class LoadedModel:
    """A base model directory opened: its tokenizer, config and weight headers, and the frozen weights once loaded
    (``model`` is None before ``load_weights``, and after a trainer releases them)."""

    path: Path
    model: Any
    tokenizer: Any
    is_default: bool
    config: Any = None  # the transformers config (``model.config`` once loaded)
    weights: WeightsInfo | None = None  # the safetensors headers
    precision: str = "fp32"  # what the loaded weights are held in: fp32 | bf16
    quantization: str = "none"  # none | nf4
    device: str = "cpu"  # where the loaded weights are: cpu | cuda:N (kiln.model.resolve_device)

    @property
    def vocab_size(self) -> int:
        """The output head's vocabulary, from the config (a multimodal config's text part)."""
        return int(_text_config(self.config).vocab_size)

    @property
    def hidden_size(self) -> int:
        text = _text_config(self.config)
        return int(getattr(text, "hidden_size", None) or text.n_embd)


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


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
    return check_model_dir(path), False


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the Hugging Face Hub spells a model


def check_model_dir(path: str | os.PathLike[str]) -> Path:
    """``path`` resolved, once it is a local Hugging Face model directory (``config.json`` and every weight file
    transformers will open); else a refusal that says what is wrong with it -- missing, not a directory, a Hub id
    (Kiln never downloads), no config.json, a missing weight shard. Touches only the file system: a command line
    checks ``--model`` with it before torch loads."""
    directory = Path(path).expanduser()
    download = (
        "Kiln reads models from disk and never downloads; download it first, e.g. "
        f"`huggingface-cli download {path} --local-dir ~/models/{Path(str(path)).name}`, then pass --model with that "
        "directory"
    )
    if not directory.exists():
        hub = HUB_ID.fullmatch(str(path)) is not None and not str(path).startswith((".", "~"))
        raise RequestError(
            f"model path {directory} does not exist"
            + (f" (it reads like a Hugging Face Hub id: {path})" if hub else ""),
            code="training_invalid_request",
            hint=download if hub else "pass --model with the directory of a model downloaded to this machine",
        )
    if not directory.is_dir():
        raise RequestError(
            f"model path {directory} is not a directory",
            code="training_invalid_request",
            hint="pass --model with the model's directory (config.json, *.safetensors and tokenizer files), not a file",
        )
    if not (directory / "config.json").is_file():
        raise RequestError(
            f"model path {directory} is not a Hugging Face model directory (no config.json)",
            code="training_invalid_request",
            hint="pass --model with a local directory holding config.json, *.safetensors and tokenizer files",
        )
    _check_weight_files(directory)
    return directory.resolve()


def _check_weight_files(path: Path) -> None:
    """Refuse a model directory without safetensors weights, or missing a weight file transformers would open."""
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


def load_base_model(
    path: Path, *, is_default: bool = False, precision: str = "fp32", quantization: str = "none", device: str = "cpu"
) -> LoadedModel:
    """Load model and tokenizer from a local directory; base weights are frozen."""
    return load_weights(
        open_base_model(path, is_default=is_default), precision=precision, quantization=quantization, device=device
    )


def open_base_model(path: Path, *, is_default: bool = False) -> LoadedModel:
    """The tokenizer, config and weight headers of a local model directory, its weights not loaded."""
    _check_weight_files(path)
    stage(f"opening the model {path} (tokenizer, config, weight headers)")
    quiet_hub()
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(f"the tokenizer in {path} has no chat template", code="training_invalid_request")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return LoadedModel(
        path=path,
        model=None,
        tokenizer=tokenizer,
        is_default=is_default,
        config=config,
        weights=read_weights_info(path),
    )


def resolve_precision(requested: str, loaded: LoadedModel) -> str:
    """``fp32`` or ``bf16``: the requested precision, or for ``auto`` the checkpoint's own (a bfloat16 checkpoint
    trains in bf16; float32, float16 and anything else in fp32 -- float16 is not a training precision here)."""
    if requested != "auto":
        return requested
    stored = loaded.weights.stored_dtype if loaded.weights is not None else "f32"
    return "bf16" if stored == "bf16" else "fp32"


def load_weights(
    loaded: LoadedModel, *, precision: str = "fp32", quantization: str = "none", device: str = "cpu"
) -> LoadedModel:
    """``loaded`` with its frozen weights in ``precision`` (``fp32`` | ``bf16``), NF4-quantized when
    ``quantization`` is ``nf4``, on ``device`` (``cpu`` | ``cuda:N``, resolved). Weights already loaded that way are
    kept; weights loaded that way on another device are moved (a copy: the caller's stay where they are)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {sorted(PRECISIONS)}")
    if loaded.model is not None and (loaded.precision, loaded.quantization) == (precision, quantization):
        if loaded.device == device:
            return loaded
        if quantization == "none":
            import copy

            stage(f"copying the weights of {loaded.path.name} to {device}")
            moved = copy.deepcopy(loaded.model).to(device) if loaded.device == "cpu" else loaded.model.to(device)
            return dataclasses.replace(loaded, model=moved, device=device)
    size = f"{human_bytes(loaded.weights.stored_bytes)}, " if loaded.weights is not None else ""
    stage(f"loading the weights of {loaded.path.name} ({size}{precision}{', NF4' if quantization == 'nf4' else ''})")
    quiet_hub()
    import torch
    from transformers import AutoModelForCausalLM

    extra: dict[str, Any] = {}
    if quantization == "nf4":
        extra["quantization_config"] = nf4_config(getattr(torch, PRECISIONS[precision]))
    elif quantization != "none":
        raise ValueError(f"quantization {quantization!r} is not one of {list(QUANTIZATIONS)}")
    if device != "cpu":
        extra["device_map"] = {"": device}  # straight onto the device: no host copy of a large model
    model = AutoModelForCausalLM.from_pretrained(
        loaded.path, local_files_only=True, dtype=getattr(torch, PRECISIONS[precision]), use_safetensors=True, **extra
    )
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    if quantization == "nf4":
        for module in model.modules():
            # bitsandbytes repacks a 4-bit weight in place for its AVX512-bf16 inference kernel the first time a
            # forward runs without gradient, and only for widths divisible by 32: one weight format, one path
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
    return dataclasses.replace(
        loaded, model=model, config=model.config, precision=precision, quantization=quantization, device=device
    )


def nf4_config(compute_dtype: Any) -> Any:
    """transformers' ``BitsAndBytesConfig`` for NF4 weights computing in ``compute_dtype``; refuses a missing or too
    old bitsandbytes with what to install."""
    from importlib import metadata

    try:
        version = metadata.version("bitsandbytes")
    except metadata.PackageNotFoundError:
        version = None
    numbers = tuple(int(p) for p in (version or "0.0").split(".")[:2] if p.isdigit())
    if version is None or numbers < MIN_BITSANDBYTES:
        found = "is not installed" if version is None else f"is {version}"
        raise RequestError(
            f"quantization nf4 needs bitsandbytes {MIN_BITSANDBYTES[0]}.{MIN_BITSANDBYTES[1]} or later, which {found}",
            code="training_backend_unsupported",
            pointer="/config/quantization",
            hint="pip install 'bitsandbytes>=0.47' (or the kiln[quantization] extra), or train without quantization",
        )
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=compute_dtype,
        bnb_4bit_use_double_quant=False,
        bnb_4bit_quant_storage="uint8",
    )


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
