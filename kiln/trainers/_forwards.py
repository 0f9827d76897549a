"""Batched forwards shared by the trainers: several sequences right-padded into one forward of the decoder, the
model's logits computed only at the positions a loss reads.

``selected_logits(model, head, sequences, wanted)`` runs the decoder once over the right-padded batch (an attention
mask marks the real tokens; a causal model's real positions never see the padding after them) and applies the
model's head -- its bias and ``head.logit_map``, the post-processing ``kiln.training.model_head`` proved at
admission -- to the hidden states of the wanted positions only, in fp32. Row ``p`` of a sequence is the
distribution of its token ``p + 1``, exactly as ``kiln.model.forward_logits`` would give it, up to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SelectedLogits", "selected_logits"]


@dataclass
class SelectedLogits:
    """``rows`` ``[sum of A_i, V]`` fp32 logits, sequence after sequence; ``positions[i]`` the A_i positions of
    sequence i (a LongTensor); ``targets`` the token each row predicts (``ids[p + 1]``)."""

    rows: Any
    positions: list[Any]
    targets: Any

    def split(self, values: Any) -> list[Any]:
        """``values`` (one per row) cut back into one tensor per sequence."""
        out, start = [], 0
        for pos in self.positions:
            out.append(values[start : start + pos.numel()])
            start += pos.numel()
        return out


def selected_logits(model: Any, head: Any, sequences: list[Any], wanted: list[Any]) -> SelectedLogits:
    """The logits at the positions where ``wanted[i]`` (a bool ``[T_i - 1]``) is true, from one forward."""
    import torch

    from kiln.model import right_padded
    from kiln.training import decoder_of

    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    body, out = decoder_of(causal), causal.get_output_embeddings()
    ids, attention = right_padded(sequences)
    width = ids.shape[1]
    hidden = body(input_ids=ids, attention_mask=attention).last_hidden_state
    positions = [torch.as_tensor(w, dtype=torch.bool).nonzero().squeeze(1) for w in wanted]
    flat = torch.cat([i * width + p for i, p in enumerate(positions)])
    targets = torch.cat([ids[i, p + 1] for i, p in enumerate(positions)])
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat).float()
    return SelectedLogits(head.logit_map.head_logits(rows, out.weight, out.bias), positions, targets)
