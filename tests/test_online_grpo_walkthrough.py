"""The README's online GRPO walkthrough, as written: the built-in tiny model learns to answer in valid JSON with
the built-in scorer, its reward rising from the first steps to the last, and every ratio exactly 1."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from kiln.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _walkthrough() -> list[str]:
    """The `kiln train grpo` command of the README's online GRPO section."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("### GRPO that samples its own rollouts") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None
    command = block[1].replace("\\\n", " ").splitlines()[0]
    assert command.startswith("kiln train grpo --local -f examples/online_json_request.json")
    return shlex.split(command)[1:]


@pytest.mark.slow
def test_the_readme_walkthrough_trains_the_tiny_model_to_answer_in_json(tmp_path, monkeypatch, tiny_model_dir, capsys):
    monkeypatch.chdir(ROOT)
    argv = [*_walkthrough(), "--model", str(tiny_model_dir), "--adapter-dir", str(tmp_path / "adapters")]
    assert main(argv) == 0
    assert "mean reward" in capsys.readouterr().out
    receipt = json.loads((tmp_path / "adapters" / "json-bot" / "train_receipt.json").read_text())
    online = receipt["grpo"]["online"]
    rewards = [step["reward_mean"] for step in online["steps"]]
    tenth = len(rewards) // 10
    first, last = sum(rewards[:tenth]) / tenth, sum(rewards[-tenth:]) / tenth
    assert last >= first + 0.4, rewards  # the curve rises: about 0.1 to about 0.8
    assert online["max_behavior_logprob_gap"] == 0.0
