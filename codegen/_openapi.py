"""Build the OpenAPI 3.1 document of the HTTP routes from the same definitions."""

from __future__ import annotations

import re
from typing import Any

ERROR_STATUSES = {
    "400": "Invalid request: the body or a parameter breaks the contract.",
    "401": "Missing or wrong bearer API key.",
    "404": "Unknown job, adapter or teacher.",
    "409": "Conflict with the current state.",
    "413": "Request body or memory estimate over its budget.",
    "500": "Internal error.",
    "503": "Queue full; retry after the Retry-After interval.",
}


def _components_ref(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            key: ("#/components/schemas/" + value[len("#/$defs/") :])
            if key == "$ref" and isinstance(value, str)
            else _components_ref(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_components_ref(value) for value in node]
    return node


def _body_name(spec: str) -> str:
    """A route body is ``Def`` or ``file.schema.json#Def``."""
    return spec.rpartition("#")[2]


def build_openapi(definitions: dict[str, Any], routes: list[dict[str, Any]], version: str) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for route in routes:
        method = route["method"].lower()
        operation: dict[str, Any] = {"operationId": route["operation_id"], "summary": route.get("summary", "")}
        params = re.findall(r"\{([^}]+)\}", route["path"])
        if params:
            operation["parameters"] = [
                {"name": p, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
                for p in params
            ]
        if route.get("request_media_type"):  # a raw body (an upload), not a JSON document
            operation["requestBody"] = {
                "required": True,
                "content": {
                    route["request_media_type"]: {
                        "schema": {"type": "string", "format": "binary", "minLength": 1}  # an empty upload is refused
                    }
                },
            }
        if route.get("request"):
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/" + _body_name(route["request"])}}
                },
            }
        responses: dict[str, Any] = {}
        for status, body in sorted(route.get("responses", {}).items()):
            entry: dict[str, Any] = {"description": "Success." if status.startswith("2") else "See the error envelope."}
            if body:
                entry["content"] = {
                    "application/json": {"schema": {"$ref": "#/components/schemas/" + _body_name(body)}}
                }
            elif status.startswith("2") and route.get("media_type"):
                # a text route (/metrics, /ui): the body is a document of that media type, not JSON
                entry["content"] = {route["media_type"]: {"schema": {"type": "string"}}}
            if status.startswith("2") and route.get("stream_response"):
                # server-sent events: each `data:` line carries one JSON object of this definition
                # (the schema describes one event, as OpenAPI 3.2's itemSchema does; `data: [DONE]` ends the stream)
                chunk = {"$ref": "#/components/schemas/" + _body_name(route["stream_response"])}
                entry["content"]["text/event-stream"] = {
                    "schema": {
                        "anyOf": [
                            {"type": "object", "required": ["data"], "properties": {"data": {"const": "[DONE]"}}},
                            {
                                "type": "object",
                                "required": ["data"],
                                "properties": {
                                    "event": {"type": "string"},
                                    "data": {
                                        "type": "string",
                                        "contentMediaType": "application/json",
                                        "contentSchema": chunk,
                                    },
                                },
                            },
                        ]
                    }
                }
            responses[status] = entry
        for status, text in ERROR_STATUSES.items():
            responses.setdefault(
                status,
                {
                    "description": text,
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorEnvelope"}}},
                },
            )
        operation["responses"] = responses
        if method in paths.get(route["path"], {}):
            raise ValueError(f"route {route['method']} {route['path']} is declared twice")
        paths.setdefault(route["path"], {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Kiln training control plane",
            "version": version,
            "description": "HTTP API of the Kiln training server. Every body is defined by the JSON Schemas in schemas/.",
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "security": [{"bearer": []}, {}],
        "paths": dict(sorted(paths.items())),
        "components": {
            "schemas": _components_ref(definitions),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
