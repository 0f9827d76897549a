"""Exact resume on the tiny model (CPU): the property of spec/30 and the refusal matrix.

Run A trains uninterrupted; run B, with the same inputs, is cancelled at a committed
boundary (mid-epoch, at an epoch boundary, on a step that was just published) and resumed
from its checkpoint. B's loss history, final adapter bytes, optimizer state and loop state
equal A's exactly, for each optimizer kind, and a second clean run equals the first.
Resume admission refuses every drift by field path and accepts relocated model files.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading

import pytest
from _runs import assert_same_run

from kiln.checkpoints import incompatibilities, inspect_checkpoint, list_checkpoints, load_checkpoint
from kiln.documents.epoch_order import epoch_order
from kiln.errors import CheckpointError
from kiln.trainers.sft import admit_sft, run_sft

ROWS = [
    {"messages": [{"role": "user", "content": f"Question {i}: how do I do thing {i}?"},
                  {"role": "assistant", "content": f"Open the menu and pick option {i}, then confirm."}]}
    for i in range(5)
]  # fmt: skip
ITEMS, EPOCHS = len(ROWS), 2
TOTAL = ITEMS * EPOCHS


def _write_data(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _config(optimizer="muon", **extra):
    return {"epochs": EPOCHS, "seed": 7, "checkpoint_interval": 3, "optimizer": {"kind": optimizer}, **extra}


def _run(registry, data, model, config, *, cancel_at=None, name="bot"):
    job = admit_sft(adapter_name=name, registry=registry, config=config, dataset_path=data, model_path=str(model))
    event = threading.Event()

    def progress(e):
        if cancel_at is not None and e["step"] == cancel_at:
            event.set()

    return run_sft(job, progress=progress, cancel=event, keep_final_state=True)


def _resume(registry, data, model, config, checkpoint, name="bot"):
    return _run(registry, data, model, {**config, "resume_checkpoint": checkpoint}, name=name)


def _checkpoint_bytes(path):
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.name != "checkpoint_manifest.json"}


def _assert_same_run(a, b):
    assert_same_run(a, b)
    assert len(b.losses) == TOTAL


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return _write_data(tmp_path_factory.mktemp("data") / "rows.jsonl")


WARMUP_COSINE = {"kind": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1}


@pytest.mark.parametrize("optimizer", ["muon", "adam_w", "sgd", "adam_w+warmup-cosine"])
def test_cancel_and_resume_reproduces_the_uninterrupted_run(optimizer, tmp_path, tiny_model_dir, data_file):
    kind, _, schedule = optimizer.partition("+")
    config = _config(kind, **({"lr_scheduler": WARMUP_COSINE} if schedule else {}))
    optimizer = kind
    a = _run(tmp_path / "A", data_file, tiny_model_dir, config)
    assert [p.name for p in a.checkpoints] == [f"bot-checkpoint-step-{s:08d}.kiln-checkpoint" for s in (3, 6, 9)]
    if optimizer == "sgd":
        assert a.final_state.optimizer is None
        assert not (a.checkpoints[0] / "optimizer.safetensors").exists()
    else:
        assert (a.checkpoints[0] / "optimizer.safetensors").is_file()

    again = _run(tmp_path / "A2", data_file, tiny_model_dir, config)
    _assert_same_run(a, again)

    # mid-epoch (step 4: epoch 0, cursor 4), at the epoch boundary (step 5: epoch 1, cursor 0)
    # and on a step the interval has just published (step 6: no second checkpoint)
    for cancel_at, epoch, cursor in ((4, 0, 4), (5, 1, 0), (6, 1, 1)):
        registry = tmp_path / f"B{cancel_at}"
        b = _run(registry, data_file, tiny_model_dir, config, cancel_at=cancel_at)
        assert b.status == "failed"
        assert b.cancelled
        assert b.receipt["failure_reason"] == "cancelled"
        assert b.losses == a.losses[:cancel_at]
        checkpoint = b.checkpoints[-1]
        assert checkpoint.name == f"bot-checkpoint-step-{cancel_at:08d}.kiln-checkpoint"
        assert len(b.checkpoints) == len(set(b.checkpoints))
        progress = inspect_checkpoint(checkpoint).manifest["progress"]
        assert (progress["epoch_index"], progress["cursor_in_epoch"]) == (epoch, cursor)
        assert progress["data_order"] == epoch_order(7, epoch, ITEMS)
        if cancel_at in (3, 6):  # the same boundary in run A: byte-identical state files
            assert _checkpoint_bytes(checkpoint) == _checkpoint_bytes(tmp_path / "A" / checkpoint.name)

        resumed = _resume(registry, data_file, tiny_model_dir, config, checkpoint.name)
        _assert_same_run(a, resumed)
        assert resumed.resumed_from == checkpoint
        later = [p.name for p in resumed.checkpoints]
        assert later == [f"bot-checkpoint-step-{s:08d}.kiln-checkpoint" for s in (3, 6, 9) if s > cancel_at]
        for name in later:
            assert _checkpoint_bytes(registry / name) == _checkpoint_bytes(tmp_path / "A" / name)


def test_no_checkpoint_at_the_final_step_and_epoch_end_checkpoints_point_at_the_next_epoch(
    tmp_path, tiny_model_dir, data_file
):
    result = _run(tmp_path / "reg", data_file, tiny_model_dir, _config(checkpoint_interval=5))
    assert result.status == "success"
    assert [p.name for p in result.checkpoints] == ["bot-checkpoint-step-00000005.kiln-checkpoint"]
    loaded = load_checkpoint(result.checkpoints[0])
    assert loaded.manifest["progress"] == {
        "global_step": 5,
        "total_steps": TOTAL,
        "epoch_index": 1,
        "cursor_in_epoch": 0,
        "data_order": epoch_order(7, 1, ITEMS),
    }
    assert loaded.loop_state["first_epoch_loss"] == loaded.loop_state["best_epoch_loss"]
    assert loaded.manifest["rng_states"]["epoch-order"]["position"] == 1
    assert loaded.manifest["rng_states"]["lora-init"] == {
        "algorithm": "kiln.seeded-lora-init.v1",
        "seed": 7,
        "position": loaded.manifest["rng_states"]["lora-init"]["position"],
    }
    assert loaded.manifest["rng_states"]["lora-init"]["position"] > 0


def test_a_cancelled_run_without_interval_still_publishes_its_checkpoint(tmp_path, tiny_model_dir, data_file):
    config = _config(checkpoint_interval=None)
    b = _run(tmp_path / "reg", data_file, tiny_model_dir, config, cancel_at=2)
    assert b.cancelled
    assert [p.name for p in b.checkpoints] == ["bot-checkpoint-step-00000002.kiln-checkpoint"]
    assert "bot-checkpoint-step-00000002.kiln-checkpoint" in b.receipt["failure_message"]


# ----------------------------------------------------------------------------- refusal matrix


@pytest.fixture(scope="module")
def cancelled(tmp_path_factory, tiny_model_dir, data_file):
    """A registry holding one run cancelled at step 4 (muon)."""
    registry = tmp_path_factory.mktemp("cancelled") / "adapters"
    result = _run(registry, data_file, tiny_model_dir, _config(checkpoint_interval=None), cancel_at=4)
    assert result.cancelled
    return registry, result.checkpoints[-1].name


def _refusal(registry, data, model, config, checkpoint, name="bot"):
    with pytest.raises(CheckpointError) as info:
        admit_sft(
            adapter_name=name,
            registry=registry,
            config={**config, "resume_checkpoint": checkpoint},
            dataset_path=data,
            model_path=str(model),
        )
    return info.value


def _copy_model(tiny_model_dir, target):
    shutil.copytree(tiny_model_dir, target)
    return target


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"learning_rate": 2e-3}, "effective_config.learning_rate"),
        ({"seed": 8}, "effective_config.seed"),
        ({"lora_rank": 32}, "effective_config.lora_rank"),
        ({"epochs": 3}, "effective_config.epochs"),
        ({"optimizer": {"kind": "adam_w"}}, "effective_config.optimizer.kind"),
        ({"checkpoint_interval": 2}, "effective_config.checkpoint_interval"),
        ({"lora_target_modules": ["q_proj", "v_proj"]}, "effective_config.lora_target_modules"),
        ({"max_seq_len": 512}, "effective_config.max_seq_len"),
        ({"overlong_row_policy": "skip"}, "effective_config.overlong_row_policy"),
        ({"lr_scheduler": {"kind": "linear"}}, "effective_config.lr_scheduler.kind"),
        ({"lr_scheduler": {"kind": "constant", "warmup_steps": 2}}, "effective_config.lr_scheduler.warmup_steps"),
    ],
)
def test_resume_refuses_a_changed_setting_naming_the_field(change, field, cancelled, tiny_model_dir, data_file):
    registry, checkpoint = cancelled
    error = _refusal(registry, data_file, tiny_model_dir, {**_config(checkpoint_interval=None), **change}, checkpoint)
    assert error.code == "checkpoint_incompatible"
    assert error.reason.startswith("effective_config.")
    assert field in {p.code for p in error.problems}
    assert field in error.message


def test_resume_refuses_one_changed_byte_of_the_data(cancelled, tiny_model_dir, tmp_path):
    registry, checkpoint = cancelled
    rows = json.loads(json.dumps(ROWS))
    rows[2]["messages"][1]["content"] = rows[2]["messages"][1]["content"].replace("confirm", "confirn")
    changed = _write_data(tmp_path / "rows.jsonl", rows)
    error = _refusal(registry, changed, tiny_model_dir, _config(checkpoint_interval=None), checkpoint)
    assert error.code == "checkpoint_incompatible"
    assert error.reason == "data.content_sha256"
    codes = {p.code for p in error.problems}
    assert {"auxiliary_state.ingestion_receipt_sha256", "data.content_sha256"} <= codes


def test_resume_refuses_one_changed_byte_of_a_base_weight_shard(cancelled, tiny_model_dir, tmp_path, data_file):
    registry, checkpoint = cancelled
    model = _copy_model(tiny_model_dir, tmp_path / "model")
    shard = model / "model.safetensors"
    blob = bytearray(shard.read_bytes())
    blob[-3] ^= 0x01  # a low mantissa bit of the last tensor
    shard.write_bytes(bytes(blob))
    error = _refusal(registry, data_file, model, _config(checkpoint_interval=None), checkpoint)
    assert error.code == "checkpoint_incompatible"
    assert error.reason == "auxiliary_state.base_weight_shard_manifest"
    assert "model.safetensors" in error.message
    assert "auxiliary_state.base_model_weights_sha256" in {p.code for p in error.problems}


def test_resume_refuses_a_changed_chat_template(cancelled, tiny_model_dir, tmp_path, data_file):
    registry, checkpoint = cancelled
    model = _copy_model(tiny_model_dir, tmp_path / "model")
    template = model / "chat_template.jinja"
    template.write_text(template.read_text(encoding="utf-8") + "{# edited #}", encoding="utf-8")
    error = _refusal(registry, data_file, model, _config(checkpoint_interval=None), checkpoint)
    assert error.code == "checkpoint_incompatible"
    codes = {p.code for p in error.problems}
    assert {"auxiliary_state.chat_template_sha256", "auxiliary_state.training_chat_template_sha256"} <= codes


def test_resume_refuses_a_different_loss_route(cancelled, tiny_model_dir, data_file, monkeypatch):
    import kiln.kernels

    registry, checkpoint = cancelled
    monkeypatch.setattr(
        kiln.kernels, "choose_loss_route", lambda *a, **k: kiln.kernels.LossRouteChoice("active_rows", None)
    )
    error = _refusal(registry, data_file, tiny_model_dir, _config(checkpoint_interval=None), checkpoint)
    assert error.code == "checkpoint_incompatible"
    assert error.reason == "auxiliary_state.training_runtime_planning_identity.sft_loss_route"


def test_a_relocated_model_resumes_and_reproduces_the_run(tmp_path, tiny_model_dir, data_file):
    config = _config(checkpoint_interval=None)
    a = _run(tmp_path / "A", data_file, tiny_model_dir, config)
    b = _run(tmp_path / "B", data_file, tiny_model_dir, config, cancel_at=3)
    moved = _copy_model(tiny_model_dir, tmp_path / "elsewhere" / "renamed-model")
    _assert_same_run(a, _resume(tmp_path / "B", data_file, moved, config, b.checkpoints[-1].name))


def test_renamed_shards_with_the_same_bytes_are_compatible(cancelled):
    registry, checkpoint = cancelled
    manifest = inspect_checkpoint(registry / checkpoint).manifest
    current = json.loads(json.dumps(manifest))
    for shard in current["auxiliary_state"]["base_weight_shard_manifest"]["shards"]:
        shard["filename"] = "weights-renamed.safetensors"
    assert incompatibilities(manifest, current) == []
    current["auxiliary_state"]["base_weight_shard_manifest"]["shards"][0]["sha256"] = (
        "sha256:" + hashlib.sha256(b"other").hexdigest()
    )
    assert next(p.code for p in incompatibilities(manifest, current)) == "auxiliary_state.base_weight_shard_manifest"


def test_resume_keeps_the_checkpoint_seed_when_none_is_given(cancelled, tiny_model_dir, data_file):
    registry, checkpoint = cancelled
    config = {k: v for k, v in _config(checkpoint_interval=None).items() if k != "seed"}
    job = admit_sft(
        adapter_name="bot",
        registry=registry,
        config={**config, "resume_checkpoint": checkpoint},
        dataset_path=data_file,
        model_path=str(tiny_model_dir),
    )
    assert job.config.seed == 7
    assert job.start_step == 4


@pytest.mark.parametrize(
    ("value", "code", "reason"),
    [
        ("../bot-checkpoint-step-00000004.kiln-checkpoint", "checkpoint_invalid", "outside_registry"),
        ("sub/bot-checkpoint-step-00000004.kiln-checkpoint", "checkpoint_invalid", "outside_registry"),
        ("bot-checkpoint-step-00000099.kiln-checkpoint", "checkpoint_invalid", "not_found"),
        ("bot", "checkpoint_invalid", "non_canonical_name"),
    ],
)
def test_bad_resume_values_fail_before_any_model_work(value, code, reason, cancelled, data_file, monkeypatch):
    import kiln.model

    registry, _ = cancelled

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(kiln.model, "load_base_model", no_model)
    error = _refusal(registry, data_file, "/nonexistent-model", _config(checkpoint_interval=None), value)
    assert (error.code, error.reason) == (code, reason)


def test_another_adapters_checkpoint_and_a_peft_directory_are_refused_early(cancelled, data_file, monkeypatch):
    import kiln.model

    registry, checkpoint = cancelled
    monkeypatch.setattr(kiln.model, "load_base_model", lambda *a, **k: pytest.fail("model loaded"))
    error = _refusal(registry, data_file, "/nonexistent-model", _config(checkpoint_interval=None), checkpoint, "other")
    assert (error.code, error.reason) == ("checkpoint_incompatible", "adapter_name")

    peft = registry / "peft-checkpoint-step-00000001.kiln-checkpoint"
    peft.mkdir()
    (peft / "adapter_config.json").write_text("{}", encoding="utf-8")
    (peft / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    try:
        error = _refusal(
            registry, data_file, "/nonexistent-model", _config(checkpoint_interval=None), peft.name, "peft"
        )
    finally:
        shutil.rmtree(peft)
    assert (error.code, error.reason) == ("checkpoint_not_resumable", "missing_manifest")
    assert "PEFT" in error.message
    assert "not resumable" in error.message


def test_later_checkpoints_block_a_fresh_run_and_an_older_resume(tmp_path, tiny_model_dir, data_file):
    registry = tmp_path / "reg"
    config = _config(checkpoint_interval=2)
    b = _run(registry, data_file, tiny_model_dir, config, cancel_at=5)
    assert [p.name.split("-step-")[1][:8] for p in b.checkpoints] == ["00000002", "00000004", "00000005"]
    with pytest.raises(CheckpointError) as fresh:
        admit_sft(
            adapter_name="bot", registry=registry, config=config, dataset_path=data_file, model_path=str(tiny_model_dir)
        )
    assert fresh.value.code == "checkpoint_exists"
    assert "archive" in fresh.value.hint
    error = _refusal(registry, data_file, tiny_model_dir, config, "bot-checkpoint-step-00000002.kiln-checkpoint")
    assert error.code == "checkpoint_exists"
    assert "bot-checkpoint-step-00000004.kiln-checkpoint" in error.message
    assert [c.global_step for c in list_checkpoints(registry, "bot")] == [2, 4, 5]
