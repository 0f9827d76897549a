"""The GRPO trainer on the tiny model: rewarded completions become more likely, every
objective variant writes a valid receipt and manifest, and the dry run checks everything
without a forward pass."""

from __future__ import annotations

import json
import warnings

import pytest

from kiln import contracts
from kiln.errors import CheckpointError, ContractError, RequestError
from kiln.trainers.grpo import admit_grpo, run_grpo

PROMPT = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
GROUP = {
    "messages": PROMPT,
    "completions": [
        {"text": "yes", "reward": 1.0},
        {"text": "no", "reward": 0.0},
        {"text": "maybe", "reward": 0.25},
    ],
}


def _admit(tmp_path, tiny_model_dir, request, name="policy"):
    return admit_grpo(
        adapter_name=name, registry=tmp_path / "adapters", request=request, model_path=str(tiny_model_dir)
    )


def _completion_logp(model_dir, adapter_dir, text):
    """Mean log-probability of the completion's action tokens under base (+ adapter)."""
    import torch
    from peft import PeftModel

    from kiln.data.grpo import read_groups
    from kiln.model import load_base_model

    loaded = load_base_model(model_dir)
    ingestion = read_groups(
        tokenizer=loaded.tokenizer, groups=[{"messages": PROMPT, "completions": [{"text": text, "reward": 0.0}]}]
    )
    completion = ingestion.groups[0].completions[0]
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5 for a renamed attribute
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = loaded.model if adapter_dir is None else PeftModel.from_pretrained(loaded.model, adapter_dir)
    ids = torch.tensor([completion.input_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    taken = logp.gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    return float(taken[torch.tensor(completion.action_mask)].mean())


def test_training_makes_the_rewarded_completion_more_likely(tmp_path, tiny_model_dir):
    request = {"groups": [GROUP] * 6, "config": {"seed": 5, "learning_rate": 0.01}}
    result = run_grpo(_admit(tmp_path, tiny_model_dir, request))
    assert result.status == "success", result.receipt.get("failure_message")
    before_yes = _completion_logp(tiny_model_dir, None, "yes")
    before_no = _completion_logp(tiny_model_dir, None, "no")
    after_yes = _completion_logp(tiny_model_dir, result.adapter_dir, "yes")
    after_no = _completion_logp(tiny_model_dir, result.adapter_dir, "no")
    assert after_yes > before_yes
    assert after_no < before_no
    assert contracts.validate_path(result.receipt_path).valid
    assert contracts.validate_path(result.manifest_path).valid
    audit = result.receipt["grpo"]["policy_audit"]
    assert audit["importance_sampling"]["ratio_scope"] == "token"
    assert audit["kl_reference"]["token_observations"] > 0
    assert result.receipt["data"]["groups_trained"] == 6


@pytest.mark.parametrize(
    "config",
    [
        {"is_level": "sequence", "kl_estimator": "k3"},
        {"is_level": "cispo", "loss_aggregation": "per_sample", "kl_reference_policy": {"kind": "ema", "decay": 0.5}},
        {"kl_reference_policy": {"kind": "none"}, "kl_coeff": 0, "advantage_mode": "vanilla"},
        {"entropy_aware_kl_quantile": 0.5, "clip_eps_high": 0.3},
    ],
    ids=["gspo-k3", "cispo-ema-per-sample", "no-reference-vanilla", "entropy-mask"],
)
def test_every_objective_variant_trains_and_writes_a_valid_receipt(tmp_path, tiny_model_dir, config):
    job = _admit(tmp_path, tiny_model_dir, {"groups": [GROUP, GROUP], "config": {"seed": 1, **config}})
    result = run_grpo(job)
    assert result.status == "success", result.receipt.get("failure_message")
    reference_ms = result.receipt["phase_timings"]["reference_forward_ms"]
    assert (reference_ms > 0) == job.config.kl_on  # no reference forward runs when no KL term reads it
    assert contracts.validate_path(result.receipt_path).valid
    grpo = result.receipt["grpo"]
    assert grpo["is_level"] == config.get("is_level", "token")
    expected_steps = 6 if config.get("loss_aggregation") == "per_sample" else 2
    assert len(result.losses) == expected_steps


def test_echo_trains_on_observation_tokens(tmp_path, tiny_model_dir):
    trajectory = [
        {"role": "assistant", "content": "Let me check.", "kind": "action"},
        {"role": "tool", "content": "WARNING: slow\nThe sky is blue.", "kind": "observation", "warning_prefix_len": 14},
        {"role": "assistant", "content": "Yes.", "kind": "action"},
    ]
    group = {
        "messages": PROMPT,
        "completions": [{"text": "", "reward": 1.0, "trajectory": trajectory}, {"text": "no", "reward": 0.0}],
    }
    request = {"groups": [group], "config": {"seed": 2, "loss": {"echo": {"lambda": 0.1}}}}
    result = run_grpo(_admit(tmp_path, tiny_model_dir, request))
    assert result.status == "success", result.receipt.get("failure_message")
    echo = result.receipt["echo"]
    assert echo["enabled"] is True
    assert echo["initial_env_ce"] > 0
    assert result.receipt["token_counts"]["warning_tokens_filtered"] > 0


def test_the_dry_run_checks_everything_without_a_forward_pass(tmp_path, tiny_model_dir):
    data = tmp_path / "groups.jsonl"
    data.write_text(json.dumps(GROUP) + "\n\n" + json.dumps(GROUP) + "\n", encoding="utf-8")
    job = _admit(tmp_path, tiny_model_dir, {"dataset_path": str(data), "dry_run": True, "config": {"seed": 4}})

    def no_forward(*args, **kwargs):
        raise AssertionError("the dry run ran the model")

    job.loaded.model.forward = no_forward
    result = run_grpo(job)
    assert result.status == "success", result.receipt.get("failure_message")
    assert result.receipt["training_data"]["source"] == "jsonl_grpo_groups_dry_run"
    assert result.receipt["data"]["groups_read"] == 2
    assert result.manifest_path is None
    assert sorted(p.name for p in result.adapter_dir.iterdir()) == ["train_receipt.json"]
    assert contracts.validate_path(result.receipt_path).valid
    from kiln.adapters import list_adapters

    (entry,) = list_adapters(job.registry)["available"]
    assert entry["status"] == "dry_run"  # not listed as a failed or invalid adapter
    assert entry["error"] is None


def test_a_dry_run_that_would_train_nothing_writes_a_failed_zero_groups_receipt(tmp_path, tiny_model_dir):
    flat = {"messages": PROMPT, "completions": [{"text": "a", "reward": 1.0}, {"text": "b", "reward": 1.0}]}
    data = tmp_path / "groups.jsonl"
    data.write_text(json.dumps(flat) + "\n", encoding="utf-8")
    request = {"dataset_path": str(data), "dry_run": True, "config": {"dynamic_sampling": True}}
    result = run_grpo(_admit(tmp_path, tiny_model_dir, request))
    assert result.status == "failed"
    assert result.receipt["failure_reason"] == "zero_groups"
    assert result.receipt["grpo"]["dynamic_groups_filtered"] == 1
    assert contracts.validate_path(result.receipt_path).valid


def test_a_file_changed_after_admission_fails_the_run_naming_it(tmp_path, tiny_model_dir):
    data = tmp_path / "groups.jsonl"
    data.write_text(json.dumps(GROUP) + "\n", encoding="utf-8")
    job = _admit(tmp_path, tiny_model_dir, {"dataset_path": str(data), "config": {"seed": 4}})
    data.write_text(json.dumps(GROUP) + "\n" + json.dumps(GROUP) + "\n", encoding="utf-8")
    result = run_grpo(job)
    assert result.status == "failed"
    assert str(data) in result.receipt["failure_message"]


def test_bad_groups_and_unsupported_settings_are_refused_at_admission(tmp_path, tiny_model_dir):
    thinking_only = [{"role": "assistant", "content": "hmm", "kind": "context"}]
    empty_text = {"messages": PROMPT, "completions": [{"text": "", "reward": 1.0, "trajectory": thinking_only}]}
    for request, needle in (
        ({"groups": [empty_text]}, "zero_action_tokens"),
        ({"groups": [{"messages": PROMPT, "completions": []}]}, "/groups/0/completions"),
        ({"groups": [{"messages": PROMPT, "completions": [{"text": "x", "reward": 1, "trajectory": [
            {"role": "assistant", "content": "x", "kind": "thought"}]}]}]}, "kind"),
    ):  # fmt: skip
        with pytest.raises((RequestError, ContractError)) as info:
            _admit(tmp_path, tiny_model_dir, request)
        assert needle in info.value.message


@pytest.mark.parametrize(
    ("streamed", "config"),
    [
        (False, {}),
        (True, {}),
        (False, {"kl_reference_policy": {"kind": "ema", "decay": 0.5, "refresh_every": 2}}),
        (True, {"kl_reference_policy": {"kind": "ema", "decay": 0.9}, "loss_aggregation": "per_sample"}),
        (False, {"lr_scheduler": {"kind": "cosine", "warmup_steps": 2, "min_lr_ratio": 0.1}}),
    ],
    ids=["inline", "streamed", "inline-ema", "streamed-ema-per-sample", "inline-warmup-cosine"],
)
def test_cancel_then_resume_equals_the_uninterrupted_run(tmp_path, tiny_model_dir, streamed, config):
    import threading

    data = tmp_path / "groups.jsonl"
    data.write_text((json.dumps(GROUP) + "\n") * 5, encoding="utf-8")
    source = {"dataset_path": str(data)} if streamed else {"groups": [GROUP] * 5}
    cfg = {"seed": 3, "checkpoint_interval": 2, **config}
    straight = run_grpo(_admit(tmp_path, tiny_model_dir, {**source, "config": dict(cfg)}, name="straight"))
    assert straight.status == "success", straight.receipt.get("failure_message")

    stop = threading.Event()
    cut = run_grpo(
        _admit(tmp_path, tiny_model_dir, {**source, "config": dict(cfg)}, name="cut"),
        progress=lambda event: stop.set() if event["step"] == 3 else None,
        cancel=stop,
    )
    assert cut.cancelled
    assert cut.receipt["failure_reason"] == "cancelled"
    newest = cut.checkpoints[-1]
    assert contracts.validate_path(newest).valid
    resumed = run_grpo(
        _admit(tmp_path, tiny_model_dir, {**source, "config": {**cfg, "resume_checkpoint": newest.name}}, name="cut")
    )
    assert resumed.status == "success", resumed.receipt.get("failure_message")
    assert resumed.losses == straight.losses
    assert (resumed.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        straight.adapter_dir / "adapter_model.safetensors"
    ).read_bytes()
    assert resumed.receipt["grpo"]["policy_audit"] == straight.receipt["grpo"]["policy_audit"]


def test_a_resume_with_a_changed_setting_is_refused_naming_it(tmp_path, tiny_model_dir):
    import threading

    stop = threading.Event()
    cut = run_grpo(
        _admit(tmp_path, tiny_model_dir, {"groups": [GROUP] * 4, "config": {"seed": 3, "checkpoint_interval": 1}}),
        progress=lambda event: stop.set(),
        cancel=stop,
    )
    with pytest.raises(CheckpointError) as info:
        _admit(
            tmp_path,
            tiny_model_dir,
            {
                "groups": [GROUP] * 4,
                "config": {"checkpoint_interval": 1, "kl_coeff": 0.5, "resume_checkpoint": cut.checkpoints[-1].name},
            },
        )
    assert info.value.code == "checkpoint_incompatible"
    assert "effective_config.kl_coeff" in info.value.message
