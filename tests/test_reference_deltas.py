"""The bodies a client written against the reference's published contracts sends or expects: what Kiln fixed, and
the differences it keeps, pinned one by one (docs/contracts.md "Reference deltas" gives the reasons).

Each documented difference is measured, not asserted from memory: a test reads the reference contract and Kiln's real
bodies and requires the difference to be exactly the documented one, so a difference that grows, shrinks or vanishes
fails here until the documentation follows.
"""

from __future__ import annotations

import json
from pathlib import Path

import kiln_contracts
import pytest
from _upstream import needs_upstream, upstream_definition, upstream_validator

from kiln import contracts
from kiln.artifacts.evals import canonical_data_scope

KILN = kiln_contracts.load_bundle()["$defs"]


# ----------------------------------------------------------------------------- post_eval


def test_post_eval_accepts_the_reference_spelling_of_data_scope_and_records_kiln_s():
    for spelling, canonical in (
        ("held-out", "held_out"),
        ("train-set-eval", "train_set_eval"),
        ("held_out", "held_out"),
        ("train_set_eval", "train_set_eval"),
    ):
        assert contracts.problems("PostEval", {"suite": "capitals", "data_scope": spelling}) == []
        assert canonical_data_scope(spelling) == canonical
    assert KILN["GateVerdict"]["properties"]["data_scope"]["enum"] == ["held_out", "train_set_eval"]
    refused = contracts.problems("PostEval", {"suite": "capitals", "data_scope": "train-set-eval", "min_accuracy": 0.5})
    assert [p.code for p in refused] == ["inconsistent_fields"]


@needs_upstream
def test_every_reference_data_scope_spelling_is_accepted_by_kiln():
    reference = upstream_definition("PostEvalDataScope")["enum"]
    assert set(reference) <= set(KILN["PostEval"]["properties"]["data_scope"]["enum"])


@needs_upstream
def test_post_eval_verdict_stays_kiln_s_evidence_object_where_the_reference_has_a_string():
    """Documented difference: Kiln's verdict is the gate's whole evidence (GateVerdict); the reference's is a string
    beside a differently shaped evidence list, so a Kiln job detail with a gate does not validate there."""
    assert upstream_definition("TrainingJobDetail")["properties"]["post_eval_verdict"] == {"$ref": "#/$defs/String"}
    assert KILN["TrainingJobDetail"]["properties"]["post_eval_verdict"]["$ref"].endswith("/GateVerdict")
    assert "gate_outcome" in KILN["TrainingJobDetail"]["properties"]  # the outcome both spell the same way


# ----------------------------------------------------------------------------- adapters restore


@needs_upstream
def test_restore_receipt_verified_hashes_are_keyed_by_the_manifest_fields_they_equal():
    keys = set(KILN["AdapterRestoreVerifiedHashes"]["properties"])
    assert keys == {"safetensors_hash", "config_hash", "receipt_hash"}
    assert keys <= set(upstream_definition("AdapterManifest")["properties"])


# ----------------------------------------------------------------------------- openenv_training_data


@needs_upstream
def test_openenv_training_data_is_in_no_published_manifest_contract_so_kiln_refuses_it():
    """Documented difference: the reference's published AdapterManifest is closed and has no openenv_training_data,
    so there is no field list to validate it by; Kiln's closed manifest refuses it like the reference's schema."""
    reference = upstream_definition("AdapterManifest")
    assert reference["additionalProperties"] is False
    assert "openenv_training_data" not in reference["properties"]
    assert "openenv_training_data" not in KILN["AdapterManifest"]["properties"]
    validator, _ = upstream_validator("AdapterManifest")
    example = _kiln_example("AdapterManifest")
    assert not list(validator.iter_errors(example))
    with_field = {**example, "openenv_training_data": {"schema": "kiln.openenv-training-data.v1"}}
    assert [e.validator for e in validator.iter_errors(with_field)] == ["additionalProperties"]
    assert [p.code for p in contracts.problems("AdapterManifest", with_field)] == ["unknown_field"]


def _kiln_example(defname):
    """Kiln's first example of ``defname`` (the conformance example cases, rendered from the schemas)."""
    cases = json.loads((Path(__file__).resolve().parent.parent / "conformance" / "cases" / "examples.json").read_text())
    return next(c["instance"] for c in cases if c["type"] == defname)


# ----------------------------------------------------------------------------- /health and /v1/config

