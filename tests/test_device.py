"""The device setting and what a CUDA run records, on a CPU-only torch.

``device`` (``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``) resolves to a concrete device or is refused with what the
machine has; ``--device cuda`` here is refused at admission without a traceback, a malformed one by the parser
before torch loads. The CUDA determinism settings are applied only for a CUDA device and recorded as they are; the
execution envelope exists only on CUDA. The CUDA generator's state is captured and restored only on CUDA (every
``torch.cuda`` call guarded), so a CPU checkpoint has no such stream or file. A checkpoint written inside one
execution envelope is refused at resume outside it, naming the member that differs.

Where a test needs CUDA's answers it fakes ``torch.cuda``'s functions: what runs is Kiln's own code path, and the
GPU qualification (``scripts/qualify-gpu``) is where the real device answers.
"""

from __future__ import annotations

import json
import os
import threading
import types

import pytest
import torch
from _probe import cli_probe
from _runs import admit_kind
from kiln_contracts.models.kiln_checkpoint_v1_schema import CheckpointExecutionEnvelope, CheckpointRngState

from kiln import contracts
from kiln.checkpoints import list_checkpoints, load_checkpoint
from kiln.errors import CheckpointError, RequestError
from kiln.model import apply_determinism, determinism_settings, execution_envelope, resolve_device, runtime_device
from kiln.trainers.sft import admit_sft, run_sft
from kiln.training import (
    CUDA_RNG_FILE,
    CUDA_RNG_STREAM,
    cuda_rng_capture,
    cuda_rng_position,
    cuda_rng_restore,
    cuda_rng_stream,
    encode_tensors,
)

