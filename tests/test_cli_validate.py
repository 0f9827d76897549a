"""`kiln validate`: exit status, codes and pointers, --json, --type, and no torch on its path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli import main

CASES = Path(__file__).resolve().parent.parent / "conformance" / "cases"
EXAMPLES = json.loads((CASES / "examples.json").read_text(encoding="utf-8"))
MUTATIONS = json.loads((CASES / "schema-mutations.json").read_text(encoding="utf-8"))
TAGGED = {
    "TrainReceipt",
    "AdapterManifest",
    "BaseWeightShardManifest",
    "ExecutionProvenanceV1",
    "SftIngestion",
    "TrainingCheckpointManifest",
}


def _write(tmp_path, name, value):
    path = tmp_path / name
    path.write_text(json.dumps(value), encoding="utf-8")
    return path


def test_valid_documents_of_every_type_are_accepted(tmp_path, capsys):
    for i, case in enumerate(EXAMPLES):
        path = _write(tmp_path, f"doc{i}.json", case["instance"])
        args = ["validate", str(path)] if case["type"] in TAGGED else ["validate", str(path), "--type", case["type"]]
        assert main(args) == 0, case["description"]
    assert "valid" in capsys.readouterr().out


@pytest.mark.parametrize(
    "rule",
    [
        "mutation.unknown-field",
        "mutation.wrong-const",
        "mutation.wrong-type",
        "mutation.null-not-nullable",
        "mutation.absent-required",
    ],
)
def test_each_mutation_class_is_rejected_with_its_code_and_pointer(tmp_path, capsys, rule):
    cases = [c for c in MUTATIONS if c["rule"] == rule and c["mode"] == "read" and c["type"] != "TrainReceipt"]
    assert cases, rule
    for i, case in enumerate(cases[:25]):
        path = _write(tmp_path, f"bad{i}.json", case["instance"])
        assert main(["validate", str(path), "--type", case["type"], "--json"]) == 1
        report = json.loads(capsys.readouterr().out)
        assert report["valid"] is False
        assert report["type"] == case["type"]
        assert {"code": case["error_code"], "pointer": case["pointer"]} in [
            {"code": e["code"], "pointer": e["pointer"]} for e in report["errors"]
        ], case["description"]


def test_human_output_lists_code_pointer_and_message_on_stderr(tmp_path, capsys):
    doc = next(c["instance"] for c in EXAMPLES if c["type"] == "AdapterManifest")
    doc = dict(doc, extra_field=1)
    path = _write(tmp_path, "m.json", doc)
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "unknown_field at /extra_field" in err


def test_untagged_documents_need_a_type(tmp_path, capsys):
    request = next(c["instance"] for c in EXAMPLES if c["type"] == "SftRequest")
    path = _write(tmp_path, "req.json", request)
    assert main(["validate", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["errors"][0]["code"] == "unknown_document_type"
    assert main(["validate", str(path), "--type", "SftRequest"]) == 0


def test_broken_json_and_missing_files_are_reported_not_raised(tmp_path, capsys):
    path = tmp_path / "broken.json"
    path.write_text('{"a": 1, "a": 2}', encoding="utf-8")
    assert main(["validate", str(path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["errors"][0]["code"] == "invalid_json"
    assert main(["validate", str(tmp_path / "absent.json"), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["errors"][0]["code"] == "document_unreadable"


def test_validate_and_help_do_not_import_torch(tmp_path):
    doc = next(c["instance"] for c in EXAMPLES if c["type"] == "TrainReceipt")
    path = _write(tmp_path, "r.json", doc)
    code = (
        "import sys\n"
        "from kiln.cli import main\n"
        f"rc = main(['validate', {str(path)!r}])\n"
        "assert rc == 0, rc\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'peft', 'numpy') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    out = subprocess.run([sys.executable, "-m", "kiln.cli", "--help"], check=True, capture_output=True, text=True)
    assert "validate" in out.stdout


def test_a_reader_that_goes_away_ends_the_command_quietly():
    """``kiln types | head``: the pipe closes before everything is written; no traceback, SIGPIPE's status."""
    with subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", "types"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        proc.stdout.close()  # the reader is gone before the first line
        err = proc.stderr.read().decode()
        assert proc.wait(60) == 141, err
    assert "Traceback" not in err
    assert "BrokenPipeError" not in err
