"""The policy and reference forwards of the trainers that score sequences (GRPO, OPD): several sequences
right-padded into one forward of the decoder, the model's logits computed only at the positions a loss reads.

* ``selected_logits(model, head, sequences, wanted)`` runs the decoder once over the right-padded batch (an attention
  mask marks the real tokens; a causal model's real positions never see the padding after them) and applies the
  model's head -- its bias and ``head.logit_map``, the post-processing ``kiln.training.model_head`` proved at
  admission -- to the hidden states of the wanted positions only, in fp32. Row ``p`` of a sequence is the
  distribution of its token ``p + 1``, exactly as ``kiln.model.forward_logits`` would give it, up to rounding;
* ``logprobs``: one sequence's dense log-probabilities and those of its taken tokens; ``group_logprobs``: several
  sequences' taken log-probabilities (and entropies) from one ``selected_logits`` forward;
* ``ReferencePolicy``: a KL reference's log-probabilities of the taken tokens -- the frozen base (the adapter
  disabled for one forward) or the EMA of the LoRA tensors (swapped in for one forward, then back);
* ``BatchedForwards``: a group's policy and reference forwards, ``micro_batch_size`` sequences at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from kiln.data import GrpoCompletion
    from kiln.training import ModelHead
    from kiln.training.grpo_objective import EmaReference


__all__ = ["BatchedForwards", "ReferencePolicy", "SelectedLogits", "group_logprobs", "logprobs", "selected_logits"]


@dataclass
class SelectedLogits:
    """``rows`` ``[sum of A_i, V]`` fp32 logits, sequence after sequence; ``positions[i]`` the A_i positions of
    sequence i (a LongTensor); ``targets`` the token each row predicts (``ids[p + 1]``)."""

    rows: torch.Tensor
    positions: list[torch.Tensor]
    targets: torch.Tensor

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """``values`` (one per row) cut back into one tensor per sequence."""
        out, start = [], 0
        for pos in self.positions:
            out.append(values[start : start + pos.numel()])
            start += pos.numel()
        return out


def selected_logits(
    model: Any, head: ModelHead | None, sequences: Sequence[Sequence[int]], wanted: Sequence[Sequence[bool]]
) -> SelectedLogits:
    """The logits at the positions where ``wanted[i]`` (a bool ``[T_i - 1]``) is true, from one forward."""
    import torch

    from kiln.model import right_padded
    from kiln.training import decoder_of

    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    body, out = decoder_of(causal), causal.get_output_embeddings()
    ids, attention = right_padded([list(sequence) for sequence in sequences])
    width = ids.shape[1]
    hidden = body(input_ids=ids, attention_mask=attention).last_hidden_state
    positions = [torch.as_tensor(w, dtype=torch.bool).nonzero().squeeze(1) for w in wanted]
    flat = torch.cat([i * width + p for i, p in enumerate(positions)])
    targets = torch.cat([ids[i, p + 1] for i, p in enumerate(positions)])
    rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat).float()
    if head is None:  # admission proves the head whenever a batch can hold several sequences
        raise AssertionError("a batched forward needs the model's head, proven at admission")
    return SelectedLogits(head.logit_map.head_logits(rows, out.weight, out.bias), positions, targets)


def logprobs(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of every next token ``[T-1, V]`` and of the taken ones ``[T-1]``, from the model's own
    logits (``kiln.model.forward_logits``: after its soft-cap or scaling)."""
    import torch

    from kiln.model import forward_logits

    logits = forward_logits(model, ids)[:-1]
    logp = torch.log_softmax(logits, dim=-1)
    return logp, logp.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)


