"""The model's logits: what its own forward returns, the definition every log-probability in Kiln uses.

``forward_logits(model, ids)`` runs the model's forward on one sequence and returns ``[T, V]`` float32 logits
-- after everything the model applies past its head (Gemma's final soft-cap, Granite's logits scaling, Cohere's
logit scale, ...), because that is the model's own code. GRPO's policy and reference log-probabilities, OPD's
student logits and a local teacher's scores all come from it; ``next_token_logprobs`` is its log-softmax. SFT
reproduces the same logits from hidden states and the head (``kiln.training.model_head``), checked against this
function at admission.
"""

from __future__ import annotations

from typing import Any


def forward_logits(model: Any, ids: Any) -> Any:
    """``[T, V]`` float32 logits of ``ids`` (a ``[T]`` or ``[1, T]`` LongTensor) from the model's own forward."""
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    return model(input_ids=ids).logits[0].float()


def next_token_logprobs(model: Any, ids: Any) -> Any:
    """``[T, V]`` float32 log-probabilities; row r is the distribution of the token after ``ids[r]``."""
    import torch

    return torch.log_softmax(forward_logits(model, ids), dim=-1)
