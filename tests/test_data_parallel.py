"""Data-parallel SFT over ``torchrun`` ranks (gloo on CPU, the tiny model).

* the sharding rule deals a step's micro-batches to the ranks in turn;
* 2 ranks x micro-batch 2 train what 1 rank x micro-batch 4 trains (fp32 tolerance: losses and LoRA tensors);
* ``kiln train sft --local --nproc-per-node 2`` publishes an adapter whose receipt and manifest validate and record
  the world size;
* cancel (asked by one rank, agreed by all) then resume at world size 2 is byte-identical to an uninterrupted run;
* a world-size-2 checkpoint is refused at world size 1, naming the world size;
* two "nodes" (two torchrun agents meeting at one c10d rendezvous on 127.0.0.1) train the same bytes as one node of
  two ranks.

GRPO and OPD over ranks: ``test_data_parallel_rl.py``.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _server import free_port

from kiln import contracts
from kiln.errors import CheckpointError
from kiln.trainers import TRAINERS, TrainingContext
from kiln.training import DataParallel, backend_for

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "examples" / "sft_corrections.jsonl"  # 12 conversations
DRIVER = Path(__file__).resolve().parent / "_rank_driver.py"
CONFIG = {"seed": 5, "optimizer": {"kind": "adam_w"}, "learning_rate": 1e-3, "lora_rank": 4, "lora_alpha": 8.0}


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update({"KILN_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"})
    return env


def _torchrun(tmp_path: Path, name: str, plan: dict, nproc: int = 2) -> dict:
    """Run the rank driver under torchrun; returns rank 0's summary."""
    plan_path = tmp_path / f"{name}.plan.json"
    result = tmp_path / f"{name}.result.json"
    plan_path.write_text(json.dumps({**plan, "result": str(result)}), encoding="utf-8")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    done = subprocess.run(
        [*argv, str(DRIVER), str(plan_path)], env=_env(tmp_path), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(result.read_text(encoding="utf-8"))


def _plan(tmp_path: Path, model: Path, adapter: str, config: dict, **extra) -> dict:
    request = {"dataset_path": str(DATA), "config": {**CONFIG, **config}}
    return {
        "threads": DataParallel.planned(2).threads,  # the ranks run as an admission in another process planned
        "registry": str(tmp_path / "adapters"),
        "model": str(model),
        "adapter": adapter,
        "request": request,
        **extra,
    }


def _loaded(definition: str, path: Path) -> dict:
    """The document at ``path`` once its strict loader accepts it, as JSON."""
    contracts.load(definition, path)
    return json.loads(path.read_text(encoding="utf-8"))


def _tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


def test_a_step_s_micro_batches_are_dealt_to_the_ranks_in_turn():
    rows = list(range(10))
    assert DataParallel(2, 0, "gloo").micro_batches(rows, 2) == [[0, 1], [4, 5], [8, 9]]
    assert DataParallel(2, 1, "gloo").micro_batches(rows, 2) == [[2, 3], [6, 7]]
    assert DataParallel(3, 2, "gloo").micro_batches([0, 1, 2], 2) == []  # a short last step leaves this rank none
    assert DataParallel().micro_batches(rows, 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert DataParallel().plan() is None
    # the trainers train on the CPU: gloo, also where CUDA is available (nccl would refuse CPU tensors)
    assert DataParallel.planned(2).backend == backend_for("cpu") == "gloo"
    assert backend_for("cuda:0") == "nccl"
    assert DataParallel(2, 0, "gloo").plan() == {
        "world_size": 2,
        "backend": "gloo",
        "sharding": "kiln.sft-step-round-robin.v1",
    }


def test_two_ranks_at_micro_batch_2_train_what_one_rank_at_micro_batch_4_trains(tmp_path, tiny_model_dir):
    from kiln.trainers.sft import admit_sft, run_sft

    two = _torchrun(tmp_path, "two", _plan(tmp_path, tiny_model_dir, "two", {"micro_batch_size": 2, "epochs": 2}))
    job = admit_sft(
        adapter_name="one",
        registry=tmp_path / "adapters",
        config={**CONFIG, "micro_batch_size": 4, "epochs": 2},
        dataset_path=DATA,
        model_path=str(tiny_model_dir),
    )
    one = run_sft(job)
    assert two["status"] == one.status == "success"
    assert len(two["losses"]) == len(one.losses) == 6  # 12 rows at 4 a step, two epochs
    assert two["losses"] == pytest.approx(one.losses, rel=1e-5)
    a, b = _tensors(tmp_path / "adapters" / "two"), _tensors(tmp_path / "adapters" / "one")
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name] - b[name]).abs().max().item() <= 1e-5 * max(1.0, b[name].abs().max().item()), name


