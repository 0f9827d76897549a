"""The generation engine of ``kiln serve``: chat completions, adapter load/unload, serving canary.

Longer than 600 lines: the one owner of the served model -- its forwards, its adapters' hooks, the canary and the
swap that releases and reloads it -- in one module, because each of these holds the same lock and the same model
reference, and the locking rules below are only checkable read together.

One ``Generator`` owns the served model (``LoadedModel.model``) for inference. It never
changes a base weight: an adapter is applied as a forward hook on each LoRA target
``nn.Linear`` (``y + B(A(x)) * scale``, computed exactly as peft's LoRA layer does), the
hooks exist only for the duration of one forward pass, and each hook is a no-op on any
module other than the one it was registered on (so a deep copy taken mid-pass, e.g. by
the training worker, never carries an adapter). Base output is therefore bit-identical
to a pristine model's, before and after any adapter was loaded.

Locking
    One ``threading.Lock`` (``Generator.lock``) serialises every forward pass and every
    adapter swap. A completion resolves its weights once, when it starts, and keeps them
    for every token, so a load or unload during a long stream never mixes two adapters;
    the lock is held per forward pass, never across a ``yield``, so a slow SSE client
    cannot block other requests.
Decoding
    Every sequence of every route (each choice of each request, ``answer``) decodes through
    ``Generator.scheduler`` (``kiln.server._batching``): sequences running at the same time
    share one forward per step, each with its own weights, sampling, seed and stops, and
    each gives bit for bit what it gives decoded alone. The canary times its greedy runs
    alone, on a scheduler of their own.
The served model, swapped
    ``swap(model)`` serves another copy of the base weights, or none (``kiln.server._serving``
    releases the serving copy while a job trains on its device and loads it again after). A
    request holds the served model from admission to its last token (``serving()``); a swap
    holds new requests back (refuses them with the release's error when no model will be
    served), waits for those in flight, for at most ``drain_s``, then retires the old
    scheduler (a request still decoding ends with the error) and moves the active adapter's
    weights onto the new copy, so it stays active. Every adapter carries the ``epoch`` of the
    copy its layers are bound to: a request admitted before a swap never decodes with an
    adapter bound to the copy it no longer reaches (it ends with the error instead).

Adapters
    ``load(name)`` reads the registry adapter once into memory through the registry module
    (``kiln.adapters``: ``adapter_directory(registry, name).read()``): a name the registry rule
    refuses -- a demoted ``<name>.failed``, a checkpoint, a hidden staging directory -- or no
    directory is ``adapter_not_found``; the manifest loads strictly and binds exactly the bytes
    read (weights, config, train receipt, and the request lineage the receipt links) -- or, for
    a plain PEFT directory (no manifest and no ``train_receipt.json``: spec/50's legacy
    adapter), there is nothing to bind, while a directory holding a Kiln receipt but no
    manifest is refused (Kiln binds every adapter it publishes); the config is a LoRA config by
    the rules ``kiln adapters verify`` applies (``parse_lora_config``: ``all-linear``, a target
    regular expression, ``rank_pattern``). Then: the config is a plain LoRA config this engine
    applies (no DoRA, bias, ``alpha_pattern``, ...); every tensor is a complete
    ``lora_A``/``lora_B`` pair of a declared target ``nn.Linear`` of the served model (or a
    GPT-2 ``Conv1D``, with ``fan_in_fan_out`` as peft writes it; never the output layer under
    ``all-linear``, which peft leaves out) with its module's rank and matching shapes, scaled
    as peft scales it; the canary has not quarantined it (``adapter_canary_status.json``,
    read as ``kiln adapters list`` reads it: an invalid file counts as quarantined) unless
    ``allow_quarantined``. Every refusal is ``adapter_invalid`` and leaves the served adapter
    unchanged.

``content_revision`` (``kiln.adapters.content_revision``)
    The revision of an adapter's serving files, a raw SHA-256 (64 lowercase hex)::

        sha256(canonical_json({"adapter_config_sha256": <hex of adapter_config.json bytes>,
                               "adapter_model_sha256":  <hex of adapter_model.safetensors bytes>}))

    with canonical JSON as in spec/20 (sorted keys, no spaces, UTF-8). It changes whenever
    either file changes and does not depend on the manifest or the receipt.

Completions
    ``messages`` are rendered with the tokenizer's chat template and a generation prompt;
    message text that spells a special token is tokenized as plain text, exactly as SFT
    ingestion does (so a user cannot forge a turn delimiter). Weights: ``adapter`` (this
    request only; the active adapter when it names it, else read from the registry like
    ``load`` without ``allow_quarantined``), ``base_model: true`` (base), else the active
    adapter, else base. Each token is chosen by ``kiln.model.choose`` under the plan's
    ``Sampling`` (repetition penalty, ``min_tokens``, then temperature -- 0 is greedy argmax,
    first maximum -- ``top_k``, ``top_p``, ``min_p``) with a ``torch.Generator`` seeded with the
    plan's seed, so equal requests with equal seeds give equal answers. Decoding stops at an end-of-turn token (``stop``; not part of the content,
    counted in ``completion_tokens``) or after ``max_tokens`` (default 64, at most the
    model's context minus the prompt: ``length``). Text is decoded incrementally
    (special tokens skipped; a chunk is held back while it ends in an incomplete UTF-8
    sequence); the non-streaming content is the concatenation of exactly those deltas.

Canary
    ``run_canary(name)`` checks, stopping at the first failure: ``finite_logits`` (one
    forward of a fixed prompt with the adapter), ``non_empty_output`` (greedy, at most 16
    tokens, non-empty after stripping), ``bounded_latency`` (16 tokens with the adapter
    take at most 10x the base model's time on the same prompt + 2 s). Identical greedy
    output with and without the adapter is a warning. The ``AdapterCanaryStatus`` is
    validated and written crash-atomically to ``<registry>/<name>/adapter_canary_status.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln.adapters import (
    CANARY_FILE,
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterFiles,
    adapter_directory,
    attempt_record,
    content_revision,
)
from kiln.data import match_skeleton, template_errors
from kiln.errors import AdapterError, CapacityError, ContractError, InternalError, KilnError, NotFoundError, Problem
from kiln.host.progress import human_bytes, note
from kiln.model import Sampling, sequence_logprobs
from kiln.model import max_positions as _max_positions
from kiln.model import special_tokens as _special_tokens
from kiln.model import stop_token_ids as _stop_ids
from kiln.server._batching import Lora, NonFiniteLogitsError, Scheduler, Stream, lora_layers

__all__ = [
    "CANARY_FILE",
    "SEEDS",
    "Generator",
    "Held",
    "Outcome",
    "Piece",
    "Plan",
    "TokenScore",
    "checked",
    "content_revision",
]

REQUEST = "ChatCompletionRequest"

CANARY_MESSAGES = ({"role": "user", "content": "Say hello in one short sentence."},)
CANARY_MAX_TOKENS = 16
SEEDS = 1 << 64  # a request's seed (and each further choice's) is taken modulo 2^64
LATENCY_FACTOR = 10.0
LATENCY_SLACK_S = 2.0
# End-of-turn spellings of common chat templates; used only when the tokenizer has them as special tokens.
# LoRA config features this engine does not apply; an adapter using any of them is refused, never half-applied.
UNSUPPORTED_CONFIG = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "modules_to_save",
    "trainable_token_indices",
    "layer_replication",
    "target_parameters",
    "alpha_pattern",
    "alora_invocation_tokens",
    "use_qalora",
    "use_bdlora",
)
_KEY = re.compile(r"^base_model\.model\.(?P<path>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(frozen=True)
class _Adapter:
    name: str
    content_revision: str
    manifest_sha256: str | None  # sha256:<hex> of adapter_manifest.json as read; None for a plain PEFT directory
    weights_sha256: str  # sha256:<hex> of adapter_model.safetensors as read
    layers: tuple[Lora, ...]
    epoch: int = 0  # the served copy its layers are bound to (Generator.swap counts them)

    def identity(self) -> dict[str, str]:
        return {"name": self.name, "content_revision": self.content_revision}


@dataclass(frozen=True)
class Plan:
    """One admitted completion request."""

    prompt_ids: list[int]
    max_new: int
    sampling: Sampling
    seed: int
    adapter: _Adapter | None
    model: str


@dataclass(frozen=True)
class TokenScore:
    """One generated token; with scoring, its log-probability and the most likely alternatives."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass(frozen=True)
