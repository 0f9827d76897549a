"""The OpenAPI document is built from the same schemas and covers the routes of spec/60."""

from __future__ import annotations

import kiln_contracts

ROUTES = {
    ("post", "/v1/train/sft"), ("post", "/v1/train/grpo"), ("post", "/v1/train/opd"),
    ("get", "/v1/train/status"), ("get", "/v1/train/jobs/{job_id}"), ("get", "/v1/train/queue"),
    ("delete", "/v1/train/queue/{job_id}"), ("delete", "/v1/train/jobs/{job_id}"),
    ("get", "/v1/adapters"), ("post", "/v1/adapters/load"), ("post", "/v1/adapters/unload"),
    ("delete", "/v1/adapters/{name}"), ("get", "/v1/adapters/{name}/receipt"),
    ("get", "/v1/teachers"), ("post", "/v1/teachers"), ("delete", "/v1/teachers/{alias}"),
    ("get", "/health"), ("get", "/v1/config"),
}  # fmt: skip


def _refs(node, out):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            out.add(node["$ref"])
        for value in node.values():
            _refs(value, out)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out)
    return out


def test_openapi_document_lists_every_route_of_the_control_plane():
    doc = kiln_contracts.openapi_document()
    assert doc["openapi"] == "3.1.0"
    found = {(method, path) for path, ops in doc["paths"].items() for method in ops}
    assert found >= ROUTES


def test_every_reference_in_the_openapi_document_resolves():
    doc = kiln_contracts.openapi_document()
    components = doc["components"]["schemas"]
    for ref in _refs(doc, set()):
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.rsplit("/", 1)[1] in components, ref


def test_openapi_components_are_the_strict_bundle():
    doc = kiln_contracts.openapi_document()
    assert set(doc["components"]["schemas"]) == set(kiln_contracts.load_bundle()["$defs"])


def test_errors_use_the_envelope():
    doc = kiln_contracts.openapi_document()
    op = doc["paths"]["/v1/train/sft"]["post"]
    assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorEnvelope")
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/SftRequest")
