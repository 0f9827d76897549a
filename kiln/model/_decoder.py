"""The invariant forward: Kiln's own decoder over a Hugging Face causal LM's weights, every op from the invariant set
(``kiln.kernels`` ``linear``, ``attention``, ``rms_norm``, ``layer_norm``, ``silu``, ``gelu_tanh``,
``log_softmax``), so a row's hidden states, logits and log-probabilities are the same bits however it was batched:
alone or beside other rows, right-padded, in one prefill or one position at a time, with or without gradient.

``Decoder.of(model)`` reads the model's structure -- the module tree of a family Kiln implements -- and proves it:
one probe forward of a fixed sequence must give the model's own logits (``model(ids).logits``) to within
``PROBE_TOLERANCE`` of their largest magnitude. A model it cannot run is ``Unsupported`` with the reason (the
callers fall back, visibly: the server decodes each row alone with the model's own forward). Families:

* ``llama``: Llama, Mistral, Qwen2, Qwen3 (``q_norm``/``k_norm``) -- pre-norm RMSNorm layers, rotary embeddings
  (the model's own ``inv_freq`` and ``attention_scaling``: default, linear, llama3 and yarn scaling; not the
  dynamic kinds), grouped-query attention with optional biases and sliding windows (a query at p sees the keys
  after ``p - window``, as transformers masks them), a gated MLP (``silu``, or GELU's tanh form);
* ``gpt2``: GPT-2 -- LayerNorm, learned positions, ``Conv1D`` projections, GELU's tanh form.

Refused: attention soft-capping or any other family, dynamic rotary scaling, quantized
(NF4) projections, peft LoRA variants (DoRA) and merged adapters.

What it computes, per layer, is the model's own arithmetic with the invariant ops in place of torch's: the
RMSNorm in float32 then ``weight * normed.to(dtype)``; ``q·cos + rotate_half(q)·sin`` with ``cos``/``sin`` read
from a table (``kiln.kernels.rope_table``: the same bits for a position whatever the batch); attention in float32;
the MLP in the weights' dtype; the head in the weights' dtype, then float32 and the config's logit map. LoRA:
each adapted projection adds ``B(A(x)) * scale`` to its output as peft does (input cast to the LoRA weights'
dtype, the sum cast back) -- from peft's live modules when the model is peft-wrapped (the adapter disabled inside
``disable_adapter()``), or per row from ``RowLoras`` (the server's adapters: rows of several adapters share a
forward, each row gets exactly its own delta). No dropout runs: the forward is the model's eval-mode function.

Caches are ``KVCache`` (``kiln.model._cache``): keys and values laid out by position (key j of a row at index j),
so a decoding step reads every row's keys in place; layers marked by ``kiln.training.checkpoint_layers`` are recomputed in the backward
pass when autograd records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kiln.kernels import invariant as inv
from kiln.model._cache import KVCache
from kiln.model._structure import decoder_of, logit_map_of

__all__ = [
    "PROBE_TOLERANCE",
    "Decoder",
    "RowLoras",
    "Unsupported",
]

LLAMA_FAMILY = frozenset({"llama", "mistral", "qwen2", "qwen3"})
GPT2_FAMILY = frozenset({"gpt2"})
PROBE_TOKENS = 12
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
PROBE_TOLERANCE_NARROW = 5e-2  # bf16 / fp16 weights round every product
ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
GATED_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


class Unsupported(Exception):  # noqa: N818 -- a reason, not a failure: callers fall back
    """This model's forward cannot run on the invariant operations; ``str()`` says why."""


# ----------------------------------------------------------------------------- model structure


