"""The effective GRPO configuration: defaults filled once, every spec/40 refusal named."""

from __future__ import annotations

import pytest
from _effective import check_grpo_request
from _effective import grpo_effective as effective_grpo_config

from kiln.errors import ContractError, RequestError

GROUP = {
    "messages": [{"role": "user", "content": "2+2?"}],
    "completions": [{"text": "4", "reward": 1.0}, {"text": "5", "reward": 0.0}],
}


def _refused(config: dict, field: str, code: str = "training_invalid_request") -> RequestError:
    with pytest.raises(RequestError) as info:
        effective_grpo_config(config, "g")
    assert info.value.code == code
    assert field in info.value.message
    return info.value


def test_defaults_are_filled_and_the_seed_is_canonical():
    cfg = effective_grpo_config({"seed": "42"}, "g")
    assert cfg["seed"] == 42
    assert effective_grpo_config({"seed": 42}, "g") == cfg
    assert cfg["learning_rate"] == 2e-3  # the GRPO muon default
    assert cfg["kl_coeff"] == 0.1
    assert cfg["kl_estimator"] == "k1"
    assert cfg["advantage_mode"] == "dr_grpo"
    assert cfg["loss_aggregation"] == "token_level"
    assert cfg["is_level"] == "token"
    assert cfg["behavior_policy"] == "no_importance_correction"
    assert cfg["kl_reference_policy"] == {"kind": "base_per_step"}
    # ECHO and dynamic sampling are on by default, as in the reference
    assert cfg["loss"] == {
        "echo": {"lambda": 0.05, "env_mask_mode": "env_only", "warning_filter": True},
        "no_policy_loss": False,
    }
    assert cfg["dynamic_sampling"] is True
    assert effective_grpo_config({"loss": {"echo": None}}, "g")["loss"]["echo"] is None
    assert effective_grpo_config({"optimizer": {"kind": "adam_w"}}, "g")["learning_rate"] == 1e-5


def test_the_reference_alias_is_recorded_under_its_canonical_name_and_not_both():
    cfg = effective_grpo_config({"reference_policy": {"kind": "ema", "decay": 0.9}}, "g")
    assert cfg["kl_reference_policy"] == {"kind": "ema", "decay": 0.9, "refresh_every": 1}
    _refused({"reference_policy": {"kind": "none"}, "kl_reference_policy": {"kind": "none"}}, "reference_policy")


def test_kl_against_no_reference_is_refused_unless_the_term_is_off():
    error = _refused({"kl_reference_policy": {"kind": "none"}}, "kl_reference_policy")
    assert error.pointer == "/config/kl_reference_policy"
    assert effective_grpo_config({"kl_reference_policy": {"kind": "none"}, "kl_coeff": 0}, "g")["kl_coeff"] == 0
    assert effective_grpo_config({"kl_reference_policy": {"kind": "none"}, "kl_estimator": "none"}, "g")


def test_inverted_reward_filter_bounds_are_refused():
    _refused({"reward_filter_var_min": 0.5, "reward_filter_var_max": 0.1}, "reward_filter_var_min")


def test_echo_only_training_needs_an_echo_term_and_opd_inside_grpo_is_unsupported():
    _refused({"loss": {"no_policy_loss": True, "echo": None}}, "loss.no_policy_loss")
    _refused({"loss": {"no_policy_loss": True, "echo": {"lambda": 0}}}, "loss.no_policy_loss")
    cfg = effective_grpo_config({"loss": {"no_policy_loss": True, "echo": {}}}, "g")
    assert cfg["loss"]["echo"] == {"lambda": 0.05, "env_mask_mode": "env_only", "warning_filter": True}
    _refused({"loss": {"opd": {"teacher": "t"}}}, "loss.opd", "training_backend_unsupported")


def test_unsafe_lora_scale_and_shape_conversion_are_refused():
    _refused({"lora_rank": 4, "lora_alpha": 32}, "unsafe_lora_scale")
    assert effective_grpo_config({"lora_rank": 4, "lora_alpha": 32, "allow_high_lora_scale": True}, "g")
    _refused({"allow_adapter_shape_conversion": True}, "allow_adapter_shape_conversion", "training_backend_unsupported")


def test_schema_violations_name_the_pointer():
    with pytest.raises(RequestError) as info:
        effective_grpo_config({"is_level": "batch"}, "g")
    assert info.value.pointer == "/is_level"


def test_request_level_rules():
    check_grpo_request({"groups": [GROUP]})
    check_grpo_request({"dataset_path": "/data/groups.jsonl", "dry_run": True})
    with pytest.raises(RequestError) as info:
        check_grpo_request({"groups": [GROUP], "post_eval": {"suite": "s"}})
    assert info.value.code == "training_backend_unsupported"
    assert "post_eval" in info.value.message
    for body, pointer, code, needle in (  # the schema states these (issue "Serving that real clients can rely on")
        ({"groups": [GROUP], "dry_run": True}, "/dataset_path", "inconsistent_fields", "needs a `dataset_path`"),
        ({"dataset": "hub/x"}, "/dataset", "wrong_type", "no dataset registry"),
        ({"groups": [GROUP], "dataset_split": "train"}, "/dataset_split", "wrong_type", "no dataset registry"),
    ):
        with pytest.raises(ContractError) as refused:
            check_grpo_request(body)
        found = {p.pointer: p for p in refused.value.problems}
        assert found[pointer].code == code
        assert needle in found[pointer].message
    check_grpo_request({"groups": [GROUP], "dataset": None, "dataset_split": None})  # null is the one accepted value
    with pytest.raises(ContractError):
        check_grpo_request({"groups": [GROUP], "agentic_groups": [GROUP]})
    with pytest.raises(ContractError):
        check_grpo_request({"groups": [{"messages": [], "completions": [{"text": "x", "reward": "high"}]}]})
