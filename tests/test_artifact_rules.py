"""Semantic rules of the artifact schema (receipt, adapter manifest, adapter bodies, teachers)
beyond what the conformance cases (conformance/cases/semantic-artifacts.json) show: the
loader/writer helpers, reader leniency, helper functions and edge cases of the rules."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kiln import contracts
from kiln.artifacts import adapter_bodies, adapter_manifest, receipt, teachers
from kiln.documents.digests import prefixed
from kiln.documents.rules import registered_ids
from kiln.errors import ContractError, IntegrityError

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "schemas" / "kiln-artifacts-v1.schema.json").read_text(encoding="utf-8"))
CASES = json.loads((ROOT / "conformance" / "cases" / "semantic-artifacts.json").read_text(encoding="utf-8"))
# Every artifact rule's invalid case, wherever its case file groups it (the request lineage has a file of its own).
ALL_SEMANTIC_CASES = [
    case
    for path in sorted((ROOT / "conformance" / "cases").glob("semantic-*.json"))
    for case in json.loads(path.read_text(encoding="utf-8"))
]
SFT, GRPO, OPD = 0, 1, 2


def example(name: str, index: int = 0) -> dict:
    return copy.deepcopy(SCHEMA["x-kiln-examples"][name][index])


def found(exc: pytest.ExceptionInfo[ContractError]) -> set[tuple[str, str]]:
    return {(p.code, p.pointer) for p in exc.value.problems}


# --- coverage ------------------------------------------------------------------------------


def test_every_document_constraint_of_the_artifact_schema_has_a_rule_or_is_embedded_and_has_a_case():
    registered = registered_ids()
    cased = {case["rule"] for case in ALL_SEMANTIC_CASES if not case["valid"]}
    for definition, body in SCHEMA["$defs"].items():
        for constraint in body.get("x-kiln-semantic-constraints", ()):
            if constraint["scope"] != "document":
                assert (definition, constraint["id"]) not in registered, constraint["id"]
                continue
            if not constraint["id"].endswith(".embedded-records"):
                assert (definition, constraint["id"]) in registered, constraint["id"]
            assert constraint["id"] in cased, f"no invalid conformance case for {constraint['id']}"


# --- train receipt: loader and writer ------------------------------------------------------


def test_train_receipt_reader_ignores_unknown_members_but_the_writer_refuses_them(tmp_path):
    doc = example("TrainReceipt", SFT)
    doc["x_future_member"] = {"added": "in v1.1"}
    doc["hyperparameters"]["x_future_knob"] = 3
    model = receipt.load_train_receipt(doc)
    assert model.adapter_name == "support-bot"
    with pytest.raises(ContractError) as info:
        receipt.write_train_receipt(tmp_path / "train_receipt.json", doc)
    assert ("unknown_field", "/x_future_member") in found(info)
    assert not (tmp_path / "train_receipt.json").exists()


def test_train_receipt_writer_output_is_canonical_and_loads_back(tmp_path):
    doc = example("TrainReceipt", OPD)
    path = receipt.write_train_receipt(tmp_path / "train_receipt.json", receipt.load_train_receipt(doc))
    assert json.loads(path.read_bytes()) == doc
    assert receipt.load_train_receipt(path).opd.teacher_identity_revision == doc["opd"]["teacher_identity_revision"]


def test_train_receipt_writer_runs_the_semantic_rules(tmp_path):
    doc = example("TrainReceipt", GRPO)
    doc["failure_reason"] = None
    with pytest.raises(ContractError) as info:
        receipt.write_train_receipt(tmp_path / "train_receipt.json", doc)
    assert ("inconsistent_fields", "/failure_reason") in found(info)
    assert not (tmp_path / "train_receipt.json").exists()


def test_train_receipt_missing_writer_required_members_load_but_do_not_write(tmp_path):
    doc = example("TrainReceipt", GRPO)
    for key in ("phase_timings", "config_hashes", "lora_grad_norms"):
        del doc[key]
    del doc["grpo"]["kl_reference_policy"]
    receipt.load_train_receipt(doc)
    with pytest.raises(ContractError) as info:
        receipt.write_train_receipt(tmp_path / "r.json", doc)
    assert ("missing_field", "/config_hashes") in found(info)


def test_receipt_reports_every_broken_binding_not_only_the_first():
    doc = example("TrainReceipt", SFT)
    doc["data"]["examples_read"] = 9
    doc["data"]["examples_filtered"] = 9
    doc["token_counts"]["env_tokens"] = 9
    with pytest.raises(ContractError) as info:
        receipt.load_train_receipt(doc)
    assert {
        ("inconsistent_fields", "/data/examples_read"),
        ("inconsistent_fields", "/data/examples_filtered"),
        ("inconsistent_fields", "/token_counts/env_tokens"),
    } <= found(info)


def test_receipt_digest_mismatch_fails_fast_as_an_integrity_error():
    doc = example("TrainReceipt", OPD)
    doc["opd"]["teacher_identity_revision"] = "0" * 64
    doc["data"]["examples_read"] = 1  # a non-integrity problem does not hide the integrity failure
    with pytest.raises(IntegrityError) as info:
        receipt.load_train_receipt(doc)
    assert found(info) == {("digest_mismatch", "/opd/teacher_identity_revision")}


def test_receipt_success_with_sft_ingestion_but_mode_grpo_is_rejected_at_the_mode():
    doc = example("TrainReceipt", SFT)
    doc["hyperparameters"]["mode"] = "grpo"
    problems = contracts.problems("TrainReceipt", doc)
    assert ("inconsistent_fields", "/hyperparameters/mode") in {(p.code, p.pointer) for p in problems}


def test_legacy_reference_policy_name_is_accepted_on_read_and_refused_on_write():
    doc = example("TrainReceipt", GRPO)
    doc["grpo"]["reference_policy"] = doc["grpo"].pop("kl_reference_policy")
    receipt.load_train_receipt(doc)
    with pytest.raises(ContractError) as info:
        contracts.render("TrainReceipt", doc)
    assert ("unknown_field", "/grpo/reference_policy") in found(info)


@pytest.mark.parametrize(
    "text",
    [
        "2026-07-14T12:03:41Z",
        "2026-07-14T12:03:41.512+02:00",
        "2026-07-14t12:03:41z",
        "2026-06-30T23:59:60Z",
        "2024-02-29T00:00:00-00:00",
        "2026-07-14T12:03:41.123456789123Z",
    ],
)
def test_rfc3339_check_accepts_date_times_with_an_offset(text):
    assert receipt.rfc3339_problem(text) is None


@pytest.mark.parametrize(
    "text",
    [
        "2026-07-14T12:03:41",
        "2026-07-14 12:03:41Z",
        "2026-02-30T00:00:00Z",
        "2026-07-14T24:00:00Z",
        "2026-07-14T12:60:00Z",
        "2026-07-14T12:00:00+24:00",
        "2026-07-14T12:00:00+0200",
        "2026-07-14",
        "２026-07-14T12:03:41Z",
    ],
)
def test_rfc3339_check_rejects_anything_else(text):
    assert receipt.rfc3339_problem(text)


def test_alpha_over_rank_tolerance_is_relative_one_in_a_million():
    assert receipt.alpha_over_rank_matches(16.0, 3, 5.3333335)  # f32(16/3)
    assert receipt.alpha_over_rank_matches(16.0, 8, 2.0 * (1 + 9e-7))
    assert not receipt.alpha_over_rank_matches(16.0, 8, 2.0 * (1 + 2e-6))
    assert receipt.alpha_over_rank_matches(0, 8, 0.0)


def test_alpha_over_rank_check_survives_numbers_too_large_for_a_float():
    assert not receipt.alpha_over_rank_matches(10**400, 1, 1.0)
    assert not receipt.alpha_over_rank_matches(1.0, 10**400, 1.0)


# --- adapter manifest ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["", ".", "..", "a/b", "a\\b", "a..b", "adapter_manifest.json", ".hidden-config.json", "nul\x00", "w" * 256]
)
def test_unsafe_manifest_file_names_are_named(name):
    assert adapter_manifest.unsafe_file_name(name)


@pytest.mark.parametrize("name", ["adapter_model.safetensors", "weights.v2.safetensors", "w" * 255])
def test_plain_manifest_file_names_pass(name):
    assert adapter_manifest.unsafe_file_name(name) is None


def test_adapter_manifest_round_trips_through_the_writer(tmp_path):
    doc = example("AdapterManifest")
    path = adapter_manifest.write_adapter_manifest(tmp_path / adapter_manifest.MANIFEST_FILE, doc)
    assert json.loads(path.read_bytes()) == doc
    assert adapter_manifest.load_adapter_manifest(path).adapter_name == "support-bot"


def test_manifest_rules_apply_to_a_manifest_nested_in_the_adapter_listing():
    doc = example("AdaptersResponse")
    for key in ("available", "available_adapters"):
        doc[key][1]["adapter_manifest"]["files"]["adapter_config"] = "adapter_model.safetensors"
    with pytest.raises(ContractError) as info:
        contracts.load("AdaptersResponse", doc)
    assert ("inconsistent_fields", "/available/1/adapter_manifest/files/adapter_config") in found(info)


# --- adapter bodies ------------------------------------------------------------------------


def test_canary_status_round_trips_through_the_writer(tmp_path):
    doc = example("AdapterCanaryStatus", 1)
    path = adapter_bodies.write_adapter_canary_status(tmp_path / "adapter_canary_status.json", doc)
    assert adapter_bodies.load_adapter_canary_status(path).status == "quarantined"


def test_restore_and_verify_receipts_render_canonical_bytes_that_load_back():
    for render, load, name in (
        (
            adapter_bodies.render_adapter_restore_receipt,
            adapter_bodies.load_adapter_restore_receipt,
            "AdapterRestoreReceipt",
        ),
        (
            adapter_bodies.render_adapter_verify_receipt,
            adapter_bodies.load_adapter_verify_receipt,
            "AdapterVerifyReceipt",
        ),
    ):
        doc = example(name)
        data = render(doc)
        assert json.loads(data) == doc
        load(data)


def _verify_with(checks: list[tuple[str, bool]], *, summary: bool = False) -> dict:
    doc = example("AdapterVerifyReceipt", 1)
    doc["checks"] = [{"name": n, "pass": p, "message": "..."} for n, p in checks]
    doc["status"] = "ok" if all(p for _, p in checks) else "failed"
    doc["tensor_summary"] = None
    if summary:
        doc["tensor_summary"] = example("AdapterVerifyReceipt")["tensor_summary"]
        doc["lora"]["tensor_count"] = doc["tensor_summary"]["tensor_count"]
    return doc


def test_verify_receipt_stopping_at_a_failing_first_check_is_accepted():
    contracts.load("AdapterVerifyReceipt", _verify_with([("directory_exists", False)]))


def test_verify_receipt_with_server_checks_but_no_manifest_check_is_accepted():
    offline = [(name, True) for name in adapter_bodies.OFFLINE_CHECKS]
    doc = _verify_with([*offline, ("server_load", True), ("server_listed", False)], summary=True)
    contracts.load("AdapterVerifyReceipt", doc)


def test_verify_receipt_that_stops_early_without_a_failure_is_rejected():
    doc = _verify_with([("directory_exists", True), ("layout", True)])
    with pytest.raises(ContractError) as info:
        contracts.load("AdapterVerifyReceipt", doc)
    assert ("inconsistent_fields", "/checks/1/name") in found(info)


def test_verify_receipt_with_a_check_listed_twice_is_rejected():
    doc = _verify_with([("directory_exists", True), ("directory_exists", False)])
    with pytest.raises(ContractError) as info:
        contracts.load("AdapterVerifyReceipt", doc)
    assert ("inconsistent_fields", "/checks/1/name") in found(info)


def test_verify_receipt_not_starting_with_directory_exists_is_rejected():
    doc = _verify_with([("layout", False)])
    with pytest.raises(ContractError) as info:
        contracts.load("AdapterVerifyReceipt", doc)
    assert ("inconsistent_fields", "/checks/0/name") in found(info)


def test_verify_receipt_whose_failed_measurable_check_contradicts_the_tensor_summary_is_rejected():
    offline = [(name, True) for name in adapter_bodies.OFFLINE_CHECKS[:-1]]
    doc = _verify_with([*offline, ("measurable", False)], summary=True)
    with pytest.raises(ContractError) as info:
        contracts.load("AdapterVerifyReceipt", doc)
    assert ("inconsistent_fields", "/checks/8/pass") in found(info)


def test_disk_entry_rank_zero_skips_the_scale_check():
    doc = example("AdapterDiskEntry", 1)
    doc["rank"], doc["alpha_over_rank"] = 0, 7.0
    contracts.load("AdapterDiskEntry", doc)


# --- teachers ------------------------------------------------------------------------------


def test_teacher_identity_revision_is_raw_in_receipts_and_prefixed_in_the_registry():
    identity = example("TeacherIdentityV1")
    revision = teachers.teacher_identity_revision_of(identity)
    assert revision == example("TrainReceipt", OPD)["opd"]["teacher_identity_revision"]
    assert prefixed(revision) == example("TeacherEntry")["identity_revision"]
    assert teachers.teacher_identity_revision_of(teachers.load_teacher_identity(identity)) == revision


def test_teacher_identity_revision_helper_refuses_an_invalid_identity():
    identity = example("TeacherIdentityV1")
    identity["vocab_size"] = 0
    with pytest.raises(ContractError) as info:
        teachers.teacher_identity_revision_of(identity)
    assert ("out_of_range", "/vocab_size") in found(info)


def test_teacher_entry_with_a_raw_identity_revision_is_refused_by_the_schema():
    doc = example("TeacherEntry")
    doc["identity_revision"] = doc["identity_revision"].removeprefix("sha256:")
    with pytest.raises(ContractError) as info:
        teachers.load_teacher_entry(doc)
    assert ("pattern_mismatch", "/identity_revision") in found(info)


def test_teacher_entry_with_capabilities_null_checks_only_the_spec_against_the_identity():
    doc = example("TeacherEntry")
    doc["capabilities"] = None
    teachers.load_teacher_entry(doc)
    doc["spec"]["vocab_size"] = None
    with pytest.raises(ContractError) as info:
        teachers.load_teacher_entry(doc)
    assert found(info) == {("inconsistent_fields", "/spec/vocab_size")}


def test_register_teacher_request_rules_report_every_misplaced_member():
    doc = {"alias": "t", "kind": "fixture", "provider": "vllm", "url": "http://x", "credential_id": "c", "adapter": "a"}
    with pytest.raises(ContractError) as info:
        teachers.load_register_teacher_request(doc)
    assert {p for _, p in found(info)} == {"/model_id", "/provider", "/url", "/credential_id", "/adapter"}


def test_rules_reading_members_that_may_hold_any_json_report_problems_instead_of_raising(tmp_path):
    """A reader-open auxiliary state may hold any JSON where a rule looks a value up in a table: a list there was a
    TypeError (unhashable) out of the strict loader, not a refusal. So was a replay record whose type is a list."""
    import copy

    from kiln.artifacts.replay_log import load_replay_log
    from kiln.errors import ContractError

    manifest = json.loads((ROOT / "examples" / "checkpoint_manifest.json").read_text(encoding="utf-8"))
    for kind, member in (("opd", "prompt_source"), ("grpo", "route")):
        doc = copy.deepcopy(manifest)
        doc["training_kind"] = kind
        doc["auxiliary_state"][member] = ["not", "a", "name"]
        assert contracts.problems("TrainingCheckpointManifest", doc)  # problems, never an exception
    log = tmp_path / "replay.jsonl"
    log.write_text(json.dumps({"record_type": ["request"]}) + "\n", encoding="utf-8")
    with pytest.raises(ContractError) as info:
        load_replay_log(log)
    assert info.value.code == "value_not_allowed"
