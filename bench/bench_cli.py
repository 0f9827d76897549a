"""How fast ``kiln train ... --local`` answers a mistake: wall time of the whole command, from exec to exit.

    python bench/bench_cli.py [--repeats 5] [--rows 10000]

Each case runs the real ``kiln`` console script of this interpreter's environment as a subprocess with a fresh
``KILN_HOME`` (a temporary directory), ``--repeats`` times; reported: the median and the worst wall time, the exit
status and whether torch was imported (``-X importtime`` output searched for ``torch``). The cases:

* an unknown flag (``--epohcs 2``): argparse's refusal with a suggestion;
* a missing file (``-f examples/sft_corection.jsonl``);
* a config bound (``--lora-rank 0``);
* a malformed row, the last of ``--rows`` rows of an SFT JSONL file (every row before it read and checked);
* the same malformed row at line 2 (what the rest of the file costs);
* for reference, ``kiln --version`` (the interpreter and the CLI's own imports).

The targets (issue "The command line a person meets"): an argument or path mistake in at most 1 s, a malformed row
in a 10,000-row file in at most 3 s, on an idle 2-core machine.
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

from _machine import cpu_model

ROOT = Path(__file__).resolve().parent.parent
GOOD = {"messages": [{"role": "user", "content": "Reset my password, please."},
                     {"role": "assistant", "content": "Open Settings, choose Security, then Reset password."}]}  # fmt: skip


def _kiln() -> list[str]:
    script = Path(sys.executable).parent / "kiln"
    return [str(script)] if script.exists() else [sys.executable, "-m", "kiln.cli"]


def _measure(argv: list[str], repeats: int) -> dict[str, object]:
    times, codes, torch = [], set(), False
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as home:
            env = {**os.environ, "KILN_HOME": home, "PYTHONPROFILEIMPORTTIME": "1"}
            started = time.perf_counter()
            done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
            times.append(time.perf_counter() - started)
            codes.add(done.returncode)
            torch = torch or any(line.rstrip().endswith("| torch") for line in done.stderr.splitlines())
    return {"median_s": statistics.median(times), "max_s": max(times), "exit": sorted(codes), "torch": torch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=10_000)
    args = parser.parse_args()
    kiln = _kiln()
    with tempfile.TemporaryDirectory() as tmp:
        last = Path(tmp) / "last_row_bad.jsonl"
        line = json.dumps(GOOD) + "\n"
        last.write_text(line * (args.rows - 1) + '{"messages": [\n', encoding="utf-8")
        early = Path(tmp) / "second_row_bad.jsonl"
        early.write_text(line + '{"messages": [\n' + line * (args.rows - 2), encoding="utf-8")
        train = [*kiln, "train", "sft", "--local", "--adapter", "bench-bot"]
        cases = {
            "kiln --version": [*kiln, "--version"],
            "unknown flag (--epohcs 2)": [*train, "-f", "examples/sft_corrections.jsonl", "--epohcs", "2"],
            "missing file": [*train, "-f", "examples/sft_corection.jsonl"],
            "config bound (--lora-rank 0)": [*train, "-f", "examples/sft_corrections.jsonl", "--lora-rank", "0"],
            f"malformed row {args.rows:,} of {args.rows:,}": [*train, "-f", str(last)],
            f"malformed row 2 of {args.rows:,}": [*train, "-f", str(early)],
        }
        print(f"{cpu_model()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; {args.repeats} runs each")
        print(f"{'case':<34} {'median s':>9} {'max s':>7}  exit  torch imported")
        for name, argv in cases.items():
            found = _measure(argv, args.repeats)
            print(f"{name:<34} {found['median_s']:>9.2f} {found['max_s']:>7.2f}  {found['exit']}  {found['torch']}")


if __name__ == "__main__":
    main()
