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
* ``BatchedForwards``: a group's policy and reference forwards, ``micro_batch_size`` sequences at a time;
* the invariant forward (``kiln.model.Decoder``, what the sampler runs): ``invariant_decoder`` finds a model's,
  ``invariant_selected`` is ``selected_logits`` on it -- each sequence's rows its own forward's bits, the shared
  prompt run once (``Decoder.prefix``) with the same bits as the whole sequences' -- and ``invariant_logits`` one
  sequence's dense logits;
* the shared prompt (``prefix_sharing``): ``shared_length`` finds the tokens every sequence of a group starts with,
  ``run_prefix`` runs them once (``Prefix``: their hidden states and key/value cache) and ``selected_logits(...,
  prefix=)`` runs only each sequence's own suffix against that cache, expanded across the batch. The positions a loss
  reads inside the prompt come from the prompt's one forward, so the gradient through them accumulates from every
  sequence that reads them; ``prefix_problem`` proves at admission that a model's attention reproduces a full forward
  this way (``PrefixPlan``: which forwards share, or why not).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import DynamicCache

    from kiln.data import GrpoCompletion
    from kiln.training import ModelHead
    from kiln.training.grpo_objective import EmaReference


__all__ = [
    "BatchedForwards",
    "Prefix",
    "PrefixPlan",
    "ReferencePolicy",
    "SelectedLogits",
    "group_logprobs",
    "invariant_decoder",
    "invariant_group_logprobs",
    "invariant_logits",
    "invariant_selected",
    "logprobs",
    "plan_sharing",
    "prefix_problem",
    "run_prefix",
    "selected_logits",
    "shared_length",
]

PROBE_PROMPT, PROBE_SUFFIXES = 5, (3, 1)  # the cached-prefix probe: a 5-token prompt, two suffixes


@dataclass(frozen=True)
class PrefixPlan:
    """Which of a GRPO run's forwards run a group's shared prompt once (``policy``, ``reference``), from the
    configured ``mode``; ``reason``: why a forward that runs does not (None when nothing stops it)."""

    mode: str = "off"
    policy: bool = False
    reference: bool = False
    reason: str | None = "prefix_sharing is off"

    @property
    def any(self) -> bool:
        return self.policy or self.reference


@dataclass
class Prefix:
    """A prompt several sequences share, run once: its ``length``, its last hidden states ``[L, H]`` and the decoder's
    key/value cache of it (batch 1)."""

    length: int
    hidden: torch.Tensor
    cache: DynamicCache


def shared_length(sequences: Sequence[Sequence[int]]) -> int:
    """How many first tokens every sequence shares, leaving each at least one token of its own (0: none)."""
    first = sequences[0]
    limit = min(len(s) for s in sequences) - 1
    length = 0
    while length < limit and all(s[length] == first[length] for s in sequences):
        length += 1
    return length


def _decoder(model: Any) -> tuple[Any, Any]:
    """The decoder stack and the output head of a causal LM (or of its peft wrapper)."""
    from kiln.training import decoder_of

    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    return decoder_of(causal), causal.get_output_embeddings()


def run_prefix(model: Any, ids: Sequence[int]) -> Prefix:
    """The prompt ``ids`` through the decoder once (with gradient when autograd records), keeping its cache."""
    import torch

    body, _ = _decoder(model)
    out = body(input_ids=torch.tensor([list(ids)], dtype=torch.long, device=_device(body)), use_cache=True)
    return Prefix(len(ids), out.last_hidden_state[0], out.past_key_values)


def _expanded(cache: DynamicCache, batch: int) -> DynamicCache:
    """A fresh cache holding ``cache``'s keys and values (batch 1) for each of ``batch`` rows: expanded views, so the
    gradient of every row flows back into the one prompt forward."""
    from transformers import DynamicCache

    fresh = DynamicCache()
    for index, layer in enumerate(cache.layers):
        fresh.update(layer.keys.expand(batch, -1, -1, -1), layer.values.expand(batch, -1, -1, -1), index)
    return fresh


