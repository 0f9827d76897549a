"""Shared fixtures. Tests never touch the user's KILN_HOME: every test gets its own."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated_kiln_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln-home"))
    monkeypatch.delenv("KILN_PATHS_HOME", raising=False)
    monkeypatch.delenv("KILN_MODEL_PATH", raising=False)
    monkeypatch.delenv("KILN_MODEL_ADAPTER_DIR", raising=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default tiny model (seed 0), written once per test session."""
    from kiln.model import create_tiny

    return create_tiny(tmp_path_factory.mktemp("models") / "kiln-tiny", seed=0)
