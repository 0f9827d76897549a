"""`python -m conformance PATH` validates any directory of artifacts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CASES = Path(__file__).resolve().parent.parent / "conformance" / "cases"


def _run(path):
    return subprocess.run([sys.executable, "-m", "conformance", str(path), "--json"], capture_output=True, text=True)


def test_a_tree_of_valid_artifacts_passes_and_untagged_files_are_skipped(tmp_path):
    examples = json.loads((CASES / "examples.json").read_text(encoding="utf-8"))
    receipt = next(c["instance"] for c in examples if c["type"] == "TrainReceipt")
    manifest = next(c["instance"] for c in examples if c["type"] == "AdapterManifest")
    (tmp_path / "bot").mkdir()
    (tmp_path / "bot" / "train_receipt.json").write_text(json.dumps(receipt), encoding="utf-8")
    (tmp_path / "bot" / "adapter_manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    (tmp_path / "bot" / "adapter_config.json").write_text('{"r": 16}', encoding="utf-8")
    result = _run(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["counts"] == {"valid": 2, "invalid": 0, "skipped": 1}


def test_an_invalid_artifact_fails_the_run_with_its_pointer(tmp_path):
    examples = json.loads((CASES / "examples.json").read_text(encoding="utf-8"))
    manifest = dict(next(c["instance"] for c in examples if c["type"] == "AdapterManifest"), schema_version=2)
    (tmp_path / "adapter_manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    result = _run(tmp_path)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["results"][0]["errors"][0]["code"] == "unsupported_schema_version"
    assert report["results"][0]["errors"][0]["pointer"] == "/schema_version"
