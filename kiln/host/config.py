"""Kiln's configuration, resolved once: ``kiln.toml``, the environment and command-line flags.

Precedence, highest first: command-line flags, ``KILN_<SECTION>_<FIELD>`` environment variables (then the field's
aliases, e.g. ``KILN_HOME``), ``kiln.toml``, the ``KilnConfig`` schema's defaults. ``resolve_settings`` is the
one resolver the server and the CLI share; everything else reads its ``Settings``:

1. the file: ``kiln.toml`` in the home the environment names (``KILN_PATHS_HOME``, ``KILN_HOME``, else
   ``~/.kiln``), or the ``--config`` given, parsed and checked against ``KilnConfig`` (unknown keys fail);
2. each field, from the schema's list: a flag, else its environment variable converted to the field's JSON type
   (integers in decimal, a list of paths separated like ``PATH``; a variable set but empty is refused), else the
   file's value, else the schema's default, else unset; its origin is kept for ``GET /v1/config``;
3. the result checked against ``KilnConfig`` as a whole: every problem of every value reported together, as one
   ``config_invalid`` naming the variable (or flag) that gave it and never repeating a secret;
4. the typed view: ``settings.server.port`` (``int``), ``settings.training.checkpoint_interval`` (``int | None``),
   sections built from the generated models and frozen, a field with a schema default never ``None``.

The paths beneath the home (the adapter registry, the built-in models, the job store, uploads, data roots) are
derived here too, so the CLI and the server find the same ones.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypedDict

import kiln_contracts
from kiln_contracts.models.kiln_config_v1_schema import (
    KilnModelConfig,
    KilnPathsConfig,
    KilnServerConfig,
    KilnTrainingConfig,
    Worker,
)
from kiln_contracts.models.kiln_observability_v1_schema import ConfigValueSource
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from kiln import contracts
from kiln.documents.digests import json_sha256
from kiln.errors import InternalError, Problem, RequestError
from kiln.host.fs import within_roots

__all__ = [
    "REDACTED",
    "FieldOrigin",
    "ModelSettings",
    "PathsSettings",
    "ServerSettings",
    "Settings",
    "TrainingSettings",
    "configured_registry",
    "load_config",
    "resolve_settings",
]

REDACTED = "<redacted-present>"
_JOB_STORE = "jobs.sqlite3"
_CONFIG_FILE = "kiln.toml"
_DECIMAL = re.compile(r"-?[0-9]+")

JsonValue = str | int | list[str]  # what a configuration value is in kiln.toml's JSON shape


# ----------------------------------------------------------------------------- the typed view


class ServerSettings(KilnServerConfig, frozen=True):
    """``[server]`` as resolved (the fields with a schema default are always set)."""

    host: str
    port: int
    max_request_bytes: int
    max_upload_bytes: int


class ModelSettings(KilnModelConfig, frozen=True):
    """``[model]`` as resolved."""


class TrainingSettings(KilnTrainingConfig, frozen=True):
    """``[training]`` as resolved (the fields with a schema default are always set)."""

    max_queued_jobs: int
    nproc_per_node: int
    worker: Worker
    data_roots: tuple[str, ...] | None = None  # type: ignore[assignment]  # frozen: a tuple where the file has a list


class PathsSettings(KilnPathsConfig, frozen=True):
    """``[paths]`` as resolved."""

    home: str


_SECTIONS: dict[str, type[BaseModel]] = {
    "server": ServerSettings,
    "model": ModelSettings,
    "training": TrainingSettings,
    "paths": PathsSettings,
}


class FieldOrigin(TypedDict):
    """Where one value came from (``ConfigFieldOrigin`` of ``GET /v1/config``)."""

    source: ConfigValueSource
    environment_variable: str
    redacted: bool


@dataclass(frozen=True)
class Settings:
    """The configuration in force: typed sections, each value's origin, the file read (None when none was)."""

    server: ServerSettings
    model: ModelSettings
    training: TrainingSettings
    paths: PathsSettings
    origins: Mapping[str, FieldOrigin]  # "section.field" -> origin, for every value that is set
    config_file: Path | None

    def get(self, section: str, field: str) -> JsonValue | None:
        """One value by name in its JSON form (None when unset)."""
        value: JsonValue | None = to_jsonable_python(getattr(getattr(self, section), field))
        return value

    @property
    def home(self) -> Path:
        return Path(self.paths.home).expanduser()

    @property
    def registry(self) -> Path:
        """The adapter registry: ``model.adapter_dir``, else ``<home>/adapters``."""
        return Path(self.model.adapter_dir).expanduser() if self.model.adapter_dir else self.home / "adapters"

    @property
    def models_dir(self) -> Path:
        """Where the built-in tiny model is materialised."""
        return self.home / "models"

    @property
    def data_roots(self) -> tuple[Path, ...]:
        """The directories a training request's ``dataset_path`` may lie in: ``training.data_roots``, else
        ``<home>/data`` (where ``POST /v1/datasets`` stores uploads, which are therefore always readable)."""
        configured = self.training.data_roots
        roots = [Path(r).expanduser() for r in configured] if configured is not None else []
        uploads = self.home / "data"
        return tuple(roots) if within_roots(str(uploads), roots) else (*roots, uploads)

    @property
    def uploads(self) -> Path:
        """Where ``POST /v1/datasets`` stores uploaded files, by digest."""
        return self.home / "data" / "uploads"

    @property
    def job_store(self) -> Path:
        return self.home / "server" / _JOB_STORE

    def redacted(self) -> dict[str, dict[str, JsonValue | None]]:
        """The effective configuration in ``kiln.toml`` shape, secrets replaced by a marker."""
        out: dict[str, dict[str, JsonValue | None]] = {section: {} for section in _SECTIONS}
        for key, origin in self.origins.items():
            section, field = key.split(".")
            out[section][field] = REDACTED if origin["redacted"] else self.get(section, field)
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
                "model_dir": str(self.models_dir),
                "job_store": str(self.job_store),
                "data_roots": [str(r) for r in self.data_roots],
                "uploads": str(self.uploads),
            },
        }


