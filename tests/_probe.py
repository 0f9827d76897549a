"""``kiln`` run in a fresh interpreter with its own ``KILN_HOME``, reporting its exit code and whether torch and
transformers were imported: how the command-line tests prove a refusal comes before the heavy imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

PROBE = textwrap.dedent(
    """
    import json, sys
    from kiln.cli import main
    code = main(sys.argv[1:])
    print(json.dumps({"code": code, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
    """
)


def cli_probe(tmp_path: Path, argv: list[str]) -> tuple[dict[str, Any] | None, int, str]:
    """``(outcome, returncode, stderr)``: outcome is None when ``main`` never returned (argparse's usage exit)."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "KILN_HOME": str(tmp_path / "home")},
    )
    lines = done.stdout.strip().splitlines()
    return (json.loads(lines[-1]) if lines else None), done.returncode, done.stderr
