"""Row-exact batched decoding: sequences with KV caches of their own, one forward per step for all of them, and
each row's logits bit for bit those of the same step of that sequence decoded alone.

A plain left-padded batch (attention mask, position ids) is not that. Measured on 5 chat prompts of 13-42 tokens,
16 greedy steps each, all in one batch: a row's logits differ from its lone decoding by up to 2.1e-7 on the tiny
model and 1.25e-6 on the benches' 23 M model, because the ops of a forward round differently at another batch
shape. ``RowBatch`` removes each cause by construction:

1. Prefill stays per sequence: the caller runs each prompt alone and hands its cache to ``add``.
2. The caches are stacked left-padded (``DynamicCache`` layers ``[B, kv_heads, L, head_dim]``): row r's keys are
   its last n_r positions. A step feeds every row its last token at position n_r, with no attention mask.
3. During that forward a ``TorchFunctionMode`` runs every op whose bits could depend on the batch around a row
   row by row, on the row's ``[1, ...]`` slice -- the very call the row's lone forward makes:
   * matrix products (``linear``, ``matmul`` by a shared matrix, ``addmm``): one row is a gemv, a batch a gemm,
     and they add in another order;
   * attention (``scaled_dot_product_attention``): each row attends to exactly its own keys, unpadded, unmasked;
   * transcendental elementwise functions (``exp``, ``sin``, ``cos``, ``tanh``, ``silu``, ``gelu``, ...) and
     ``softmax``: vector and scalar kernels differ in the last bit, and which elements of a row take which depends
     on where the row starts in the batch (the tiny model's 176-wide MLP: 1.2e-7 with these on the whole batch).
   Everything else runs on the whole batch: IEEE-exact elementwise ops (add, mul, 1/sqrt on x86 -- elsewhere
   ``rsqrt`` runs per row), copies, views, and reductions along a row (RMSNorm's ``mean``), whose kernel reduces
   each row with the same loop whatever the number of rows.
4. One row alone is the model's own forward, unchanged (no mode, no padding, no position ids): the lone decoding.

``step`` checks that attention ran through ``scaled_dot_product_attention`` once per cache layer with no mask
(transformers' ``sdpa`` implementation on a cache of plain ``DynamicLayer``s, i.e. no sliding window); a model or
cache that does not (eager attention, sliding windows, an attention bias) makes the batch step each row alone from
then on -- still exact, no longer batched. ``tests/test_server_batching.py`` compares rows stepped in batches with
their lone decoding bit for bit on Qwen2 (the tiny model), GPT-2 and Llama shapes; ``bench/bench_serving.py``
checks whole answers on the 23 M model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import platform
from typing import Any

__all__ = ["RowBatch"]


class _Unsupported(Exception):  # noqa: N818 - a signal inside this module, never raised to a caller
    """The forward did something a row-exact batch cannot reproduce per row."""


class RowBatch:
    """Decoding rows (any hashable keys) over ``model``; ``add`` and ``retain`` between ``step``s."""

    def __init__(self, model: Any):
        self._model = model
        self._extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
        self._batched = getattr(model.config, "_attn_implementation", None) == "sdpa"
        self.rows: list[Any] = []  # keys, in batch order
        self._lengths: list[int] = []  # tokens in each row's cache
        self._cache: Any = None  # the stacked cache: layers [B, kv_heads, L, head_dim], row r in its last n_r
        self._alone: dict[Any, Any] = {}  # each row's own cache, once the batch steps rows alone

    def add(self, entries: list[tuple[Any, Any, int]]) -> None:
        """Rows ``(key, cache, length)`` join: ``cache`` is the ``past_key_values`` of the row's prefill (left as it
        is: its tensors are copied), ``length`` the tokens it holds."""
        import torch
        from transformers.cache_utils import DynamicLayer

        if not entries:
            return
        if any(type(layer) is not DynamicLayer for _, cache, _ in entries for layer in cache.layers):
            self._step_alone()
        if not self._batched:
            for key, cache, length in entries:
                self.rows.append(key)
                self._lengths.append(length)
                self._alone[key] = copy.deepcopy(cache)
            return
        width = max([*self._lengths, *(length for _, _, length in entries)])
        stacked = _pairs(self._cache) if self.rows else []
        layers = []
        for i in range(len(entries[0][1].layers)):
            keys = [_left_pad(stacked[i][0], width)] if stacked else []
            values = [_left_pad(stacked[i][1], width)] if stacked else []
            for _, cache, _ in entries:
                keys.append(_left_pad(cache.layers[i].keys, width))
                values.append(_left_pad(cache.layers[i].values, width))
            layers.append((torch.cat(keys), torch.cat(values)))
        self._cache = _cache(layers)
        for key, _, length in entries:
            self.rows.append(key)
            self._lengths.append(length)

    def retain(self, keep: set[Any]) -> None:
        """Drop every row not in ``keep``, and the padding no remaining row needs."""
        import torch

        order = [i for i, key in enumerate(self.rows) if key in keep]
        if len(order) == len(self.rows):
            return
        for key in self.rows:
            if key not in keep:
                self._alone.pop(key, None)
        self.rows = [self.rows[i] for i in order]
        self._lengths = [self._lengths[i] for i in order]
        if not self._batched:
            return
        if not order:
            self._cache = None
            return
        index = torch.tensor(order, device=self._device())
        width = max(self._lengths)
        self._cache = _cache(
            [
                (
                    k.index_select(0, index)[:, :, k.shape[2] - width :],
                    v.index_select(0, index)[:, :, v.shape[2] - width :],
                )
                for k, v in _pairs(self._cache)
            ]
        )

    def step(self, tokens: list[int], weights: Any = None) -> list[Any]:
        """One step: ``tokens[r]`` is fed to ``rows[r]``; returns each row's float32 logits ``[V]`` (a tensor of its
        own). ``weights(indices)``, when given, is the context manager each forward runs in, for the rows it covers
        (indices into ``rows``): the caller's adapters. The caller holds whatever lock guards the model."""
        around = weights or (lambda indices: contextlib.nullcontext())
        if not self._batched:
            results = []
            for r, (key, token) in enumerate(zip(self.rows, tokens, strict=True)):
                with around([r]):
                    results.append(self._one(key, token))
            return results
        if len(self.rows) == 1:
            with around([0]):
                return [self._lone(tokens[0])]
        try:
            with around(list(range(len(self.rows)))):
                return self._together(tokens)
        except _Unsupported:
            self._step_alone()
            return self.step(tokens, weights)

    # --- the forwards -------------------------------------------------------------------

    def _device(self) -> Any:
        return self._cache.layers[0].keys.device

    def _lone(self, token: int) -> Any:
        """The model's own forward of one row, as decoding that sequence alone runs it."""
        import torch

        out = self._forward(input_ids=torch.tensor([[token]], device=self._device()))
        self._lengths[0] += 1
        return out.logits[0, -1].float().clone()

    def _together(self, tokens: list[int]) -> Any:
        import torch

        device = self._device()
        rows = _mode_class()([n + 1 for n in self._lengths])
        with rows:
            out = self._forward(
                input_ids=torch.tensor([[t] for t in tokens], device=device),
                position_ids=torch.tensor([[n] for n in self._lengths], device=device),
                check=lambda: rows.attentions == len(self._cache.layers),  # every attention ran per row
            )
        self._lengths = [n + 1 for n in self._lengths]
        logits = out.logits[:, -1].float()
        return [logits[r].clone() for r in range(len(tokens))]

    def _forward(self, *, check: Any = None, **inputs: Any) -> Any:
        """The model's forward on the stacked cache; on any failure the cache is as it was before."""
        before = _pairs(self._cache)
        try:
            out = self._model(**inputs, past_key_values=self._cache, use_cache=True, **self._extra)
            if check is not None and not check():
                raise _Unsupported
        except BaseException:
            self._cache = _cache(before)
            raise
        return out

    def _one(self, key: Any, token: int) -> Any:
        """A row's forward on its own cache (the batch steps rows alone)."""
        import torch

        cache = self._alone[key]
        out = self._model(
            input_ids=torch.tensor([[token]], device=cache.layers[0].keys.device),
            past_key_values=cache,
            use_cache=True,
            **self._extra,
        )
        self._alone[key] = out.past_key_values
        return out.logits[0, -1].float().clone()

    def _step_alone(self) -> None:
        """From now on every row steps alone, each with its own cache (split out of the stacked one)."""
        if not self._batched:
            return
        self._batched = False
        if self.rows:
            for r, key in enumerate(self.rows):
                n = self._lengths[r]
                self._alone[key] = _cache(
                    [
                        (k[r : r + 1, :, k.shape[2] - n :].clone(), v[r : r + 1, :, v.shape[2] - n :].clone())
                        for k, v in _pairs(self._cache)
                    ]
                )
        self._cache = None


