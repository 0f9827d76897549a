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


def model_device(model: Any) -> Any:
    """The ``torch.device`` a model's weights are on (its first parameter's)."""
    return next(model.parameters()).device


def forward_logits(model: Any, ids: Any) -> Any:
    """``[T, V]`` float32 logits of ``ids`` (a ``[T]`` or ``[1, T]`` LongTensor, on any device: it is moved to the
    model's) from the model's own forward."""
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    return model(input_ids=ids.to(model_device(model))).logits[0].float()


def padded_forward_logits(model: Any, ids: Any, attention_mask: Any) -> Any:
    """``[B, T, V]`` float32 logits of a right-padded batch ``ids`` ``[B, T]`` from the model's own forward; a
    causal model's real positions equal those of ``forward_logits`` on each sequence alone, up to rounding."""
    return model(input_ids=ids, attention_mask=attention_mask).logits.float()


def next_token_logprobs(model: Any, ids: Any) -> Any:
    """``[T, V]`` float32 log-probabilities; row r is the distribution of the token after ``ids[r]``."""
    import torch

    return torch.log_softmax(forward_logits(model, ids), dim=-1)


def right_padded(sequences: list[Any], device: Any = None) -> tuple[Any, Any]:
    """``(ids, attention_mask)`` ``[B, longest]`` LongTensors on ``device`` (default: the CPU): each sequence from
    the left, then id 0 (never read: the mask excludes it)."""
    import torch

    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
        attention[i, : len(seq)] = 1
    if device is None:
        return ids, attention
    return ids.to(device), attention.to(device)
