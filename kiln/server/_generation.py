"""The generation engine of ``kiln serve``: chat completions, adapter load/unload, serving canary.

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

import inspect
import itertools
import re
import threading
import time
from collections.abc import Iterator
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
from kiln.errors import AdapterError, ContractError, InternalError, KilnError, NotFoundError, Problem
from kiln.model import Sampling
from kiln.model import max_positions as _max_positions
from kiln.model import special_tokens as _special_tokens
from kiln.model import stop_token_ids as _stop_ids
from kiln.server._batching import Lora, NonFiniteLogitsError, Scheduler, Stream, applied

__all__ = ["CANARY_FILE", "SEEDS", "Generator", "Outcome", "Piece", "Plan", "TokenScore", "checked", "content_revision"]

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
        self._model = loaded.model
        self._tokenizer = loaded.tokenizer
        self._registry = Path(registry)
        self._model_name = model_name
        self._active: _Adapter | None = None
        self._load_errors: dict[str, str] = {}
        first = next(self._model.parameters())
        self._device = first.device
        self._keep_last = "logits_to_keep" in inspect.signature(self._model.forward).parameters
        self._specials = _special_tokens(self._tokenizer)
        self._stop_ids = _stop_ids(self._model, self._tokenizer, self._specials)
        self._max_positions = _max_positions(self._model.config, self._tokenizer)
        self.scheduler = Scheduler(self._model, self.lock, self._stop_ids)  # every route's sequences decode here

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
        try:
            adapter = self._read_adapter(name, allow_quarantined=allow_quarantined)
        except KilnError as exc:
            self._load_errors[name] = exc.message
            raise
        with self.lock:
            self._active = adapter
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

        with self.lock, torch.inference_mode(), self._applied(adapter):
            logits = self._model(input_ids=torch.tensor([prompt], device=self._device)).logits
        bad = int((~torch.isfinite(logits)).sum())
        return f"{bad} of {logits.numel()} logits of the canary prompt are not finite" if bad else None

    def _timed_greedy(self, adapter: _Adapter | None, prompt: list[int]) -> tuple[list[int] | None, float]:
        """CANARY_MAX_TOKENS greedy tokens, stop tokens ignored so both timings cover equal work (None: non-finite)."""
        started = time.perf_counter()
        alone = Scheduler(self._model, self.lock, self._stop_ids)  # timed alone, not beside the served traffic
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
        stream = self.scheduler.submit(
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

    def _applied(self, adapter: _Adapter | None) -> Any:
        """Hook ``adapter`` onto its target modules for one forward pass (callers hold the lock)."""
        return applied(adapter)

    # --- reading adapters ---------------------------------------------------------------

    def _read_adapter(self, name: str, *, allow_quarantined: bool = False) -> _Adapter:
        """Read, verify and materialise a registry adapter (see the module docstring for the order)."""
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
            layers=self._lora_layers(files),
        )

    def _lora_layers(self, files: AdapterFiles) -> tuple[Lora, ...]:
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
        output_layer = self._model.get_output_embeddings() if config.all_linear else None
        layers = []
        for path, pair in sorted(pairs.items()):
            if set(pair) != {"A", "B"}:
                raise invalid(f"{WEIGHTS_FILE} has lora_{next(iter(pair))} of {path} without its partner")
            if not config.targets(path):
                raise invalid(
                    f"{WEIGHTS_FILE} adapts {path}, which is not among target_modules {config.target_modules!r}"
                )
            try:
                module = self._model.get_submodule(path)
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
            layers.append(Lora(module, a.float().to(self._device), b.float().to(self._device), config.scale(r)))
        return tuple(layers)


# --- helpers ------------------------------------------------------------------------------


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
