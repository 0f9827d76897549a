"""Batched decoding for ``kiln serve``: every decoding sequence of the serving routes steps through one scheduler.

A sequence (one choice of one request) is ``submit``ted with its prompt, adapter, ``Sampling``, seed and limits;
its consumer iterates the ``Stream`` it gets back: ``(token, score)`` pairs, as the one-sequence loop gave them.

Scheduling
    No thread of its own: a consumer that finds nothing buffered for its sequence runs the next step itself, for
    every sequence (the others' tokens wait in their buffers), while the consumers of other threads wait for that
    step to end. A step (a) runs one forward for all running sequences (``kiln.model.RowBatch``: each with its own
    KV cache, stacked left-padded), then (b) admits the sequences submitted since (up to ``MAX_ROWS`` running):
    each prompt's prefill runs alone -- once for the choices of one request, which share prompt and weights -- and
    picks the sequence's first token. A sequence leaves the batch when it ends (an end-of-turn token, its
    ``max_new`` tokens, non-finite logits) or when its consumer closes the stream or drops it (a client that
    disconnects: the generator chain above the stream is closed or collected); it is gone from the next step on.
    A consumer that does not pull (a slow SSE client) never stalls the batch: its tokens wait in its buffer,
    bounded by its ``max_new``. Sequences submitted together before any step share every step from the first.
Per sequence
    Its own weights (rows of several adapters and of the base model share a forward: a LoRA hook adds each
    row's adapter to that row only, computed exactly as the one-adapter hook computes it, and leaves a base row's
    output untouched), its own ``Sampling`` through ``kiln.model.choose`` with its ``seen`` ids and ``produced``
    count, its own ``torch.Generator`` seeded with its seed, its stop ids, its scoring (log-softmax of the raw
    logits; ``top_k`` alternatives by ``stable_top_k``) and the ``first`` shortcut (log-probabilities of its first
    token already computed by prompt scoring). Non-finite logits end that sequence alone (``NonFiniteLogitsError``
    at its consumer); an error of a forward ends the sequences of that forward (``InternalError``).
Locking
    ``lock`` (``Generator.lock``) is held for each forward pass (a prefill, a step) and by every adapter swap; never
    while a consumer holds a token, so a client never blocks the model. A condition guards the queues.
Retiring
    ``retire(error)`` ends a scheduler whose model is going away (the serving copy released or swapped,
    ``kiln.server._serving``): it waits for a step under way, ends every sequence running or waiting with ``error``
    at its consumer, frees their caches and lets the model go; a sequence submitted later ends the same way.
Guarantee
    Bitwise: a sequence gives the same token ids, scores and text whichever sequences share its steps, and the same
    as decoded alone (a batch of one is the model's own one-sequence forward). ``kiln.model.RowBatch`` says how;
    measured before it, a left-padded batch moved logits by up to 2.1e-7 on the tiny model and 1.25e-6 on the
    benches' 23 M model. ``tests/test_server_batching.py`` compares batched and lone decoding bit for bit.
"""

from __future__ import annotations

import copy
import inspect
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import InternalError, KilnError
from kiln.model import RowBatch, Sampling
from kiln.model import choose as _choose
from kiln.teachers import stable_top_k

__all__ = ["MAX_ROWS", "Lora", "NonFiniteLogitsError", "Scheduler", "Stream", "applied", "lora_hook"]

MAX_ROWS = 32  # sequences decoding together; later ones wait for a free row
Score = tuple[float, list[tuple[int, float]]]  # log-probability of the token and its top-k alternatives


class NonFiniteLogitsError(Exception):
    """A forward pass produced NaN or infinite logits for a sequence."""


@dataclass(frozen=True)
class Lora:
    """One adapted module: ``y + B(A(x)) * scale``, computed as peft's ``lora.Linear`` computes it."""

    module: Any  # the target nn.Linear (or GPT-2 Conv1D) of the served model (None while no model is served)
    a: Any  # [r, in_features], float32
    b: Any  # [out_features, r], float32
    scale: float
    path: str = ""  # the module's name in the model (what binds the layer to another copy of it)


