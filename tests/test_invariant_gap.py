"""The sampler and the trainer agree to the bit: the log-probability the one batched decoder reports for each token
it samples (``kiln.model.decode(..., logprobs=True)``) is exactly what the training forward recomputes for that token
-- with gradient, with and without activation checkpointing, in fp32 and bf16, LoRA attached -- over 64 sampled
completions, on the tiny model and on a 2-layer model of Qwen2.5-0.5B's shape. The gap is 0.0, not small."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import invariant as inv
from kiln.model import Decoder, Sampling, decode, load_base_model
from kiln.trainers._forwards import invariant_selected
from kiln.training import attach_lora, checkpoint_layers

COMPLETIONS = 64


def _qwen_shaped() -> torch.nn.Module:
    """Qwen2.5-0.5B's exact shape (hidden 896, 14 heads over 2 key/value heads of 64, MLP 4864, vocabulary 151,936,
    tied embeddings, rope theta 1e6) with 2 layers and random weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=2, num_attention_heads=14,
        num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, use_sliding_window=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2 or name.endswith(".bias"):
                param.normal_(0.0, 0.05)
    return model.eval()


def _with_lora(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` in ``dtype`` with Kiln's LoRA on every projection, B set nonzero so the adapter moves every row."""
    peft = attach_lora(model.to(dtype), rank=8, alpha=16.0, seed=3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return peft


def _gap(peft: torch.nn.Module, prompts: list[list[int]], max_new: int) -> list[float]:
    """The largest |sampled - recomputed| log-probability, once without and once with activation checkpointing."""
    decoded = decode(
        peft,
        prompts,
        max_new=[max_new] * len(prompts),
        sampling=Sampling(temperature=1.0),
        seed=11,
        sequences=list(range(len(prompts))),
        stop_ids=frozenset(),
        logprobs=True,
    )
    sequences = [p + d.ids for p, d in zip(prompts, decoded, strict=True)]
    wanted = [[q >= len(p) - 1 for q in range(len(s) - 1)] for p, s in zip(prompts, sequences, strict=True)]
    sampled = torch.tensor([lp for d in decoded for lp in d.logprobs])
    gaps = []
    for recompute in (False, True):
        if recompute:
            checkpoint_layers(peft.get_base_model())
        peft.train()
        decoder = Decoder.of(peft)
        with torch.enable_grad():
            found = invariant_selected(decoder, sequences, wanted)
            taken = inv.log_softmax(found.rows).gather(1, found.targets.unsqueeze(1)).squeeze(1)
            assert taken.requires_grad
            taken.sum().backward()  # a real training forward: its graph goes back to the LoRA tensors
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for n, p in peft.named_parameters() if "lora_" in n)
        gaps.append(float((taken.detach() - sampled).abs().max()))
        peft.zero_grad(set_to_none=True)
    return gaps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_trainer_recomputes_the_sampler_s_log_probabilities_exactly_on_the_tiny_model(tiny_model_dir, dtype):
    peft = _with_lora(load_base_model(tiny_model_dir).model, dtype)
    generator = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(3, 600, (int(n),), generator=generator).tolist()
        for n in torch.randint(2, 40, (COMPLETIONS,), generator=generator)
    ]
    assert _gap(peft, prompts, max_new=12) == [0.0, 0.0]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_trainer_recomputes_the_sampler_s_log_probabilities_exactly_at_qwen2_5_0_5b_shape(dtype):
    peft = _with_lora(_qwen_shaped(), dtype)
    generator = torch.Generator().manual_seed(6)
    prompts = [
        torch.randint(3, 150000, (int(n),), generator=generator).tolist()
        for n in torch.randint(2, 12, (COMPLETIONS,), generator=generator)
    ]
    assert _gap(peft, prompts, max_new=4) == [0.0, 0.0]
