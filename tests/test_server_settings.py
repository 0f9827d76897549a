"""The server's configuration: precedence, origins, redaction and refusals."""

from __future__ import annotations

import pytest

from kiln import contracts
from kiln.errors import RequestError
from kiln.host.config import REDACTED, resolve_settings


def test_flags_beat_environment_beat_file_beat_defaults(tmp_path, monkeypatch):
    (tmp_path / "kiln-home").mkdir()
    (tmp_path / "kiln-home" / "kiln.toml").write_text(
        '[server]\nport = 9000\nhost = "127.0.0.2"\n[training]\nmax_queued_jobs = 5\n', encoding="utf-8"
    )
    monkeypatch.setenv("KILN_SERVER_HOST", "127.0.0.3")
    monkeypatch.setenv("KILN_TRAINING_MAX_QUEUED_JOBS", "7")
    settings = resolve_settings({"server.port": 9100})
    assert settings.get("server", "port") == 9100
    assert settings.origins["server.port"]["source"] == "command_line"
    assert settings.get("server", "host") == "127.0.0.3"
    assert settings.origins["server.host"]["source"] == "environment"
    assert settings.get("training", "max_queued_jobs") == 7
    assert settings.get("server", "max_request_bytes") == 8 * 1024 * 1024
    assert settings.origins["server.max_request_bytes"]["source"] == "default"
    body = settings.response()
    assert contracts.problems("ConfigResponse", body) == []
    assert body["config_file"].endswith("kiln.toml")


def test_the_api_key_alias_is_read_and_never_reported(monkeypatch):
    monkeypatch.setenv("KILN_API_KEY", "s3cret-key")
    settings = resolve_settings()
    assert settings.get("server", "api_key") == "s3cret-key"
    body = settings.response()
    assert body["effective_config"]["server"]["api_key"] == REDACTED
    assert body["fields"]["server.api_key"] == {
        "source": "environment",
        "environment_variable": "KILN_SERVER_API_KEY",
        "redacted": True,
    }
    assert "s3cret" not in str(body)


def test_an_unknown_key_or_a_bad_value_stops_the_server(tmp_path, monkeypatch):
    config = tmp_path / "kiln.toml"
    config.write_text("[server]\nthreads = 4\n", encoding="utf-8")
    with pytest.raises(RequestError) as info:
        resolve_settings(config_path=config)
    assert info.value.code == "config_invalid"
    monkeypatch.setenv("KILN_SERVER_PORT", "eighty")
    with pytest.raises(RequestError) as info:
        resolve_settings()
    assert "KILN_SERVER_PORT" in info.value.message
    monkeypatch.setenv("KILN_SERVER_PORT", "70000")
    with pytest.raises(RequestError):
        resolve_settings()


def test_paths_follow_the_home_and_the_adapter_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "h"))
    settings = resolve_settings({"model.adapter_dir": str(tmp_path / "reg")})
    assert settings.registry == tmp_path / "reg"
    assert settings.job_store == tmp_path / "h" / "server" / "jobs.sqlite3"
    assert settings.response()["resolved_paths"]["adapter_dir"] == str(tmp_path / "reg")
