"""Whole-run comparison: Kiln ``train sft --local`` versus TRL's SFTTrainer with PEFT.

    python bench/bench_vs_trl.py [--conversations 64] [--seq-len 2048] [--runs 3] [--out DIR]
                                 [--micro-batch B] [--accumulation K] [--trl-python PATH]
    python bench/bench_vs_trl.py --kiln-sweep 1,4,8 [--conversations N] [--seq-len L]

``--trl-python`` is an interpreter with ``trl==1.16.0`` (a bench-only dependency) and Kiln's
own dependencies (default: this one). Both tools train the same model (a 2-layer
Qwen2-shaped model, H=896, V=151,936, random weights from a fixed seed, the tiny tokenizer),
on the same conversations (one user turn and one assistant turn of about seq_len/2 tokens
each; only the assistant turn is learned), for one epoch, ``--micro-batch`` conversations per
forward and ``--accumulation`` forwards per optimizer step (TRL's
``per_device_train_batch_size`` and ``gradient_accumulation_steps``), LoRA rank 16 / alpha 32
on the same target modules, AdamW at lr 1e-4. Each run is a fresh process; the script reports
wall time and peak RSS (ru_maxrss of the child) and the medians over ``--runs`` runs,
alternating the tools so that machine noise hits both alike.

``--kiln-sweep`` runs Kiln alone at each listed micro-batch size (accumulation 1) and reports
training tokens per second: every token of the conversations (padding excluded) over the
time of the training loop (the receipt's forward, backward and optimizer phases), so start-up,
model load and publication do not dilute it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TRL_SCRIPT = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer
model_dir, data, out, targets = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
rows = [json.loads(line) for line in open(data)]
ds = Dataset.from_list([{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows])
tok = AutoTokenizer.from_pretrained(model_dir)
dtype = sys.argv[7] if len(sys.argv) > 7 else "float32"  # float32 | bfloat16
checkpointing = len(sys.argv) > 8 and sys.argv[8] == "on"
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
batch, accumulation = int(sys.argv[5]), int(sys.argv[6])
cfg = SFTConfig(output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                num_train_epochs=1, bf16=dtype == "bfloat16", gradient_checkpointing=checkpointing,
                learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
                optim="adamw_torch", weight_decay=0.0, logging_steps=1000, save_strategy="no", report_to=[],
                max_length=None, completion_only_loss=True, use_cpu=True, seed=1, dataloader_num_workers=0,
                disable_tqdm=True)
peft_cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=peft_cfg)
metrics = trainer.train().metrics
trainer.save_model(out)
print("TRL_METRICS " + json.dumps(metrics), flush=True)
"""


