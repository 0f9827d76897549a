"""Where Kiln keeps its data: ``KILN_HOME`` and the paths beneath it.

Resolution, first match wins: ``KILN_PATHS_HOME``, ``KILN_HOME`` (alias), ``~/.kiln``.
The adapter registry is ``--adapter-dir``, else ``KILN_MODEL_ADAPTER_DIR``, else
``<home>/adapters``; built-in models live in ``<home>/models``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["adapter_registry", "kiln_home", "models_dir"]


def kiln_home() -> Path:
    for name in ("KILN_PATHS_HOME", "KILN_HOME"):
        value = os.environ.get(name)
        if value:
            return Path(value).expanduser()
    return Path.home() / ".kiln"


def models_dir() -> Path:
    return kiln_home() / "models"


def adapter_registry(override: str | os.PathLike[str] | None = None) -> Path:
    if override:
        return Path(override).expanduser()
    value = os.environ.get("KILN_MODEL_ADAPTER_DIR")
    if value:
        return Path(value).expanduser()
    return kiln_home() / "adapters"