def test_cancel_then_resume_at_world_size_2_is_byte_identical_to_an_uninterrupted_run(tmp_path, tiny_model_dir):
    config = {"micro_batch_size": 2, "epochs": 2, "checkpoint_interval": 2}
    whole = _torchrun(tmp_path, "whole", _plan(tmp_path, tiny_model_dir, "whole", config))
    assert whole["status"] == "success"
    assert whole["checkpoints"] == ["whole-checkpoint-step-00000002.kiln-checkpoint",
                                    "whole-checkpoint-step-00000004.kiln-checkpoint"]  # fmt: skip

    # rank 0 alone asks to stop after step 2; the group agrees at step 3's collective and stops there together
    cut = _torchrun(tmp_path, "cut", _plan(tmp_path, tiny_model_dir, "cut", config, cancel_after_step=2))
    assert cut["status"] == "failed"
    assert cut["failure_reason"] == "cancelled"
    assert cut["checkpoints"][-1] == "cut-checkpoint-step-00000003.kiln-checkpoint"
    receipt = _loaded("TrainReceipt", tmp_path / "adapters" / "cut" / "train_receipt.json")
    assert receipt["failure_reason"] == "cancelled"

    resume = {**config, "resume_checkpoint": cut["checkpoints"][-1]}
    # admitted in this process for two ranks (as a server or `kiln train --local` admits), the checkpoint resumes...
    request = {"dataset_path": str(DATA), "config": {**CONFIG, **resume}}
    context = TrainingContext(
        registry=tmp_path / "adapters", model_path=str(tiny_model_dir), data_parallel=DataParallel.planned(2)
    )
    assert TRAINERS["sft"].admit(request, adapter_name="cut", context=context).start_step == 3
    # ...and at world size 1 (and 3) it is refused, naming the world size first
    for world in (1, 3):
        context = TrainingContext(
            registry=tmp_path / "adapters", model_path=str(tiny_model_dir), data_parallel=DataParallel.planned(world)
        )
        with pytest.raises(CheckpointError) as refused:
            TRAINERS["sft"].admit(request, adapter_name="cut", context=context)
        assert refused.value.code == "checkpoint_incompatible"
        assert refused.value.reason == "auxiliary_state.training_runtime_planning_identity.data_parallel.world_size"
        assert f"2 (checkpoint) != {world} (this run)" in refused.value.message

    resumed = _torchrun(tmp_path, "resumed", _plan(tmp_path, tiny_model_dir, "cut", resume))
    assert resumed["status"] == "success"
    assert resumed["losses"] == whole["losses"]
    assert resumed["adapter_sha256"] == whole["adapter_sha256"]
    assert resumed["optimizer_sha256"] == whole["optimizer_sha256"]
    assert resumed["loop_state"] == whole["loop_state"]
    a = (tmp_path / "adapters" / "cut" / "adapter_model.safetensors").read_bytes()
    assert a == (tmp_path / "adapters" / "whole" / "adapter_model.safetensors").read_bytes()


