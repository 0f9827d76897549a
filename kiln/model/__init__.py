"""The model layer: find, materialise and load a base model, and capture its identity.

``resolve_model_path(cli)``  --model > model.path (kiln.host.config: KILN_MODEL_PATH > kiln.toml) > the tiny default
``check_model_dir(path)``   a local model directory, or a refusal saying why not (missing, a Hub id, no config.json)
``load_base_model(path)``    a frozen Hugging Face causal LM and its tokenizer (local files only); in two halves,
                             ``open_base_model`` (tokenizer, config, weight headers) and ``load_weights`` (fp32,
                             bf16 or NF4)
``capture_identity(...)``    base-weight shard manifest, config/tokenizer/template digests,
                             execution provenance and training precision -- once per process
``resolve_device(setting)``  auto | cpu | cuda | cuda:N to cpu or cuda:N, or a refusal naming what this machine has;
                             ``apply_determinism``, ``execution_envelope``: CUDA's reproducibility settings and the
                             envelope a CUDA run's exact resume holds in
``create_tiny(path, seed)``  write a tiny model (same tokenizer, weights from ``seed``)
``forward_logits(model, ids)`` the model's own logits (after its post-processing): every log-probability's source
``RowBatch(model)``          sequences decoded together, one forward per step, each row's logits bit for bit its own
"""

from __future__ import annotations

from kiln.model._device import (
    apply_determinism,
    cuda_device_count,
    determinism_settings,
    device_free_bytes,
    device_memory_bytes,
    execution_envelope,
    is_cuda,
    resolve_device,
    runtime_device,
)
from kiln.model._identity import ModelIdentity, capture_identity, git_source, training_precision, weights_cache_dir
from kiln.model._loader import (
    LoadedModel,
    check_model_dir,
    load_base_model,
    load_weights,
    open_base_model,
    resolve_model_path,
    resolve_precision,
)
from kiln.model._logits import (
    forward_logits,
    model_device,
    next_token_logprobs,
    padded_forward_logits,
    right_padded,
)
from kiln.model._rows import RowBatch
from kiln.model._sampling import (
    Sampling,
    choose,
    max_positions,
    pick_token,
    sample,
    sample_batch,
    special_tokens,
    stop_token_ids,
)
from kiln.model._tiny import TINY_NAME, create_tiny, ensure_default_tiny
from kiln.model._weights import WeightsInfo, read_weights_info

__all__ = [
    "TINY_NAME",
    "LoadedModel",
    "ModelIdentity",
    "RowBatch",
    "Sampling",
    "WeightsInfo",
    "apply_determinism",
    "capture_identity",
    "check_model_dir",
    "choose",
    "create_tiny",
    "cuda_device_count",
    "determinism_settings",
    "device_free_bytes",
    "device_memory_bytes",
    "ensure_default_tiny",
    "execution_envelope",
    "forward_logits",
    "git_source",
    "is_cuda",
    "load_base_model",
    "load_weights",
    "max_positions",
    "model_device",
    "next_token_logprobs",
    "open_base_model",
    "padded_forward_logits",
    "pick_token",
    "read_weights_info",
    "resolve_device",
    "resolve_model_path",
    "resolve_precision",
    "right_padded",
    "runtime_device",
    "sample",
    "sample_batch",
    "special_tokens",
    "stop_token_ids",
    "training_precision",
    "weights_cache_dir",
]
