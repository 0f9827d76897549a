"""The README's server walk-through, and its SDK example, run verbatim against a live ``kiln serve``.

The commands of the block after the ``server-walkthrough`` marker run one by one with
bash from the repository root; only ``localhost:8420`` is pointed at the test server's
port (and ``KILN_URL`` with it). ``kiln serve`` itself is the test's server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _readme import ROOT, block, commands, run_bash
from _server import ServerProcess

pytestmark = pytest.mark.slow


def _walkthrough() -> list[str]:
    return commands("server-walkthrough")


def _sdk_snippet() -> str:
    return block("sdk-snippet", "python")


def test_the_walkthrough_parses_into_commands():
    commands = _walkthrough()
    assert commands[0] == "kiln serve"
    assert any(c.startswith("curl -s localhost:8420/v1/train/sft") for c in commands)
    assert any("--wait" in c for c in commands)


def test_the_readme_server_walkthrough_runs_verbatim(tmp_path, tiny_model_dir):
    with ServerProcess(tmp_path / "home", tiny_model_dir) as proc:
        started = "".join(proc.output)  # what a person sees while the server starts, step by step
        steps = ("Loading the base model", "opening the model", "loading the weights of", "hashing", "Ready on")
        at = [started.find(step) for step in steps]
        assert -1 not in at, started
        assert at == sorted(at), started
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "KILN_URL": proc.url,
            "KILN_HOME": str(tmp_path / "client-home"),
        }
        for command in _walkthrough()[1:]:
            command = command.replace("localhost:8420", f"127.0.0.1:{proc.port}")
            run = run_bash(command, env, timeout=300)
            assert run.returncode == 0, f"{command}\n{run.stdout}\n{run.stderr}"
            assert '"error"' not in run.stdout, f"{command}\n{run.stdout}"
            assert run.stdout.strip(), command
        snippet = _sdk_snippet().replace("http://127.0.0.1:8420", proc.url)
        run = subprocess.run(
            [sys.executable, "-c", snippet], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        assert run.returncode == 0, f"{snippet}\n{run.stdout}\n{run.stderr}"
        job_id, state = run.stdout.split()
        assert job_id.startswith("job-")
        assert state in ("queued", "running", "completed")
