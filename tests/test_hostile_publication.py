"""Adapter publication in one rename, and failures that tell the truth (issue 19, items 2 and 6).

* An adapter directory -- config, weights, receipt, manifest -- is staged hidden and appears with one rename, also
  over the directory a failed attempt's receipt holds; a SIGKILL at any file-system call of that publication never
  leaves a visible directory with serving files and no manifest, the listing never shows a half adapter
  ``available``, and resuming from the newest checkpoint gives the bytes of an uninterrupted run.
* A write the file system refuses (read-only, no space left, a name too long) ends the run with a failed receipt
  ``storage_error`` naming the path; when not even that receipt can be written, the run (and a server job) says
  so as ``registry_unwritable``; ``/health`` reports an unwritable registry.

The kill test forks its training processes from tests/_crash_driver.py's preloaded parent (the machinery of
tests/test_checkpoint_crash.py), pausing them before the n-th file-system call of the adapter's publication.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from test_checkpoint_crash import Run, Zygote

from kiln import contracts
from kiln.adapters import list_adapters
from kiln.adapters.publish import check_target
from kiln.checkpoints import list_checkpoints
from kiln.documents.digests import file_sha256, prefixed
from kiln.errors import ConflictError

ADAPTER = "bot"
ROWS = [
    {"messages": [{"role": "user", "content": f"How do I open panel {i}?"},
                  {"role": "assistant", "content": f"Press F{i}, then choose Open."}]}
    for i in range(4)
]  # fmt: skip
CONFIG = {"epochs": 1, "seed": 11, "checkpoint_interval": 1, "optimizer": {"kind": "adam_w"}, "learning_rate": 0.01}
NEWEST = f"{ADAPTER}-checkpoint-step-00000003.kiln-checkpoint"  # 4 steps: checkpoints 1..3, never at the last
CHECKPOINTS = [f"{ADAPTER}-checkpoint-step-{n:08d}.kiln-checkpoint" for n in (1, 2, 3)]
SERVING = ("adapter_config.json", "adapter_model.safetensors")
COMPLETE = sorted([*SERVING, "adapter_manifest.json", "train_receipt.json", "replay.jsonl", "lineage.json"])

fork_only = pytest.mark.skipif(not hasattr(os, "fork"), reason="the driver forks its training processes (POSIX)")


def _write_rows(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- what a registry may show


def _adapter_state(registry: Path, reference: dict[str, bytes]) -> str:
    """What ``<registry>/bot`` is after a kill: absent, a failed attempt's receipt, empty, or a complete adapter
    with exactly the reference's serving bytes. Anything else -- serving files without a manifest -- fails."""
    target = registry / ADAPTER
    if not target.exists():
        return "absent"
    files = sorted(os.listdir(target))
    if files == ["train_receipt.json"]:
        receipt = json.loads((target / "train_receipt.json").read_text())
        assert receipt["status"] == "failed", receipt
        assert receipt["failure_reason"] == "cancelled", receipt
        return "failed-receipt"
    if not files:
        return "empty"
    assert files == COMPLETE, f"a visible adapter directory that is not complete: {files}"
    manifest = json.loads((target / "adapter_manifest.json").read_text())
    assert contracts.problems("AdapterManifest", manifest) == []
    for key, name in (
        ("safetensors_hash", SERVING[1]),
        ("config_hash", SERVING[0]),
        ("receipt_hash", "train_receipt.json"),
    ):
        assert manifest[key] == prefixed(file_sha256(target / name)[0]), key
    for name in SERVING:
        assert (target / name).read_bytes() == reference[name], f"{name} differs from the uninterrupted run's"
    receipt = json.loads((target / "train_receipt.json").read_text())
    assert receipt["status"] == "success"
    assert receipt["adapters"]["output"]["path"] == str(target)  # the published place, not the staging directory
    return "complete"


def _check_registry(registry: Path, reference: dict[str, bytes]) -> str:
    state = _adapter_state(registry, reference)
    visible = sorted(e for e in os.listdir(registry) if not e.startswith("."))
    assert visible == sorted([*CHECKPOINTS, *([ADAPTER] if state != "absent" else [])]), visible
    assert [c.path.name for c in list_checkpoints(registry, ADAPTER)] == CHECKPOINTS
    listed = {e["name"]: e for e in list_adapters(registry)["available"]}
    if state == "absent":
        assert listed == {}
    elif state == "complete":
        assert listed[ADAPTER]["status"] == "available"
        assert listed[ADAPTER]["adapter_manifest"] is not None
    else:
        assert listed[ADAPTER]["status"] == "invalid", listed[ADAPTER]
        assert listed[ADAPTER]["adapter_manifest"] is None
    return state


# ----------------------------------------------------------------------------- SIGKILL during publication


def _spec(tmp_path: Path, model: Path, registry: Path, *, resume=None, pause=None, cancel_after=None) -> dict:
    return {
        "model": str(model),
        "registry": str(registry),
        "data": str(tmp_path / "data.jsonl"),
        "adapter": ADAPTER,
        "config": CONFIG,
        "resume": resume,
        "result": str(tmp_path / "result.json"),
        "pause": pause,
        "pause_in": "adapter",
        "cancel_after": cancel_after,
    }


def _run(zygote: Zygote, spec: dict, *, exit_code: int = 0) -> tuple[Run, dict]:
    run = Run(zygote.submit(spec))
    run.follow(zygote, lambda line: False)
    if run.exit_code != exit_code:
        zygote._fail(f"run {run.pid} exited with {run.exit_code}, not {exit_code}; lines: {run.lines}")
    return run, json.loads(Path(spec["result"]).read_text())


