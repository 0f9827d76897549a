"""GRPO gradient accumulation: ``gradient_accumulation_steps`` groups (``per_sample``: completions of a group) add
their gradients before one optimizer step whose loss is the token mean over all of them; checkpoints land on step
boundaries, a cancelled run resumes to the bytes of an uninterrupted one, and a changed accumulation is refused."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load_file

from kiln import contracts
from kiln.errors import CheckpointError
from kiln.trainers.grpo import admit_grpo, run_grpo

PROMPT = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
SHORT = {
    "messages": PROMPT,
    "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}],
}
LONG = {
    "messages": [{"role": "user", "content": "Name a colour."}],
    "completions": [
        {"text": "Blue, like the sky on a clear summer day.", "reward": 1.0},
        {"text": "red", "reward": 0.0},
        {"text": "A deep and quiet green, I think.", "reward": 0.5},
    ],
}
SGD = {"seed": 4, "learning_rate": 0.05, "optimizer": {"kind": "sgd"}}


def _admit(tmp_path, tiny_model_dir, name, groups, config):
    return admit_grpo(
        adapter_name=name,
        registry=tmp_path / "adapters",
        request={"groups": groups, "config": config},
        model_path=str(tiny_model_dir),
    )


def _run(tmp_path, tiny_model_dir, name, groups, config, **kwargs):
    result = run_grpo(_admit(tmp_path, tiny_model_dir, name, groups, config), **kwargs)
    assert result.status == "success", result.receipt.get("failure_message")
    return result


def _weights(result):
    return load_file(result.adapter_dir / "adapter_model.safetensors")


def _action_tokens(tmp_path, tiny_model_dir, group):
    job = _admit(tmp_path, tiny_model_dir, "count", [group], {})
    return sum(sum(c.action_mask) for c in job.ingestion.groups[0].completions)


def test_two_groups_accumulated_take_the_token_mean_of_both(tmp_path, tiny_model_dir):
    # SGD's first step is W0 - lr * gradient, linear in the gradient: the accumulated step must move the weights by
    # the action-token-weighted mean of the two groups' own steps, and its loss is the same weighted mean
    n_short = _action_tokens(tmp_path, tiny_model_dir, SHORT)
    n_long = _action_tokens(tmp_path, tiny_model_dir, LONG)
    assert n_long > 3 * n_short  # weighting by tokens and averaging the groups' means differ clearly
    short = _run(tmp_path, tiny_model_dir, "short", [SHORT], SGD)
    short2 = _run(tmp_path, tiny_model_dir, "short2", [SHORT], {**SGD, "learning_rate": 0.1})
    long = _run(tmp_path, tiny_model_dir, "long", [LONG], SGD)
    both = _run(tmp_path, tiny_model_dir, "both", [SHORT, LONG], {**SGD, "gradient_accumulation_steps": 2})
    assert len(both.losses) == 1
    w_short, w_long = n_short / (n_short + n_long), n_long / (n_short + n_long)
    expected_loss = w_short * short.losses[0] + w_long * long.losses[0]
    assert both.losses[0] == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
    mean_of_means = (short.losses[0] + long.losses[0]) / 2
    assert abs(expected_loss - mean_of_means) > 1e-3 * max(abs(expected_loss), 1e-3)  # the check can fail
    a, a2, b, ab = _weights(short), _weights(short2), _weights(long), _weights(both)
    for name in ab:
        start = 2 * a[name] - a2[name]  # the initial tensor, from two learning rates
        expected = start + w_short * (a[name] - start) + w_long * (b[name] - start)
        torch.testing.assert_close(ab[name], expected, rtol=1e-4, atol=1e-6, msg=name)
    for path in (both.receipt_path, both.manifest_path):
        assert contracts.validate_path(path).valid, path
    assert both.receipt["config"]["gradient_accumulation_steps"] == 2


def test_per_sample_accumulation_averages_the_completions_means(tmp_path, tiny_model_dir):
    # per_sample: a step of two completions has the mean of their own token means as its loss; the first
    # completion's loss at the initial weights comes from a run that starts with it (advantages ignore order)
    config = {**SGD, "loss_aggregation": "per_sample"}
    flipped = {**LONG, "completions": [LONG["completions"][1], LONG["completions"][0], LONG["completions"][2]]}
    first = _run(tmp_path, tiny_model_dir, "first", [LONG], config)
    second = _run(tmp_path, tiny_model_dir, "second", [flipped], config)
    paired = _run(tmp_path, tiny_model_dir, "paired", [LONG, SHORT], {**config, "gradient_accumulation_steps": 2})
    assert len(first.losses) == 3
    assert len(paired.losses) == 3  # LONG: 2 + 1 completions (no step spans two groups), SHORT: 2
    assert paired.losses[0] == pytest.approx((first.losses[0] + second.losses[0]) / 2, rel=1e-5, abs=1e-7)
    assert contracts.validate_path(paired.manifest_path).valid


def test_an_accumulating_run_resumes_to_the_bytes_of_an_uninterrupted_one(tmp_path, tiny_model_dir):
    groups = [SHORT, LONG, SHORT, LONG, SHORT]
    config = {"seed": 3, "checkpoint_interval": 3, "micro_batch_size": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"kind": "adam_w"}, "learning_rate": 0.01,
              "kl_reference_policy": {"kind": "ema", "decay": 0.5, "refresh_every": 1},
              "lr_scheduler": {"kind": "cosine", "warmup_steps": 1, "min_lr_ratio": 0.1}}  # fmt: skip
    straight = _run(tmp_path, tiny_model_dir, "straight", groups, config)
    assert len(straight.losses) == 3  # groups 1-2, 3-4, 5
    # checkpoint_interval 3 groups: due at group 3, published at the end of the step that holds it (group 4)
    assert [p.name for p in straight.checkpoints] == ["straight-checkpoint-step-00000002.kiln-checkpoint"]
    stop = threading.Event()
    cut = run_grpo(
        _admit(tmp_path, tiny_model_dir, "cut", groups, config),
        progress=lambda event: stop.set() if event["step"] == 1 else None,  # mid-step: the step finishes first
        cancel=stop,
    )
    assert cut.cancelled
    assert cut.checkpoints[-1].name == "cut-checkpoint-step-00000001.kiln-checkpoint"
    assert contracts.validate_path(cut.checkpoints[-1]).valid
    for changed in ({"gradient_accumulation_steps": 1}, {"gradient_accumulation_steps": 3}):
        with pytest.raises(CheckpointError, match=r"effective_config\.gradient_accumulation_steps"):
            _admit(tmp_path, tiny_model_dir, "cut", groups,
                   {**config, **changed, "resume_checkpoint": cut.checkpoints[-1].name})  # fmt: skip
    resumed = _run(tmp_path, tiny_model_dir, "cut", groups, {**config, "resume_checkpoint": cut.checkpoints[-1].name})
    assert resumed.losses == straight.losses
    assert (resumed.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        straight.adapter_dir / "adapter_model.safetensors"
    ).read_bytes()
