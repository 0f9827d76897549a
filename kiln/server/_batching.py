"""Batched decoding for ``kiln serve``: every decoding sequence of the serving routes steps through one scheduler.

A sequence (one choice of one request) is ``submit``ted with its prompt, adapter, ``Sampling``, seed and limits;
its consumer iterates the ``Stream`` it gets back: ``(token, score)`` pairs, as the one-sequence loop gave them.

Scheduling
    No thread of its own: a consumer that finds nothing buffered for its sequence runs the next step itself, for
    every sequence (the others' tokens wait in their buffers), while the consumers of other threads wait for that
    step to end. A step (a) runs one forward for all running sequences (``kiln.model.Batch``: the model's invariant
    forward, each sequence at its own position in its own slot of one KV cache), then (b) admits the sequences
    submitted since (up to ``MAX_ROWS`` running): their prompts run as one right-padded prefill -- once for the
    choices of one request, which share prompt and weights -- and pick each sequence's first token. A sequence leaves the batch when it ends (an end-of-turn token, its
    ``max_new`` tokens, non-finite logits) or when its consumer closes the stream or drops it (a client that
    disconnects: the generator chain above the stream is closed or collected); it is gone from the next step on.
    A consumer that does not pull (a slow SSE client) never stalls the batch: its tokens wait in its buffer,
    bounded by its ``max_new``. Sequences submitted together before any step share every step from the first.
Per sequence
    Its own weights (rows of several adapters and of the base model share a forward: each row's LoRA delta is
    added to that row only, ``kiln.model.RowLoras``), its own ``Sampling``, its ``seen`` ids (a mask on the model's
    device, for the repetition penalty) and ``produced`` count, its draws keyed by ``(seed, 0, position)``
    (``kiln.model.next_tokens``: the portable rule, every row of a step in one call), its stop ids, its scoring
    (the invariant log-softmax of the raw logits: what a trainer recomputes; ``top_k`` alternatives by
    ``stable_top_k``) and the ``first`` shortcut (log-probabilities of its first token already computed by prompt
    scoring). A step's tokens, finiteness flags and scores reach the host in one read. Non-finite logits end that
    sequence alone (``NonFiniteLogitsError`` at its consumer); an error of a forward ends the sequences of that
    forward (``InternalError``).
Locking
    ``lock`` (``Generator.lock``) is held for each forward pass (a prefill, a step) and by every adapter swap; never
    while a consumer holds a token, so a client never blocks the model. A condition guards the queues.
Retiring
    ``retire(error)`` ends a scheduler whose model is going away (the serving copy released or swapped,
    ``kiln.server._serving``): it waits for a step under way, ends every sequence running or waiting with ``error``
    at its consumer, frees their caches and lets the model go; a sequence submitted later ends the same way.
Guarantee
    Bitwise: a sequence gives the same token ids, scores and text whichever sequences share its steps, and the same
    as decoded alone -- by construction of the invariant forward (``kiln.kernels.invariant``), which a lone
    sequence runs too; a model without one decodes each sequence alone through its own forward
    (``Batch.fallback`` says why). ``tests/test_server_batching.py`` compares batched and lone decoding bit for
    bit.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import InternalError, KilnError
from kiln.model import Batch, DrawKey, LoraLayers, Sampling, next_tokens
from kiln.teachers import stable_top_k

__all__ = ["MAX_ROWS", "Lora", "NonFiniteLogitsError", "Scheduler", "Stream", "lora_layers"]

MAX_ROWS = 32  # sequences decoding together; later ones wait for a free row
Score = tuple[float, list[tuple[int, float]]]  # log-probability of the token and its top-k alternatives


class NonFiniteLogitsError(Exception):
    """A forward pass produced NaN or infinite logits for a sequence."""


@dataclass(frozen=True)
class Lora:
    """One adapted module: ``y + B(A(x)) * scale``, computed as peft's ``lora.Linear`` computes it."""

    path: str  # the module's name in the model (what binds the layer to any copy of it)
    a: Any  # [r, in_features], float32, on the served copy's device
    b: Any  # [out_features, r], float32
    scale: float


def lora_layers(adapter: Any) -> LoraLayers | None:
    """An adapter's layers (``adapter.layers``, a tuple of ``Lora``) as ``kiln.model`` takes them, or None for
    the base model."""
    if adapter is None:
        return None
    return {layer.path: (layer.a, layer.b, layer.scale) for layer in adapter.layers}