def prefix_problem(model: Any) -> str | None:
    """None when ``model``'s decoder, run on a prompt once and then on two suffixes against its cached keys and
    values, reproduces the hidden states of the whole sequences run in full; otherwise why not (one sentence)."""
    import torch

    architecture = type(model).__name__
    body, head = _decoder(model)
    if body is None or head is None:
        return f"{architecture}: no decoder stack Kiln can run from a cached prefix"
    vocab = int(head.weight.shape[0])
    prompt = [(5 * i + 2) % vocab for i in range(PROBE_PROMPT)]
    sequences = [prompt + [(11 * i + 7 * n) % vocab for i in range(n)] for n in PROBE_SUFFIXES]
    try:
        with torch.no_grad():
            ids, attention = _right_padded(sequences, _device(body))
            full = body(input_ids=ids, attention_mask=attention).last_hidden_state.float()
            prefix = run_prefix(model, prompt)
            split = _suffix_hidden(body, prefix, [s[PROBE_PROMPT:] for s in sequences])[0].float()
    except (AttributeError, TypeError, ValueError, RuntimeError, IndexError) as exc:
        return f"{architecture}: its decoder cannot run from a cached prefix ({type(exc).__name__}: {exc})"
    scale = max(float(full.abs().max()), 1.0)
    tolerance = 1e-4 if body.dtype == torch.float32 else 5e-2
    worst = 0.0
    for i, seq in enumerate(sequences):
        worst = max(worst, float((split[i, : len(seq) - PROBE_PROMPT] - full[i, PROBE_PROMPT : len(seq)]).abs().max()))
        worst = max(worst, float((prefix.hidden.float() - full[i, :PROBE_PROMPT]).abs().max()))
    if worst > tolerance * scale:
        return (
            f"{architecture}: a forward from a cached prefix moved the hidden states by {worst:.3g} "
            f"(above {tolerance:g} x {scale:.3g})"
        )
    return None


def plan_sharing(
    mode: str, model: Any, head: ModelHead | None, *, blockers: Sequence[str], reference: bool
) -> tuple[ModelHead | None, PrefixPlan]:
    """``(head, plan)`` under ``prefix_sharing`` ``mode``: off shares nothing; ``auto`` shares where it is proven to
    compute the same thing -- the model passes the cached-prefix probe (``prefix_problem``) and its head is
    reproducible (proven here when only sharing needs it) -- the policy (training) forward unless one of
    ``blockers`` (sentences: why it cannot) applies, the reference forward when ``reference`` (one runs)."""
    from kiln.errors import RequestError
    from kiln.training import model_head

    if mode == "off":
        return head, PrefixPlan()
    problem = prefix_problem(model)
    if problem is None and head is None:
        try:
            head = model_head(model)
        except RequestError as refused:
            problem = refused.message
    if problem is not None:
        return head, PrefixPlan(mode, reason=problem)
    return head, PrefixPlan(mode, policy=not blockers, reference=reference, reason="; ".join(blockers) or None)


def _device(module: Any) -> torch.device:
    """Where a module's weights are: every tensor a forward of it reads is made there."""
    return next(module.parameters()).device


