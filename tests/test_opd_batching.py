"""OPD steps of several candidates (``micro_batch_size`` x ``gradient_accumulation_steps``): a local teacher scores
a batch as it scores each rollout alone; a step trains alike however its candidates are cut into micro-batches; its
loss is the mean over all its action positions; cancel-then-resume is byte-identical to an uninterrupted run, and a
resume with another batch plan is refused naming the fields."""

from __future__ import annotations

import threading

import pytest
import torch
from _opd_fixture import off_policy_teacher
from _runs import assert_same_opd_run
from safetensors.torch import load_file

from kiln import contracts
from kiln.documents.epoch_order import epoch_order
from kiln.errors import CheckpointError
from kiln.teachers import TeacherRegistry, open_scorer
from kiln.trainers.opd import admit_opd, run_opd

PROMPTS = [
    {"messages": [{"role": "user", "content": f"Tell me one thing about {topic}."}]}
    for topic in ("cats", "rain", "maps")
]
CONFIG = {"seed": 11, "samples_per_prompt": 2, "max_tokens": 10, "top_k": 16, "learning_rate": 0.01,
          "optimizer": {"kind": "adam_w"}}  # fmt: skip


def _run(tmp_path, model, teachers, config, *, cancel_at=None, name="student", prompts=PROMPTS):
    job = admit_opd(
        adapter_name=name,
        registry=tmp_path / "adapters",
        request={"teacher": "tutor", "prompts": prompts, "config": {**CONFIG, **config}},
        teachers_root=teachers,
        model_path=str(model),
    )
    event = threading.Event()

    def progress(info):
        if cancel_at is not None and info["step"] == cancel_at:
            event.set()

    return run_opd(job, progress=progress, cancel=event)


def _weights(result):
    return load_file(result.adapter_dir / "adapter_model.safetensors")


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


GREEDY = {"epochs": 1, "temperature": 1e-4, "checkpoint_interval": None,  # one-hot: the draw cannot matter
          "optimizer": {"kind": "sgd"}, "learning_rate": 0.05}  # fmt: skip


# ECHO: trajectories whose observations differ in length, so the step's cross-entropy weights them
ECHO_PROMPTS = [
    {"messages": [{"role": "user", "content": f"List the files in {where}."}],
     "trajectory": [{"role": "assistant", "content": "ls", "kind": "action"},
                    {"role": "tool", "content": " ".join(files), "kind": "observation"}]}
    for where, files in (("docs", ["a.txt"]), ("src", ["main.py", "util.py", "io.py", "net.py"]),
                         ("data", ["x.csv", "y.csv"]))
]  # fmt: skip


@pytest.mark.parametrize(("prompts", "extra"), [(PROMPTS, {}), (ECHO_PROMPTS, {"echo": {"lambda": 0.5}})],
                         ids=["plain", "echo"])  # fmt: skip
def test_a_step_trains_alike_however_its_candidates_are_cut(tmp_path, tiny_model_dir, teachers, prompts, extra):
    # 6 candidates, 4 a step: one batch of 4 (one padded student forward), two of 2 accumulated, or four of 1
    # accumulated (dense forwards) -- the same rollouts (all from the policy at the step's start) and, with SGD,
    # the same steps to fp32 rounding
    runs = {
        (micro, accumulation): _run(tmp_path / f"{micro}x{accumulation}", tiny_model_dir, teachers,
                                    {**GREEDY, **extra, "micro_batch_size": micro,
                                     "gradient_accumulation_steps": accumulation}, prompts=prompts)
        for micro, accumulation in ((4, 1), (2, 2), (1, 4))
    }  # fmt: skip
    reference = runs[(4, 1)]
    assert reference.status == "success", reference.receipt.get("failure_message")
    assert len(reference.losses) == 2  # steps of 4 and 2 candidates
    for key, run in runs.items():
        assert run.status == "success", (key, run.receipt.get("failure_message"))
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(reference.losses), rtol=1e-5, atol=1e-7)
        a, b = _weights(reference), _weights(run)
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6, msg=(key, name))
        for path in (run.receipt_path, run.manifest_path):
            assert contracts.validate_path(path).valid, (key, path)
        if extra:
            for field in ("initial_env_ce", "final_env_ce"):
                assert run.receipt["echo"][field] == pytest.approx(reference.receipt["echo"][field], rel=1e-5)
    assert runs[(2, 2)].receipt["config"]["gradient_accumulation_steps"] == 2
    if extra:
        assert reference.receipt["opd"]["env_tokens"] > 0


RESPONSES = [("Name a colour.", "Blue."), ("Name a fruit.", ""), ("Name a tree.", "An old oak by the river."),
             ("Name a bird.", "A robin."), ("Name a fish.", "A pike."), ("Name a stone.", "Granite.")]  # fmt: skip


def _off_policy(tmp_path, model, root, path, config):
    job = admit_opd(
        adapter_name="scored-student",
        registry=tmp_path / "adapters",
        request={
            "teacher": "scored",
            "dataset_path": str(path),
            "config": {**CONFIG, "training_mode": "off_policy", **config},
        },
        teachers_root=root,
        model_path=str(model),
    )
    events = []
    result = run_opd(job, progress=events.append)
    assert result.status == "success", result.receipt.get("failure_message")
    order = epoch_order(job.config.seed, 0, len(job.candidates))
    lengths = [len(job.source.rows[job.candidates[i][0]].action_ids) for i in order]
    return result, [(e["loss"], n) for e, n in zip(events, lengths, strict=False)]