class Piece:
    """A text increment of one choice and the tokens consumed since the previous piece."""

    text: str
    tokens: list[TokenScore]


@dataclass
class Outcome:
    finish_reason: str = "length"
    completion_tokens: int = 0


class Generator:
    """Chat completions, adapter load/unload and the serving canary over one loaded model."""

    def __init__(self, loaded: Any, registry: Path, model_name: str):
        self.lock = threading.Lock()
        self._tokenizer = loaded.tokenizer
        self._registry = Path(registry)
        self._model_name = model_name
        self._active: _Adapter | None = None
        self._load_errors: dict[str, str] = {}
        self._specials = _special_tokens(self._tokenizer)
        self._stop_ids = _stop_ids(loaded.model, self._tokenizer, self._specials)
        self._max_positions = _max_positions(loaded.model.config, self._tokenizer)
        # the served copy: which one (epoch), the requests holding it, and what they get while none is served
        self._gate = threading.Condition()
        self._epoch = 0
        self._holds = 0
        self._swapping = False
        self._refusal: KilnError | None = None
        self._attach(loaded.model)

    def _attach(self, model: Any) -> None:
        """Serve ``model`` (callers hold the lock and the gate, or are the constructor); None serves nothing and keeps
        the retired scheduler, which ends whatever reaches it."""
        self._model = model
        if model is None:
            return
        self._device = next(model.parameters()).device
        self._keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.scheduler = Scheduler(model, self.lock, self._stop_ids)  # every route's sequences decode here
        self.packed_bytes = self.scheduler.pack()  # on the CPU: oneDNN's copy of the projections, read when decoding
        if self.scheduler.fallback is not None:
            note(f"decoding: each sequence alone through the model's own forward ({self.scheduler.fallback})")
        elif self.packed_bytes:
            note(f"decoding: the invariant forward, {human_bytes(self.packed_bytes)} of projection weights packed")

    # --- the served copy ----------------------------------------------------------------

    def hold(self) -> Callable[[], None]:
        """One request's hold on the served model, from its admission to its last token; returns the function that
        lets go of it (once, however often it is called). Refused with the release's error while no model is
        served; held back while one copy is swapped for another."""
        with self._gate:
            while self._swapping and self._refusal is None:
                self._gate.wait()
            if self._refusal is not None:
                raise copy.copy(self._refusal)
            self._holds += 1
        done = threading.Event()

        def release() -> None:
            with self._gate:
                if done.is_set():
                    return
                done.set()
                self._holds -= 1
                self._gate.notify_all()

        return release

    @contextmanager
    def serving(self) -> Iterator[None]:
        """``hold`` for the length of a ``with`` block (a request answered in one piece)."""
        release = self.hold()
        try:
            yield
        finally:
            release()

    def swap(self, model: Any, *, refusal: KilnError, drain_s: float) -> int:
        """Serve ``model`` (None: no model) instead of the copy served now, and free that copy.

        New requests are held back -- refused with ``refusal`` when ``model`` is None -- while the requests in flight
        finish, for at most ``drain_s`` seconds; any still decoding then end with ``refusal``. The active adapter
        stays active, its layers bound to ``model`` (kept in host memory while no model is served). Returns how many
        requests were cut off. Callers swap from one thread (the job queue's)."""
        with self._gate:
            self._swapping = True
            if model is None:
                self._refusal = refusal
            self._gate.wait_for(lambda: self._holds == 0, timeout=drain_s)
            cut = self._holds
        old = self._model
        self.scheduler.retire(refusal)
        with self.lock, self._gate:
            self._epoch += 1
            self._attach(model)
            self._active = self._rebound(self._active)
            self._swapping = False
            self._refusal = None if model is not None else refusal
            self._gate.notify_all()
        if old is not None and old is not model:
            _free(old)
        return cut

    def _rebound(self, adapter: _Adapter | None) -> _Adapter | None:
        """``adapter`` with its layers bound to the served copy of this epoch (to no module, its weights in host
        memory, while none is served). Callers hold the lock."""
        if adapter is None or adapter.epoch == self._epoch:
            return adapter
        model = self._model
        device = self._device if model is not None else "cpu"
        layers = tuple(
            dataclasses.replace(layer, a=layer.a.to(device), b=layer.b.to(device)) for layer in adapter.layers
        )
        return dataclasses.replace(adapter, layers=layers, epoch=self._epoch)

    def _served(self) -> tuple[Any, Any, int]:
        """(model, device, epoch) of the copy served now; the release's error while none is."""
        with self._gate:
            if self._model is None:
                raise copy.copy(self._refusal) if self._refusal is not None else InternalError("no model is served")
            return self._model, self._device, self._epoch

    def forward_model(self, adapter: _Adapter | None) -> Any:
        """The model a forward with ``adapter`` runs on now (callers hold the lock): the served copy, refused while
        none is or when ``adapter`` is bound to a copy swapped out since (a request admitted before the swap)."""
        model, _, epoch = self._served()
        if adapter is not None and adapter.epoch != epoch:
            raise _swapped()
        return model

    # --- adapters -----------------------------------------------------------------------

    def active(self) -> dict[str, str] | None:
        """``LoadedAdapterIdentity`` of the served adapter, or None when serving the base model."""
        current = self._active
        return current.identity() if current else None

    def last_load_error(self, name: str) -> str | None:
        """Message of the most recent failed ``load`` of ``name`` (cleared by a successful one)."""
        return self._load_errors.get(name)

    def load(self, name: str, *, allow_quarantined: bool = False, reload: bool = False) -> dict[str, str]:
        """Serve ``name`` (``LoadAdapterResponse``); a failure keeps the adapter served before."""
        current = self._active
        if current is not None and current.name == name and not reload:
            return checked("LoadAdapterResponse", {"status": "loaded", **current.identity()})
        self._served()  # while the serving copy is released: serving_unavailable, not a load error of `name`
        try:
            adapter = self._read_adapter(name, allow_quarantined=allow_quarantined)
        except KilnError as exc:
            self._load_errors[name] = exc.message
            raise
        with self.lock, self._gate:
            self._active = self._rebound(adapter)  # a swap since it was read moved the served copy
        self._load_errors.pop(name, None)
        return checked("LoadAdapterResponse", {"status": "loaded", **adapter.identity()})

    def unload(self) -> dict[str, str]:
        """Serve the base model (``UnloadAdapterResponse``); a no-op when nothing is loaded."""
        with self.lock:
            self._active = None
        return checked("UnloadAdapterResponse", {"status": "unloaded"})

    # --- completions --------------------------------------------------------------------

    def adapter_named(self, name: str) -> _Adapter:
        """The active adapter when it is ``name``, else ``name`` read from the registry (not quarantined)."""
        current = self._active
        return current if current is not None and current.name == name else self._read_adapter(name)

    # --- evaluation ---------------------------------------------------------------------

    def answer(self, messages: list[dict[str, str]], *, max_tokens: int, seed: int, adapter: str | None) -> str:
        """The greedy answer to ``messages``, exactly as a chat completion with temperature 0 gives it: the base
        model's (``adapter`` None) or a registry adapter's, applied to this answer only (what an evaluation
        scores; the served adapter is left as it is)."""
        weights = None if adapter is None else self.adapter_named(adapter)
        prompt = self._encode_prompt(messages)
        room = self._max_positions - len(prompt)
        if room < 1:
            raise ContractError(
                [
                    Problem(
                        "out_of_range",
                        "/messages",
                        f"the prompt is {len(prompt)} tokens and the model's context is {self._max_positions}: no "
                        "room to generate; shorten the conversation",
                    )
                ]
            )
        model = weights.name if weights is not None else self._model_name
        plan = Plan(prompt, min(max_tokens, room), Sampling(), seed % SEEDS, weights, model)
        return "".join(piece.text for piece in self.pieces(plan, Outcome()))

    # --- canary -------------------------------------------------------------------------

    def run_canary(self, name: str) -> dict[str, Any]:
        """Run the serving canary of ``name``, write ``adapter_canary_status.json``, return it."""
        adapter = self._read_adapter(name, allow_quarantined=True)
        prompt = self._encode_prompt(list(CANARY_MESSAGES))
        checks: list[dict[str, Any]] = []
        warnings: list[str] = []

        def record(check: str, failure: str | None) -> bool:
            checks.append(
                {"name": check, "passed": True}
                if failure is None
                else {"name": check, "passed": False, "failure_reason": failure}
            )
            return failure is None

        if record("finite_logits", self._finite_logits_failure(adapter, prompt)):
            base_ids, base_s = self._timed_greedy(None, prompt)
            adapter_ids, adapter_s = self._timed_greedy(adapter, prompt)
            if adapter_ids is None:
                empty: str | None = "greedy generation produced non-finite logits"
            else:
                adapter_text = self._decode(_until_stop(adapter_ids, self._stop_ids))
                empty = (
                    None
                    if adapter_text.strip()
                    else f"greedy output ({CANARY_MAX_TOKENS} tokens at most) is empty after stripping: {adapter_text!r}"
                )
                if base_ids is not None and adapter_text == self._decode(_until_stop(base_ids, self._stop_ids)):
                    warnings.append(
                        f"greedy output with the adapter is identical to the base model's: {adapter_text!r}"
                    )
            if record("non_empty_output", empty):
                bound = LATENCY_FACTOR * base_s + LATENCY_SLACK_S
                slow = None
                if adapter_s > bound:
                    slow = f"{CANARY_MAX_TOKENS} tokens took {adapter_s:.3f} s with the adapter, over the bound {bound:.3f} s ({LATENCY_FACTOR:g} x base {base_s:.3f} s + {LATENCY_SLACK_S:g} s)"
                record("bounded_latency", slow)
        failed = [check for check in checks if not check["passed"]]
        status = {
            "schema_version": 1,
            "receipt_type": "kiln_adapter_canary_status",
            "adapter_name": name,
            "checked_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
            "adapter_model_sha256": adapter.weights_sha256,
            "status": "quarantined" if failed else "passed",
            "failure_reason": f"{failed[0]['name']}: {failed[0]['failure_reason']}" if failed else None,
            "warnings": warnings,
            "checks": checks,
        }
        adapter_directory(self._registry, name).write_canary_status(status)
        return status

    def _finite_logits_failure(self, adapter: _Adapter, prompt: list[int]) -> str | None:
        import torch

        with self.lock, torch.inference_mode():
            logits = sequence_logprobs(self.forward_model(adapter), prompt, lora_layers(adapter))
        bad = int((~torch.isfinite(logits)).sum())
        return f"{bad} of {logits.numel()} logits of the canary prompt are not finite" if bad else None

    def _timed_greedy(self, adapter: _Adapter | None, prompt: list[int]) -> tuple[list[int] | None, float]:
        """CANARY_MAX_TOKENS greedy tokens, stop tokens ignored so both timings cover equal work (None: non-finite)."""
        started = time.perf_counter()
        alone = Scheduler(self.forward_model(adapter), self.lock, self._stop_ids)  # alone, not beside the traffic
        try:
            ids: list[int] | None = [
                token for token, _ in alone.submit(prompt, adapter, Sampling(), 0, CANARY_MAX_TOKENS, stop=False)
            ]
        except NonFiniteLogitsError:
            ids = None
        return ids, time.perf_counter() - started

    # --- admission ----------------------------------------------------------------------

    def _encode_prompt(self, messages: list[dict[str, Any]], *, generation: bool = True) -> list[int]:
        """Chat-template render (with the generation prompt unless ``generation`` is false); message text spelling a
        special token stays text."""
        full = self._render(messages, generation)
        slots: list[str] = []
        base = "kilnslot"
        while base in full:
            base += "x"
        swapped = []
        for message in messages:
            content = message["content"]
            if any(special in content for special in self._specials):
                slots.append(content)
                content = f"{base}{len(slots) - 1}q"
            swapped.append({**message, "content": content})
        data: list[tuple[int, int]] = []
        if slots:
            spans = match_skeleton(
                re.split(re.escape(base) + r"(\d+)q", self._render(swapped, generation)), slots, full
            )
            if spans is None:
                raise ContractError(
                    [
                        Problem(
                            "schema_violation",
                            "/messages",
                            "message text spells a special token and the chat template does not insert it verbatim, so it cannot be kept apart from the template's own delimiters",
                        )
                    ],
                    document=REQUEST,
                )
            data = [span for span in spans if span[0] < span[1]]
        cuts = sorted({0, len(full), *(p for span in data for p in span)})
        pieces = [(full[a:b], any(s <= a and b <= e for s, e in data)) for a, b in itertools.pairwise(cuts) if a < b]
        ids: list[int] = []
        for text, is_data in pieces:
            ids.extend(
                int(i)
                for i in self._tokenizer(text, add_special_tokens=False, split_special_tokens=is_data)["input_ids"]
            )
        if not ids:
            raise ContractError(
                [Problem("schema_violation", "/messages", "the rendered prompt is empty")], document=REQUEST
            )
        return ids

    def _render(self, messages: list[dict[str, Any]], generation: bool = True) -> str:
        try:
            text = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        except template_errors() as exc:
            raise ContractError(
                [Problem("schema_violation", "/messages", f"the chat template rejected the conversation: {exc}")],
                document=REQUEST,
            ) from None
        if not isinstance(text, str):
            raise InternalError("the chat template did not render text")
        return text

    # --- decoding -----------------------------------------------------------------------

    def pieces(self, plan: Plan, outcome: Outcome, *, top_k: int | None = None, first: Any = None) -> Iterator[Piece]:
        """The decoding of every route: text increments of one choice, with the tokens behind them.

        The sequence is submitted to the scheduler now (so choices created together decode together); the
        increments come as the iterator is pulled. With ``top_k`` every generated token carries its log-probability
        (temperature 1, before ``top_p``) and its ``top_k`` most likely alternatives. An end-of-turn token ends the
        choice (``outcome.finish_reason`` ``stop``), counts in ``completion_tokens`` and is no piece's token.
        ``first`` (the log-probabilities after the last prompt token, when the caller already ran the prompt
        forward to score it) picks the first token; for a one-token answer no forward runs.
        """
        with self._gate:  # the scheduler of the copy the plan's adapter is bound to, or none
            if plan.adapter is not None and plan.adapter.epoch != self._epoch:
                raise _swapped()
            scheduler = self.scheduler
        stream = scheduler.submit(
            plan.prompt_ids, plan.adapter, plan.sampling, plan.seed, plan.max_new, top_k=top_k, first=first
        )
        return self._pieces(stream, plan, outcome)

    def _pieces(self, stream: Stream, plan: Plan, outcome: Outcome) -> Iterator[Piece]:
        detok = _Detokenizer(self._decode)
        held: list[TokenScore] = []
        try:
            for token, score in stream:
                outcome.completion_tokens += 1
                if token in self._stop_ids:
                    outcome.finish_reason = "stop"
                    break
                held.append(TokenScore(token, *score) if score else TokenScore(token))
                delta = detok.push(token)
                if delta:
                    yield Piece(delta, held)
                    held = []
        except NonFiniteLogitsError:
            if plan.adapter is None:
                raise InternalError("the base model produced non-finite logits") from None
            raise AdapterError(
                f"adapter {plan.adapter.name!r} produced non-finite logits",
                hint=f"run its canary; a quarantined adapter is only served with allow_quarantined ({plan.adapter.name})",
            ) from None
        finally:
            stream.close()
        tail = detok.flush()
        if tail or held:
            yield Piece(tail, held)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def logprobs(self, prompt: list[int], adapter: _Adapter | None) -> Any:
        """``[len(prompt), V]`` float32 log-probabilities of ``prompt`` with ``adapter`` (None: base) from one forward
        under the lock -- the invariant forward, so the same bits as the scheduler's draws read and a trainer's
        recomputation -- on the host."""
        import torch

        with self.lock, torch.inference_mode():
            return sequence_logprobs(self.forward_model(adapter), prompt, lora_layers(adapter)).cpu()

    # --- reading adapters ---------------------------------------------------------------

    def _read_adapter(self, name: str, *, allow_quarantined: bool = False) -> _Adapter:
        """Read, verify and materialise a registry adapter (see the module docstring for the order)."""
        model, device, epoch = self._served()  # the copy its layers are bound to
        directory = adapter_directory(self._registry, name)  # adapter_not_found
        if attempt_record(directory.path):
            raise NotFoundError(
                f"{name!r} holds only the receipt of a run that published no adapter (a failed run or a dry run): "
                "there is no adapter to serve",
                code="adapter_not_found",
                hint=f"its receipt says why; a successful run of {name!r} replaces the record",
            )
        files = directory.read()  # adapter_invalid: the manifest against the bytes read, the LoRA config
        canary = directory.canary_status()
        if not allow_quarantined and canary is not None and canary["status"] == "quarantined":
            raise AdapterError(
                f"adapter {name!r} is quarantined by its serving canary: {canary['failure_reason']}",
                hint="load it explicitly with allow_quarantined: true to serve it anyway",
            )
        return _Adapter(
            name=name,
            content_revision=files.content_revision,
            manifest_sha256=files.manifest_sha256,
            weights_sha256=files.weights_sha256,
            layers=self._lora_layers(files, model, device),
            epoch=epoch,
        )

    def _lora_layers(self, files: AdapterFiles, model: Any, device: Any) -> tuple[Lora, ...]:
        import torch
        from safetensors import SafetensorError
        from safetensors.torch import load as load_tensors
        from transformers.pytorch_utils import Conv1D

        def invalid(why: str) -> AdapterError:
            return AdapterError(f"adapter {files.name!r}: {why}")

        config = files.config
        if config.peft_type != "LORA":
            raise invalid(f"{CONFIG_FILE} peft_type is {config.peft_type!r}; only LORA adapters are served")
        # fan_in_fan_out is how peft adapts GPT-2's Conv1D (its weight is stored transposed); it changes only how
        # a merge would lay out the delta, so it is accepted exactly when every adapted module is a Conv1D
        transposed = "fan_in_fan_out" in config.enabled
        used = [key for key in UNSUPPORTED_CONFIG if key in config.enabled and key != "fan_in_fan_out"]
        if used:
            raise invalid(f"{CONFIG_FILE} uses {', '.join(used)}, which the Kiln server does not apply")
        try:
            tensors = load_tensors(files.weights_bytes)
        except (SafetensorError, ValueError, RuntimeError) as exc:
            raise invalid(f"{WEIGHTS_FILE} is not a readable safetensors file: {exc}") from None
        pairs: dict[str, dict[str, Any]] = {}
        for key, tensor in tensors.items():
            match = _KEY.match(key)
            if match is None:
                raise invalid(f"{WEIGHTS_FILE} holds {key!r}, which is not a LoRA A/B weight of a linear layer")
            pairs.setdefault(match["path"], {})[match["ab"]] = tensor
        if not pairs:
            raise invalid(f"{WEIGHTS_FILE} holds no tensors")
        output_layer = model.get_output_embeddings() if config.all_linear else None
        layers = []
        for path, pair in sorted(pairs.items()):
            if set(pair) != {"A", "B"}:
                raise invalid(f"{WEIGHTS_FILE} has lora_{next(iter(pair))} of {path} without its partner")
            if not config.targets(path):
                raise invalid(
                    f"{WEIGHTS_FILE} adapts {path}, which is not among target_modules {config.target_modules!r}"
                )
            try:
                module = model.get_submodule(path)
            except AttributeError:
                raise invalid(
                    f"the served model has no module {path}; was the adapter trained on another base model?"
                ) from None
            conv = isinstance(module, Conv1D)
            if not isinstance(module, torch.nn.Linear) and not conv:
                raise invalid(f"{path} is a {type(module).__name__}, not a linear layer")
            if output_layer is not None and module is output_layer:
                raise invalid(f"{WEIGHTS_FILE} adapts the output layer {path}, which all-linear leaves out (as peft)")
            if conv != transposed:
                raise invalid(
                    f"{path} is a {type(module).__name__} but {CONFIG_FILE} has fan_in_fan_out {transposed}: peft "
                    "adapts Conv1D layers (and only those) with fan_in_fan_out true"
                )
            in_features, out_features = (
                module.weight.shape if conv else (module.in_features, module.out_features)
            )  # Conv1D stores its weight [in, out]
            a, b = pair["A"], pair["B"]
            r = a.shape[0] if a.dim() == 2 else -1
            expected_a, expected_b = (r, in_features), (out_features, r)
            if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
                raise invalid(
                    f"{path}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit a {in_features}->{out_features} linear layer"
                )
            rank = config.rank_for(path)
            if r != rank:
                given = f"r = {rank}" if rank == config.rank else f"rank_pattern's {rank} for it"
                raise invalid(f"{path}: LoRA rank {r} differs from {given} in {CONFIG_FILE}")
            layers.append(Lora(path, a.float().to(device), b.float().to(device), config.scale(r)))
        return tuple(layers)


