"""SFT steps per second: one process with T threads against N ranks (torchrun, gloo) with T / N threads each.

    python bench/bench_data_parallel.py [--model tiny|wide] [--rows 48] [--micro 1] [--ranks 2] [--rounds 3]

Both sides train the same global steps: one process at micro-batch ``micro x ranks`` against ``ranks`` ranks at
micro-batch ``micro`` (a step of ``micro x ranks`` conversations either way; they train the same weights up to
rounding). Each side runs in a fresh process tree: the single process is ``python bench/bench_data_parallel.py
--side`` with ``torch.set_num_threads(T)``; the ranks are ``python -m torch.distributed.run --standalone
--nproc-per-node N bench/bench_data_parallel.py --side`` (each rank with T / N threads, as ``kiln serve`` and
``kiln train --local`` plan them). The rate is timed from the trainer's own progress events on rank 0 (from the
first step's end to the last's: model load, admission and publication are left out). Rounds alternate the sides;
each side's best round is reported, with the ratio ranks / one process. Results: bench/README.md.
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
    from kiln.trainers.sft import run_sft
    from kiln.training import DataParallel

    group = DataParallel.from_environment(threads=args.threads)
    if not group.active:
        torch.set_num_threads(args.threads)
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    examples = (rows * (args.rows // len(rows) + 1))[: args.rows]
    config = {"seed": 3, "micro_batch_size": args.micro, "optimizer": {"kind": "adam_w"}, "learning_rate": 1e-4,
              "lora_rank": 8, "lora_alpha": 16.0}  # fmt: skip
    context = TrainingContext(registry=Path(args.registry), model_path=args.model_path, data_parallel=group)
    job = TRAINERS["sft"].admit({"examples": examples, "config": config}, adapter_name=args.name, context=context)
    stamps: list[float] = []
    result = run_sft(job, progress=lambda _event: stamps.append(time.perf_counter()))
    if group.publishes:
        steps = len(stamps) - 1
        print(json.dumps({"steps": steps, "seconds": stamps[-1] - stamps[0], "status": result.status,
                          "threads": torch.get_num_threads(), "world": group.world_size}))  # fmt: skip
    group.leave()


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
        env = {**os.environ, "KILN_HOME": str(root / "home")}
        env.pop("OMP_NUM_THREADS", None)
        common = ["--rows", str(args.rows), "--model-path", str(model), "--side"]
        best: dict[str, dict] = {}
        for round_index in range(args.rounds):
            for label in ("one", "ranks"):
                name, registry = f"{label}-{round_index}", str(root / "adapters")
                if label == "one":
                    argv = [sys.executable, __file__, *common, "--micro", str(args.micro * args.ranks),
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
    print(f"\nmodel {args.model}, {args.rows} rows, a step of {args.micro * args.ranks} conversations, "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(f"1 process x {one['threads']} threads : {one['rate']:.2f} steps/s")
    print(f"{args.ranks} ranks x {ranks['threads']} thread(s): {ranks['rate']:.2f} steps/s")
    print(f"ratio ranks / one process: {ranks['rate'] / one['rate']:.2f}x")


if __name__ == "__main__":
    main()
