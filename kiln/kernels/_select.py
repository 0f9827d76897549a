"""Route names, the capability rule that picks one, the default chunk sizes, and ``sft_loss``.

Selection rule (capability only; never read from a request, config or environment):

* ``triton_fused_linear_ce`` on CUDA for fp32 and bf16 hidden states when triton imports: the logits of a
  chunk of rows from one matmul, then one Triton program per row (loss and gradient in one kernel).
* ``fused_chunked_linear_ce`` wherever it is available otherwise: on CPU for every floating dtype (CPU
  runs never take the Triton route, so their artifacts do not change with triton installed) and on CUDA
  without triton or for fp16/fp64. It has the smallest peak memory and no head gradient to compute.
* ``active_rows`` on every other device type (MPS, XPU, ...), where the fused route has
  not been validated: plain torch ops that any backend runs.
* ``full_logits`` is never selected; it is the reference the parity tests compare against.
"""

from __future__ import annotations

import dataclasses

import torch

from ._active_rows import active_rows_loss
from ._full_logits import IGNORE_INDEX, full_logits_loss
from ._fused_ce import fused_chunked_loss
from ._logit_map import IDENTITY, LogitMap
from ._triton_ce import check_triton_device, triton_available, triton_fused_loss

FULL_LOGITS = "full_logits"
ACTIVE_ROWS = "active_rows"
FUSED_CHUNKED_LINEAR_CE = "fused_chunked_linear_ce"
TRITON_FUSED_LINEAR_CE = "triton_fused_linear_ce"
LOSS_ROUTES = (FULL_LOGITS, ACTIVE_ROWS, FUSED_CHUNKED_LINEAR_CE, TRITON_FUSED_LINEAR_CE)

# Which code runs each route, with a version that changes whenever its numerics do.
ROUTE_IMPLEMENTATIONS = {
    FULL_LOGITS: "torch.full-logits.v1",
    ACTIVE_ROWS: "torch.active-rows.v1",
    FUSED_CHUNKED_LINEAR_CE: "torch.fused-linear-ce.online-grad.v2",
    TRITON_FUSED_LINEAR_CE: "triton.fused-linear-ce.row-programs.v1",
}

FUSED_DEVICE_TYPES = ("cpu", "cuda")
TRITON_DTYPES = (torch.float32, torch.bfloat16)
CHUNK_BUDGET_BYTES = 64 * 1024 * 1024
MIN_CHUNK = 256
MAX_CHUNK = 8192


@dataclasses.dataclass(frozen=True)
class LossRouteChoice:
    """A route and its chunk size, as receipts record them: vocabulary columns per chunk for
    ``fused_chunked_linear_ce``, supervised rows per chunk for ``triton_fused_linear_ce``, ``None`` for the
    routes that do not chunk."""

    route: str
    chunk_size: int | None

    @property
    def implementation(self) -> str:
        return ROUTE_IMPLEMENTATIONS[self.route]


def select_loss_route(device: torch.device | str, dtype: torch.dtype) -> str:
    """The loss route for a device and a floating dtype, by the rule in this module's docstring."""
    if not dtype.is_floating_point:
        raise ValueError(f"loss routes take floating hidden states, got dtype {dtype}")
    kind = torch.device(device).type
    if kind == "cuda" and dtype in TRITON_DTYPES and triton_available():
        return TRITON_FUSED_LINEAR_CE
    if kind in FUSED_DEVICE_TYPES:
        return FUSED_CHUNKED_LINEAR_CE
    return ACTIVE_ROWS


def check_route_device(route: str, device: torch.device | str) -> None:
    """Raise ``ValueError`` (naming the route and the device) unless ``route`` can run on ``device``.

    The torch routes run on any device. ``triton_fused_linear_ce`` needs triton, and runs on CUDA devices,
    or on the CPU only in triton's interpreter (``TRITON_INTERPRET=1``). A trainer calls this before its
    first step, so a route recorded for another machine fails at once, not mid-run.
    """
    if route not in LOSS_ROUTES:
        raise ValueError(f"unknown loss route {route!r}; expected one of {', '.join(LOSS_ROUTES)}")
    if route == TRITON_FUSED_LINEAR_CE:
        check_triton_device(device)


def default_chunk_size(num_rows: int, vocab: int, hidden: int, dtype: torch.dtype) -> int:
    """The vocabulary chunk for ``num_rows`` supervised rows: the largest power of two in [256, 8192] that fits the budget.

    The budget (64 MiB) covers one chunk of logits ``[num_rows, C]`` in the compute dtype,
    plus the chunk of the head cast to the compute dtype when ``dtype`` is narrower. The
    chunk never exceeds the power of two that covers the whole vocabulary, and is 256
    when even that does not fit.
    """
    if num_rows < 0 or vocab < 1 or hidden < 1:
        raise ValueError(f"need num_rows >= 0, vocab >= 1 and hidden >= 1, got {num_rows}, {vocab}, {hidden}")
    compute = torch.promote_types(dtype, torch.float32)
    item = compute.itemsize
    cast_bytes_per_col = hidden * item if compute != dtype else 0
    ceiling = min(MAX_CHUNK, max(MIN_CHUNK, 1 << (vocab - 1).bit_length()))
    chunk = ceiling
    while chunk > MIN_CHUNK and chunk * (num_rows * item + cast_bytes_per_col) > CHUNK_BUDGET_BYTES:
        chunk //= 2
    return chunk