def test_kiln_train_local_on_two_ranks_publishes_an_adapter_that_records_the_world_size(tmp_path, tiny_model_dir):
    registry = tmp_path / "adapters"
    argv = [sys.executable, "-m", "kiln.cli", "train", "sft", "--local", "-f", str(DATA), "--adapter", "pair",
            "--adapter-dir", str(registry), "--model", str(tiny_model_dir), "--seed", "5", "--optimizer", "adam_w",
            "--lr", "1e-3", "--lora-rank", "4", "--lora-alpha", "8", "--micro-batch-size", "2", "--nproc-per-node", "2", "--json"]  # fmt: skip
    done = subprocess.run(argv, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["status"] == "success"
    assert summary["world_size"] == 2
    assert summary["optimizer_steps"] == 3
    plan = {"world_size": 2, "backend": "gloo", "sharding": "kiln.sft-step-round-robin.v1"}
    receipt = _loaded("TrainReceipt", registry / "pair" / "train_receipt.json")
    assert receipt["runtime"]["data_parallel"] == plan
    assert receipt["config"]["micro_batch_size"] == 2
    manifest = _loaded("AdapterManifest", registry / "pair" / "adapter_manifest.json")
    assert manifest["data_parallel"] == plan
    verified = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "adapters", "verify", "pair", "--adapter-dir", str(registry)],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr

    # a two-node run (two torchrun agents, one c10d rendezvous on loopback, one rank each) trains the same bytes
    port = free_port()
    base = [word for word in argv if word != "--json"]
    base[base.index("pair")] = "nodes"
    base = base[: base.index("--nproc-per-node")]
    nodes = []
    for rank in (0, 1):
        flags = ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(rank), "--rdzv-id", "rehearsal"]
        node_argv = [*base, *flags, "--rdzv-endpoint", f"127.0.0.1:{port}", "--json"]
        nodes.append(
            subprocess.Popen(node_argv, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, out[-3000:] + err[-3000:]
    # the c10d rendezvous assigns the global ranks: the node that got rank 0 prints the result, the other says so
    printed = sorted((out for out, _ in outputs), key=lambda out: out.startswith("{"))
    assert "rank 0, on another node, publishes adapter 'nodes'" in printed[0]
    assert json.loads(printed[1])["world_size"] == 2
    assert (registry / "nodes" / "adapter_model.safetensors").read_bytes() == (
        registry / "pair" / "adapter_model.safetensors"
    ).read_bytes()
    nodes_receipt = _loaded("TrainReceipt", registry / "nodes" / "train_receipt.json")
    assert nodes_receipt["runtime"]["data_parallel"] == plan


def test_a_signal_to_kiln_train_local_cancels_every_rank_and_its_resume_command_continues_the_run(
    tmp_path, tiny_model_dir
):
    registry = tmp_path / "adapters"
    argv = [sys.executable, "-m", "kiln.cli", "train", "sft", "--local", "-f", str(DATA), "--adapter", "stop",
            "--adapter-dir", str(registry), "--model", str(tiny_model_dir), "--seed", "5", "--lora-rank", "4",
            "--lora-alpha", "8", "--epochs", "100", "--checkpoint-interval", "25", "--nproc-per-node", "2"]  # fmt: skip
    proc = subprocess.Popen(argv, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # 600 steps; once the first checkpoint is on disk the run is a second or two in, far from its end
        first = registry / "stop-checkpoint-step-00000025.kiln-checkpoint"
        deadline = time.monotonic() + 300
        while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert first.exists(), proc.communicate()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, out + err
    assert "failure_reason cancelled" in err
    receipt = _loaded("TrainReceipt", registry / "stop" / "train_receipt.json")
    assert receipt["failure_reason"] == "cancelled"
    assert receipt["runtime"]["data_parallel"]["world_size"] == 2
    command = err.split("Resume with:\n", 1)[1].strip().splitlines()[0]
    words = shlex.split(command)
    assert words[words.index("--nproc-per-node") + 1] == "2"  # a checkpoint resumes at its world size
    checkpoint = words[words.index("--resume-checkpoint") + 1]
    step = int(checkpoint.split("-step-")[1].split(".")[0])
    assert 25 <= step < 600
    # the printed command, run as printed, finishes the run
    resumed = subprocess.run(
        [sys.executable, "-m", "kiln.cli", *words[1:], "--json"], env=_env(tmp_path), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert json.loads(resumed.stdout)["status"] == "success"
