"""Wire compatibility with the reference implementation's published contracts.

Reads ``../shared/upstream/contracts`` beside the checkout and skips cleanly when it is
absent (a user's clone has no ``../shared``). For every object spec/10 names:
what Kiln emits (its schema examples, rendered by the strict writer) validates against
the reference definition, and the reference's own examples validate against Kiln's schema.
The reference examples are illustrative (placeholder digests), so they are checked at the
schema level, not against Kiln's recomputed-digest rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import kiln_contracts
import pytest
from _upstream import needs_upstream, upstream, upstream_validator

from kiln import contracts
from kiln.documents import validation

COMPAT = [
    "AdapterManifest", "AdapterManifestFiles", "BaseWeightShardManifest", "ExecutionProvenanceV1",
    "TrainingCheckpointPrecision", "SftRequest", "SftConfig", "GrpoRequest", "GrpoConfig", "OpdRequest",
    "OpdConfig", "TrainingResponse", "TrainingStatus", "TrainingJobDetail", "TrainingCheckpointSummary",
    "QueueResponse", "CancelTrainingJobResponse", "AdaptersResponse", "AdapterDiskEntry", "LoadAdapterRequest",
    "LoadAdapterResponse", "UnloadAdapterResponse", "DeleteAdapterResponse", "RegisterTeacherRequest",
    "TeacherEntry", "TeacherIdentityV1",
]  # fmt: skip

pytestmark = needs_upstream


def _emitted(defname):
    cases = json.loads((Path(__file__).resolve().parent.parent / "conformance" / "cases" / "examples.json").read_text())
    return [c["instance"] for c in cases if c["type"] == defname]


@pytest.mark.parametrize("defname", COMPAT)
def test_reference_examples_validate_against_kiln(defname):
    docs, _ = upstream()
    ours = jsonschema.Draft202012Validator(
        validation.entry_schema(defname)
        if defname in kiln_contracts.ENTRYPOINTS
        else {"$ref": f"#/$defs/{defname}", "$defs": kiln_contracts.load_bundle()["$defs"]},
        format_checker=jsonschema.FormatChecker(),
    )
    for doc in docs.values():
        for example in doc.get("x-kiln-examples", {}).get(defname, []):
            errors = [f"{e.json_path}: {e.message}" for e in ours.iter_errors(example)]
            assert not errors, errors


@pytest.mark.parametrize("defname", [d for d in COMPAT if d in kiln_contracts.ENTRYPOINTS])
def test_what_kiln_emits_validates_against_the_reference(defname):
    validator, _ = upstream_validator(defname)
    emitted = _emitted(defname)
    assert emitted, f"Kiln has no example of {defname}"
    for instance in emitted:
        written = json.loads(contracts.render(defname, contracts.load(defname, instance)))
        errors = [f"{e.json_path}: {e.message}" for e in validator.iter_errors(written)]
        assert not errors, errors


def test_embedded_compat_objects_in_kiln_documents_validate_against_the_reference():
    manifest = _emitted("AdapterManifest")[0]
    files_validator, _ = upstream_validator("AdapterManifestFiles")
    assert not list(files_validator.iter_errors(manifest["files"]))
    receipt = _emitted("TrainReceipt")[0]
    for key, defname in (
        ("execution_provenance", "ExecutionProvenanceV1"),
        ("training_precision", "TrainingCheckpointPrecision"),
    ):
        validator, _ = upstream_validator(defname)
        assert not list(validator.iter_errors(receipt["runtime"][key])), defname
    validator, _ = upstream_validator("BaseWeightShardManifest")
    assert not list(validator.iter_errors(receipt["model"]["base_weight_shard_manifest"]))


def test_a_trained_adapters_manifest_validates_against_the_reference(tmp_path, tiny_model_dir):
    from kiln.trainers.sft import admit_sft, run_sft

    data = tmp_path / "data.jsonl"
    data.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})
        + "\n",
        encoding="utf-8",
    )
    job = admit_sft(
        adapter_name="compat",
        registry=tmp_path / "adapters",
        config={"epochs": 1, "seed": 1},
        dataset_path=data,
        model_path=str(tiny_model_dir),
    )
    result = run_sft(job)
    manifest = json.loads(result.manifest_path.read_text(encoding="utf-8"))
    validator, _ = upstream_validator("AdapterManifest")
    assert not [e.message for e in validator.iter_errors(manifest)]
    for key, defname in (
        ("base_weight_shard_manifest", "BaseWeightShardManifest"),
        ("execution_provenance", "ExecutionProvenanceV1"),
        ("training_precision", "TrainingCheckpointPrecision"),
    ):
        validator, _ = upstream_validator(defname)
        assert not [e.message for e in validator.iter_errors(manifest[key])], defname
