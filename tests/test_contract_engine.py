"""The strict-loader pipeline: schema, semantic rules wherever a definition is embedded, model, writer."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kiln import contracts
from kiln.documents.digests import execution_provenance_digest
from kiln.errors import ContractError, IntegrityError

EXAMPLES = {
    (c["type"], c["description"]): c["instance"]
    for c in json.loads(
        (Path(__file__).parent.parent / "conformance" / "cases" / "examples.json").read_text(encoding="utf-8")
    )
}


def example(doc_type: str, index: int = 0):
    return copy.deepcopy(EXAMPLES[(doc_type, f"{doc_type}: schema example {index}")])


def test_every_schema_example_loads_and_round_trips_unchanged():
    for (doc_type, _), instance in EXAMPLES.items():
        model = contracts.load(doc_type, instance)
        assert json.loads(contracts.render(doc_type, model)) == instance, doc_type


def test_an_embedded_provenance_record_is_checked_where_it_sits():
    receipt = example("TrainReceipt")
    receipt["runtime"]["execution_provenance"]["backend"]["device"] = "cpu (tampered)"
    with pytest.raises(IntegrityError) as info:
        contracts.load("TrainReceipt", receipt)
    assert info.value.code == "digest_mismatch"
    assert info.value.pointer == "/runtime/execution_provenance/provenance_sha256"


def test_readers_keep_unknown_receipt_fields_and_writers_refuse_them(tmp_path):
    receipt = example("TrainReceipt")
    receipt["future_field"] = {"added": "in a later minor release"}
    model = contracts.load("TrainReceipt", receipt)
    assert model.model_extra["future_field"] == {"added": "in a later minor release"}
    with pytest.raises(ContractError) as info:
        contracts.write("TrainReceipt", tmp_path / "train_receipt.json", model)
    assert (info.value.code, info.value.pointer) == ("unknown_field", "/future_field")
    assert not (tmp_path / "train_receipt.json").exists()


def test_closed_documents_refuse_unknown_fields_with_a_pointer():
    manifest = example("AdapterManifest")
    manifest["files"]["extra"] = "x"
    with pytest.raises(ContractError) as info:
        contracts.load("AdapterManifest", manifest)
    assert (info.value.code, info.value.pointer) == ("unknown_field", "/files/extra")


def test_envelope_problems_are_reported_first():
    doc = example("ExecutionProvenanceV1")
    doc["schema_version"] = 2
    doc["backend"]["name"] = 7
    with pytest.raises(ContractError) as info:
        contracts.load("ExecutionProvenanceV1", doc)
    assert info.value.problems[0].code == "unsupported_schema_version"
    assert ("wrong_type", "/backend/name") in {(p.code, p.pointer) for p in info.value.problems}


def test_all_schema_problems_are_collected_together():
    doc = example("BaseWeightShardManifest")
    del doc["total_size_bytes"]
    doc["shards"][0]["size_bytes"] = "12"
    doc["surprise"] = True
    with pytest.raises(ContractError) as info:
        contracts.load("BaseWeightShardManifest", doc)
    found = {(p.code, p.pointer) for p in info.value.problems}
    assert {
        ("missing_field", "/total_size_bytes"),
        ("wrong_type", "/shards/0/size_bytes"),
        ("unknown_field", "/surprise"),
    } <= found


def test_writer_emits_canonical_json_atomically(tmp_path):
    doc = example("ExecutionProvenanceV1")
    path = contracts.write("ExecutionProvenanceV1", tmp_path / "p.json", doc)
    data = path.read_bytes()
    assert data == json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert contracts.load("ExecutionProvenanceV1", path).provenance_sha256 == execution_provenance_digest(doc)


def test_a_document_type_is_detected_from_its_tag():
    assert contracts.detect_type(example("TrainReceipt")) == "TrainReceipt"
    assert contracts.detect_type(example("AdapterManifest")) == "AdapterManifest"
    assert contracts.detect_type(example("SftIngestion")) == "SftIngestion"
    with pytest.raises(ContractError) as info:
        contracts.detect_type({"hello": 1})
    assert info.value.code == "unknown_document_type"


def test_an_unknown_document_type_is_a_declared_error():
    with pytest.raises(ContractError) as info:
        contracts.load("NoSuchDocument", {})
    assert info.value.code == "unknown_document_type"


def test_strings_are_never_coerced_to_numbers():
    doc = example("BaseWeightShardManifest")
    doc["total_size_bytes"] = str(doc["total_size_bytes"])
    with pytest.raises(ContractError) as info:
        contracts.load("BaseWeightShardManifest", doc)
    assert (info.value.code, info.value.pointer) == ("wrong_type", "/total_size_bytes")
