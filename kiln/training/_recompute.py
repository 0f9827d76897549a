"""Activation checkpointing: keep each decoder layer's input, recompute the layer during the backward pass.

``checkpoint_layers(causal)`` wraps every decoder layer's ``forward`` so that, whenever autograd records (a training
forward), the layer runs under ``torch.utils.checkpoint`` in its non-reentrant form: only the layer's inputs are
kept, and its activations are recomputed when the backward pass reaches it. Every layer is one segment, so the
planning identity records ``explicit_segments`` with the layer count. Under ``no_grad`` (rollouts, reference and
teacher forwards, evaluation) the layer runs as before.

Why these choices:

* non-reentrant checkpointing gives the frozen layers' LoRA parameters their gradients without the usual
  ``enable_input_require_grads`` trick (the reentrant form only backpropagates into inputs that require grad);
* it works in eval mode: transformers' own switch checkpoints only modules in training mode, and Kiln keeps the
  model in eval mode so no dropout ever draws from an unrecorded random stream;
* the recomputation replays the same operations on the same inputs (no dropout, no random draw), so the gradients
  equal the kept-activation run's up to the order of floating-point work, and a run with it is byte-deterministic;
* a KV cache passed during a training forward is dropped (the recomputation would write it twice).
"""

from __future__ import annotations

from typing import Any

__all__ = ["checkpoint_layers", "decoder_layers"]

_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


def decoder_layers(causal: Any) -> Any:
    """The decoder's layer list of a causal LM (``model.layers``, GPT-2's ``transformer.h``), or None."""
    from kiln.training._head import decoder_of

    body = decoder_of(causal)
    for name in ("layers", "h", "blocks"):
        found = getattr(body, name, None) if body is not None else None
        if found is not None and len(found):
            return found
    return None


def checkpoint_layers(causal: Any) -> int:
    """Recompute every decoder layer of ``causal`` (a transformers causal LM, not its peft wrapper) in the backward
    pass; returns how many layers now do. Idempotent."""
    import torch
    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(causal)
    if layers is None:
        from kiln.errors import RequestError

        raise RequestError(
            f"{type(causal).__name__} has no decoder layer list Kiln can checkpoint",
            code="training_backend_unsupported",
            pointer="/config/gradient_checkpointing",
            hint="train with gradient_checkpointing off",
        )
    for layer in layers:
        if getattr(layer, "_kiln_recomputed", False):
            continue
        forward = layer.forward

        def recomputed(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            for name in _CACHE_ARGUMENTS:
                if kwargs.get(name) is not None:
                    kwargs[name] = None
            if "use_cache" in kwargs:
                kwargs["use_cache"] = False
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        layer.forward = recomputed
        layer._kiln_recomputed = True
    return len(layers)