def _causal(model: Any) -> Any:
    """The causal LM inside a peft wrapper (its LoRA layers in place), or ``model`` itself."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


# ----------------------------------------------------------------------------- projections and LoRA


@dataclasses.dataclass(frozen=True)
class _Projection:
    """One linear layer: ``path`` in the causal LM, the module found there (a peft LoRA layer or the plain layer),
    and the plain layer (``nn.Linear`` or GPT-2's ``Conv1D``, whose weight is stored ``[in, out]``)."""

    path: str
    module: Any
    base: Any
    conv: bool
    packed: list[torch.Tensor | None] = dataclasses.field(default_factory=lambda: [None])  # Decoder.pack's copy

    def weight(self) -> torch.Tensor:
        w: torch.Tensor = self.base.weight
        return w.t() if self.conv else w

    def live_loras(self) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """peft's active LoRA deltas on this layer ``(A, B, scale)``; none when it has none or they are disabled."""
        module = self.module
        if module is self.base or getattr(module, "disable_adapters", False):
            return []
        return [
            (module.lora_A[name].weight, module.lora_B[name].weight, float(module.scaling[name]))
            for name in module.active_adapters
            if name in module.lora_A
        ]


@dataclasses.dataclass(frozen=True)
class RowLoras:
    """Per row of a forward, the LoRA layers that apply to it: ``rows[r]`` maps a projection's path to
    ``(A, B, scale)`` (an empty mapping: the base model). Rows that share an adapter share one delta product."""

    rows: Sequence[dict[str, tuple[torch.Tensor, torch.Tensor, float]]]

    def groups(self, path: str) -> Iterator[tuple[list[int], tuple[torch.Tensor, torch.Tensor, float]]]:
        """``(row indices, (A, B, scale))`` for each distinct LoRA of ``path`` among the rows."""
        seen: dict[tuple[int, int, float], tuple[list[int], tuple[torch.Tensor, torch.Tensor, float]]] = {}
        for r, layers in enumerate(self.rows):
            layer = layers.get(path)
            if layer is not None:
                seen.setdefault((id(layer[0]), id(layer[1]), layer[2]), ([], layer))[0].append(r)
        yield from seen.values()


def _project(proj: _Projection, x: torch.Tensor, loras: RowLoras | None) -> torch.Tensor:
    """The projection of ``x`` ``[B, T, K]`` with its base weights, then each LoRA's ``B(A(x)) * scale`` as peft
    adds it (``x`` cast to the LoRA's dtype, the sum cast back to the base output's)."""
    bias = proj.base.bias
    y = inv.linear(x, proj.weight(), bias, packed=proj.packed[0])
    live = proj.live_loras()
    if live:
        dtype = y.dtype
        for a, b, scale in live:
            y = y + inv.linear(inv.linear(x.to(a.dtype), a), b) * scale
        y = y.to(dtype)
    if loras is not None:
        for rows, (a, b, scale) in loras.groups(proj.path):
            index = torch.tensor(rows, device=x.device)
            part = x.index_select(0, index).to(a.dtype)
            delta = inv.linear(inv.linear(part, a), b) * scale
            y = y.index_copy(0, index, (y.index_select(0, index) + delta).to(y.dtype))
    return y


@dataclasses.dataclass(frozen=True)
class _Step:
    """Where a forward's keys and values go: the cache, and each batch row's slot (rows ``0..B-1`` of the forward
    are slots ``first..first+B-1``); ``rows`` ``[B, T]`` each query's batch row, ``seen`` the highest position + 1."""

    cache: KVCache
    first: int
    rows: torch.Tensor
    seen: int


# ----------------------------------------------------------------------------- the decoder


@dataclasses.dataclass
class _Layer:
    module: Any
    norms: tuple[Any, ...]
    projections: dict[str, _Projection]
    q_norm: Any = None
    k_norm: Any = None


class Decoder:
    """The invariant forward of one model (see the module docstring). Build it with ``Decoder.of``."""

    def __init__(self, model: Any):
        # no reference to ``model`` itself is kept (only to its modules): a cache keyed weakly by the model can let go
        causal = _causal(model)
        self.architecture = type(causal).__name__
        config = causal.config
        self.config = config
        family = getattr(config, "model_type", None)
        if family in LLAMA_FAMILY:
            self.family = "llama"
        elif family in GPT2_FAMILY:
            self.family = "gpt2"
        else:
            raise Unsupported(
                f"{type(causal).__name__} ({family}): Kiln's invariant forward implements Llama, Mistral, Qwen2, Qwen3 and GPT-2"
            )
        body = decoder_of(causal)
        head = causal.get_output_embeddings()
        if body is None or head is None:
            raise Unsupported(f"{type(causal).__name__}: no decoder stack or output head Kiln can reach")
        self.body = body
        self.head = _plain_module(head, "lm_head")
        self._head_projection = _Projection("lm_head", self.head, self.head, False)
        self.logit_map = logit_map_of(config)
        self._paths = {id(module): name for name, module in causal.named_modules()}
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.family == "llama":
            self._read_llama(config)
        else:
            self._read_gpt2(config)
        self.vocab = int(self.head.weight.shape[0])

    # --- reading the structure --------------------------------------------------------------

    def _projection(self, module: Any) -> _Projection:
        from transformers.pytorch_utils import Conv1D

        base = getattr(module, "base_layer", module)
        if getattr(module, "merged", False):
            raise Unsupported(f"{self._paths.get(id(module))}: a merged LoRA adapter")
        if (
            any(getattr(module, "use_dora", {}).values())
            if isinstance(getattr(module, "use_dora", None), dict)
            else False
        ):
            raise Unsupported(f"{self._paths.get(id(module))}: a DoRA adapter")
        if type(base) is not torch.nn.Linear and not isinstance(base, Conv1D):
            raise Unsupported(f"{self._paths.get(id(module))} is a {type(base).__name__} (quantized or custom)")
        for dropout in getattr(module, "lora_dropout", {}).values():
            if float(getattr(dropout, "p", 0.0)) > 0:
                raise Unsupported(f"{self._paths.get(id(module))}: LoRA dropout (the invariant forward runs none)")
        return _Projection(self._paths[id(module)], module, base, isinstance(base, Conv1D))

    def _read_llama(self, config: Any) -> None:
        kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * len(self.body.layers))
        if any(kind not in ("full_attention", "sliding_attention") for kind in kinds):
            raise Unsupported(f"{config.model_type}: attention layers of kinds {sorted(set(kinds))}")
        window = getattr(config, "sliding_window", None)
        if config.model_type == "mistral" and window:  # Mistral windows every layer
            kinds = ["sliding_attention"] * len(kinds)
        size = window if isinstance(window, int) and window > 0 else 0
        if "sliding_attention" in kinds and not size:
            raise Unsupported(f"{config.model_type}: sliding-window layers without a window size")
        self.windows = [size if kind == "sliding_attention" else 0 for kind in kinds]
        activation = GATED_ACTIVATIONS.get(str(getattr(config, "hidden_act", "")))
        if activation is None:
            raise Unsupported(f"{config.model_type}: activation {getattr(config, 'hidden_act', None)!r}")
        self.activation = activation
        rotary = getattr(self.body, "rotary_emb", None)
        rope_type = getattr(rotary, "rope_type", None)
        if rotary is None or rope_type not in ROPE_TYPES:
            raise Unsupported(f"{config.model_type}: rotary embedding type {rope_type!r}")
        self.inv_freq = rotary.inv_freq.detach().float()
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.embed = self.body.embed_tokens
        self.final_norm = self.body.norm
        self.layers: list[_Layer] = []
        for layer in self.body.layers:
            attn, mlp = layer.self_attn, layer.mlp
            names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
            owners = (attn, attn, attn, attn, mlp, mlp, mlp)
            if not all(hasattr(owner, name) for owner, name in zip(owners, names, strict=True)):
                raise Unsupported(f"{config.model_type}: a layer without the q/k/v/o and gate/up/down projections")
            self.layers.append(
                _Layer(
                    layer,
                    (layer.input_layernorm, layer.post_attention_layernorm),
                    {n: self._projection(getattr(o, n)) for o, n in zip(owners, names, strict=True)},
                    getattr(attn, "q_norm", None),
                    getattr(attn, "k_norm", None),
                )
            )
        first = self.body.layers[0].self_attn
        self.head_dim = int(first.head_dim)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.scale = float(first.scaling)

    def _read_gpt2(self, config: Any) -> None:
        if getattr(config, "scale_attn_by_inverse_layer_idx", False) or getattr(
            config, "reorder_and_upcast_attn", False
        ):
            raise Unsupported("gpt2: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn")
        activation = GATED_ACTIVATIONS.get(str(getattr(config, "activation_function", "")))
        if activation != "gelu_tanh":
            raise Unsupported(f"gpt2: activation {getattr(config, 'activation_function', None)!r}")
        self.activation = activation
        self.embed = self.body.wte
        self.positions = self.body.wpe
        self.final_norm = self.body.ln_f
        self.layers = [
            _Layer(
                block,
                (block.ln_1, block.ln_2),
                {
                    "c_attn": self._projection(block.attn.c_attn),
                    "attn_proj": self._projection(block.attn.c_proj),
                    "c_fc": self._projection(block.mlp.c_fc),
                    "mlp_proj": self._projection(block.mlp.c_proj),
                },
            )
            for block in self.body.h
        ]
        first = self.body.h[0].attn
        self.windows = [0] * len(self.layers)
        self.head_dim = int(first.head_dim)
        self.heads = self.kv_heads = int(first.num_heads)
        self.scale = float(first.scaling)

    # --- the proof ----------------------------------------------------------------------------

    @classmethod
    def of(cls, model: Any) -> Decoder:
        """The invariant forward of ``model`` (a causal LM or its peft wrapper), proven against the model's own
        forward on a probe sequence; ``Unsupported`` with the reason otherwise."""
        decoder = cls(model)
        device = decoder.device
        ids = torch.tensor([[(7 * i + 3) % decoder.vocab for i in range(PROBE_TOKENS)]], device=device)
        with torch.no_grad():
            own = model(input_ids=ids).logits[0].float()
            ours = decoder.logits(decoder.hidden(ids)[0])
        error = float((own - ours).abs().max() / own.abs().max().clamp_min(1.0))
        tolerance = PROBE_TOLERANCE.get(decoder.head.weight.dtype, PROBE_TOLERANCE_NARROW)
        if not error <= tolerance:
            raise Unsupported(
                f"{decoder.architecture}: Kiln's invariant forward differs from the model's own by "
                f"{error:.3g} of its largest logit (tolerance {tolerance:g})"
            )
        decoder.probe_error = error
        return decoder

    probe_error: float = 0.0

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    def new_cache(self) -> KVCache:
        """An empty cache for this model's layers, in the dtype its keys are computed in."""
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, self._compute_dtype(), self.device)

    def pack(self) -> int:
        """Keep oneDNN's blocked copy of every frozen CPU projection weight (and the head's), which decoding then reads
        instead of reordering the weight at each product -- the same bits (``kiln.kernels.invariant.pack``), at the
        memory of a second copy of those weights. Returns the bytes the copies hold. For a serving copy, whose
        weights never change; a trainer's forwards never use it."""
        held = 0
        for projection in [*(p for layer in self.layers for p in layer.projections.values()), self._head_projection]:
            if projection.packed[0] is None and not projection.base.weight.requires_grad:
                projection.packed[0] = inv.pack(projection.weight())
                if projection.packed[0] is not None:
                    held += projection.weight().numel() * projection.weight().element_size()
        return held

    def _compute_dtype(self) -> torch.dtype:
        dtype: torch.dtype = self.embed.weight.dtype
        return dtype

    # --- the forward ----------------------------------------------------------------------------

    def hidden(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        *,
        cache: KVCache | None = None,
        first_slot: int = 0,
        loras: RowLoras | None = None,
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """The final hidden states ``[B, T, H]`` (after the last norm) of ``ids`` ``[B, T]`` at ``positions``
        ``[B, T]`` (default ``0..T-1`` on every row -- a right-padded batch of whole sequences -- or, after ``past``,
        ``P..P+T-1``).

        With a ``cache`` the rows are its slots ``first_slot..first_slot+B-1``: their keys and values are written
        at ``positions`` and each query attends to its slot's keys ``0..position`` (earlier positions must be in
        the cache). With ``past`` (``prefix``'s per-layer keys and values of positions ``0..P-1``, batch 1 or B)
        each row continues that prefix: a row's bits are those of its whole sequence in one forward, and the
        gradient flows into the one prefix forward. Otherwise each row attends to its own ``ids``."""
        return self._run(ids, positions, cache=cache, first_slot=first_slot, loras=loras, past=past)[0]

    def prefix(
        self, ids: torch.Tensor, loras: RowLoras | None = None
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """``(hidden [B, P, H], per-layer (keys, values))`` of ``ids`` ``[B, P]`` (positions ``0..P-1``), the keys
        and values kept (with gradient, when autograd records) for ``hidden(..., past=)``."""
        hidden, kept = self._run(ids, None, loras=loras, keep=True)
        return hidden, kept

    def _run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None,
        *,
        cache: KVCache | None = None,
        first_slot: int = 0,
        loras: RowLoras | None = None,
        past: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
        keep: bool = False,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        batch, length = ids.shape
        if positions is None:
            start = 0 if past is None else int(past[0][0].shape[2])
            positions = torch.arange(start, start + length, device=ids.device).unsqueeze(0).expand(batch, -1)
        seen = int(positions.max()) + 1
        step = None
        if cache is not None:
            cache.reserve(first_slot + batch, seen)
            rows = torch.arange(batch, device=ids.device).unsqueeze(1).expand_as(positions)
            step = _Step(cache, first_slot, rows, seen)
        h = torch.nn.functional.embedding(ids, self.embed.weight)
        if self.family == "gpt2":
            h = h + torch.nn.functional.embedding(positions, self.positions.weight)
            rope = None
        else:
            rope = self._rope_at(positions, seen, h.dtype)
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        for index, layer in enumerate(self.layers):
            before = None if past is None else past[index]
            if torch.is_grad_enabled() and getattr(layer.module, "_kiln_recomputed", False) and step is None:
                from torch.utils.checkpoint import checkpoint

                h, kv = checkpoint(
                    self._layer, index, h, positions, rope, step, loras, before, keep, use_reentrant=False
                )
            else:
                h, kv = self._layer(index, h, positions, rope, step, loras, before, keep)
            if kv is not None:
                kept.append(kv)
        return self._norm(self.final_norm, h), kept

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N, V]`` float32 logits of final hidden states ``rows`` ``[N, H]``: the head (and its bias) in the
        weights' dtype, then float32 and the config's logit map (scale, soft-cap)."""
        packed = self._head_projection.packed[0]
        logits = inv.linear(rows, self.head.weight, self.head.bias, packed=packed).float()
        if self.logit_map.scale != 1.0:
            logits = logits * self.logit_map.scale
        if self.logit_map.softcap is not None:
            logits = inv.tanh(logits / self.logit_map.softcap) * self.logit_map.softcap
        return logits

    def _norm(self, norm: Any, h: torch.Tensor) -> torch.Tensor:
        """The model's norm module on ``h``: RMSNorm (``weight * normed.to(dtype)``) or LayerNorm, in float32."""
        dtype = h.dtype
        wide = h if dtype == torch.float32 else h.float()
        if self.family == "gpt2":
            normed = inv.layer_norm(wide, float(norm.eps))
            out = normed * norm.weight.float() + norm.bias.float()
            return out if dtype == torch.float32 else out.to(dtype)
        eps = getattr(norm, "variance_epsilon", None)
        if eps is None:
            eps = norm.eps
        normed = inv.rms_norm(wide, float(eps))
        return norm.weight * (normed if dtype == torch.float32 else normed.to(dtype))

    def _rope_at(self, positions: torch.Tensor, needed: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed sin)`` ``[B, 1, T, head_dim]`` of ``positions`` from the table (grown to cover ``needed``
        positions); the sin's first half negated, so that ``rotate_half(x) * sin`` is ``x.roll(half) * signed`` --
        the same products, since negation is exact."""
        if self._rope is None or self._rope[0].shape[0] < needed:
            size = max(needed, 2 * (self._rope[0].shape[0] if self._rope is not None else 0), 256)
            cos, sin = inv.rope_table(self.inv_freq.to(self.device), size, self.rope_scale)
            half = sin.shape[-1] // 2
            self._rope = (cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1))
        cos, sin = self._rope
        return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)

    def _layer(
        self,
        index: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        step: _Step | None,
        loras: RowLoras | None,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        keep: bool,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        layer = self.layers[index]
        p = layer.projections
        batch, length, _ = h.shape
        x = self._norm(layer.norms[0], h)
        if self.family == "gpt2":
            q, k, v = _project(p["c_attn"], x, loras).split(self.heads * self.head_dim, dim=-1)
        else:
            q, k, v = (_project(p[name], x, loras) for name in ("q_proj", "k_proj", "v_proj"))
        q = q.view(batch, length, self.heads, self.head_dim)
        k = k.view(batch, length, self.kv_heads, self.head_dim)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        if layer.q_norm is not None:
            q = self._norm(layer.q_norm, q)
        if layer.k_norm is not None:
            k = self._norm(layer.k_norm, k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if rope is not None:
            cos, signed = rope
            half = self.head_dim // 2
            q = (q * cos) + (q.roll(half, -1) * signed)
            k = (k * cos) + (k.roll(half, -1) * signed)
        kept = (k, v) if keep else None
        if step is not None:
            keys, values = self._cached(index, step, positions, k, v)
        elif past is not None:
            before_k, before_v = past
            keys = torch.cat([before_k.expand(batch, -1, -1, -1), k], dim=2)
            values = torch.cat([before_v.expand(batch, -1, -1, -1), v], dim=2)
        else:
            keys, values = k, v
        a = inv.attention(q, keys, values, positions, self.scale, self.windows[index] or None)
        a = a.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)
        h = h + _project(p["attn_proj" if self.family == "gpt2" else "o_proj"], a, loras)
        x = self._norm(layer.norms[1], h)
        if self.family == "gpt2":
            m = _project(p["mlp_proj"], inv.gelu_tanh(_project(p["c_fc"], x, loras).float()).to(x.dtype), loras)
        else:
            gate = _project(p["gate_proj"], x, loras)
            act = inv.silu(gate.float()) if self.activation == "silu" else inv.gelu_tanh(gate.float())
            m = _project(p["down_proj"], act.to(gate.dtype) * _project(p["up_proj"], x, loras), loras)
        return h + m, kept

    @staticmethod
    def _cached(
        index: int, step: _Step, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's keys and values into the cache; the keys and values its queries read."""
        batch = k.shape[0]
        keys = step.cache.keys[index][step.first : step.first + batch]
        values = step.cache.values[index][step.first : step.first + batch]
        keys.transpose(1, 2)[step.rows, positions] = k.transpose(1, 2).to(keys.dtype)
        values.transpose(1, 2)[step.rows, positions] = v.transpose(1, 2).to(values.dtype)
        return keys[:, :, : step.seen], values[:, :, : step.seen]


def _plain_module(module: Any, what: str) -> Any:
    base = getattr(module, "base_layer", module)
    if type(base) is not torch.nn.Linear:
        raise Unsupported(f"the {what} is a {type(base).__name__}, not a linear layer")
    return base