@dataclass(eq=False)
class _Row:
    """One decoding sequence: its settings and state (the scheduler's), its buffered events (its consumer's)."""

    prompt: list[int]
    adapter: Any  # an object with ``layers: tuple[Lora, ...]``, or None for the base model
    sampling: Sampling
    max_new: int
    generator: Any  # torch.Generator seeded with the sequence's seed
    stop: bool
    top_k: int | None
    first: Any
    seen: set[int] = field(default_factory=set)
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
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        self._batch = RowBatch(model)
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
        import torch

        generator = torch.Generator(device=self._device)
        generator.manual_seed(seed)
        penalised = sampling.repetition_penalty != 1
        row = _Row(
            prompt=list(prompt),
            adapter=adapter,
            sampling=sampling,
            max_new=max_new,
            generator=generator,
            stop=stop,
            top_k=top_k,
            first=None if penalised else first,  # the penalty applies to raw logits, not to log-probabilities
            seen=set(prompt) if penalised else set(),
        )
        with self._cond:
            self._waiting.append(row)
        return Stream(self, row)

    def running(self) -> int:
        """Sequences in the batch (a closed one counts until it leaves)."""
        return len(self._batch.rows)

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
                rows = [row for row in self._batch.rows if not row.done] + self._waiting
                self._waiting = []
                self._batch.retain(set())  # the KV caches go
                self._batch = RowBatch(_NoModel())
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
        import torch

        with self._cond:
            self._waiting = [row for row in self._waiting if not row.closed]
            if self._retired is not None:
                return
        with torch.inference_mode():
            self._batch.retain({row for row in self._batch.rows if not row.closed and not row.done})

    # --- one step ---------------------------------------------------------------------

    def _step(self) -> None:
        import torch

        with self._cond:
            if self._retired is not None:  # submitted after retire(): ended at once
                for row in self._waiting:
                    row.done = True
                    row.events.append(_Failed(copy.copy(self._retired)))
                self._waiting = []
                return
            self._waiting = [row for row in self._waiting if not row.closed]
            room = max(0, MAX_ROWS - len(self._batch.rows))
            joining, self._waiting = self._waiting[:room], self._waiting[room:]
        emitted: list[tuple[_Row, Any]] = []
        try:
            with torch.inference_mode():
                self._batch.retain({row for row in self._batch.rows if not row.closed})
                self._decode(list(self._batch.rows), emitted)
                entries = self._prefill(joining, emitted)
                try:
                    self._batch.add(entries)
                except Exception as exc:  # noqa: BLE001 -- not swallowed: the joining sequences end with it
                    _fail([row for row, _, _ in entries], exc, emitted)
                self._batch.retain({row for row in self._batch.rows if not row.done})
        finally:  # what was decoded reaches its consumers whatever happened after
            with self._cond:
                for row, event in emitted:
                    row.events.append(event)
                self._cond.notify_all()

    def _decode(self, running: list[_Row], emitted: list[tuple[_Row, Any]]) -> None:
        """One forward for the running sequences, and each one's next token."""
        if not running:
            return
        try:
            with self._lock:
                logits = self._batch.step(
                    [row.last for row in running],
                    lambda indices: rows_applied([running[i].adapter for i in indices]),
                )
        except Exception as exc:  # noqa: BLE001 -- not swallowed: each sequence of the forward ends with it
            _fail(running, exc, emitted)
            return
        self.steps += 1
        self.stepped += len(running)
        self.widest = max(self.widest, len(running))
        for row, row_logits in zip(running, logits, strict=True):
            self._advance(row, row_logits, emitted)

    def _prefill(self, joining: list[_Row], emitted: list[tuple[_Row, Any]]) -> list[tuple[_Row, Any, int]]:
        """Each joining sequence's first token: its prompt's forward (one per distinct prompt and weights; none
        for a one-token answer given ``first``). Returns the ``RowBatch`` entries of those that go on."""
        import torch

        entries: list[tuple[_Row, Any, int]] = []
        shared: dict[tuple[tuple[int, ...], int], tuple[Any, Any]] = {}
        for row in joining:
            if row.max_new <= 0:
                row.done = True
                emitted.append((row, _END))
                continue
            cache = logits = None
            if row.first is None or row.max_new > 1:
                key = (tuple(row.prompt), id(row.adapter))
                if key not in shared:
                    try:
                        with self._lock, applied(row.adapter):
                            out = self._model(
                                input_ids=torch.tensor([row.prompt], device=self._device), use_cache=True, **self._extra
                            )
                    except Exception as exc:  # noqa: BLE001 -- not swallowed: the sequence ends with it
                        _fail([row], exc, emitted)
                        continue
                    shared[key] = (out.past_key_values, out.logits[0, -1].float())
                cache, logits = shared[key]
            if row.first is not None:
                logits = row.first.to(self._device).float()
            self._advance(row, logits, emitted)
            if not row.done:
                entries.append((row, cache, len(row.prompt)))
        return entries

    def _advance(self, row: _Row, logits: Any, emitted: list[tuple[_Row, Any]]) -> None:
        """Pick the sequence's next token from ``logits`` as the one-sequence loop did, and queue it (a failure
        ends the sequence with it)."""
        try:
            self._pick(row, logits, emitted)
        except Exception as exc:  # noqa: BLE001 -- not swallowed: the sequence ends with it
            _fail([row], exc, emitted)

    def _pick(self, row: _Row, logits: Any, emitted: list[tuple[_Row, Any]]) -> None:
        import torch

        if not bool(torch.isfinite(logits).all()):
            row.done = True
            emitted.append((row, _Failed(None)))
            return
        token = _choose(
            logits, row.sampling, row.generator, seen=row.seen, produced=row.produced, stop_ids=self._stop_ids
        )
        if row.sampling.repetition_penalty != 1:
            row.seen.add(token)
        score: Score | None = None
        if row.top_k is not None:
            logprobs = torch.log_softmax(logits, dim=-1).cpu()
            alternatives: list[tuple[int, float]] = []
            if row.top_k:
                ids, values = stable_top_k(logprobs.unsqueeze(0), row.top_k)
                alternatives = list(zip(ids[0].tolist(), values[0].tolist(), strict=True))
            score = (float(logprobs[token]), alternatives)
        row.produced += 1
        emitted.append((row, (token, score)))
        if (row.stop and token in self._stop_ids) or row.produced >= row.max_new:
            row.done = True
            emitted.append((row, _END))
        else:
            row.last = token


