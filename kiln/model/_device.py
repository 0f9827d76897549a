"""Where Kiln computes: the ``device`` setting, CUDA's determinism settings and the execution envelope.

* ``resolve_device(setting)``: ``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` to a concrete ``cpu`` or ``cuda:N``
  (``auto``: the current CUDA device -- ``cuda:0``, or a torchrun rank's own -- when this machine has one, else the
  CPU); a device the machine lacks is refused
  with what it has and why (a CPU-only torch, no visible device, an index past the last), never a traceback;
* ``apply_determinism(device)``: the one place that makes CUDA execution reproducible -- deterministic algorithms,
  ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (set only when unset, and before CUDA initialises: cuBLAS reads it once),
  cuDNN deterministic without autotuning, TF32 and reduced-precision reductions off -- and returns the settings as
  they are in effect; on the CPU it only switches deterministic algorithms on, as Kiln always has, so CPU numerics
  are untouched;
* ``execution_envelope(device)``: where a CUDA run's bitwise reproducibility holds (device model, compute
  capability, SM count, torch/CUDA/cuDNN/triton versions, the determinism settings); None on the CPU.

Every ``torch.cuda`` call here is guarded: a CPU-only torch imports and runs all of it.
"""

from __future__ import annotations

import os
import re
from importlib import metadata
from typing import Any

from kiln.errors import RequestError

DEVICE_SETTINGS = ("auto", "cpu", "cuda", "cuda:N")
_CUDA = re.compile(r"cuda(?::(0|[1-9][0-9]{0,3}))?")
CUBLAS_WORKSPACE_CONFIG = ":4096:8"  # the workspace size cuBLAS needs for reproducible results


def is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def runtime_device(device: str) -> str:
    """The short name a planning identity records: ``cpu`` or ``cuda`` (the index does not change numerics)."""
    return "cuda" if is_cuda(device) else "cpu"


def cuda_device_count() -> int:
    """Visible CUDA devices (0 on a CPU-only torch or without a driver)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.device_count())


def resolve_device(setting: str, *, field: str = "device", pointer: str | None = "/config/device") -> str:
    """``cpu`` or ``cuda:N`` for a device setting; refuses a malformed setting and a device this machine lacks
    (``training_backend_unsupported``, naming what it has)."""
    if setting == "cpu":
        return "cpu"
    count = cuda_device_count()
    if setting == "auto":  # the current CUDA device: cuda:0, or a rank's own (torch.cuda.set_device)
        return _current() if count else "cpu"
    match = _CUDA.fullmatch(setting)
    if match is None:
        raise RequestError(
            f"{field}: {setting!r} is not a device; use auto, cpu, cuda or cuda:N",
            code="training_invalid_request",
            pointer=pointer,
        )
    if count == 0:
        raise RequestError(
            f"{field}: {setting} needs a CUDA device, and this machine has none ({_why_no_cuda()})",
            code="training_backend_unsupported",
            pointer=pointer,
            hint="use --device cpu (or auto, which picks the CPU here), or run on a machine with an NVIDIA GPU, its "
            "driver and a CUDA build of torch",
        )
    if match.group(1) is None:
        return _current()
    index = int(match.group(1))
    if index >= count:
        visible = ", ".join(f"cuda:{i}" for i in range(count))
        raise RequestError(
            f"{field}: {setting} is not a CUDA device of this machine, which has {count} ({visible})",
            code="training_backend_unsupported",
            pointer=pointer,
            hint=f"use one of {visible}, or check CUDA_VISIBLE_DEVICES",
        )
    return f"cuda:{index}"


def _current() -> str:
    import torch

    return f"cuda:{torch.cuda.current_device()}"


def _why_no_cuda() -> str:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    limited = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"torch {torch.__version__} is built for CUDA {torch.version.cuda} but sees no device{limited}"


def apply_determinism(device: str) -> dict[str, Any]:
    """Switch on what makes ``device``'s execution reproducible (idempotent) and return the settings in effect.

    CUDA: ``CUBLAS_WORKSPACE_CONFIG`` is set here only when the environment has none (an existing value is kept and
    recorded); the flags are process-wide. Call it before anything initialises CUDA."""
    import torch

    if is_cuda(device):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.use_deterministic_algorithms(True)
    return determinism_settings()


def determinism_settings() -> dict[str, Any]:
    """The determinism settings as this process has them (``CheckpointDeterminismSettings``)."""
    import torch

    matmul = torch.backends.cuda.matmul
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG") or None,
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "tf32_matmul": bool(matmul.allow_tf32),
        "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        "bf16_reduced_precision_reduction": bool(matmul.allow_bf16_reduced_precision_reduction),
        "fp16_reduced_precision_reduction": bool(matmul.allow_fp16_reduced_precision_reduction),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def execution_envelope(device: str) -> dict[str, Any] | None:
    """The envelope a CUDA run's exact resume holds in (``CheckpointExecutionEnvelope``); None on the CPU."""
    if not is_cuda(device):
        return None
    import torch

    index = torch.device(device).index or 0
    properties = torch.cuda.get_device_properties(index)
    return {
        "device_name": str(properties.name),
        "compute_capability": f"{properties.major}.{properties.minor}",
        "sm_count": int(properties.multi_processor_count),
        "torch_version": str(torch.__version__),
        "cuda_version": torch.version.cuda,
        "cudnn_version": int(torch.backends.cudnn.version()) if torch.backends.cudnn.is_available() else None,
        "triton_version": package_version("triton"),
        "determinism": determinism_settings(),
    }


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def device_memory_bytes(device: str) -> int | None:
    """The total memory of a CUDA device (None on the CPU, whose budget is the host's)."""
    if not is_cuda(device):
        return None
    import torch

    return int(torch.cuda.get_device_properties(torch.device(device).index or 0).total_memory)


def device_free_bytes(device: str) -> int | None:
    """The free memory of a CUDA device now, net of what any process holds on it (a server's serving copy
    included); None on the CPU."""
    if not is_cuda(device):
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device).index or 0)
    return int(free)
