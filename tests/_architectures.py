"""Tiny random causal-LM directories of many Hugging Face architecture families, built at test time.

The architecture matrix test needs real model directories of each family Kiln claims to train, without
downloading anything. ``build(family, directory)`` writes one: a two-layer, 64-wide model of that family whose
weights come from an explicit seed, saved as ``config.json`` + ``model.safetensors`` next to the tokenizer of
Kiln's tiny default model (same vocabulary, special tokens and chat template), so
``kiln.model.load_base_model`` opens it like any other local model.

The weights are scaled up (``weight_scale``) so the logits are as large as a trained model's; small random
weights give near-uniform distributions that hide mistakes in how logits are computed. Families that change
the logits after the output head (Gemma's final soft-capping, Granite's and Cohere's logit scales) are built
with non-default values, and ``post_processing(family)`` says what that step is, so a test can check code that
computes logits from the hidden states itself.

``python tests/_architectures.py`` builds every family and checks that step against each model's own forward.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "gpt2",
    "cohere",
    "phi",
)

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
POSITIONS = 256
SLIDING_WINDOW = 128

GEMMA_SOFTCAP = 2.0  # below the largest logits (about 5), so the cap bends them
GRANITE_LOGITS_SCALING = 4.0
COHERE_LOGIT_SCALE = 0.25

# Families whose checkpoints tie the output head to the input embedding; every other one gets its own head.
TIED = frozenset({"gpt2", "gemma2", "gemma3_text"})


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    """The tiny default model's tokenizer (trained from its built-in corpus once per process)."""
    from kiln.model._tiny import CHAT_TEMPLATE, build_tokenizer

    tok = build_tokenizer()
    assert tok.chat_template == CHAT_TEMPLATE
    return tok


def _token_ids() -> dict[str, int | None]:
    tok = tokenizer()
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def make_config(family: str) -> Any:
    """The transformers config of ``family``'s tiny model (float32, vocabulary of the tiny tokenizer)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    common: dict[str, Any] = {"vocab_size": len(tokenizer()), "dtype": "float32", **_token_ids()}
    if family == "gpt2":
        return transformers.GPT2Config(
            n_embd=HIDDEN,
            n_layer=LAYERS,
            n_head=HEADS,
            n_inner=INTERMEDIATE,
            n_positions=POSITIONS,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            **common,
        )
    shape: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": POSITIONS,
    }
    if family not in TIED:
        shape["tie_word_embeddings"] = False
    if family == "llama":
        return transformers.LlamaConfig(head_dim=HEAD_DIM, **shape, **common)
    if family == "mistral":
        return transformers.MistralConfig(head_dim=HEAD_DIM, sliding_window=SLIDING_WINDOW, **shape, **common)
    if family == "qwen2":
        return transformers.Qwen2Config(use_sliding_window=False, **shape, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=HEAD_DIM, use_sliding_window=False, **shape, **common)
    if family in ("gemma2", "gemma3_text"):
        config_class = transformers.Gemma2Config if family == "gemma2" else transformers.Gemma3TextConfig
        return config_class(
            head_dim=HEAD_DIM,
            query_pre_attn_scalar=HEAD_DIM,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=GEMMA_SOFTCAP,
            **shape,
            **common,
        )
    if family == "phi3":
        return transformers.Phi3Config(original_max_position_embeddings=POSITIONS, **shape, **common)
    if family == "olmo2":
        return transformers.Olmo2Config(**shape, **common)
    if family == "granite":
        return transformers.GraniteConfig(
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
            logits_scaling=GRANITE_LOGITS_SCALING,
            **shape,
            **common,
        )
    if family == "phi":  # the one family here whose output head has a bias
        return transformers.PhiConfig(
            resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, partial_rotary_factor=0.5, **shape, **common
        )
    return transformers.CohereConfig(logit_scale=COHERE_LOGIT_SCALE, **shape, **common)


def post_processing(family: str) -> dict[str, float]:
    """What ``family``'s ``ForCausalLM.forward`` does to ``lm_head``'s output for the built config.

    ``{"scale": s}`` multiplies the logits by ``s``; ``{"softcap": c}`` replaces ``z`` by ``c * tanh(z / c)``;
    when both are present the scale comes first. ``{}``: the head's output is the logits."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}")
    if family in ("gemma2", "gemma3_text"):
        return {"softcap": GEMMA_SOFTCAP}
    if family == "granite":
        return {"scale": 1.0 / GRANITE_LOGITS_SCALING}
    if family == "cohere":
        return {"scale": COHERE_LOGIT_SCALE}
    return {}


