"""The SFT engine end to end on the tiny model: admission, training, publication."""

from __future__ import annotations

import hashlib
import json

import pytest

from kiln import contracts
from kiln.cli import main
from kiln.errors import ConflictError, RequestError
from kiln.trainers.sft import admit_sft, run_sft

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "How do I reset my password?"},
                  {"role": "assistant", "content": "Open Settings, choose Security, then Reset password."}]},
    {"messages": [{"role": "system", "content": "You are a concise support agent."},
                  {"role": "user", "content": "Where is my order?"},
                  {"role": "assistant", "content": "Please share the order number and I will check."}]},
    {"messages": [{"role": "user", "content": "Can I change my email?"},
                  {"role": "assistant", "content": "Yes: Settings, Account, Email."},
                  {"role": "user", "content": "Thanks!"},
                  {"role": "assistant", "content": "You are welcome."}]},
]  # fmt: skip


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _train(tmp_path, tiny_model_dir, name="bot", *, config=None, rows=CONVERSATIONS, registry=None):
    data = _write_jsonl(tmp_path / f"{name}.jsonl", rows)
    job = admit_sft(
        adapter_name=name,
        registry=registry or tmp_path / "adapters",
        config={"epochs": 1, "seed": 7, **(config or {})},
        dataset_path=data,
        model_path=str(tiny_model_dir),
    )
    return run_sft(job)


def test_training_publishes_an_adapter_with_a_valid_receipt_and_manifest(tmp_path, tiny_model_dir):
    result = _train(tmp_path, tiny_model_dir)
    assert result.status == "success"
    files = sorted(p.name for p in result.adapter_dir.iterdir())
    assert files == [
        "adapter_config.json", "adapter_manifest.json", "adapter_model.safetensors", "lineage.json", "replay.jsonl",
        "train_receipt.json",
    ]  # fmt: skip
    receipt = contracts.load("TrainReceipt", result.receipt_path)
    contracts.load("AdapterManifest", result.manifest_path)
    manifest = json.loads(result.manifest_path.read_text())
    assert receipt.status.value == "success"
    for field, name in (("safetensors_hash", "adapter_model.safetensors"), ("config_hash", "adapter_config.json"),
                        ("receipt_hash", "train_receipt.json")):  # fmt: skip
        digest = "sha256:" + hashlib.sha256((result.adapter_dir / name).read_bytes()).hexdigest()
        assert manifest[field] == digest, field
    raw = json.loads(result.receipt_path.read_text())
    assert raw["runtime"]["sft_loss_route"] == "fused_chunked_linear_ce"  # CPU capability
    assert raw["runtime"]["sft_loss_implementation"] == "torch.fused-linear-ce.online-grad.v2"
    chunk = raw["runtime"]["sft_loss_chunk_size"]
    assert chunk >= 256
    assert chunk & (chunk - 1) == 0
    assert raw["data"]["examples_trained"] == len(CONVERSATIONS)
    assert raw["training_data"]["sha256"] == raw["data"]["sft_ingestion"]["kept_corpus_sha256"]
    assert len(result.losses) == len(CONVERSATIONS)
    assert not list((tmp_path / "adapters").glob(".*")), "no staging directory is left behind"


def test_the_same_seed_gives_byte_identical_adapters_and_another_seed_does_not(tmp_path, tiny_model_dir):
    a = _train(tmp_path, tiny_model_dir, "a")
    b = _train(tmp_path, tiny_model_dir, "b")
    c = _train(tmp_path, tiny_model_dir, "c", config={"seed": 8})
    weights = [(r.adapter_dir / "adapter_model.safetensors").read_bytes() for r in (a, b, c)]
    assert weights[0] == weights[1]
    assert weights[0] != weights[2]
    assert a.losses == b.losses


@pytest.mark.parametrize("kind", ["muon", "adam_w", "sgd"])
def test_every_optimizer_trains_and_lowers_the_loss(tmp_path, tiny_model_dir, kind):
    lr = {"muon": 0.02, "adam_w": 0.01, "sgd": 0.5}[kind]
    result = _train(
        tmp_path, tiny_model_dir, f"opt-{kind}", config={"epochs": 4, "optimizer": {"kind": kind}, "learning_rate": lr}
    )
    assert result.status == "success"
    per_epoch = [sum(result.losses[i : i + 3]) / 3 for i in range(0, 12, 3)]
    assert per_epoch[-1] < per_epoch[0], per_epoch
    assert result.receipt["config"]["optimizer"]["kind"] == kind


def test_default_learning_rates_follow_the_optimizer(tmp_path, tiny_model_dir):
    muon = _train(tmp_path, tiny_model_dir, "lr-muon")
    adam = _train(tmp_path, tiny_model_dir, "lr-adam", config={"optimizer": {"kind": "adam_w"}})
    assert muon.receipt["hyperparameters"]["learning_rate"] == 1e-3
    assert adam.receipt["hyperparameters"]["learning_rate"] == 1e-4


