"""OPD batches (``micro_batch_size``): a local teacher scores a batch as it scores each rollout alone, batched runs
train (reverse KL falls, artifacts validate), cancel-then-resume at a batch boundary is byte-identical to an
uninterrupted batched run, and a resume with another batch size is refused naming the field."""

from __future__ import annotations

import threading

import pytest
import torch
from _runs import assert_same_opd_run

from kiln import contracts
from kiln.errors import CheckpointError
from kiln.teachers import TeacherRegistry, open_scorer
from kiln.trainers.opd import admit_opd, run_opd

PROMPTS = [
    {"messages": [{"role": "user", "content": f"Tell me one thing about {topic}."}]}
    for topic in ("cats", "rain", "maps")
]
CONFIG = {"seed": 11, "samples_per_prompt": 2, "max_tokens": 10, "top_k": 16, "learning_rate": 0.01,
          "optimizer": {"kind": "adam_w"}}  # fmt: skip


def _run(tmp_path, model, teachers, config, *, cancel_at=None, name="student"):
    job = admit_opd(
        adapter_name=name,
        registry=tmp_path / "adapters",
        request={"teacher": "tutor", "prompts": PROMPTS, "config": {**CONFIG, **config}},
        teachers_root=teachers,
        model_path=str(model),
    )
    event = threading.Event()

    def progress(info):
        if cancel_at is not None and info["step"] == cancel_at:
            event.set()

    return run_opd(job, progress=progress, cancel=event)


def test_a_local_teacher_scores_a_batch_as_each_rollout_alone(tmp_path, teachers):
    scorer = open_scorer(TeacherRegistry(teachers).get("tutor"), registry_dir=tmp_path / "adapters")
    pairs = [([5, 9, 30, 31], [40, 41, 42]), ([7, 8], [50, 51, 52, 53, 54, 55]), ([60] * 9, [61])]
    alone = [scorer.score(prefix, action, 16) for prefix, action in pairs]
    together = scorer.score_batch(pairs, 16)
    assert len(together) == len(pairs)
    for (ids_a, lp_a), (ids_b, lp_b), (_, action) in zip(alone, together, pairs, strict=True):
        assert ids_b.shape == ids_a.shape == (len(action), 16)
        torch.testing.assert_close(lp_b, lp_a, rtol=1e-5, atol=1e-5)
        assert torch.equal(ids_b, ids_a)  # no near-ties in these rows: the top-K sets agree exactly
    scorer.close()


def test_a_batched_run_trains_and_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, tiny_model_dir, teachers):
    config = {"epochs": 2, "checkpoint_interval": 3, "micro_batch_size": 4,
              "lr_scheduler": {"kind": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}}  # fmt: skip
    whole = _run(tmp_path / "a", tiny_model_dir, teachers, config)
    assert whole.status == "success", whole.receipt.get("failure_message")
    assert len(whole.losses) == 12  # no empty rollout in this run: every candidate stepped
    # 6 candidates an epoch in batches of 4 and 2; a checkpoint due inside a batch lands at its end
    assert [p.name for p in whole.checkpoints] == [
        "student-checkpoint-step-00000004.kiln-checkpoint",
        "student-checkpoint-step-00000006.kiln-checkpoint",
        "student-checkpoint-step-00000010.kiln-checkpoint",
    ]
    for path in (whole.receipt_path, whole.manifest_path, *whole.checkpoints):
        assert contracts.validate_path(path).valid, path
    assert whole.receipt["config"]["micro_batch_size"] == 4
    # near-greedy rollouts: the first candidate of a batch sees the policy and the tokens it would see alone; the
    # others were rolled out from the batch's starting policy, so they train differently
    greedy = {"epochs": 1, "temperature": 1e-4, "checkpoint_interval": None}  # one-hot: the draw cannot matter
    alone = _run(tmp_path / "g1", tiny_model_dir, teachers, {**greedy, "micro_batch_size": 1})
    batched = _run(tmp_path / "g4", tiny_model_dir, teachers, {**greedy, "micro_batch_size": 4})
    assert batched.losses[0] == pytest.approx(alone.losses[0], rel=1e-5)
    assert batched.losses[1:4] != pytest.approx(alone.losses[1:4], rel=1e-5)

    cut = _run(tmp_path / "b", tiny_model_dir, teachers, config, cancel_at=5)  # mid-batch: finishes the batch
    assert cut.cancelled
    assert cut.checkpoints[-1].name == "student-checkpoint-step-00000006.kiln-checkpoint"
    with pytest.raises(CheckpointError) as info:
        _run(tmp_path / "b", tiny_model_dir, teachers,
             {**config, "micro_batch_size": 2, "resume_checkpoint": cut.checkpoints[-1].name})  # fmt: skip
    assert "effective_config.micro_batch_size" in {p.code for p in info.value.problems}
    resumed = _run(tmp_path / "b", tiny_model_dir, teachers, {**config, "resume_checkpoint": cut.checkpoints[-1].name})
    assert_same_opd_run(whole, resumed)
