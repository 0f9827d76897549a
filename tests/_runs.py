"""Assertions the exact-resume tests share."""

from __future__ import annotations


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
