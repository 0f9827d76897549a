"""SFT's head: the model's logits rebuilt from hidden states, and the check that they are the model's own.

SFT never materialises ``[T, V]`` logits through the model's forward: it takes the decoder's hidden states and
applies the head itself, inside a loss route (``kiln.kernels``). So it must apply exactly what the model's forward
applies after the decoder: the head's weight and bias, then the post-processing the config declares --

* ``final_logit_softcapping`` (Gemma 2, Gemma 3, ...): ``c · tanh(z / c)``;
* ``logits_scaling`` (Granite and its MoE variants): ``z / s``;
* ``logit_scale`` (Cohere): ``z · s``.

``model_head(model)`` reads those fields into a ``kiln.kernels.LogitMap`` and then proves it: one no-grad probe
compares ``map(head(decoder(ids)))`` with the model's own ``forward_logits`` on a fixed 16-token sequence. A model
whose forward does something else (another multiplier, a non-linear head, a decoder Kiln cannot reach) fails the
probe and is refused with ``training_backend_unsupported``, naming its architecture and the discrepancy -- never
trained on an approximate loss.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kiln.errors import RequestError
from kiln.model import decoder_of, logit_map_of

__all__ = ["ModelHead", "decoder_of", "logit_map_of", "model_head"]

PROBE_TOKENS = 16
# largest |model logits - rebuilt logits| relative to the largest |logit| (at least 1) that still counts as equal
PROBE_TOLERANCE = {"float32": 1e-4, "float64": 1e-9}
PROBE_TOLERANCE_NARROW = 2e-2  # bf16 / fp16 forwards round their logits


@dataclasses.dataclass(frozen=True)
class ModelHead:
    """How a model's logits follow from its decoder's hidden states, proven against its forward at admission."""

    architecture: str
    logit_map: Any  # kiln.kernels.LogitMap
    has_bias: bool
    probe_error: float

    def as_record(self) -> dict[str, Any]:
        """The receipt's ``runtime.sft_logits`` block."""
        return {"architecture": self.architecture, "head_bias": self.has_bias, **self.logit_map.as_record()}


def model_head(model: Any) -> ModelHead:
    """The head of ``model`` (a causal LM, LoRA-free) with its post-processing, proven by one probe forward."""
    import torch

    from kiln.model import forward_logits

    architecture = type(model).__name__
    body, head = decoder_of(model), model.get_output_embeddings()

    def refuse(why: str) -> RequestError:
        return RequestError(
            f"{architecture}: Kiln cannot reproduce this model's logits from its hidden states ({why}), so SFT "
            "would train a different loss than the model defines; the architecture is refused",
            code="training_backend_unsupported",
            hint="SFT supports the architectures listed in the README's table; GRPO and OPD use the model's own "
            "forward and are not affected",
        )

    if body is None:
        raise refuse("no decoder stack is reachable through get_decoder() or base_model_prefix")
    if not isinstance(head, torch.nn.Linear):
        raise refuse(f"the output head is a {type(head).__name__}, not a linear layer")
    try:
        logit_map = logit_map_of(model.config)
    except ValueError as exc:
        raise refuse(f"its config declares an unusable logit post-processing: {exc}") from None
    vocab = int(head.weight.shape[0])
    ids = torch.tensor([[(7 * i + 3) % vocab for i in range(PROBE_TOKENS)]], dtype=torch.long)
    ids = ids.to(head.weight.device)
    with torch.no_grad():
        own = forward_logits(model, ids)
        hidden = body(input_ids=ids).last_hidden_state[0].float()
        rebuilt = logit_map.head_logits(hidden, head.weight, head.bias)
    if own.shape != rebuilt.shape:
        raise refuse(f"the forward returns logits of shape {tuple(own.shape)}, the head {tuple(rebuilt.shape)}")
    error = float((own - rebuilt).abs().max() / own.abs().max().clamp_min(1.0))
    dtype = str(head.weight.dtype).removeprefix("torch.")
    tolerance = PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE_NARROW)
    if not error <= tolerance:
        declared = "none" if logit_map.is_identity else str(logit_map.as_record())
        raise refuse(
            f"after the head and the post-processing its config declares ({declared}) the logits differ from the "
            f"model's forward by {error:.3g} of their largest magnitude (tolerance {tolerance:g})"
        )
    return ModelHead(architecture, logit_map, head.bias is not None, error)
