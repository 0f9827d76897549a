"""Real models on one machine, proven on the tiny model: the precision policy (bf16 base, fp32 LoRA), activation
checkpointing, the memory planner that refuses before any weight loads, and the shard-digest cache.

* bf16 and checkpointing runs resume byte for byte after a cancel (SFT, GRPO, OPD), and the receipt says what ran;
* checkpointing gives the losses and LoRA gradients of the run without it, to fp32 tolerance;
* a resume under another checkpointing setting is refused naming the field; ``auto`` keeps the checkpoint's;
* a ``--local`` run over its memory budget is refused before its weights load, naming the settings that fit;
* a second job on the same model hashes no shard again (counted), and a changed shard is hashed again.
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import pytest
from _runs import admit_kind, assert_same_opd_run, assert_same_run

from kiln.errors import CapacityError, CheckpointError, RequestError
from kiln.trainers.grpo import admit_grpo, run_grpo
from kiln.trainers.opd import admit_opd, run_opd
from kiln.trainers.sft import admit_sft, run_sft

ROWS = [
    {"messages": [{"role": "user", "content": f"Question {i}: how do I do thing {i}?"},
                  {"role": "assistant", "content": f"Open the menu and pick option {i}, then confirm."}]}
    for i in range(5)
]  # fmt: skip
PROMPT = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
GROUP = {
    "messages": PROMPT,
    "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}, {"text": "maybe", "reward": 0.25}],
}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return path


def _sft(registry, data, model, config, *, cancel_at=None, name="bot"):
    job = admit_sft(adapter_name=name, registry=registry, config=config, dataset_path=data, model_path=str(model))
    event = threading.Event()

    def progress(e):
        if cancel_at is not None and e["step"] == cancel_at:
            event.set()

    return run_sft(job, progress=progress, cancel=event, keep_final_state=True)


def _sft_config(**extra):
    return {"epochs": 2, "seed": 7, "checkpoint_interval": 3, "optimizer": {"kind": "adam_w"}, **extra}


# ----------------------------------------------------------------------------- what the receipt says


def test_bf16_trains_a_bf16_base_under_fp32_lora_and_the_receipt_says_so(tmp_path, tiny_model_dir, data_file):
    result = _sft(tmp_path / "reg", data_file, tiny_model_dir, _sft_config(epochs=1, precision="bf16"))
    assert result.status == "success", result.receipt.get("failure_message")
    receipt = result.receipt
    assert receipt["config"]["precision"] == "bf16"
    assert receipt["runtime"]["training_precision"] == {
        "parameter_dtype": "f32",
        "optimizer_state_dtype": "f32",
        "activation_dtype": "bf16",
        "gradient_dtype": "f32",
        "stochastic_rounding": {"mode": "round_to_nearest"},
    }
    assert receipt["runtime"]["execution_provenance"]["precision"]["inference_dtype"] == "bf16"
    plan = receipt["runtime"]["memory_plan"]
    assert plan["precision"] == "bf16"
    assert plan["estimate_bytes"] == sum(plan["components"].values())
    assert plan["budget_source"] in ("host_available_memory", "unknown")
    from safetensors.torch import load_file

    tensors = load_file(result.adapter_dir / "adapter_model.safetensors")
    assert {str(t.dtype) for t in tensors.values()} == {"torch.float32"}


def test_auto_precision_keeps_the_checkpoints_dtype(tmp_path, tiny_model_dir, data_file):
    """The tiny model is stored in float32: auto is fp32. A copy stored in bfloat16 trains in bf16 under auto and is
    upcast only when fp32 is asked for, and the effective configuration says which."""
    import torch
    from safetensors.torch import load_file, save_file

    fp32 = _sft(tmp_path / "a", data_file, tiny_model_dir, _sft_config(epochs=1))
    assert fp32.receipt["config"]["precision"] == "fp32"
    model = tmp_path / "bf16-model"
    shutil.copytree(tiny_model_dir, model)
    shard = model / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(shard).items()}, shard, metadata={"format": "pt"})
    auto = _sft(tmp_path / "b", data_file, model, _sft_config(epochs=1))
    assert auto.status == "success", auto.receipt.get("failure_message")
    assert auto.receipt["config"]["precision"] == "bf16"
    upcast = _sft(tmp_path / "c", data_file, model, _sft_config(epochs=1, precision="fp32"))
    assert upcast.receipt["config"]["precision"] == "fp32"
    assert upcast.receipt["runtime"]["training_precision"]["activation_dtype"] == "f32"


# ----------------------------------------------------------------------------- exact resume


@pytest.mark.parametrize(
    "memory",
    [{"precision": "bf16"}, {"gradient_checkpointing": "on"}, {"precision": "bf16", "gradient_checkpointing": "on"}],
    ids=["bf16", "checkpointing", "bf16-checkpointing"],
)
def test_sft_cancel_then_resume_is_byte_identical(memory, tmp_path, tiny_model_dir, data_file):
    config = _sft_config(**memory)
    whole = _sft(tmp_path / "A", data_file, tiny_model_dir, config)
    assert whole.status == "success", whole.receipt.get("failure_message")
    cut = _sft(tmp_path / "B", data_file, tiny_model_dir, config, cancel_at=4)
    assert cut.cancelled
    resumed = _sft(tmp_path / "B", data_file, tiny_model_dir, {**config, "resume_checkpoint": cut.checkpoints[-1].name})
    assert_same_run(whole, resumed)
    if memory.get("gradient_checkpointing") == "on":
        from kiln.checkpoints import inspect_checkpoint

        manifest = inspect_checkpoint(cut.checkpoints[-1]).manifest
        from kiln.model import open_base_model

        layers = open_base_model(tiny_model_dir).config.num_hidden_layers
        policy = manifest["auxiliary_state"]["training_runtime_planning_identity"]["gradient_checkpoint_policy"]
        assert policy == {"mode": "explicit_segments", "segments": layers}


def test_grpo_bf16_with_checkpointing_resumes_byte_identically(tmp_path, tiny_model_dir):
    cfg = {"seed": 3, "checkpoint_interval": 2, "precision": "bf16", "gradient_checkpointing": "on"}
    request = {"groups": [GROUP] * 5, "config": cfg}

    def admit(req, name):
        return admit_grpo(adapter_name=name, registry=tmp_path / "r", request=req, model_path=str(tiny_model_dir))

    straight = run_grpo(admit(request, "straight"))
    assert straight.status == "success", straight.receipt.get("failure_message")
    assert straight.receipt["config"]["precision"] == "bf16"
    stop = threading.Event()
    cut = run_grpo(admit(request, "cut"), progress=lambda e: stop.set() if e["step"] == 3 else None, cancel=stop)
    assert cut.cancelled
    resumed = run_grpo(admit({**request, "config": {**cfg, "resume_checkpoint": cut.checkpoints[-1].name}}, "cut"))
    assert resumed.status == "success", resumed.receipt.get("failure_message")
    assert resumed.losses == straight.losses
    assert (resumed.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        straight.adapter_dir / "adapter_model.safetensors"
    ).read_bytes()
    assert resumed.receipt["grpo"]["policy_audit"] == straight.receipt["grpo"]["policy_audit"]


def test_opd_bf16_with_checkpointing_resumes_byte_identically(tmp_path, tiny_model_dir, teachers):
    config = {
        "seed": 11,
        "samples_per_prompt": 2,
        "max_tokens": 8,
        "top_k": 16,
        "learning_rate": 0.01,
        "optimizer": {"kind": "adam_w"},
        "epochs": 1,
        "checkpoint_interval": 2,
        "precision": "bf16",
        "gradient_checkpointing": "on",
    }
    prompts = [{"messages": [{"role": "user", "content": f"Tell me about {t}."}]} for t in ("cats", "rain")]

    def admit(where, extra=None):
        request = {"teacher": "tutor", "prompts": prompts, "config": {**config, **(extra or {})}}
        return admit_opd(
            adapter_name="student",
            registry=where,
            request=request,
            teachers_root=teachers,
            model_path=str(tiny_model_dir),
        )

    whole = run_opd(admit(tmp_path / "a"))
    assert whole.status == "success", whole.receipt.get("failure_message")
    cancel = threading.Event()
    first = run_opd(admit(tmp_path / "b"), progress=lambda e: cancel.set() if e["step"] == 3 else None, cancel=cancel)
    assert first.cancelled
    resumed = run_opd(admit(tmp_path / "b", {"resume_checkpoint": first.checkpoints[-1].name}))
    assert_same_opd_run(whole, resumed)


def test_a_resume_under_another_checkpointing_setting_is_refused_and_auto_keeps_the_checkpoints(
    tmp_path, tiny_model_dir, data_file
):
    config = _sft_config(gradient_checkpointing="on")
    cut = _sft(tmp_path / "B", data_file, tiny_model_dir, config, cancel_at=4)
    name = cut.checkpoints[-1].name
    with pytest.raises(CheckpointError) as info:
        admit_sft(
            adapter_name="bot",
            registry=tmp_path / "B",
            config={**config, "gradient_checkpointing": "off", "resume_checkpoint": name},
            dataset_path=data_file,
            model_path=str(tiny_model_dir),
        )
    assert info.value.code == "checkpoint_incompatible"
    assert "effective_config.gradient_checkpointing" in info.value.message
    job = admit_sft(
        adapter_name="bot",
        registry=tmp_path / "B",
        config={**config, "gradient_checkpointing": "auto", "resume_checkpoint": name},
        dataset_path=data_file,
        model_path=str(tiny_model_dir),
    )
    assert job.config.gradient_checkpointing == "on"


# ----------------------------------------------------------------------------- same numbers


def _first_step(tiny_model_dir, registry, **memory):
    """Loss, per-module LoRA gradient norms and the adapter after one SGD step."""
    from safetensors.torch import load_file

    config = {"epochs": 1, "seed": 5, "optimizer": {"kind": "sgd"}, "learning_rate": 0.05, **memory}
    job = admit_sft(
        adapter_name="one", registry=registry, config=config, examples=ROWS[:1], model_path=str(tiny_model_dir)
    )
    result = run_sft(job)
    assert result.status == "success", result.receipt.get("failure_message")
    grads = {g["module"]: g for g in result.receipt["lora_grad_norms"]}
    return result.losses, grads, load_file(result.adapter_dir / "adapter_model.safetensors")


def test_checkpointing_gives_the_losses_and_gradients_of_the_run_without_it(tmp_path, tiny_model_dir):
    import torch

    loss_off, grads_off, adapter_off = _first_step(tiny_model_dir, tmp_path / "off")
    loss_on, grads_on, adapter_on = _first_step(tiny_model_dir, tmp_path / "on", gradient_checkpointing="on")
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert grads_on.keys() == grads_off.keys()
    for module, entry in grads_off.items():
        for key, value in entry.items():
            if isinstance(value, float):
                assert grads_on[module][key] == pytest.approx(value, rel=1e-5, abs=1e-9), (module, key)
    assert adapter_on.keys() == adapter_off.keys()
    for name, tensor in adapter_off.items():
        torch.testing.assert_close(adapter_on[name], tensor, rtol=1e-5, atol=1e-7)
    moved = [name for name, tensor in adapter_off.items() if ".lora_B." in name and tensor.abs().max() > 0]
    assert moved, "the step changed no LoRA B matrix: the comparison would prove nothing"


# ----------------------------------------------------------------------------- the planner


def _plan_bounds(tmp_path, tiny_model_dir, data_file):
    """The estimates of this run with checkpointing off and on (from an unbounded admission)."""
    job = admit_sft(
        adapter_name="probe",
        registry=tmp_path / "probe",
        config=_sft_config(epochs=1, precision="fp32", gradient_checkpointing="off"),
        dataset_path=data_file,
        model_path=str(tiny_model_dir),
    )
    plan = job.memory_plan
    return plan.estimate_bytes, plan.variant(gradient_checkpointing="on").estimate_bytes


def test_local_run_over_budget_is_refused_before_loading_naming_what_fits(
    tmp_path, tiny_model_dir, data_file, monkeypatch, capsys
):
    from kiln.cli import main

    off, on = _plan_bounds(tmp_path, tiny_model_dir, data_file)
    assert on < off
    limit = (on + off) // 2
    monkeypatch.setenv("KILN_TRAINING_MEMORY_LIMIT_BYTES", str(limit))

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded for a run the planner refuses")

    monkeypatch.setattr("kiln.model._loader.load_weights", no_weights)
    monkeypatch.setattr("kiln.model.load_weights", no_weights)
    argv = ["train", "sft", "--local", "-f", str(data_file), "--adapter", "big", "--model", str(tiny_model_dir)]
    # the run _plan_bounds planned: the optimizer's slots are part of the estimate
    code = main([*argv, "--optimizer", "adam_w", "--gradient-checkpointing", "off", "--precision", "fp32"])
    err = capsys.readouterr().err
    assert code != 0
    assert "memory_budget_exceeded" in err
    assert "training.memory_limit_bytes" in err
    assert "gradient_checkpointing on" in err
    assert not (tmp_path / "kiln-home" / "adapters" / "big").exists()


def test_auto_checkpointing_turns_on_exactly_when_the_run_needs_it(tmp_path, tiny_model_dir, data_file):
    from kiln.trainers import TRAINERS, TrainingContext
    from kiln.training import MemorySettings

    off, on = _plan_bounds(tmp_path, tiny_model_dir, data_file)
    request = {"dataset_path": str(data_file), "config": _sft_config(epochs=1, precision="fp32")}

    def admit(name, limit):
        context = TrainingContext(
            registry=tmp_path / name, model_path=str(tiny_model_dir), memory=MemorySettings(memory_limit_bytes=limit)
        )
        return TRAINERS["sft"].admit(request, adapter_name=name, context=context)

    for limit, expected in ((off + 1, "off"), ((on + off) // 2, "on")):
        admitted = admit(f"auto-{expected}", limit)
        assert admitted.config.gradient_checkpointing == expected
        assert admitted.memory_plan.budget.source == "configured_limit"
        assert admitted.memory_plan.record()["budget_bytes"] == limit
    with pytest.raises(CapacityError) as info:
        admit("never", on // 2)
    assert info.value.code == "memory_budget_exceeded"


def test_grad_checkpoint_segments_must_be_the_layer_count(tmp_path, tiny_model_dir, data_file):
    with pytest.raises(RequestError) as info:
        admit_sft(
            adapter_name="seg",
            registry=tmp_path,
            config=_sft_config(epochs=1, grad_checkpoint_segments=7),
            dataset_path=data_file,
            model_path=str(tiny_model_dir),
        )
    assert info.value.pointer == "/config/grad_checkpoint_segments"


# ----------------------------------------------------------------------------- the digest cache


def _count_hashing(monkeypatch):
    from kiln.host import digest_cache

    calls = []
    real = digest_cache.file_sha256

    def counting(path):
        calls.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(digest_cache, "file_sha256", counting)
    return calls


def _settled_copy(tiny_model_dir, target):
    shutil.copytree(tiny_model_dir, target)
    old = 1_600_000_000
    for path in target.iterdir():
        os.utime(path, (old, old))  # written long ago: outside the racy window
    return target


def test_a_second_job_on_the_same_model_hashes_no_shard(tmp_path, tiny_model_dir, data_file, monkeypatch):
    model = _settled_copy(tiny_model_dir, tmp_path / "model")
    calls = _count_hashing(monkeypatch)
    first = admit_sft(adapter_name="one", registry=tmp_path / "r", config=_sft_config(), dataset_path=data_file,
                      model_path=str(model))  # fmt: skip
    assert calls.count("model.safetensors") == 1
    second = admit_sft(adapter_name="two", registry=tmp_path / "r", config=_sft_config(), dataset_path=data_file,
                       model_path=str(model))  # fmt: skip
    assert calls.count("model.safetensors") == 1  # no rehash
    assert second.identity.base_weight_shard_manifest == first.identity.base_weight_shard_manifest

    monkeypatch.setenv("KILN_REHASH", "1")
    admit_sft(adapter_name="three", registry=tmp_path / "r", config=_sft_config(), dataset_path=data_file,
              model_path=str(model))  # fmt: skip
    assert calls.count("model.safetensors") == 2  # forced


def test_a_changed_shard_is_hashed_again_even_with_its_old_time(tmp_path, tiny_model_dir):
    from kiln.artifacts.base_weights import build_base_weight_manifest
    from kiln.host.digest_cache import digest_cache_dir

    model = _settled_copy(tiny_model_dir, tmp_path / "model")
    cache = digest_cache_dir(tmp_path / "home")
    before = build_base_weight_manifest(model, cache_dir=cache)
    assert list(cache.iterdir())
    shard = model / "model.safetensors"
    stat = shard.stat()
    blob = bytearray(shard.read_bytes())
    blob[-3] ^= 0x01
    shard.write_bytes(bytes(blob))
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same size, same mtime: only ctime tells
    after = build_base_weight_manifest(model, cache_dir=cache)
    assert after["aggregate_sha256"] != before["aggregate_sha256"]
    assert after == build_base_weight_manifest(model)  # what an uncached hash says


def test_a_freshly_written_shard_is_not_cached(tmp_path, tiny_model_dir):
    from kiln.artifacts.base_weights import build_base_weight_manifest
    from kiln.host.digest_cache import digest_cache_dir

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    os.utime(model / "model.safetensors")  # modified just now: racily clean, never cached
    cache = digest_cache_dir(tmp_path / "home")
    build_base_weight_manifest(model, cache_dir=cache)
    assert not cache.exists() or not list(cache.iterdir())


# ----------------------------------------------------------------------------- QLoRA


def test_nf4_quantizes_the_base_trains_fp32_lora_and_resumes_byte_identically(tmp_path, tiny_model_dir, data_file):
    config = _sft_config(quantization="nf4")
    job = admit_sft(adapter_name="bot", registry=tmp_path / "A", config=config, dataset_path=data_file,
                    model_path=str(tiny_model_dir))  # fmt: skip
    kinds = {type(m).__name__ for m in job.loaded.model.modules()}
    assert "Linear4bit" in kinds
    assert job.memory_plan.run.quantization == "nf4"
    whole = run_sft(job, keep_final_state=True)
    assert whole.status == "success", whole.receipt.get("failure_message")
    assert whole.receipt["config"]["quantization"] == "nf4"
    assert whole.receipt["runtime"]["memory_plan"]["quantization"] == "nf4"
    cut = _sft(tmp_path / "B", data_file, tiny_model_dir, config, cancel_at=4)
    assert cut.cancelled
    with pytest.raises(CheckpointError) as info:  # the quantization is bound: a resume without it is refused
        admit_sft(adapter_name="bot", registry=tmp_path / "B", dataset_path=data_file, model_path=str(tiny_model_dir),
                  config={**config, "quantization": "none", "resume_checkpoint": cut.checkpoints[-1].name})  # fmt: skip
    assert "effective_config.quantization" in info.value.message
    resumed = _sft(tmp_path / "B", data_file, tiny_model_dir, {**config, "resume_checkpoint": cut.checkpoints[-1].name})
    assert_same_run(whole, resumed)


def test_nf4_without_bitsandbytes_is_refused_before_loading(tmp_path, tiny_model_dir, data_file, monkeypatch):
    from importlib import metadata

    real = metadata.version

    def missing(name):
        if name == "bitsandbytes":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(RequestError) as info:
        admit_sft(adapter_name="q", registry=tmp_path, config=_sft_config(quantization="nf4"), dataset_path=data_file,
                  model_path=str(tiny_model_dir))  # fmt: skip
    assert info.value.code == "training_backend_unsupported"
    assert info.value.pointer == "/config/quantization"
    assert "bitsandbytes" in info.value.message


# ----------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("kind", ["sft", "grpo", "opd"])
def test_every_kind_takes_the_memory_flags_and_its_resume_command_carries_them(kind, tmp_path):
    import shlex

    from kiln import contracts
    from kiln.cli import build_parser
    from kiln.cli._requests import build_request, resume_command, training_config

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n", encoding="utf-8")
    flags = ["--precision", "bf16", "--gradient-checkpointing", "on", "--quantization", "nf4"]
    teacher = ["--teacher", "tutor"] if kind == "opd" else []
    argv = ["train", kind, "--local", "-f", str(data), "--adapter", "bot", *teacher, *flags]
    args = build_parser().parse_args(argv)
    config = training_config(args)
    assert (config["precision"], config["gradient_checkpointing"], config["quantization"]) == ("bf16", "on", "nf4")
    if kind == "sft":
        assert contracts.problems("SftConfig", build_request(args, data)["config"]) == []
    resume = shlex.split(resume_command(args, "bot-checkpoint-step-00000001.kiln-checkpoint", None))
    again = build_parser().parse_args(resume[1:])
    assert {k: training_config(again)[k] for k in ("precision", "gradient_checkpointing", "quantization")} == {
        "precision": "bf16",
        "gradient_checkpointing": "on",
        "quantization": "nf4",
    }


def test_the_planner_reads_the_weights_the_model_loads_from_the_headers_alone(tiny_model_dir):
    from kiln.model import load_weights, open_base_model
    from kiln.training import ModelShape, target_modules

    opened = open_base_model(tiny_model_dir)
    assert opened.model is None
    shape = ModelShape.of(opened.config, opened.weights)
    loaded = load_weights(opened)
    model = loaded.model
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert shape.stored_bytes == (tiny_model_dir / "model.safetensors").stat().st_size - _header_bytes(tiny_model_dir)
    layers = model.config.num_hidden_layers
    for leaf in target_modules(model):
        assert shape.projections[leaf][1] == layers, leaf
        module = next(m for name, m in model.named_modules() if ".layers.0." in name and name.endswith(f".{leaf}"))
        assert shape.projections[leaf][0] == layers * (module.in_features + module.out_features), leaf


def _header_bytes(model_dir):
    import struct

    with (model_dir / "model.safetensors").open("rb") as handle:
        return 8 + struct.unpack("<Q", handle.read(8))[0]


@pytest.mark.parametrize("kind", ["sft", "grpo", "opd"])
def test_every_kind_takes_the_servers_memory_defaults_when_its_config_has_none(
    kind, tmp_path, tiny_model_dir, teachers
):
    # the server's training.precision / gradient_checkpointing apply to a job that sets neither (OPD ignored them)
    from kiln.training import MemorySettings

    job = admit_kind(
        kind, tmp_path, tiny_model_dir, teachers, ROWS, MemorySettings(precision="bf16", gradient_checkpointing="on")
    )
    assert job.config.precision == "bf16"
    assert job.config.gradient_checkpointing == "on"
    assert job.precision["activation_dtype"] == "bf16"  # the identity says what trains
