"""Data-parallel GRPO and OPD over ``torchrun`` ranks (gloo on CPU, the tiny model).

* the rules as pure functions: GRPO's ``token_level`` groups split into contiguous blocks whose weights add up to
  the single-process weights, ``per_sample`` shares dealt in turn; OPD's micro-batches dealt in turn; the gather of
  one process is its own payload;
* one ``torchrun`` launch of two ranks trains, in turn: GRPO (``token_level``, accumulation, batched forwards, EMA
  reference, ECHO) whole, cancelled and resumed; GRPO ``per_sample`` whole; OPD (micro-batches, accumulation, ECHO)
  whole, cancelled and resumed. Against it:
  - 2 ranks train what 1 rank trains (fp32 tolerance: losses, LoRA tensors, the receipts' audits and diagnostics);
  - cancel (asked by rank 0 alone, agreed by both) then resume at world size 2 is byte-identical to an uninterrupted
    world-size-2 run; the world-size-2 checkpoint resumes for 2 ranks and is refused at 1 and 3, naming the world
    size;
* ``kiln train grpo --local --nproc-per-node 2`` publishes an adapter whose receipt and manifest record the plan.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from kiln import contracts
from kiln.errors import CheckpointError
from kiln.trainers import TRAINERS, TrainingContext
from kiln.trainers.grpo import rank_shares, step_plan, step_weights
from kiln.training import GRPO_SHARDING_RULE, OPD_SHARDING_RULE, DataParallel, StepSync

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).resolve().parent / "_rank_driver.py"

GROUPS = [
    {
        "messages": [{"role": "user", "content": "Is the sky blue? Answer yes or no."}],
        "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}, {"text": "maybe", "reward": 0.25}],
    },
    {
        "messages": [{"role": "user", "content": "Name a colour."}],
        "completions": [
            {"text": "Blue, like the sky on a clear summer day.", "reward": 1.0},
            {"text": "red", "reward": 0.0},
            {"text": "A deep and quiet green, I think.", "reward": 0.5},
        ],
    },
    {
        "messages": [{"role": "user", "content": "Is it raining?"}],
        "completions": [
            {"text": "", "reward": 1.0, "trajectory": [
                {"role": "assistant", "content": "Let me check.", "kind": "action"},
                {"role": "tool", "content": "Rain: light, 2 mm.", "kind": "observation"},
                {"role": "assistant", "content": "Yes, lightly.", "kind": "action"},
            ]},
            {"text": "No.", "reward": 0.0},
            {"text": "", "reward": 0.5, "trajectory": [
                {"role": "assistant", "content": "Checking the sky.", "kind": "action"},
                {"role": "tool", "content": "Sky: overcast, dry roads everywhere in town.", "kind": "observation"},
                {"role": "assistant", "content": "Probably not.", "kind": "action"},
            ]},
        ],
    },
    {
        "messages": [{"role": "user", "content": "Two plus two?"}],
        "completions": [{"text": "4", "reward": 1.0}, {"text": "five", "reward": 0.0}],
    },
    {
        "messages": [{"role": "user", "content": "Name a fruit."}],
        "completions": [{"text": "An apple.", "reward": 1.0}, {"text": "A stone.", "reward": 0.0},
                        {"text": "Pear", "reward": 0.75}],
    },
]  # fmt: skip
SGD = {"optimizer": {"kind": "sgd"}, "learning_rate": 0.05, "lora_rank": 4, "lora_alpha": 8.0}
GRPO_TOKENS = {  # 5 groups in 3 steps of 2, 2 and 1; a checkpoint every 2 groups
    **SGD, "seed": 3, "gradient_accumulation_steps": 2, "micro_batch_size": 2, "checkpoint_interval": 2,
    "kl_reference_policy": {"kind": "ema", "decay": 0.5, "refresh_every": 2}, "loss": {"echo": {"lambda": 0.1}},
}  # fmt: skip
GRPO_SAMPLES = {  # a step per group (of 2 or 3 completions), its completions dealt to the ranks
    **SGD, "seed": 3, "loss_aggregation": "per_sample", "gradient_accumulation_steps": 3, "kl_estimator": "k3",
    "loss": {"echo": {"lambda": 0.1}},
}  # fmt: skip
PROMPTS = [
    {"messages": [{"role": "user", "content": f"Tell me one thing about {topic}."}]} for topic in ("cats", "rain")
] + [
    {
        "messages": [{"role": "user", "content": "List the files."}],
        "trajectory": [
            {"role": "assistant", "content": "ls", "kind": "action"},
            {"role": "tool", "content": "notes.txt report.pdf", "kind": "observation"},
        ],
    }
]
OPD = {  # 6 candidates a pass, 2 passes; steps of 4 candidates (two micro-batches of 2) and the epoch's last 2
    **SGD, "seed": 11, "samples_per_prompt": 2, "max_tokens": 10, "top_k": 16, "epochs": 2, "micro_batch_size": 2,
    "gradient_accumulation_steps": 2, "checkpoint_interval": 2, "echo": {"lambda": 0.1},
}  # fmt: skip


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update({"KILN_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"})
    return env


# ----------------------------------------------------------------------------- the rules, without a group


def _group(*sizes: tuple[int, int]) -> SimpleNamespace:
    """A stand-in kept group: per completion (action tokens, observation tokens)."""
    return SimpleNamespace(
        completions=[
            SimpleNamespace(action_mask=[True] * a + [False] * 3, observation_mask=[False] * (a + 3 - o) + [True] * o)
            for a, o in sizes
        ]
    )


def test_grpo_token_level_splits_each_group_into_contiguous_blocks_whose_weights_add_up():
    kept = [_group((3, 0), (5, 2), (1, 0)), _group((4, 1)), _group((2, 0), (2, 0), (6, 3), (1, 1), (2, 0))]
    for shares in step_plan(kept, "token_level", 3):
        single = step_weights(kept, shares, "token_level")
        for world in (2, 3, 4):
            parts = [rank_shares(kept, shares, "token_level", rank) for rank in DataParallel(world, 0, "gloo").ranks()]
            for s, (_, indices) in enumerate(shares):
                blocks = [part[s][0] for part in parts]
                assert [i for block in blocks for i in block] == indices  # contiguous, in rank order, all of them
                n = len(indices)
                assert blocks == [indices[r * n // world : (r + 1) * n // world] for r in range(world)]
                for k in (0, 1):  # the loss and ECHO weights of a group's blocks add up to the group's
                    assert sum(part[s][1][k] for part in parts) == pytest.approx(single[s][k], abs=1e-12)
    # one process: every share whole, exactly the single-process weights
    shares = [(1, [0, 1, 2]), (2, [0])]
    assert rank_shares(kept, shares, "token_level", DataParallel()) == [
        ([0, 1, 2], step_weights(kept, shares, "token_level")[0]),
        ([0], step_weights(kept, shares, "token_level")[1]),
    ]
    # a group of one completion over two ranks: rank 1 takes it, whole (weights (1, 1)), rank 0 nothing
    alone = [(2, [0])]
    assert rank_shares(kept, alone, "token_level", DataParallel(2, 0, "gloo")) == [([], (0.0, 0.0))]
    assert rank_shares(kept, alone, "token_level", DataParallel(2, 1, "gloo")) == [([0], (1.0, 1.0))]


def test_grpo_per_sample_deals_a_steps_completions_to_the_ranks_in_turn():
    kept = [_group((3, 0), (5, 2), (1, 0), (2, 2), (4, 0))]
    shares = step_plan(kept, "per_sample", 5)[0]
    weights = step_weights(kept, shares, "per_sample")
    rank0 = rank_shares(kept, shares, "per_sample", DataParallel(2, 0, "gloo"))
    rank1 = rank_shares(kept, shares, "per_sample", DataParallel(2, 1, "gloo"))
    assert [mine for mine, _ in rank0] == [[0], [], [2], [], [4]]
    assert [mine for mine, _ in rank1] == [[], [1], [], [3], []]
    for s, (mine0, w0), (_, w1) in zip(range(5), rank0, rank1, strict=True):
        assert (w0 if mine0 else w1) == weights[s]  # each share keeps its single-process weights


def test_opd_deals_a_steps_micro_batches_and_a_single_process_gathers_its_own_payload():
    positions = list(range(7))  # a step of 7 candidates in micro-batches of 2
    assert DataParallel(2, 0, "gloo").micro_batches(positions, 2) == [[0, 1], [4, 5]]
    assert DataParallel(2, 1, "gloo").micro_batches(positions, 2) == [[2, 3], [6]]
    assert [j for j in range(4) if DataParallel(2, 1, "gloo").deals(j)] == [1, 3]
    assert list(DataParallel(3, 2, "gloo").block(7)) == [4, 5, 6]
    assert list(DataParallel(3, 0, "gloo").block(2)) == []
    assert DataParallel(2, 0, "gloo").plan(GRPO_SHARDING_RULE)["sharding"] == "kiln.grpo-step-completions.v1"
    assert DataParallel(2, 0, "gloo").plan(OPD_SHARDING_RULE)["sharding"] == "kiln.opd-step-candidates.v1"
    assert StepSync(DataParallel(), {}, None).gather({"a": [1.5, None]}) == [{"a": [1.5, None]}]


# ----------------------------------------------------------------------------- two ranks, one launch


def _grpo_request(config: dict) -> dict:
    return {"groups": GROUPS, "config": config}


def _opd_request(config: dict) -> dict:
    return {"teacher": "tutor", "prompts": PROMPTS, "config": config}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, tiny_model_dir, teacher_dir):
    """Every world-size-2 run of this module, trained by one ``torchrun`` launch; rank 0's summaries by name."""
    from kiln.teachers import TeacherRegistry

    root = tmp_path_factory.mktemp("ranks")
    teachers = root / "teachers"
    TeacherRegistry(teachers).add({"alias": "tutor", "kind": "local", "model_id": str(teacher_dir)})
    base = {"registry": str(root / "adapters"), "model": str(tiny_model_dir), "teachers": str(teachers)}
    cut_grpo, cut_opd = "grpo-cut-checkpoint-step-00000002.kiln-checkpoint", "opd-cut-checkpoint-step-00000003.kiln-checkpoint"  # fmt: skip
    runs = {
        "grpo-whole": ("grpo", "grpo-whole", _grpo_request(GRPO_TOKENS), {}),
        "grpo-cut": ("grpo", "grpo-cut", _grpo_request(GRPO_TOKENS), {"cancel_after_step": 2}),
        "grpo-resumed": ("grpo", "grpo-cut", _grpo_request({**GRPO_TOKENS, "resume_checkpoint": cut_grpo}), {}),
        "grpo-samples": ("grpo", "grpo-samples", _grpo_request(GRPO_SAMPLES), {}),
        "opd-whole": ("opd", "opd-whole", _opd_request(OPD), {}),
        "opd-cut": ("opd", "opd-cut", _opd_request(OPD), {"cancel_after_step": 6}),
        "opd-resumed": ("opd", "opd-cut", _opd_request({**OPD, "resume_checkpoint": cut_opd}), {}),
    }
    plan = {
        "threads": DataParallel.planned(2).threads,  # the ranks run as an admission in another process planned
        "runs": [
            {
                **base,
                "kind": kind,
                "adapter": adapter,
                "request": request,
                "result": str(root / f"{name}.json"),
                **extra,
            }
            for name, (kind, adapter, request, extra) in runs.items()
        ],
    }
    plan_path = root / "plan.json"
    plan_path.write_text(json.dumps(plan), encoding="utf-8")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(DRIVER)]
    done = subprocess.run(
        [*argv, str(plan_path)], env=_env(root), capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = {name: json.loads((root / f"{name}.json").read_text(encoding="utf-8")) for name in runs}
    return SimpleNamespace(root=root, registry=root / "adapters", teachers=teachers, runs=found)


def _loaded(path: Path) -> dict:
    """The document at ``path`` once its strict loader accepts it, as JSON."""
    report = contracts.validate_path(path)
    assert report.valid, report.errors
    return json.loads(path.read_text(encoding="utf-8"))


def _close(value: object) -> object:
    """What a value of a 1-rank receipt is at 2 ranks: a count exactly, a float to fp32 rounding -- relative, and
    absolute for means of differences of log-probabilities (near 0, the rounding of the terms dominates)."""
    return pytest.approx(value, rel=1e-5, abs=1e-6) if isinstance(value, float) else value


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "adapter_model.safetensors"))


