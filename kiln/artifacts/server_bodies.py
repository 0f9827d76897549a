"""Semantic rules of the server's own observability bodies (``/health``, ``/v1/config``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kiln.documents.digests import json_sha256
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

REDACTED = "<redacted-present>"
CONFIG_SECTIONS = ("server", "model", "training", "paths")
DEFAULTED_FIELDS = ("server.host", "server.port", "server.max_request_bytes", "training.max_queued_jobs", "paths.home")
SECRET_FIELDS = ("server.api_key",)

__all__: list[str] = []


@semantic_rule("HealthResponse", "health.status-matches-checks")
def _health_status(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    seen: set[str] = set()
    for i, check in enumerate(doc["checks"]):
        if check["name"] in seen:
            yield Problem(
                "inconsistent_fields", ptr(at, "checks", i, "name"), f"check {check['name']!r} is listed twice"
            )
        seen.add(check["name"])
    all_pass = all(check["pass"] for check in doc["checks"])
    if (doc["status"] == "ok") != all_pass:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "status"),
            f"status {doc['status']!r} disagrees with the checks ({'all pass' if all_pass else 'some fail'})",
        )


def _present_fields(config: dict[str, Any]) -> set[str]:
    return {f"{section}.{key}" for section, body in config.items() if isinstance(body, dict) for key in body}


@semantic_rule("ConfigResponse", "config-response.effective-complete")
def _config_complete(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    config = doc["effective_config"]
    for section in CONFIG_SECTIONS:
        if section not in config:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "effective_config", section),
                f"effective config lacks section [{section}]",
            )
    present = _present_fields(config)
    for name in DEFAULTED_FIELDS:
        if name not in present:
            section, key = name.split(".")
            yield Problem(
                "inconsistent_fields",
                ptr(at, "effective_config", section, key),
                f"{name} has a default and must appear in the effective config",
            )


@semantic_rule("ConfigResponse", "config-response.digest", integrity=True)
def _config_digest(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    expected = json_sha256(doc["effective_config"])
    if doc["effective_server_config_sha256"] != expected:
        yield Problem(
            "digest_mismatch",
            ptr(at, "effective_server_config_sha256"),
            f"effective_server_config_sha256 does not recompute: recorded {doc['effective_server_config_sha256']}, computed {expected}",
        )


@semantic_rule("ConfigResponse", "config-response.fields-cover-values")
def _config_fields(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    present = _present_fields(doc["effective_config"])
    listed = set(doc["fields"])
    for name in sorted(present - listed):
        yield Problem("inconsistent_fields", ptr(at, "fields"), f"no origin listed for {name}")
    for name in sorted(listed - present):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "fields", name),
            f"origin listed for {name}, which is not in the effective config",
        )


@semantic_rule("ConfigResponse", "config-response.redaction")
def _config_redaction(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    for name, origin in doc["fields"].items():
        if origin["redacted"] and name not in SECRET_FIELDS:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "fields", name, "redacted"),
                f"{name} is not a secret and is never redacted",
            )
    for name in SECRET_FIELDS:
        section, key = name.split(".")
        value = doc["effective_config"].get(section, {}).get(key)
        if value is not None and value != REDACTED:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "effective_config", section, key),
                f"{name} must be reported as {REDACTED!r}, never in clear",
            )
        origin = doc["fields"].get(name)
        if value is not None and origin is not None and not origin["redacted"]:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "fields", name, "redacted"),
                f"{name} is present and must be marked redacted",
            )
