"""The invariant operations (``kiln.kernels.invariant``) and the invariant forward (``kiln.model.Decoder``): a row's
bits depend on that row only.

Each property is checked on both implementations: torch (the CPU's) and the Triton kernels (CUDA's), the latter on
CPU tensors in triton's interpreter (``TRITON_INTERPRET=1`` for the test; the kernels are decorated at their first
launch in each mode). Properties: a row alone equals the same row in batches of 2-32 rows at random positions; a
query decoded one position at a time (its keys from a cache) equals the same query inside a whole-sequence prefill,
across key chunks, with grouped-query heads and a sliding window; a model's rows are the same alone, in a batch,
step by step and in one forward (Qwen2 -- the tiny model --, Llama and GPT-2 shapes); and the exact elementwise
functions agree with float64 references to about an ulp, giving the same bits for an element wherever it sits.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kiln.kernels import exact
from kiln.kernels import invariant as inv


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch):
    """The implementation under test: torch's, or the Triton kernels in triton's interpreter."""
    if request.param == "torch":
        yield "torch"
        return
    pytest.importorskip("triton", reason="the Triton kernels need triton (pinned in the dev extra)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with inv.triton_backend():
        yield "triton"


LINEAR_SHAPES = {  # (K, N, Conv1D layout): the tiny model's, Qwen2.5-0.5B's, GPT-2's, and ragged ones
    "torch": [
        (64, 176, False),
        (64, 32, False),
        (896, 4864, False),
        (4864, 896, False),
        (768, 2304, True),
        (100, 70, False),
    ],
    "triton": [(64, 176, False), (64, 32, False), (100, 70, False), (48, 96, True)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_of_a_product_is_the_same_alone_and_in_any_batch(backend, dtype):
    if backend == "triton" and dtype == torch.bfloat16:
        pytest.skip("the interpreter has no bf16 arithmetic; bf16 products run on CUDA (scripts/qualify-gpu)")
    rng = random.Random(0)
    generator = torch.Generator().manual_seed(0)
    for k, n, conv in LINEAR_SHAPES[backend]:
        w = (torch.randn(k, n, generator=generator).t() if conv else torch.randn(n, k, generator=generator)).to(dtype)
        bias = torch.randn(n, generator=generator).to(dtype)
        row = torch.randn(k, generator=generator).to(dtype)
        alone = inv.linear(row[None], w, bias)[0]
        for count in (2, 3, 8, 9, 17, 32):
            x = torch.randn(count, k, generator=generator).to(dtype)
            at = rng.randrange(count)
            x[at] = row
            assert torch.equal(inv.linear(x, w, bias)[at], alone), (k, n, conv, count, at)
        reference = torch.nn.functional.linear(row[None].double(), w.double(), bias.double())[0]
        scale = float(reference.abs().max())
        assert float((alone.double() - reference).abs().max()) <= (1e-5 if dtype == torch.float32 else 2e-2) * scale


@pytest.mark.parametrize("heads", [(4, 2, 16), (14, 2, 64), (4, 4, 24)])
def test_a_decoded_query_is_the_same_query_of_a_prefill_and_of_any_batch(backend, heads):
    q_heads, kv_heads, dim = heads
    length = 80 if backend == "triton" else 150
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, q_heads, length, dim, generator=generator)
    k = torch.randn(1, kv_heads, length, dim, generator=generator)
    v = torch.randn(1, kv_heads, length, dim, generator=generator)
    positions = torch.arange(length)[None]
    scale = dim**-0.5
    for window in (None, 40):
        full = inv.attention(q, k, v, positions, scale, window)
        group = q_heads // kv_heads
        visible = torch.arange(length)[None, :] <= torch.arange(length)[:, None]
        if window:
            visible &= torch.arange(length)[None, :] > torch.arange(length)[:, None] - window
        reference = torch.nn.functional.scaled_dot_product_attention(
            q.double(),
            k.double().repeat_interleave(group, 1),
            v.double().repeat_interleave(group, 1),
            attn_mask=visible,
        )
        assert float((full.double() - reference).abs().max()) < 1e-5
        for t in (0, 5, 63, 64, 65, length - 1):
            cache_k = torch.zeros(1, kv_heads, length + 20, dim)  # a cache laid out by position, zeros past it
            cache_v = torch.zeros(1, kv_heads, length + 20, dim)
            cache_k[:, :, : t + 1], cache_v[:, :, : t + 1] = k[:, :, : t + 1], v[:, :, : t + 1]
            one = inv.attention(q[:, :, t : t + 1], cache_k, cache_v, torch.tensor([[t]]), scale, window)
            assert torch.equal(one[0, :, 0], full[0, :, t]), (heads, window, t)
            rows = 5
            at = t % rows
            batch_k = torch.randn(rows, kv_heads, length + 20, dim, generator=generator)
            batch_v = torch.randn(rows, kv_heads, length + 20, dim, generator=generator)
            batch_q = torch.randn(rows, q_heads, 1, dim, generator=generator)
            where = torch.randint(0, length + 19, (rows, 1), generator=generator)
            batch_k[at], batch_v[at], batch_q[at], where[at, 0] = cache_k[0], cache_v[0], q[0, :, t : t + 1], t
            many = inv.attention(batch_q, batch_k, batch_v, where, scale, window)
            assert torch.equal(many[at, :, 0], full[0, :, t]), (heads, window, t)


def test_row_reductions_are_the_same_alone_and_in_any_batch(backend):
    generator = torch.Generator().manual_seed(2)
    for width in (64, 896, 1000):
        row = torch.randn(width, generator=generator)
        x = torch.randn(13, width, generator=generator)
        x[4] = row
        assert torch.equal(inv.rms_norm(row[None], 1e-6)[0], inv.rms_norm(x, 1e-6)[4])
        assert torch.equal(inv.layer_norm(row[None], 1e-5)[0], inv.layer_norm(x, 1e-5)[4])
        reference = row.double() * torch.rsqrt(row.double().pow(2).mean() + 1e-6)
        assert float((inv.rms_norm(row[None], 1e-6)[0].double() - reference).abs().max()) < 1e-6
    for vocab in (627, 151936):
        logits = torch.randn(3, vocab, generator=generator) * 5
        alone = inv.log_softmax(logits[1:2])[0]
        assert torch.equal(alone, inv.log_softmax(logits)[1])
        assert float((alone.double() - torch.log_softmax(logits[1].double(), -1)).abs().max()) < 1e-5


def test_the_exact_functions_are_within_about_an_ulp_of_float64():
    generator = torch.Generator().manual_seed(3)
    x = torch.cat([torch.randn(100_000, generator=generator) * 30, torch.linspace(-86, 88.7, 50_001)])

    def ulps(got: torch.Tensor, want: torch.Tensor, floor: float = 1.2e-38) -> float:
        keep = torch.isfinite(want) & (want.abs() > floor) & (want.abs() < 3.4e38)
        spacing = torch.nextafter(want.float().abs(), torch.tensor(torch.inf)).double() - want.float().abs().double()
        return float(((got.double() - want).abs()[keep] / spacing[keep]).max())

    assert ulps(exact.exp(x), torch.exp(x.double()), floor=2.7e-38) <= 1.0
    positive = torch.exp(torch.randn(100_000, generator=generator) * 20).clamp(1.2e-38, 3e38)  # normal numbers
    assert ulps(exact.log(positive), torch.log(positive.double())) <= 1.0
    t = torch.randn(100_000, generator=generator) * 3
    assert ulps(exact.tanh(t), torch.tanh(t.double())) <= 2.0
    assert float((exact.silu(t).double() - torch.nn.functional.silu(t.double())).abs().max()) < 2e-6
    gelu = torch.nn.functional.gelu(t.double(), approximate="tanh")
    assert float((exact.gelu_tanh(t).double() - gelu).abs().max()) < 1e-6
    special = exact.exp(torch.tensor([0.0, -torch.inf, torch.inf, -86.4, -87.0]))
    assert special[0] == 1
    assert special[1] == 0
    assert torch.isfinite(special[2])
    assert special[3] > 0
    assert special[4] == 0
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    cos, sin = exact.rope_table(inv_freq, 32768)
    angles = (torch.arange(32768, dtype=torch.float32)[:, None] * inv_freq[None]).double()
    assert float((cos[:, :32].double() - angles.cos()).abs().max()) < 6e-8
    assert float((sin[:, 32:].double() - angles.sin()).abs().max()) < 6e-8


def test_an_exact_function_gives_an_element_the_same_bits_wherever_it_sits():
    # torch's own exp rounds some elements differently in its vector and scalar paths, and which path an element
    # takes depends on where it falls in the tensor; Kiln's does not depend on that
    generator = torch.Generator().manual_seed(4)
    row = torch.randn(176, generator=generator) * 10
    alone = exact.silu(row)
    for rows in (2, 7, 200):
        block = torch.randn(rows, 176, generator=generator) * 10
        block[rows // 2] = row
        assert torch.equal(exact.silu(block)[rows // 2], alone)
        assert torch.equal(exact.exp(block.flatten()[3:])[(rows // 2) * 176 - 3 :][:176], exact.exp(row))
    assert torch.equal(exact.tree_sum(torch.nn.functional.pad(row, (0, 80))), exact.tree_sum(row))


def _model(family: str):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    common = {"vocab_size": 627, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=627, n_positions=128, n_embd=64, n_layer=2, n_head=4)).eval()
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(**common)).eval()
    if family == "mistral-window":  # a window shorter than the sequences: it shapes every query past it
        return MistralForCausalLM(MistralConfig(**common, head_dim=16, sliding_window=7)).eval()
    return Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=False)).eval()


def test_a_sliding_window_masks_what_the_model_s_own_forward_masks():
    from kiln.model import Decoder

    model = _model("mistral-window")
    decoder = Decoder.of(model)
    assert decoder.windows == [7, 7]
    ids = torch.randint(0, 600, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        own = model(input_ids=ids).logits
        ours = decoder.logits(decoder.hidden(ids).reshape(-1, 64)).view(2, 40, -1)
    assert float((own - ours).abs().max()) < 1e-5 * max(1.0, float(own.abs().max()))


def test_onednn_s_packed_weights_give_the_bits_of_the_weights_themselves():
    if not inv.onednn_products():
        pytest.skip("this torch runs CPU products without oneDNN: nothing is packed")
    generator = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in ((896, 4864), (4864, 896), (512, 1408), (896, 151936 // 16)):
            w = torch.randn(n, k, generator=generator).to(dtype)
            packed = inv.pack(w)
            assert packed is not None
            for rows in (1, 2, 8, 33):
                x = torch.randn(rows, k, generator=generator).to(dtype)
                assert torch.equal(inv.linear(x, w, packed=packed), inv.linear(x, w)), (dtype, k, n, rows)


@pytest.mark.parametrize("family", ["qwen2", "llama", "gpt2", "mistral-window"])
def test_a_model_s_rows_are_the_same_alone_batched_stepped_and_in_one_forward(backend, family):
    from kiln.model import Decoder

    model = _model(family)
    decoder = Decoder.of(model)
    generator = torch.Generator().manual_seed(5)
    lengths = (3, 11, 70) if backend == "torch" else (3, 9, 66)  # the longest crosses a key chunk
    sequences = [torch.randint(0, 600, (n,), generator=generator).tolist() for n in lengths]
    with torch.no_grad():
        alone = [decoder.logits(decoder.hidden(torch.tensor([s]))[0]) for s in sequences]
        ids = torch.zeros((len(sequences), max(lengths)), dtype=torch.long)
        for r, s in enumerate(sequences):
            ids[r, : len(s)] = torch.tensor(s)
        together = decoder.hidden(ids)
        for r, s in enumerate(sequences):
            assert torch.equal(decoder.logits(together[r, : len(s)]), alone[r]), (family, r)
        cache = decoder.new_cache()
        prompt = 2
        prompts = torch.tensor([s[:prompt] for s in sequences])
        first = decoder.hidden(prompts, cache=cache)
        for r in range(len(sequences)):
            assert torch.equal(decoder.logits(first[r]), alone[r][:prompt])
        # then one position at a time, every row at its own position, the shorter rows leaving when done
        for t in range(prompt, max(lengths)):
            live = [r for r, s in enumerate(sequences) if t < len(s)]
            if live != list(range(len(live))):
                break  # rows stay in the first slots while they last (the longest is last)
            step = decoder.hidden(
                torch.tensor([[sequences[r][t]] for r in live]), torch.full((len(live), 1), t), cache=cache
            )
            logits = decoder.logits(step[:, 0])
            for j, r in enumerate(live):
                assert torch.equal(logits[j], alone[r][t]), (family, r, t)


def test_a_model_s_rows_are_the_same_at_any_thread_count(tiny_model_dir):
    script = (
        "import sys, torch\n"
        "torch.set_num_threads(int(sys.argv[1]))\n"
        "from kiln.model import Decoder, load_base_model\n"
        "from pathlib import Path\n"
        "d = Decoder.of(load_base_model(Path(sys.argv[2])).model)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "ids = torch.randint(0, 600, (4, 90), generator=g)\n"
        "with torch.no_grad():\n"
        "    h = d.logits(d.hidden(ids).reshape(-1, 64))\n"
        "print(h.double().sum().item(), h.view(torch.int32).long().sum().item())\n"
    )
    found = {
        subprocess.run(
            [sys.executable, "-c", script, str(n), str(tiny_model_dir)], capture_output=True, text=True, check=True
        ).stdout
        for n in (1, 2)
    }
    assert len(found) == 1


COMPILED_FOR_H100 = textwrap.dedent(
    """
    import os, sys
    assert "TRITON_INTERPRET" not in os.environ
    os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kiln.kernels import _invariant_triton as T

    target = GPUTarget("cuda", 90, 32)
    def build(function, signature, constants, warps=4):
        source = ASTSource(T._kernel(function, False), signature, constants)
        compiled = triton.compile(source, target=target, options={"num_warps": warps})
        assert compiled.asm["cubin"], (function.__name__, constants)

    for element, ieee in (("fp32", True), ("bf16", False)):
        build(T._linear_kernel, {"x": f"*{element}", "w": f"*{element}", "out": f"*{element}", "rows": "i32", "cols": "i32",
            "depth": "i32", "sxm": "i32", "sxk": "i32", "swn": "i32", "swk": "i32", "som": "i32",
            "IEEE": "constexpr", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr"},
            {"IEEE": ieee, "BM": T.BLOCK_M, "BN": T.BLOCK_N, "BK": T.BLOCK_K})
    attention = {"q": "*fp32", "k": "*fp32", "v": "*fp32", "positions": "*i64", "out": "*fp32", "lse": "*fp32",
        "heads": "i32", "rows": "i32", "keys": "i32", "dim": "i32", "scale": "fp32", "window": "i32",
        "sq_b": "i32", "sq_r": "i32", "sk_b": "i32", "sk_l": "i32", "sv_b": "i32", "sv_l": "i32", "sp_b": "i32",
        "so_b": "i32", "so_r": "i32", "sl_b": "i32", "HAS_WINDOW": "constexpr", "BM": "constexpr", "KC": "constexpr",
        "BD": "constexpr"}
    for window in (False, True):
        for bd in (16, 64, 128):
            build(T._attention_kernel, attention, {"HAS_WINDOW": window, "BM": T.ATTENTION_ROWS, "KC": T.KEY_CHUNK, "BD": bd})
    for centred in (False, True):
        build(T._norm_kernel, {"x": "*fp32", "out": "*fp32", "width": "i32", "eps": "fp32", "sx": "i32", "so": "i32",
            "CENTRED": "constexpr", "BLOCK": "constexpr"}, {"CENTRED": centred, "BLOCK": 1024})
    build(T._log_softmax_kernel, {"x": "*fp32", "out": "*fp32", "width": "i32", "sx": "i32", "so": "i32", "BLOCK": "constexpr"}, {"BLOCK": 4096}, 8)
    print("compiled")
    """
)


@pytest.mark.slow
def test_the_triton_kernels_compile_for_an_h100_without_a_gpu(tmp_path):
    """The interpreter runs the kernels' Python and skips the compiler: compiling for sm_90 with triton's bundled
    ptxas (no GPU needed) catches what only compiling finds -- fp32 products at IEEE precision and bf16 ones on the
    tensor cores, attention with and without a window at head sizes 16, 64 and 128, both norms, the log-softmax."""
    pytest.importorskip("triton", reason="the Triton kernels need triton (pinned in the dev extra)")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    repo = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", COMPILED_FOR_H100, str(tmp_path / "triton-cache")],
        capture_output=True, text=True, env=env, timeout=600, cwd=repo, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "compiled"