def test_integral_optimizer_numbers_give_the_same_effective_config_as_floats():
    from _effective import sft_effective as effective_config

    as_ints = effective_config(
        {"optimizer": {"kind": "adam_w", "weight_decay": 0, "eps": 1, "beta1": 0}, "seed": 1}, "a"
    )
    as_floats = effective_config(
        {"optimizer": {"kind": "adam_w", "weight_decay": 0.0, "eps": 1.0, "beta1": 0.0}, "seed": 1}, "a"
    )
    assert as_ints == as_floats
    assert isinstance(as_ints["optimizer"]["weight_decay"], float)
    muon = effective_config({"optimizer": {"kind": "muon", "ns_iters": 3, "nesterov": False}, "seed": 1}, "a")
    assert muon["optimizer"]["ns_iters"] == 3
    assert muon["optimizer"]["nesterov"] is False


def test_a_non_finite_loss_writes_a_failed_receipt_and_no_adapter(tmp_path, tiny_model_dir, monkeypatch):
    import torch

    import kiln.kernels

    real = kiln.kernels.sft_loss
    monkeypatch.setattr(kiln.kernels, "sft_loss", lambda *a, **k: real(*a, **k) * torch.tensor(float("nan")))
    result = _train(tmp_path, tiny_model_dir, "nan")
    assert result.status == "failed"
    receipt = json.loads(result.receipt_path.read_text())
    assert receipt["failure_reason"] == "nan_loss"
    assert "step 1" in receipt["failure_message"]
    assert contracts.problems("TrainReceipt", receipt) == []
    assert sorted(p.name for p in result.adapter_dir.iterdir()) == ["train_receipt.json"]


def test_bad_rows_under_fail_are_refused_before_training_and_publish_nothing(tmp_path, tiny_model_dir):
    rows = [*CONVERSATIONS, {"messages": [{"role": "robot", "content": "beep"}]}]
    with pytest.raises(RequestError) as info:
        _train(tmp_path, tiny_model_dir, "bad", rows=rows)
    assert "row 4" in info.value.message
    assert "invalid_role" in info.value.message
    assert not (tmp_path / "adapters" / "bad").exists()


def test_an_existing_adapter_name_is_refused_at_admission(tmp_path, tiny_model_dir):
    _train(tmp_path, tiny_model_dir, "taken")
    with pytest.raises(ConflictError) as info:
        _train(tmp_path, tiny_model_dir, "taken")
    assert info.value.code == "adapter_exists"


def test_an_unsafe_lora_scale_is_refused_unless_allowed(tmp_path, tiny_model_dir):
    with pytest.raises(RequestError) as info:
        _train(tmp_path, tiny_model_dir, "scale", config={"lora_rank": 4, "lora_alpha": 16})
    assert "unsafe_lora_scale" in info.value.message
    result = _train(
        tmp_path, tiny_model_dir, "scale", config={"lora_rank": 4, "lora_alpha": 16, "allow_high_lora_scale": True}
    )
    assert result.status == "success"


def test_unknown_config_fields_are_refused_with_a_pointer(tmp_path, tiny_model_dir):
    with pytest.raises(RequestError) as info:
        _train(tmp_path, tiny_model_dir, "knob", config={"max_grad_norm": 1.0})
    assert info.value.pointer == "/max_grad_norm"


