"""Assertions the exact-resume tests share, and the inline GRPO run several test files start."""

from __future__ import annotations


def grpo_run(tmp_path, model_dir, name, groups, config, **kwargs):
    """A GRPO run of inline ``groups`` under ``config`` on ``model_dir``, its adapter ``name`` in ``tmp_path``."""
    from kiln.trainers.grpo import admit_grpo, run_grpo

    job = admit_grpo(
        adapter_name=name,
        registry=tmp_path / "adapters",
        request={"groups": groups, "config": config},
        model_path=str(model_dir),
    )
    return run_grpo(job, **kwargs)


def adapter_weights(result):
    """The trained adapter's tensors."""
    from safetensors.torch import load_file

    return load_file(result.adapter_dir / "adapter_model.safetensors")


def assert_same_adapter(a, b):
    """``b`` ended with ``a``'s losses and adapter bytes."""
    assert b.losses == a.losses
    assert (b.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        a.adapter_dir / "adapter_model.safetensors"
    ).read_bytes()


def assert_same_run(a, b):
    """``b`` (a resumed run) ended exactly as ``a`` (uninterrupted): losses, tensors, optimizer, loop state, bytes."""
    assert b.status == a.status == "success"
    assert b.losses == a.losses
    assert b.final_state.adapter == a.final_state.adapter
    assert b.final_state.optimizer == a.final_state.optimizer
    assert b.final_state.loop_state == a.final_state.loop_state
    assert (b.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        a.adapter_dir / "adapter_model.safetensors"
    ).read_bytes()


def assert_same_opd_run(whole, resumed):
    """An OPD run resumed from a checkpoint ended as the uninterrupted one: losses, adapter bytes, diagnostics."""
    assert resumed.status == "success", resumed.receipt.get("failure_message")
    assert resumed.losses == whole.losses
    assert (resumed.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        whole.adapter_dir / "adapter_model.safetensors"
    ).read_bytes()
    assert resumed.receipt["opd"]["collapse_diagnostics"][-1] == whole.receipt["opd"]["collapse_diagnostics"][-1]


def admit_kind(kind, tmp_path, model_dir, teachers, rows, memory):
    """The smallest request of ``kind`` (from the conversations ``rows``; OPD's teacher ``tutor`` in ``teachers``),
    admitted through the trainer registry in a context whose defaults are ``memory`` (the server's training.*)."""
    from kiln.trainers import TRAINERS, TrainingContext

    prompt = rows[0]["messages"][:1]
    bodies = {
        "sft": {"examples": rows[:2]},
        "grpo": {"groups": [{"messages": prompt, "completions": [{"text": "a", "reward": 1.0}]}]},
        "opd": {"teacher": "tutor", "prompts": [{"messages": prompt}]},
    }
    context = TrainingContext(
        registry=tmp_path / "adapters", model_path=str(model_dir), teachers_root=teachers, memory=memory
    )
    return TRAINERS[kind].admit({**bodies[kind], "config": {"output_name": "bot"}}, adapter_name="bot", context=context)
