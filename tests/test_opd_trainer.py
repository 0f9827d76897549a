"""The OPD trainer on the tiny model with a tiny teacher (same tokenizer, other weights):
the student's reverse KL to the teacher falls, cancel-then-resume equals an uninterrupted
run (also when the candidate settled right before the cancel produced no update), a teacher
whose weights changed is refused at resume, a pre-scored file with a misaligned row is
refused naming the line, what Kiln does not execute is refused at admission, and every
artifact validates."""

from __future__ import annotations

import threading

import pytest
from _opd_fixture import off_policy_teacher
from _runs import assert_same_opd_run

from kiln import contracts
from kiln.errors import ContractError, KilnError, RequestError
from kiln.model import create_tiny
from kiln.teachers import TeacherRegistry
from kiln.trainers.opd import admit_opd, run_opd

PROMPTS = [
    {"messages": [{"role": "user", "content": f"Tell me one thing about {topic}."}]}
    for topic in ("cats", "rain", "maps")
]
CONFIG = {
    "seed": 11,
    "samples_per_prompt": 2,
    "max_tokens": 10,
    "top_k": 16,
    "learning_rate": 0.01,
    "optimizer": {"kind": "adam_w"},
}


def _request(**config):
    return {"teacher": "tutor", "prompts": PROMPTS, "config": {**CONFIG, **config}}


def _admit(tmp_path, tiny_model_dir, teachers, request, name="student"):
    return admit_opd(
        adapter_name=name,
        registry=tmp_path / "adapters",
        request=request,
        teachers_root=teachers,
        model_path=str(tiny_model_dir),
    )


def _cancel_at(candidate: int, event: threading.Event):
    def progress(info):
        if info["step"] == candidate:
            event.set()

    return progress


def test_the_students_reverse_kl_to_the_teacher_falls(tmp_path, tiny_model_dir, teachers):
    result = run_opd(_admit(tmp_path, tiny_model_dir, teachers, _request(epochs=4)))
    assert result.status == "success", result.receipt.get("failure_message")
    per_epoch = [sum(result.losses[i : i + 6]) / 6 for i in range(0, 24, 6)]
    assert per_epoch[-1] < 0.8 * per_epoch[0], per_epoch
    opd = result.receipt["opd"]
    assert opd["teacher_id"] == "tutor"
    assert opd["top_k"] == 16
    assert opd["samples_per_prompt"] == 2
    assert opd["initial_opd_loss"] == result.losses[0]
    assert opd["final_opd_loss"] == result.losses[-1]
    assert opd["teacher_identity"]["served_model_id"] == "teacher"
    assert result.receipt["training_data"]["source"] == "opd_prompts"
    snapshots = opd["collapse_diagnostics"]
    assert snapshots[-1]["global_step"] == len(result.losses) == 24
    assert 0.0 <= snapshots[-1]["truncation_rate"] <= 1.0
    assert snapshots[-1]["mean_response_tokens"] <= 10
    for path in (result.receipt_path, result.manifest_path, *result.checkpoints):
        report = contracts.validate_path(path)
        assert report.valid, (path, report.errors)


@pytest.mark.parametrize(
    "schedule", [None, {"kind": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1}], ids=["constant", "warmup-cosine"]
)
def test_cancel_then_resume_equals_an_uninterrupted_run(tmp_path, tiny_model_dir, teachers, schedule):
    extra = {} if schedule is None else {"lr_scheduler": schedule}
    request = _request(epochs=2, checkpoint_interval=3, **extra)
    whole = run_opd(_admit(tmp_path / "a", tiny_model_dir, teachers, request))
    assert whole.status == "success"

    cancel = threading.Event()
    first = run_opd(
        _admit(tmp_path / "b", tiny_model_dir, teachers, request), progress=_cancel_at(7, cancel), cancel=cancel
    )
    assert first.status == "failed"
    assert first.cancelled
    assert first.receipt["failure_reason"] == "cancelled"
    names = [p.name for p in first.checkpoints]
    assert names == [
        "student-checkpoint-step-00000003.kiln-checkpoint",
        "student-checkpoint-step-00000006.kiln-checkpoint",
        "student-checkpoint-step-00000007.kiln-checkpoint",
    ]
    resumed_request = _request(epochs=2, checkpoint_interval=3, resume_checkpoint=names[-1], **extra)
    resumed = run_opd(_admit(tmp_path / "b", tiny_model_dir, teachers, resumed_request))
    assert_same_opd_run(whole, resumed)