@dataclass(eq=False)
class _Row:
    """One decoding sequence: its settings and state (the scheduler's), its buffered events (its consumer's)."""

    prompt: list[int]
    adapter: Any  # an object with ``layers: tuple[Lora, ...]``, or None for the base model
    lora: LoraLayers | None  # its layers as the model layer takes them (one object per adapter)
    sampling: Sampling
    max_new: int
    seed: int
    stop: bool
    top_k: int | None
    first: Any
    seen: Any = None  # bool [V] on the model's device: the ids the repetition penalty applies to (None: no penalty)
    produced: int = 0
    last: int = -1  # the token to feed next
    done: bool = False
    closed: bool = False  # its consumer is gone
    events: deque[Any] = field(default_factory=deque)


_END = object()


@dataclass(frozen=True)
class _Failed:
    error: Exception | None  # None: non-finite logits


class Stream:
    """The consumer side of one sequence: ``(token, score)`` pairs (score None without ``top_k``)."""

    def __init__(self, scheduler: Scheduler, row: _Row):
        self._scheduler = scheduler
        self._row = row
        self._gone = weakref.finalize(self, _abandon, row)  # dropped without close(): the row still leaves

    def __iter__(self) -> Iterator[tuple[int, Score | None]]:
        return self

    def __next__(self) -> tuple[int, Score | None]:
        return self._scheduler._next(self._row)

    def close(self) -> None:
        """The consumer is done: the sequence leaves the batch (now when no step runs, else at the next step)."""
        self._gone()
        self._scheduler._release()


def _abandon(row: _Row) -> None:
    row.closed = True  # only a flag: this may run inside any frame of any thread


