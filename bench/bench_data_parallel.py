"""Steps per second of SFT, GRPO or OPD: one process with T threads against N ranks (torchrun, gloo), T / N each.

    python bench/bench_data_parallel.py [--kind sft|grpo|opd] [--model tiny|wide] [--rows 48] [--micro 1]
                                        [--ranks 2] [--rounds 3]

Both sides train the same global steps: one process at micro-batch ``micro x ranks`` against ``ranks`` ranks at
micro-batch ``micro`` (a step of ``micro x ranks`` conversations either way; they train the same weights up to
rounding). Each side runs in a fresh process tree: the single process is ``python bench/bench_data_parallel.py
--side`` with ``torch.set_num_threads(T)``; the ranks are ``python -m torch.distributed.run --standalone
--nproc-per-node N bench/bench_data_parallel.py --side`` (each rank with T / N threads, as ``kiln serve`` and
``kiln train --local`` plan them). The rate is timed from the trainer's own progress events on rank 0 (from the
first step's end to the last's: model load, admission and publication are left out). Rounds alternate the sides;
each side's best round is reported, with the ratio ranks / one process. Results: bench/README.md.

``--kind grpo``: ``--rows`` groups of ``micro x ranks`` completions (the example conversations' answers, rewards
spread over [0, 1], each group one prompt), one optimizer step per group; one process runs the group in one micro-batch,
each rank its contiguous block of ``micro`` completions (``kiln.grpo-step-completions.v1``), both with the shared
prompt (``prefix_sharing`` auto) and a k1 KL term against the base. ``--kind opd``: ``--rows`` prompts, a step of
``micro x ranks`` candidates (``micro_batch_size`` ``micro``, ``gradient_accumulation_steps`` ``ranks`` on both
sides, 24 new tokens at most, the student as its own local teacher); one process trains every micro-batch, each rank
decodes the whole step and trains its own (``kiln.opd-step-candidates.v1``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE.parent / "examples" / "sft_corrections.jsonl"


def side(args: argparse.Namespace) -> None:
    """One training run (a single process, or one rank under torchrun); rank 0 prints its rate as JSON."""
    import torch

    from kiln.trainers import TRAINERS, TrainingContext
    from kiln.training import DataParallel

    group = DataParallel.from_environment(threads=args.threads)
    if not group.active:
        torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    examples = (rows * (args.rows // len(rows) + 1))[: args.rows]
    config = {"seed": 3, "micro_batch_size": args.micro, "optimizer": {"kind": "adam_w"}, "learning_rate": 1e-4,
              "lora_rank": 8, "lora_alpha": 16.0}  # fmt: skip
    teachers = Path(args.registry).parent / "teachers"
    context = TrainingContext(
        registry=Path(args.registry), model_path=args.model_path, data_parallel=group, teachers_root=teachers
    )
    request = _request(args.kind, examples, config, args.group)
    job = TRAINERS[args.kind].admit(request, adapter_name=args.name, context=context)
    stamps: list[float] = []
    result = TRAINERS[args.kind].run(job, progress=lambda _event: stamps.append(time.perf_counter()))
    if group.publishes:
        steps = len(stamps) - 1
        print(json.dumps({"steps": steps, "seconds": stamps[-1] - stamps[0], "status": result.status,
                          "threads": torch.get_num_threads(), "world": group.world_size}))  # fmt: skip
    group.leave()


def _request(kind: str, examples: list[dict], config: dict, size: int) -> dict:
    """The run's request: SFT on the example conversations; GRPO groups of ``size`` completions of one prompt
    each; OPD on their prompts with the local teacher ``self``."""
    answers = [m["content"] for row in examples for m in row["messages"] if m["role"] == "assistant"]
    prompts = [[m for m in row["messages"] if m["role"] != "assistant"][:2] for row in examples]
    if kind == "sft":
        return {"examples": examples, "config": config}
    if kind == "grpo":
        groups = [
            {"messages": prompt,
             "completions": [{"text": answers[(n + i) % len(answers)], "reward": (i * 5 % size) / max(size - 1, 1)}
                             for i in range(size)]}
            for n, prompt in enumerate(prompts)
        ]  # fmt: skip
        return {"groups": groups, "config": {**config, "kl_coeff": 0.05}}
    return {"teacher": "self", "prompts": [{"messages": prompt} for prompt in prompts],
            "config": {**config, "max_tokens": 24, "top_k": 16, "epochs": 1,
                       "gradient_accumulation_steps": size // config["micro_batch_size"]}}  # fmt: skip


def _model(kind: str, root: Path) -> Path:
    from kiln.model import create_tiny

    tiny = create_tiny(root / "kiln-tiny", seed=0)
    if kind == "tiny":
        return tiny
    sys.path.insert(0, str(HERE))
    from _machine import make_wide

    wide = root / "wide"
    make_wide(wide, tiny)
    return wide


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("sft", "grpo", "opd"), default="sft")
    parser.add_argument("--model", choices=("tiny", "wide"), default="tiny")
    parser.add_argument("--rows", type=int, default=48, help="conversations of the run (the example rows repeated)")
    parser.add_argument("--micro", type=int, default=1, help="micro-batch of a rank")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="the single process's threads (default: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--registry", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--name", help=argparse.SUPPRESS)
    parser.add_argument("--group", type=int, default=1, help=argparse.SUPPRESS)  # a step's completions/candidates
    args = parser.parse_args()
    if args.side:
        side(args)
        return
    import torch

    threads = args.threads or torch.get_num_threads()
    per_rank = max(1, threads // args.ranks)
    with tempfile.TemporaryDirectory(prefix="kiln-bench-dp-") as tmp:
        root = Path(tmp)
        model = _model(args.model, root)
        if args.kind == "opd":
            from kiln.teachers import TeacherRegistry

            TeacherRegistry(root / "teachers").add({"alias": "self", "kind": "local", "model_id": str(model)})
        env = {**os.environ, "KILN_HOME": str(root / "home")}
        env.pop("OMP_NUM_THREADS", None)
        size = args.micro * args.ranks
        common = ["--rows", str(args.rows), "--model-path", str(model), "--side", "--kind", args.kind,
                  "--group", str(size)]  # fmt: skip
        best: dict[str, dict] = {}
        for round_index in range(args.rounds):
            for label in ("one", "ranks"):
                name, registry = f"{label}-{round_index}", str(root / "adapters")
                if label == "one":  # SFT and GRPO: the step in one micro-batch; OPD: the same micro-batches
                    micro = args.micro if args.kind == "opd" else size
                    argv = [sys.executable, __file__, *common, "--micro", str(micro),
                            "--threads", str(threads)]  # fmt: skip
                else:
                    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                            f"--nproc-per-node={args.ranks}", __file__, *common, "--micro", str(args.micro),
                            "--threads", str(per_rank)]  # fmt: skip
                done = subprocess.run(
                    [*argv, "--registry", registry, "--name", name], env=env, capture_output=True, text=True
                )
                if done.returncode != 0:
                    raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])
                line = next(x for x in done.stdout.splitlines() if x.startswith("{"))
                found = json.loads(line)
                found["rate"] = found["steps"] / found["seconds"]
                print(f"round {round_index} {label:5s}: {found['rate']:.2f} steps/s "
                      f"({found['world']} process(es) x {found['threads']} thread(s))", flush=True)  # fmt: skip
                if label not in best or found["rate"] > best[label]["rate"]:
                    best[label] = found
    one, ranks = best["one"], best["ranks"]
    unit = {"sft": "conversations", "grpo": "completions (one group)", "opd": "candidates"}[args.kind]
    print(f"\n{args.kind}, model {args.model}, {args.rows} rows, a step of {size} {unit}, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"1 process x {one['threads']} threads : {one['rate']:.2f} steps/s")
    print(f"{args.ranks} ranks x {ranks['threads']} thread(s): {ranks['rate']:.2f} steps/s")
    print(f"ratio ranks / one process: {ranks['rate'] / one['rate']:.2f}x")


if __name__ == "__main__":
    main()