# --- caches ---------------------------------------------------------------------------------


def _left_pad(tensor: Any, width: int) -> Any:
    from torch.nn.functional import pad

    return tensor if tensor.shape[2] == width else pad(tensor, (0, 0, width - tensor.shape[2], 0))


def _pairs(cache: Any) -> list[tuple[Any, Any]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache(pairs: list[tuple[Any, Any]]) -> Any:
    """A ``DynamicCache`` of ``pairs`` (copied: the model appends by building new tensors, never in place)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (keys, values) in enumerate(pairs):
        cache.update(keys, values, i)
    return cache


# --- the per-row mode -------------------------------------------------------------------------

# Elementwise functions whose vector and scalar kernels may round differently. 1/sqrt is correctly rounded by both
# on x86 (a division of a square root); elsewhere a vector unit may estimate it, so it runs per row there.
_ELEMENTWISE = ("exp", "expm1", "log", "log1p", "sin", "cos", "tan", "tanh", "sigmoid", "erf", "erfc") + (
    () if platform.machine() in ("x86_64", "AMD64") else ("rsqrt",)
)
_WITHIN_ROW = ("softmax", "log_softmax")  # along a dim: per row unless across rows (mean and sum, below, are not)


@functools.cache
def _mode_class() -> Any:
    """The ``TorchFunctionMode`` of a batched step (built on first use: torch is imported lazily)."""
    import torch
    from torch.nn import functional
    from torch.overrides import TorchFunctionMode

    def batched(mode: Any, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == mode.batch

    def first_rows(mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(x, *rest)`` row by row: an op on the last dims of ``x`` with shared other arguments."""
        if not batched(mode, args[0]):
            return func(*args, **kwargs)
        x = args[0]
        return torch.cat([func(x[r : r + 1], *args[1:], **kwargs) for r in range(mode.batch)])

    def elementwise_rows(mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if any(isinstance(a, torch.Tensor) and a.dim() > 0 for a in args[1:]):  # a second operand: as it is
            return func(*args, **kwargs)
        return first_rows(mode, func, args, kwargs)

    def power_rows(mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
        if isinstance(exponent, int | float) and exponent == 2:  # x * x in every kernel
            return func(*args, **kwargs)
        return elementwise_rows(mode, func, args, kwargs)

    def matrix_rows(mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``x @ w`` (``matmul``) with a shared 2-D ``w``, or ``addmm(bias, x, w)`` (GPT-2's ``Conv1D``)."""
        at = 1 if func is torch.addmm else 0
        x, w = args[at], args[at + 1]
        if not batched(mode, x) or not isinstance(w, torch.Tensor) or w.dim() != 2 or (at and x.dim() != 2):
            return func(*args, **kwargs)
        return torch.cat([func(*args[:at], x[r : r + 1], *args[at + 1 :], **kwargs) for r in range(mode.batch)])

    def within_rows(mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        dims = dim if isinstance(dim, list | tuple) else [dim]
        if dim is None or any(not isinstance(d, int) or d % args[0].dim() == 0 for d in dims):
            return func(*args, **kwargs)  # a reduction across rows (none happens in a decoding step)
        return first_rows(mode, func, args, kwargs)

    def attention(mode: Any, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if len(args) != 3 or kwargs.get("attn_mask") is not None or kwargs.get("is_causal"):
            raise _Unsupported
        query, key, value = args
        width = key.shape[2]
        if query.shape[0] != mode.batch or query.shape[2] != 1 or width < max(mode.lengths):
            raise _Unsupported
        mode.attentions += 1
        return torch.cat(
            [
                func(
                    query[r : r + 1],
                    key[r : r + 1, :, width - n :].contiguous(),
                    value[r : r + 1, :, width - n :].contiguous(),
                    **kwargs,
                )
                for r, n in enumerate(mode.lengths)
            ]
        )

    table: dict[Any, Any] = {
        functional.linear: first_rows,
        functional.layer_norm: first_rows,
        functional.silu: first_rows,
        functional.gelu: first_rows,
        functional.softplus: first_rows,
        functional.mish: first_rows,
        functional.softmax: within_rows,
        functional.log_softmax: within_rows,
        functional.scaled_dot_product_attention: attention,
        torch.matmul: matrix_rows,
        torch.Tensor.matmul: matrix_rows,
        torch.Tensor.__matmul__: matrix_rows,
        torch.addmm: matrix_rows,
        torch.pow: power_rows,
        torch.Tensor.pow: power_rows,
    }
    if hasattr(functional, "rms_norm"):
        table[functional.rms_norm] = first_rows
    for name in _ELEMENTWISE:
        table[getattr(torch, name)] = elementwise_rows
        table[getattr(torch.Tensor, name)] = elementwise_rows
    for name in _WITHIN_ROW:
        table[getattr(torch, name)] = within_rows
        table[getattr(torch.Tensor, name)] = within_rows

    class PerRow(TorchFunctionMode):
        """Runs the ops of ``table`` row by row; every other op on the whole batch."""

        def __init__(self, lengths: list[int]):
            super().__init__()
            self.batch = len(lengths)
            self.lengths = lengths  # each row's keys, this step's token included
            self.attentions = 0

        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            per_row = table.get(func)
            if per_row is None:
                return func(*args, **kwargs)
            return per_row(self, func, args, kwargs)

    return PerRow
