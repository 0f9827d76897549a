"""The Triton route (``triton_fused_linear_ce``) on CPU in triton's interpreter, and how routes are selected.

Triton 3.8 reads ``TRITON_INTERPRET`` (``triton.knobs.runtime.interpret``, from the environment on every read)
when ``triton.jit`` decorates a function, not when triton is imported. The route decorates its kernel at the
first launch in each mode, so the ``interpreter`` fixture only sets the variable for its test (monkeypatch
restores it): no import order matters, and other tests in the same worker see it unset. The interpreter runs
the kernel's Python body with numpy on CPU tensors; the kernel itself only ever sees fp32 (the route casts bf16
inputs before the matmul), so bf16 inputs run here too. A fresh interpreter checks the other order (the
variable set before triton is imported). The interpreter does not compile, so a last check compiles the kernel
for an H100 (sm_90) with triton's bundled ptxas, which needs no GPU. Without triton these tests skip (the dev
extra pins triton==3.8.0 with numpy==2.4.6, so CI runs them); the selection tests need no triton.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import kiln.kernels
from kiln.kernels import (
    FULL_LOGITS,
    FUSED_CHUNKED_LINEAR_CE,
    IDENTITY,
    TRITON_FUSED_LINEAR_CE,
    LogitMap,
    LossRouteChoice,
    check_route_device,
    choose_loss_route,
    default_row_chunk,
    select_loss_route,
    sft_loss,
)

REPO = Path(__file__).resolve().parent.parent
# The same bounds as tests/test_kernels.py (measured there with ~10x headroom): loss ~5, |d hidden| <= ~0.1.
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
GRAD_TOL = {"rtol": 5e-4, "atol": 3e-6}
LOGIT_MAPS = {
    "identity": IDENTITY,
    "scale": LogitMap(scale=0.25),
    "softcap": LogitMap(softcap=1.5),
    "scale-and-softcap": LogitMap(scale=3.0, softcap=2.0),
}


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter on for this test (the route then runs on CPU tensors)."""
    pytest.importorskip("triton", reason="the Triton route needs triton (pinned in the dev extra)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def make_problem(rows, vocab, width, *, supervised, dtype=torch.float32, seed=0, with_bias=False):
    """hidden [rows, width], a frozen head [vocab, width] (logits of a few units), its bias, and labels with
    ``supervised`` rows kept (the rest -100)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(rows, width, generator=gen) * 2).to(dtype)
    weight = (torch.randn(vocab, width, generator=gen) * 6 / width**0.5).to(dtype)
    bias = torch.randn(vocab, generator=gen).to(dtype) if with_bias else None
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    keep = torch.randperm(rows, generator=gen)[:supervised]
    mask = torch.full((rows,), -100, dtype=torch.long)
    mask[keep] = labels[keep]
    return hidden, weight, bias, mask


def loss_and_grad(route, hidden, weight, labels, *, upstream=0.75, **kwargs):
    leaf = hidden.detach().clone().requires_grad_()
    loss = sft_loss(route, leaf, weight, labels, **kwargs)
    (loss * upstream).backward()
    return loss.detach(), leaf.grad


def triton_loss_and_grad(hidden, weight, labels, *, rows_per_chunk, block=None, upstream=0.75, **kwargs):
    """The route's own entry point, which also takes the kernel's vocabulary block."""
    from kiln.kernels._triton_ce import triton_fused_loss

    leaf = hidden.detach().clone().requires_grad_()
    loss = triton_fused_loss(leaf, weight, labels, rows_per_chunk, block=block, **kwargs)
    (loss * upstream).backward()
    return loss.detach(), leaf.grad


def float64_reference(hidden, weight, labels, bias, logit_map, upstream=0.75):
    """The definition in float64 with plain autograd: y = c tanh(s (h W^T + b) / c), masked mean CE."""
    leaf = hidden.double().requires_grad_()
    z = leaf @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    z = z * logit_map.scale
    if logit_map.softcap is not None:
        z = logit_map.softcap * torch.tanh(z / logit_map.softcap)
    loss = torch.nn.functional.cross_entropy(z, labels, ignore_index=-100)
    (loss * upstream).backward()
    return loss.detach(), leaf.grad


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("name", LOGIT_MAPS)
def test_triton_route_matches_float64_and_the_torch_routes_for_every_logit_map(name, with_bias):
    # 13 supervised rows in chunks of 5 (5, 5, 3); V = 97 in blocks of 16 (six full, one of a single column)
    hidden, weight, bias, labels = make_problem(20, 97, 8, supervised=13, with_bias=with_bias)
    logit_map = LOGIT_MAPS[name]
    kwargs = {"bias": bias, "logit_map": logit_map}
    loss, grad = triton_loss_and_grad(hidden, weight, labels, rows_per_chunk=5, block=16, **kwargs)
    public = loss_and_grad(TRITON_FUSED_LINEAR_CE, hidden, weight, labels, chunk_size=5, **kwargs)  # one block
    want_loss, want_grad = float64_reference(hidden, weight, labels, bias, logit_map)
    assert loss.dtype == torch.float32
    assert loss.shape == ()
    assert grad.dtype == torch.float32
    for got_loss, got_grad in [(loss, grad), public]:
        torch.testing.assert_close(got_loss.double(), want_loss, **LOSS_TOL)
        torch.testing.assert_close(got_grad.double(), want_grad, **GRAD_TOL)
    for route in (FULL_LOGITS, FUSED_CHUNKED_LINEAR_CE):
        other_loss, other_grad = loss_and_grad(route, hidden, weight, labels, **kwargs)
        torch.testing.assert_close(loss, other_loss, **LOSS_TOL)
        torch.testing.assert_close(grad, other_grad, **GRAD_TOL)
    if not logit_map.is_identity:  # the map changes the loss, so the checks above can fail
        plain, _ = float64_reference(hidden, weight, labels, bias, IDENTITY)
        assert abs(float(plain) - float(want_loss)) > 1e-2


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize(
    ("rows", "vocab", "supervised", "rows_per_chunk", "block"),
    [
        pytest.param(40, 97, 23, 7, 32, id="chunks-7-7-7-2"),
        pytest.param(40, 97, 23, 1, 64, id="chunk-of-one-row"),
        pytest.param(40, 97, 23, 23, 16, id="one-exact-chunk"),
        pytest.param(40, 97, 23, 500, None, id="chunk-larger-than-the-rows"),
        pytest.param(40, 97, 1, 4, 16, id="one-supervised-row"),
        pytest.param(12, 97, 12, 5, 16, id="every-row-supervised"),
        pytest.param(1, 10, 1, 3, 16, id="single-row-sequence"),
        pytest.param(3, 4100, 2, 1, None, id="vocab-past-the-largest-block"),
    ],
)
def test_ragged_chunks_and_blocks_match_the_float64_reference(rows, vocab, supervised, rows_per_chunk, block):
    logit_map = LOGIT_MAPS["scale-and-softcap"]
    hidden, weight, bias, labels = make_problem(rows, vocab, 8, supervised=supervised, with_bias=True)
    loss, grad = triton_loss_and_grad(
        hidden, weight, labels, rows_per_chunk=rows_per_chunk, block=block, bias=bias, logit_map=logit_map
    )
    want_loss, want_grad = float64_reference(hidden, weight, labels, bias, logit_map)
    torch.testing.assert_close(loss.double(), want_loss, **LOSS_TOL)
    torch.testing.assert_close(grad.double(), want_grad, **GRAD_TOL)
    ignored = labels == -100
    assert torch.count_nonzero(grad[ignored]) == 0
    assert torch.count_nonzero(grad[~ignored]) > 0


@pytest.mark.usefixtures("interpreter")
@pytest.mark.parametrize("rows", [12, 0], ids=["all-ignored", "empty-sequence"])
def test_no_supervised_row_gives_zero_loss_connected_to_hidden_and_zero_gradient(rows):
    hidden, weight, _, labels = make_problem(rows, 50, 8, supervised=0)
    loss, grad = loss_and_grad(TRITON_FUSED_LINEAR_CE, hidden, weight, labels, chunk_size=4)
    assert loss.item() == 0.0
    assert loss.dtype == torch.float32
    assert torch.equal(grad, torch.zeros_like(hidden))


@pytest.mark.usefixtures("interpreter")
def test_two_runs_give_bit_identical_loss_and_gradient():
    hidden, weight, bias, labels = make_problem(20, 97, 16, supervised=13, with_bias=True)
    kwargs = {"chunk_size": 4, "bias": bias, "logit_map": LOGIT_MAPS["softcap"]}
    first = loss_and_grad(TRITON_FUSED_LINEAR_CE, hidden, weight, labels, **kwargs)
    second = loss_and_grad(TRITON_FUSED_LINEAR_CE, hidden, weight, labels, **kwargs)
    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])


@pytest.mark.usefixtures("interpreter")
def test_bf16_inputs_are_computed_in_fp32_with_the_head_cast_a_slice_at_a_time():
    # chunks of 2 rows over V = 97 and H = 40: each fp32 head slice holds 2 * 97 // 40 = 4 rows (25 slices)
    hidden, weight, bias, labels = make_problem(20, 97, 40, supervised=13, dtype=torch.bfloat16, with_bias=True)
    logit_map = LOGIT_MAPS["scale-and-softcap"]
    loss, grad = loss_and_grad(
        TRITON_FUSED_LINEAR_CE, hidden, weight, labels, chunk_size=2, bias=bias, logit_map=logit_map
    )
    wide_loss, wide_grad = loss_and_grad(
        TRITON_FUSED_LINEAR_CE, hidden.float(), weight.float(), labels, chunk_size=2, bias=bias.float(),
        logit_map=logit_map,
    )  # fmt: skip
    fused_loss, _ = loss_and_grad(FUSED_CHUNKED_LINEAR_CE, hidden, weight, labels, bias=bias, logit_map=logit_map)
    assert loss.dtype == torch.float32
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss, wide_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, wide_grad.bfloat16(), rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(loss, fused_loss, **LOSS_TOL)


@pytest.mark.usefixtures("interpreter")
def test_the_gradient_is_computed_in_the_forward_pass_and_backward_only_scales_it():
    hidden, weight, _, labels = make_problem(15, 60, 8, supervised=9)
    leaf = hidden.clone().requires_grad_()
    (want,) = torch.autograd.grad(sft_loss(FULL_LOGITS, leaf, weight, labels), leaf)
    loss = sft_loss(TRITON_FUSED_LINEAR_CE, leaf, weight, labels, chunk_size=4)
    weight.zero_()  # a backward that recomputed logits from the head would now see zeros
    (got,) = torch.autograd.grad(loss * 2.0, leaf)
    torch.testing.assert_close(got, 2.0 * want, **GRAD_TOL)


@pytest.mark.usefixtures("interpreter")
def test_without_a_gradient_the_loss_is_the_same_bits():
    hidden, weight, bias, labels = make_problem(15, 60, 8, supervised=9, with_bias=True)
    kwargs = {"chunk_size": 4, "bias": bias, "logit_map": LOGIT_MAPS["scale-and-softcap"]}
    with_grad, _ = loss_and_grad(TRITON_FUSED_LINEAR_CE, hidden, weight, labels, **kwargs)
    with torch.no_grad():
        without = sft_loss(TRITON_FUSED_LINEAR_CE, hidden, weight, labels, **kwargs)
    assert torch.equal(with_grad, without)


@pytest.mark.usefixtures("interpreter")
def test_the_triton_route_refuses_what_it_cannot_compute():
    hidden, weight, _, labels = make_problem(6, 20, 8, supervised=3)
    with pytest.raises(ValueError, match="frozen LM head"):
        sft_loss(TRITON_FUSED_LINEAR_CE, hidden.requires_grad_(), weight.clone().requires_grad_(), labels)
    with pytest.raises(ValueError, match="frozen LM head"):
        sft_loss(TRITON_FUSED_LINEAR_CE, hidden, weight, labels, bias=torch.zeros(20, requires_grad=True))
    with pytest.raises(ValueError, match="float64"):
        sft_loss(TRITON_FUSED_LINEAR_CE, hidden.double(), weight.double(), labels)
    with pytest.raises(ValueError, match="positive int"):
        sft_loss(TRITON_FUSED_LINEAR_CE, hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="outside the"):
        sft_loss(TRITON_FUSED_LINEAR_CE, hidden, weight, labels.clone().fill_(20))


def test_the_triton_route_on_cpu_outside_the_interpreter_is_refused_naming_route_and_device(monkeypatch):
    pytest.importorskip("triton", reason="without triton the refusal names the missing package instead")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, _, labels = make_problem(6, 20, 8, supervised=3)
    message = r"triton_fused_linear_ce loss route .* not on device cpu"
    with pytest.raises(ValueError, match=message):
        check_route_device(TRITON_FUSED_LINEAR_CE, "cpu")
    with pytest.raises(ValueError, match=message):
        sft_loss(TRITON_FUSED_LINEAR_CE, hidden, weight, labels)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_route_device(TRITON_FUSED_LINEAR_CE, "cpu")
    check_route_device(TRITON_FUSED_LINEAR_CE, "cuda:0")
    with pytest.raises(ValueError, match="not on device mps"):
        check_route_device(TRITON_FUSED_LINEAR_CE, "mps")


def test_torch_routes_run_on_every_device_and_unknown_routes_are_refused():
    for route in (FULL_LOGITS, FUSED_CHUNKED_LINEAR_CE, kiln.kernels.ACTIVE_ROWS):
        for device in ("cpu", "cuda", "mps"):
            check_route_device(route, device)
    with pytest.raises(ValueError, match="unknown loss route"):
        check_route_device("softmax", "cpu")


def test_without_triton_the_triton_route_is_refused_naming_the_package(monkeypatch):
    monkeypatch.setattr("kiln.kernels._triton_ce.triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs the triton package"):
        check_route_device(TRITON_FUSED_LINEAR_CE, "cuda")


# ----------------------------------------------------------------------------- selection


def test_cpu_keeps_the_torch_fused_route_whether_or_not_triton_imports(monkeypatch):
    for available in (True, False):
        monkeypatch.setattr("kiln.kernels._select.triton_available", lambda available=available: available)
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            assert select_loss_route("cpu", dtype) == FUSED_CHUNKED_LINEAR_CE
        choice = choose_loss_route("cpu", torch.float32, max_rows=1024, vocab=151_936, hidden=896)
        assert choice == LossRouteChoice(FUSED_CHUNKED_LINEAR_CE, 8192)
        assert choice.implementation == "torch.fused-linear-ce.online-grad.v2"


def test_cuda_selects_the_triton_route_for_fp32_and_bf16_when_triton_imports(monkeypatch):
    monkeypatch.setattr("kiln.kernels._select.triton_available", lambda: True)
    for device in ("cuda", "cuda:1", torch.device("cuda:0")):
        assert select_loss_route(device, torch.float32) == TRITON_FUSED_LINEAR_CE
        assert select_loss_route(device, torch.bfloat16) == TRITON_FUSED_LINEAR_CE
        assert select_loss_route(device, torch.float16) == FUSED_CHUNKED_LINEAR_CE
        assert select_loss_route(device, torch.float64) == FUSED_CHUNKED_LINEAR_CE
    choice = choose_loss_route("cuda", torch.bfloat16, max_rows=4096, vocab=151_936, hidden=896)
    assert choice == LossRouteChoice(TRITON_FUSED_LINEAR_CE, 110)
    assert choice.implementation == "triton.fused-linear-ce.row-programs.v1"


def test_cuda_without_triton_keeps_the_torch_fused_route(monkeypatch):
    monkeypatch.setattr("kiln.kernels._select.triton_available", lambda: False)
    assert select_loss_route("cuda:0", torch.float32) == FUSED_CHUNKED_LINEAR_CE
    assert select_loss_route("cuda:0", torch.bfloat16) == FUSED_CHUNKED_LINEAR_CE
    choice = choose_loss_route("cuda", torch.bfloat16, max_rows=4096, vocab=151_936, hidden=896)
    assert choice.route == FUSED_CHUNKED_LINEAR_CE
    assert choice.chunk_size == kiln.kernels.default_chunk_size(4096, 151_936, 896, torch.bfloat16)


def test_with_triton_installed_a_cuda_device_string_selects_the_triton_route():
    pytest.importorskip("triton", reason="needs triton installed")
    assert select_loss_route("cuda", torch.float32) == TRITON_FUSED_LINEAR_CE


def test_the_row_chunk_keeps_the_fp32_logits_buffer_within_64_mib():
    budget = 64 * 1024 * 1024
    for vocab, rows in [(151_936, 110), (32_000, 524), (262_144, 64), (1, budget // 4), (budget, 1), (budget * 2, 1)]:
        assert default_row_chunk(vocab) == rows
        assert rows == 1 or rows * vocab * 4 <= budget < (rows + 1) * vocab * 4
    with pytest.raises(ValueError):
        default_row_chunk(0)


# ----------------------------------------------------------------------------- in a fresh interpreter

INTERPRETED_FROM_THE_START = textwrap.dedent(
    """
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"
    import torch
    import triton  # imported with the interpreter already on: triton's own @jit library is interpreted too
    from kiln.kernels import TRITON_FUSED_LINEAR_CE, LogitMap, sft_loss

    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(9, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(50, 8, generator=gen, dtype=torch.float64)
    labels = torch.tensor([3, -100, 49, 0, -100, 7, 7, 20, -100])
    logit_map = LogitMap(scale=0.5, softcap=3.0)
    leaf = hidden.float().requires_grad_()
    loss = sft_loss(TRITON_FUSED_LINEAR_CE, leaf, weight.float(), labels, chunk_size=4, logit_map=logit_map)
    loss.backward()
    wide = hidden.clone().requires_grad_()
    want = torch.nn.functional.cross_entropy(3.0 * torch.tanh(0.5 * (wide @ weight.T) / 3.0), labels)
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(leaf.grad.double(), wide.grad, rtol=5e-4, atol=3e-6)
    """
)

COMPILED_FOR_H100 = textwrap.dedent(
    """
    import os, sys
    assert "TRITON_INTERPRET" not in os.environ
    os.environ["TRITON_CACHE_DIR"] = sys.argv[1]  # compile for real, not from a cache
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kiln.kernels import _triton_rows

    kernel = _triton_rows._kernel(False)
    signature = {
        "logits": "*fp32", "row_stride": "i32", "targets": "*i64", "losses": "*fp32", "n_cols": "i32",
        "scale": "fp32", "softcap": "fp32", "count": "fp32",
        "HAS_SOFTCAP": "constexpr", "WRITE_GRAD": "constexpr", "BLOCK": "constexpr",
    }
    for softcap, grad, block in [(True, True, 4096), (True, False, 16), (False, True, 16), (False, False, 4096)]:
        source = ASTSource(kernel, signature, {"HAS_SOFTCAP": softcap, "WRITE_GRAD": grad, "BLOCK": block})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        assert compiled.asm["cubin"], (softcap, grad, block)
    """
)


def _run_python(code, env, *args):
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=300, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-4000:]


def test_the_interpreter_also_runs_the_route_when_set_before_triton_is_imported():
    pytest.importorskip("triton", reason="the Triton route needs triton (pinned in the dev extra)")
    _run_python(INTERPRETED_FROM_THE_START, {**os.environ, "TRITON_INTERPRET": "1"})


def test_the_kernel_compiles_for_an_h100_without_a_gpu(tmp_path):
    """The interpreter runs the kernel's Python and skips the compiler: this catches what only compiling finds."""
    pytest.importorskip("triton", reason="the Triton route needs triton (pinned in the dev extra)")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    _run_python(COMPILED_FOR_H100, env, str(tmp_path / "triton-cache"))
