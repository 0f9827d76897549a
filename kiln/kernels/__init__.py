"""SFT loss routes: the same masked mean next-token cross-entropy over a frozen LM head, four ways.

* ``full_logits`` -- dense ``[T, V]`` logits, standard cross-entropy; O(T·V). The
  reference, and the only route that accepts a trainable head.
* ``active_rows`` -- gathers the A supervised rows, dense cross-entropy on ``[A, V]``; O(A·V).
* ``fused_chunked_linear_ce`` -- one autograd node: walks the vocabulary in chunks of C
  with an online log-sum-exp and computes the gradient of the hidden rows in the same
  pass, so backward only scales it; two matrix products per supervised row, O(A·H + A·C).
* ``triton_fused_linear_ce`` -- the same single autograd node for CUDA, in Liger's structure: per chunk of R
  supervised rows, the ``[R, V]`` logits from one matmul, then one Triton program per row (the logit map, an
  online log-sum-exp, the loss, the logits' gradient in place) and one matmul for the rows' gradient;
  O(A·H + R·V). Runs on CUDA, or on CPU in triton's interpreter (``TRITON_INTERPRET=1``, for tests).

Every route applies the head's bias and the model's ``LogitMap`` (a scale, then a soft-cap ``c·tanh(z/c)``)
before the softmax, so the loss is the one the model's own forward defines.

All routes accumulate in at least fp32 whatever the input dtype (the Triton route computes in fp32 and
refuses fp64), treat ``-100`` labels as ignored, return 0.0 (with zero gradients) when nothing is
supervised, and are deterministic. ``select_loss_route`` picks a route from device capability alone;
``check_route_device`` says whether a route can run on a device; route names are stable strings recorded
in receipts.

The invariant operations (``kiln.kernels.invariant``: products, chunked attention, norms, log-softmax and
elementwise functions whose bits for a row depend on that row alone; ``kiln.kernels.exact``: the IEEE-only
functions, trees and scans they and the portable draws are built from) are public modules of their own, what
``kiln.model``'s invariant forward runs on; ``docs/invariant.md`` describes them.

This package imports only torch and the standard library, and triton for the Triton kernels: optional, imported
inside functions, so the package imports (and every torch implementation runs) without it.
"""

from __future__ import annotations

from ._logit_map import IDENTITY, LogitMap
from ._select import (
    ACTIVE_ROWS,
    FULL_LOGITS,
    FUSED_CHUNKED_LINEAR_CE,
    LOSS_ROUTES,
    ROUTE_IMPLEMENTATIONS,
    TRITON_FUSED_LINEAR_CE,
    LossRouteChoice,
    check_route_device,
    choose_loss_route,
    default_chunk_size,
    default_row_chunk,
    select_loss_route,
    sft_loss,
)

__all__ = [
    "ACTIVE_ROWS",
    "FULL_LOGITS",
    "FUSED_CHUNKED_LINEAR_CE",
    "IDENTITY",
    "LOSS_ROUTES",
    "ROUTE_IMPLEMENTATIONS",
    "TRITON_FUSED_LINEAR_CE",
    "LogitMap",
    "LossRouteChoice",
    "check_route_device",
    "choose_loss_route",
    "default_chunk_size",
    "default_row_chunk",
    "select_loss_route",
    "sft_loss",
]
