"""One SFT optimizer step, route by route: where the time and the memory of the LM head go.

    python bench/sft_step.py [--seq-len 2048] [--reps 3] [--plot bench/sft_step.png]
    python bench/sft_step.py --quick          # T=256 smoke test

The model is a 2-layer Qwen2-shaped causal LM (H=896, intermediate 4864, 14 heads / 2 KV
heads, V=151,936, tied embeddings like Qwen2-0.5B), fp32, weights from a fixed seed. One
conversation of T tokens (random ids) whose second half is supervised, so A = T/2 rows
reach the loss. LoRA rank 16 / alpha 32 on q k v o gate up down, AdamW (lr 1e-4, no weight
decay), batch 1, 2 torch threads. A step is forward + backward + optimizer step + zero_grad.

Routes (each in a fresh interpreter):

* ``hf_full_logits``   -- ``model(input_ids, labels=...)``: transformers' own loss over
  the full ``[T, V]`` logits.
* ``trl_sft``          -- TRL's SFTTrainer with a PEFT config and its default loss, run by
  ``--trl-python`` (the venv that has trl); the step is timed from its callbacks
  (``on_step_begin`` to ``on_step_end``). fp32 and no gradient checkpointing like every
  other route, unless ``--trl-defaults`` (TRL's own defaults: bf16 autocast and gradient
  checkpointing).
* ``torch_lce``        -- ``F.linear_cross_entropy(h[active], W, y[active])`` as called
  by default (``options=None``: the reference path, logits of the A rows).
* ``torch_lce_chunked``-- the same with ``LinearCrossEntropyOptions(batch_chunk_size=R)``,
  R rows per chunk with ``[R, V]`` fp32 within Kiln's 64 MiB chunk budget (gradient
  computed in the forward pass). ``torch_lce_auto`` (not in the default set: ~55 s a
  step at T=2048 on 2 cores) uses ``LinearCrossEntropyOptions()`` as it comes.
* ``ckpt_chunks``      -- the A rows in chunks of R, each chunk's logits + cross-entropy
  under ``torch.utils.checkpoint`` (logits recomputed in backward).
* ``body_only``        -- the model body without the LM head, the loss a fixed random
  projection of the A hidden rows (floor, part 1).
* ``kiln_fused``       -- ``kiln.kernels.sft_loss("fused_chunked_linear_ce", ...)`` with the
  chunk size of ``choose_loss_route("cpu", float32, max_rows=A, ...)``.
* ``kiln_fused_softcap`` -- the same with the model's logits soft-capped at 30
  (``LogitMap(softcap=30.0)``, Gemma 2's final-logit cap): the cap and its derivative are
  folded into the same single pass. Its worker also times whole steps, and the loss path
  alone, with and without the cap in one process, interleaved in ABBA order (9 pairs after
  a warm-up pair each), and reports the ratio of the fastest of each (the whole-step ratio
  is the target, <= 1.05) and the median pair ratio.
* ``head_matmuls``     -- no model: ``logits = h @ W.T`` and ``logits @ W`` on ``[A, H]``
  rows, the two matrix products any head gradient needs (floor, part 2).
  ``head_matmuls_chunked`` does the same vocabulary chunk by chunk (Kiln's chunk size);
  the floor takes the faster of the two that ran.

Memory: after set-up (model, LoRA, optimizer, inputs) the worker resets the resident
high-water mark (``/proc/self/clear_refs``) and reads VmRSS as its baseline; the peak is
VmHWM after the warm-up and the timed steps. "peak" is that absolute VmHWM, "above base"
is peak minus baseline, and the loss-path memory is a route's "above base" minus
``body_only``'s (for ``head_matmuls*`` it is their own "above base": they run nothing else).
A route whose loss path stays under the body's own backward peak shows about 0 there (or
a few tens of MiB either side: allocator noise between processes), so each model route
also measures its loss path alone after the timed steps, as bench_loss_routes.py does:
hidden states from a no-grad body forward, then the loss forward + backward from them,
peak above the resident set before it ("alone MiB", "alone s"). Freed heap is handed back
(``malloc_trim``) before every reset, so nothing is served from pages already resident.
Time: median (and min) of ``--reps`` steps after one warm-up step. A route whose
projected peak is over 80% of the memory available now is not run.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _machine import available_bytes, memory_status

VOCAB, HIDDEN, INTERMEDIATE, LAYERS = 151_936, 896, 4864, 2
HEADS, KV_HEADS = 14, 2
LORA_RANK, LORA_ALPHA, LR = 16, 32, 1e-4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CHUNK_BUDGET = 64 * 1024 * 1024  # the same budget as kiln.kernels.default_chunk_size
THREADS = 2
MIB = 1024 * 1024
REPO = Path(__file__).resolve().parent.parent
SOFTCAP = 30.0  # Gemma 2's final_logit_softcapping
SOFTCAP_PAIRS = 9  # interleaved plain / soft-capped loss-path timings after one warm-up pair
TRL_PYTHON = "/tmp/trlvenv/bin/python"  # noqa: S108 - the bench venv with trl, not a temp file

ROUTES = (
    "hf_full_logits",
    "trl_sft",
    "torch_lce",
    "torch_lce_chunked",
    "ckpt_chunks",
    "body_only",
    "kiln_fused",
    "kiln_fused_softcap",
    "head_matmuls",
    "head_matmuls_chunked",
)
EXTRA_ROUTES = ("torch_lce_auto",)
LABELS = {
    "hf_full_logits": "transformers forward with labels (full logits)",
    "trl_sft": "TRL SFTTrainer + PEFT (default loss)",
    "torch_lce": "F.linear_cross_entropy, supervised rows (default)",
    "torch_lce_chunked": "F.linear_cross_entropy, chunked (R rows)",
    "torch_lce_auto": "F.linear_cross_entropy, chunked (auto options)",
    "ckpt_chunks": "chunks of R rows + activation checkpoint",
    "body_only": "model body alone, no LM head (floor 1)",
    "kiln_fused": "Kiln fused_chunked_linear_ce",
    "kiln_fused_softcap": "Kiln fused route, logits soft-capped at 30",
    "head_matmuls": "h @ W.T and grad @ W alone (floor 2)",
    "head_matmuls_chunked": "same, vocabulary chunks of C (floor 2)",
}
MODEL_FREE = ("head_matmuls", "head_matmuls_chunked")


# ----------------------------------------------------------------------------- memory


def reset_peak() -> int:
    """Reset the resident high-water mark to the current resident set; return that resident set.

    Freed heap memory is handed back to the system first (``malloc_trim``), so that what a
    later step allocates is counted rather than served from pages already resident.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return memory_status("VmRSS")