def _assert_close_weights(a: Path, b: Path) -> None:
    x, y = _tensors(a), _tensors(b)
    assert x.keys() == y.keys()
    for name in x:
        assert (x[name] - y[name]).abs().max().item() <= 1e-5 * max(1.0, y[name].abs().max().item()), name


def _one_rank(tmp_path: Path, tiny_model_dir: Path, kind: str, name: str, request: dict, teachers: Path | None = None):
    context = TrainingContext(registry=tmp_path / "adapters", model_path=str(tiny_model_dir), teachers_root=teachers)
    result = TRAINERS[kind].run(TRAINERS[kind].admit(request, adapter_name=name, context=context))
    assert result.status == "success", result.receipt.get("failure_message")
    return result


def _refused_elsewhere(ranks, tmp_path: Path, tiny_model_dir, kind: str, checkpoint: str, request: dict, path: str):
    """The world-size-2 ``checkpoint`` (copied into a registry where its adapter is not yet published) resumes for two
    ranks and is refused at 1 and 3, naming the world size under the kind's planning identity ``path``."""
    shutil.copytree(ranks.registry / checkpoint, tmp_path / "adapters" / checkpoint)
    for world in (2, 1, 3):
        context = TrainingContext(
            registry=tmp_path / "adapters",
            model_path=str(tiny_model_dir),
            teachers_root=ranks.teachers,
            data_parallel=DataParallel.planned(world),
        )
        if world == 2:
            assert TRAINERS[kind].admit(request, adapter_name=f"{kind}-cut", context=context).start_step > 0
            continue
        with pytest.raises(CheckpointError) as refused:
            TRAINERS[kind].admit(request, adapter_name=f"{kind}-cut", context=context)
        assert refused.value.code == "checkpoint_incompatible"
        assert refused.value.reason == f"auxiliary_state.{path}.data_parallel.world_size"
        assert f"2 (checkpoint) != {world} (this run)" in refused.value.message


