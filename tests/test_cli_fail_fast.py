"""Mistakes answered before torch loads, in the words the person typed: a missing file, a malformed line of a JSONL
file (SFT rows, GRPO groups, an OPD pre-scored file), a .json file holding JSON lines, a bad --adapter name, config
bounds, an existing adapter, a resume checkpoint's name, a Hub id given to --model -- each refused by ``kiln train
... --local`` without importing torch (checked in a fresh interpreter, not timed), naming the flag, the file and the
line."""

from __future__ import annotations

import json

import pytest
from _probe import cli_probe

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def _run(tmp_path, argv):
    outcome, _code, stderr = cli_probe(tmp_path, argv)
    assert outcome is not None, stderr
    return outcome, stderr


CASES = [
    "missing-file", "bad-row", "json-lines-in-json", "bad-adapter-name", "config-bounds", "adapter-exists",
    "bad-checkpoint-name", "missing-checkpoint", "hub-id-model", "grpo-bad-group", "opd-bad-manifest",
]  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_mistake_is_refused_without_importing_torch(case, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(GOOD) + "\n" + '{"messages": [\n', encoding="utf-8")
    kind, adapter, extra = "sft", "bot", []
    if case != "bad-row":
        data.write_text(json.dumps(GOOD) + "\n", encoding="utf-8")
    if case == "missing-file":
        data = tmp_path / "sft_corection.jsonl"
    elif case == "json-lines-in-json":
        data = tmp_path / "rows.json"
        data.write_text((json.dumps(GOOD) + "\n") * 2, encoding="utf-8")
    elif case == "bad-adapter-name":
        adapter = "team/bot"
    elif case == "config-bounds":
        extra = ["--lora-rank", "0", "--lr", "-1"]
    elif case == "adapter-exists":
        existing = tmp_path / "home" / "adapters" / "bot"
        existing.mkdir(parents=True)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (existing / name).write_bytes(b"{}")
    elif case == "bad-checkpoint-name":
        extra = ["--resume-checkpoint", "bot-step-3"]
    elif case == "missing-checkpoint":
        extra = ["--resume-checkpoint", "bot-checkpoint-step-00000003.kiln-checkpoint"]
    elif case == "hub-id-model":
        extra = ["--model", "Qwen/Qwen2.5-0.5B-Instruct"]
    elif case == "grpo-bad-group":
        kind = "grpo"
        data.write_text(json.dumps({"messages": GOOD["messages"][:1], "completions": []}) + "\n", encoding="utf-8")
    elif case == "opd-bad-manifest":
        kind, extra = "opd", ["--teacher", "tutor"]
        data.write_text(json.dumps({"manifest": 1}) + "\n", encoding="utf-8")
    argv = ["train", kind, "--local", "-f", str(data), "--adapter", adapter, *extra]
    outcome, err = _run(tmp_path, argv)
    assert outcome == {"code": 2, "torch": False, "transformers": False}, err
    expected = {
        "missing-file": [f"{data} is not a file"],
        "bad-row": [f"{data} line 2: not valid JSON (the line ends before its value does", f"fix line 2 of {data}",
                    "pass --invalid-row-policy skip"],
        "json-lines-in-json": ["rename it to .jsonl"],
        "bad-adapter-name": ["--adapter 'team/bot'"],
        "config-bounds": ["--lora-rank: 0 is less than the minimum of 1", "--lr: -1.0 is less than"],
        "adapter-exists": ["adapter 'bot' already exists", "`kiln adapters delete bot --local`"],
        "bad-checkpoint-name": ["'bot-step-3' is not a checkpoint name",
                                "e.g. bot-checkpoint-step-00000025.kiln-checkpoint"],
        "missing-checkpoint": ["bot-checkpoint-step-00000003.kiln-checkpoint does not exist"],
        "hub-id-model": ["reads like a Hugging Face Hub id", "download it first"],
        "grpo-bad-group": [f"{data} line 1: ", "completions", f"fix line 1 of {data}"],
        "opd-bad-manifest": [f"{data} line 1: the off-policy distillation manifest is invalid"],
    }[case]  # fmt: skip
    for text in expected:
        assert text in err, err
    assert "Traceback" not in err
    assert "invalid_row_policy" not in err  # the flags, not the request's members
    assert "/config/" not in err
    assert "support-bot" not in err  # hints name the adapter being trained


def test_refusals_speak_in_flags():
    from kiln.cli._requests import in_cli_terms

    assert in_cli_terms('/config/output_name: "team/bot" is bad') == '--adapter: "team/bot" is bad'
    assert in_cli_terms('or set invalid_row_policy to "skip" to go on') == "or pass --invalid-row-policy skip to go on"
    assert in_cli_terms("max_seq_len: 9 exceeds the context") == "--max-seq-len: 9 exceeds the context"
    assert in_cli_terms("kl_coeff: refused") == "kl_coeff: refused"  # no flag: the request's own words


@pytest.mark.parametrize(
    ("line", "words"),
    [
        (
            b'{"messages": [\n',
            "not valid JSON (the line ends before its value does: a bracket, brace or quote left open)",
        ),
        (b'{"a": 1,, }', "not valid JSON (expecting property name enclosed in double quotes at column 9)"),
        (b'{"a": 1, "a": 2}', "not valid JSON (duplicate key 'a')"),
        (b'{"a": NaN}', "NaN is not valid JSON (non-finite numbers are refused)"),
        (b"\xff{}", "not UTF-8 text (byte 1 of the line)"),
    ],
)
def test_a_json_mistake_is_said_in_words(line, words):
    from kiln.data.jsonl import json_words

    assert json_words(line) == words