class _NoModel:
    """What a retired scheduler's empty ``RowBatch`` is built over: no model, no rows, never stepped."""

    config = None

    def forward(self) -> None:
        raise AssertionError("a retired scheduler runs no forward")


def _fail(rows: list[_Row], error: Exception, emitted: list[tuple[_Row, Any]]) -> None:
    for row in rows:
        row.done = True
        emitted.append((row, _Failed(error)))


# --- adapters -----------------------------------------------------------------------------------


@contextmanager
def applied(adapter: Any) -> Iterator[None]:
    """Hook ``adapter`` (its ``layers``; None: base) onto its target modules for one forward pass (callers hold
    the lock)."""
    if adapter is None:
        yield
        return
    handles = [layer.module.register_forward_hook(lora_hook(layer), with_kwargs=True) for layer in adapter.layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def rows_applied(adapters: list[Any]) -> Iterator[None]:
    """Row r of the next forward with ``adapters[r]``: ``applied`` when every row has the same weights, else one
    hook per adapted module that adds each row's own delta to that row (and leaves base rows as they are)."""
    if all(adapter is adapters[0] for adapter in adapters):
        with applied(adapters[0]):
            yield
        return
    targets: dict[int, tuple[Any, list[Lora | None]]] = {}
    for r, adapter in enumerate(adapters):
        for layer in adapter.layers if adapter is not None else ():
            targets.setdefault(id(layer.module), (layer.module, [None] * len(adapters)))[1][r] = layer
    handles = [
        module.register_forward_hook(_rows_hook(module, layers), with_kwargs=True)
        for module, layers in targets.values()
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def lora_hook(layer: Lora) -> Any:
    from torch.nn.functional import linear

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if module is not layer.module:  # a deep copy of the model: never adapt it
            return None
        x = (args[0] if args else kwargs["input"]).to(layer.a.dtype)
        return (output + linear(linear(x, layer.a), layer.b) * layer.scale).to(output.dtype)  # as peft's lora.Linear

    return hook


def _rows_hook(target: Any, layers: list[Lora | None]) -> Any:
    import torch
    from torch.nn.functional import linear

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if module is not target:  # a deep copy of the model: never adapt it
            return None
        x = args[0] if args else kwargs["input"]
        rows = []
        for r, layer in enumerate(layers):
            out = output[r : r + 1]
            if layer is not None:  # exactly lora_hook's arithmetic, on this row
                delta = linear(linear(x[r : r + 1].to(layer.a.dtype), layer.a), layer.b)
                out = (out + delta * layer.scale).to(output.dtype)
            rows.append(out)
        return torch.cat(rows)

    return hook
