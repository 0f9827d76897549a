"""Portable draws: the token each row of a batch takes from its logits, the same token for the same logits on any
device, computed where the logits are, with one host read for the whole batch.

The rule, per row, on float32 logits ``z`` (``Sampling`` holds the row's settings):

1. the repetition penalty on the ids the row has seen (prompt and output): ``z / p`` where ``z > 0``, else
   ``z · p``, in float64, clamped to +-3e38, rounded to float32;
2. before ``min_tokens`` tokens, the stop ids are -inf (unless that would leave no id);
3. temperature 0 -- or a row whose largest logit, or largest logit over the temperature, is not finite -- takes the
   first maximum (greedy);
4. otherwise ``s = z / temperature``; ``top_k`` keeps the k largest (ties: the lower id first); ``e = exp(s -
   max s)`` (Kiln's exact ``exp``), ``p = e / sum(e)`` (``tree_sum``); ``top_p`` keeps, in the order of a stable
   descending sort of ``p``, the ids whose preceding mass is below ``top_p`` (the first always); ``min_p`` keeps
   ``e >= min_p`` (``p >= min_p · max p``);
5. the token by the inverse of the kept mass's cumulative distribution in two stages -- a block of ``BLOCK`` ids,
   then an id inside it -- with two uniforms ``u1, u2`` in (0, 1): the block is the first whose inclusive
   cumulative mass (over blocks, ``prefix_sum``) exceeds ``u1 · total``; the id the first in the block whose
   inclusive cumulative mass exceeds ``u2 · block mass`` (float64 products, compared exactly); rounding that
   leaves no such id takes the block's last id with mass. Two stages sample exactly ``p``: a block with
   probability ``mass / total``, an id in it with probability ``p / mass``.

The uniforms are a function of ``(seed, sequence, position)`` alone -- ``DrawKey.uniforms``: splitmix64 on Python
integers, so no random generator's state exists to save or restore, on any device: a sequence resumed at any
position draws what it would have drawn. Every step above is an IEEE-754 basic operation, an exact comparison,
select, sort (stable) or first-maximum, or Kiln's fixed-order ``exp``, ``tree_sum`` and ``prefix_sum``: nothing
depends on the device's own ``exp``, reduction order or random engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import torch

from kiln.kernels import exact
from kiln.model._sampling import Sampling

__all__ = ["BLOCK", "DrawKey", "draw_tokens", "next_tokens", "penalised"]

BLOCK = 1024
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclasses.dataclass(frozen=True)
class DrawKey:
    """Where a draw sits: the sequence's ``seed`` and ``sequence`` number and the ``position`` of the token being
    drawn (0 for a sequence's first generated token)."""

    seed: int
    sequence: int
    position: int

    def uniforms(self) -> tuple[float, float]:
        """Two uniforms in (0, 1), each a multiple of 2**-53 plus 2**-54, from splitmix64 of the key."""
        state = _splitmix64(self.seed & _MASK64)
        state = _splitmix64(state ^ (self.sequence & _MASK64))
        state = _splitmix64(state ^ (self.position & _MASK64))
        second = _splitmix64(state)
        return ((state >> 11) + 0.5) * 2.0**-53, ((second >> 11) + 0.5) * 2.0**-53


def penalised(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """Step 1 of the rule: ``logits`` ``[B, V]`` with the repetition penalty ``penalty`` ``[B]`` (1: none) applied
    to the ids ``seen`` (a bool ``[B, V]``)."""
    wide = logits.double()
    factor = penalty.double().unsqueeze(1)
    adjusted = torch.where(wide > 0, wide / factor, wide * factor).clamp(-3.0e38, 3.0e38).float()
    return torch.where(seen & (penalty != 1).unsqueeze(1), adjusted, logits)


def _first_max(values: torch.Tensor) -> torch.Tensor:
    return torch.argmax(values, dim=-1)


def draw_tokens(
    logits: torch.Tensor,
    *,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
    keys: Sequence[DrawKey],
    held: torch.Tensor | None = None,
) -> torch.Tensor:
    """Steps 2-5 of the rule for each row of ``logits`` ``[B, V]`` (float32, penalties applied): the tokens, a
    LongTensor ``[B]`` on the logits' device. ``held`` (bool ``[B, V]``) marks ids held back (stop ids before
    ``min_tokens``); a row where it would hold back every id is left as it is."""
    rows, vocab = logits.shape
    device = logits.device
    if held is not None:
        keep_some = ~held.all(-1, keepdim=True)
        logits = torch.where(held & keep_some, -torch.inf, logits)
    greedy = _first_max(logits)
    temps = torch.tensor(temperature, dtype=torch.float32, device=device)
    sampled_rows = [r for r, t in enumerate(temperature) if t != 0]
    if not sampled_rows:
        return greedy
    top = logits.amax(-1)
    safe = torch.where(temps == 0, 1.0, temps).unsqueeze(1)
    scaled = logits / safe
    scaled_top = scaled.amax(-1)
    use_greedy = (temps == 0) | ~torch.isfinite(top) | ~torch.isfinite(scaled_top)
    keep = torch.ones_like(logits, dtype=torch.bool)
    ks = torch.tensor(top_k, dtype=torch.long, device=device)
    if any(0 < k < vocab for k in top_k):
        _, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        ranks = torch.empty_like(order).scatter_(1, order, torch.arange(vocab, device=device).expand(rows, -1))
        limited = (ks > 0) & (ks < vocab)
        keep = keep & (~limited.unsqueeze(1) | (ranks < ks.unsqueeze(1)))
    shifted = torch.where(
        keep, scaled - torch.where(torch.isfinite(scaled_top), scaled_top, 0.0).unsqueeze(1), -torch.inf
    )
    e = exact.exp(shifted)
    if any(p < 1 for p in top_p):
        total = exact.tree_sum(e)
        p = e / torch.where(total > 0, total, 1.0).unsqueeze(1)
        ordered, order = torch.sort(p, dim=-1, descending=True, stable=True)
        before = exact.prefix_sum(ordered) - ordered
        tops = torch.tensor(top_p, dtype=torch.float32, device=device).unsqueeze(1)
        nucleus = (before < tops) | (torch.arange(vocab, device=device) == 0)
        nucleus = torch.empty_like(nucleus).scatter_(1, order, nucleus)
        keep = keep & (nucleus | (tops >= 1))
    if any(m > 0 for m in min_p):
        floors = torch.tensor(min_p, dtype=torch.float32, device=device).unsqueeze(1)
        keep = keep & ((floors <= 0) | (e >= floors))
    mass = torch.where(keep, e, 0.0)
    chosen = _inverse_cdf(mass, keys)
    return torch.where(use_greedy, greedy, chosen)


def _inverse_cdf(mass: torch.Tensor, keys: Sequence[DrawKey]) -> torch.Tensor:
    """Step 5: per row, an id with probability proportional to ``mass`` (non-negative, some positive)."""
    rows, vocab = mass.shape
    device = mass.device
    blocks = -(-vocab // BLOCK)
    padded = torch.nn.functional.pad(mass, (0, blocks * BLOCK - vocab)).view(rows, blocks, BLOCK)
    block_mass = exact.tree_sum(padded)  # [rows, blocks]
    uniforms = torch.tensor([key.uniforms() for key in keys], dtype=torch.float64, device=device)
    block = _first_above(exact.prefix_sum(block_mass), uniforms[:, 0])
    inside = padded[torch.arange(rows, device=device), block]  # [rows, BLOCK]
    offset = _first_above(exact.prefix_sum(inside), uniforms[:, 1])
    return block * BLOCK + offset


def _first_above(cumulative: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose inclusive cumulative mass exceeds ``u`` times the row's total (the last
    entry); the last index with mass when rounding leaves none."""
    total = cumulative[:, -1:].double()
    target = u.unsqueeze(1) * total
    above = cumulative.double() > target
    width = cumulative.shape[1]
    index = torch.arange(width, device=cumulative.device).expand_as(cumulative)
    first = torch.where(above, index, width).amin(-1)
    positive = torch.cat([cumulative[:, :1] > 0, cumulative[:, 1:] > cumulative[:, :-1]], dim=-1)
    last = torch.where(positive, index, -1).amax(-1).clamp_min(0)
    return torch.where(first < width, first, last)


def next_tokens(
    logits: torch.Tensor,
    samplings: Sequence[Sampling],
    keys: Sequence[DrawKey],
    *,
    seen: torch.Tensor | None = None,
    produced: Sequence[int] | None = None,
    stop_ids: Collection[int] = (),
) -> torch.Tensor:
    """The whole rule for a batch: each row of ``logits`` ``[B, V]`` (float32) under its ``Sampling`` and
    ``DrawKey``; ``seen`` (bool ``[B, V]``) the ids each row's repetition penalty applies to, ``produced`` how many
    tokens each row generated (what ``min_tokens`` counts against ``stop_ids``). A LongTensor ``[B]`` on the
    logits' device."""
    rows, vocab = logits.shape
    device = logits.device
    penalties = [s.repetition_penalty for s in samplings]
    if seen is not None and any(p != 1 for p in penalties):
        logits = penalised(logits, seen, torch.tensor(penalties, dtype=torch.float64, device=device))
    held = None
    counts = produced if produced is not None else [0] * rows
    early = [count < s.min_tokens for s, count in zip(samplings, counts, strict=True)]
    ids = [i for i in stop_ids if 0 <= i < vocab]
    if ids and any(early):
        stops = torch.zeros(vocab, dtype=torch.bool, device=device)
        stops[torch.tensor(ids, dtype=torch.long, device=device)] = True
        held = torch.tensor(early, dtype=torch.bool, device=device).unsqueeze(1) & stops.unsqueeze(0)
    return draw_tokens(
        logits,
        temperature=[s.temperature for s in samplings],
        top_k=[s.top_k for s in samplings],
        top_p=[s.top_p for s in samplings],
        min_p=[s.min_p for s in samplings],
        keys=keys,
        held=held,
    )