RESPONSES = [
    ("Name a colour.", "Blue."),
    ("Name a fruit.", ""),
    ("Name a tree.", "An oak."),
    ("Name a bird.", "A robin."),
    ("Name a fish.", ""),
    ("Name a stone.", "Granite."),
]


@pytest.mark.parametrize("interval", [100, 2])
def test_off_policy_resume_after_an_empty_candidate_equals_an_uninterrupted_run(
    tmp_path, tiny_model_dir, teacher_dir, interval
):
    """interval 100: the cancel publishes a checkpoint past the empty candidate; interval 2: the
    step was already published, so the cancel keeps that checkpoint and the resume replays the
    empty candidate."""
    path, root = off_policy_teacher(tmp_path, tiny_model_dir, teacher_dir, RESPONSES)
    config = {**CONFIG, "training_mode": "off_policy", "epochs": 2, "checkpoint_interval": interval}
    request = {"teacher": "scored", "dataset_path": str(path), "config": config}

    def admit(where, req):
        return admit_opd(
            adapter_name="student", registry=where, request=req, teachers_root=root, model_path=str(tiny_model_dir)
        )

    whole = run_opd(admit(tmp_path / "a", request))
    assert whole.status == "success", whole.receipt.get("failure_message")
    assert len(whole.losses) == 8  # 12 candidates, 4 of them empty
    assert whole.receipt["training_data"] == {
        "source": "opd_teacher_jsonl",
        "path": str(path),
        "sha256": whole.receipt["training_data"]["sha256"],
    }

    cancel = threading.Event()
    seen: list[bool] = []

    def progress(info):  # cancel right after the first empty candidate that follows a step
        seen.append(info["loss"] is None)
        if len(seen) >= 3 and seen[-1] and not seen[-2] and not cancel.is_set():
            cancel.set()

    first = run_opd(admit(tmp_path / "b", request), progress=progress, cancel=cancel)
    assert first.cancelled
    assert seen[-1] is True, seen
    latest = first.checkpoints[-1]
    from kiln.checkpoints import load_checkpoint

    state = load_checkpoint(latest).loop_state
    if interval == 100:
        assert len(first.checkpoints) == 1
        assert state["candidates_consumed"] == len(seen)
        assert state["empty_rollouts"] >= 1
    else:
        assert state["global_step"] == seen.count(False)
        assert state["candidates_consumed"] < len(seen)
    resumed = run_opd(admit(tmp_path / "b", {**request, "config": {**config, "resume_checkpoint": latest.name}}))
    assert resumed.status == "success", resumed.receipt.get("failure_message")
    assert resumed.losses == whole.losses
    assert (resumed.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        whole.adapter_dir / "adapter_model.safetensors"
    ).read_bytes()


def test_a_teacher_whose_weights_changed_is_refused_at_resume(tmp_path, tiny_model_dir):
    teacher = create_tiny(tmp_path / "mutable-teacher", seed=2)
    root = tmp_path / "teachers"
    TeacherRegistry(root).add({"alias": "tutor", "kind": "local", "model_id": str(teacher)})
    cancel = threading.Event()
    first = run_opd(
        _admit(tmp_path, tiny_model_dir, root, _request(checkpoint_interval=2)),
        progress=_cancel_at(3, cancel),
        cancel=cancel,
    )
    assert first.cancelled
    create_tiny(teacher, seed=3, overwrite=True)
    resume = _request(checkpoint_interval=2, resume_checkpoint=first.checkpoints[-1].name)
    with pytest.raises(KilnError) as caught:
        _admit(tmp_path, tiny_model_dir, root, resume)
    assert caught.value.code == "teacher_identity_mismatch"
    assert "base_model_sha256" in str(caught.value)


