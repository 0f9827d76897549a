"""GRPO micro-batches: a group's completions in padded batches give the losses of one forward each.

``micro_batch_size`` > 1 runs right-padded batches (one policy forward and one reference forward inside a single
adapter switch per batch) and computes the model's logits only where the loss reads them. Every objective variant
must train as the unbatched run does -- losses, audits and weights to fp32 rounding -- and resume exactly.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
from _runs import adapter_weights, grpo_run

from kiln import contracts
from kiln.errors import CheckpointError

PROMPT = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
GROUP = {
    "messages": PROMPT,
    "completions": [
        {"text": "yes", "reward": 1.0},
        {"text": "no, it is not blue at all", "reward": 0.0},  # of another length: padding matters
        {"text": "maybe", "reward": 0.25},
        {"text": "Yes, it is blue on a clear day.", "reward": 0.75},
    ],
}
TRAJECTORY = [
    {"role": "assistant", "content": "Let me check.", "kind": "action"},
    {"role": "tool", "content": "WARNING: slow\nThe sky is blue.", "kind": "observation", "warning_prefix_len": 14},
    {"role": "assistant", "content": "Yes.", "kind": "action"},
]
ECHO_GROUP = {
    "messages": PROMPT,
    "completions": [{"text": "", "reward": 1.0, "trajectory": TRAJECTORY}, {"text": "no", "reward": 0.0}],
}


@pytest.mark.parametrize(
    ("groups", "config"),
    [
        ([GROUP] * 3, {}),
        ([GROUP] * 2, {"is_level": "sequence", "kl_estimator": "k3"}),
        ([GROUP] * 2, {"kl_reference_policy": {"kind": "ema", "decay": 0.5, "refresh_every": 1}}),
        ([GROUP] * 2, {"entropy_aware_kl_quantile": 0.5, "clip_eps_high": 0.3}),
        ([GROUP] * 2, {"is_level": "cispo", "loss_aggregation": "per_sample"}),
        ([ECHO_GROUP, GROUP], {"loss": {"echo": {"lambda": 0.1}}}),
    ],
    ids=["token-k1-base", "gspo-k3", "ema", "entropy-mask", "cispo-per-sample", "echo"],
)
@pytest.mark.parametrize("width", [2, 4])
def test_batched_forwards_train_as_one_forward_per_completion(tmp_path, tiny_model_dir, groups, config, width):
    # SGD: the update is linear in the gradient, so fp32 rounding in the forward stays rounding in the weights
    # (Adam divides by the root of the second moment and turns a 1e-9 change of a near-zero gradient into +-lr)
    base = {"seed": 4, "learning_rate": 0.05, "optimizer": {"kind": "sgd"}, **config}
    one = grpo_run(tmp_path, tiny_model_dir, "one", groups, base)
    batched = grpo_run(tmp_path, tiny_model_dir, "batched", groups, {**base, "micro_batch_size": width})
    assert one.status == batched.status == "success", batched.receipt.get("failure_message")
    assert len(batched.losses) == len(one.losses)
    torch.testing.assert_close(torch.tensor(batched.losses), torch.tensor(one.losses), rtol=1e-5, atol=1e-6)
    a, b = adapter_weights(one), adapter_weights(batched)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-6, msg=name)
    audit_one, audit_batched = one.receipt["grpo"]["policy_audit"], batched.receipt["grpo"]["policy_audit"]
    for block in ("importance_sampling", "kl_reference"):
        for key, value in audit_one[block].items():
            if isinstance(value, float):
                assert audit_batched[block][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (block, key)
            else:
                assert audit_batched[block][key] == value, (block, key)
    if "echo" in config.get("loss", {}):
        assert batched.receipt["echo"]["initial_env_ce"] == pytest.approx(one.receipt["echo"]["initial_env_ce"])
    assert contracts.validate_path(batched.receipt_path).valid
    assert json.loads(batched.receipt_path.read_text())["config"]["micro_batch_size"] == width


def test_a_batched_run_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, tiny_model_dir):
    config = {"seed": 3, "checkpoint_interval": 2, "micro_batch_size": 3}
    straight = grpo_run(tmp_path, tiny_model_dir, "straight", [GROUP] * 5, config)
    stop = threading.Event()
    cut = grpo_run(
        tmp_path,
        tiny_model_dir,
        "cut",
        [GROUP] * 5,
        config,
        progress=lambda event: stop.set() if event["step"] == 3 else None,
        cancel=stop,
    )
    assert cut.cancelled
    with pytest.raises(CheckpointError, match=r"effective_config\.micro_batch_size"):
        grpo_run(
            tmp_path,
            tiny_model_dir,
            "cut",
            [GROUP] * 5,
            {**config, "micro_batch_size": 2, "resume_checkpoint": cut.checkpoints[-1].name},
        )
    resumed = grpo_run(
        tmp_path, tiny_model_dir, "cut", [GROUP] * 5, {**config, "resume_checkpoint": cut.checkpoints[-1].name}
    )
    assert resumed.status == "success", resumed.receipt.get("failure_message")
    assert resumed.losses == straight.losses
    assert (resumed.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        straight.adapter_dir / "adapter_model.safetensors"
    ).read_bytes()
