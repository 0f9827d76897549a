"""Where a causal LM keeps what Kiln reads of it, without loading torch: its decoder stack and the post-processing its
config declares for its logits.

* ``decoder_of(causal)``: the module that returns ``last_hidden_state`` (``get_decoder()``, else the
  ``base_model_prefix`` attribute), or None when there is none Kiln knows;
* ``logit_map_of(config)``: what the model's forward applies after its head, as a ``kiln.kernels.LogitMap`` --
  ``final_logit_softcapping`` (Gemma 2 and 3: ``c · tanh(z / c)``), ``logits_scaling`` (Granite: ``z / s``),
  ``logit_scale`` (Cohere: ``z · s``); the identity when it declares none.

The invariant forward (``kiln.model._decoder``) and SFT's head proof (``kiln.training.model_head``) read both here.
"""

from __future__ import annotations

from typing import Any, TypeGuard

__all__ = ["decoder_of", "logit_map_of"]


def decoder_of(causal: Any) -> Any:
    """The decoder stack of a causal LM (what returns ``last_hidden_state``), or None when it has none Kiln knows."""
    get = getattr(causal, "get_decoder", None)
    if callable(get):
        try:
            found = get()
        except (AttributeError, NotImplementedError):
            found = None
        if found is not None and found is not causal:
            return found
    prefix = getattr(causal, "base_model_prefix", None)
    found = getattr(causal, prefix, None) if isinstance(prefix, str) and prefix else None
    return found if found is not None and found is not causal else None


def logit_map_of(config: Any) -> Any:
    """The post-processing a model config declares, as a ``kiln.kernels.LogitMap`` (identity when it declares none)."""
    from kiln.kernels import LogitMap

    scale = 1.0
    divisor = getattr(config, "logits_scaling", None)
    if _number(divisor) and divisor != 1:
        scale /= float(divisor)
    multiplier = getattr(config, "logit_scale", None)
    if _number(multiplier) and multiplier != 1:
        scale *= float(multiplier)
    cap = getattr(config, "final_logit_softcapping", None)
    return LogitMap(scale=scale, softcap=float(cap) if _number(cap) and cap > 0 else None)


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)
