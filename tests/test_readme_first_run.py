"""The README's "First run" block runs verbatim, as a new user would: a fresh ``HOME``, ``KILN_HOME`` unset.

Each command of the block after the ``first-run`` marker runs with bash from the repository root, with this
interpreter's environment first on ``PATH`` (what ``. scripts/activate`` does). The one command with
``--checkpoint-interval`` gets the Ctrl-C the README asks for once its first checkpoint is published; it must exit
130 and print a resume command, which then runs and must finish the run.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _readme import ROOT, commands, run_bash

pytestmark = pytest.mark.slow


def _setup_training() -> str:
    """What set-up command 1 runs after installing: ``scripts/bootstrap && . scripts/activate && <this>``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    prefix = "scripts/bootstrap && . scripts/activate && "
    (line,) = [line for line in text.splitlines() if line.startswith(prefix)]
    return line.removeprefix(prefix)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(HOME=str(home), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return env


def _interrupted(command: str, env: dict[str, str], home: Path) -> str:
    """Run ``command``, Ctrl-C it once its first checkpoint exists; the resume command it printed."""
    interval = int(re.search(r"--checkpoint-interval (\d+)", command)[1])
    adapter = re.search(r"--adapter (\S+)", command)[1]
    first = home / ".kiln" / "adapters" / f"{adapter}-checkpoint-step-{interval:08d}.kiln-checkpoint"
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 600
    while not first.is_dir():  # published by one rename: present means complete
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 600 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=600)
    err = err.decode(errors="replace")
    assert proc.returncode == 130, f"{command}\n{out.decode()}\n{err}"
    assert "✗ training cancelled: its receipt records status failed, failure_reason cancelled" in err
    resume = err.split("Resume with:\n", 1)[1].strip().splitlines()[0].strip()
    argv = shlex.split(resume)
    assert argv[:4] == ["kiln", "train", "sft", "--local"], resume
    assert argv[argv.index("--adapter") + 1] == adapter
    assert argv[-2] == "--resume-checkpoint"
    return resume


def test_the_first_run_block_parses_into_commands():
    found = commands("first-run")
    assert found[0].startswith("kiln train sft --local")
    assert sum("--checkpoint-interval" in c for c in found) == 1
    setup_adapter = re.search(r"--adapter (\S+)", _setup_training())[1]
    assert all(f"--adapter {setup_adapter} " not in f"{c} " for c in found)  # never collides with set-up 1


def test_the_readme_first_run_runs_verbatim_in_a_fresh_home(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = _env(home)
    resume = None
    for index, command in enumerate(commands("first-run")):
        if "--checkpoint-interval" in command:
            resume = _interrupted(command, env, home)
            continue
        run = run_bash(command, env)
        assert run.returncode == 0, f"{command}\n{run.stdout}\n{run.stderr}"
        assert run.stdout.strip(), command
        assert "Traceback" not in run.stderr, f"{command}\n{run.stderr}"
        waits = []  # every wait of more than a moment is announced on stderr before it starts
        if index == 0:  # the first command in a fresh home builds the tiny model
            waits += ["building the built-in tiny model", "training the tiny model's tokenizer", "drawing its weights"]
        if command.startswith(("kiln train", "kiln models create-tiny")):
            waits += ["importing torch"] if "create-tiny" in command else ["opening the model", "loading the weights"]
        if command.startswith("python -m codegen"):
            waits += ["codegen: generating the typed models"]
        for wait in waits:
            assert wait in run.stderr, f"{command}: no '{wait}…' line\n{run.stderr}"
    assert resume is not None
    run = run_bash(resume, env)
    assert run.returncode == 0, f"{resume}\n{run.stdout}\n{run.stderr}"
    assert "✓ trained" in run.stdout
    # set-up command 1's training after the First run (or before it): no collision either way
    setup = run_bash(_setup_training(), env)
    assert setup.returncode == 0, setup.stderr