def row_chunk(vocab: int) -> int:
    """Rows per chunk for the row-chunked routes: the largest power of two whose ``[R, V]`` fp32 fits the budget."""
    rows = 1
    while 2 * rows * vocab * 4 <= CHUNK_BUDGET:
        rows *= 2
    return rows


# ----------------------------------------------------------------------------- model and data


def qwen2_config(vocab: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=2,
        pad_token_id=0,
    )


def build_model(vocab: int):
    """The Qwen2-shaped model with weights from an explicit generator (same bytes in both venvs)."""
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(qwen2_config(vocab))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied
    return model


def lora_config():
    from peft import LoraConfig

    return LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        target_modules=TARGETS,
        bias="none",
        task_type="CAUSAL_LM",
    )


def make_batch(seq_len: int, vocab: int):
    """``ids`` [1, T]; ``labels`` [1, T] in transformers' convention (second half supervised)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, seq_len), generator=generator)
    labels = ids.clone()
    labels[0, : seq_len - seq_len // 2] = -100
    return ids, labels


# ----------------------------------------------------------------------------- workers


def worker(route: str, seq_len: int, vocab: int, reps: int) -> dict:
    import torch

    torch.set_num_threads(THREADS)
    if route == "trl_sft":
        raise SystemExit("trl_sft runs through --trl-worker")
    ids, labels = make_batch(seq_len, vocab)
    targets = labels[0, 1:]  # row t of the hidden states predicts targets[t]
    active = (targets != -100).nonzero().squeeze(1)
    rows = active.numel()
    extra: dict = {}

    if route in MODEL_FREE:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(vocab, HIDDEN, generator=generator) * 0.02
        h = torch.randn(rows, HIDDEN, generator=generator)
        optimizer = None
        if route == "head_matmuls":

            def step() -> float:
                logits = h @ weight.T  # [A, V]
                grad = logits @ weight  # [A, H]: logits stand in for their gradient
                return float(grad[0, 0])
        else:
            from kiln.kernels import default_chunk_size

            chunk = default_chunk_size(rows, vocab, HIDDEN, torch.float32)
            extra["chunk"] = chunk

            def step() -> float:
                grad = torch.zeros_like(h)
                for start in range(0, vocab, chunk):
                    w = weight[start : start + chunk]
                    grad.addmm_(h @ w.T, w)
                return float(grad[0, 0])
    else:
        from peft import get_peft_model
        from torch.nn import functional as nnf

        torch.manual_seed(2)  # peft draws the LoRA A init from the global generator
        model = get_peft_model(build_model(vocab), lora_config())
        model.train()
        causal = model.get_base_model()
        body, head = causal.get_decoder(), causal.get_output_embeddings()
        assert not head.weight.requires_grad
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, foreach=False)
        extra["trainable"] = sum(p.numel() for p in params)
        weight, y = head.weight, targets.index_select(0, active)

        # loss_from(last [1, T, H]) is the route's loss path; the step runs it on the body's output
        if route == "hf_full_logits":

            def loss_from(last):  # what Qwen2ForCausalLM.forward does with labels, on given hidden states
                return causal.loss_function(logits=head(last), labels=labels, vocab_size=vocab)
        elif route in ("torch_lce", "torch_lce_chunked", "torch_lce_auto"):
            options = None
            if route == "torch_lce_chunked":
                extra["rows_per_chunk"] = row_chunk(vocab)
                options = torch.nn.LinearCrossEntropyOptions(
                    batch_chunk_size=extra["rows_per_chunk"], chunking_method=None
                )
            elif route == "torch_lce_auto":
                options = torch.nn.LinearCrossEntropyOptions()

            def loss_from(last):
                return nnf.linear_cross_entropy(last[0, :-1].index_select(0, active), weight, y, options=options)
        elif route == "ckpt_chunks":
            from torch.utils.checkpoint import checkpoint

            size = extra["rows_per_chunk"] = row_chunk(vocab)

            def chunk_ce(h, w, t):
                return nnf.cross_entropy(h @ w.T, t, reduction="sum")

            def loss_from(last):
                h = last[0, :-1].index_select(0, active)
                total = sum(
                    checkpoint(chunk_ce, h[s : s + size], weight, y[s : s + size], use_reentrant=False)
                    for s in range(0, rows, size)
                )
                return total / rows
        elif route == "body_only":
            probe = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(3)) / rows

            def loss_from(last):
                return (last[0, :-1].index_select(0, active) * probe).sum()
        elif route in ("kiln_fused", "kiln_fused_softcap"):
            from kiln import kernels

            choice = kernels.choose_loss_route("cpu", torch.float32, max_rows=rows, vocab=vocab, hidden=HIDDEN)
            assert choice.route == kernels.FUSED_CHUNKED_LINEAR_CE, choice
            extra["chunk"] = choice.chunk_size
            extra["implementation"] = getattr(choice, "implementation", None)
            capped = kernels.LogitMap(softcap=SOFTCAP) if route == "kiln_fused_softcap" else kernels.IDENTITY

            def fused(last, logit_map):
                return kernels.sft_loss(
                    choice.route, last[0, :-1], weight, targets, chunk_size=choice.chunk_size, logit_map=logit_map
                )

            def loss_from(last):
                return fused(last, capped)
        else:
            raise SystemExit(f"unknown route {route!r}")

        def step() -> float:
            if route == "hf_full_logits":  # the model's own forward with labels
                loss = model(input_ids=ids, labels=labels).loss
            else:
                loss = loss_from(body(input_ids=ids).last_hidden_state)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())

    baseline = reset_peak()
    times, losses = [], []
    for rep in range(reps + 1):
        start = time.perf_counter()
        losses.append(step())
        if rep:  # the first step is a warm-up
            times.append(time.perf_counter() - start)
    peak = memory_status("VmHWM")
    if optimizer is not None:  # the loss path alone: forward + backward from detached hidden states
        with torch.no_grad():
            last = body(input_ids=ids).last_hidden_state
        last.requires_grad_()
        alone_base = reset_peak()
        start = time.perf_counter()
        loss_from(last).backward()
        extra["alone_seconds"] = time.perf_counter() - start
        extra["alone"] = memory_status("VmHWM") - alone_base
        if route == "kiln_fused_softcap":  # the cap's cost side by side: plain and capped, interleaved
            from kiln import kernels

            def whole_step(logit_map) -> None:
                fused(body(input_ids=ids).last_hidden_state, logit_map).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            def loss_path(logit_map) -> None:
                fused(last.detach().requires_grad_(), logit_map).backward()

            for name, run in (("step", whole_step), ("alone", loss_path)):
                ratios, plain_times, capped_times = [], [], []
                for rep in range(SOFTCAP_PAIRS + 1):
                    order = (kernels.IDENTITY, capped) if rep % 2 else (capped, kernels.IDENTITY)  # ABBA
                    timed = {}
                    for logit_map in order:
                        start = time.perf_counter()
                        run(logit_map)
                        timed[logit_map] = time.perf_counter() - start
                    if rep:  # the first pair is a warm-up
                        plain_times.append(timed[kernels.IDENTITY])
                        capped_times.append(timed[capped])
                        ratios.append(timed[capped] / timed[kernels.IDENTITY])
                extra[f"softcap_{name}"] = {
                    "median_ratio": statistics.median(ratios),
                    "ratios": ratios,
                    "min_ratio": min(capped_times) / min(plain_times),
                    "plain_min": min(plain_times),
                    "capped_min": min(capped_times),
                }
    return {
        "route": route,
        "seq_len": seq_len,
        "rows": rows,
        "seconds": statistics.median(times),
        "min_seconds": min(times),
        "times": times,
        "peak": peak,
        "baseline": baseline,
        "above": peak - baseline,
        "first_loss": losses[0] if optimizer is not None else None,
        "threads": torch.get_num_threads(),
        **extra,
    }


def trl_worker(seq_len: int, vocab: int, reps: int, trl_defaults: bool) -> dict:
    """TRL's SFTTrainer on the same model and batch, ``reps + 1`` optimizer steps timed by callbacks."""
    import warnings

    warnings.simplefilter("ignore")
    import torch

    torch.set_num_threads(THREADS)
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from kiln.model._tiny import build_tokenizer, quiet_hub

    quiet_hub()
    ids, labels = make_batch(seq_len, vocab)
    row = {"input_ids": ids[0].tolist(), "labels": labels[0].tolist()}
    dataset = Dataset.from_list([row] * (reps + 1))
    tokenizer = build_tokenizer()  # only its pad token is used: the data are token ids already

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.baseline = self.start = 0
            self.times: list[float] = []

        def on_train_begin(self, args, state, control, **kwargs):
            self.baseline = reset_peak()

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    settings = {} if trl_defaults else {"bf16": False, "gradient_checkpointing": False}
    config = SFTConfig(
        output_dir=str(Path(tempfile.gettempdir()) / "kiln-sft-step-trl"),  # nothing is saved
        per_device_train_batch_size=1,
        gradient_accumulation_steps=1,
        max_steps=reps + 1,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=0.0,
        optim="adamw_torch",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        max_length=None,
        use_cpu=True,
        seed=1,
        dataloader_num_workers=0,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        **settings,
    )
    torch.manual_seed(2)
    probe = Probe()
    trainer = SFTTrainer(
        model=build_model(vocab),
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=lora_config(),
        callbacks=[probe],
    )
    trainer.train()
    peak = memory_status("VmHWM")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    times = probe.times[1:]
    return {
        "route": "trl_sft",
        "seq_len": seq_len,
        "rows": seq_len // 2,
        "seconds": statistics.median(times),
        "min_seconds": min(times),
        "times": times,
        "peak": peak,
        "baseline": probe.baseline,
        "above": peak - probe.baseline,
        "first_loss": losses[0] if losses else None,
        "threads": torch.get_num_threads(),
        "trl": trl.__version__,
        "trl_settings": "TRL defaults (bf16 autocast, gradient checkpointing)"
        if trl_defaults
        else "fp32, no gradient checkpointing",
        "bf16": config.bf16,
        "gradient_checkpointing": config.gradient_checkpointing,
    }


