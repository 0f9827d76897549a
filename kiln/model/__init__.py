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
``forward_logits(model, ids)`` the model's own logits (after its post-processing), from its own forward
``Decoder.of(model)``         the invariant forward: Kiln's decoder over the model's weights on ``kiln.kernels``'
                             invariant operations, a row's bits independent of its batch, padding and prefill/step;
                             ``decoder_for`` caches one per model; ``sequence_logprobs`` scores sequences with it
``Batch(model)``              the one batched decoder (server, evaluations, OPD rollouts): rows join, step and leave,
                             one invariant forward per step (each row alone through the model's own when it has none)
``draw_tokens(...)``          portable draws: a batch's tokens from its logits by a counter-keyed rule, the same token
                             for the same logits on any device
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
from kiln.model._sampling import (
    Sampling,
    max_positions,
    special_tokens,
    stop_token_ids,
)
from kiln.model._structure import decoder_of, logit_map_of
from kiln.model._tiny import TINY_NAME, create_tiny, ensure_default_tiny
from kiln.model._weights import WeightsInfo, read_weights_info

if TYPE_CHECKING:  # the names below, for the type checker; at run time they load lazily (``__getattr__``)
    from kiln.model._cache import KVCache
    from kiln.model._decoder import Decoder, RowLoras, Unsupported
    from kiln.model._draw import DrawKey, draw_tokens, next_tokens, penalised
    from kiln.model._generator import (
        Batch,
        Decoded,
        LoraLayers,
        batch_logprobs,
        decode,
        decoder_for,
        generation_backend,
        lora_hooks,
        sequence_logprobs,
    )

# The invariant forward, the one generator and the draws import torch (and kiln.kernels) at their top: they load on
# first use, so ``import kiln.model`` stays light for the CLI's commands that never touch a model.
_LAZY = {
    "Decoder": "_decoder",
    "KVCache": "_cache",
    "RowLoras": "_decoder",
    "Unsupported": "_decoder",
    "DrawKey": "_draw",
    "draw_tokens": "_draw",
    "next_tokens": "_draw",
    "penalised": "_draw",
    "Batch": "_generator",
    "Decoded": "_generator",
    "LoraLayers": "_generator",
    "batch_logprobs": "_generator",
    "decode": "_generator",
    "decoder_for": "_generator",
    "generation_backend": "_generator",
    "lora_hooks": "_generator",
    "sequence_logprobs": "_generator",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln.model' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f"kiln.model.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "TINY_NAME",
    "Batch",
    "Decoded",
    "Decoder",
    "DrawKey",
    "KVCache",
    "LoadedModel",
    "LoraLayers",
    "ModelIdentity",
    "RowLoras",
    "Sampling",
    "Unsupported",
    "WeightsInfo",
    "apply_determinism",
    "batch_logprobs",
    "capture_identity",
    "check_model_dir",
    "create_tiny",
    "cuda_device_count",
    "decode",
    "decoder_for",
    "decoder_of",
    "determinism_settings",
    "device_free_bytes",
    "device_memory_bytes",
    "draw_tokens",
    "ensure_default_tiny",
    "execution_envelope",
    "forward_logits",
    "generation_backend",
    "git_source",
    "is_cuda",
    "load_base_model",
    "load_weights",
    "logit_map_of",
    "lora_hooks",
    "max_positions",
    "model_device",
    "next_token_logprobs",
    "next_tokens",
    "open_base_model",
    "padded_forward_logits",
    "penalised",
    "read_weights_info",
    "resolve_device",
    "resolve_model_path",
    "resolve_precision",
    "right_padded",
    "runtime_device",
    "sequence_logprobs",
    "special_tokens",
    "stop_token_ids",
    "training_precision",
    "weights_cache_dir",
]