def test_two_grpo_ranks_train_what_one_trains(ranks, tmp_path, tiny_model_dir):
    for name, config in (("grpo-whole", GRPO_TOKENS), ("grpo-samples", GRPO_SAMPLES)):
        two = ranks.runs[name]
        one = _one_rank(tmp_path, tiny_model_dir, "grpo", name, _grpo_request(config))
        assert two["status"] == "success"
        assert len(two["losses"]) == len(one.losses) == (3 if name == "grpo-whole" else 5)
        assert two["losses"] == pytest.approx(one.losses, rel=1e-5, abs=1e-7)
        _assert_close_weights(ranks.registry / name, one.adapter_dir)
        receipt = _loaded(ranks.registry / name / "train_receipt.json")
        assert receipt["runtime"]["data_parallel"] == {
            "world_size": 2,
            "backend": "gloo",
            "sharding": GRPO_SHARDING_RULE,
        }
        assert "data_parallel" not in one.receipt["runtime"]
        audit, single = receipt["grpo"]["policy_audit"], one.receipt["grpo"]["policy_audit"]
        for block in ("importance_sampling", "kl_reference"):  # counts exactly, means to rounding
            for key, value in single[block].items():
                assert audit[block][key] == _close(value)
        assert audit["kl_reference"]["token_observations"] > 0
        for key, value in one.receipt["echo"].items():
            assert receipt["echo"][key] == _close(value)
        assert receipt["echo"]["enabled"] is True
        assert (
            _loaded(ranks.registry / name / "adapter_manifest.json")["data_parallel"]["sharding"] == GRPO_SHARDING_RULE
        )