def _ops(run: Run) -> list[str]:
    [line] = [line for line in run.lines if line.startswith("ADAPTER ")]
    return line.split()[2].split(",")


@fork_only
def test_sigkill_at_every_call_of_adapter_publication_never_leaves_a_half_adapter_and_resume_gives_the_same_bytes(
    tmp_path, tiny_model_dir
):
    _write_rows(tmp_path / "data.jsonl")
    zygote = Zygote(tmp_path)
    log: list[dict] = []
    try:
        # A: uninterrupted, fresh. Its serving files are the bytes every later publication must have.
        run_a, a = _run(zygote, _spec(tmp_path, tiny_model_dir, tmp_path / "a"))
        assert a["status"] == "success"
        assert len(a["losses"]) == len(ROWS)
        reference = {name: (tmp_path / "a" / ADAPTER / name).read_bytes() for name in SERVING}
        assert _check_registry(tmp_path / "a", reference) == "complete"

        # C: cancelled after step 3 -- checkpoints 1..3 and a failed attempt's receipt at the adapter's name.
        _, c = _run(zygote, _spec(tmp_path, tiny_model_dir, tmp_path / "c", cancel_after=3), exit_code=1)
        assert c["failure_reason"] == "cancelled"
        assert c["checkpoints"] == CHECKPOINTS
        templates = {"supersede": tmp_path / "c", "fresh": tmp_path / "c-fresh"}
        shutil.copytree(templates["supersede"], templates["fresh"], symlinks=True)
        shutil.rmtree(templates["fresh"] / ADAPTER)
        assert _check_registry(templates["supersede"], reference) == "failed-receipt"
        assert _check_registry(templates["fresh"], reference) == "absent"

        # The calls one publication makes, per case (a resume over a failed attempt's receipt moves it aside first).
        ops = {}
        for case, template in templates.items():
            registry = tmp_path / f"reference-{case}"
            shutil.copytree(template, registry, symlinks=True)
            run, result = _run(zygote, _spec(tmp_path, tiny_model_dir, registry, resume=NEWEST))
            assert result["status"] == "success"
            assert result["resumed_from"] == NEWEST
            assert result["published_adapter_sha256"] == a["published_adapter_sha256"]
            assert result["adapter_sha256"] == a["adapter_sha256"]
            assert _check_registry(registry, reference) == "complete"
            ops[case] = _ops(run)
        assert _ops(run_a) == ops["fresh"]
        assert ops["fresh"].count("rename") == 1, f"one rename publishes the adapter: {ops['fresh']}"
        assert ops["supersede"].count("rename") == 2, f"the receipt moved aside, then one rename: {ops['supersede']}"
        assert "fsync" in ops["fresh"][ops["fresh"].index("rename") + 1 :], "the registry is fsynced after the rename"

        # A kill before every call of the publication, then a resume from the newest checkpoint.
        for case, template in templates.items():
            for event in range(1, len(ops[case]) + 1):
                registry = tmp_path / "kills" / f"{case}-{event:02d}"
                shutil.copytree(template, registry, symlinks=True)
                spec = _spec(tmp_path, tiny_model_dir, registry, resume=NEWEST, pause=[1, event])
                run = Run(zygote.submit(spec))
                if run.follow(zygote, lambda line, p=f"PAUSE 1 {event} ": line.startswith(p)) is None:
                    zygote._fail(f"run {run.pid} ({case}, {event}) ended before its pause: {run.lines}")
                os.kill(run.pid, signal.SIGKILL)  # our own child, which the zygote has not reaped yet
                run.follow(zygote, lambda line: False)
                assert run.exit_code == -signal.SIGKILL, run.lines
                state = _check_registry(registry, reference)
                entry = {"case": case, "event": event, "op": ops[case][event - 1], "after_kill": state}
                if state == "complete":  # killed after the rename: the adapter is published, its name taken
                    with pytest.raises(ConflictError) as taken:
                        check_target(registry, ADAPTER)
                    assert taken.value.code == "adapter_exists"
                else:
                    _, result = _run(zygote, _spec(tmp_path, tiny_model_dir, registry, resume=NEWEST))
                    assert result["status"] == "success", result["failure"]
                    assert result["published_adapter_sha256"] == a["published_adapter_sha256"]
                    assert result["adapter_sha256"] == a["adapter_sha256"]
                    assert result["losses"] == a["losses"]  # the history restored, then the last step
                    assert _check_registry(registry, reference) == "complete"
                    entry["resumed"] = True
                log.append(entry)
                shutil.rmtree(registry)
    finally:
        zygote.close()
    states = [e["after_kill"] for e in log]
    assert len(log) >= 20, log
    assert {"absent", "failed-receipt", "empty", "complete"} <= set(states), states
    for e in log:  # the adapter is visible exactly from its one rename on
        published = len(ops[e["case"]]) - ops[e["case"]][::-1].index("rename")  # 1-based: the last rename
        assert (e["after_kill"] == "complete") == (e["event"] > published), e
    print(
        f"\n{len(log)} kills inside adapter publication ({len(ops['fresh'])} + {len(ops['supersede'])} calls), "
        f"{sum('resumed' in e for e in log)} resumed to the uninterrupted bytes, "
        f"{states.count('complete')} already complete",
        *(json.dumps(e) for e in log),
        sep="\n  ",
    )
