"""The public surface is pinned: a change here is a change to users' code."""

from __future__ import annotations

import kiln
import kiln.artifacts
import kiln.contracts
import kiln.digests
import kiln.errors


def test_public_modules_export_exactly_their_declared_names():
    assert kiln.__all__ == ["__version__"]
    assert sorted(kiln.contracts.__all__) == [
        "ValidationReport", "detect_type", "document_types", "load", "problems", "render", "validate_path", "write",
    ]  # fmt: skip
    assert sorted(kiln.errors.__all__) == [
        "AdapterError", "AuthError", "CapacityError", "CheckpointError", "ConflictError", "ContractError",
        "DocumentReadError", "IntegrityError", "InternalError", "KilnError", "NotFoundError", "Problem",
        "RequestError", "UnknownDocumentTypeError",
    ]  # fmt: skip
    assert sorted(kiln.digests.__all__) == [
        "BASE_MODEL_CONTENT_ALGORITHM", "KERNEL_CONTRACT_TYPE", "base_model_content_aggregate", "canonical_json",
        "checkpoint_manifest_identity", "effective_config_hash", "execution_provenance_digest", "file_sha256",
        "json_sha256", "kernel_contract_digest", "prefixed", "raw_hex", "sft_kept_corpus_digest",
        "sft_parsed_row_hash", "sft_raw_row_hash", "stream_sha256", "teacher_identity_revision",
    ]  # fmt: skip


def test_every_exported_name_exists():
    for module in (kiln, kiln.contracts, kiln.errors, kiln.digests, kiln.artifacts):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_artifact_modules_offer_symmetric_load_and_write():
    """Every written artifact has its strict loader beside the writer (printed-only documents may lack a writer)."""
    for name in kiln.artifacts.__all__:
        module = getattr(kiln.artifacts, name)
        exported = set(getattr(module, "__all__", ()))
        for writer in (n for n in exported if n.startswith("write_")):
            assert "load_" + writer.removeprefix("write_") in exported, f"{name}.{writer} has no loader"


def test_the_server_exports_build_create_and_serve_without_importing_fastapi_eagerly():
    import importlib
    import subprocess
    import sys

    probe = "import sys, kiln.server; print('fastapi' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout == "False\n"
    server = importlib.import_module("kiln.server")
    assert sorted(server.__all__) == ["build_server", "create_app", "serve"]
    for name in server.__all__:
        assert callable(getattr(server, name))
