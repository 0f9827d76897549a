"""``scripts/qualify-gpu`` fails honestly where there is no GPU: it exits 1, every check is ``not_run`` with its
reason, the receipt says the qualification did not pass and why; and a qualification passes only when every check
passed -- one that did not run, or failed, fails it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "qualify-gpu"


def _module():
    spec = importlib.util.spec_from_file_location("qualify_gpu", REPO / "scripts" / "qualify_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_the_qualification_runs_nothing_and_exits_1(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the qualification would run (scripts/qualify-gpu)")
    out = tmp_path / "receipt.json"
    done = subprocess.run(
        [str(SCRIPT), "--out", str(out), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "KILN_HOME": str(tmp_path / "home")},
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr
    assert "NOT qualified" in done.stderr
    assert "Traceback" not in done.stderr
    receipt = json.loads(out.read_text(encoding="utf-8"))
    assert receipt["receipt_type"] == "kiln.gpu-qualification.v1"
    assert receipt["passed"] is False
    assert receipt["device"] is None
    assert receipt["envelope"] is None
    assert "needs a CUDA device, and this machine has none" in receipt["error"]
    assert set(receipt["checks"]) == set(_module().CHECKS)
    assert {c["outcome"] for c in receipt["checks"].values()} == {"not_run"}
    assert not (tmp_path / "work").exists()  # nothing ran, nothing was built


def test_the_cpu_is_not_a_device_the_qualification_accepts(tmp_path):
    out = tmp_path / "receipt.json"
    assert _module().main(["--device", "cpu", "--out", str(out)]) == 1
    receipt = json.loads(out.read_text(encoding="utf-8"))
    assert receipt["passed"] is False
    assert "the qualification is of a CUDA device" in receipt["error"]


@pytest.mark.parametrize(
    ("outcomes", "passed"),
    [
        (["passed"] * 6, True),
        (["passed"] * 5 + ["not_run"], False),
        (["passed"] * 5 + ["failed"], False),
        ([], False),
    ],
)
def test_a_qualification_passes_only_when_every_check_passed(tmp_path, outcomes, passed, capsys):
    module = _module()
    receipt = {"checks": {f"check{i}": {"outcome": o} for i, o in enumerate(outcomes)}, "device": "cuda:0"}
    code = module._finish(receipt, tmp_path / "r.json", 0.0)
    assert receipt["passed"] is passed
    assert code == (0 if passed else 1)
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is passed


@pytest.mark.parametrize("kind", ["sft", "grpo", "opd"])
def test_the_exact_run_checks_hold_on_the_cpu(kind, tmp_path):
    # the code the qualification runs on a GPU, run here on the CPU: fresh repeats and a cancel-then-resume in bf16
    figures = _module()._exact(kind, "cpu", tmp_path)
    assert figures["ok"] is True, figures
    assert figures["losses_identical"] is True
    assert len(set(figures["adapter_sha256"].values())) == 1
    assert figures["resumed_from"].startswith(f"{kind}-checkpoint-step-")
