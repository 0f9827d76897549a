"""``kiln audit``: a published run re-executed between its checkpoints, on the tiny model.

Honest SFT, GRPO (streamed) and OPD (local teacher, inline prompts) runs are ``reproduced`` in full and by spot
checks. Forgeries that keep every digest self-consistent -- a checkpoint tensor changed and its manifest entry
recomputed, the adapter weights replaced and the receipt and manifest rebound -- are ``not_reproduced``, naming the
file, the tensor and the step. A changed data file, another thread count and a missing checkpoint are
``cannot_audit``, naming why. Every record passes its strict loader.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from kiln.artifacts.training_audit import load_training_audit
from kiln.audit import AuditSources, audit
from kiln.cli import main
from kiln.trainers import TRAINERS, TrainingContext

ROOT = Path(__file__).resolve().parent.parent
SFT_DATA = ROOT / "examples" / "sft_corrections.jsonl"
GRPO_DATA = ROOT / "examples" / "grpo_groups.jsonl"
OPD_PROMPTS = [{"messages": [{"role": "user", "content": f"Tell me one thing about {t}."}]} for t in ("cats", "rain")]


def _train(registry: Path, kind: str, request: dict, model: Path, teachers: Path | None = None) -> Path:
    context = TrainingContext(
        registry=registry, model_path=str(model), teachers_root=teachers, checkpoint_interval=None
    )
    job = TRAINERS[kind].admit(request, adapter_name="bot", context=context)
    result = TRAINERS[kind].run(job)
    assert result.status == "success", result.receipt.get("failure_message")
    return result.adapter_dir


def _copy(adapter: Path, tmp_path: Path) -> Path:
    """The adapter's whole registry (adapter and checkpoints), copied: the forgeries edit the copy."""
    registry = tmp_path / "copy"
    shutil.copytree(adapter.parent, registry)
    return registry / adapter.name


def _checked(record: dict) -> dict:
    load_training_audit(record)  # every record passes its strict loader
    return record


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory, tiny_model_dir):
    """12 conversations x 2 epochs, a checkpoint every 6 steps: boundaries 6, 12, 18 and the end at 24."""
    registry = tmp_path_factory.mktemp("sft") / "adapters"
    config = {"seed": 7, "epochs": 2, "checkpoint_interval": 6}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(registry.parent / "home"))
        return _train(registry, "sft", {"dataset_path": str(SFT_DATA), "config": config}, tiny_model_dir)


def test_an_honest_sft_run_is_reproduced_in_full_and_by_spot_checks(sft_run, capsys):
    full = _checked(audit(sft_run))
    assert full["verdict"] == "reproduced", (full["first_difference"], full["cannot_audit"])
    assert [(s["from_step"], s["to_step"], s["outcome"]) for s in full["segments"]] == [
        (0, 6, "reproduced"), (6, 12, "reproduced"), (12, 18, "reproduced"), (18, None, "reproduced"),
    ]  # fmt: skip
    assert [c["global_step"] for c in full["checkpoints"]] == [6, 12, 18]
    spot = _checked(audit(sft_run, segments=2, seed=3))
    assert spot["verdict"] == "reproduced"
    assert spot["seed"] == 3
    assert sorted(s["outcome"] for s in spot["segments"]) == ["not_replayed"] * 2 + ["reproduced"] * 2
    # the command line: exit 0, the record on --out, readable by kiln validate
    assert (
        main(["audit", str(sft_run), "--segments", "1", "--seed", "5", "--out", str(sft_run.parent.parent / "a.json")])
        == 0
    )
    assert "✓ reproduced" in capsys.readouterr().out
    assert main(["validate", str(sft_run.parent.parent / "a.json")]) == 0