def test_a_misaligned_pre_scored_row_is_refused_naming_its_line(tmp_path, tiny_model_dir, teacher_dir):
    import json

    path, root = off_policy_teacher(tmp_path, tiny_model_dir, teacher_dir, RESPONSES[:3])
    lines = path.read_text().splitlines()
    row = json.loads(lines[3])
    row["teacher_tokens"][0]["token_id"] += 1
    lines[3] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")
    request = {"teacher": "scored", "dataset_path": str(path), "config": {**CONFIG, "training_mode": "off_policy"}}
    with pytest.raises(KilnError) as caught:
        _admit(tmp_path, tiny_model_dir, root, request)
    assert "line 4" in str(caught.value)


@pytest.mark.parametrize(
    ("change", "code", "field"),
    [
        ({"objective": "cross_entropy"}, "training_backend_unsupported", "objective"),
        ({"loss": "full_vocab"}, "training_backend_unsupported", "loss"),
        ({"top_k": 8}, "training_backend_unsupported", "top_k"),
        ({"stable_opd": {"mode": "clip"}}, None, "stable_opd"),
        ({"discount": 0.5}, "training_backend_unsupported", "discount"),
        ({"clip_epsilon": 0.2}, "training_backend_unsupported", "clip_epsilon"),
        ({"max_cost_usd": 3.0}, "training_backend_unsupported", "max_cost_usd"),
        ({"rollout_prompt_rendering": "legacy_action_boundary"}, "training_backend_unsupported", "rollout"),
        ({"lora_alpha": 64, "lora_rank": 8}, "training_invalid_request", "unsafe_lora_scale"),
    ],
)
def test_values_kiln_does_not_execute_are_refused_at_admission(tmp_path, tiny_model_dir, teachers, change, code, field):
    with pytest.raises((RequestError, ContractError)) as caught:
        _admit(tmp_path, tiny_model_dir, teachers, _request(**change))
    if code is not None:
        assert caught.value.code == code
    assert field in str(caught.value)
    assert not (tmp_path / "adapters" / "student").exists()


def test_request_level_refusals(tmp_path, tiny_model_dir, teachers):
    cases = [
        ({"teacher": "nobody", "prompts": PROMPTS}, "teacher_not_found"),
        ({"teacher": "tutor", "prompts": PROMPTS, "post_eval": {"suite": "x"}}, "training_backend_unsupported"),
        (
            {"teacher": "tutor", "prompts": PROMPTS, "config": {"training_mode": "off_policy"}},
            "inconsistent_fields",  # the schema states it: off_policy reads a dataset_path
        ),
    ]
    for request, code in cases:
        with pytest.raises(KilnError) as caught:
            _admit(tmp_path, tiny_model_dir, teachers, request)
        assert caught.value.code == code, (request, caught.value)


def test_echo_trains_on_the_trajectorys_observation_tokens(tmp_path, tiny_model_dir, teachers):
    prompts = [
        {
            "messages": [{"role": "user", "content": "List the files."}],
            "trajectory": [
                {"role": "assistant", "content": "ls", "kind": "action"},
                {"role": "tool", "content": "notes.txt report.pdf", "kind": "observation"},
            ],
        }
    ]
    request = {"teacher": "tutor", "prompts": prompts, "config": {**CONFIG, "echo": {"lambda": 0.1}}}
    result = run_opd(_admit(tmp_path, tiny_model_dir, teachers, request))
    assert result.status == "success", result.receipt.get("failure_message")
    assert result.receipt["opd"]["echo_combined"] is True
    assert result.receipt["opd"]["echo_lambda"] == 0.1
    assert result.receipt["opd"]["env_tokens"] > 0
    assert result.receipt["echo"]["enabled"] is True