# ----------------------------------------------------------------------------- the fields, from the schema


@dataclass(frozen=True)
class _Field:
    section: str
    name: str
    schema: Mapping[str, Any]  # the field's JSON Schema

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def pointer(self) -> str:
        return f"/{self.section}/{self.name}"

    @property
    def variables(self) -> tuple[str, ...]:
        """Its environment variable, then the aliases (the first that is set wins)."""
        return (self.schema["x-kiln-env"], *self.schema.get("x-kiln-env-aliases", ()))

    @property
    def secret(self) -> bool:
        return bool(self.schema.get("x-kiln-secret"))

    def from_environment(self) -> tuple[str, str] | None:
        """(variable, raw value) of the first of its variables that is set."""
        return next(((name, os.environ[name]) for name in self.variables if name in os.environ), None)


@cache
def _fields() -> dict[str, _Field]:
    defs = kiln_contracts.load_bundle()["$defs"]
    fields: dict[str, _Field] = {}
    for section in _SECTIONS:
        definition = defs["KilnConfig"]["properties"][section]["$ref"].rsplit("/", 1)[-1]
        for name, schema in defs[definition]["properties"].items():
            fields[f"{section}.{name}"] = _Field(section, name, schema)
    return fields


def _converted(field: _Field, variable: str, raw: str) -> JsonValue | Problem:
    """An environment value as the field's JSON type, or why it cannot be one."""
    if raw == "":
        return Problem("invalid_length", field.pointer, f"{variable} is set but empty; give it a value or unset it")
    kind = field.schema.get("type")
    if kind == "array":  # a list of paths, separated like PATH
        return [part for part in raw.split(os.pathsep) if part]
    if kind == "integer":
        if _DECIMAL.fullmatch(raw) is None:
            return Problem("wrong_type", field.pointer, f"{variable}={raw!r} is not a decimal integer")
        return int(raw)
    return raw


