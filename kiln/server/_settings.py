"""The server's configuration: every ``kiln.toml`` field resolved once at startup.

Precedence, highest first: command-line flags, ``KILN_<SECTION>_<FIELD>`` (then the
field's aliases, e.g. ``KILN_API_KEY``), ``kiln.toml``, the schema's defaults. The field
list, environment names, defaults and secrets come from the ``KilnConfig`` schema, so a
new field needs no code here. ``GET /v1/config`` reports the result with each value's
origin and the secret redacted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kiln_contracts

from kiln import contracts
from kiln._fs import within_roots
from kiln.digests import json_sha256
from kiln.errors import RequestError
from kiln.home import kiln_home

SECTIONS = {
    "server": "KilnServerConfig",
    "model": "KilnModelConfig",
    "training": "KilnTrainingConfig",
    "paths": "KilnPathsConfig",
}
REDACTED = "<redacted-present>"
JOB_STORE_NAME = "jobs.sqlite3"


@dataclass(frozen=True)
class Settings:
    values: dict[str, dict[str, Any]]  # KilnConfig shape, secrets in clear (never serialised)
    origins: dict[str, dict[str, Any]]  # "section.field" -> ConfigFieldOrigin
    config_file: Path | None

    def get(self, section: str, field: str, default: Any = None) -> Any:
        return self.values.get(section, {}).get(field, default)

    @property
    def home(self) -> Path:
        return Path(self.get("paths", "home")).expanduser()

    @property
    def registry(self) -> Path:
        value = self.get("model", "adapter_dir")
        return Path(value).expanduser() if value else self.home / "adapters"

    @property
    def data_roots(self) -> tuple[Path, ...]:
        """The directories a training request's ``dataset_path`` may lie in: ``training.data_roots``, else
        ``<home>/data`` (where ``POST /v1/datasets`` stores uploads, which are therefore always readable)."""
        configured = self.get("training", "data_roots")
        roots = [Path(r).expanduser() for r in configured] if configured is not None else []
        uploads = self.home / "data"
        return tuple(roots) if within_roots(str(uploads), roots) else (*roots, uploads)

    @property
    def uploads(self) -> Path:
        """Where ``POST /v1/datasets`` stores uploaded files, by digest."""
        return self.home / "data" / "uploads"

    @property
    def job_store(self) -> Path:
        return self.home / "server" / JOB_STORE_NAME

    def redacted(self) -> dict[str, dict[str, Any]]:
        """The effective configuration as reported: secrets replaced by a marker."""
        out: dict[str, dict[str, Any]] = {}
        for section, body in self.values.items():
            out[section] = {
                key: REDACTED if self.origins[f"{section}.{key}"]["redacted"] else value for key, value in body.items()
            }
        return out

    @property
    def digest(self) -> str:
        return json_sha256(self.redacted())

    def response(self) -> dict[str, Any]:
        """``ConfigResponse`` of ``GET /v1/config``."""
        return {
            "config_file": str(self.config_file) if self.config_file else None,
            "effective_config": self.redacted(),
            "effective_server_config_sha256": self.digest,
            "fields": dict(sorted(self.origins.items())),
            "resolved_paths": {
                "home": str(self.home),
                "adapter_dir": str(self.registry),
                "model_dir": str(self.home / "models"),
                "job_store": str(self.job_store),
                "data_roots": [str(r) for r in self.data_roots],
                "uploads": str(self.uploads),
            },
        }


def _coerce(raw: str, schema: dict[str, Any], name: str) -> Any:
    if schema.get("type") == "array":  # a list of paths: separated like PATH
        return [part for part in raw.split(os.pathsep) if part]
    if schema.get("type") == "integer":
        try:
            return int(raw)
        except ValueError:
            raise RequestError(f"{name}={raw!r} is not an integer", code="config_invalid") from None
    return raw


def resolve_settings(
    flags: dict[str, Any] | None = None, *, config_path: str | os.PathLike[str] | None = None
) -> Settings:
    """Resolve every field; ``flags`` maps ``"section.field"`` to a command-line value (None = not given)."""
    from kiln.config import load_config

    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    file_path = Path(config_path) if config_path else kiln_home() / "kiln.toml"
    from_file = load_config(config_path) if config_path or file_path.is_file() else {}
    defs = kiln_contracts.load_bundle()["$defs"]
    values: dict[str, dict[str, Any]] = {}
    origins: dict[str, dict[str, Any]] = {}
    for section, definition in SECTIONS.items():
        values[section] = {}
        for field, schema in defs[definition]["properties"].items():
            key = f"{section}.{field}"
            env_names = [schema["x-kiln-env"], *schema.get("x-kiln-env-aliases", [])]
            env_hit = next((n for n in env_names if os.environ.get(n)), None)
            if key in flags:
                value, source = flags[key], "command_line"
            elif env_hit:
                value, source = _coerce(os.environ[env_hit], schema, env_hit), "environment"
            elif field in from_file.get(section, {}):
                value, source = from_file[section][field], "config_file"
            elif "default" in schema:
                value, source = schema["default"], "default"
            else:
                continue
            values[section][field] = value
            origins[key] = {
                "source": source,
                "environment_variable": schema["x-kiln-env"],
                "redacted": bool(schema.get("x-kiln-secret")),
            }
    found = contracts.problems("KilnConfig", values)
    if found:
        detail = "; ".join(f"{p.pointer or '/'}: {p.message}" for p in found)
        raise RequestError(f"invalid configuration: {detail}", code="config_invalid", pointer=found[0].pointer)
    return Settings(values, origins, file_path.resolve() if from_file or config_path else None)
