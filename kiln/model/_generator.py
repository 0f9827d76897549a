"""The one batched decoder: rows that join, step and leave over one model -- the server's sequences, evaluation
answers and OPD's student rollouts all decode here.

With the model's invariant forward (``Decoder.of``), every step is one forward for every row: each row at its own
position, with its own LoRA weights (``RowLoras``), its keys and values in its own slot of one ``KVCache``. A
joining group of prompts is one right-padded prefill (prompts that are equal, with equal weights, run once and
their rows copy the cache). A row's logits are then the same bits whoever shares its steps, and the same as the
training forward's at that position (``kiln.model._decoder``).

A model without one (``Unsupported``: the reason is ``fallback``) decodes each row alone through the model's own
forward, with a cache of its own: still the same bits whoever shares the step -- nobody does -- but not the
training forward's, and one forward per row.

``Batch`` is not thread-safe: its caller serialises calls (the server's scheduler holds the model lock). It runs
under ``torch.inference_mode`` (decoding records no graph): its logits are inference tensors.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import weakref
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch

from kiln.model._cache import KVCache
from kiln.model._decoder import Decoder, RowLoras, Unsupported
from kiln.model._draw import DrawKey, next_tokens
from kiln.model._sampling import Sampling

__all__ = [
    "Batch",
    "Decoded",
    "LoraLayers",
    "batch_logprobs",
    "decode",
    "decoder_for",
    "generation_backend",
    "lora_hooks",
    "sequence_logprobs",
]

LoraLayers = Mapping[str, tuple[torch.Tensor, torch.Tensor, float]]  # module path -> (A [r, in], B [out, r], scale)

_DECODERS: weakref.WeakKeyDictionary[Any, Decoder | Unsupported] = weakref.WeakKeyDictionary()


def decoder_for(model: Any) -> Decoder:
    """The invariant forward of ``model``, built and proven once per model object; ``Unsupported`` (the same
    reason each time) when it has none."""
    found = _DECODERS.get(model)
    if found is None:
        try:
            found = Decoder.of(model)
        except Unsupported as refused:
            found = refused
        _DECODERS[model] = found
    if isinstance(found, Unsupported):
        raise Unsupported(str(found))
    return found


def generation_backend(model: Any) -> str:
    """What decodes ``model`` (recorded with every rollout it samples): the invariant forward and its
    implementation -- a trainer's forward of the same weights recomputes its log-probabilities bit for bit -- or
    ``kiln.model-forward`` (each row alone through the model's own forward) for a family without one."""
    from kiln.kernels import invariant

    try:
        decoder_for(model)
    except Unsupported:
        return "kiln.model-forward"
    return f"kiln.invariant-forward: {invariant.IMPLEMENTATION}"


def sequence_logprobs(model: Any, ids: Sequence[int], lora: LoraLayers | None = None) -> torch.Tensor:
    """``[len(ids), V]`` float32 log-probabilities of one sequence (row p: the distribution of the token after
    ``ids[p]``), from one forward under the caller's grad mode: the invariant forward (``kiln.kernels``'
    ``log_softmax`` of ``Decoder.logits``) -- what a sampled row's draws and a trainer's recomputation read --,
    or the model's own forward and ``torch.log_softmax`` when it has none. ``lora``: a LoRA added to the model's
    weights for this forward."""
    return batch_logprobs(model, [ids], lora)[0]


def batch_logprobs(
    model: Any, sequences: Sequence[Sequence[int]], lora: LoraLayers | None = None
) -> list[torch.Tensor]:
    """``sequence_logprobs`` of each sequence, from one right-padded forward: with the invariant forward each
    sequence's rows are its own forward's bits; with the model's own forward (it has no invariant one), equal up
    to rounding."""
    from kiln.kernels import invariant

    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for r, sequence in enumerate(sequences):
        ids[r, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
        mask[r, : len(sequence)] = 1
    ids, mask = ids.to(device), mask.to(device)
    try:
        decoder = decoder_for(model)
    except Unsupported:
        with lora_hooks(model, lora):
            logits = model(input_ids=ids, attention_mask=mask if len(sequences) > 1 else None).logits.float()
        return [torch.log_softmax(logits[r, : len(s)], dim=-1) for r, s in enumerate(sequences)]
    loras = RowLoras([dict(lora)] * len(sequences)) if lora else None
    hidden = decoder.hidden(ids, loras=loras)
    return [invariant.log_softmax(decoder.logits(hidden[r, : len(s)])) for r, s in enumerate(sequences)]


@contextlib.contextmanager
def lora_hooks(model: Any, layers: LoraLayers | None) -> Iterator[None]:
    """``layers`` added to ``model``'s own forward for the length of the block: each named module's output gets
    ``B(A(x)) * scale`` as peft adds it (``x`` cast to the LoRA's dtype, the sum cast back). Only on the module
    the hook was registered on: a deep copy of the model taken meanwhile is never adapted."""
    if not layers:
        yield
        return
    handles = [
        model.get_submodule(path).register_forward_hook(_lora_hook(model.get_submodule(path), *layer), with_kwargs=True)
        for path, layer in layers.items()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _lora_hook(module: Any, a: torch.Tensor, b: torch.Tensor, scale: float) -> Any:
    def hook(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if target is not module:
            return None
        x = (args[0] if args else kwargs["input"]).to(a.dtype)
        delta = torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)
        return (output + delta * scale).to(output.dtype)

    return hook


Key = TypeVar("Key", bound=Hashable)


@dataclasses.dataclass
class _Row(Generic[Key]):
    key: Key
    length: int  # positions in the cache
    lora: LoraLayers | None
    alone: Any = None  # the row's own transformers cache (fallback)


class Batch(Generic[Key]):
    """Rows decoding over ``model``; ``join`` and ``retain`` between ``step``s. Rows are any hashable keys."""

    def __init__(self, model: Any):
        self.model = model
        self.fallback: str | None = None
        self.decoder: Decoder | None = None
        try:
            self.decoder = decoder_for(model)
        except Unsupported as refused:
            self.fallback = str(refused)
        self._rows: list[_Row[Key]] = []
        self._cache: KVCache | None = self.decoder.new_cache() if self.decoder is not None else None

    @property
    def rows(self) -> list[Key]:
        """The keys, in step order."""
        return [row.key for row in self._rows]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def lengths(self) -> list[int]:
        return [row.length for row in self._rows]

    @torch.inference_mode()
    def join(self, entries: Sequence[tuple[Key, Sequence[int], LoraLayers | None]]) -> torch.Tensor:
        """Rows ``(key, prompt, lora)`` join: their prompts' forward (equal prompts with the same ``lora`` object
        run once). Returns the float32 logits ``[len(entries), V]`` after each prompt's last token."""
        if not entries:
            return torch.empty((0, 0))
        source: list[int] = []  # per entry, the index of the first entry with its prompt and weights
        distinct: list[int] = []
        seen: dict[tuple[tuple[int, ...], int], int] = {}
        for i, (_, prompt, lora) in enumerate(entries):
            first = seen.setdefault((tuple(prompt), id(lora)), i)
            source.append(first)
            if first == i:
                distinct.append(i)
        if self.decoder is None:
            return self._join_alone(entries, source)
        decoder, cache = self.decoder, self._cache
        assert cache is not None
        start = len(self._rows)
        prompts = [list(entries[i][1]) for i in distinct]
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, prompt in enumerate(prompts):
            ids[r, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        cache.reserve(start + len(entries), width)
        for slot in range(start, start + len(distinct)):
            cache.clear(slot)
        loras = RowLoras([dict(entries[i][2] or {}) for i in distinct])
        hidden = decoder.hidden(ids.to(self.device), cache=cache, first_slot=start, loras=loras)
        last = torch.tensor([len(p) - 1 for p in prompts], device=hidden.device)
        logits = decoder.logits(hidden[torch.arange(len(prompts), device=hidden.device), last])
        # the distinct prompts hold slots start.., in order; each repeat takes the next slot, a copy of its first's
        slot_of = {i: start + j for j, i in enumerate(distinct)}
        for i in range(len(entries)):
            if source[i] != i:
                slot_of[i] = start + len(slot_of)
                cache.copy(slot_of[source[i]], [slot_of[i]])
        for i in sorted(range(len(entries)), key=slot_of.__getitem__):
            key, prompt, lora = entries[i]
            self._rows.append(_Row(key, len(prompt), lora))
        position = {i: j for j, i in enumerate(distinct)}
        return logits[torch.tensor([position[source[i]] for i in range(len(entries))], device=logits.device)]

    def _join_alone(
        self, entries: Sequence[tuple[Key, Sequence[int], LoraLayers | None]], source: list[int]
    ) -> torch.Tensor:
        shared: dict[int, tuple[Any, torch.Tensor]] = {}
        out = []
        for i, (key, prompt, lora) in enumerate(entries):
            if source[i] not in shared:
                with lora_hooks(self.model, lora):
                    result = self.model(input_ids=torch.tensor([list(prompt)], device=self.device), use_cache=True)
                shared[source[i]] = (result.past_key_values, result.logits[0, -1].float())
            cache, logits = shared[source[i]]
            self._rows.append(_Row(key, len(prompt), lora, copy.deepcopy(cache)))
            out.append(logits)
        return torch.stack(out)

    @torch.inference_mode()
    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """One step: ``tokens[r]`` is fed to row r at its next position; returns the float32 logits ``[B, V]``."""
        if self.decoder is None:
            return torch.stack([self._step_alone(row, token) for row, token in zip(self._rows, tokens, strict=True)])
        decoder, cache = self.decoder, self._cache
        assert cache is not None
        device = self.device
        ids = torch.tensor([[t] for t in tokens], dtype=torch.long, device=device)
        positions = torch.tensor([[row.length] for row in self._rows], dtype=torch.long, device=device)
        loras = RowLoras([dict(row.lora or {}) for row in self._rows])
        hidden = decoder.hidden(ids, positions, cache=cache, first_slot=0, loras=loras)
        for row in self._rows:
            row.length += 1
        return decoder.logits(hidden[:, 0])

    def _step_alone(self, row: _Row[Key], token: int) -> torch.Tensor:
        with lora_hooks(self.model, row.lora):
            result = self.model(
                input_ids=torch.tensor([[token]], device=self.device), past_key_values=row.alone, use_cache=True
            )
        row.alone = result.past_key_values
        row.length += 1
        return result.logits[0, -1].float()

    @torch.inference_mode()
    def retain(self, keep: set[Key]) -> None:
        """Drop every row whose key is not in ``keep`` (the last rows move into the freed slots)."""
        index = 0
        while index < len(self._rows):
            if self._rows[index].key in keep:
                index += 1
                continue
            last = len(self._rows) - 1
            if index != last and self._cache is not None:
                self._cache.move(last, index)
            self._rows[index] = self._rows[last]
            self._rows.pop()


@dataclasses.dataclass
class Decoded:
    """One decoded sequence: the sampled ``ids`` (a sampled stop id kept, last), whether ``max_new`` rather than a
    stop id ended it, and, when asked for, the log-probability of each sampled id under the logits it was drawn
    from (the invariant log-softmax: what a trainer's forward of the same sequence recomputes, bit for bit)."""

    ids: list[int]
    truncated: bool
    logprobs: list[float] | None = None


def decode(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new: Sequence[int],
    sampling: Sampling,
    seed: int | Sequence[int],
    sequences: Sequence[int],
    stop_ids: frozenset[int],
    logprobs: bool = False,
) -> list[Decoded]:
    """Each prompt decoded until a stop id or its ``max_new`` tokens, every row in one ``Batch`` (one forward per
    step); row i's draws are keyed ``DrawKey(seed, sequences[i], position)`` (``seed[i]`` when ``seed`` is one per
    row) -- so a row samples the same tokens whichever rows decode beside it. Each step reads its tokens (and flags, log-probabilities) to the host once.
    Non-finite logits raise ``FloatingPointError`` naming how many tokens the row had."""
    from kiln.kernels import invariant

    out = [Decoded([], limit > 0, [] if logprobs else None) for limit in max_new]
    seeds = [seed] * len(prompts) if isinstance(seed, int) else list(seed)
    live = [i for i, limit in enumerate(max_new) if limit > 0]
    if not live:
        return out
    batch: Batch[int] = Batch(model)
    logits = batch.join([(i, prompts[i], None) for i in live])
    with torch.inference_mode():
        while live:
            keys = [DrawKey(seeds[i], sequences[i], len(out[i].ids)) for i in live]
            tokens = next_tokens(logits, [sampling] * len(live), keys)
            parts = [tokens.double(), torch.isfinite(logits).all(-1).double()]
            if logprobs:
                scores = invariant.log_softmax(logits).gather(1, tokens.unsqueeze(1)).squeeze(1)
                parts.append(scores.double())
            flat = torch.cat(parts).tolist()  # the step's one read
            count = len(live)
            going = []
            for j, i in enumerate(live):
                if not flat[count + j]:
                    raise FloatingPointError(f"non-finite student logits after {len(out[i].ids)} rollout tokens")
                token = int(flat[j])
                out[i].ids.append(token)
                if logprobs:
                    out[i].logprobs.append(flat[2 * count + j])  # type: ignore[union-attr]
                if token in stop_ids:
                    out[i].truncated = False
                elif len(out[i].ids) < max_new[i]:
                    going.append(i)
            batch.retain(set(going))
            live = [i for i in batch.rows if i in set(going)]
            if live:
                logits = batch.step([out[i].ids[-1] for i in live])
    return out