# ----------------------------------------------------------------------------- kiln.toml


def _config_file(path: str | os.PathLike[str] | None) -> Path:
    """``path`` (``--config``), else ``kiln.toml`` in the home the environment names, else in the default home
    (the file cannot move itself)."""
    if path:
        return Path(path)
    field = _fields()["paths.home"]
    named = field.from_environment()
    home = named[1] if named is not None and named[1] else field.schema["default"]
    return Path(home).expanduser() / _CONFIG_FILE


def load_config(path: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The parsed, validated ``kiln.toml`` (an empty dict when there is none at the default place)."""
    file = _config_file(path)
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


# ----------------------------------------------------------------------------- resolution


def _named(problem: Problem, givers: Mapping[str, str]) -> Problem:
    """A schema problem of a value, its message naming who gave the value (a secret's value never shown)."""
    field = _fields()[".".join(problem.pointer.split("/")[1:3])]
    giver = givers.get(field.key, field.key)
    if field.secret:
        return Problem(problem.code, problem.pointer, f"{giver}: not a valid {field.key} (the secret is not shown)")
    return Problem(problem.code, problem.pointer, f"{giver}: {problem.message}")


def _refusal(problems: list[Problem]) -> RequestError:
    ordered = sorted(problems, key=lambda p: p.pointer)
    return RequestError(
        "invalid configuration: " + "; ".join(p.message for p in ordered),
        code="config_invalid",
        pointer=ordered[0].pointer,
        hint="fix or unset the environment variable (KILN_<SECTION>_<FIELD>) or the flag named",
    )


def resolve_settings(
    flags: Mapping[str, JsonValue | None] | None = None, *, config_path: str | os.PathLike[str] | None = None
) -> Settings:
    """Resolve every field; ``flags`` maps ``"section.field"`` to a command-line value (None = not given)."""
    given = {key: value for key, value in (flags or {}).items() if value is not None}
    unknown = sorted(set(given) - set(_fields()))
    if unknown:
        raise InternalError(f"no configuration field {unknown[0]!r}: flags are keyed 'section.field'")
    from_file = load_config(config_path)
    values: dict[str, dict[str, JsonValue]] = {section: {} for section in _SECTIONS}
    origins: dict[str, FieldOrigin] = {}
    problems: list[Problem] = []
    givers: dict[str, str] = {}  # "section.field" -> the flag or variable that gave its value
    for key, field in _fields().items():
        environment = field.from_environment()
        if key in given:
            value, source = given[key], ConfigValueSource.command_line
            givers[key] = f"flag {key}"
        elif environment is not None:
            found = _converted(field, *environment)
            if isinstance(found, Problem):
                problems.append(found)
                continue
            value, source = found, ConfigValueSource.environment
            givers[key] = environment[0] if field.secret else f"{environment[0]}={environment[1]!r}"
        elif field.name in from_file.get(field.section, {}):
            value, source = from_file[field.section][field.name], ConfigValueSource.config_file
        elif "default" in field.schema:
            value, source = field.schema["default"], ConfigValueSource.default
        else:
            continue
        values[field.section][field.name] = value
        origins[key] = {"source": source, "environment_variable": field.variables[0], "redacted": field.secret}
    problems += [_named(problem, givers) for problem in contracts.problems("KilnConfig", values)]
    if problems:
        raise _refusal(problems)
    used = _config_file(config_path).resolve() if from_file or config_path else None
    return Settings(
        server=ServerSettings.model_validate(values["server"]),
        model=ModelSettings.model_validate(values["model"]),
        training=TrainingSettings.model_validate(values["training"]),
        paths=PathsSettings.model_validate(values["paths"]),
        origins=origins,
        config_file=used,
    )


def configured_registry(override: str | os.PathLike[str] | None = None) -> Path:
    """The adapter registry: ``override`` (``--adapter-dir``), else ``model.adapter_dir`` as resolved (environment,
    ``kiln.toml``), else ``<home>/adapters``."""
    return resolve_settings({"model.adapter_dir": os.fspath(override) if override else None}).registry