def _forge_checkpoint_tensor(checkpoint: Path) -> str:
    """Change one adapter tensor of a checkpoint and re-record the file's digest and size, so the checkpoint is
    self-consistent (its strict load passes) but holds other numbers."""
    from safetensors.torch import load_file, save_file

    state = load_file(checkpoint / "adapter.safetensors")
    name = sorted(state)[0]
    state[name] = state[name] + 0.01
    save_file(state, checkpoint / "adapter.safetensors")
    data = (checkpoint / "adapter.safetensors").read_bytes()
    manifest = json.loads((checkpoint / "checkpoint_manifest.json").read_text())
    manifest["files"]["adapter.safetensors"].update(sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    (checkpoint / "checkpoint_manifest.json").write_text(json.dumps(manifest, indent=2))
    return name


def test_a_self_consistent_forged_checkpoint_is_not_reproduced_naming_tensor_and_step(sft_run, tmp_path, capsys):
    from kiln.checkpoints import load_checkpoint

    adapter = _copy(sft_run, tmp_path)
    forged = adapter.parent / "bot-checkpoint-step-00000012.kiln-checkpoint"
    tensor = _forge_checkpoint_tensor(forged)
    load_checkpoint(forged)  # integrity holds: only re-execution can tell
    record = _checked(audit(adapter))
    assert record["verdict"] == "not_reproduced"
    difference = record["first_difference"]
    assert (difference["file"], difference["item"], difference["step"]) == ("adapter.safetensors", tensor, 12)
    assert difference["max_abs_difference"] == pytest.approx(0.01, rel=1e-3)
    assert [s["outcome"] for s in record["segments"]] == [
        "reproduced",
        "not_reproduced",
        "not_replayed",
        "not_replayed",
    ]
    spot = _checked(audit(adapter, segments=4, seed=0))  # every segment drawn: the one ending at 12 names it first
    assert spot["verdict"] == "not_reproduced"
    assert spot["first_difference"]["step"] == 12
    assert main(["audit", str(adapter)]) == 1
    assert f"at step 12, adapter.safetensors {tensor} differs" in capsys.readouterr().out


def test_replaced_adapter_weights_with_rebound_receipt_and_manifest_are_not_reproduced(sft_run, tmp_path):
    from safetensors.torch import load_file, save_file

    from kiln.adapters import MANIFEST_FILE, RECEIPT_FILE, WEIGHTS_FILE
    from kiln.adapters.publish import adapter_file_receipt, bind_adapter_manifest

    adapter = _copy(sft_run, tmp_path)
    state = load_file(adapter / WEIGHTS_FILE)
    name = sorted(state)[-1]
    state[name] = torch.zeros_like(state[name])
    save_file(state, adapter / WEIGHTS_FILE)
    receipt = json.loads((adapter / RECEIPT_FILE).read_text())
    receipt["adapters"]["output"] = {**adapter_file_receipt(adapter), "path": receipt["adapters"]["output"]["path"]}
    (adapter / RECEIPT_FILE).write_text(json.dumps(receipt))
    (adapter / MANIFEST_FILE).unlink()
    bind_adapter_manifest(adapter, receipt)
    assert main(["adapters", "verify", str(adapter)]) == 0  # self-consistent: integrity cannot tell
    record = _checked(audit(adapter))
    assert record["verdict"] == "not_reproduced"
    difference = record["first_difference"]
    assert (difference["file"], difference["item"], difference["step"]) == (WEIGHTS_FILE, name, None)
    assert record["segments"][-1]["outcome"] == "not_reproduced"


def test_a_changed_data_file_is_cannot_audit(sft_run, tmp_path, capsys):
    changed = tmp_path / "data.jsonl"
    lines = SFT_DATA.read_text().splitlines(keepends=True)
    changed.write_text("".join(lines[:-1]), encoding="utf-8")  # one conversation fewer
    record = _checked(audit(sft_run, sources=AuditSources(data_file=changed)))
    assert record["verdict"] == "cannot_audit"
    assert record["cannot_audit"]["field"] == "training_data"
    assert main(["audit", str(sft_run), "--file", str(changed)]) == 2
    assert "? cannot audit" in capsys.readouterr().err


def test_another_thread_count_is_cannot_audit_naming_the_device(sft_run):
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads != 1 else 2)
    try:
        record = _checked(audit(sft_run, segments=1, seed=0))
    finally:
        torch.set_num_threads(threads)
    assert record["verdict"] == "cannot_audit"
    device = ("execution_provenance.backend.device", "/auxiliary_state/backend_runtime/device")
    assert record["cannot_audit"]["field"] in device  # from 0: the envelope; from a checkpoint: its resume check
    assert "thread" in record["cannot_audit"]["message"]