def test_the_step_loss_is_the_mean_over_all_its_action_positions(tmp_path, tiny_model_dir, teacher_dir):
    # pre-scored responses of different lengths (one empty): one candidate a step at a negligible rate gives each
    # candidate's own loss at (nearly) the initial weights; a step of 4 must weight them by action positions
    path, root = off_policy_teacher(tmp_path, tiny_model_dir, teacher_dir, RESPONSES)
    still = {"epochs": 1, "optimizer": {"kind": "sgd"}, "learning_rate": 1e-9, "checkpoint_interval": None}
    _, alone = _off_policy(tmp_path / "alone", tiny_model_dir, root, path, still)
    stepped, _ = _off_policy(tmp_path / "step", tiny_model_dir, root, path, {**still, "micro_batch_size": 4})
    first = [(loss, n) for loss, n in alone[:4] if n]  # an empty response adds no position and no step
    assert len({n for _, n in first}) > 1
    expected = sum(loss * n for loss, n in first) / sum(n for _, n in first)
    assert stepped.losses[0] == pytest.approx(expected, rel=1e-5)
    mean_of_means = sum(loss for loss, _ in first) / len(first)
    assert abs(expected - mean_of_means) > 1e-4 * abs(expected)  # the lengths differ: the check can fail
    assert len(stepped.losses) == 2  # steps of 4 and 2 candidates


def test_a_batched_run_trains_and_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, tiny_model_dir, teachers):
    config = {"epochs": 2, "checkpoint_interval": 1, "micro_batch_size": 2, "gradient_accumulation_steps": 2,
              "lr_scheduler": {"kind": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1}}  # fmt: skip
    whole = _run(tmp_path / "a", tiny_model_dir, teachers, config)
    assert whole.status == "success", whole.receipt.get("failure_message")
    assert len(whole.losses) == 4  # 6 candidates an epoch in steps of 4 and 2, two epochs
    assert [p.name for p in whole.checkpoints] == [
        f"student-checkpoint-step-0000000{n}.kiln-checkpoint" for n in (1, 2, 3)
    ]
    for path in (whole.receipt_path, whole.manifest_path, *whole.checkpoints):
        assert contracts.validate_path(path).valid, path
    assert whole.receipt["config"]["micro_batch_size"] == 2

    cut = _run(
        tmp_path / "b", tiny_model_dir, teachers, config, cancel_at=5
    )  # candidate 5: published at the end of its step
    assert cut.cancelled
    assert cut.checkpoints[-1].name == "student-checkpoint-step-00000002.kiln-checkpoint"
    for changed in ({"micro_batch_size": 4, "gradient_accumulation_steps": 1}, {"gradient_accumulation_steps": 1}):
        with pytest.raises(CheckpointError) as info:
            _run(tmp_path / "b", tiny_model_dir, teachers,
                 {**config, **changed, "resume_checkpoint": cut.checkpoints[-1].name})  # fmt: skip
        codes = {p.code for p in info.value.problems}
        assert {f"effective_config.{field}" for field in changed} <= codes, codes
    resumed = _run(tmp_path / "b", tiny_model_dir, teachers, {**config, "resume_checkpoint": cut.checkpoints[-1].name})
    assert_same_opd_run(whole, resumed)


def test_the_student_forward_runs_the_tokens_its_rollouts_share_once(tmp_path, tiny_model_dir, teachers, monkeypatch):
    # a micro-batch of 4 rollouts of prompts that share their template and first words: prefix_sharing auto (the
    # default) runs those tokens once (the invariant forward's Decoder.prefix): the losses are exactly off's (every
    # rollout in full; the shared rows and the suffixes after them are the whole sequences' bits), the updates
    # equal to fp32 rounding (the prompt's gradient sums the rollouts' in another order)
    from kiln.model import Decoder

    shared: list[int] = []
    real = Decoder.prefix
    monkeypatch.setattr(
        Decoder, "prefix", lambda self, ids, *a, **k: shared.append(ids.shape[1]) or real(self, ids, *a, **k)
    )
    config = {**GREEDY, "micro_batch_size": 4, "echo": {"lambda": 0.5}}
    auto = _run(tmp_path / "auto", tiny_model_dir, teachers, config, prompts=ECHO_PROMPTS)
    assert min(shared, default=0) > 8  # the chat template and "List the files in"
    del shared[:]
    off = _run(tmp_path / "off", tiny_model_dir, teachers, {**config, "prefix_sharing": "off"}, prompts=ECHO_PROMPTS)
    assert not shared
    for run in (auto, off):
        assert run.status == "success", run.receipt.get("failure_message")
        assert contracts.validate_path(run.receipt_path).valid
    assert auto.losses == off.losses
    a, b = _weights(off), _weights(auto)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6, msg=name)
    assert auto.receipt["echo"]["initial_env_ce"] == off.receipt["echo"]["initial_env_ce"]
    assert auto.receipt["opd"]["prefix_sharing"] == {"mode": "auto", "student": True, "reason": None}
    assert off.receipt["opd"]["prefix_sharing"] == {"mode": "off", "student": False, "reason": "prefix_sharing is off"}
    alone = _run(tmp_path / "alone", tiny_model_dir, teachers, {**GREEDY, "epochs": 1}, prompts=PROMPTS[:1])
    assert alone.receipt["opd"]["prefix_sharing"]["student"] is False
    assert "micro_batch_size 1" in alone.receipt["opd"]["prefix_sharing"]["reason"]
