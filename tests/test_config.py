"""kiln.toml: strict, and consulted after flags and the environment."""

from __future__ import annotations

import pytest

from kiln.config import config_value, load_config
from kiln.errors import RequestError


def _write(tmp_path, text):
    home = tmp_path / "kiln-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "kiln.toml").write_text(text, encoding="utf-8")


def test_no_config_file_means_defaults():
    assert load_config() == {}


def test_a_valid_file_is_read_and_the_environment_wins(tmp_path, monkeypatch):
    _write(tmp_path, '[model]\npath = "/models/a"\nadapter_dir = "/adapters"\n')
    config = load_config()
    assert config_value(config, "model", "path") == "/models/a"
    monkeypatch.setenv("KILN_MODEL_PATH", "/models/b")
    assert config_value(config, "model", "path") == "/models/b"
    assert config_value(config, "model", "adapter_dir") == "/adapters"


def test_unknown_keys_are_refused_with_a_pointer(tmp_path):
    _write(tmp_path, "[model]\npaht = '/typo'\n")
    with pytest.raises(RequestError) as info:
        load_config()
    assert info.value.code == "config_invalid"
    assert info.value.pointer == "/model/paht"


def test_broken_toml_is_refused(tmp_path):
    _write(tmp_path, "[model\n")
    with pytest.raises(RequestError) as info:
        load_config()
    assert "not valid TOML" in info.value.message


def test_the_cli_trains_with_the_model_named_in_kiln_toml(tmp_path, tiny_model_dir, capsys):
    import json

    from kiln.cli import main

    _write(tmp_path, f'[model]\npath = "{tiny_model_dir}"\nadapter_dir = "{tmp_path / "reg"}"\n')
    data = tmp_path / "d.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})
        + "\n",
        encoding="utf-8",
    )
    assert main(["train", "sft", "--local", "-f", str(data), "--adapter", "cfg", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["adapter_dir"] == str(tmp_path / "reg" / "cfg")
    receipt = json.loads((tmp_path / "reg" / "cfg" / "train_receipt.json").read_text())
    assert receipt["model"]["path"] == str(tiny_model_dir.resolve())
