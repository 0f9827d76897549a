"""Training state as checkpoint files, and back (shared by the trainers).

* adapter tensors by stable parameter name (``adapter.safetensors``);
* optimizer slots by ``<parameter name>#<slot>`` (``optimizer.safetensors``; AdamW's
  ``step`` is a 0-d tensor like the others; SGD has none);
* the identity parts every kind binds into ``auxiliary_state``: model, tokenizer and
  template digests, the full shard manifest, execution provenance, backend runtime,
  Kiln version, precision and the planning identity.

safetensors only (no pickle). Restoring checks the exact name set, shapes and dtypes and
refuses any difference with ``checkpoint_incompatible`` naming the tensor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kiln import __version__
from kiln.documents.digests import json_sha256
from kiln.errors import CheckpointError

ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
LORA_INIT_ALGORITHM = "kiln.seeded-lora-init.v1"
SLOT_SEPARATOR = "#"
# Activation checkpointing recomputes whole decoder layers, one segment each (kiln.training._recompute), and there is
# no boundary replay; the planning identity records the segment count and this boundary policy.
BOUNDARY_POLICY = {
    "recompute_mode": "disabled",
    "recompute_threshold_tokens": 4096,
    "anchor_stride": None,
    "cache_target_bytes": 268435456,
}

__all__ = [
    "ADAPTER_FILE",
    "CUDA_RNG_ALGORITHM",
    "CUDA_RNG_FILE",
    "CUDA_RNG_STREAM",
    "LORA_INIT_ALGORITHM",
    "OPTIMIZER_FILE",
    "adapter_tensors",
    "auxiliary_identity",
    "cuda_rng_capture",
    "cuda_rng_position",
    "cuda_rng_restore",
    "cuda_rng_stream",
    "encode_tensors",
    "optimizer_tensors",
    "planning_identity",
    "restore_adapter",
    "restore_optimizer",
]


def adapter_tensors(params: Mapping[str, Any]) -> dict[str, Any]:
    """Host copies of the LoRA tensors by stable name (run under the device lock)."""
    return {name: p.detach().to("cpu", copy=True).contiguous() for name, p in params.items()}


def optimizer_tensors(optimizer: Any, params: Mapping[str, Any]) -> dict[str, Any]:
    """Host copies of every optimizer slot as ``<param>#<slot>``."""
    out = {}
    for name, param in params.items():
        for slot, value in sorted(optimizer.state.get(param, {}).items()):
            if not hasattr(value, "detach"):
                raise TypeError(f"optimizer slot {slot!r} of {name} is not a tensor; it cannot be checkpointed")
            out[f"{name}{SLOT_SEPARATOR}{slot}"] = value.detach().to("cpu", copy=True).contiguous()
    return out


def encode_tensors(tensors: Mapping[str, Any]) -> bytes:
    from safetensors.torch import save

    return save(dict(tensors))


def _decode(blob: bytes, what: str) -> dict[str, Any]:
    from safetensors.torch import load

    try:
        return load(blob)
    except Exception as exc:  # noqa: BLE001 -- safetensors raises its own error types
        raise CheckpointError(
            f"{what} is not a readable safetensors file: {exc}", reason="tensor_file_invalid"
        ) from None


def _incompatible(message: str, reason: str) -> CheckpointError:
    return CheckpointError(
        message,
        code="checkpoint_incompatible",
        reason=reason,
        hint="the checkpoint was written for another adapter shape; resume with the same model, LoRA rank and targets",
    )


def restore_adapter(params: Mapping[str, Any], blob: bytes) -> None:
    import torch

    saved = _decode(blob, ADAPTER_FILE)
    missing, extra = sorted(set(params) - set(saved)), sorted(set(saved) - set(params))
    if missing or extra:
        name = (missing or extra)[0]
        where = "has no tensor" if missing else "has a tensor the adapter does not"
        raise _incompatible(
            f"{ADAPTER_FILE} {where} {name!r} ({len(missing)} missing, {len(extra)} extra)", "adapter_parameters"
        )
    with torch.no_grad():
        for name, param in params.items():
            tensor = saved[name]
            if tuple(tensor.shape) != tuple(param.shape) or tensor.dtype != param.dtype:
                raise _incompatible(
                    f"{ADAPTER_FILE} tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the adapter needs "
                    f"{tuple(param.shape)} {param.dtype}",
                    "adapter_parameters",
                )
            param.copy_(tensor)


def restore_optimizer(optimizer: Any, params: Mapping[str, Any], blob: bytes | None) -> None:
    saved = {} if blob is None else _decode(blob, OPTIMIZER_FILE)
    by_param: dict[str, dict[str, Any]] = {}
    for key, tensor in saved.items():
        name, sep, slot = key.rpartition(SLOT_SEPARATOR)
        if not sep or name not in params:
            raise _incompatible(
                f"{OPTIMIZER_FILE} has state {key!r} for no parameter of the adapter", "optimizer_state"
            )
        by_param.setdefault(name, {})[slot] = tensor
    for name, slots in by_param.items():
        param = params[name]
        for slot, tensor in slots.items():
            if tensor.dim() and tuple(tensor.shape) != tuple(param.shape):
                raise _incompatible(
                    f"{OPTIMIZER_FILE} slot {name}{SLOT_SEPARATOR}{slot} is {tuple(tensor.shape)}, the parameter is "
                    f"{tuple(param.shape)}",
                    "optimizer_state",
                )
        # a slot the shape of its parameter lives where the parameter does; a 0-dim one (a step count) stays on the
        # host, where torch's optimizers keep it
        optimizer.state[param] = {
            slot: tensor.to(param.device, copy=True) if tensor.dim() else tensor.clone()
            for slot, tensor in sorted(slots.items())
        }