# ----------------------------------------------------------------------------- driver


def projected_bytes(route: str, seq_len: int, vocab: int) -> int:
    """A rough upper bound of a route's peak RSS, to skip what cannot fit."""
    model = 1536 * MIB  # interpreter, torch, the ~0.7 GB model, LoRA, activations of 2 layers
    logits_rows = {"hf_full_logits": 4 * seq_len, "torch_lce": 3 * (seq_len // 2), "head_matmuls": seq_len // 2}
    if route == "trl_sft":
        return model + 512 * MIB + 3 * min(seq_len, 4096) * 32768 * 4
    return model + logits_rows.get(route, 0) * vocab * 4 + seq_len * 64 * 1024


def run_route(route: str, args: argparse.Namespace) -> dict:
    python = args.trl_python if route == "trl_sft" else sys.executable
    if route == "trl_sft" and not Path(python).exists():
        return {"route": route, "skipped": f"{python} not found (needs a venv with trl)"}
    projected = projected_bytes(route, args.seq_len, args.vocab)
    if projected > 0.8 * available_bytes():
        why = f"projected peak {projected / 2**30:.1f} GiB > 80% of {available_bytes() / 2**30:.1f} GiB available"
        return {"route": route, "skipped": why}
    cmd = [python, str(Path(__file__).resolve()), "--seq-len", str(args.seq_len), "--reps", str(args.reps)]
    cmd += ["--vocab", str(args.vocab)]
    cmd += ["--trl-worker"] if route == "trl_sft" else ["--worker", route]
    if args.trl_defaults:
        cmd.append("--trl-defaults")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(THREADS),
        "MKL_NUM_THREADS": str(THREADS),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if args.mmap_threshold is not None:  # glibc: fixed threshold, blocks above it mmapped and returned on free
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, check=False, env=env, cwd=REPO, timeout=args.route_timeout
        )
    except subprocess.TimeoutExpired:
        return {"route": route, "skipped": f"over --route-timeout {args.route_timeout} s"}
    wall = time.perf_counter() - start
    if done.returncode != 0:
        return {"route": route, "skipped": f"exit {done.returncode}: {done.stderr.strip()[-400:]}"}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall"] = wall
    return result


def derived(results: list[dict]) -> dict:
    """Loss-path memory per route, and the floor (body-only step + the faster head-matmul route)."""
    ok = {r["route"]: r for r in results if "skipped" not in r}
    body = ok.get("body_only")
    for r in ok.values():
        if r["route"] in MODEL_FREE:  # nothing else runs there: all of it is the head
            r["loss_path"] = r["alone"] = r["above"]
            r["alone_seconds"] = r["seconds"]
        elif body is not None:
            r["loss_path"] = r["above"] - body["above"]
    heads = [ok[k] for k in MODEL_FREE if k in ok]
    floor = None
    if body is not None and heads:
        fastest = min(heads, key=lambda r: r["seconds"])
        floor = {
            "seconds": body["seconds"] + fastest["seconds"],
            "min_seconds": body["min_seconds"] + min(r["min_seconds"] for r in heads),
            "head_route": fastest["route"],
        }
    return {"ok": ok, "floor": floor}


def describe(r: dict) -> str:
    what = LABELS.get(r["route"], r["route"])
    if "rows_per_chunk" in r:
        what = what.replace("R rows", f"{r['rows_per_chunk']} rows").replace("of R", f"of {r['rows_per_chunk']}")
    if "chunk" in r:
        what = what.replace("of C", f"of {r['chunk']}") if "of C" in what else f"{what}, C={r['chunk']}"
    return what


def table(results: list[dict], floor: dict | None) -> str:
    def mib(r: dict, key: str) -> str:
        return f"{r[key] / MIB:.0f}" if key in r else "-"

    lines = [
        f"{'route':<21} {'what':<49} {'step s':>6} {'min s':>6} {'x floor':>7} {'peak MiB':>8} {'above base':>10}"
        f" {'loss path':>9} {'alone MiB':>9} {'alone s':>7} {'first loss':>10}",
    ]
    for r in results:
        name = r["route"]
        if "skipped" in r:
            lines.append(f"{name:<21} {LABELS.get(name, name):<49} not run: {r['skipped']}")
            continue
        x_floor = f"{r['seconds'] / floor['seconds']:.2f}" if floor else "-"
        alone_s = f"{r['alone_seconds']:.2f}" if "alone_seconds" in r else "-"
        first = f"{r['first_loss']:.5f}" if r.get("first_loss") is not None else "-"
        lines.append(
            f"{name:<21} {describe(r):<49} {r['seconds']:>6.2f} {r['min_seconds']:>6.2f} {x_floor:>7}"
            f" {r['peak'] / MIB:>8.0f} {r['above'] / MIB:>10.0f} {mib(r, 'loss_path'):>9} {mib(r, 'alone'):>9}"
            f" {alone_s:>7} {first:>10}"
        )
    if floor:
        what = "body_only + " + floor["head_route"]
        lines.append(f"{'floor':<21} {what:<49} {floor['seconds']:>6.2f} {floor['min_seconds']:>6.2f} {1.0:>7.2f}")
    return "\n".join(lines)


def verdict(value: float, limit: float) -> str:
    return "met" if value <= limit else "MISSED"


def targets(ok: dict, floor: dict | None) -> list[str]:
    kiln = ok.get("kiln_fused")
    if kiln is None:
        return ["targets: kiln_fused not measured", *softcap_lines(ok.get("kiln_fused_softcap"))]
    out = []
    lce = ok.get("torch_lce")
    if lce is not None:
        t = kiln["seconds"] / lce["seconds"]
        out.append(
            f"{'step time, kiln / F.linear_cross_entropy':<58} {t:6.2f}x  target <= 1.0: {verdict(t, 1.0)}"
            f" ({kiln['seconds']:.2f} vs {lce['seconds']:.2f} s; fastest steps"
            f" {kiln['min_seconds'] / lce['min_seconds']:.2f}x)"
        )
        if "loss_path" in kiln and "loss_path" in lce and lce["loss_path"] > 0:
            # a route whose loss path stays under the body's own peak adds nothing to it: count that as 0
            m = max(kiln["loss_path"], 0) / lce["loss_path"]
            out.append(
                f"{'loss-path memory (peak - body peak), ratio':<58} {m:6.3f}x  target <= 0.2: {verdict(m, 0.2)}"
                f" ({kiln['loss_path'] / MIB:.0f} vs {lce['loss_path'] / MIB:.0f} MiB)"
            )
        if "alone" in kiln and "alone" in lce and lce["alone"] > 0:
            m = kiln["alone"] / lce["alone"]
            out.append(
                f"{'loss path alone (isolated), ratio':<58} {m:6.3f}x  target <= 0.2: {verdict(m, 0.2)}"
                f" ({kiln['alone'] / MIB:.0f} vs {lce['alone'] / MIB:.0f} MiB)"
            )
    else:
        out.append("torch_lce not measured: no F.linear_cross_entropy targets")
    if floor:
        f = kiln["seconds"] / floor["seconds"]
        out.append(
            f"{'step time, kiln / floor (body_only + ' + floor['head_route'] + ')':<58} {f:6.2f}x"
            f"  target <= 1.15: {verdict(f, 1.15)} ({kiln['seconds']:.2f} vs {floor['seconds']:.2f} s;"
            f" fastest steps {kiln['min_seconds'] / floor['min_seconds']:.2f}x)"
        )
    capped = ok.get("kiln_fused_softcap")
    if capped is not None:
        c = capped["seconds"] / kiln["seconds"]
        out.append(
            f"{'step time, kiln soft-capped / kiln plain (two processes)':<58} {c:6.2f}x  (for context:"
            f" separate processes; {capped['seconds']:.2f} vs {kiln['seconds']:.2f} s)"
        )
    out += softcap_lines(capped)
    chunked = ok.get("torch_lce_chunked")
    if chunked is not None:
        line = f"for context, kiln / F.linear_cross_entropy chunked ({chunked.get('rows_per_chunk')} rows):"
        line += f" step time {kiln['seconds'] / chunked['seconds']:.2f}x"
        if "alone" in kiln and chunked.get("alone"):
            line += f", loss path alone {kiln['alone'] / chunked['alone']:.2f}x"
        out.append(line)
    return out


def softcap_lines(capped: dict | None) -> list[str]:
    """The soft-cap's cost, measured interleaved with the plain route in one process."""
    out: list[str] = []
    if capped is None:
        return out
    for name, what, target in (
        ("step", "whole step, soft-capped / plain, fastest of each", 1.05),
        ("alone", "loss path alone, soft-capped / plain, fastest of each", None),
    ):
        found = capped.get(f"softcap_{name}")
        if found is None:
            continue
        m = found["min_ratio"]
        goal = f"  target <= {target}: {verdict(m, target)}" if target else "  (for context)"
        spread = ", ".join(f"{x:.3f}" for x in found["ratios"])
        out.append(
            f"{what:<58} {m:6.3f}x{goal} ({found['capped_min']:.2f} vs {found['plain_min']:.2f} s; median of"
            f" {len(found['ratios'])} interleaved pairs {found['median_ratio']:.3f}x: {spread})"
        )
    return out


def plot(ok: dict, floor: dict | None, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (step_ax, alone_ax) = plt.subplots(1, 2, figsize=(13, 5.5))
    panels = (
        (step_ax, "seconds", "above", "whole step (forward, backward, AdamW)", "peak RSS above the pre-step baseline"),
        (
            alone_ax,
            "alone_seconds",
            "alone",
            "loss path alone (from detached hidden states)",
            "peak RSS above its start",
        ),
    )
    for ax, x_key, y_key, subtitle, y_label in panels:
        for name, r in ok.items():
            if x_key not in r or y_key not in r or (ax is alone_ax and name == "body_only"):
                continue
            marker = "s" if name in MODEL_FREE or name == "body_only" else "o"
            color = "tab:red" if name == "kiln_fused" else ("tab:gray" if marker == "s" else "tab:blue")
            x, y = r[x_key], max(r[y_key], MIB) / MIB
            ax.scatter(x, y, marker=marker, color=color, s=50, zorder=3)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
        ax.set(xlabel=f"{'step' if ax is step_ax else 'loss path'} time, s", ylabel=f"{y_label}, MiB", yscale="log")
        ax.set_title(subtitle, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    if floor:
        step_ax.axvline(floor["seconds"], color="tab:green", linestyle="--", linewidth=1)
        step_ax.annotate(
            "floor: body + head matmuls",
            (floor["seconds"], step_ax.get_ylim()[0]),
            textcoords="offset points",
            xytext=(4, 6),
            fontsize=8,
            color="tab:green",
        )
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def git_state() -> str:
    def git(*argv: str) -> str:
        done = subprocess.run(["git", *argv], capture_output=True, text=True, cwd=REPO, check=False)  # noqa: S607
        return done.stdout.strip()

    head = git("log", "-1", "--format=%h")
    kernels = git("log", "-1", "--format=%h %s", "--", "kiln/kernels")
    dirty = git("status", "--porcelain", "--", "kiln/kernels")
    return f"HEAD {head}; kiln/kernels last changed in {kernels}" + (" + uncommitted changes" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per conversation (half supervised)")
    parser.add_argument("--quick", action="store_true", help="smoke test: T=256")
    parser.add_argument("--reps", type=int, default=3, help="timed steps per route after one warm-up step")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--routes", default=",".join(ROUTES), help=f"comma list; also {', '.join(EXTRA_ROUTES)}")
    parser.add_argument("--trl-python", default=TRL_PYTHON, help="interpreter of a venv with trl, peft, datasets")
    parser.add_argument("--trl-defaults", action="store_true", help="TRL's own bf16 / gradient-checkpointing defaults")
    parser.add_argument("--route-timeout", type=int, default=900)
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        metavar="BYTES",
        help="set glibc's MALLOC_MMAP_THRESHOLD_ in the workers (default: glibc's dynamic threshold)",
    )
    parser.add_argument("--plot", metavar="PATH", default=str(REPO / "bench" / "sft_step.png"))
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--json", metavar="PATH", help="also write the raw results here")
    parser.add_argument("--worker", metavar="ROUTE", help=argparse.SUPPRESS)
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.seq_len = 256
    if args.worker:
        print(json.dumps(worker(args.worker, args.seq_len, args.vocab, args.reps)))
        return
    if args.trl_worker:
        with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the result line
            result = trl_worker(args.seq_len, args.vocab, args.reps, args.trl_defaults)
        print(json.dumps(result))
        return
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    unknown = set(routes) - set(ROUTES) - set(EXTRA_ROUTES)
    if unknown:
        parser.error(f"unknown routes: {', '.join(sorted(unknown))}")

    import torch

    rows = args.seq_len // 2
    print(
        f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, "
        f"{os.cpu_count()} cpus, {THREADS} torch threads; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(f"kiln: {git_state()}")
    print(
        f"model: Qwen2-shaped, {LAYERS} layers, H={HIDDEN}, V={args.vocab:,}, tied embeddings, fp32; "
        f"T={args.seq_len}, A={rows} supervised; LoRA r={LORA_RANK} on {len(TARGETS)} projections; "
        f"AdamW; median of {args.reps} steps after 1 warm-up"
        + (f"; MALLOC_MMAP_THRESHOLD_={args.mmap_threshold}" if args.mmap_threshold is not None else ""),
        flush=True,
    )
    results = []
    started = time.perf_counter()
    for route in routes:
        results.append(run_route(route, args))
        brief = {k: v for k, v in results[-1].items() if k != "times"}
        print(json.dumps(brief), flush=True)
    info = derived(results)
    print()
    print(table(results, info["floor"]))
    print()
    print(f"targets at T={args.seq_len} (same run):")
    for line in targets(info["ok"], info["floor"]):
        print("  " + line)
    trl = info["ok"].get("trl_sft")
    if trl:
        print(f"TRL {trl['trl']}: {trl['trl_settings']}")
    print(
        f"wall {time.perf_counter() - started:.0f} s; load average at the end"
        f" {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    if not args.no_plot:
        try:
            plot(info["ok"], info["floor"], args.plot, f"one SFT step, T={args.seq_len}, A={rows}, 2 threads")
            print(f"plot written to {args.plot}")
        except ImportError:
            print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