def _right_padded(sequences: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    from kiln.model import right_padded

    ids, attention = right_padded([list(sequence) for sequence in sequences], device)
    return ids, attention


def _suffix_hidden(
    body: torch.nn.Module, prefix: Prefix, suffixes: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, int]:
    """``([B, W, H], W)``: the right-padded ``suffixes`` through the decoder after ``prefix``'s cached keys and values
    (positions from ``prefix.length`` on)."""
    import torch

    ids, attention = _right_padded(suffixes, _device(body))
    batch, width = ids.shape
    attention = torch.cat(
        [torch.ones((batch, prefix.length), dtype=attention.dtype, device=ids.device), attention], dim=1
    )
    positions = (prefix.length + torch.arange(width, device=ids.device)).unsqueeze(0).expand(batch, -1)
    hidden = body(
        input_ids=ids,
        attention_mask=attention,
        past_key_values=_expanded(prefix.cache, batch),
        position_ids=positions,
        use_cache=True,
    ).last_hidden_state
    return hidden, width


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
    model: Any,
    head: ModelHead | None,
    sequences: Sequence[Sequence[int]],
    wanted: Sequence[Sequence[bool]],
    *,
    prefix: Prefix | None = None,
) -> SelectedLogits:
    """The logits at the positions where ``wanted[i]`` (a bool ``[T_i - 1]``) is true, from one forward; with a
    ``prefix`` (the first ``prefix.length`` tokens of every sequence, already run) only the suffixes run, and the
    wanted positions inside the prompt read its hidden states."""
    import torch

    body, out = _decoder(model)
    if head is None:  # admission proves the head whenever a batch can hold several sequences
        raise AssertionError("a batched forward needs the model's head, proven at admission")
    device = _device(body)
    positions = [torch.as_tensor(w, dtype=torch.bool).nonzero().squeeze(1).to(device) for w in wanted]
    if prefix is None:
        ids, attention = _right_padded(sequences, device)
        width = ids.shape[1]
        hidden = body(input_ids=ids, attention_mask=attention).last_hidden_state
        flat = torch.cat([i * width + p for i, p in enumerate(positions)])
        targets = torch.cat([ids[i, p + 1] for i, p in enumerate(positions)])
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat).float()
        return SelectedLogits(head.logit_map.head_logits(rows, out.weight, out.bias), positions, targets)
    start = prefix.length
    suffix, width = _suffix_hidden(body, prefix, [list(s)[start:] for s in sequences])
    table = torch.cat([prefix.hidden, suffix.reshape(-1, suffix.shape[-1])])  # the prompt's rows, then the suffixes'
    flat = torch.cat([torch.where(p < start, p, start + i * width + p - start) for i, p in enumerate(positions)])
    targets = torch.cat(
        [
            torch.as_tensor(list(s), dtype=torch.long, device=device)[p + 1]
            for s, p in zip(sequences, positions, strict=True)
        ]
    )
    rows = table.index_select(0, flat).float()
    return SelectedLogits(head.logit_map.head_logits(rows, out.weight, out.bias), positions, targets)


def invariant_decoder(model: Any) -> Any:
    """The model's invariant forward (``kiln.model.decoder_for``: one per model object), or None without one."""
    from kiln.model import Unsupported, decoder_for

    try:
        return decoder_for(model)
    except Unsupported:
        return None


def invariant_logits(decoder: Any, ids: torch.Tensor) -> torch.Tensor:
    """``[T, V]`` float32 logits of one sequence ``ids`` (``[T]`` or ``[1, T]``) from the invariant forward."""
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    logits: torch.Tensor = decoder.logits(decoder.hidden(ids.to(decoder.device))[0])
    return logits


def invariant_selected(
    decoder: Any, sequences: Sequence[Sequence[int]], wanted: Sequence[Sequence[bool]], *, shared: int = 0
) -> SelectedLogits:
    """``selected_logits`` from the invariant forward: one right-padded forward, or with ``shared`` > 0 the
    sequences' first ``shared`` tokens once (``Decoder.prefix``) and each suffix after them -- either way each
    sequence's rows are the bits of its own whole forward (and of the sampler's draws)."""
    import torch

    device = decoder.device
    positions = [torch.as_tensor(w, dtype=torch.bool).nonzero().squeeze(1).to(device) for w in wanted]
    targets = torch.cat(
        [
            torch.as_tensor(list(s), dtype=torch.long, device=device)[p + 1]
            for s, p in zip(sequences, positions, strict=True)
        ]
    )
    if not shared:
        ids, _ = _right_padded(sequences, device)
        width = ids.shape[1]
        hidden = decoder.hidden(ids)
        flat = torch.cat([i * width + p for i, p in enumerate(positions)])
        rows = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat)
        return SelectedLogits(decoder.logits(rows), positions, targets)
    prompt = torch.tensor([list(sequences[0][:shared])], dtype=torch.long, device=device)
    head, past = decoder.prefix(prompt)
    suffix_ids, _ = _right_padded([list(s)[shared:] for s in sequences], device)
    width = suffix_ids.shape[1]
    suffix = decoder.hidden(suffix_ids, past=past)
    table = torch.cat([head[0], suffix.reshape(-1, suffix.shape[-1])])  # the prompt's rows, then the suffixes'
    flat = torch.cat([torch.where(p < shared, p, shared + i * width + p - shared) for i, p in enumerate(positions)])
    return SelectedLogits(decoder.logits(table.index_select(0, flat)), positions, targets)