def test_a_missing_checkpoint_is_cannot_audit_naming_its_step(sft_run, tmp_path):
    adapter = _copy(sft_run, tmp_path)
    shutil.rmtree(adapter.parent / "bot-checkpoint-step-00000012.kiln-checkpoint")
    record = _checked(audit(adapter))
    assert record["verdict"] == "cannot_audit"
    assert record["cannot_audit"]["field"] == "checkpoints.12"
    spot = _checked(audit(adapter, segments=3, seed=1))  # every segment: the one from 6 publishes the missing 12
    assert spot["verdict"] == "cannot_audit"
    assert spot["cannot_audit"]["field"] == "checkpoints.12"


def test_a_checkpoint_target_is_audited_up_to_its_step(sft_run):
    record = _checked(audit(sft_run.parent / "bot-checkpoint-step-00000012.kiln-checkpoint"))
    assert record["verdict"] == "reproduced"
    assert record["target"]["kind"] == "checkpoint"
    assert [(s["from_step"], s["to_step"]) for s in record["segments"]] == [(0, 6), (6, 12)]


def test_an_honest_grpo_run_is_reproduced_and_a_forged_checkpoint_is_not(tmp_path, tiny_model_dir):
    registry = tmp_path / "grpo" / "adapters"
    config = {"seed": 7, "checkpoint_interval": 1, "learning_rate": 0.01}
    adapter = _train(registry, "grpo", {"dataset_path": str(GRPO_DATA), "config": config}, tiny_model_dir)
    honest = _checked(audit(adapter))
    assert honest["verdict"] == "reproduced", honest["first_difference"]
    assert _checked(audit(adapter, segments=2, seed=9))["verdict"] == "reproduced"
    copy = _copy(adapter, tmp_path)
    _forge_checkpoint_tensor(copy.parent / "bot-checkpoint-step-00000002.kiln-checkpoint")
    record = _checked(audit(copy))
    assert record["verdict"] == "not_reproduced"
    assert record["first_difference"]["step"] == 2


def test_an_honest_opd_run_with_inline_prompts_is_reproduced_given_its_prompts(tmp_path, tiny_model_dir, teachers):
    registry = tmp_path / "opd" / "adapters"
    config = {"seed": 11, "samples_per_prompt": 2, "max_tokens": 6, "top_k": 16, "checkpoint_interval": 2,
              "optimizer": {"kind": "adam_w"}, "learning_rate": 0.01}  # fmt: skip
    request = {"teacher": "tutor", "prompts": OPD_PROMPTS, "config": config}
    adapter = _train(registry, "opd", request, tiny_model_dir, teachers)
    inline = _checked(audit(adapter, sources=AuditSources(teachers_root=teachers)))
    assert inline["verdict"] == "cannot_audit"  # the prompts were sent inline: not stored with the run
    assert inline["cannot_audit"]["field"] == "training_data"
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(OPD_PROMPTS), encoding="utf-8")
    sources = AuditSources(data_file=prompts, teachers_root=teachers)
    record = _checked(audit(adapter, sources=sources))
    assert record["verdict"] == "reproduced", record
    assert record["sources"]["teacher"] == "tutor"
    assert _checked(audit(adapter, segments=1, seed=2, sources=sources))["verdict"] == "reproduced"


