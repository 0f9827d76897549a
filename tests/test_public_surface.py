"""The public surface is pinned: a change here is a change to users' code."""

from __future__ import annotations

import kiln
import kiln.artifacts
import kiln.cli
import kiln.contracts
import kiln.documents.digests
import kiln.errors


def test_public_modules_export_exactly_their_declared_names():
    assert kiln.__all__ == ["__version__"]
    assert sorted(kiln.contracts.__all__) == [
        "ValidationReport", "canonical", "detect_type", "document_types", "load", "problems", "render", "validate_path",
        "write",
    ]  # fmt: skip
    assert sorted(kiln.errors.__all__) == [
        "AccessError", "AdapterError", "AdapterLoadError", "AuthError", "BaseAdapterMissingError", "CancelledError",
        "CapacityError", "CheckpointError", "ConflictError", "ContractError", "DataSchemaError", "DocumentReadError",
        "IntegrityError", "InternalError", "KilnError", "NonFiniteLossError", "NotFoundError", "OutOfMemoryError",
        "Problem", "RegistryError", "RequestError", "ScorerError", "ShapeMismatchError", "StorageFailureError",
        "TrainingDataError", "TrainingFailedError", "UnknownDocumentTypeError", "UnsafeLoraScaleError", "UnsupportedLossConfigError",
            "UpstreamError",
        "ZeroActionTokensError", "ZeroEnvTokensError", "ZeroGroupsError", "all_failure_reasons", "storage_condition",
    ]  # fmt: skip
    assert kiln.cli.__all__ == ["build_parser", "main"]  # the console script is kiln.cli:main
    assert sorted(kiln.documents.digests.__all__) == [
        "BASE_MODEL_CONTENT_ALGORITHM", "KERNEL_CONTRACT_TYPE", "REPLAY_HASH_ALGORITHM", "base_model_content_aggregate",
        "canonical_json",
        "checkpoint_manifest_identity", "effective_config_hash", "execution_provenance_digest", "file_sha256",
        "json_sha256", "kernel_contract_digest", "prefixed", "raw_hex", "replay_hash", "sft_kept_corpus_digest",
        "sft_parsed_row_hash", "sft_raw_row_hash", "stream_sha256", "teacher_identity_revision",
    ]  # fmt: skip


def test_the_data_package_exports_its_ingestion_entry_points_and_shared_components():
    import kiln.data
    import kiln.data.chat
    import kiln.data.jsonl
    import kiln.data.trajectory

    assert sorted(kiln.data.__all__) == [
        "BEHAVIOR_POLICIES", "GRPO_SOURCES", "GrpoCompletion", "GrpoCounts", "GrpoGroup", "GrpoIngestion",
        "GrpoSourcePosition", "IGNORE_INDEX", "OFF_POLICY_SOURCE", "OffPolicyFile", "OffPolicyRow", "OnlineLog",
        "OpdPromptItem",
        "OpdPrompts", "PROMPTS_SOURCE", "REJECTION_REASONS", "ROLES", "SEGMENT_KINDS", "SFT_INGESTION_SCHEMA",
        "SftExample", "SftIngestion", "check_unchanged", "dataset_sha256", "ingest_sft", "iter_dataset_groups",
        "match_skeleton", "online_ingestion", "precheck_dataset_file", "precheck_sft_rows", "read_groups",
        "read_off_policy_file", "read_prompts", "refused_ingestion", "rollout_log_lines", "spelled", "template_errors",
        "tokenize_response",
    ]  # fmt: skip
    assert sorted(kiln.data.chat.__all__) == [
        "ChatTemplate", "InvalidRowError", "ROLES", "json_type", "match_skeleton", "normalise_message",
        "template_errors",
    ]  # fmt: skip
    assert sorted(kiln.data.jsonl.__all__) == [
        "check_unchanged", "dataset_file", "dataset_sha256", "file_lines", "is_blank", "json_words", "precheck_lines",
    ]  # fmt: skip
    assert sorted(kiln.data.trajectory.__all__) == [
        "ACTION", "CONTEXT", "ItemError", "OBSERVATION", "PROMPT", "Segment", "TrajectoryTokenizer", "WARNING",
        "check_item", "describe_problems", "inline_value", "normalised_messages", "parse_line", "segments",
    ]  # fmt: skip
    for module in (kiln.data, kiln.data.chat, kiln.data.jsonl, kiln.data.trajectory):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"
    assert kiln.data.check_unchanged is kiln.data.jsonl.check_unchanged  # one home for the pinned-file check


def test_the_rollouts_package_exports_its_scorers_and_generator():
    import kiln.rollouts

    assert sorted(kiln.rollouts.__all__) == [
        "BUILTIN_SCORERS", "BehaviourPolicy", "BuiltinScorer", "EntryPointScorer", "ExecutableScorer", "HttpScorer",
        "PROVENANCE_SCHEMA", "RequestTemplate", "RolloutGroup", "SUMMARY_TYPE", "ScoreRequest", "Scored", "Scorer",
        "Task", "Timings", "read_request_template", "read_tasks", "sample_groups", "scorer_of", "summary_of",
        "tasks_of",
    ]  # fmt: skip
    for name in kiln.rollouts.__all__:
        assert hasattr(kiln.rollouts, name), name


def test_every_exported_name_exists():
    for module in (kiln, kiln.contracts, kiln.errors, kiln.documents.digests, kiln.artifacts, kiln.cli):
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
