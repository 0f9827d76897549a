"""Every benchmark this suite names runs as written from a clean clone, at its smallest size (``--smoke``): the
command in bench/README.md cannot rot. The figures of a smoke run mean nothing; that it runs, and that its checks
hold (batched answers equal to sequential ones, the same tokens on both sides), does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, *command: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env["KILN_HOME"] = str(tmp_path / "home")
    done = subprocess.run(
        [sys.executable, *command], cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.slow
def test_the_invariant_forward_bench_runs_at_its_smallest_size(tmp_path):
    out = _run(tmp_path, "bench/bench_invariant.py", "--smoke")
    assert "same tokens: yes" in out
    assert "same tokens: NO" not in out
    assert "lone decoding" in out.split("medians of")[-1]
    assert "training step" in out.split("medians of")[-1]


@pytest.mark.slow
def test_the_serving_bench_runs_at_its_smallest_size(tmp_path):
    out = _run(tmp_path, "bench/bench_serving.py", "--smoke", "--threads", "1")
    assert "batched answers identical: yes" in out
    assert "(b) n=2 vs 2 x n=1" in out


@pytest.mark.slow
def test_the_online_grpo_bench_runs_at_its_smallest_size(tmp_path):
    out = _run(tmp_path, "bench/bench_online_grpo.py", "--smoke", "--dir", str(tmp_path / "work"))
    assert "| kiln |" in out
    assert "max behaviour/trainer gap 0.0" in out  # the bench itself fails on any other gap
