"""Every ``kiln`` command shown in the README and ``docs/`` is one the CLI accepts as written.

The README's First run and server walkthrough also run for real (``test_readme_first_run.py``,
``test_readme_server.py``); this check covers every other command line in a fenced block: it must parse with the
real argument parser (a wrong flag, a removed subcommand or a ``[optional]`` synopsis fails). Placeholders such as
``JOB_ID`` are values and parse like any other.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from kiln.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
SHELL_BREAKS = {"|", "&&", "||", ";", ">", ">>", "2>&1"}


def _commands() -> list[tuple[str, str]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
            pending = ""
            for line in block.splitlines():
                if line.endswith("\\"):
                    pending += line[:-1] + " "
                    continue
                command, pending = (pending + line).strip().removeprefix("$ "), ""
                command = re.sub(r"\s+#[^'\"]*$", "", command)  # trailing comments are prose
                if command.startswith("kiln "):
                    found.append((path.relative_to(ROOT).as_posix(), command))
    return found


COMMANDS = _commands()


def test_the_docs_show_kiln_commands():
    assert len(COMMANDS) > 20
    assert {p for p, _ in COMMANDS} >= {"README.md", "docs/evals.md", "docs/teachers.md"}


@pytest.mark.parametrize(("path", "command"), COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_a_documented_command_parses_as_written(path, command):
    argv = shlex.split(command)[1:]
    for i, token in enumerate(argv):
        if token in SHELL_BREAKS:
            argv = argv[:i]
            break
    assert not any(t.startswith("[") for t in argv), f"{path}: a synopsis, not a command: {command}"
    err = io.StringIO()
    args, status = None, 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:  # --help exits 0; a parse error exits 2
            status = exc.code
    assert status == 0, f"{path}: {command}\n{err.getvalue()}"
    assert args is None or getattr(args, "func", None) is not None, f"{path}: {command} names no command"
