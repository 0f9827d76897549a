"""Semantic rules of checkpoint manifests, their typed auxiliary views, loop states and
summaries, for what the conformance cases (conformance/cases/semantic-checkpoint.json) do
not show: fail-fast integrity inside the interpreted auxiliary state, paths the schema
would already refuse, exact float accounting, and the load/write helpers."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kiln import contracts
from kiln.artifacts import checkpoint_manifest as cm
from kiln.artifacts import loop_state as ls
from kiln.documents import rules
from kiln.errors import ContractError, IntegrityError

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "schemas" / "kiln-checkpoint-v1.schema.json").read_text(encoding="utf-8"))
MANIFEST = "TrainingCheckpointManifest"


def example(doc_type: str, index: int = 0):
    return copy.deepcopy(SCHEMA["x-kiln-examples"][doc_type][index])


def codes_and_pointers(doc_type, value):
    return {(p.code, p.pointer) for p in contracts.problems(doc_type, value)}


def test_every_document_constraint_of_the_checkpoint_schema_has_a_registered_rule():
    covered_by_embedded_records = {f"{kind}-aux.provenance-digest" for kind in ("sft", "grpo", "opd")}
    declared = {
        (name, c["id"])
        for name, definition in SCHEMA["$defs"].items()
        for c in definition.get("x-kiln-semantic-constraints", [])
        if c["scope"] == "document"
    }
    registered = rules.registered_ids()
    registered_ids = {rule_id for _, rule_id in registered}
    for name, rule_id in sorted(declared):
        if rule_id in covered_by_embedded_records:
            assert rule_id not in registered_ids
        else:
            assert (name, rule_id) in registered or (MANIFEST, rule_id) in registered, rule_id


def test_no_files_or_admission_constraint_is_registered_as_a_document_rule():
    others = {
        c["id"]
        for definition in SCHEMA["$defs"].values()
        for c in definition.get("x-kiln-semantic-constraints", [])
        if c["scope"] != "document"
    }
    assert not others & {rule_id for _, rule_id in rules.registered_ids()}


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("/etc/passwd", "not a relative"),
        ("a\\b", "not a relative"),
        ("a//b", "not a relative"),
        ("a/", "not a relative"),
        ("./a", "'.' component"),
        ("a/./b", "'.' component"),
        ("a/../b", "'..'"),
        ("a..b", "'..'"),
        ("checkpoint_manifest.json", "reserved"),
        (".incomplete", "reserved"),
        ("a" * 1025, "longer than 1024"),
        ("ünicode.bin", "not a relative"),
        (".hidden", "'.hidden' component"),
        ("a" * 256, "component"),
    ],
)
def test_unsafe_checkpoint_paths_are_named_with_the_reason(path, why):
    assert why in cm.relative_path_problem(path)


def test_portable_checkpoint_paths_pass():
    longest = "/".join(["a" * 204] * 5)  # 1024 bytes, every component a file name
    for path in ("adapter.safetensors", "rng/rollout-sampling.safetensors", "a" * 255, longest, "x/y/z-1_2.json"):
        assert cm.relative_path_problem(path) is None


def test_the_path_rule_reports_unsafe_paths_the_typed_model_would_let_through():
    # generated models drop the schema's `not`; the rule re-checks every path in code
    manifest = example(MANIFEST)
    manifest["files"]["a/../adapter.safetensors"] = manifest["files"].pop("adapter.safetensors")
    manifest["state_files"]["adapter_parameters"] = "a/../adapter.safetensors"
    manifest["rng_states"]["lora-init"]["state_file"] = "checkpoint_manifest.json"
    found = {(p.code, p.pointer) for p in cm._file_paths(manifest, "")}
    assert found == {
        ("unsafe_path", "/files/a~1..~1adapter.safetensors"),
        ("unsafe_path", "/state_files/adapter_parameters"),
        ("unsafe_path", "/rng_states/lora-init/state_file"),
    }


def test_a_stale_digest_inside_the_auxiliary_state_fails_the_load_at_once():
    manifest = example(MANIFEST)
    manifest["auxiliary_state"]["execution_provenance"]["backend"]["device"] = "cpu (tampered)"
    manifest["auxiliary_state"]["backend_runtime"]["device"] = "cpu (tampered)"
    with pytest.raises(IntegrityError) as info:
        contracts.load(MANIFEST, manifest)
    assert [(p.code, p.pointer) for p in info.value.problems] == [
        ("digest_mismatch", "/auxiliary_state/execution_provenance/provenance_sha256")
    ]


def test_problems_lists_an_auxiliary_digest_mismatch_without_raising():
    manifest = example(MANIFEST, 1)
    manifest["auxiliary_state"]["base_weight_shard_manifest"]["aggregate_sha256"] = "sha256:" + "0" * 64
    manifest["auxiliary_state"]["base_model_weights_sha256"] = "sha256:" + "0" * 64
    assert codes_and_pointers(MANIFEST, manifest) == {
        ("digest_mismatch", "/auxiliary_state/base_weight_shard_manifest/aggregate_sha256")
    }


def test_a_missing_auxiliary_member_is_reported_once_by_the_typed_view():
    manifest = example(MANIFEST, 2)
    del manifest["auxiliary_state"]["training_precision_policy"]
    del manifest["auxiliary_state"]["candidates_consumed"]
    problems = contracts.problems(MANIFEST, manifest)
    assert {(p.code, p.pointer) for p in problems} == {
        ("inconsistent_fields", "/auxiliary_state/training_precision_policy"),
        ("inconsistent_fields", "/auxiliary_state/candidates_consumed"),
    }
    assert all("OpdCheckpointAuxiliaryState (missing_field)" in p.message for p in problems)


def test_schema_problems_of_interpreted_sub_objects_carry_semantic_codes():
    # the manifest is schema-valid; what its auxiliary_state or effective_config lacks is an inconsistency
    manifest = example(MANIFEST, 1)
    manifest["auxiliary_state"]["route"] = "stream"
    manifest["effective_config"]["kl_coeff"] = -1
    problems = contracts.problems(MANIFEST, manifest)
    assert {(p.code, p.pointer) for p in problems} == {
        ("inconsistent_fields", "/auxiliary_state/route"),
        ("inconsistent_fields", "/effective_config/kl_coeff"),
    }
    messages = sorted(p.message for p in problems)
    assert "does not fit GrpoCheckpointAuxiliaryState (value_not_allowed)" in messages[0]
    assert "does not fit GrpoConfig (out_of_range)" in messages[1]


def test_auxiliary_states_load_on_their_own_as_typed_models():
    for kind, doc_type in cm.AUXILIARY_STATE_TYPES.items():
        manifest = example(MANIFEST, ("sft", "grpo", "opd").index(kind))
        model = contracts.load(doc_type, manifest["auxiliary_state"])
        assert type(model).__name__ == doc_type


def test_a_huge_item_count_is_never_expanded_into_a_permutation():
    manifest = example(MANIFEST, 2)
    manifest["data"]["item_count"] = 2**62
    found = codes_and_pointers(MANIFEST, manifest)
    assert ("inconsistent_fields", "/progress/data_order") in found


def test_sft_accounting_needs_the_resolved_number_of_epochs():
    manifest = example(MANIFEST)
    del manifest["effective_config"]["epochs"]
    assert codes_and_pointers(MANIFEST, manifest) == {("inconsistent_fields", "/effective_config/epochs")}


def test_optimizer_settings_keep_booleans_and_numbers_apart():
    assert cm._same_setting(True, True)
    assert not cm._same_setting(True, 1)
    assert not cm._same_setting(0, False)
    assert cm._same_setting(0.0, 0)


def test_a_manifest_is_written_canonically_and_loads_back(tmp_path):
    manifest = example(MANIFEST, 2)
    path = cm.write_checkpoint_manifest(tmp_path / "checkpoint_manifest.json", manifest)
    model = cm.load_checkpoint_manifest(path)
    assert model.checkpoint_id == "opd-step-00000005"
    assert json.loads(path.read_bytes()) == manifest


def test_an_inconsistent_manifest_is_never_written(tmp_path):
    manifest = example(MANIFEST)
    manifest["optimizer"]["step"] = 24
    with pytest.raises(ContractError) as info:
        cm.write_checkpoint_manifest(tmp_path / "checkpoint_manifest.json", manifest)
    assert (info.value.code, info.value.pointer) == ("inconsistent_fields", "/optimizer/step")
    assert not (tmp_path / "checkpoint_manifest.json").exists()


def _sft_state(losses, *, epoch, cursor, first=None, best=None, current_sum=None):
    state = {
        "schema_version": 1,
        "state_type": "kiln.sft-loop-state.v1",
        "global_step": len(losses),
        "epoch_index": epoch,
        "cursor_in_epoch": cursor,
        "loss_history": losses,
        "last_loss": losses[-1] if losses else None,
        "current_epoch_loss_sum": ls.float_sum(losses[len(losses) - cursor :]) if current_sum is None else current_sum,
        "current_epoch_items": cursor,
        "lora_grad_norms": [],
    }
    if first is not None:
        state["first_epoch_loss"] = first
    if best is not None:
        state["best_epoch_loss"] = best
    return state


def test_the_epoch_loss_sum_is_the_left_to_right_float_sum_not_a_compensated_one():
    losses = [1e16, 1.0, -1e16]
    assert ls.float_sum(losses) == 0.0  # a compensated sum (math.fsum, sum() on 3.12+) gives 1.0
    contracts.load("SftLoopState", _sft_state(losses, epoch=0, cursor=3))
    with pytest.raises(ContractError) as info:
        contracts.load("SftLoopState", _sft_state(losses, epoch=0, cursor=3, current_sum=1.0))
    assert (info.value.code, info.value.pointer) == ("inconsistent_fields", "/current_epoch_loss_sum")


def test_best_epoch_loss_is_the_lowest_mean_over_every_finished_epoch():
    losses = [3.0, 1.0, 1.0, 0.5, 0.25]  # two items per epoch: means 2.0 and 0.75
    contracts.load("SftLoopState", _sft_state(losses, epoch=2, cursor=1, first=2.0, best=0.75))
    with pytest.raises(ContractError) as info:
        contracts.load("SftLoopState", _sft_state(losses, epoch=2, cursor=1, first=2.0, best=2.0))
    assert (info.value.code, info.value.pointer) == ("inconsistent_fields", "/best_epoch_loss")


def test_finished_epochs_must_have_a_whole_number_of_items_each():
    losses = [3.0, 1.0, 1.0, 0.5, 0.25]
    with pytest.raises(ContractError) as info:
        contracts.load("SftLoopState", _sft_state(losses, epoch=3, cursor=1, first=2.0, best=0.75))
    assert (info.value.code, info.value.pointer) == ("inconsistent_fields", "/epoch_index")


def test_loop_states_are_loaded_and_written_by_training_kind(tmp_path):
    for kind, doc_type in ls.LOOP_STATE_TYPES.items():
        state = example(doc_type)
        path = ls.write_loop_state(kind, tmp_path / ls.loop_state_file_name(kind), state)
        assert path.name == f"{kind}_loop_state.json"
        assert type(ls.load_loop_state(kind, path)).__name__ == doc_type
    with pytest.raises(ValueError, match="capability-distillation"):
        ls.loop_state_file_name("capability-distillation")


def test_a_loop_state_of_another_kind_is_refused():
    with pytest.raises(ContractError):
        ls.load_loop_state("grpo", example("SftLoopState"))
