"""The checkpoint CLI: ``kiln checkpoints list|inspect|verify``, ``kiln validate`` on a
checkpoint, and cooperative cancellation of ``kiln train sft --local`` by SIGINT/SIGTERM
in a real subprocess (checkpoint published, cancelled receipt, resume command printed and
working, non-zero exit)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from kiln.cli import main
from kiln.trainers.sft import admit_sft, run_sft

ROWS = [
    {"messages": [{"role": "user", "content": f"Where is setting {i}?"},
                  {"role": "assistant", "content": f"Setting {i} is under Preferences, tab {i}."}]}
    for i in range(6)
]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """A registry with checkpoints at steps 2 and 4 of a 6-step run (adam_w)."""
    root = tmp_path_factory.mktemp("cli")
    data = root / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:3]), encoding="utf-8")
    registry = root / "adapters"
    job = admit_sft(
        adapter_name="bot",
        registry=registry,
        config={"epochs": 2, "seed": 3, "checkpoint_interval": 2, "optimizer": {"kind": "adam_w"}},
        dataset_path=data,
        model_path=str(tiny_model_dir),
    )
    result = run_sft(job)
    assert result.status == "success"
    return registry, [p.name for p in result.checkpoints]


@pytest.fixture
def copy(trained, tmp_path):
    registry, names = trained
    target = tmp_path / "adapters"
    target.mkdir()
    for name in names:
        shutil.copytree(registry / name, target / name)
    return target, names


def _chmod_write(path):
    path.chmod(0o644)
    return path


def test_list_inspect_verify_on_valid_checkpoints(trained, capsys):
    registry, names = trained
    assert names == ["bot-checkpoint-step-00000002.kiln-checkpoint", "bot-checkpoint-step-00000004.kiln-checkpoint"]
    assert main(["checkpoints", "list", "--adapter-dir", str(registry)]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in names)
    assert "ok (metadata)" in out

    assert main(["checkpoints", "list", "--adapter-dir", str(registry), "--adapter", "bot", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [e["global_step"] for e in listed] == [2, 4]
    assert all(e["valid"] for e in listed)
    assert listed[1]["summary"]["resume_checkpoint"] == names[1]

    assert main(["checkpoints", "inspect", names[1], "--adapter-dir", str(registry), "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert inspected["valid"] is True
    assert inspected["summary"]["global_step"] == 4
    assert set(inspected["files"]) == {"adapter.safetensors", "optimizer.safetensors", "sft_loop_state.json"}

    assert main(["checkpoints", "inspect", str(registry / names[0])]) == 0
    out = capsys.readouterr().out
    assert "step 2 of 6" in out
    assert f"--resume-checkpoint {names[0]}" in out

    assert main(["checkpoints", "verify", str(registry / names[0])]) == 0
    assert "verified 3 files" in capsys.readouterr().out


def _tamper_checksum(directory):
    target = _chmod_write(directory / "adapter.safetensors")
    blob = bytearray(target.read_bytes())
    blob[-1] ^= 0xFF
    target.write_bytes(bytes(blob))


def _tamper_extra(directory):
    (directory / "notes.txt").write_text("hello", encoding="utf-8")


def _tamper_sentinel(directory):
    (directory / ".incomplete").write_bytes(b"")


def _tamper_unknown_field(directory):
    manifest = _chmod_write(directory / "checkpoint_manifest.json")
    value = json.loads(manifest.read_text(encoding="utf-8"))
    value["note"] = "edited by hand"
    manifest.write_text(json.dumps(value), encoding="utf-8")


def _tamper_missing(directory):
    (directory / "optimizer.safetensors").unlink()


@pytest.mark.parametrize(
    ("tamper", "reason", "inspect_ok"),
    [
        (None, None, True),
        (_tamper_checksum, "checksum_mismatch", True),
        (_tamper_extra, "extra_file", False),
        (_tamper_sentinel, "sentinel_present", False),
        (_tamper_unknown_field, "unknown_field", False),
        (_tamper_missing, "missing_file", False),
    ],
)
def test_verify_and_validate_agree(tamper, reason, inspect_ok, copy, capsys):
    registry, names = copy
    directory = registry / names[0]
    if tamper:
        tamper(directory)
    verify = main(["checkpoints", "verify", str(directory), "--json"])
    verified = json.loads(capsys.readouterr().out)
    validate_dir = main(["validate", str(directory), "--json"])
    validated_dir = json.loads(capsys.readouterr().out)
    validate_manifest = main(["validate", str(directory / "checkpoint_manifest.json"), "--json"])
    validated_manifest = json.loads(capsys.readouterr().out)
    inspect = main(["checkpoints", "inspect", str(directory), "--json"])
    capsys.readouterr()

    expected = 0 if tamper is None else 1
    assert verify == validate_dir == validate_manifest == expected
    assert verified["valid"] == validated_dir["valid"] == validated_manifest["valid"] == (tamper is None)
    assert inspect == (0 if inspect_ok else 1)
    if tamper is not None:
        assert verified["error"]["reason"] == reason
        assert any(reason in e["message"] or e["code"] == reason for e in validated_dir["errors"])
        assert validated_dir["errors"] == validated_manifest["errors"]


def test_list_reports_invalid_checkpoints_and_unfinished_publications(copy, capsys):
    registry, names = copy
    _tamper_sentinel(registry / names[1])
    (registry / f".{names[1]}.incomplete-abc12345").mkdir()
    assert main(["checkpoints", "list", "--adapter-dir", str(registry)]) == 0
    out = capsys.readouterr().out
    assert "INVALID (sentinel_present)" in out
    assert "1 unfinished publication" in out


# ----------------------------------------------------------------------------- cancellation


def _kiln(*args, env, **kwargs):
    return subprocess.Popen(
        [sys.executable, "-m", "kiln.cli", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs
    )


def _wait_for_progress(proc, marker, timeout=120):
    """Collect stderr in a thread; return once ``marker`` has appeared."""
    seen = bytearray()
    ready = threading.Event()

    def pump():
        while chunk := proc.stderr.read1(4096):
            seen.extend(chunk)
            if marker in seen:
                ready.set()
        ready.set()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    assert ready.wait(timeout), "the training never reported progress"
    return seen, thread


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_publishes_a_checkpoint_and_prints_a_working_resume_command(
    signum, exit_code, tmp_path, tiny_model_dir
):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    registry = tmp_path / "adapters"
    env = {**os.environ, "KILN_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}

    def options(adapters):
        return ["--local", "-f", str(data), "--model", str(tiny_model_dir), "--adapter-dir", str(adapters),
                "--epochs", "8", "--seed", "11", "--optimizer", "adam_w", "--adapter", "bot"]  # fmt: skip

    with _kiln("train", "sft", *options(registry), env=env) as proc:  # pipes closed even when a check fails
        seen, pump = _wait_for_progress(proc, b"/48")
        time.sleep(0.05)
        proc.send_signal(signum)
        out = proc.stdout.read().decode()
        assert proc.wait(timeout=120) == exit_code
        pump.join()  # the pipe reached end of file: the process is gone
    err = seen.decode(errors="replace")

    assert "cancelling after the current step" in err
    assert "✗ training cancelled: its receipt records status failed, failure_reason cancelled" in err
    checkpoints = sorted(p.name for p in registry.glob("bot-checkpoint-step-*.kiln-checkpoint"))
    assert len(checkpoints) == 1, (out, err)
    receipt = json.loads((registry / "bot" / "train_receipt.json").read_text(encoding="utf-8"))
    assert receipt["status"] == "failed"
    assert receipt["failure_reason"] == "cancelled"
    assert checkpoints[0] in receipt["failure_message"]
    assert main(["checkpoints", "verify", str(registry / checkpoints[0])]) == 0
    command = err.split("Resume with:\n", 1)[1].strip().splitlines()[0].strip()
    argv = shlex.split(command)
    assert argv[:3] == ["kiln", "train", "sft"]
    assert argv[-2:] == ["--resume-checkpoint", checkpoints[0]]
    if signum != signal.SIGINT:
        return

    def cli(argv):
        done = subprocess.run(
            [sys.executable, "-m", "kiln.cli", *argv, "--json"], env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["status"] == "success"

    cli(argv[1:])  # the printed resume command, as printed
    other = tmp_path / "uninterrupted"
    cli(["train", "sft", *options(other)])
    assert (registry / "bot" / "adapter_model.safetensors").read_bytes() == (
        other / "bot" / "adapter_model.safetensors"
    ).read_bytes()


def test_the_configured_interval_applies_when_the_command_omits_it(tmp_path, tiny_model_dir, monkeypatch, capsys):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]), encoding="utf-8")
    registry = tmp_path / "adapters"
    monkeypatch.setenv("KILN_TRAINING_CHECKPOINT_INTERVAL", "3")
    argv = ["train", "sft", "--local", "-f", str(data), "--model", str(tiny_model_dir), "--adapter-dir", str(registry)]
    assert main([*argv, "--adapter", "bot", "--epochs", "2", "--seed", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints"] == [
        str(registry / "bot-checkpoint-step-00000003.kiln-checkpoint")
    ]
    monkeypatch.setenv("KILN_TRAINING_CHECKPOINT_INTERVAL", "0")
    assert main([*argv, "--adapter", "other", "--json"]) == 2
    assert "config_invalid" in capsys.readouterr().err