# What the reference's HealthResponse requires and Kiln's /health does not have: facts of the reference's GPU
# serving engine (paged-KV scheduler, prefix and prompt caches, prefill/decode runtimes, backend runtime, serving
# profile, thinking defaults, per-request metrics). Kiln has no such engine; it would have to invent the values.
HEALTH_MISSING = {
    "$": {
        "backend", "backend_runtime", "serving_profile", "http", "model_defaults_profile", "eval_mode",
        "debug_model_state", "default_thinking_enabled", "default_thinking_budget_tokens",
        "default_thinking_budget_ms", "fold_reasoning_into_content", "loaded_adapter", "loaded_adapter_revision",
        "adapters_loaded", "request_count", "requests", "recent_requests", "scheduler", "gpu_memory",
        "prefix_cache", "prompt_caches", "decode_runtime", "prefill_runtime",
    },
    "$.training": {"checkpoint_boundary_policy"},
}  # fmt: skip
# Kiln-only facts the reference's closed HealthResponse refuses.
HEALTH_EXTRA = {"$": {"auth_required", "memory", "model_source", "serving"}, "$.training": {"queue_capacity"}}
# Kiln's readiness checks the reference's closed enum does not name (both have six; two are shared).
HEALTH_CHECK_NAMES = {"base_weights_identified", "job_store_writable", "training_worker_alive", "registry_writable"}
# The reference's ConfigResponse describes its serving engine's configuration (accelerator runtime, ROCm/CUDA graphs,
# batching, KV cache, speculative decoding...); Kiln's is its kiln.toml resolution.
CONFIG_MISSING = {
    "$": {
        "effective_configuration", "serving_profile", "accelerator_runtime", "rocm_graphs",
        "rocm_graphs_unavailable_reason", "rocm_graph_telemetry", "rocm_graph_telemetry_unavailable_reason",
        "cuda_graphs", "decode_runtime", "batching", "prefix_cache", "streaming_prefill", "speculative",
        "model_startup", "paths", "vram", "kv_cache", "training", "memory_budget", "generation", "operational",
    }
}  # fmt: skip
CONFIG_EXTRA = {"$": {"config_file", "effective_config", "effective_server_config_sha256", "fields", "resolved_paths"}}


def _differences(defname, body):
    """(missing required fields, unexpected fields, values outside an enum), each by JSON path."""
    validator, _ = upstream_validator(defname)
    missing, extra, enums, other = {}, {}, set(), []
    for error in validator.iter_errors(body):
        if error.validator == "required":
            missing.setdefault(error.json_path, set()).update(
                k for k in error.validator_value if k not in error.instance
            )
        elif error.validator == "additionalProperties":
            extra.setdefault(error.json_path, set()).update(set(error.instance) - set(error.schema["properties"]))
        elif error.validator == "enum":
            enums.add(error.instance)
        else:
            other.append(f"{error.json_path}: {error.message}")
    return missing, extra, enums, other


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """Kiln's real /health and /v1/config bodies, from an in-process server on the tiny model."""
    from fastapi.testclient import TestClient

    from kiln.host.config import resolve_settings
    from kiln.server._app import build_server, create_app

    home = tmp_path_factory.mktemp("reference-deltas") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(home))
        settings = resolve_settings({"paths.home": str(home), "model.path": str(tiny_model_dir)})
        settings.registry.mkdir(parents=True)
        with TestClient(create_app(build_server(settings))) as client:
            yield {"HealthResponse": client.get("/health").json(), "ConfigResponse": client.get("/v1/config").json()}


@needs_upstream
def test_health_differs_from_the_reference_exactly_as_documented(served):
    body = served["HealthResponse"]
    assert contracts.problems("HealthResponse", body) == []
    missing, extra, enums, other = _differences("HealthResponse", body)
    assert (missing, extra, enums, other) == (HEALTH_MISSING, HEALTH_EXTRA, HEALTH_CHECK_NAMES, [])
    assert len(body["checks"]) == 6  # as many readiness checks as the reference, four of them Kiln's own


@needs_upstream
def test_config_differs_from_the_reference_exactly_as_documented(served):
    body = served["ConfigResponse"]
    assert contracts.problems("ConfigResponse", body) == []
    assert _differences("ConfigResponse", body) == (CONFIG_MISSING, CONFIG_EXTRA, set(), [])