def test_a_cancelled_two_rank_grpo_run_resumes_to_the_bytes_of_an_uninterrupted_one(ranks, tmp_path, tiny_model_dir):
    whole, cut, resumed = (ranks.runs[name] for name in ("grpo-whole", "grpo-cut", "grpo-resumed"))
    assert whole["checkpoints"] == ["grpo-whole-checkpoint-step-00000001.kiln-checkpoint",
                                    "grpo-whole-checkpoint-step-00000002.kiln-checkpoint"]  # fmt: skip
    # rank 0 alone asks to stop at group 2 (the end of step 1); the group agrees at step 2's collective
    assert cut["status"] == "failed"
    assert cut["failure_reason"] == "cancelled"
    assert cut["checkpoints"][-1] == "grpo-cut-checkpoint-step-00000002.kiln-checkpoint"
    checkpoint = contracts.validate_path(ranks.registry / cut["checkpoints"][-1])
    assert checkpoint.valid, checkpoint.errors
    assert resumed["status"] == "success"
    assert resumed["losses"] == whole["losses"]
    assert resumed["adapter_sha256"] == whole["adapter_sha256"]
    for block in ("grpo", "echo", "data", "token_counts"):
        assert resumed["receipt"][block] == whole["receipt"][block]
    request = _grpo_request({**GRPO_TOKENS, "resume_checkpoint": cut["checkpoints"][-1]})
    path = "training_runtime_planning_identity"
    _refused_elsewhere(ranks, tmp_path, tiny_model_dir, "grpo", cut["checkpoints"][-1], request, path)


