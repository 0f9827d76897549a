"""Online GRPO step time: Kiln samples, scores and trains each group itself, against TRL's ``GRPOTrainer`` with its
built-in generation and the same reward function.

    python bench/bench_online_grpo.py              # tiny + wide model, 2 rounds (~10 min on 2 cores with TRL)
    python bench/bench_online_grpo.py --no-trl     # Kiln only
    python bench/bench_online_grpo.py --smoke      # tiny model, Kiln only, 2 steps (the suite runs this)

Both sides train the same LoRA policy (rank 16 / alpha 32 on q k v o gate up down, every A initialised as Kiln
does, B = 0) from the same prompts, one prompt per optimizer step: each step samples a group of 8 completions of up
to 32 tokens at temperature 1 from the current policy (Kiln: its one batched decoder on the invariant forward; TRL:
``model.generate`` with a KV cache, 8 rows), scores them with one reward function (``_online_reward.digit_reward``:
1 when the completion holds a digit -- TRL calls it, and Kiln calls it as its ``module:function`` scorer), and takes
one AdamW step (lr 1e-4) on ``-min(ρA, clip(ρ, 0.8, 1.2)A) + 0.1·k3`` over the group's completion tokens
(A = r − mean r; TRL: ``loss_type="dapo"``, ``scale_rewards="none"``, ``beta=0.1`` against the adapter-disabled
model; Kiln: ``token_level``, ``dr_grpo``, ``kl_estimator k3``, ``dynamic_sampling`` off so every group trains).
Kiln's ratios are taken against its recorded behaviour log-probabilities (exactly 1 at each step's start); TRL's
against its own forward (``num_iterations=1``). fp32, no gradient clipping, 2 torch threads, each side in a fresh
interpreter.

Time: one warm-up step, then the timed steps (8 tiny, 4 wide); median per step. Kiln: the interval between
consecutive ``progress`` callbacks (a step: sample, score, forwards, backward, optimizer step); TRL:
``on_step_begin`` to ``on_step_end`` (its generation runs inside the step). Generation share over the timed steps:
Kiln, the time inside ``kiln.rollouts.sample_groups`` (decoding, the forward of the template's closing tokens and
scoring; scoring alone is shown beside it, from the receipt); TRL, the time inside the PEFT model's
``generate`` (a wrapper).
Rounds alternate the order of the sides; the table takes each side's fastest round.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from _machine import cpu_model, kiln_lora_init, make_wide

REPO = Path(__file__).resolve().parent.parent
TRL_PYTHON = "/tmp/trlvenv/bin/python"  # noqa: S108 - the bench venv with trl, not a temp file
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
THREADS, GROUP, TOKENS, LR, BETA, EPS, SEED, RANK, ALPHA = 2, 8, 32, 1e-4, 0.1, 0.2, 7, 16, 32.0
SCORER = "_online_reward:digit_reward"


def prompts(count: int) -> list[str]:
    topics = ("cats", "rain", "maps", "bread", "ships", "glass", "stars", "trees", "songs", "clocks", "rivers")
    return [f"Tell me one number about {topics[i % len(topics)]} ({i})." for i in range(count)]


def side_kiln(args: argparse.Namespace) -> dict[str, Any]:
    import kiln.rollouts
    from kiln.trainers.grpo import admit_grpo, run_grpo

    sampling = [0.0]  # seconds inside sample_groups: decoding, the forced tokens' forward, scoring
    sample = kiln.rollouts.sample_groups

    def timed_sample(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return sample(*a, **k)
        finally:
            sampling[0] += time.perf_counter() - t0

    kiln.rollouts.sample_groups = timed_sample  # the trainer imports it from the package at each step

    tasks = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(prompts(args.steps))]
    request = {
        "online": {
            "tasks": tasks,
            "scorer": SCORER,
            "group_size": GROUP,
            "sampling": {"temperature": 1.0, "max_tokens": TOKENS},
        },
        "config": {
            "seed": SEED, "learning_rate": LR, "optimizer": {"kind": "adam_w", "weight_decay": 0.0},
            "kl_coeff": BETA, "kl_estimator": "k3", "clip_epsilon": EPS, "dynamic_sampling": False,
            "lora_rank": RANK, "lora_alpha": ALPHA, "lora_target_modules": TARGETS, "precision": "fp32",
            "checkpoint_interval": None,
        },
    }  # fmt: skip
    job = admit_grpo(adapter_name="online", registry=Path(args.work) / "adapters", request=request,
                     model_path=args.model)  # fmt: skip
    marks: list[float] = []
    rewards: list[float] = []
    shares: list[float] = []

    def progress(event: dict[str, Any]) -> None:
        marks.append(time.perf_counter())
        shares.append(sampling[0])
        rewards.append(float(event.get("reward", 0.0)))

    start = time.perf_counter()
    result = run_grpo(job, progress=progress)
    if result.status != "success":
        raise RuntimeError(f"kiln run failed: {result.receipt.get('failure_message')}")
    online = result.receipt["grpo"]["online"]
    steps = [marks[0] - start] + [b - a for a, b in itertools.pairwise(marks)]
    return {
        "steps": steps,
        "generation_steps_s": [shares[0]] + [b - a for a, b in itertools.pairwise(shares)],
        "generation_s": online["generation_ms"] / 1000,
        "scoring_s": online["scoring_ms"] / 1000,
        "rewards": rewards,
        "gap": online["max_behavior_logprob_gap"],
        "tokens": sum(len(c["provenance"]["action_tokens"]) for c in _log(result.adapter_dir)),
    }


def _log(adapter: Path) -> list[dict[str, Any]]:
    return [
        c for line in (adapter / "rollouts.jsonl").read_text().splitlines() for c in json.loads(line)["completions"]
    ]


def side_trl(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    warnings.simplefilter("ignore")
    import peft
    import torch
    from _online_reward import digit_reward
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    generating = [0.0]
    generate = peft.PeftModelForCausalLM.generate  # what TRL's generation calls on the PEFT policy

    def timed_generate(self: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return generate(self, *a, **k)
        finally:
            generating[0] += time.perf_counter() - t0

    peft.PeftModelForCausalLM.generate = timed_generate
    steps: list[float] = []
    shares: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.g0 = time.perf_counter(), generating[0]

        def on_step_end(self, a, state, control, **kw):
            steps.append(time.perf_counter() - self.t0)
            shares.append(generating[0] - self.g0)

    config = GRPOConfig(
        output_dir=str(Path(args.work) / "trl-out"), per_device_train_batch_size=GROUP, num_generations=GROUP,
        gradient_accumulation_steps=1, num_iterations=1, beta=BETA, epsilon=EPS, loss_type="dapo",
        scale_rewards="none", learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
        optim="adamw_torch", adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, bf16=False,
        gradient_checkpointing=False, use_cpu=True, logging_steps=1, save_strategy="no", report_to=[],
        num_train_epochs=1, seed=SEED, shuffle_dataset=False, disable_tqdm=True, dataloader_num_workers=0,
        max_completion_length=TOKENS, log_completions=False, temperature=1.0, top_p=1.0,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts(args.steps)])
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=[digit_reward], args=config, train_dataset=data,
                          processing_class=tok, peft_config=lora, callbacks=[Clock()])  # fmt: skip
    kiln_lora_init(trainer.model, SEED)
    torch.set_num_threads(THREADS)
    trainer.train()
    return {"steps": steps, "generation_steps_s": shares}


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(THREADS)
    out = side_trl(args) if args.worker == "trl" else side_kiln(args)
    out["versions"] = {"torch": torch.__version__}
    if args.worker == "trl":
        import trl

        out["versions"]["trl"] = trl.__version__
    Path(args.result).write_text(json.dumps(out))


def run_side(side: str, python: str, model: Path, steps: int, work: Path) -> dict[str, Any]:
    result = work / f"result-{side}-{time.monotonic_ns()}.json"
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--model", str(model), "--steps", str(steps),
           "--work", str(work / f"{side}-{time.monotonic_ns()}"), "--result", str(result)]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "KILN_HOME": str(work / "home"), "OMP_NUM_THREADS": str(THREADS), "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "generated"), str(Path(__file__).resolve().parent)])}  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,wide")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny model, Kiln only, 2 steps, 1 round")
    parser.add_argument("--trl-python", default=TRL_PYTHON)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    models = ["tiny"] if args.smoke else args.models.split(",")
    sides = ["kiln"] if args.smoke or args.no_trl else ["kiln", "trl"]
    rounds = 1 if args.smoke else args.rounds
    work = args.dir or Path(tempfile.mkdtemp(prefix="kiln-bench-online-"))
    work.mkdir(parents=True, exist_ok=True)
    from kiln.model import create_tiny

    tiny = work / "tiny"
    if not tiny.exists():
        create_tiny(tiny, seed=0)
    dirs = {"tiny": tiny}
    if "wide" in models:
        dirs["wide"] = work / "wide"
        if not dirs["wide"].exists():
            make_wide(dirs["wide"], tiny)
    print(f"# {cpu_model()}, {os.cpu_count()} cores, {THREADS} threads per side, group {GROUP}, {TOKENS} tokens")
    for name in models:
        timed = 2 if args.smoke else 8 if name == "tiny" else 4
        found: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
        for r in range(rounds):
            for side in sides if r % 2 == 0 else list(reversed(sides)):
                python = args.trl_python if side == "trl" else sys.executable
                found[side].append(run_side(side, python, dirs[name], timed + 1, work))
        best: dict[str, tuple[float, dict[str, Any]]] = {}
        for side, runs in found.items():
            medians = [(statistics.median(run["steps"][1:]), run) for run in runs]
            best[side] = min(medians, key=lambda pair: pair[0])
        print(f"\n## {name}")
        print("| side | step ms (median) | round medians ms | generating | scoring | steps timed |")
        print("|---|---|---|---|---|---|")
        for side, (med, run) in best.items():
            total = sum(run["steps"][1:])
            share = sum(run["generation_steps_s"][1:]) / total
            scoring = f"{run['scoring_s'] / sum(run['steps']):.1%}" if side == "kiln" else "-"
            rounds_ms = ", ".join(f"{statistics.median(r['steps'][1:]) * 1000:.0f}" for r in found[side])
            print(f"| {side} | {med * 1000:.0f} | {rounds_ms} | {share:.1%} | {scoring} | {len(run['steps']) - 1} |")
        kiln = best["kiln"][1]
        print(f"\nKiln: max behaviour/trainer gap {kiln['gap']}, rewards {[round(x, 3) for x in kiln['rewards']]}")
        if kiln["gap"] != 0.0:
            raise SystemExit(f"the behaviour/trainer gap is {kiln['gap']}, not 0.0")
        if "trl" in best:
            print(f"Kiln/TRL step time: {best['kiln'][0] / best['trl'][0]:.2f}x")


if __name__ == "__main__":
    main()