CUDA_RNG_STREAM = "cuda-global"  # the global generator of the CUDA device a run trains on
CUDA_RNG_ALGORITHM = "kiln.torch-cuda-global-state.v1"
CUDA_RNG_FILE = "cuda_rng.safetensors"


def _cuda_index(device: str) -> int | None:
    """The CUDA device index of ``device``, or None for any other device (nothing of CUDA is touched then)."""
    if device != "cuda" and not device.startswith("cuda:"):
        return None
    return int(device.partition(":")[2] or 0)


def cuda_rng_stream(device: str) -> dict[str, Any] | None:
    """The ``rng_states`` record of a CUDA run's global device generator (position 0: ``cuda_rng_capture`` fills it
    in); None on every other device, so a CPU checkpoint has no such stream and no such file."""
    index = _cuda_index(device)
    if index is None:
        return None
    import torch

    with torch.cuda.device(index):
        seed = int(torch.cuda.initial_seed())
    return {"algorithm": CUDA_RNG_ALGORITHM, "seed": seed, "position": 0, "state_file": CUDA_RNG_FILE}


def cuda_rng_capture(device: str) -> dict[str, tuple[str, dict[str, Any]]]:
    """``{file: ("rng-state", {"state": ...})}`` with the CUDA generator's state of ``device``; empty elsewhere."""
    index = _cuda_index(device)
    if index is None:
        return {}
    import torch

    return {CUDA_RNG_FILE: ("rng-state", {"state": torch.cuda.get_rng_state(index).clone()})}


def cuda_rng_position(state: Any) -> int:
    """How far a CUDA (Philox) generator has gone: the offset its state's last 8 bytes hold (little-endian)."""
    raw = bytes(state.tolist())
    return int.from_bytes(raw[8:16], "little") if len(raw) >= 16 else 0


def cuda_rng_restore(device: str, rng_states: Mapping[str, Any], blobs: Mapping[str, bytes]) -> bool:
    """Put a checkpoint's CUDA generator state back on ``device``; False when the checkpoint has none (a CPU run's:
    then nothing is touched)."""
    stream = rng_states.get(CUDA_RNG_STREAM)
    index = _cuda_index(device)
    if stream is None or index is None:
        return False
    import torch

    state = _decode(blobs[stream["state_file"]], CUDA_RNG_FILE)["state"]
    torch.cuda.set_rng_state(state, index)
    return True


def _host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1


def gradient_checkpoint_plan(segments: int | None) -> list[list[int]]:
    """The layer ranges recomputed in the backward pass, ``[first, end)`` each: one per decoder layer when activation
    checkpointing is on (``segments`` layers), none when it is off."""
    return [[layer, layer + 1] for layer in range(segments or 0)]


def planning_identity(
    *,
    device: str,
    sft_loss_route: str | None = None,
    data_parallel: dict[str, Any] | None = None,
    segments: int | None = None,
    device_bytes: int | None = None,
) -> dict[str, Any]:
    """Planning identity v3 (GRPO, OPD) or, with an SFT loss route, v4 (with the data-parallel plan of a run over
    several ranks). ``segments``: the decoder layers recomputed one by one under activation checkpointing (None:
    checkpointing off)."""
    policy = {"mode": "explicit_segments", "segments": segments} if segments else {"mode": "disabled", "segments": None}
    record: dict[str, Any] = {
        "schema": "kiln.training-checkpoint-planning.v4" if sft_loss_route else "kiln.training-checkpoint-planning.v3",
        "gradient_checkpoint_policy": policy,
        "checkpoint_boundary_policy": dict(BOUNDARY_POLICY),
        "runtime_device": device,
        "effective_memory": {  # a device run's: the device's own memory (``device_bytes``)
            "total_bytes": _host_memory_bytes() if device_bytes is None else device_bytes,
            "source": "host_physical_memory" if device_bytes is None else "device_reported",
        },
    }
    if sft_loss_route:
        record["sft_loss_route"] = sft_loss_route
    if data_parallel is not None:
        record["data_parallel"] = data_parallel
    return record


def auxiliary_identity(
    identity: Any,
    precision: dict[str, Any],
    planning: dict[str, Any],
    *,
    threads: int | None = None,
    envelope: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The identity members of ``auxiliary_state`` shared by every training kind (``threads``: a data-parallel rank's
    intra-op threads, when admission runs in another process; ``envelope``: a CUDA run's execution envelope, which
    ``backend_runtime`` carries -- absent on the CPU)."""
    import torch

    provenance = identity.execution_provenance
    runtime: dict[str, Any] = {
        "backend": provenance["backend"]["name"],
        "device": provenance["backend"]["device"],
        "torch_version": str(torch.__version__),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "intra_op_threads": torch.get_num_threads() if threads is None else threads,
    }
    if envelope is not None:
        runtime["execution_envelope"] = envelope
    return {
        "model_config_sha256": identity.config_hash,
        "tokenizer_config_sha256": identity.tokenizer_config_hash,
        "chat_template_sha256": identity.chat_template_hash,
        "training_chat_template_sha256": identity.training_chat_template_hash,
        "base_model_weights_sha256": identity.base_weight_shard_manifest["aggregate_sha256"],
        "base_weight_shard_manifest": identity.base_weight_shard_manifest,
        "execution_provenance": provenance,
        "backend_runtime": runtime,
        "kiln_train_version": __version__,
        "gradient_checkpoint_plan_sha256": json_sha256(
            gradient_checkpoint_plan(planning["gradient_checkpoint_policy"].get("segments"))
            if planning["gradient_checkpoint_policy"]["mode"] == "explicit_segments"
            else []
        ),
        "training_precision_policy": precision,
    }
