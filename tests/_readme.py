"""The README's marked blocks, as the tests that run them read them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def block(marker: str, language: str = "bash") -> str:
    """The first ``language`` fenced block after ``<!-- marker``."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.split(f"<!-- {marker}", 1)[1].split(f"```{language}\n", 1)[1].split("```", 1)[0]


def commands(marker: str) -> list[str]:
    """The shell commands of a bash block: continuation lines joined, comments and trailing comments dropped."""
    found, pending = [], ""
    for line in block(marker).splitlines():
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command = re.sub(r"\s+#[^'\"]*$", "", pending + line).strip()  # trailing comments are prose
        pending = ""
        if command and not command.startswith("#"):
            found.append(command)
    return found


def run_bash(command: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``command`` as a user would type it: bash, from the repository root."""
    return subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