def test_spot_check_segments_follow_from_the_recorded_seed_alone():
    from kiln.audit import draw_segments

    assert draw_segments(7, 10, 3) == draw_segments(7, 10, 3)
    assert len(draw_segments(7, 10, 3)) == 3
    assert draw_segments(7, 4, 9) == [0, 1, 2, 3]  # more than there are: every segment
    assert len({tuple(draw_segments(seed, 10, 3)) for seed in range(20)}) > 10  # the seed decides


def test_a_data_parallel_run_is_cannot_audit_in_one_process(sft_run, tmp_path):
    adapter = _copy(sft_run, tmp_path)
    receipt = json.loads((adapter / "train_receipt.json").read_text())
    receipt["runtime"]["data_parallel"] = {
        "world_size": 2,
        "backend": "gloo",
        "sharding": "kiln.sft-step-round-robin.v1",
    }
    (adapter / "train_receipt.json").write_text(json.dumps(receipt))
    record = _checked(audit(adapter))
    assert record["verdict"] == "cannot_audit"
    assert record["cannot_audit"]["field"] == "runtime.data_parallel"
    assert record["segments"] == []  # nothing was re-executed


def test_an_honest_off_policy_opd_run_is_reproduced_from_its_recorded_file(tmp_path, tiny_model_dir, teacher_dir):
    from _opd_fixture import off_policy_teacher

    responses = [("Name a colour.", "Blue."), ("Name a tree.", "An oak."), ("Name a bird.", "A robin.")]
    path, root = off_policy_teacher(tmp_path, tiny_model_dir, teacher_dir, responses)
    config = {"seed": 11, "top_k": 16, "training_mode": "off_policy", "epochs": 2, "checkpoint_interval": 2,
              "optimizer": {"kind": "adam_w"}, "learning_rate": 0.01}  # fmt: skip
    request = {"teacher": "scored", "dataset_path": str(path), "config": config}
    adapter = _train(tmp_path / "adapters", "opd", request, tiny_model_dir, root)
    sources = AuditSources(teachers_root=root)
    record = _checked(audit(adapter, sources=sources))
    assert record["verdict"] == "reproduced", (record["first_difference"], record["cannot_audit"])
    assert record["sources"]["data"] == {"dataset_path": str(path)}
    assert _checked(audit(adapter, segments=2, seed=4, sources=sources))["verdict"] == "reproduced"


def test_a_full_audit_can_start_at_a_published_checkpoint(sft_run, capsys):
    start = "bot-checkpoint-step-00000012.kiln-checkpoint"
    record = _checked(audit(sft_run, start=start))
    assert record["verdict"] == "reproduced"
    assert [(s["from_step"], s["to_step"]) for s in record["segments"]] == [(12, 18), (18, None)]
    assert main(["audit", str(sft_run), "--from", "bot-checkpoint-step-00000099.kiln-checkpoint"]) == 2
    assert "is not one of the run's published checkpoints" in capsys.readouterr().err


def test_a_checkpoint_left_by_another_run_of_the_name_is_not_taken_for_this_runs(sft_run, tmp_path, tiny_model_dir):
    other_registry = tmp_path / "other" / "adapters"
    config = {"seed": 8, "epochs": 2, "checkpoint_interval": 6}  # another seed: another run
    _train(other_registry, "sft", {"dataset_path": str(SFT_DATA), "config": config}, tiny_model_dir)
    adapter = _copy(sft_run, tmp_path)
    name = "bot-checkpoint-step-00000018.kiln-checkpoint"
    shutil.rmtree(adapter.parent / name)
    shutil.copytree(other_registry / name, adapter.parent / name)
    record = _checked(audit(adapter))
    assert record["verdict"] == "cannot_audit"  # this run's step 18 is missing; the other run's is not compared
    assert record["cannot_audit"]["field"] == "checkpoints.18"
    assert [c["global_step"] for c in record["checkpoints"]] == [6, 12]
