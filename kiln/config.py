"""``kiln.toml``: the strict configuration file at ``$KILN_HOME/kiln.toml``.

Precedence, highest first: command-line flags, ``KILN_<SECTION>_<FIELD>`` environment
variables, ``kiln.toml``, built-in defaults. Unknown keys fail (the ``KilnConfig`` schema is
closed at every level).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln.errors import RequestError
from kiln.home import adapter_registry, kiln_home

__all__ = ["config_value", "configured_registry", "load_config"]


def load_config(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The parsed, validated ``kiln.toml`` (an empty dict when there is none)."""
    file = Path(path) if path else kiln_home() / "kiln.toml"
    if not file.is_file():
        if path:
            raise RequestError(f"config file {file} does not exist", code="config_invalid")
        return {}
    try:
        data = tomllib.loads(file.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"{file} is not valid TOML: {exc}", code="config_invalid") from None
    problems = contracts.problems("KilnConfig", data)
    if problems:
        detail = "; ".join(f"{p.pointer or '/'}: {p.message}" for p in problems)
        raise RequestError(f"{file}: {detail}", code="config_invalid", pointer=problems[0].pointer)
    return data


def config_value(config: dict[str, Any], section: str, key: str) -> Any:
    """The environment's ``KILN_<SECTION>_<FIELD>`` if set, else the file's value (or None)."""
    env = os.environ.get(f"KILN_{section.upper()}_{key.upper()}")
    if env:
        return env
    return config.get(section, {}).get(key)


def configured_registry(override: str | os.PathLike[str] | None = None, config: dict[str, Any] | None = None) -> Path:
    """The adapter registry: ``override`` (``--adapter-dir``), else ``KILN_MODEL_ADAPTER_DIR``,
    else ``model.adapter_dir`` of kiln.toml, else ``$KILN_HOME/adapters``."""
    settings = load_config() if config is None else config
    return adapter_registry(override or config_value(settings, "model", "adapter_dir"))
