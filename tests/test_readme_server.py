"""The README's server walk-through runs verbatim against a live ``kiln serve``.

The commands of the block after the ``server-walkthrough`` marker run one by one with
bash from the repository root; only ``localhost:8420`` is pointed at the test server's
port (and ``KILN_URL`` with it). ``kiln serve`` itself is the test's server.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _server import ServerProcess

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _walkthrough() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = text.split("<!-- server-walkthrough", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands, pending = [], ""
    for line in block.splitlines():
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command = re.sub(r"\s+#[^'\"]*$", "", pending + line).strip()  # trailing comments are prose
        pending = ""
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


def test_the_walkthrough_parses_into_commands():
    commands = _walkthrough()
    assert commands[0] == "kiln serve"
    assert any(c.startswith("curl -s localhost:8420/v1/train/sft") for c in commands)
    assert any("--wait" in c for c in commands)


def test_the_readme_server_walkthrough_runs_verbatim(tmp_path, tiny_model_dir):
    with ServerProcess(tmp_path / "home", tiny_model_dir) as proc:
        env = {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "KILN_URL": proc.url,
            "KILN_HOME": str(tmp_path / "client-home"),
        }
        for command in _walkthrough()[1:]:
            command = command.replace("localhost:8420", f"127.0.0.1:{proc.port}")
            run = subprocess.run(
                ["bash", "-c", command],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert run.returncode == 0, f"{command}\n{run.stdout}\n{run.stderr}"
            assert '"error"' not in run.stdout, f"{command}\n{run.stdout}"
            assert run.stdout.strip(), command