def test_the_cli_trains_locally_and_names_the_artifacts(tmp_path, tiny_model_dir, capsys):
    data = _write_jsonl(tmp_path / "data.jsonl", CONVERSATIONS)
    args = ["train", "sft", "--local", "-f", str(data), "--adapter", "cli-bot", "--adapter-dir", str(tmp_path / "reg"),
            "--model", str(tiny_model_dir), "--seed", "3"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"Adapter:  {tmp_path / 'reg' / 'cli-bot'}" in out
    assert "Receipt:" in out
    assert "Manifest:" in out
    assert main(["validate", str(tmp_path / "reg" / "cli-bot" / "train_receipt.json")]) == 0
    assert main(["validate", str(tmp_path / "reg" / "cli-bot" / "adapter_manifest.json")]) == 0
    capsys.readouterr()
    json_args = ["train", "sft", "--local", "-f", str(data), "--adapter", "cli-json", "--adapter-dir",
                 str(tmp_path / "reg"), "--model", str(tiny_model_dir), "--json"]  # fmt: skip
    assert main(json_args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "success"
    assert report["effective_seed"].isdigit()


def test_the_cli_reports_admission_errors_on_stderr(tmp_path, tiny_model_dir, capsys):
    data = _write_jsonl(tmp_path / "data.jsonl", [{"messages": []}])
    code = main(["train", "sft", "--local", "-f", str(data), "--adapter", "x", "--adapter-dir", str(tmp_path / "reg"),
                 "--model", str(tiny_model_dir)])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "training_invalid_request" in err
    assert f'{data} line 1: "messages" is empty' in err  # the file and its line, in words


def test_a_base_adapter_warm_starts_the_lora_weights(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    base = _train(tmp_path, tiny_model_dir, "base", config={"epochs": 2, "learning_rate": 0.02})
    warm = _train(
        tmp_path,
        tiny_model_dir,
        "warm",
        config={"base_adapter": "base", "optimizer": {"kind": "sgd"}, "learning_rate": 1e-9},
    )
    assert warm.status == "success"
    before = load_file(base.adapter_dir / "adapter_model.safetensors")
    after = load_file(warm.adapter_dir / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    for key in before:
        assert (before[key] - after[key]).abs().max() < 1e-6, key
    assert any(float(t.abs().max()) > 0 for k, t in after.items() if "lora_B" in k), "B was copied, not re-initialised"
    assert (
        warm.receipt["adapters"]["base"]["adapter_model_sha256"]
        == base.receipt["adapters"]["output"]["adapter_model_sha256"]
    )
    manifest = json.loads(warm.manifest_path.read_text())
    assert manifest["parent_adapter"] == "base"


def test_a_missing_base_adapter_fails_with_its_category(tmp_path, tiny_model_dir):
    result = _train(tmp_path, tiny_model_dir, "orphan", config={"base_adapter": "nowhere"})
    assert result.status == "failed"
    assert result.receipt["failure_reason"] == "base_adapter_missing"


def test_a_base_adapter_of_another_shape_fails_with_shape_mismatch(tmp_path, tiny_model_dir):
    _train(tmp_path, tiny_model_dir, "rank4", config={"lora_rank": 4, "lora_alpha": 8})
    result = _train(tmp_path, tiny_model_dir, "rank16", config={"base_adapter": "rank4"})
    assert result.status == "failed"
    assert result.receipt["failure_reason"] == "shape_mismatch"
    assert "rank and target modules must match" in result.receipt["failure_message"]


def test_max_seq_len_defaults_to_the_context_length_and_may_not_exceed_it(tmp_path, tiny_model_dir):
    from kiln.model import load_base_model, max_positions

    loaded = load_base_model(tiny_model_dir)
    context = max_positions(loaded.model.config, loaded.tokenizer)
    result = _train(tmp_path, tiny_model_dir, "default-limit")
    receipt = json.loads(result.receipt_path.read_text())
    assert receipt["config"]["max_seq_len"] == context
    assert receipt["data"]["sft_ingestion"]["sequence_limit"]["max_seq_len"] == context
    with pytest.raises(RequestError, match=rf"max_seq_len {context + 1} exceeds the model's context length"):
        _train(tmp_path, tiny_model_dir, "too-long", config={"max_seq_len": context + 1})


def test_truncated_rows_train_and_the_receipt_counts_them(tmp_path, tiny_model_dir):
    result = _train(tmp_path, tiny_model_dir, "cut", config={"max_seq_len": 24, "overlong_row_policy": "truncate"})
    assert result.status == "success"
    receipt = json.loads(result.receipt_path.read_text())
    limit = receipt["data"]["sft_ingestion"]["sequence_limit"]
    assert limit["overlong_row_policy"] == "truncate"
    assert limit["rows_truncated"] + limit["rows_skipped"] == limit["rows_over"] > 0
    assert limit["tokens_truncated"] > 0
    contracts.load("TrainReceipt", result.receipt_path)
    with pytest.raises(RequestError, match=r"over max_seq_len 24"):
        _train(tmp_path, tiny_model_dir, "refused", config={"max_seq_len": 24})
    with pytest.raises(RequestError, match=r"every row was rejected .*over max_seq_len 24") as caught:
        _train(tmp_path, tiny_model_dir, "skipped", config={"max_seq_len": 24, "overlong_row_policy": "skip"})
    assert "overlong_row_policy" in caught.value.hint


def test_the_cli_passes_target_modules_and_sequence_limits(tmp_path, tiny_model_dir, capsys):
    data = _write_jsonl(tmp_path / "rows.jsonl", CONVERSATIONS)
    argv = ["train", "sft", "--local", "-f", str(data), "--adapter", "flags", "--model", str(tiny_model_dir)]
    argv += ["--adapter-dir", str(tmp_path / "adapters"), "--seed", "3", "--lora-target-modules", "q_proj,v_proj"]
    argv += ["--max-seq-len", "40", "--overlong-row-policy", "truncate"]
    assert main(argv) == 0, capsys.readouterr().err
    adapter = tmp_path / "adapters" / "flags"
    receipt = json.loads((adapter / "train_receipt.json").read_text())
    assert receipt["config"]["lora_target_modules"] == ["q_proj", "v_proj"]
    assert receipt["config"]["max_seq_len"] == 40
    assert receipt["config"]["overlong_row_policy"] == "truncate"
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