# --- helpers ------------------------------------------------------------------------------


class Held:
    """The chunks of a streamed answer, holding the served model (``Generator.hold``) until they end, fail, are
    closed or are dropped (a client that went away)."""

    def __init__(self, chunks: Iterator[Any], release: Any):
        self._chunks = chunks
        self._release = weakref.finalize(self, release)

    def __iter__(self) -> Held:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._chunks)
        except BaseException:
            self._release()
            raise

    def close(self) -> None:
        close = getattr(self._chunks, "close", None)
        if close is not None:
            close()
        self._release()


def _swapped() -> CapacityError:
    return CapacityError(
        "the served model was swapped while this request was being answered (the serving copy was released for a "
        "training job, or loaded again after one)",
        code="serving_unavailable",
        hint="send the request again",
    )


def _free(model: Any) -> None:
    """Let a served copy go: its tensors onto the meta device (their memory is freed even if a straggling
    reference to the module remains), then the CUDA caching allocator's blocks back to the driver."""
    import gc

    import torch

    cuda = any(p.is_cuda for p in itertools.islice(model.parameters(), 1))
    model.to("meta")
    gc.collect()
    if cuda and torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Detokenizer:
    """Incremental decoding over a sliding window; text ending in an incomplete UTF-8 sequence waits."""

    def __init__(self, decode: Any):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token: int) -> str:
        self._ids.append(token)
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)

    def _step(self, *, final: bool) -> str:
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) > len(before) and (final or not text.endswith("\ufffd")):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(before) :]
        return ""


def _until_stop(ids: list[int], stop_ids: frozenset[int]) -> list[int]:
    for i, token in enumerate(ids):
        if token in stop_ids:
            return ids[:i]
    return ids


def checked(doc_type: str, value: dict[str, Any]) -> dict[str, Any]:
    """``value`` after validating it as ``doc_type``: the server never returns a document that breaks its schema."""
    found = contracts.problems(doc_type, value)
    if found:
        raise InternalError(f"the server built an invalid {doc_type}: {found[0]}")
    return value