class Scheduler:
    """Decodes every submitted sequence over ``model`` in shared steps (see the module docstring)."""

    def __init__(self, model: Any, lock: threading.Lock, stop_ids: frozenset[int]):
        self._model: Any = model
        self._lock = lock
        self._stop_ids = stop_ids
        self._device = next(model.parameters()).device
        self._batch: Batch[_Row] | None = Batch(model)
        self.fallback = self._batch.fallback  # why sequences decode alone, or None: they share each step's forward
        self._loras: dict[int, tuple[Any, LoraLayers | None]] = {}  # per adapter object, its layers (one dict each)
        self._cond = threading.Condition()
        self._waiting: list[_Row] = []
        self._stepping = False
        self._retired: KilnError | None = None  # set by retire(): every sequence ends with it
        self.steps = 0  # decoding steps that ran a forward for running sequences
        self.stepped = 0  # sequences those steps advanced, summed
        self.widest = 0  # most sequences one step advanced

    def submit(
        self,
        prompt: list[int],
        adapter: Any,
        sampling: Sampling,
        seed: int,
        max_new: int,
        *,
        stop: bool = True,
        top_k: int | None = None,
        first: Any = None,
    ) -> Stream:
        """Queue a sequence; it joins at the next step. ``stop``: an end-of-turn token ends it (and is its last
        token); ``first``: the log-probabilities after the prompt, when the caller already has them."""
        penalised = sampling.repetition_penalty != 1
        with self._cond:
            known = self._loras.get(id(adapter))
            if known is None:
                known = self._loras[id(adapter)] = (adapter, lora_layers(adapter))
            row = _Row(
                prompt=list(prompt),
                adapter=adapter,
                lora=known[1],
                sampling=sampling,
                max_new=max_new,
                seed=seed,
                stop=stop,
                top_k=top_k,
                first=None if penalised else first,  # the penalty applies to raw logits, not to log-probabilities
            )
            self._waiting.append(row)
        return Stream(self, row)

    def pack(self) -> int:
        """On the CPU, keep oneDNN's blocked copy of the served model's projection weights for decoding
        (``kiln.model.Decoder.pack``: the same bits, no reordering at each product); the bytes it holds."""
        decoder = self._batch.decoder if self._batch is not None else None
        if decoder is None or self._device.type != "cpu":
            return 0
        return decoder.pack()

    def running(self) -> int:
        """Sequences in the batch (a closed one counts until it leaves)."""
        return len(self._batch.rows) if self._batch is not None else 0

    def retire(self, error: KilnError) -> int:
        """End this scheduler for good (its model is going away): wait for a step under way, end every sequence
        running or waiting with ``error``, free their caches and let the model go; a sequence submitted later ends
        with ``error`` too. Returns the sequences it ended. The caller must not hold ``lock``."""
        with self._cond:
            self._retired = error
            while self._stepping:
                self._cond.wait()
            self._stepping = True
        try:
            with self._lock:  # no forward of this scheduler's model runs from here on
                running: list[_Row] = self._batch.rows if self._batch is not None else []
                rows = [row for row in running if not row.done] + self._waiting
                self._waiting = []
                self._batch = None  # the KV caches go
                self._loras.clear()
                self._model = None
        finally:
            with self._cond:
                for row in rows:
                    row.done = True
                    row.events.append(_Failed(copy.copy(error)))
                self._stepping = False
                self._cond.notify_all()
        return len(rows)

    # --- the consumers' side ----------------------------------------------------------

    def _next(self, row: _Row) -> tuple[int, Score | None]:
        while True:
            with self._cond:
                while not row.events and self._stepping:
                    self._cond.wait()
                if row.events:
                    event = row.events.popleft()
                    break
                if row.closed:
                    raise StopIteration
                self._stepping = True
            try:
                self._step()
            finally:
                with self._cond:
                    self._stepping = False
                    self._cond.notify_all()
        if event is _END:
            raise StopIteration
        if isinstance(event, _Failed):
            if event.error is None:
                raise NonFiniteLogitsError
            if isinstance(event.error, KilnError):  # the scheduler was retired: the error says why
                raise event.error
            raise InternalError(f"decoding failed: {type(event.error).__name__}: {event.error}") from event.error
        return event

    def _release(self) -> None:
        """Let closed sequences leave now, unless a step runs (it drops them) or this frame holds the condition."""
        if not self._cond.acquire(blocking=False):
            return
        try:
            if self._stepping:
                return
            self._stepping = True
        finally:
            self._cond.release()
        try:
            self._drop()
        finally:
            with self._cond:
                self._stepping = False
                self._cond.notify_all()

    def _drop(self) -> None:
        with self._cond:
            self._waiting = [row for row in self._waiting if not row.closed]
            if self._retired is not None or self._batch is None:
                return
        self._batch.retain({row for row in self._batch.rows if not row.closed and not row.done})

    # --- one step ---------------------------------------------------------------------

    def _step(self) -> None:
        import torch

        with self._cond:
            if self._retired is not None or self._batch is None:  # submitted after retire(): ended at once
                for row in self._waiting:
                    row.done = True
                    row.events.append(_Failed(copy.copy(self._retired)))
                self._waiting = []
                return
            self._waiting = [row for row in self._waiting if not row.closed]
            room = max(0, MAX_ROWS - len(self._batch.rows))
            joining, self._waiting = self._waiting[:room], self._waiting[room:]
        batch = self._batch
        emitted: list[tuple[_Row, Any]] = []
        try:
            with torch.inference_mode():
                batch.retain({row for row in batch.rows if not row.closed})
                self._decode(batch, list(batch.rows), emitted)
                self._join(batch, joining, emitted)
                batch.retain({row for row in batch.rows if not row.done})
        finally:  # what was decoded reaches its consumers whatever happened after
            with self._cond:
                for row, event in emitted:
                    row.events.append(event)
                self._cond.notify_all()

    def _decode(self, batch: Batch[_Row], running: list[_Row], emitted: list[tuple[_Row, Any]]) -> None:
        """One forward for the running sequences, and each one's next token."""
        if not running:
            return
        try:
            with self._lock:
                logits = batch.step([row.last for row in running])
        except Exception as exc:  # noqa: BLE001 -- not swallowed: each sequence of the forward ends with it
            _fail(running, exc, emitted)
            return
        self.steps += 1
        self.stepped += len(running)
        self.widest = max(self.widest, len(running))
        self._advance(running, logits, emitted)

    def _join(self, batch: Batch[_Row], joining: list[_Row], emitted: list[tuple[_Row, Any]]) -> None:
        """The joining sequences' prompts in one prefill (none for a one-token answer given ``first``), and each
        one's first token from its prompt's logits (or from ``first``)."""
        import torch

        picking: list[_Row] = []
        for row in joining:
            if row.max_new <= 0:
                row.done = True
                emitted.append((row, _END))
            else:
                picking.append(row)
        forwarded = [row for row in picking if row.first is None or row.max_new > 1]
        by_row: dict[int, Any] = {}
        if forwarded:
            try:
                with self._lock:
                    logits = batch.join([(row, row.prompt, row.lora) for row in forwarded])
            except Exception as exc:  # noqa: BLE001 -- not swallowed: the joining sequences end with it
                _fail(forwarded, exc, emitted)
                picking = [row for row in picking if row not in forwarded]
                batch.retain({row for row in batch.rows if row not in forwarded})
            else:
                by_row = {id(row): logits[i] for i, row in enumerate(forwarded)}
        if not picking:
            return
        rows_logits = torch.stack(
            [row.first.to(self._device).float() if row.first is not None else by_row[id(row)] for row in picking]
        )
        self._advance(picking, rows_logits, emitted)

    def _advance(self, rows: list[_Row], logits: Any, emitted: list[tuple[_Row, Any]]) -> None:
        """Each row's next token from its row of ``logits`` ``[B, V]`` (float32, on the model's device), its
        finiteness and its score, read to the host at once; then queued (a failure ends those rows with it)."""
        try:
            tokens, finite, scores = self._pick(rows, logits)
        except Exception as exc:  # noqa: BLE001 -- not swallowed: the sequences end with it
            _fail(rows, exc, emitted)
            return
        for row, token, ok, score in zip(rows, tokens, finite, scores, strict=True):
            if not ok:
                row.done = True
                emitted.append((row, _Failed(None)))
                continue
            if row.seen is not None:
                row.seen[token] = True
            row.produced += 1
            emitted.append((row, (token, score)))
            if (row.stop and token in self._stop_ids) or row.produced >= row.max_new:
                row.done = True
                emitted.append((row, _END))
            else:
                row.last = token

    def _pick(self, rows: list[_Row], logits: Any) -> tuple[list[int], list[bool], list[Score | None]]:
        import torch

        from kiln.kernels import invariant

        finite = torch.isfinite(logits).all(-1)
        safe = torch.where(finite.unsqueeze(1), logits, 0.0)  # a non-finite row fails; its draw is discarded
        vocab = logits.shape[1]
        for row in rows:
            if row.seen is None and row.sampling.repetition_penalty != 1:  # the prompt's ids, once
                row.seen = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
                ids = sorted({t for t in row.prompt if 0 <= t < vocab})
                row.seen[torch.tensor(ids, dtype=torch.long, device=logits.device)] = True
        seen = None
        if any(row.seen is not None for row in rows):
            blank = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            seen = torch.stack([row.seen if row.seen is not None else blank for row in rows])
        tokens = next_tokens(
            safe,
            [row.sampling for row in rows],
            [DrawKey(row.seed, 0, row.produced) for row in rows],
            seen=seen,
            produced=[row.produced for row in rows],
            stop_ids=self._stop_ids,
        )
        parts = [tokens.double(), finite.double()]
        scoring = [i for i, row in enumerate(rows) if row.top_k is not None]
        widths: list[int] = []
        if scoring:
            index = torch.tensor(scoring, device=logits.device)
            logprobs = invariant.log_softmax(safe.index_select(0, index))
            parts.append(logprobs.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1).double())
            for j, i in enumerate(scoring):
                k = rows[i].top_k or 0
                widths.append(k)
                if k:
                    ids, values = stable_top_k(logprobs[j : j + 1], k)
                    parts.extend([ids[0].double(), values[0].double()])
        flat = torch.cat(parts).tolist()  # the step's one read from the device
        count = len(rows)
        picked = [int(t) for t in flat[:count]]
        ok = [bool(f) for f in flat[count : 2 * count]]
        scores: list[Score | None] = [None] * count
        at = 2 * count + len(scoring)
        for j, i in enumerate(scoring):
            k = widths[j]
            ids_k, values_k = flat[at : at + k], flat[at + k : at + 2 * k]
            at += 2 * k
            scores[i] = (flat[2 * count + j], list(zip((int(t) for t in ids_k), values_k, strict=True)))
        return picked, ok, scores


def _fail(rows: list[_Row], error: Exception, emitted: list[tuple[_Row, Any]]) -> None:
    for row in rows:
        row.done = True
        emitted.append((row, _Failed(error)))