def group_logprobs(
    model: Any,
    head: ModelHead | None,
    sequences: Sequence[Sequence[int]],
    wanted: Sequence[Sequence[bool]],
    *,
    entropy: bool = False,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per sequence ``(taken [T-1], entropy [T-1] or None)`` from one right-padded forward of all of them.

    Only the positions where ``wanted[i]`` (a bool ``[T_i - 1]``) is true are computed; the others are 0 (the
    objective masks them). Row ``p`` is the distribution of token ``p + 1`` under the model's own logits: the head
    (and bias) and ``head.logit_map`` applied to the decoder's hidden states, in fp32."""
    import torch

    found = selected_logits(model, head, sequences, wanted)
    positions, targets = found.positions, found.targets
    logp = torch.log_softmax(found.rows, dim=-1)
    taken = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    spread = -(logp.exp() * logp).sum(-1) if entropy else None
    results, start = [], 0
    for seq, pos in zip(sequences, positions, strict=True):
        stop = start + pos.numel()
        zeros = torch.zeros(len(seq) - 1, dtype=taken.dtype)
        row = zeros.index_put((pos,), taken[start:stop])
        results.append((row, None if spread is None else zeros.index_put((pos,), spread[start:stop].detach())))
        start = stop
    return results


class ReferencePolicy:
    """``reference(ids)``: the reference's log-probabilities of the taken tokens of ``ids`` (no gradient).

    Call it before the policy forward of the same step: an EMA reference is swapped into the LoRA tensors, which
    must not happen between a policy forward and its backward."""

    def __init__(
        self, model: Any, params: dict[str, torch.nn.Parameter], ema: EmaReference | None, timings: dict[str, float]
    ) -> None:
        self.model, self.params, self.ema, self.timings = model, params, ema, timings

    @contextmanager
    def _as_reference(self) -> Iterator[None]:
        """No gradient, and the reference in place: the adapter disabled, or the EMA tensors swapped in."""
        import torch

        with torch.no_grad():
            if self.ema is None:  # base_per_step: the frozen base model
                with self.model.disable_adapter():
                    yield
                return
            saved = {n: p.detach().clone() for n, p in self.params.items()}  # ema: the averaged LoRA tensors
            for name, tensor in self.ema.tensors.items():
                self.params[name].copy_(tensor)
            try:
                yield
            finally:
                for name, tensor in saved.items():
                    self.params[name].copy_(tensor)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        with self._as_reference():
            _, taken = logprobs(self.model, ids)
        self.timings["reference_forward_ms"] += (time.perf_counter() - t0) * 1000
        return taken

    def group(
        self, head: ModelHead | None, sequences: Sequence[Sequence[int]], wanted: Sequence[Sequence[bool]]
    ) -> list[torch.Tensor]:
        """The reference's taken log-probabilities of several sequences: one batched forward (``group_logprobs``)
        inside one ``disable_adapter()`` or one EMA swap."""
        t0 = time.perf_counter()
        with self._as_reference():
            found = group_logprobs(self.model, head, sequences, wanted)
        self.timings["reference_forward_ms"] += (time.perf_counter() - t0) * 1000
        return [taken for taken, _ in found]


class BatchedForwards:
    """A group's forwards, ``width`` (``micro_batch_size``) completions at a time; width 1 leaves each completion
    to its own dense forward (``policy`` answers None for it, ``references`` calls the reference per completion)."""

    def __init__(
        self, model: Any, head: ModelHead | None, reference: ReferencePolicy, width: int, *, echo: bool, entropy: bool
    ) -> None:
        self.model, self.head, self.reference, self.width = model, head, reference, width
        self.echo, self.entropy = echo, entropy

    def _batches(self, completions: Sequence[GrpoCompletion]) -> list[Sequence[GrpoCompletion]]:
        return [completions[i : i + self.width] for i in range(0, len(completions), self.width)]

    def _wanted(self, c: GrpoCompletion) -> list[bool]:
        """The positions a loss reads: the action targets, and ECHO's observation targets."""
        return [a or (self.echo and o) for a, o in zip(c.action_mask, c.observation_mask, strict=True)]

    def references(self, completions: Sequence[GrpoCompletion]) -> list[torch.Tensor | None]:
        import torch

        if self.width == 1:
            return [self.reference(torch.tensor(c.input_ids, dtype=torch.long)) for c in completions]
        return [
            taken
            for part in self._batches(completions)
            for taken in self.reference.group(self.head, [c.input_ids for c in part], [self._wanted(c) for c in part])
        ]

    def policy(
        self, completions: Sequence[GrpoCompletion], timings: dict[str, float]
    ) -> list[tuple[torch.Tensor, torch.Tensor | None] | None]:
        """Per completion ``(taken, entropy)`` with gradient, or None when each runs its own forward (width 1)."""
        if self.width == 1:
            return [None] * len(completions)
        t0 = time.perf_counter()
        found: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [
            row
            for part in self._batches(completions)
            for row in group_logprobs(
                self.model,
                self.head,
                [c.input_ids for c in part],
                [self._wanted(c) for c in part],
                entropy=self.entropy,
            )
        ]
        timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
        return found
