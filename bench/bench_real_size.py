"""A model of real size on one machine: Kiln's precision and activation-checkpointing settings, side by side with
TRL's SFTTrainer at the same settings, in one run.

    python bench/bench_real_size.py [--rows 2] [--seq-len 2048] [--out DIR] [--trl-python PATH]
                                    [--settings fp32-off,fp32-on,bf16-off,bf16-on,nf4-on] [--no-trl]

The model has the exact shape of Qwen2.5-0.5B-Instruct (494M parameters, 24 layers, hidden 896, vocabulary
151,936, tied embeddings) with random weights from a fixed seed, stored in float32 (1.98 GB) under ``--out`` (a
temporary directory by default; reused when it exists) with the tiny model's tokenizer. The data are ``--rows``
conversations of about ``--seq-len`` tokens (half prompt, half learned answer), trained for one epoch at batch 1,
LoRA rank 16 / alpha 32 on every projection, AdamW at lr 1e-4: one optimizer step per row.

Each setting is ``PRECISION-CHECKPOINTING``: ``fp32`` | ``bf16`` | ``nf4`` (NF4 weights computing in bf16) and
``off`` | ``on``. Every run is a fresh process; for each the bench reports

* start-up before step 1: the wall time of the process minus its training loop (Kiln: the receipt's forward,
  backward and optimizer phases; TRL: its ``train_runtime``), so model load, hashing, tokenisation and publication;
  the first Kiln run starts with an empty Kiln home (``cold``: every shard hashed), the others reuse it (``warm``);
* seconds per optimizer step (the loop time over the steps);
* peak RSS of the process (``ru_maxrss``), and for Kiln the memory planner's estimate and its ratio to that peak.

Runs alternate the tools so that machine noise hits both alike; the ratios compare Kiln with TRL at the same
setting. TRL (``trl==1.16.0``) is a bench-only dependency: ``--trl-python`` names an interpreter that has it and
Kiln's dependencies (default: this one); ``--no-trl`` measures Kiln alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_vs_trl import TRL_SCRIPT, make_data, run_child
from bench_vs_trl import make_model as build

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
DEFAULT_SETTINGS = "fp32-off,fp32-on,bf16-off,bf16-on,nf4-on"


# Qwen2.5-0.5B-Instruct's configuration where it differs from bench_vs_trl's 2-layer shape
QWEN25_05B = {
    "num_hidden_layers": 24,
    "max_window_layers": 21,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}


def make_model(path: Path) -> None:
    """Qwen2.5-0.5B-Instruct's exact configuration, random weights (seed 0), float32 safetensors."""
    build(path, **QWEN25_05B)


def kiln_run(setting: str, data: Path, model_dir: Path, env: dict[str, str], home: Path, name: str) -> dict:
    precision, checkpointing = setting.split("-")
    flags = ["--precision", "bf16", "--quantization", "nf4"] if precision == "nf4" else ["--precision", precision]
    cmd = [sys.executable, "-m", "kiln.cli", "train", "sft", "--local", "-f", str(data), "--adapter", name,
           "--model", str(model_dir), "--epochs", "1", "--optimizer", "adam_w", "--lr", "1e-4", "--lora-rank", "16",
           "--lora-alpha", "32", "--seed", "1", "--gradient-checkpointing", checkpointing, *flags, "--json"]  # fmt: skip
    wall, peak = run_child(cmd, env)
    receipt = json.loads((home / "adapters" / name / "train_receipt.json").read_text())
    phases = receipt["phase_timings"]
    loop = sum(phases[k] for k in ("policy_forward_ms", "backward_ms", "optimizer_ms")) / 1000
    steps = len(receipt.get("loss_history") or []) or receipt["data"]["examples_trained"]
    plan = receipt["runtime"]["memory_plan"]
    return {
        "tool": "kiln",
        "setting": setting,
        "startup_s": wall - loop,
        "step_s": loop / max(1, steps),
        "peak_mib": peak,
        "estimate_mib": plan["estimate_bytes"] / 2**20,
    }


def trl_run(setting: str, data: Path, model_dir: Path, env: dict[str, str], work: Path, python: str) -> dict:
    precision, checkpointing = setting.split("-")
    dtype = "float32" if precision == "fp32" else "bfloat16"
    out = work / f"trl-{setting}-{time.monotonic_ns()}"
    cmd = [python, "-c", TRL_SCRIPT, str(model_dir), str(data), str(out), ",".join(TARGETS), "1", "1", dtype,
           checkpointing]  # fmt: skip
    lines: list[str] = []
    wall, peak = run_child(cmd, env, lines)
    metrics = json.loads(next(line for line in lines if line.startswith("TRL_METRICS ")).split(" ", 1)[1])
    loop = float(metrics["train_runtime"])
    steps = int(metrics.get("global_step") or 0) or 1
    return {"tool": "trl", "setting": setting, "startup_s": wall - loop, "step_s": loop / steps, "peak_mib": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--settings", default=DEFAULT_SETTINGS)
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="kiln-bench-real-"))
    model_dir, data, home = work / "model", work / "data.jsonl", work / "home"
    if not (model_dir / "model.safetensors").exists():
        t0 = time.perf_counter()
        make_model(model_dir)
        print(f"built the model in {time.perf_counter() - t0:.0f} s: {model_dir}", flush=True)
    make_data(data, model_dir, args.rows, args.seq_len)
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "KILN_HOME": str(home), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "generated")])}  # fmt: skip
    settings = args.settings.split(",")
    results = []
    for i, setting in enumerate(settings):
        order = ("kiln", "trl") if i % 2 == 0 else ("trl", "kiln")
        for tool in order:
            if tool == "trl" and (args.no_trl or setting.startswith("nf4")):
                continue
            if tool == "kiln":
                row = kiln_run(setting, data, model_dir, env, home, f"real-{setting}")
                row["start"] = "cold" if not any(r["tool"] == "kiln" for r in results) else "warm"
            else:
                row = trl_run(setting, data, model_dir, env, work, args.trl_python)
            results.append(row)
            extra = (f"  estimate {row['estimate_mib']:7.0f} MiB ({row['estimate_mib'] / row['peak_mib']:.2f}x)"
                     if "estimate_mib" in row else "")  # fmt: skip
            print(f"{tool:4} {setting:9} start-up {row['startup_s']:6.1f} s{' (' + row['start'] + ')' if 'start' in row else ''}"
                  f"  step {row['step_s']:7.1f} s  peak {row['peak_mib']:7.0f} MiB{extra}", flush=True)  # fmt: skip
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.rows} rows x ~{args.seq_len} tokens, batch 1; ratios Kiln / TRL at the same setting")
    for setting in settings:
        k = next((r for r in results if r["tool"] == "kiln" and r["setting"] == setting), None)
        t = next((r for r in results if r["tool"] == "trl" and r["setting"] == setting), None)
        if k and t:
            print(f"{setting:9} peak {k['peak_mib'] / t['peak_mib']:.2f}x  step {k['step_s'] / t['step_s']:.2f}x  "
                  f"start-up {k['startup_s'] / t['startup_s']:.2f}x")  # fmt: skip
    base = next((r for r in results if r["tool"] == "kiln" and r["setting"] == "fp32-off"), None)
    for r in results:
        if base and r["tool"] == "kiln" and r is not base:
            print(f"kiln {r['setting']:9} peak {r['peak_mib'] / base['peak_mib']:.2f}x of fp32-off, step "
                  f"{r['step_s'] / base['step_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
