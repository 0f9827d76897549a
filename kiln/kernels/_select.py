"""Route names, the capability rule that picks one, the default chunk size, and ``sft_loss``.

Selection rule (capability only; never read from a request, config or environment):

* ``fused_chunked_linear_ce`` wherever it is available: on CPU for every floating dtype
  and on CUDA. It has the smallest peak memory and no head gradient to compute.
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

FULL_LOGITS = "full_logits"
ACTIVE_ROWS = "active_rows"
FUSED_CHUNKED_LINEAR_CE = "fused_chunked_linear_ce"
LOSS_ROUTES = (FULL_LOGITS, ACTIVE_ROWS, FUSED_CHUNKED_LINEAR_CE)

# Which code runs each route, with a version that changes whenever its numerics do.
ROUTE_IMPLEMENTATIONS = {
    FULL_LOGITS: "torch.full-logits.v1",
    ACTIVE_ROWS: "torch.active-rows.v1",
    FUSED_CHUNKED_LINEAR_CE: "torch.fused-linear-ce.online-grad.v2",
}

FUSED_DEVICE_TYPES = ("cpu", "cuda")
CHUNK_BUDGET_BYTES = 64 * 1024 * 1024
MIN_CHUNK = 256
MAX_CHUNK = 8192


@dataclasses.dataclass(frozen=True)
class LossRouteChoice:
    """A route and its vocabulary chunk size (``None`` for routes that do not chunk), as receipts record them."""

    route: str
    chunk_size: int | None

    @property
    def implementation(self) -> str:
        return ROUTE_IMPLEMENTATIONS[self.route]


def select_loss_route(device: torch.device | str, dtype: torch.dtype) -> str:
    """The loss route for a device and a floating dtype, by the rule in this module's docstring."""
    if not dtype.is_floating_point:
        raise ValueError(f"loss routes take floating hidden states, got dtype {dtype}")
    if torch.device(device).type in FUSED_DEVICE_TYPES:
        return FUSED_CHUNKED_LINEAR_CE
    return ACTIVE_ROWS


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


def choose_loss_route(
    device: torch.device | str, dtype: torch.dtype, *, max_rows: int, vocab: int, hidden: int
) -> LossRouteChoice:
    """The selected route with a chunk size fixed for batches of up to ``max_rows`` supervised rows.

    A trainer records this choice and passes ``chunk_size=choice.chunk_size`` on every step,
    so the chunking (and with it the floating-point summation order) is the same all run.
    """
    route = select_loss_route(device, dtype)
    if route != FUSED_CHUNKED_LINEAR_CE:
        return LossRouteChoice(route, None)
    return LossRouteChoice(route, default_chunk_size(max_rows, vocab, hidden, dtype))


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
    is 0.0 and the gradient of ``hidden`` is zeros. ``chunk_size`` applies to the fused
    route only (default: ``default_chunk_size`` for this call's supervised rows).
    """
    if route not in LOSS_ROUTES:
        raise ValueError(f"unknown loss route {route!r}; expected one of {', '.join(LOSS_ROUTES)}")
    _check_inputs(hidden, weight, labels, bias)
    logit_map = IDENTITY if logit_map is None else logit_map
    if not isinstance(logit_map, LogitMap):
        raise TypeError(f"logit_map must be a kiln.kernels.LogitMap or None, got {type(logit_map).__name__}")
    if route != FUSED_CHUNKED_LINEAR_CE:
        if chunk_size is not None:
            raise ValueError(f"chunk_size applies to the {FUSED_CHUNKED_LINEAR_CE} route only, not to {route}")
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