def default_row_chunk(vocab: int) -> int:
    """Supervised rows per chunk of the Triton route: as many as keep the ``[rows, vocab]`` fp32 logits buffer
    within the same 64 MiB budget as ``default_chunk_size`` (at least one).

    The figure depends on the vocabulary only; a call with fewer supervised rows uses one chunk of them all.
    (V = 151,936 gives 110 rows; V = 32,000 gives 524.)
    """
    if vocab < 1:
        raise ValueError(f"need vocab >= 1, got {vocab}")
    return max(1, CHUNK_BUDGET_BYTES // (vocab * torch.float32.itemsize))


def choose_loss_route(
    device: torch.device | str, dtype: torch.dtype, *, max_rows: int, vocab: int, hidden: int
) -> LossRouteChoice:
    """The selected route with a chunk size fixed for batches of up to ``max_rows`` supervised rows.

    A trainer records this choice and passes ``chunk_size=choice.chunk_size`` on every step,
    so the chunking (and with it the floating-point summation order) is the same all run. For
    ``triton_fused_linear_ce`` the chunk is ``default_row_chunk(vocab)`` supervised rows: it fixes the shapes
    of the chunk matmuls, whose summation order may depend on them.
    """
    route = select_loss_route(device, dtype)
    if route == FUSED_CHUNKED_LINEAR_CE:
        return LossRouteChoice(route, default_chunk_size(max_rows, vocab, hidden, dtype))
    if route == TRITON_FUSED_LINEAR_CE:
        return LossRouteChoice(route, default_row_chunk(vocab))
    return LossRouteChoice(route, None)


def sft_loss(
    route: str,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = None,
    bias: torch.Tensor | None = None,
    logit_map: LogitMap | None = None,
) -> torch.Tensor:
    """Masked mean next-token cross-entropy of the model's logits against ``labels`` by ``route``.

    The logits are ``logit_map(hidden @ weight.T + bias)``: the head (``bias`` [V] or None) and what the model
    does after it (``LogitMap``: scale, soft-cap; default none). ``hidden`` [T, H] is already aligned with
    ``labels`` [T] (row t predicts ``labels[t]``);
    ``labels == -100`` marks ignored rows. The loss is a 0-dim tensor in the compute dtype
    (fp32, or fp64 for fp64 inputs); gradients flow to ``hidden``. With no supervised row it
    is 0.0 and the gradient of ``hidden`` is zeros. ``chunk_size`` applies to the chunked routes only:
    vocabulary columns for ``fused_chunked_linear_ce`` (default: ``default_chunk_size`` for this call's
    supervised rows), supervised rows for ``triton_fused_linear_ce`` (default: ``default_row_chunk``), which
    also raises ``ValueError`` where its kernels cannot run (``check_route_device``).
    """
    if route not in LOSS_ROUTES:
        raise ValueError(f"unknown loss route {route!r}; expected one of {', '.join(LOSS_ROUTES)}")
    _check_inputs(hidden, weight, labels, bias)
    logit_map = IDENTITY if logit_map is None else logit_map
    if not isinstance(logit_map, LogitMap):
        raise TypeError(f"logit_map must be a kiln.kernels.LogitMap or None, got {type(logit_map).__name__}")
    if route == TRITON_FUSED_LINEAR_CE:
        rows_per_chunk = default_row_chunk(weight.shape[0]) if chunk_size is None else chunk_size
        return triton_fused_loss(hidden, weight, labels, rows_per_chunk, bias, logit_map)
    if route != FUSED_CHUNKED_LINEAR_CE:
        if chunk_size is not None:
            raise ValueError(
                f"chunk_size applies to the {FUSED_CHUNKED_LINEAR_CE} and {TRITON_FUSED_LINEAR_CE} routes only, not to {route}"
            )
        loss = full_logits_loss if route == FULL_LOGITS else active_rows_loss
        return loss(hidden, weight, labels, bias, logit_map)
    if chunk_size is None:
        rows = int((labels != IGNORE_INDEX).sum())
        chunk_size = default_chunk_size(rows, weight.shape[0], weight.shape[1], hidden.dtype)
    return fused_chunked_loss(hidden, weight, labels, chunk_size, bias, logit_map)


def _check_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"expected hidden [T, H], weight [V, H] and labels [T]; got shapes {tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"shapes disagree: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, labels {tuple(labels.shape)} (need hidden [T, H], weight [V, H], labels [T])"
        )
    if not hidden.dtype.is_floating_point or not weight.dtype.is_floating_point:
        raise TypeError(f"hidden and weight must be floating tensors, got {hidden.dtype} and {weight.dtype}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0] or not bias.dtype.is_floating_point):
        raise ValueError(
            f"the head's bias must be a floating [V] tensor matching weight {tuple(weight.shape)}, got "
            f"{tuple(bias.shape)} of {bias.dtype}"
        )
    if bias is not None and bias.device != weight.device:
        raise ValueError(f"bias and weight must share a device, got {bias.device} and {weight.device}")
    if labels.dtype != torch.long:
        raise TypeError(f"labels must be torch.long token ids (-100 = ignored), got {labels.dtype}")
    if not hidden.device == weight.device == labels.device:
        raise ValueError(
            f"hidden, weight and labels must share a device, got {hidden.device}, {weight.device}, {labels.device}"
        )
    bad = ((labels < 0) | (labels >= weight.shape[0])) & (labels != IGNORE_INDEX)
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"labels[{position}] = {int(labels[position])} is outside the vocabulary [0, {weight.shape[0]}) and is not the ignore index {IGNORE_INDEX}"
        )