def test_two_opd_ranks_train_what_one_trains(ranks, tmp_path, tiny_model_dir, teachers):
    two = ranks.runs["opd-whole"]
    one = _one_rank(tmp_path, tiny_model_dir, "opd", "opd-whole", _opd_request(OPD), teachers)
    assert two["status"] == "success"
    assert len(two["losses"]) == len(one.losses) == 4
    assert two["losses"] == pytest.approx(one.losses, rel=1e-5, abs=1e-7)
    _assert_close_weights(ranks.registry / "opd-whole", one.adapter_dir)
    receipt, single = two["receipt"], one.receipt
    assert receipt["runtime"]["data_parallel"] == {"world_size": 2, "backend": "gloo", "sharding": OPD_SHARDING_RULE}
    for key in ("action_tokens", "env_tokens", "echo_combined"):  # every rank decoded every rollout
        assert receipt["opd"][key] == single["opd"][key]
    assert receipt["opd"]["env_tokens"] > 0
    for mine, theirs in zip(receipt["opd"]["collapse_diagnostics"], single["opd"]["collapse_diagnostics"], strict=True):
        for key, value in theirs.items():
            assert mine[key] == _close(value), key
    for key, value in single["echo"].items():
        assert receipt["echo"][key] == _close(value)
    assert (
        _loaded(ranks.registry / "opd-whole" / "adapter_manifest.json")["data_parallel"]["sharding"]
        == OPD_SHARDING_RULE
    )


def test_a_cancelled_two_rank_opd_run_resumes_to_the_bytes_of_an_uninterrupted_one(ranks, tmp_path, tiny_model_dir):
    whole, cut, resumed = (ranks.runs[name] for name in ("opd-whole", "opd-cut", "opd-resumed"))
    assert whole["checkpoints"] == ["opd-whole-checkpoint-step-00000002.kiln-checkpoint"]
    # rank 0 alone asks to stop at candidate 6 (the end of step 2); the group agrees at step 3's collective, whose
    # checkpoint is not due: the cancellation publishes it
    assert cut["failure_reason"] == "cancelled"
    assert cut["checkpoints"] == ["opd-cut-checkpoint-step-00000002.kiln-checkpoint",
                                  "opd-cut-checkpoint-step-00000003.kiln-checkpoint"]  # fmt: skip
    assert contracts.validate_path(ranks.registry / cut["checkpoints"][-1]).valid
    assert resumed["status"] == "success"
    assert resumed["losses"] == whole["losses"]
    assert resumed["adapter_sha256"] == whole["adapter_sha256"]
    for key in ("action_tokens", "env_tokens", "final_opd_loss"):
        assert resumed["receipt"]["opd"][key] == whole["receipt"]["opd"][key]
    # the diagnostics at the end (each run also lists a snapshot per checkpoint it published)
    assert resumed["receipt"]["opd"]["collapse_diagnostics"][-1] == whole["receipt"]["opd"]["collapse_diagnostics"][-1]
    assert resumed["receipt"]["echo"] == whole["receipt"]["echo"]
    request = _opd_request({**OPD, "resume_checkpoint": cut["checkpoints"][-1]})
    _refused_elsewhere(ranks, tmp_path, tiny_model_dir, "opd", cut["checkpoints"][-1], request, "checkpoint_planning")


def test_kiln_train_grpo_local_on_two_ranks_records_the_plan(tmp_path, tiny_model_dir):
    data = tmp_path / "groups.jsonl"
    data.write_text("".join(json.dumps(group) + "\n" for group in GROUPS[:2]), encoding="utf-8")
    registry = tmp_path / "adapters"
    argv = [sys.executable, "-m", "kiln.cli", "train", "grpo", "--local", "-f", str(data), "--adapter", "pair",
            "--adapter-dir", str(registry), "--model", str(tiny_model_dir), "--seed", "5", "--nproc-per-node", "2",
            "--json"]  # fmt: skip
    done = subprocess.run(argv, env=_env(tmp_path), capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["status"] == "success"
    assert summary["world_size"] == 2
    plan = {"world_size": 2, "backend": "gloo", "sharding": "kiln.grpo-step-completions.v1"}
    assert _loaded(registry / "pair" / "train_receipt.json")["runtime"]["data_parallel"] == plan
    assert _loaded(registry / "pair" / "adapter_manifest.json")["data_parallel"] == plan
    verified = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "adapters", "verify", "pair", "--adapter-dir", str(registry)],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr
