"""What an audit costs against the run it audits: ``kiln audit`` full and by spot checks, on the bench model.

    python bench/bench_audit.py [--epochs 4] [--interval 12] [--kind sft|grpo]

In one process, with a temporary KILN_HOME: the benches' wider random Qwen2 (hidden 512, 8 layers, 23.2 M
parameters, ``_machine.make_wide``) on the tiny tokenizer; one run trained in-process from the examples
(SFT: ``examples/sft_corrections.jsonl`` x ``--epochs``; GRPO: ``examples/grpo_groups.jsonl``), a checkpoint every
``--interval`` steps; then a full audit and a spot check of one segment. Reported: the run's own training time
(its receipt's ``runtime.wall_clock_ms``), the same run end to end (admission and model load included), each
audit's wall time, its verdict, and the ratios. Target (issue "Training audit"): a full audit at most 1.2x the
original run's training time.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _machine import cpu_model, make_wide

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=("sft", "grpo"), default="sft")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--interval", type=int, default=12)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-audit-") as tmp:
        os.environ["KILN_HOME"] = str(Path(tmp) / "home")
        from kiln.audit import audit
        from kiln.model import create_tiny
        from kiln.trainers import TRAINERS, TrainingContext

        tiny = create_tiny(Path(tmp) / "tiny", seed=0)
        model = Path(tmp) / "wide"
        make_wide(model, tiny)
        config: dict[str, object] = {"seed": 7, "checkpoint_interval": args.interval}
        if args.kind == "sft":
            request = {"dataset_path": str(ROOT / "examples" / "sft_corrections.jsonl"),
                       "config": {**config, "epochs": args.epochs}}  # fmt: skip
        else:
            request = {"dataset_path": str(ROOT / "examples" / "grpo_groups.jsonl"), "config": config}
        context = TrainingContext(registry=Path(tmp) / "adapters", model_path=str(model))
        started = time.perf_counter()
        job = TRAINERS[args.kind].admit(request, adapter_name="bench", context=context)
        result = TRAINERS[args.kind].run(job)
        end_to_end = time.perf_counter() - started
        assert result.status == "success", result.receipt.get("failure_message")
        training = result.receipt["runtime"]["wall_clock_ms"] / 1000
        full = audit(result.adapter_dir, say=lambda _: None)
        spot = audit(result.adapter_dir, segments=1, seed=0, say=lambda _: None)
        steps = len(result.losses)
        print(f"{cpu_model()}, {os.cpu_count()} CPUs; {args.kind} on the 23.2 M bench model, {steps} optimizer steps, "
              f"a checkpoint every {args.interval} ({len(full['checkpoints'])} published)")  # fmt: skip
        print(f"{'measure':<44} {'seconds':>8} {'x training':>11}")
        rows = [
            ("the run: training (receipt wall_clock_ms)", training),
            ("the run: end to end (admission, model load)", end_to_end),
            (f"full audit ({full['verdict']})", full["seconds"]),
            (f"spot check, 1 of {len(spot['segments'])} segments ({spot['verdict']})", spot["seconds"]),
        ]
        for name, seconds in rows:
            print(f"{name:<44} {seconds:>8.2f} {seconds / training:>10.2f}x")


if __name__ == "__main__":
    main()