def logprobs(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of every next token ``[T-1, V]`` and of the taken ones ``[T-1]``, from the model's own
    logits (``kiln.model.forward_logits``: after its soft-cap or scaling)."""
    import torch

    from kiln.model import forward_logits

    logits = forward_logits(model, ids)[:-1]
    ids = ids.to(logits.device)
    logp = torch.log_softmax(logits, dim=-1)
    return logp, logp.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)


def group_logprobs(
    model: Any,
    head: ModelHead | None,
    sequences: Sequence[Sequence[int]],
    wanted: Sequence[Sequence[bool]],
    *,
    entropy: bool = False,
    prefix: Prefix | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per sequence ``(taken [T-1], entropy [T-1] or None)`` from one right-padded forward of all of them.

    Only the positions where ``wanted[i]`` (a bool ``[T_i - 1]``) is true are computed; the others are 0 (the
    objective masks them). Row ``p`` is the distribution of token ``p + 1`` under the model's own logits: the head
    (and bias) and ``head.logit_map`` applied to the decoder's hidden states, in fp32."""
    import torch

    found = selected_logits(model, head, sequences, wanted, prefix=prefix)
    return per_sequence(found, sequences, torch.log_softmax(found.rows, dim=-1), entropy=entropy)


def invariant_group_logprobs(
    decoder: Any,
    sequences: Sequence[Sequence[int]],
    wanted: Sequence[Sequence[bool]],
    *,
    entropy: bool = False,
    shared: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """``group_logprobs`` from the invariant forward (``invariant_selected``) and its log-softmax: each taken
    log-probability is, bit for bit, the one the sampler recorded when it drew the token."""
    from kiln.kernels import invariant

    found = invariant_selected(decoder, sequences, wanted, shared=shared)
    return per_sequence(found, sequences, invariant.log_softmax(found.rows), entropy=entropy)


def per_sequence(
    found: SelectedLogits, sequences: Sequence[Sequence[int]], logp: torch.Tensor, *, entropy: bool
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The selected rows' log-probabilities ``logp`` as one ``(taken [T-1], entropy or None)`` per sequence, zero
    where nothing was selected."""
    import torch

    taken = logp.gather(1, found.targets.unsqueeze(1)).squeeze(1)
    spread = -(logp.exp() * logp).sum(-1) if entropy else None
    results, start = [], 0
    for seq, pos in zip(sequences, found.positions, strict=True):
        stop = start + pos.numel()
        zeros = torch.zeros(len(seq) - 1, dtype=taken.dtype, device=taken.device)
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
        self,
        head: ModelHead | None,
        sequences: Sequence[Sequence[int]],
        wanted: Sequence[Sequence[bool]],
        *,
        width: int | None = None,
        shared: int = 0,
        decoder: Any = None,
    ) -> list[torch.Tensor]:
        """The reference's taken log-probabilities of several sequences inside one ``disable_adapter()`` or one EMA
        swap: right-padded forwards (``group_logprobs``) of ``width`` sequences at a time (all at once when None);
        ``shared`` > 0 runs those first tokens, which every sequence shares, once (``run_prefix``). With a
        ``decoder`` the forwards are the invariant ones (``invariant_group_logprobs``)."""
        t0 = time.perf_counter()
        step = width or len(sequences)
        found: list[torch.Tensor] = []
        with self._as_reference():
            prefix = run_prefix(self.model, sequences[0][:shared]) if shared and decoder is None else None
            for start in range(0, len(sequences), step):
                some, marks = sequences[start : start + step], wanted[start : start + step]
                part = (
                    group_logprobs(self.model, head, some, marks, prefix=prefix)
                    if decoder is None
                    else invariant_group_logprobs(decoder, some, marks, shared=shared)
                )
                found.extend(taken for taken, _ in part)
        self.timings["reference_forward_ms"] += (time.perf_counter() - t0) * 1000
        return found


class BatchedForwards:
    """A group's forwards, ``width`` (``micro_batch_size``) completions at a time; width 1 leaves each completion
    to its own dense forward (``policy`` answers None for it, ``references`` calls the reference per completion).

    ``sharing`` (a ``PrefixPlan``): the forwards that run the group's shared prompt once (``run_prefix``), then
    ``width`` suffixes at a time against its cache -- also at width 1.

    ``decoder`` (the model's invariant forward, for rollouts Kiln's generator sampled): every forward -- policy and
    reference, at any width, shared or not -- runs it, so a recorded behaviour log-probability is recomputed bit
    for bit."""

    def __init__(
        self,
        model: Any,
        head: ModelHead | None,
        reference: ReferencePolicy,
        width: int,
        *,
        echo: bool,
        entropy: bool,
        sharing: PrefixPlan | None = None,
        decoder: Any = None,
    ) -> None:
        self.model, self.head, self.reference, self.width = model, head, reference, width
        self.echo, self.entropy = echo, entropy
        self.sharing = sharing or PrefixPlan()
        self.decoder = decoder

    def _batches(self, completions: Sequence[GrpoCompletion]) -> list[Sequence[GrpoCompletion]]:
        return [completions[i : i + self.width] for i in range(0, len(completions), self.width)]

    def _wanted(self, c: GrpoCompletion) -> list[bool]:
        """The positions a loss reads: the action targets, and ECHO's observation targets."""
        return [a or (self.echo and o) for a, o in zip(c.action_mask, c.observation_mask, strict=True)]

    def references(self, completions: Sequence[GrpoCompletion]) -> list[torch.Tensor | None]:
        import torch

        sequences = [c.input_ids for c in completions]
        shared = shared_length(sequences) if self.sharing.reference else 0
        if self.width == 1 and not shared and self.decoder is None:
            return [self.reference(torch.tensor(c.input_ids, dtype=torch.long)) for c in completions]
        # one adapter switch (or EMA swap) for the group: its prompt once when shared, then width sequences at a time
        wanted = [self._wanted(c) for c in completions]
        return list(
            self.reference.group(self.head, sequences, wanted, width=self.width, shared=shared, decoder=self.decoder)
        )

    def policy(
        self, completions: Sequence[GrpoCompletion], timings: dict[str, float]
    ) -> list[tuple[torch.Tensor, torch.Tensor | None] | None]:
        """Per completion ``(taken, entropy)`` with gradient, or None when each runs its own forward (width 1)."""
        shared = shared_length([c.input_ids for c in completions]) if self.sharing.policy else 0
        if self.decoder is not None:
            t0 = time.perf_counter()
            rows: list[tuple[torch.Tensor, torch.Tensor | None] | None] = []
            for part in self._batches(completions):
                rows.extend(
                    invariant_group_logprobs(
                        self.decoder,
                        [c.input_ids for c in part],
                        [self._wanted(c) for c in part],
                        entropy=self.entropy,
                        shared=shared,
                    )
                )
            timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
            return rows
        if self.width == 1 and not shared:
            return [None] * len(completions)
        t0 = time.perf_counter()
        prefix = run_prefix(self.model, completions[0].input_ids[:shared]) if shared else None
        found: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [
            row
            for part in self._batches(completions)
            for row in group_logprobs(
                self.model,
                self.head,
                [c.input_ids for c in part],
                [self._wanted(c) for c in part],
                entropy=self.entropy,
                prefix=prefix,
            )
        ]
        timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
        return found