def make_model(path: Path, **shape: object) -> list[str]:
    """A Qwen2-shaped model with random weights (seed 0) and the tiny tokenizer: 2 layers at H=896, V=151,936, or
    what ``shape`` overrides (``bench_real_size.py``: Qwen2.5-0.5B's whole configuration)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kiln.model._tiny import build_tokenizer, quiet_hub

    quiet_hub()
    tok = build_tokenizer()
    config = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=2,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
    )
    for key, value in shape.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_data(path: Path, tokenizer_dir: Path, n: int, seq_len: int) -> None:
    from transformers import AutoTokenizer

    from kiln.model._tiny import tiny_corpus

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    words = " ".join(tiny_corpus()).split()
    half = seq_len // 2 - 8

    def text(offset: int) -> str:
        out, i = [], offset
        while len(tok(" ".join(out))["input_ids"]) < half:
            out.extend(words[i % len(words) : i % len(words) + 16])
            i += 16
        return " ".join(out)

    with path.open("w", encoding="utf-8") as fh:
        for k in range(n):
            row = {
                "messages": [
                    {"role": "user", "content": text(7 * k)},
                    {"role": "assistant", "content": text(7 * k + 3)},
                ]
            }
            fh.write(json.dumps(row) + "\n")


def run_child(cmd: list[str], env: dict[str, str], lines: list[str] | None = None) -> tuple[float, float]:
    """Wall seconds and peak RSS (MiB) of one child process (``lines``: receives the child's stdout lines)."""
    # ru_maxrss of RUSAGE_CHILDREN is the max over all children so far: run each in its own shell
    # wrapper so the peak is this child's alone
    wrapped = [sys.executable, "-c",
               "import resource,subprocess,sys,json;p=subprocess.run(sys.argv[1:]);"
               "print(json.dumps([p.returncode,resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))",
               *cmd]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(wrapped, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    *printed, last = proc.stdout.strip().splitlines()
    code, peak_kib = json.loads(last)
    if lines is not None:
        lines.extend(printed)
    if code != 0:
        raise RuntimeError(f"{cmd[:4]} failed:\n{proc.stderr[-4000:]}")
    return wall, peak_kib / 1024


def kiln_command(data: Path, model_dir: Path, adapter: str, micro: int, accumulation: int) -> list[str]:
    return [sys.executable, "-m", "kiln.cli", "train", "sft", "--local", "-f", str(data), "--adapter", adapter,
            "--model", str(model_dir), "--epochs", "1", "--optimizer", "adam_w", "--lr", "1e-4",
            "--lora-rank", "16", "--lora-alpha", "32", "--seed", "1", "--micro-batch-size", str(micro),
            "--gradient-accumulation-steps", str(accumulation), "--json"]  # fmt: skip


def sweep(sizes: list[int], data: Path, model_dir: Path, env: dict[str, str], home: Path) -> None:
    """Kiln alone at each micro-batch size: training tokens per second (padding excluded) and peak RSS."""
    tokens = None
    rows = []
    for micro in sizes:
        adapter = f"sweep-{micro}"
        wall, peak = run_child(kiln_command(data, model_dir, adapter, micro, 1), env)
        receipt = json.loads((home / "adapters" / adapter / "train_receipt.json").read_text())
        phases = receipt["phase_timings"]
        train_s = sum(phases[k] for k in ("policy_forward_ms", "backward_ms", "optimizer_ms")) / 1000
        counts = receipt["token_counts"]
        tokens = counts["action_tokens"] + counts["context_tokens"]
        rows.append((micro, train_s, tokens / train_s, wall, peak))
        print(f"micro-batch {micro:2}: loop {train_s:7.1f} s  {tokens / train_s:8.0f} tokens/s  "
              f"wall {wall:7.1f} s  peak {peak:7.0f} MiB", flush=True)  # fmt: skip
    base = rows[0][2]
    print(f"\n{tokens} training tokens; tokens/s relative to micro-batch {rows[0][0]}: "
          + ", ".join(f"{micro}: {rate / base:.2f}x" for micro, _, rate, _, _ in rows))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--trl-python", default=sys.executable)
    parser.add_argument("--kiln-sweep", default=None, help="comma list of micro-batch sizes: Kiln tokens/s only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="kiln-bench-trl-"))
    model_dir, data = work / "model", work / "data.jsonl"
    if not model_dir.exists():
        targets = make_model(model_dir)
    else:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    make_data(data, model_dir, args.conversations, args.seq_len)
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "KILN_HOME": str(work / "home"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "generated")])}  # fmt: skip
    if args.kiln_sweep:
        sweep([int(x) for x in args.kiln_sweep.split(",")], data, model_dir, env, work / "home")
        return
    results: dict[str, list[tuple[float, float]]] = {"kiln": [], "trl": []}
    for i in range(args.runs):
        for tool in ("kiln", "trl") if i % 2 == 0 else ("trl", "kiln"):
            if tool == "kiln":
                cmd = kiln_command(data, model_dir, f"run{i}", args.micro_batch, args.accumulation)
            else:
                cmd = [args.trl_python, "-c", TRL_SCRIPT, str(model_dir), str(data), str(work / f"trl{i}"),
                       ",".join(targets), str(args.micro_batch), str(args.accumulation)]  # fmt: skip
            wall, peak = run_child(cmd, env)
            results[tool].append((wall, peak))
            print(f"run {i} {tool:4}: {wall:8.1f} s  peak {peak:8.0f} MiB", flush=True)
    med = {t: (statistics.median(w for w, _ in r), statistics.median(m for _, m in r)) for t, r in results.items()}
    print(f"\n{args.conversations} conversations x ~{args.seq_len} tokens, 1 epoch, micro-batch {args.micro_batch} x "
          f"accumulation {args.accumulation}, {args.runs} runs each (medians)")  # fmt: skip
    print(f"kiln: {med['kiln'][0]:.1f} s, {med['kiln'][1]:.0f} MiB peak RSS")
    print(f"trl : {med['trl'][0]:.1f} s, {med['trl'][1]:.0f} MiB peak RSS")
    print(
        f"ratio kiln/trl: time {med['kiln'][0] / med['trl'][0]:.2f}x, peak memory {med['kiln'][1] / med['trl'][1]:.2f}x"
    )


if __name__ == "__main__":
    main()
