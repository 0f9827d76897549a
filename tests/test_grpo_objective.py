"""GRPO objective: every term against numbers worked out by hand, plus the audit contracts.

Tensors are float64 and tiny (2 completions × 3 action positions); the hand arithmetic is
written out beside each expectation.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import random
from functools import cache
from pathlib import Path

import jsonschema
import kiln_contracts
import pytest
import torch

import kiln.training.grpo_objective as objective
from kiln.contracts import problems
from kiln.training.echo import EchoAccumulator, echo_loss
from kiln.training.grpo_objective import (
    DROP_EQUAL_REWARDS,
    DROP_VARIANCE_ABOVE_MAX,
    DROP_VARIANCE_BELOW_MIN,
    EmaReference,
    ImportanceSamplingAccumulator,
    KlReferenceAccumulator,
    RewardStatsAccumulator,
    advantages,
    aggregate,
    group_reward_variance,
    keep_group,
    kl_estimate,
    policy_audit_receipt,
    policy_loss,
    reward_stats,
)

F64 = torch.float64
ROOT = Path(__file__).resolve().parent.parent
# two completions of three action positions; the second one's last position is padding
MASK = torch.tensor([[True, True, True], [True, True, False]])


def t(rows):
    return torch.tensor(rows, dtype=F64)


def close(actual, expected, *, tol=1e-12):
    torch.testing.assert_close(actual, t(expected) if not torch.is_tensor(expected) else expected, rtol=0, atol=tol)


@cache
def _validator(defname):
    schema = {"$ref": f"#/$defs/{defname}", "$defs": kiln_contracts.load_bundle()["$defs"]}
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def schema_errors(defname, value):
    return [f"{e.json_path}: {e.message}" for e in _validator(defname).iter_errors(value)]


def with_ratios(ratios, *, logp_new=None):
    """logp_new (leaf) and logp_behavior with exp(logp_new − logp_behavior) = ``ratios``; padding is 0."""
    ratios = t(ratios)
    new = t(logp_new) if logp_new is not None else torch.full_like(ratios, -1.0)
    behavior = new - torch.log(ratios)
    return new.requires_grad_(), behavior


# --- advantages --------------------------------------------------------------------------


def test_dr_grpo_advantage_subtracts_the_group_mean():
    # r = [1, 0, 0, 1], mean 0.5 → A = [0.5, −0.5, −0.5, 0.5]
    close(advantages(t([1.0, 0.0, 0.0, 1.0]), "dr_grpo"), [0.5, -0.5, -0.5, 0.5])


def test_vanilla_advantage_divides_by_the_population_std_plus_epsilon():
    # r = [1, 0, 0, 1]: population std = sqrt(mean([0.25]*4)) = 0.5 (the sample std would be 0.577…)
    # A = ±0.5 / (0.5 + 1e-8)
    scale = 0.5 / (0.5 + 1e-8)
    close(advantages(t([1.0, 0.0, 0.0, 1.0]), "vanilla"), [scale, -scale, -scale, scale], tol=1e-15)
    # r = [0, 3]: mean 1.5, population std 1.5 → A = ±1.5/(1.5 + 1e-8)
    close(advantages(t([0.0, 3.0]), "vanilla"), [-1.5 / (1.5 + 1e-8), 1.5 / (1.5 + 1e-8)], tol=1e-15)


@pytest.mark.parametrize("mode", ["dr_grpo", "vanilla"])
def test_a_group_of_equal_rewards_or_one_completion_has_exactly_zero_advantage(mode):
    # 0.7·3/3 rounds to 0.6999999999999998, so r − mean would leave 2e-16 (×1e8 under vanilla)
    assert torch.equal(advantages(t([0.7, 0.7, 0.7]), mode), t([0.0, 0.0, 0.0]))
    assert torch.equal(advantages(t([0.7]), mode), t([0.0]))


def test_unknown_advantage_mode_or_bad_rewards_are_rejected():
    with pytest.raises(ValueError, match="advantage_mode"):
        advantages(t([1.0, 0.0]), "grpo")
    with pytest.raises(ValueError, match="1-D"):
        advantages(t([[1.0, 0.0]]), "dr_grpo")


# --- policy loss -------------------------------------------------------------------------


def test_token_level_loss_is_the_ppo_clipped_objective():
    # ε = 0.2 → clip range [0.8, 1.2]; A = +2 for completion 0, −1 for completion 1
    new, behavior = with_ratios([[0.5, 1.1, 1.5], [0.5, 1.0, 1.0]])
    adv = t([[2.0], [-1.0]])
    loss, audit = policy_loss(new, behavior, adv, MASK, is_level="token", clip_low=0.2)
    # completion 0 (A = 2):  ρ=0.5: min(1.0, 0.8·2=1.6) = 1.0 → −1.0
    #                        ρ=1.1: min(2.2, 2.2)       = 2.2 → −2.2
    #                        ρ=1.5: min(3.0, 1.2·2=2.4) = 2.4 → −2.4
    # completion 1 (A = −1): ρ=0.5: min(−0.5, −0.8) = −0.8 → 0.8
    #                        ρ=1.0: −1.0 → 1.0;  padding → 0
    close(loss, [[-1.0, -2.2, -2.4], [0.8, 1.0, 0.0]])
    # ratios 0.5, 1.1, 1.5, 0.5, 1.0: mean 4.6/5 = 0.92; below 0.8: two; above 1.2: one → 3/5
    assert audit == pytest.approx(
        {
            "ratio_scope": "token",
            "action_tokens": 5,
            "ratio_observations": 5,
            "mean_ratio": 0.92,
            "min_ratio": 0.5,
            "max_ratio": 1.5,
            "below_clip_count": 2,
            "above_clip_count": 1,
            "outside_clip_fraction": 0.6,
        },
        abs=1e-12,
    )
    # where min picks the clipped term (ρ=1.5 with A > 0, ρ=0.5 with A < 0) there is no gradient;
    # elsewhere dL/dlogp = −A·ρ: row 0 → −2·0.5 = −1.0, −2·1.1 = −2.2; row 1 → 1·1.0 = 1.0
    loss.sum().backward()
    close(new.grad, [[-1.0, -2.2, 0.0], [0.0, 1.0, 0.0]])


def test_sequence_level_ratio_is_the_exp_of_the_mean_token_log_ratio():
    # GSPO. log ρ row 0 = [0.5, 0.1, 0.3] → mean 0.3 → s0 = e^0.3 = 1.3498588075760032 (above 1.2)
    #        row 1 = [−0.6, −0.4, pad] → mean −0.5 → s1 = e^−0.5 = 0.6065306597126334 (below 0.8)
    new = t([[-1.0, -1.0, -1.0], [-1.0, -1.0, 0.0]]).requires_grad_()
    behavior = new.detach() - t([[0.5, 0.1, 0.3], [-0.6, -0.4, 123.0]])
    adv = t([[-2.0], [-1.0]])
    loss, audit = policy_loss(new, behavior, adv, MASK, is_level="sequence", clip_low=0.2)
    s0, s1 = math.exp(0.3), math.exp(-0.5)
    # row 0, A = −2: min(−2·s0 = −2.69972, 1.2·−2 = −2.4) = −2.69972 → 2.69972 on each token
    # row 1, A = −1: min(−s1 = −0.60653, 0.8·−1 = −0.8)   = −0.8     → 0.8 on each active token
    close(loss, [[2 * s0, 2 * s0, 2 * s0], [0.8, 0.8, 0.0]])
    # Σ loss over row 0 = −3·A·s0 and ds0/dlogp_t = s0/3 → d/dlogp_t = −A·s0 = 2·s0; row 1 is clipped → 0
    loss.sum().backward()
    close(new.grad, [[2 * s0, 2 * s0, 2 * s0], [0.0, 0.0, 0.0]])
    # one ratio per completion: mean (s0 + s1)/2 = 0.9781947336443183; s1 below, s0 above → 2/2
    assert audit == pytest.approx(
        {
            "ratio_scope": "sequence",
            "action_tokens": 5,
            "ratio_observations": 2,
            "mean_ratio": (s0 + s1) / 2,
            "min_ratio": s1,
            "max_ratio": s0,
            "below_clip_count": 1,
            "above_clip_count": 1,
            "outside_clip_fraction": 1.0,
        },
        abs=1e-12,
    )


def test_cispo_loss_uses_the_capped_ratio_and_clips_from_above_only():
    # cap 2.0; ρ row 0 = [0.5, 1.0, 3.0] → w = [0.5, 1.0, 2.0];  row 1 = [6.0, 0.1, pad] → w = [2.0, 0.1]
    new, behavior = with_ratios([[0.5, 1.0, 3.0], [6.0, 0.1, 1.0]], logp_new=[[-1.0, -2.0, -0.5], [-0.25, -1.0, 0.0]])
    adv = t([[2.0], [-1.0]])
    loss, audit = policy_loss(new, behavior, adv, MASK, is_level="cispo", clip_low=0.2, cispo_max_weight=2.0)
    # loss = −w·A·logp:  row 0: −0.5·2·(−1) = 1.0;  −1·2·(−2) = 4.0;  −2·2·(−0.5) = 2.0
    #                    row 1: −2·(−1)·(−0.25) = −0.5;  −0.1·(−1)·(−1) = −0.1
    close(loss, [[1.0, 4.0, 2.0], [-0.5, -0.1, 0.0]])
    # ratios 0.5, 1, 3, 6, 0.1: mean 10.6/5 = 2.12; above the cap: 3 and 6; 0.1 < 1 − ε is not counted
    assert audit == pytest.approx(
        {
            "ratio_scope": "token",
            "action_tokens": 5,
            "ratio_observations": 5,
            "mean_ratio": 2.12,
            "min_ratio": 0.1,
            "max_ratio": 6.0,
            "below_clip_count": 0,
            "above_clip_count": 2,
            "outside_clip_fraction": 0.4,
        },
        abs=1e-12,
    )


def test_cispo_gradient_is_minus_the_capped_weight_times_advantage_times_grad_logp():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, generator=gen, dtype=F64).requires_grad_()
    ids = torch.tensor([1, 0, 3])
    logp = torch.log_softmax(logits, dim=-1).gather(1, ids[:, None]).T  # [1, 3]
    ratios = t([[0.5, 1.0, 3.0]])
    behavior = logp.detach() - torch.log(ratios)
    loss, _ = policy_loss(
        logp, behavior, t([[2.0]]), torch.ones(1, 3, dtype=torch.bool), is_level="cispo", cispo_max_weight=2.0
    )
    loss.sum().backward()
    # ∇θ_t logπ(id_t) = onehot(id_t) − softmax(θ_t); expected −min(ρ_t, 2)·A·∇logπ with min(ρ, 2) = [0.5, 1, 2]
    grad_logp = torch.nn.functional.one_hot(ids, 4).to(F64) - torch.softmax(logits.detach(), dim=-1)
    expected = -t([0.5, 1.0, 2.0])[:, None] * 2.0 * grad_logp
    close(logits.grad, expected, tol=1e-14)


def test_asymmetric_clip_changes_only_the_upper_side():
    ratios = [[0.5, 0.9, 1.1, 1.25, 1.4], [0.5, 0.9, 1.1, 1.25, 1.4]]
    mask = torch.ones(2, 5, dtype=torch.bool)
    adv = t([[1.0], [-1.0]])
    new, behavior = with_ratios(ratios)
    symmetric, sym_audit = policy_loss(new, behavior, adv, mask, is_level="token", clip_low=0.2)
    asymmetric, asym_audit = policy_loss(new, behavior, adv, mask, is_level="token", clip_low=0.2, clip_high=0.3)
    # A = +1: −min(ρ, clip(ρ)): symmetric clip [0.8, 1.2] caps 1.25 and 1.4 at 1.2; [0.8, 1.3] caps only 1.4 at 1.3
    # A = −1: −min(−ρ, −clip(ρ)) = max(ρ, clip(ρ)): the lower bound lifts 0.5 to 0.8 in both; the upper does not bind
    close(symmetric, [[-0.5, -0.9, -1.1, -1.2, -1.2], [0.8, 0.9, 1.1, 1.25, 1.4]])
    close(asymmetric, [[-0.5, -0.9, -1.1, -1.25, -1.3], [0.8, 0.9, 1.1, 1.25, 1.4]])
    assert sym_audit["below_clip_count"] == asym_audit["below_clip_count"] == 2
    assert (sym_audit["above_clip_count"], asym_audit["above_clip_count"]) == (4, 2)


@pytest.mark.parametrize("is_level", ["token", "sequence", "cispo"])
def test_no_importance_correction_gives_ratio_one_and_the_plain_policy_gradient(is_level):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 4, generator=gen, dtype=F64).requires_grad_()
    ids = torch.tensor([[1, 0, 3], [2, 2, 0]])
    logp = torch.log_softmax(logits, dim=-1).gather(2, ids[..., None]).squeeze(-1)
    adv = t([[1.5], [-0.5]])
    loss, audit = policy_loss(logp, None, adv, MASK, is_level=is_level)
    # ρ ≡ 1: token and sequence give −A per token, cispo −A·logp; each has gradient −A·∇logp
    # (sequence: Σ_t −A·s with ds/dlogp_t = 1/T over T tokens gives −A per token too)
    scope = "sequence" if is_level == "sequence" else "token"
    observations = 2 if is_level == "sequence" else 5
    assert audit == {
        "ratio_scope": scope,
        "action_tokens": 5,
        "ratio_observations": observations,
        "mean_ratio": 1.0,
        "min_ratio": 1.0,
        "max_ratio": 1.0,
        "below_clip_count": 0,
        "above_clip_count": 0,
        "outside_clip_fraction": 0.0,
    }
    loss.sum().backward()
    grad_logp = torch.nn.functional.one_hot(ids, 4).to(F64) - torch.softmax(logits.detach(), dim=-1)
    expected = -adv[..., None] * grad_logp * MASK[..., None]
    close(logits.grad, expected, tol=1e-14)


@pytest.mark.parametrize("is_level", ["token", "sequence", "cispo"])
def test_padding_values_never_reach_the_loss_the_gradient_or_the_audit(is_level):
    new, behavior = with_ratios([[0.5, 1.1, 1.5], [0.5, 1.0, 1.0]])
    with torch.no_grad():
        new[1, 2] = float("nan")
    behavior[1, 2] = float("-inf")
    loss, audit = policy_loss(new, behavior, t([[2.0], [-1.0]]), MASK, is_level=is_level)
    assert torch.isfinite(loss).all()
    assert loss[1, 2] == 0
    loss.sum().backward()
    assert torch.isfinite(new.grad).all()
    assert new.grad[1, 2] == 0
    assert audit["action_tokens"] == 5
    assert math.isfinite(audit["mean_ratio"])


@pytest.mark.parametrize("is_level", ["token", "sequence", "cispo"])
def test_float32_inputs_give_float32_losses_that_agree_with_float64(is_level):
    new, behavior = with_ratios([[0.5, 1.1, 1.5], [0.5, 1.0, 1.0]])
    adv = t([[2.0], [-1.0]])
    wide, wide_audit = policy_loss(new, behavior, adv, MASK, is_level=is_level)
    narrow, narrow_audit = policy_loss(new.float(), behavior.float(), adv.float(), MASK, is_level=is_level)
    kl, _ = kl_estimate(new.float(), behavior.float(), MASK, "k3")
    assert (narrow.dtype, kl.dtype) == (torch.float32, torch.float32)
    torch.testing.assert_close(narrow.double(), wide.detach(), rtol=0, atol=1e-6)
    assert narrow_audit == pytest.approx(wide_audit, abs=1e-6)


def test_advantages_must_be_per_token_or_per_completion():
    new, behavior = with_ratios([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="per completion"):
        policy_loss(new, behavior, t([1.0, 2.0]), MASK, is_level="token")


# --- KL ----------------------------------------------------------------------------------

KL_NEW = [[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]]
KL_REF = [[-1.5, -1.0, -0.5], [-0.1, -1.2, 7.0]]


def test_k1_estimate_is_the_policy_reference_log_ratio():
    new = t(KL_NEW).requires_grad_()
    kl, audit = kl_estimate(new, t(KL_REF), MASK, "k1")
    # new − ref: row 0 = [0.5, −1.0, 0.0]; row 1 = [−0.2, 0.0, pad]
    close(kl, [[0.5, -1.0, 0.0], [-0.2, 0.0, 0.0]], tol=1e-15)
    # mean over the five active tokens: (0.5 − 1.0 + 0 − 0.2 + 0)/5 = −0.14
    assert audit == pytest.approx(
        {
            "token_observations": 5,
            "entropy_mask_applied_tokens": 0,
            "mean_policy_reference_log_ratio": -0.14,
            "mean_estimator": -0.14,
            "mean_masked_estimator": -0.14,
        },
        abs=1e-15,
    )
    kl.sum().backward()
    close(new.grad, MASK.to(F64))  # the reference is a constant


def test_k3_estimate_matches_hand_values_and_is_never_negative():
    kl, audit = kl_estimate(t(KL_NEW), t(KL_REF), MASK, "k3")
    # x = ref − new: row 0 = [−0.5, 1.0, 0.0]; row 1 = [0.2, 0.0]; k3 = e^x − x − 1
    #   e^−0.5 + 0.5 − 1 = 0.10653065971263342;  e − 2 = 0.7182818284590451;  0
    #   e^0.2 − 1.2 = 0.0214027581601699;  0
    hand = [[0.10653065971263342, 0.7182818284590451, 0.0], [0.0214027581601699, 0.0, 0.0]]
    close(kl, hand, tol=1e-15)
    assert audit["mean_estimator"] == pytest.approx((0.10653065971263342 + 0.7182818284590451 + 0.0214027581601699) / 5)
    assert audit["mean_policy_reference_log_ratio"] == pytest.approx(-0.14)
    gen = torch.Generator().manual_seed(2)
    new = torch.randn(64, 33, generator=gen, dtype=F64) * 3
    ref = torch.cat([new[:, :1] + 1e-12, torch.randn(64, 32, generator=gen, dtype=F64) * 3], dim=1)
    for dtype in (torch.float32, F64):
        values, _ = kl_estimate(new.to(dtype), ref.to(dtype), torch.ones_like(new, dtype=torch.bool), "k3")
        assert (values >= 0).all()


def test_kl_estimator_none_takes_no_observation():
    new = t(KL_NEW).requires_grad_()
    kl, audit = kl_estimate(new, None, MASK, "none")
    assert torch.equal(kl, torch.zeros(2, 3, dtype=F64))
    assert audit == {
        "token_observations": 0,
        "entropy_mask_applied_tokens": 0,
        "mean_policy_reference_log_ratio": None,
        "mean_estimator": None,
        "mean_masked_estimator": None,
    }
    with pytest.raises(ValueError, match="reference"):
        kl_estimate(new, None, MASK, "k1")


def test_entropy_mask_keeps_tokens_at_or_above_the_quantile_and_counts_the_rest():
    # active entropies 0.9, 0.5, 0.1, 0.7, 0.3 (the padding's 99 is ignored) sorted [0.1, 0.3, 0.5, 0.7, 0.9]
    # q = 0.6 → position 0.6·4 = 2.4 → τ = 0.5 + 0.4·(0.7 − 0.5) = 0.58 → keep 0.9 and 0.7, mask three
    entropy = t([[0.9, 0.5, 0.1], [0.7, 0.3, 99.0]])
    kl, audit = kl_estimate(t(KL_NEW), t(KL_REF), MASK, "k1", entropy=entropy, entropy_quantile=0.6)
    close(kl, [[0.5, 0.0, 0.0], [-0.2, 0.0, 0.0]], tol=1e-15)
    # masked mean still divides by all five observations: (0.5 − 0.2)/5 = 0.06
    assert audit == pytest.approx(
        {
            "token_observations": 5,
            "entropy_mask_applied_tokens": 3,
            "mean_policy_reference_log_ratio": -0.14,
            "mean_estimator": -0.14,
            "mean_masked_estimator": 0.06,
        },
        abs=1e-15,
    )


def test_entropy_quantile_zero_masks_nothing_and_one_keeps_only_the_highest():
    entropy = t([[0.9, 0.5, 0.1], [0.7, 0.3, 99.0]])
    _, none_masked = kl_estimate(t(KL_NEW), t(KL_REF), MASK, "k1", entropy=entropy, entropy_quantile=0.0)
    _, top_only = kl_estimate(t(KL_NEW), t(KL_REF), MASK, "k1", entropy=entropy, entropy_quantile=1.0)
    assert none_masked["entropy_mask_applied_tokens"] == 0
    assert top_only["entropy_mask_applied_tokens"] == 4
    assert top_only["mean_masked_estimator"] == pytest.approx(0.5 / 5)
    with pytest.raises(ValueError, match="entropy"):
        kl_estimate(t(KL_NEW), t(KL_REF), MASK, "k1", entropy_quantile=0.5)


# --- aggregation and ECHO ----------------------------------------------------------------


def test_token_level_aggregation_divides_by_all_active_tokens_of_the_group():
    per_token = t([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    # (1 + 2 + 3 + 4 + 5)/5 = 3.0 — not the mean of the completion means (2.0 + 4.5)/2 = 3.25
    close(aggregate(per_token, MASK, "token_level"), 3.0)


def test_per_sample_aggregation_gives_one_mean_per_completion():
    # row 0: (1 + 2 + 3)/3 = 2.0; row 1: (4 + 5)/2 = 4.5
    close(aggregate(t([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]]), MASK, "per_sample"), [2.0, 4.5])


def test_aggregation_without_active_tokens_is_a_connected_zero():
    per_token = t([[1.0, 2.0, 3.0]]).requires_grad_()
    loss = aggregate(per_token, torch.zeros(1, 3, dtype=torch.bool), "token_level")
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(per_token.grad, torch.zeros(1, 3, dtype=F64))


def test_echo_loss_is_lambda_times_mean_observation_cross_entropy():
    logp = t([[-0.5, -1.5, 9.0], [-1.0, 9.0, 9.0]]).requires_grad_()
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, ce = echo_loss(logp, mask, 0.05)
    # CE = (0.5 + 1.5 + 1.0)/3 = 1.0; loss = 0.05·1.0; dloss/dlogp = −0.05/3 on observation tokens
    assert ce == pytest.approx(1.0, abs=1e-15)
    close(loss, 0.05, tol=1e-15)
    loss.backward()
    close(logp.grad, -0.05 / 3 * mask.to(F64), tol=1e-15)


def test_echo_without_observation_tokens_contributes_nothing():
    logp = t([[-0.5, -1.5]]).requires_grad_()
    loss, ce = echo_loss(logp, torch.zeros(1, 2, dtype=torch.bool), 0.05)
    assert ce is None
    assert loss.item() == 0.0
    acc = EchoAccumulator()
    acc.add(ce)
    assert acc.loop_state() == {"contributed": False, "observations": 0, "initial_env_ce": None, "last_env_ce": None}


# --- group filters and reward statistics -------------------------------------------------


def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal():
    assert keep_group([1.0, 1.0, 1.0], dynamic_sampling=True) == (False, DROP_EQUAL_REWARDS)
    assert keep_group([1.0], dynamic_sampling=True) == (False, DROP_EQUAL_REWARDS)
    assert keep_group([1.0, 1.0, 1.0], dynamic_sampling=False) == (True, None)
    assert keep_group([0.0, 1e-9], dynamic_sampling=True) == (True, None)  # unequal, however close


def test_variance_filter_keeps_groups_inside_inclusive_bounds():
    rewards = [0.0, 1.0]  # population variance ((−0.5)² + 0.5²)/2 = 0.25
    assert keep_group(rewards, dynamic_sampling=False, var_min=0.25) == (True, None)
    assert keep_group(rewards, dynamic_sampling=False, var_max=0.25) == (True, None)
    assert keep_group(rewards, dynamic_sampling=False, var_min=0.3) == (False, DROP_VARIANCE_BELOW_MIN)
    assert keep_group(rewards, dynamic_sampling=False, var_max=0.2) == (False, DROP_VARIANCE_ABOVE_MAX)
    assert keep_group(rewards, dynamic_sampling=False, var_min=0.1, var_max=0.3) == (True, None)
    # dynamic sampling is decided first
    assert keep_group([1.0, 1.0], dynamic_sampling=True, var_min=0.1) == (False, DROP_EQUAL_REWARDS)
    assert keep_group([1.0, 1.0], dynamic_sampling=False, var_min=0.1) == (False, DROP_VARIANCE_BELOW_MIN)


GROUPS = [
    [1.0, 1.0, 1.0, 1.0],  # var 0 → zero; degenerate; all pass
    [0.0, 0.0],  # var 0 → zero; degenerate; all fail
    [0.5, 0.625],  # mean 0.5625, var 0.0625² = 0.00390625 → tiny
    [0.25, 0.5],  # var 0.125² = 0.015625 → low
    [0.0, 0.5],  # var 0.25² = 0.0625 → medium
    [0.0, 1.0],  # var 0.25, on the high/extreme bound → high
    [0.0, 2.0],  # var 1 → extreme
    [0.95, 1.0],  # var 0.025² = 0.000625 → tiny; all pass (0.95 ≥ 0.95)
]


def test_reward_stats_match_hand_counts_and_buckets():
    stats = reward_stats(GROUPS)
    # 18 rewards, Σr = 11.325, Σr² = 12.105625 → mean 0.629166…, var = 12.105625/18 − mean² = 0.27668…
    assert stats["count"] == 18
    assert stats["mean"] == pytest.approx(11.325 / 18, abs=1e-15)
    assert stats["stdev"] == pytest.approx(math.sqrt(12.105625 / 18 - (11.325 / 18) ** 2), abs=1e-14)
    assert stats["stdev"] == pytest.approx(0.5260076309121169, abs=1e-15)
    assert (stats["min"], stats["max"]) == (0.0, 2.0)
    assert (stats["group_count"], stats["all_pass_group_count"], stats["all_fail_group_count"]) == (8, 2, 1)
    assert stats["degenerate_group_count"] == 2
    assert stats["group_variance_histogram"] == [
        {"label": "zero", "min_inclusive": 0.0, "max_inclusive": 1e-12, "count": 2},
        {"label": "tiny", "min_inclusive": 1e-12, "max_inclusive": 0.01, "count": 2},
        {"label": "low", "min_inclusive": 0.01, "max_inclusive": 0.05, "count": 1},
        {"label": "medium", "min_inclusive": 0.05, "max_inclusive": 0.15, "count": 1},
        {"label": "high", "min_inclusive": 0.15, "max_inclusive": 0.25, "count": 1},
        {"label": "extreme", "min_inclusive": 0.25, "max_inclusive": None, "count": 1},
    ]
    assert group_reward_variance([0.5, 0.625]) == 0.00390625
    assert schema_errors("TrainReceiptRewards", stats) == []


def test_reward_stats_are_independent_of_group_and_reward_order():
    rng = random.Random(3)
    groups = [[rng.random() for _ in range(rng.randint(1, 9))] for _ in range(40)]
    expected = reward_stats(groups)
    for _ in range(5):
        shuffled = [rng.sample(g, len(g)) for g in rng.sample(groups, len(groups))]
        assert reward_stats(shuffled) == expected


def test_reward_thresholds_are_configurable_and_leave_the_histogram_alone():
    stats = reward_stats(GROUPS, saturation_threshold=0.5, low_variance_threshold=0.01)
    assert stats["all_pass_group_count"] == 3  # adds [0.5, 0.625]
    assert stats["degenerate_group_count"] == 4  # adds the two tiny groups
    assert stats["group_variance_histogram"] == reward_stats(GROUPS)["group_variance_histogram"]


def test_reward_stats_without_groups_are_null_with_an_empty_histogram():
    stats = RewardStatsAccumulator().as_receipt()
    assert stats == {
        "count": 0,
        "mean": None,
        "stdev": None,
        "min": None,
        "max": None,
        "group_count": 0,
        "all_pass_group_count": 0,
        "all_fail_group_count": 0,
        "degenerate_group_count": 0,
        "group_variance_histogram": [],
    }
    assert schema_errors("TrainReceiptRewards", stats) == []
    with pytest.raises(ValueError, match="finite"):
        reward_stats([[0.0, float("nan")]])


# --- EMA reference -----------------------------------------------------------------------


def test_ema_update_blends_reference_and_current_on_refresh_groups_only():
    start = {"b": t([1.0, 2.0]), "a": t([[0.0]])}
    ema = EmaReference(start, decay=0.9, refresh_every=2)
    current = {"a": t([[10.0]]), "b": t([3.0, 4.0])}
    assert ema.update(current, 1) is False
    close(ema.tensors["b"], [1.0, 2.0])
    assert ema.update(current, 2) is True
    # 0.9·[1, 2] + 0.1·[3, 4] = [1.2, 2.2];  0.9·0 + 0.1·10 = 1.0
    close(ema.tensors["b"], [1.2, 2.2], tol=1e-15)
    close(ema.tensors["a"], [[1.0]], tol=1e-15)
    assert ema.update(current, 3) is False
    assert ema.update(current, 4) is True
    # 0.9·[1.2, 2.2] + 0.1·[3, 4] = [1.38, 2.38]
    close(ema.tensors["b"], [1.38, 2.38], tol=1e-15)
    assert ema.groups_since_refresh(5) == 1
    assert torch.equal(start["b"], t([1.0, 2.0]))  # the reference is a copy


def test_ema_state_round_trips_by_sorted_name_and_rejects_mismatches():
    from safetensors.torch import load, save

    params = {"z.lora_B": t([[0.5, -1.5]]), "a.lora_A": t([[2.0], [3.0]])}
    ema = EmaReference(params, decay=0.5, refresh_every=1)
    ema.update({"z.lora_B": t([[1.5, 0.5]]), "a.lora_A": t([[0.0], [1.0]])}, 1)
    state = ema.state_dict()
    assert list(state) == ["a.lora_A", "z.lora_B"]
    assert save(state) == save(ema.state_dict())  # deterministic bytes
    restored = EmaReference({k: torch.zeros_like(v) for k, v in params.items()}, decay=0.5, refresh_every=1)
    restored.load_state_dict(load(save(state)))
    assert all(torch.equal(restored.tensors[k], state[k]) for k in state)
    state["a.lora_A"].add_(1.0)  # a state_dict is a copy
    assert not torch.equal(ema.tensors["a.lora_A"], state["a.lora_A"])
    with pytest.raises(ValueError, match=r"no tensor 'z\.lora_B'"):
        restored.load_state_dict({"a.lora_A": t([[0.0], [0.0]])})
    with pytest.raises(ValueError, match=r"\(1, 2\)"):
        restored.load_state_dict({"a.lora_A": t([[0.0, 0.0]]), "z.lora_B": t([[0.0, 0.0]])})
    with pytest.raises(ValueError, match="float32"):
        restored.load_state_dict({"a.lora_A": t([[0.0], [0.0]]), "z.lora_B": torch.zeros(1, 2)})


def test_ema_settings_outside_the_schema_are_rejected():
    with pytest.raises(ValueError, match="decay"):
        EmaReference({}, decay=1.5, refresh_every=1)
    with pytest.raises(ValueError, match="refresh_every"):
        EmaReference({}, decay=0.5, refresh_every=0)


# --- audits and accumulators -------------------------------------------------------------


def _steps():
    """Two steps of hand-sized data (token level, k1) and the same data as one call."""
    new_a, beh_a = with_ratios([[0.5, 1.1, 1.5], [0.5, 1.0, 1.0]])
    new_b, beh_b = with_ratios([[1.3, 0.7, 1.0], [0.9, 1.05, 2.5]])
    mask_b = torch.ones(2, 3, dtype=torch.bool)
    adv_a, adv_b = t([[2.0], [-1.0]]), t([[0.5], [-0.5]])
    ref_a, ref_b = new_a.detach() - 0.1, new_b.detach() + t([[0.2, -0.3, 0.0], [0.1, 0.1, 0.4]])
    return (
        [(new_a, beh_a, adv_a, MASK, ref_a), (new_b, beh_b, adv_b, mask_b, ref_b)],
        tuple(
            torch.cat(parts)
            for parts in zip((new_a, beh_a, adv_a, MASK, ref_a), (new_b, beh_b, adv_b, mask_b, ref_b), strict=True)
        ),
    )


def test_accumulated_step_audits_equal_one_audit_over_all_the_data():
    steps, whole = _steps()
    importance, kl = ImportanceSamplingAccumulator(), KlReferenceAccumulator()
    for new, beh, adv, mask, ref in steps:
        importance.add(policy_loss(new, beh, adv, mask, is_level="token")[1])
        kl.add(kl_estimate(new, ref, mask, "k3")[1])
    new, beh, adv, mask, ref = whole
    assert importance.as_receipt() == pytest.approx(policy_loss(new, beh, adv, mask, is_level="token")[1], abs=1e-15)
    assert kl.as_receipt() == pytest.approx(kl_estimate(new, ref, mask, "k3")[1], abs=1e-15)
    # ratios 0.5 1.1 1.5 0.5 1.0 | 1.3 0.7 1.0 0.9 1.05 2.5 → 11 observations, min 0.5, max 2.5
    receipt = importance.as_receipt()
    assert (receipt["ratio_observations"], receipt["min_ratio"], receipt["max_ratio"]) == (11, 0.5, pytest.approx(2.5))
    # below 0.8: 0.5, 0.5, 0.7; above 1.2: 1.5, 1.3, 2.5 → 6/11
    assert (receipt["below_clip_count"], receipt["above_clip_count"]) == (3, 3)
    assert receipt["outside_clip_fraction"] == pytest.approx(6 / 11)


@pytest.mark.parametrize(
    ("is_level", "estimator", "quantile"),
    [("token", "k1", None), ("sequence", "k3", 0.5), ("cispo", "none", None), ("token", "k3", 0.25)],
)
def test_step_and_run_audits_validate_against_the_receipt_and_loop_state_definitions(is_level, estimator, quantile):
    steps, _ = _steps()
    importance, kl = ImportanceSamplingAccumulator(), KlReferenceAccumulator()
    for new, beh, adv, mask, ref in steps:
        _, ratio_audit = policy_loss(new, beh, adv, mask, is_level=is_level, clip_high=0.28)
        entropy = torch.rand(mask.shape, generator=torch.Generator().manual_seed(4), dtype=F64)
        _, kl_audit = kl_estimate(new, ref, mask, estimator, entropy=entropy, entropy_quantile=quantile)
        assert schema_errors("TrainReceiptGrpoImportanceSampling", ratio_audit) == []
        assert schema_errors("TrainReceiptGrpoKlReference", kl_audit) == []
        importance.add(ratio_audit)
        kl.add(kl_audit)
    audit = policy_audit_receipt(importance, kl)
    assert schema_errors("TrainReceiptGrpoPolicyAudit", audit) == []
    assert schema_errors("GrpoLoopImportanceSampling", importance.loop_state()) == []
    assert schema_errors("GrpoLoopKlReference", kl.loop_state()) == []


def test_empty_accumulators_give_null_means_and_valid_blocks():
    importance, kl = ImportanceSamplingAccumulator(), KlReferenceAccumulator()
    _, ratio_audit = policy_loss(t([[0.0]]), None, t([[1.0]]), torch.zeros(1, 1, dtype=torch.bool), is_level="token")
    importance.add(ratio_audit)
    receipt = policy_audit_receipt(importance, kl)
    assert receipt["importance_sampling"]["ratio_scope"] is None
    assert receipt["importance_sampling"]["mean_ratio"] is None
    assert receipt["kl_reference"]["mean_estimator"] is None
    assert schema_errors("TrainReceiptGrpoPolicyAudit", receipt) == []


def test_accumulator_loop_states_round_trip_through_json():
    steps, _ = _steps()
    importance, kl, echo = ImportanceSamplingAccumulator(), KlReferenceAccumulator(), EchoAccumulator()
    for new, beh, adv, mask, ref in steps:
        importance.add(policy_loss(new, beh, adv, mask, is_level="sequence")[1])
        kl.add(kl_estimate(new, ref, mask, "k1")[1])
        echo.add(echo_loss(new, mask, 0.05)[1])
    for acc, defname in (
        (importance, "GrpoLoopImportanceSampling"),
        (kl, "GrpoLoopKlReference"),
        (echo, "LoopEchoMetrics"),
    ):
        state = json.loads(json.dumps(acc.loop_state()))
        assert schema_errors(defname, state) == []
        assert type(acc).from_loop_state(state) == acc
        with pytest.raises(ValueError, match="members"):
            type(acc).from_loop_state({**state, "extra": 0})


def test_a_sequence_audit_cannot_join_a_token_scoped_run():
    steps, _ = _steps()
    new, beh, adv, mask, _ = steps[0]
    acc = ImportanceSamplingAccumulator()
    acc.add(policy_loss(new, beh, adv, mask, is_level="token")[1])
    with pytest.raises(ValueError, match="sequence"):
        acc.add(policy_loss(new, beh, adv, mask, is_level="sequence")[1])


def test_echo_receipt_records_first_and_last_ce_or_why_it_never_contributed():
    echo = EchoAccumulator()
    for ce in (None, 2.5, 2.0, None, 1.75):
        echo.add(ce)
    receipt = echo.as_receipt(lam=0.05, env_mask_mode="env_only", warning_filter=True)
    assert receipt == {
        "enabled": True,
        "lambda": 0.05,
        "env_mask_mode": "env_only",
        "warning_filter": True,
        "initial_env_ce": 2.5,
        "final_env_ce": 1.75,
    }
    assert echo.observations == 3
    dropped = EchoAccumulator().as_receipt(lam=0.05, env_mask_mode="env_only", warning_filter=True)
    assert dropped["enabled"] is False
    assert dropped["dropped_reason"]
    off = EchoAccumulator().as_receipt(lam=None, env_mask_mode=None, warning_filter=None)
    for block in (receipt, dropped, off):
        assert schema_errors("TrainReceiptEcho", block) == []
    with pytest.raises(ValueError, match="lambda"):
        echo.as_receipt(lam=None, env_mask_mode=None, warning_filter=None)


@pytest.mark.parametrize("is_level", ["token", "sequence", "cispo"])
def test_a_train_receipt_built_from_the_accumulators_passes_every_receipt_rule(is_level):
    schema = json.loads((ROOT / "schemas" / "kiln-artifacts-v1.schema.json").read_text(encoding="utf-8"))
    receipt = copy.deepcopy(next(r for r in schema["x-kiln-examples"]["TrainReceipt"] if r["grpo"] is not None))
    steps, _ = _steps()
    importance, kl, echo = ImportanceSamplingAccumulator(), KlReferenceAccumulator(), EchoAccumulator()
    for new, beh, adv, mask, ref in steps:
        importance.add(policy_loss(new, beh, adv, mask, is_level=is_level, cispo_max_weight=1.2)[1])
        kl.add(kl_estimate(new, ref, mask, "k1")[1])
        echo.add(echo_loss(new, mask, 0.05)[1])
    receipt["grpo"]["is_level"] = is_level
    receipt["grpo"]["behavior_policy"] = "recorded"
    receipt["grpo"]["policy_audit"] = policy_audit_receipt(importance, kl)
    receipt["rewards"] = reward_stats(GROUPS)
    receipt["echo"] = echo.as_receipt(lam=0.05, env_mask_mode="env_only", warning_filter=True)
    assert [p.as_dict() for p in problems("TrainReceipt", receipt)] == []
    # the receipt rule that ties the ratio scope to the IS level is live
    receipt["grpo"]["is_level"] = "token" if is_level == "sequence" else "sequence"
    assert [p.pointer for p in problems("TrainReceipt", receipt)] == [
        "/grpo/policy_audit/importance_sampling/ratio_scope"
    ]


def _import_roots(path: Path) -> set[str]:
    """The top-level packages a module imports, following its imports of ``kiln`` modules (which must be pure too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    roots = {name.split(".")[0] for name in names if not name.startswith("kiln.")}
    package = Path(objective.__file__).resolve().parents[2]
    for name in sorted(n for n in names if n.startswith("kiln.")):
        roots |= _import_roots(package / (name.replace(".", "/") + ".py"))
    return roots


@pytest.mark.parametrize("module", ["kiln.training.grpo_objective", "kiln.training.echo"])
def test_the_objective_modules_import_only_torch_and_the_standard_library(module):
    import importlib

    roots = _import_roots(Path(importlib.import_module(module).__file__))
    assert roots <= {"__future__", "collections", "dataclasses", "fractions", "math", "typing", "torch"}