def head_logits(model: Any, family: str, input_ids: Any) -> Any:
    """Logits recomputed from the decoder's last hidden state, the output head and ``post_processing``."""
    import torch

    hidden = model.get_decoder()(input_ids=input_ids).last_hidden_state
    head = model.get_output_embeddings()
    z = hidden @ head.weight.T
    if getattr(head, "bias", None) is not None:
        z = z + head.bias
    steps = post_processing(family)
    if "scale" in steps:
        z = z * steps["scale"]
    if "softcap" in steps:
        cap = steps["softcap"]
        z = cap * torch.tanh(z / cap)
    return z


def _init_weights(model: Any, seed: int, weight_scale: float) -> None:
    """Matrices and biases from N(0, 0.02) drawn in sorted parameter-name order, then scaled; norm weights keep
    their module's constant init."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if not param.is_floating_point():
                continue
            if param.dim() >= 2 or (name.endswith(".bias") and "norm" not in name.lower()):
                param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.02 * weight_scale)
            else:
                assert bool((param == param.flatten()[0]).all()), f"{name} has no constant init"


def build(family: str, directory: str | os.PathLike[str], *, seed: int = 0, weight_scale: float = 8.0) -> Path:
    """Write ``family``'s tiny model (weights from ``seed``, matrices scaled by ``weight_scale``) and the tiny
    tokenizer into ``directory`` (created if missing); returns its path."""
    import torch
    from transformers import AutoModelForCausalLM

    from kiln.model._tiny import quiet_hub

    quiet_hub()
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    config = make_config(family)
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):  # the library's own init draws from the global RNG
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed, weight_scale)
    model.generation_config.do_sample = False
    model.save_pretrained(target, safe_serialization=True)
    tokenizer().save_pretrained(target)
    return target


def _layer_leaf_names(model: Any) -> list[str]:
    """Leaf names of the Linear / Conv1D modules inside the decoder layers, in first-seen order."""
    import torch
    from transformers.pytorch_utils import Conv1D

    names: dict[str, None] = {}
    for name, module in model.get_decoder().named_modules():
        parts = name.split(".")
        if isinstance(module, torch.nn.Linear | Conv1D) and any(
            p in ("layers", "h") and i + 1 < len(parts) and parts[i + 1].isdigit() for i, p in enumerate(parts)
        ):
            names.setdefault(parts[-1], None)
    return list(names)


def _main() -> None:
    import tempfile
    import time

    import torch
    from safetensors.torch import load_file

    from kiln.model import load_base_model

    started = time.perf_counter()
    tok = tokenizer()
    print(f"tokenizer trained in {time.perf_counter() - started:.3f} s (cached for the process)")
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog. Question: What is the capital?")])
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    print(f"{'family':<12} {'build s':>8} {'params':>8} {'max|logit|':>10} {'rel err':>9} {'loss':>7}  layer linears")
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            started = time.perf_counter()
            path = build(family, Path(tmp) / family)
            elapsed = time.perf_counter() - started
            again = build(family, Path(tmp) / f"{family}-again")
            first, second = load_file(path / "model.safetensors"), load_file(again / "model.safetensors")
            assert first.keys() == second.keys()
            assert all(torch.equal(first[k], second[k]) for k in first), f"{family}: the same seed gave other weights"
            loaded = load_base_model(path)
            chat = loaded.tokenizer.apply_chat_template(messages, tokenize=True)
            chat_ids = chat["input_ids"] if hasattr(chat, "keys") else chat  # a BatchEncoding in transformers 5
            assert chat_ids[-2] == tok.eos_token_id, chat_ids  # ... "hello<|im_end|>\n"
            model = loaded.model
            with torch.no_grad():
                out = model(ids, labels=ids)
                mine = head_logits(model, family, ids)
            error = ((mine - out.logits).abs().max() / out.logits.abs().max()).item()
            assert error < 1e-4, f"{family}: logits not reproduced (relative error {error:.2e})"
            params = sum(p.numel() for p in model.parameters())
            print(
                f"{family:<12} {elapsed:>8.3f} {params:>8} {out.logits.abs().max().item():>10.3f} "
                f"{error:>9.1e} {out.loss.item():>7.3f}  {', '.join(_layer_leaf_names(model))}"
            )


if __name__ == "__main__":
    _main()