ROWS = [
    {"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]}
    for i in range(4)
]


# what apply_determinism("cuda...") switches on, as the envelope records it
CUDA_DETERMINISM = {
    "deterministic_algorithms": True,
    "cublas_workspace_config": ":4096:8",
    "cudnn_deterministic": True,
    "cudnn_benchmark": False,
    "tf32_matmul": False,
    "tf32_cudnn": False,
    "bf16_reduced_precision_reduction": False,
    "fp16_reduced_precision_reduction": False,
    "float32_matmul_precision": "highest",
}


def _fake_cuda(monkeypatch, count=2):
    """``torch.cuda`` answering as a machine with ``count`` devices would (nothing is computed on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


# ----------------------------------------------------------------------------- resolution


def test_cpu_and_auto_resolve_to_the_cpu_on_a_machine_without_cuda():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == "cpu"
    assert runtime_device("cpu") == "cpu"


@pytest.mark.parametrize("setting", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_on_a_machine_without_it_is_refused_saying_why(setting):
    with pytest.raises(RequestError) as caught:
        resolve_device(setting)
    error = caught.value
    assert error.code == "training_backend_unsupported"
    assert error.pointer == "/config/device"
    assert error.message.startswith(f"device: {setting} needs a CUDA device, and this machine has none (")
    assert "CPU-only build" in error.message  # this torch is 2.13.0+cpu
    assert "--device cpu" in (error.hint or "")


def test_a_malformed_device_is_refused_as_an_invalid_request():
    with pytest.raises(RequestError) as caught:
        resolve_device("gpu0")
    assert caught.value.code == "training_invalid_request"
    assert "auto, cpu, cuda or cuda:N" in caught.value.message


def test_cuda_settings_resolve_against_the_devices_the_machine_has(monkeypatch):
    _fake_cuda(monkeypatch, count=2)
    assert resolve_device("auto") == "cuda:0"
    assert resolve_device("cuda") == "cuda:0"
    assert resolve_device("cuda:1") == "cuda:1"
    assert runtime_device("cuda:1") == "cuda"
    with pytest.raises(RequestError) as caught:
        resolve_device("cuda:2", field="model.device", pointer=None)
    assert (
        caught.value.message
        == "model.device: cuda:2 is not a CUDA device of this machine, which has 2 (cuda:0, cuda:1)"
    )
    assert caught.value.code == "training_backend_unsupported"


def test_a_request_for_cuda_is_refused_at_admission_before_any_weight_loads(tmp_path, tiny_model_dir, monkeypatch):
    import kiln.model._loader as loader

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded for a job that cannot run")

    monkeypatch.setattr(loader, "load_weights", no_weights)
    with pytest.raises(RequestError) as caught:
        admit_sft(
            adapter_name="bot",
            registry=tmp_path / "adapters",
            config={"device": "cuda:0"},
            examples=ROWS,
            model_path=str(tiny_model_dir),
        )
    assert caught.value.code == "training_backend_unsupported"
    assert caught.value.pointer == "/config/device"


def test_a_device_outside_the_contract_is_refused_by_the_schema(tmp_path, tiny_model_dir):
    problems = contracts.problems("SftConfig", {"device": "tpu"})
    assert [p.pointer for p in problems] == ["/device"]


def test_kiln_train_device_cuda_is_refused_with_a_clear_message_and_no_traceback(tmp_path, tiny_model_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    argv = [
        "train",
        "sft",
        "-f",
        str(data),
        "--local",
        "--adapter",
        "bot",
        "--model",
        str(tiny_model_dir),
        "--device",
        "cuda",
    ]
    outcome, _rc, stderr = cli_probe(tmp_path, argv)
    assert outcome is not None
    assert outcome["code"] != 0
    assert "training_backend_unsupported" in stderr
    assert "--device: cuda needs a CUDA device, and this machine has none" in stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "home" / "adapters" / "bot").exists()


def test_a_malformed_device_flag_is_refused_before_torch_loads(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n", encoding="utf-8")
    outcome, rc, stderr = cli_probe(
        tmp_path, ["train", "sft", "-f", str(data), "--local", "--adapter", "bot", "--device", "gpu"]
    )
    assert outcome is None  # argparse's usage error: no line of JSON
    assert rc == 2
    assert "'gpu' is not a device; use auto, cpu, cuda or cuda:N" in stderr
    assert "Traceback" not in stderr


# ----------------------------------------------------------------------------- determinism and envelope


CUDA_FLAGS = [
    (torch.backends.cuda.matmul, "allow_tf32"),
    (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
    (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    (torch.backends.cudnn, "allow_tf32"),
    (torch.backends.cudnn, "deterministic"),
    (torch.backends.cudnn, "benchmark"),
]


@pytest.fixture
def cuda_flags(monkeypatch):
    """Put the process-wide CUDA flags and CUBLAS_WORKSPACE_CONFIG back as they were."""
    saved = [getattr(owner, name) for owner, name in CUDA_FLAGS]
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))  # restored after
    yield
    for (owner, name), value in zip(CUDA_FLAGS, saved, strict=True):
        setattr(owner, name, value)


def test_on_the_cpu_only_deterministic_algorithms_are_switched_on(cuda_flags, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = determinism_settings()
    record = apply_determinism("cpu")
    assert record["deterministic_algorithms"] is True
    assert {k: v for k, v in record.items() if k != "deterministic_algorithms"} == {
        k: v for k, v in before.items() if k != "deterministic_algorithms"
    }
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    assert execution_envelope("cpu") is None


def test_for_cuda_the_determinism_settings_are_applied_and_recorded(cuda_flags, monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert apply_determinism("cuda:0") == CUDA_DETERMINISM
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own value is kept, and recorded
    assert apply_determinism("cuda")["cublas_workspace_config"] == ":16:8"


def _fake_properties(monkeypatch, *, sms=132, name="NVIDIA H100 80GB HBM3"):
    props = types.SimpleNamespace(name=name, major=9, minor=0, multi_processor_count=sms, total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)


def test_the_execution_envelope_of_a_cuda_run_is_a_valid_record(cuda_flags, monkeypatch):
    _fake_properties(monkeypatch)
    apply_determinism("cuda:0")
    envelope = execution_envelope("cuda:0")
    assert envelope["device_name"] == "NVIDIA H100 80GB HBM3"
    assert envelope["compute_capability"] == "9.0"
    assert envelope["sm_count"] == 132
    assert envelope["torch_version"] == torch.__version__
    assert envelope["determinism"]["tf32_matmul"] is False
    CheckpointExecutionEnvelope.model_validate(envelope)  # the generated model of the schema's definition


# ----------------------------------------------------------------------------- the CUDA generator's state


def test_nothing_of_cuda_is_captured_or_restored_on_the_cpu(monkeypatch):
    def touched(*args, **kwargs):
        raise AssertionError("a torch.cuda call on the CPU path")

    for name in ("get_rng_state", "set_rng_state", "initial_seed", "get_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, touched)
    assert cuda_rng_stream("cpu") is None
    assert cuda_rng_capture("cpu") == {}
    assert cuda_rng_restore("cpu", {"epoch-order": {}}, {}) is False


def test_the_cuda_generator_state_round_trips_through_a_checkpoint_file(monkeypatch):
    state = torch.tensor(list((7).to_bytes(8, "little") + (4096).to_bytes(8, "little")), dtype=torch.uint8)
    restored = {}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda index: state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda value, index: restored.update(state=value, index=index))
    monkeypatch.setattr(torch.cuda, "initial_seed", lambda: 7)

    class NoDevice:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "device", NoDevice)
    stream = cuda_rng_stream("cuda:1")
    assert stream == {
        "algorithm": "kiln.torch-cuda-global-state.v1",
        "seed": 7,
        "position": 0,
        "state_file": CUDA_RNG_FILE,
    }
    CheckpointRngState.model_validate(stream)
    captured = cuda_rng_capture("cuda:1")
    role, tensors = captured[CUDA_RNG_FILE]
    assert role == "rng-state"
    assert cuda_rng_position(tensors["state"]) == 4096
    blobs = {CUDA_RNG_FILE: encode_tensors(tensors)}
    assert cuda_rng_restore("cuda:1", {CUDA_RNG_STREAM: stream}, blobs) is True
    assert restored["index"] == 1
    assert torch.equal(restored["state"], state)


def test_a_cpu_checkpoint_has_exactly_the_trainers_streams_and_files(tmp_path, tiny_model_dir):
    job = admit_sft(
        adapter_name="bot",
        registry=tmp_path / "adapters",
        config={"seed": 3, "checkpoint_interval": 1},
        examples=ROWS[:2],
        model_path=str(tiny_model_dir),
    )
    run_sft(job)
    checkpoints = [c.path for c in list_checkpoints(tmp_path / "adapters", "bot")]
    manifest = load_checkpoint(checkpoints[0]).manifest
    assert sorted(manifest["rng_states"]) == ["epoch-order", "lora-init"]
    assert "execution_envelope" not in manifest["auxiliary_state"]["backend_runtime"]
    assert manifest["auxiliary_state"]["training_runtime_planning_identity"]["runtime_device"] == "cpu"
    assert not (checkpoints[0] / CUDA_RNG_FILE).exists()


# ----------------------------------------------------------------------------- the envelope binds a resume


def _envelope(**changes):
    record = {
        "device_name": "NVIDIA H100 80GB HBM3",
        "compute_capability": "9.0",
        "sm_count": 132,
        "torch_version": "2.13.0+cu130",
        "cuda_version": "13.0",
        "cudnn_version": 91500,
        "triton_version": "3.8.0",
        "determinism": dict(CUDA_DETERMINISM),
    }
    for key, value in changes.items():
        if key in record["determinism"]:
            record["determinism"][key] = value
        else:
            record[key] = value
    return record


def _run_in(envelope, monkeypatch, tmp_path, model, config, *, cancel_at=None):
    import kiln.trainers._checkpointing as checkpointing

    monkeypatch.setattr(checkpointing, "execution_envelope", lambda device: envelope)
    job = admit_sft(
        adapter_name="bot", registry=tmp_path / "adapters", config=config, examples=ROWS, model_path=str(model)
    )
    event = threading.Event()

    def progress(info):
        if cancel_at is not None and info["step"] == cancel_at:
            event.set()

    return run_sft(job, progress=progress, cancel=event)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"sm_count": 114}, "sm_count"),
        ({"device_name": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}, "compute_capability"),
        ({"cudnn_version": 91400}, "cudnn_version"),
        ({"tf32_matmul": True}, "determinism.tf32_matmul"),
    ],
)
def test_a_resume_outside_the_checkpoints_envelope_is_refused_naming_the_member(
    change, field, tmp_path, tiny_model_dir, monkeypatch
):
    config = {"seed": 5, "checkpoint_interval": 1}
    _run_in(_envelope(), monkeypatch, tmp_path, tiny_model_dir, config, cancel_at=2)
    checkpoint = list_checkpoints(tmp_path / "adapters", "bot")[-1].path
    written = load_checkpoint(checkpoint).manifest  # the strict loader accepts the envelope
    assert written["auxiliary_state"]["backend_runtime"]["execution_envelope"] == _envelope()
    with pytest.raises(CheckpointError) as caught:
        _run_in(
            _envelope(**change), monkeypatch, tmp_path, tiny_model_dir, {**config, "resume_checkpoint": checkpoint.name}
        )
    assert caught.value.reason == f"auxiliary_state.backend_runtime.execution_envelope.{field}"
    assert caught.value.code == "checkpoint_incompatible"
    resumed = _run_in(
        _envelope(), monkeypatch, tmp_path, tiny_model_dir, {**config, "resume_checkpoint": checkpoint.name}
    )
    assert resumed.status == "success"


def test_a_cuda_checkpoint_is_refused_on_the_cpu(tmp_path, tiny_model_dir, monkeypatch):
    config = {"seed": 5, "checkpoint_interval": 1}
    _run_in(_envelope(), monkeypatch, tmp_path, tiny_model_dir, config, cancel_at=1)
    checkpoint = list_checkpoints(tmp_path / "adapters", "bot")[-1].path
    with pytest.raises(CheckpointError) as caught:
        _run_in(None, monkeypatch, tmp_path, tiny_model_dir, {**config, "resume_checkpoint": checkpoint.name})
    assert caught.value.reason == "auxiliary_state.backend_runtime.execution_envelope"


@pytest.mark.parametrize("kind", ["sft", "grpo", "opd"])
def test_every_kind_refuses_a_server_default_device_this_machine_lacks(kind, tmp_path, tiny_model_dir, teachers):
    from kiln.training import MemorySettings

    with pytest.raises(RequestError) as caught:  # the server's training.device
        admit_kind(kind, tmp_path, tiny_model_dir, teachers, ROWS, MemorySettings(device="cuda:1"))
    assert caught.value.code == "training_backend_unsupported"
    assert caught.value.message.startswith("device: cuda:1 needs a CUDA device")


def test_sft_selects_its_loss_route_for_the_jobs_device(tmp_path, tiny_model_dir, monkeypatch):
    import kiln.kernels as kernels

    seen = []
    real = kernels.choose_loss_route

    def spy(device, dtype, **kwargs):
        seen.append(str(device))
        return real(device, dtype, **kwargs)

    monkeypatch.setattr(kernels, "choose_loss_route", spy)
    job = admit_sft(
        adapter_name="bot",
        registry=tmp_path / "adapters",
        config={"device": "cpu"},
        examples=ROWS,
        model_path=str(tiny_model_dir),
    )
    assert seen == ["cpu"]
    assert job.route == "fused_chunked_linear_ce"


def test_a_loss_route_this_device_cannot_run_fails_before_the_first_step(tmp_path, tiny_model_dir, monkeypatch):
    import kiln.kernels as kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    forged = kernels.LossRouteChoice(kernels.TRITON_FUSED_LINEAR_CE, 8)
    monkeypatch.setattr(kernels, "choose_loss_route", lambda *args, **kwargs: forged)
    job = admit_sft(
        adapter_name="bot", registry=tmp_path / "adapters", config={}, examples=ROWS, model_path=str(tiny_model_dir)
    )
    steps = []
    result = run_sft(job, progress=steps.append)
    assert result.status == "failed"
    assert steps == []  # nothing trained
    receipt = json.loads((result.adapter_dir / "train_receipt.json").read_text())
    assert receipt["failure_message"].startswith("RequestError: loss route: the triton_fused_linear_ce loss route")
    assert "not on device cpu" in receipt["failure_message"]


def test_a_device_runs_planning_identity_records_the_devices_memory():
    from kiln.training import planning_identity

    assert planning_identity(device="cpu")["effective_memory"]["source"] == "host_physical_memory"
    on_card = planning_identity(device="cuda", device_bytes=80 * 2**30)
    assert on_card["runtime_device"] == "cuda"
    assert on_card["effective_memory"] == {"total_bytes": 80 * 2**30, "source": "device_reported"}


@pytest.mark.parametrize(
    ("setting", "backend", "placed"), [("cuda", "nccl", 1), ("auto", "nccl", 1), ("cpu", "gloo", None)]
)
def test_a_cuda_rank_takes_its_local_device_and_sums_over_nccl(setting, backend, placed, monkeypatch):
    import torch.distributed as dist

    from kiln.training import DataParallel

    _fake_cuda(monkeypatch, count=2)
    chosen, joined = [], []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: joined.append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    threads = torch.get_num_threads()
    try:
        group = DataParallel.from_environment(
            threads=threads, environ={"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}, device=setting
        )
    finally:
        torch.set_num_threads(threads)
    assert group.backend == backend
    assert joined == [backend]
    assert chosen == ([] if placed is None else [placed])
