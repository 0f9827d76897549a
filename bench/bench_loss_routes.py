"""Peak memory and step time of the SFT loss routes on CPU.

    python bench/bench_loss_routes.py [--seq-lens 512,2048,8192] [--reps 3] [--plot bench/loss_routes.png]

Head V=151,936, H=896 (a Qwen2-0.5B-sized LM head), fp32, half of the T positions
supervised at random. Each (route, T) runs in a fresh interpreter: it allocates the inputs,
resets the resident high-water mark (/proc/self/clear_refs) and takes the resident set as
the baseline, then runs forward+backward (one warm-up, then ``--reps`` timed) and reports
the high-water mark above the baseline (the loss-path peak: logits, softmax, gradients,
chunks, plus allocator slack) and the median step time. A configuration
whose projected peak exceeds the memory available now is reported as not run. Numbers go
to bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from _machine import available_bytes, memory_status

from kiln.kernels import FULL_LOGITS, FUSED_CHUNKED_LINEAR_CE, LOSS_ROUTES, sft_loss

VOCAB, HIDDEN = 151_936, 896
MIB = 1024 * 1024


def reset_peak() -> None:
    """Reset the resident high-water mark (VmHWM) to the current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(route: str, rows: int, vocab: int, width: int, reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, width, generator=gen).requires_grad_()
    weight = torch.randn(vocab, width, generator=gen).div_(width**0.5)
    labels = torch.randint(0, vocab, (rows,), generator=gen)
    labels[torch.randperm(rows, generator=gen)[: rows - rows // 2]] = -100
    reset_peak()  # input set-up must not count
    baseline = memory_status("VmRSS")
    times, loss = [], None
    for rep in range(reps + 1):
        hidden.grad = None
        start = time.perf_counter()
        loss = sft_loss(route, hidden, weight, labels)
        loss.backward()
        if rep:  # the first step is a warm-up
            times.append(time.perf_counter() - start)
    peak = memory_status("VmHWM")
    return {
        "route": route,
        "rows": rows,
        "supervised": rows // 2,
        "peak_bytes": peak - baseline,
        "seconds": statistics.median(times),
        "loss": loss.item(),
        "threads": torch.get_num_threads(),
    }


def run_one(route: str, rows: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", route, str(rows), "--vocab", str(args.vocab)]
    cmd += ["--hidden", str(args.hidden), "--reps", str(args.reps)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"route": route, "rows": rows, "skipped": f"exit {done.returncode}: {done.stderr.strip()[-200:]}"}
    return json.loads(done.stdout)


def table(results: list[dict]) -> str:
    full = {r["rows"]: r for r in results if r["route"] == FULL_LOGITS and "skipped" not in r}
    lines = [
        f"{'route':<25} {'T':>5} {'A':>5} {'peak MiB':>9} {'x full':>7} {'step s':>7} {'x full':>7} {'loss':>9}",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"{r['route']:<25} {r['rows']:>5}   not run: {r['skipped']}")
            continue
        ref = full.get(r["rows"])
        mem_ratio = f"{r['peak_bytes'] / ref['peak_bytes']:.3f}" if ref else "-"
        time_ratio = f"{r['seconds'] / ref['seconds']:.2f}" if ref else "-"
        lines.append(
            f"{r['route']:<25} {r['rows']:>5} {r['supervised']:>5} {r['peak_bytes'] / MIB:>9.0f} {mem_ratio:>7}"
            f" {r['seconds']:>7.2f} {time_ratio:>7} {r['loss']:>9.5f}"
        )
    return "\n".join(lines)


def targets(results: list[dict], rows: int = 2048) -> str:
    """The README targets: at T=2048 the fused route within 0.25x the full-logits peak and 1.3x its time."""
    found = {r["route"]: r for r in results if r["rows"] == rows and "skipped" not in r}
    if FULL_LOGITS not in found or FUSED_CHUNKED_LINEAR_CE not in found:
        return f"targets: T={rows} not measured"
    full, fused = found[FULL_LOGITS], found[FUSED_CHUNKED_LINEAR_CE]
    mem = fused["peak_bytes"] / full["peak_bytes"]
    step = fused["seconds"] / full["seconds"]
    return (
        f"targets at T={rows}: fused/full peak {mem:.3f} (target <= 0.25: {'met' if mem <= 0.25 else 'MISSED'}),"
        f" fused/full time {step:.2f} (target <= 1.3: {'met' if step <= 1.3 else 'MISSED'})"
    )


def plot(results: list[dict], path: str) -> None:
    import matplotlib  # optional: only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for route in LOSS_ROUTES:
        done = [r for r in results if r["route"] == route and "skipped" not in r]
        xs = [r["rows"] for r in done]
        mem_ax.plot(xs, [r["peak_bytes"] / MIB for r in done], marker="o", label=route)
        time_ax.plot(xs, [r["seconds"] for r in done], marker="o", label=route)
    for ax, title, unit in ((mem_ax, "peak loss-path memory", "MiB"), (time_ax, "forward+backward step", "s")):
        ax.set(xscale="log", yscale="log", xlabel="sequence length T (half supervised)", ylabel=unit, title=title)
        ax.grid(True, which="both", alpha=0.3)
    mem_ax.legend()
    fig.suptitle(f"SFT loss routes on CPU, head V={VOCAB:,} H={HIDDEN}, fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="512,2048,8192")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--plot", metavar="PATH")
    parser.add_argument("--worker", nargs=2, metavar=("ROUTE", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        route, rows = args.worker
        print(json.dumps(worker(route, int(rows), args.vocab, args.hidden, args.reps)))
        return

    print(f"python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cpus")
    results, per_row = [], {}
    for rows in sorted(int(t) for t in args.seq_lens.split(",")):
        for route in LOSS_ROUTES:
            projected = per_row.get(route, 0) * rows
            if projected > 0.8 * available_bytes():
                why = (
                    f"projected peak {projected / 2**30:.1f} GiB > 80% of {available_bytes() / 2**30:.1f} GiB available"
                )
                results.append({"route": route, "rows": rows, "skipped": why})
            else:
                results.append(run_one(route, rows, args))
                if "skipped" not in results[-1]:
                    per_row[route] = results[-1]["peak_bytes"] / rows
            print(json.dumps(results[-1]), flush=True)
    print(table(results))
    print(targets(results))
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
