"""Mistakes answered before torch loads, in the words the person typed: a missing file, a malformed row of a JSONL
file, a .json file holding JSON lines and a bad --adapter name are refused by ``kiln train sft --local`` without
importing torch (checked in a fresh interpreter, not timed), naming the flag, the file and the row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
PROBE = textwrap.dedent(
    """
    import json, sys
    from kiln.cli import main
    code = main(sys.argv[1:])
    print(json.dumps({"code": code, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
    """
)


def _run(tmp_path, argv):
    env_home = tmp_path / "home"
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "KILN_HOME": str(env_home)},
    )
    outcome = json.loads(done.stdout.strip().splitlines()[-1])
    return outcome, done.stderr


@pytest.mark.parametrize("case", ["missing-file", "bad-row", "json-lines-in-json", "bad-adapter-name"])
def test_a_mistake_is_refused_without_importing_torch(case, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(GOOD) + "\n" + '{"messages": [\n', encoding="utf-8")
    adapter = "bot"
    if case == "missing-file":
        data = tmp_path / "sft_corection.jsonl"
    elif case == "json-lines-in-json":
        data = tmp_path / "rows.json"
        data.write_text((json.dumps(GOOD) + "\n") * 2, encoding="utf-8")
    elif case == "bad-adapter-name":
        data.write_text(json.dumps(GOOD) + "\n", encoding="utf-8")
        adapter = "team/bot"
    outcome, err = _run(tmp_path, ["train", "sft", "--local", "-f", str(data), "--adapter", adapter])
    assert outcome == {"code": 2, "torch": False, "transformers": False}, err
    expected = {
        "missing-file": f"{data} is not a file",
        "bad-row": "row 2 (sha256:",
        "json-lines-in-json": "rename it to .jsonl",
        "bad-adapter-name": "--adapter 'team/bot'",
    }[case]
    assert expected in err
    if case == "bad-row":
        assert f"fix row 2 of {data}" in err
        assert "pass --invalid-row-policy skip" in err  # the flag, not the config member
        assert "invalid_row_policy" not in err


def test_refusals_speak_in_flags():
    from kiln.cli._requests import in_cli_terms

    assert in_cli_terms('/config/output_name: "team/bot" is bad') == '--adapter: "team/bot" is bad'
    assert in_cli_terms('or set invalid_row_policy to "skip" to go on') == "or pass --invalid-row-policy skip to go on"
    assert in_cli_terms("max_seq_len: 9 exceeds the context") == "--max-seq-len: 9 exceeds the context"
    assert in_cli_terms("kl_coeff: refused") == "kl_coeff: refused"  # no flag: the request's own words
