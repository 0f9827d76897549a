"""kiln.toml: strict, and consulted after flags and the environment."""

from __future__ import annotations

import pytest

from kiln.errors import RequestError
from kiln.host.config import load_config, resolve_settings


def _write(tmp_path, text):
    home = tmp_path / "kiln-home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "kiln.toml").write_text(text, encoding="utf-8")


def test_no_config_file_means_defaults():
    assert load_config() == {}


def test_a_valid_file_is_read_and_the_environment_wins(tmp_path, monkeypatch):
    _write(tmp_path, '[model]\npath = "/models/a"\nadapter_dir = "/adapters"\n')
    assert resolve_settings().model.path == "/models/a"
    monkeypatch.setenv("KILN_MODEL_PATH", "/models/b")
    assert resolve_settings().model.path == "/models/b"
    assert resolve_settings().model.adapter_dir == "/adapters"


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


# ----------------------------------------------------------------------------- one resolver for the CLI and the server


def _data(tmp_path):
    import json

    data = tmp_path / "d.jsonl"
    row = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    data.write_text(json.dumps(row) + "\n", encoding="utf-8")
    return data


def test_settings_are_typed_values_that_cannot_be_changed(monkeypatch):
    import dataclasses

    import pydantic

    from kiln.host.config import resolve_settings

    monkeypatch.setenv("KILN_TRAINING_CHECKPOINT_INTERVAL", "5")
    monkeypatch.setenv("KILN_TRAINING_DATA_ROOTS", "/data/a::~/b")
    settings = resolve_settings({"server.port": 9100})
    assert settings.training.checkpoint_interval == 5
    assert settings.server.port == 9100
    assert settings.server.api_key is None
    assert settings.training.worker == "process"
    assert settings.training.data_roots == ("/data/a", "~/b")
    with pytest.raises(pydantic.ValidationError):
        settings.server.port = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.server = settings.server


def test_every_default_is_the_schemas_and_a_field_with_one_is_never_unset():
    from types import NoneType
    from typing import get_args

    import kiln_contracts

    from kiln.host.config import resolve_settings

    settings = resolve_settings()
    bundle = kiln_contracts.load_bundle()["$defs"]
    sections = bundle["KilnConfig"]["properties"]
    for section, ref in sections.items():
        view = type(getattr(settings, section))
        for field, schema in bundle[ref["$ref"].rsplit("/", 1)[-1]]["properties"].items():
            declared_optional = NoneType in get_args(view.model_fields[field].annotation)
            assert declared_optional == ("default" not in schema), f"{section}.{field}"
            if "default" in schema and field != "home":  # the tests' KILN_HOME sets paths.home
                assert settings.get(section, field) == schema["default"], f"{section}.{field}"
                assert settings.origins[f"{section}.{field}"]["source"] == "default"


def test_a_bad_environment_value_is_refused_alike_by_the_cli_and_the_server(
    tmp_path, tiny_model_dir, capsys, monkeypatch
):
    from kiln.cli import main
    from kiln.host.config import resolve_settings

    monkeypatch.setenv("KILN_TRAINING_CHECKPOINT_INTERVAL", "0")
    with pytest.raises(RequestError) as info:
        resolve_settings()
    assert info.value.code == "config_invalid"
    assert info.value.pointer == "/training/checkpoint_interval"
    assert "KILN_TRAINING_CHECKPOINT_INTERVAL" in info.value.message
    argv = ["train", "sft", "--local", "-f", str(_data(tmp_path)), "--model", str(tiny_model_dir), "--adapter", "x"]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[0] == f"error [config_invalid]: {info.value.message}"


def test_a_bad_environment_value_stops_a_local_command_as_it_stops_the_server(capsys, monkeypatch):
    from kiln.cli import main

    monkeypatch.setenv("KILN_SERVER_PORT", "eighty")
    assert main(["adapters", "list", "--local"]) == 2
    err = capsys.readouterr().err
    assert "config_invalid" in err
    assert "KILN_SERVER_PORT" in err


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KILN_MODEL_ADAPTER_DIR", ""),
        ("KILN_HOME", ""),
        ("KILN_SERVER_PORT", ""),
        ("KILN_SERVER_PORT", "1_000"),
        ("KILN_SERVER_PORT", " 8080"),
        ("KILN_SERVER_PORT", "8080.0"),
        ("KILN_TRAINING_WORKER", "fork"),
        ("KILN_TRAINING_DATA_ROOTS", "relative/dir"),
    ],
)
def test_an_environment_value_is_converted_to_its_json_type_and_checked_against_the_schema(
    variable, value, monkeypatch
):
    from kiln.host.config import resolve_settings

    monkeypatch.setenv(variable, value)
    with pytest.raises(RequestError) as info:
        resolve_settings()
    assert info.value.code == "config_invalid"
    assert variable in info.value.message


def test_every_bad_environment_value_is_reported_at_once(monkeypatch):
    from kiln.host.config import resolve_settings

    monkeypatch.setenv("KILN_SERVER_PORT", "70000")
    monkeypatch.setenv("KILN_TRAINING_MAX_QUEUED_JOBS", "many")
    with pytest.raises(RequestError) as info:
        resolve_settings()
    assert "KILN_SERVER_PORT" in info.value.message
    assert "KILN_TRAINING_MAX_QUEUED_JOBS" in info.value.message


def test_a_refused_secret_is_never_repeated(monkeypatch):
    from kiln.host.config import resolve_settings

    monkeypatch.setenv("KILN_API_KEY", "two words")
    with pytest.raises(RequestError) as info:
        resolve_settings()
    assert "KILN_API_KEY" in info.value.message
    assert "two words" not in info.value.message + str(info.value.hint)


def test_the_cli_and_the_server_keep_adapters_under_the_home_kiln_toml_names(tmp_path, capsys, monkeypatch):
    import json

    from kiln.cli import main
    from kiln.host.config import resolve_settings

    monkeypatch.delenv("KILN_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))  # kiln.toml is read from ~/.kiln
    (tmp_path / "user" / ".kiln").mkdir(parents=True)
    (tmp_path / "user" / ".kiln" / "kiln.toml").write_text(f'[paths]\nhome = "{tmp_path / "data"}"\n', encoding="utf-8")
    assert resolve_settings().registry == tmp_path / "data" / "adapters"
    assert main(["adapters", "list", "--local", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["adapter_dir"] == str(tmp_path / "data" / "adapters")
