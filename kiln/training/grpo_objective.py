"""The GRPO objective as small pure functions: advantages, reward statistics, group filters,
the policy loss at three importance-sampling levels, the KL estimate, loss aggregation,
the EMA reference, and the accumulators behind the receipt's audit blocks (ECHO, which OPD
shares, is ``kiln.training.echo``).

Longer than 600 lines: one module for the whole objective, so each formula sits beside the audit that reports it;
it imports only torch, the standard library and the objectives' shared checks, and its tests exercise it without
a model.

Shapes: a group of ``B`` completions padded to ``T`` action positions gives ``[B, T]``
tensors; ``mask`` (bool or 0/1) marks the positions that count. Values at masked
positions never reach a loss or an audit (they may be padding garbage). Losses are
computed in the dtype of ``logp_new`` (float32 or float64); audits and reward statistics
are Python floats computed in float64.

Objective (spec/40, GRPO)::

    advantage     dr_grpo  A = r − mean(r)
                  vanilla  A = (r − mean(r)) / (std(r) + 1e-8)        std: population
    policy loss   token    −min(ρ·A, clip(ρ, 1−ε_lo, 1+ε_hi)·A)      ρ = exp(logπθ − logπb) per token
                  sequence the same with s = exp(mean_t(logπθ − logπb)) per completion (GSPO)
                  cispo    −sg(min(ρ, cap))·A·logπθ
    KL            k1       logπθ − logπref
                  k3       exp(logπref − logπθ) − (logπref − logπθ) − 1   (≥ 0)
    total         policy + kl_coeff·KL per token, then ``aggregate``; ECHO (kiln.training.echo) adds λ·CE(obs)

The caller composes the terms; nothing here owns a model, a device or a file.

Choices the spec leaves open, made here:

* ``vanilla`` divides by the population standard deviation (divide by n, not n − 1): the
  same statistic as the receipt's per-group reward variance, and defined for a group of
  one completion (whose advantage is then 0).
* ``behavior_policy: no_importance_correction`` is ``logp_behavior=None``: the behaviour
  log-probabilities become ``logp_new.detach()``, so every ratio is exactly 1 while the
  gradient of ρ is still ∇logπθ (token level: −A·∇logπθ, i.e. REINFORCE with a baseline).
* Clip counts are strict: a ratio exactly on ``1 − ε_lo`` or ``1 + ε_hi`` is inside.
  Under ``cispo`` only ρ > cap counts (``above_clip_count``); ``below_clip_count`` is 0.
* GSPO observes one ratio per completion that has at least one active token; its ratio
  keeps its gradient (only CISPO stops it).
* The entropy-aware KL mask keeps the KL term on active tokens whose policy entropy is at
  or above the q-quantile (linear interpolation, ``torch.quantile``) of the active tokens
  passed in one call, and zeroes it below; ``mean_masked_estimator`` still divides by all
  observed tokens (the schema's wording).
* Estimator ``none`` takes no KL observation: zero per-token KL, zero counts, null means.
* Dynamic sampling drops a group when its rewards are exactly equal (``max == min``; a
  one-completion group is therefore dropped). The variance filter compares the exact
  population variance with inclusive bounds; dynamic sampling is decided first.
* Reward statistics are exact: sums of rewards and squares are kept as ``Fraction`` so
  every mean and variance is correctly rounded once and independent of group and reward
  order. The variance histogram has fixed bounds (those of the schema's example receipt):
  zero [0, 1e-12], tiny [1e-12, 0.01], low [0.01, 0.05], medium [0.05, 0.15], high
  [0.15, 0.25], extreme [0.25, ∞); a variance on a shared bound goes to the lower bucket,
  so ``zero`` holds exactly the groups that are degenerate under the default threshold.
  The bounds do not follow ``reward_low_variance_threshold`` (a diagnostic knob), so
  histograms of different runs stay comparable.
* Audit accumulators sum in float64 in observation order, as the checkpoint's loop state
  records them (``ratio_sum`` etc.), so a resumed run continues bit-identically; counts,
  minima and maxima are order-independent. A step's sum is recovered as mean × count.
* ``EmaReference.update`` is told how many groups have been committed (1-based) and
  refreshes when that count is a multiple of ``refresh_every``; the checkpoint's cadence
  cursor ``ema_groups_since_refresh`` is that count modulo ``refresh_every``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from kiln.training._checks import active_mask, check_members

ADVANTAGE_MODES = ("dr_grpo", "vanilla")
IS_LEVELS = ("token", "sequence", "cispo")
KL_ESTIMATORS = ("k1", "k3", "none")
LOSS_AGGREGATIONS = ("token_level", "per_sample")

VANILLA_STD_EPSILON = 1e-8
# Keyword conveniences of the functions below, equal to the GrpoConfig schema defaults (the trainer always passes
# the effective config's values). This module imports no contract code, so it cannot read the
# bundle; tests/test_config_defaults.py fails when these and the schema disagree.
DEFAULT_CLIP_EPSILON = 0.2
DEFAULT_CISPO_MAX_WEIGHT = 5.0
DEFAULT_SATURATION_THRESHOLD = 0.95
DEFAULT_LOW_VARIANCE_THRESHOLD = 1e-12
POLICY_AUDIT_SCHEMA = "kiln.grpo-policy-audit.v1"

# (label, min_inclusive, max_inclusive); None is an open end. A value on a shared bound
# belongs to the first (lower) bucket that contains it.
VARIANCE_BUCKETS: tuple[tuple[str, float, float | None], ...] = (
    ("zero", 0.0, 1e-12),
    ("tiny", 1e-12, 0.01),
    ("low", 0.01, 0.05),
    ("medium", 0.05, 0.15),
    ("high", 0.15, 0.25),
    ("extreme", 0.25, None),
)

# ``keep_group`` reasons for a dropped group.
DROP_EQUAL_REWARDS = "dynamic_sampling_equal_rewards"
DROP_VARIANCE_BELOW_MIN = "reward_variance_below_min"
DROP_VARIANCE_ABOVE_MAX = "reward_variance_above_max"

EMPTY_RECORDED_PROVENANCE: dict[str, Any] = {
    "completion_count": 0,
    "sampled_action_tokens": 0,
    "forced_action_tokens": 0,
    "unique_behavior_sources": 0,
}

__all__ = [
    "ADVANTAGE_MODES",
    "DROP_EQUAL_REWARDS",
    "DROP_VARIANCE_ABOVE_MAX",
    "DROP_VARIANCE_BELOW_MIN",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_AUDIT_SCHEMA",
    "VARIANCE_BUCKETS",
    "EmaReference",
    "ImportanceSamplingAccumulator",
    "KlReferenceAccumulator",
    "RewardStatsAccumulator",
    "advantages",
    "aggregate",
    "group_reward_variance",
    "keep_group",
    "kl_estimate",
    "policy_audit_receipt",
    "policy_loss",
    "reward_stats",
]


# --- advantages and reward statistics ---------------------------------------------------


def advantages(rewards: torch.Tensor, mode: str) -> torch.Tensor:
    """Group-relative advantages of one group's rewards ``[B]``.

    ``dr_grpo``: A = r − mean(r). ``vanilla``: A = (r − mean(r)) / (std(r) + 1e-8) with the
    population std sqrt(mean((r − mean r)²)). A group whose rewards are all equal gets
    exactly 0, not the rounding residue of r − mean(r) (vanilla would scale that residue by
    1/(std + 1e-8) into a spurious ~1e-8 advantage).
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage_mode {mode!r}; choose one of {', '.join(ADVANTAGE_MODES)}")
    if rewards.dim() != 1 or rewards.numel() == 0 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a non-empty 1-D floating tensor, got {tuple(rewards.shape)} {rewards.dtype}")
    if bool((rewards == rewards[0]).all()):
        return torch.zeros_like(rewards)
    centered = rewards - rewards.mean()
    if mode == "dr_grpo":
        return centered
    return centered / (rewards.std(correction=0) + VANILLA_STD_EPSILON)


def _exact(values: Iterable[float]) -> list[Fraction]:
    out = []
    for v in values:
        f = float(v)
        if not math.isfinite(f):
            raise ValueError(f"rewards must be finite numbers, got {v!r}")
        out.append(Fraction(f))
    return out


def _variance(total: Fraction, squares: Fraction, n: int) -> Fraction:
    # population variance Σ(r − mean)²/n = (n·Σr² − (Σr)²) / n², exact
    return (n * squares - total * total) / (n * n)


def group_reward_variance(rewards: Sequence[float]) -> float:
    """Population variance of one group's rewards, computed exactly and rounded once."""
    exact = _exact(rewards)
    if not exact:
        raise ValueError("a group needs at least one reward")
    return float(_variance(sum(exact, Fraction(0)), sum((r * r for r in exact), Fraction(0)), len(exact)))


def _bucket(variance: float) -> int:
    for index, (_label, _low, high) in enumerate(VARIANCE_BUCKETS):
        if high is None or variance <= high:
            return index
    raise AssertionError("unreachable: the last bucket is open")


class RewardStatsAccumulator:
    """Streams groups of rewards into the receipt's ``rewards`` block (``TrainReceiptRewards``).

    Order-independent: sums are exact, so any order of groups (and of rewards inside a
    group) gives the same block.
    """

    def __init__(
        self,
        *,
        saturation_threshold: float = DEFAULT_SATURATION_THRESHOLD,
        low_variance_threshold: float = DEFAULT_LOW_VARIANCE_THRESHOLD,
    ) -> None:
        self.saturation_threshold = float(saturation_threshold)
        self.low_variance_threshold = float(low_variance_threshold)
        self._count = 0
        self._sum = Fraction(0)
        self._squares = Fraction(0)
        self._min: float | None = None
        self._max: float | None = None
        self._groups = 0
        self._all_pass = 0
        self._all_fail = 0
        self._degenerate = 0
        self._buckets = [0] * len(VARIANCE_BUCKETS)

    def add_group(self, rewards: Sequence[float]) -> float | None:
        """Count one group; returns its population variance (None for an empty group, which is not counted)."""
        exact = _exact(rewards)
        if not exact:
            return None
        total, squares = sum(exact, Fraction(0)), sum((r * r for r in exact), Fraction(0))
        variance = float(_variance(total, squares, len(exact)))
        low, high = float(min(exact)), float(max(exact))
        self._count += len(exact)
        self._sum += total
        self._squares += squares
        self._min = low if self._min is None else min(self._min, low)
        self._max = high if self._max is None else max(self._max, high)
        self._groups += 1
        self._all_pass += low >= self.saturation_threshold
        self._all_fail += high <= 0.0
        self._degenerate += variance <= self.low_variance_threshold
        self._buckets[_bucket(variance)] += 1
        return variance

    def as_receipt(self) -> dict[str, Any]:
        n = self._count
        mean = stdev = None
        if n:
            mean = float(self._sum / n)
            stdev = math.sqrt(float(_variance(self._sum, self._squares, n)))
        histogram = []
        if self._groups:
            histogram = [
                {"label": label, "min_inclusive": low, "max_inclusive": high, "count": count}
                for (label, low, high), count in zip(VARIANCE_BUCKETS, self._buckets, strict=True)
            ]
        return {
            "count": n,
            "mean": mean,
            "stdev": stdev,
            "min": self._min,
            "max": self._max,
            "group_count": self._groups,
            "all_pass_group_count": self._all_pass,
            "all_fail_group_count": self._all_fail,
            "degenerate_group_count": self._degenerate,
            "group_variance_histogram": histogram,
        }


def reward_stats(
    groups_rewards: Iterable[Sequence[float]],
    saturation_threshold: float = DEFAULT_SATURATION_THRESHOLD,
    low_variance_threshold: float = DEFAULT_LOW_VARIANCE_THRESHOLD,
) -> dict[str, Any]:
    """The receipt's ``rewards`` block over ``groups_rewards`` (one list of rewards per group).

    A group is all-pass when every reward is ≥ ``saturation_threshold``, all-fail when every
    reward is ≤ 0, degenerate when its population variance is ≤ ``low_variance_threshold``;
    ``stdev`` is the population standard deviation over all rewards.
    """
    acc = RewardStatsAccumulator(
        saturation_threshold=saturation_threshold, low_variance_threshold=low_variance_threshold
    )
    for group in groups_rewards:
        acc.add_group(group)
    return acc.as_receipt()


def keep_group(
    rewards: Sequence[float],
    *,
    dynamic_sampling: bool,
    var_min: float | None = None,
    var_max: float | None = None,
) -> tuple[bool, str | None]:
    """Whether a group trains, and why not: ``(True, None)`` or ``(False, DROP_*)``.

    Dynamic sampling drops a group whose rewards are all exactly equal (no signal). The
    variance filter keeps groups whose population variance lies in [var_min, var_max];
    a None bound is open.
    """
    values = [float(r) for r in rewards]
    if not values:
        raise ValueError("a group needs at least one reward")
    if dynamic_sampling and max(values) == min(values):
        return False, DROP_EQUAL_REWARDS
    if var_min is None and var_max is None:
        return True, None
    variance = group_reward_variance(values)
    if var_min is not None and variance < var_min:
        return False, DROP_VARIANCE_BELOW_MIN
    if var_max is not None and variance > var_max:
        return False, DROP_VARIANCE_ABOVE_MAX
    return True, None


# --- per-token terms --------------------------------------------------------------------


def _ratio_audit(scope: str, action_tokens: int, observed: torch.Tensor, below: int, above: int) -> dict[str, Any]:
    n = observed.numel()
    if n == 0:
        return {
            "ratio_scope": None,
            "action_tokens": action_tokens,
            "ratio_observations": 0,
            "mean_ratio": None,
            "min_ratio": None,
            "max_ratio": None,
            "below_clip_count": 0,
            "above_clip_count": 0,
            "outside_clip_fraction": None,
        }
    values = observed.detach().to(torch.float64)
    return {
        "ratio_scope": scope,
        "action_tokens": action_tokens,
        "ratio_observations": n,
        "mean_ratio": float(values.sum()) / n,
        "min_ratio": float(values.min()),
        "max_ratio": float(values.max()),
        "below_clip_count": below,
        "above_clip_count": above,
        "outside_clip_fraction": (below + above) / n,
    }


def policy_loss(
    logp_new: torch.Tensor,
    logp_behavior: torch.Tensor | None,
    advantages_per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    is_level: str,
    clip_low: float = DEFAULT_CLIP_EPSILON,
    clip_high: float | None = None,
    cispo_max_weight: float = DEFAULT_CISPO_MAX_WEIGHT,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Per-token policy loss ``[B, T]`` (0 at masked positions) and its importance-sampling audit.

    ``logp_new``: log πθ of the taken tokens (with gradient). ``logp_behavior``: log πb from
    the recorded rollouts, or None for ``no_importance_correction`` (ρ ≡ 1). Advantages
    broadcast to ``[B, T]`` (pass ``[B, 1]`` for one advantage per completion) and are
    treated as constants. ``clip_high`` None reuses ``clip_low``.

    * ``token``    ρ_t = exp(logπθ − logπb);  loss_t = −min(ρ_t·A_t, clip(ρ_t, 1−ε_lo, 1+ε_hi)·A_t)
    * ``sequence`` s_b = exp(Σ_t m_t(logπθ − logπb) / Σ_t m_t), broadcast over b's tokens, same clip
    * ``cispo``    loss_t = −sg(min(ρ_t, cap))·A_t·logπθ_t

    The audit has the members of ``TrainReceiptGrpoImportanceSampling``.
    """
    if is_level not in IS_LEVELS:
        raise ValueError(f"unknown is_level {is_level!r}; choose one of {', '.join(IS_LEVELS)}")
    if clip_low < 0 or (clip_high is not None and clip_high < 0):
        raise ValueError(f"clip ranges must be >= 0, got clip_epsilon {clip_low} and clip_eps_high {clip_high}")
    if not cispo_max_weight > 0:
        raise ValueError(f"cispo_max_weight must be > 0, got {cispo_max_weight}")
    active = active_mask(mask, logp_new)
    if advantages_per_token.dim() != logp_new.dim():
        raise ValueError(
            f"advantages are {tuple(advantages_per_token.shape)}; give them per token {tuple(logp_new.shape)} or per completion [B, 1]"
        )
    behavior = logp_new.detach() if logp_behavior is None else logp_behavior.detach()
    adv = torch.broadcast_to(advantages_per_token.detach().to(logp_new.dtype), logp_new.shape)
    zero = torch.zeros_like(logp_new)
    log_ratio = torch.where(active, logp_new - behavior, zero)
    lower, upper = 1.0 - clip_low, 1.0 + (clip_low if clip_high is None else clip_high)
    action_tokens = int(active.sum())

    if is_level == "cispo":
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, max=cispo_max_weight).detach()
        loss = -weight * adv * logp_new
        observed = ratio.detach()[active]
        audit = _ratio_audit("token", action_tokens, observed, 0, int((observed > cispo_max_weight).sum()))
    else:
        if is_level == "sequence":
            counts = active.sum(dim=-1)
            seq_ratio = torch.exp(log_ratio.sum(dim=-1) / counts.clamp(min=1).to(log_ratio.dtype))
            ratio = seq_ratio.unsqueeze(-1).expand_as(logp_new)
            observed = seq_ratio.detach()[counts > 0]
        else:
            ratio = torch.exp(log_ratio)
            observed = ratio.detach()[active]
        loss = -torch.minimum(ratio * adv, torch.clamp(ratio, lower, upper) * adv)
        scope = "sequence" if is_level == "sequence" else "token"
        audit = _ratio_audit(
            scope, action_tokens, observed, int((observed < lower).sum()), int((observed > upper).sum())
        )
    return torch.where(active, loss, zero), audit


def kl_estimate(
    logp_new: torch.Tensor,
    logp_ref: torch.Tensor | None,
    mask: torch.Tensor,
    estimator: str,
    *,
    entropy: torch.Tensor | None = None,
    entropy_quantile: float | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Per-token KL estimate ``[B, T]`` against the reference policy, and its audit.

    With x = logπref − logπθ: ``k1`` = −x = logπθ − logπref; ``k3`` = exp(x) − x − 1 ≥ 0;
    ``none`` = 0 (no observation; ``logp_ref`` may be None). The reference is a constant.
    k3 is evaluated as expm1(x) − x: the same value, accurate near 0 and never negative.

    Entropy-aware mask (``entropy_quantile`` q set, ``entropy`` = policy entropy per
    position): with τ the q-quantile of the entropies of the active tokens, the KL term is
    kept where entropy ≥ τ and zeroed below; those zeroed tokens are counted in
    ``entropy_mask_applied_tokens``. The audit has the members of
    ``TrainReceiptGrpoKlReference``: means over the active tokens, the masked estimator
    still divided by all of them.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    active = active_mask(mask, logp_new)
    zero = torch.zeros_like(logp_new)
    if estimator == "none":
        return zero, {
            "token_observations": 0,
            "entropy_mask_applied_tokens": 0,
            "mean_policy_reference_log_ratio": None,
            "mean_estimator": None,
            "mean_masked_estimator": None,
        }
    if logp_ref is None:
        raise ValueError(f"kl_estimator {estimator!r} needs the reference log-probabilities")
    log_ratio = torch.where(active, logp_new - logp_ref.detach(), zero)
    if estimator == "k1":
        values = log_ratio
    else:
        x = -log_ratio
        values = torch.expm1(x) - x  # = exp(x) − x − 1; expm1(x) ≥ x survives rounding, so never < 0
    keep = active
    if entropy_quantile is not None:
        if entropy is None:
            raise ValueError("entropy_aware_kl_quantile needs the policy entropy per position")
        if not 0.0 <= entropy_quantile <= 1.0:
            raise ValueError(f"entropy_aware_kl_quantile must lie in [0, 1], got {entropy_quantile}")
        ent = entropy.detach().to(torch.float64)
        if tuple(ent.shape) != tuple(logp_new.shape):
            raise ValueError(f"entropy is {tuple(ent.shape)}, the log-probabilities are {tuple(logp_new.shape)}")
        if bool(active.any()):
            threshold = torch.quantile(ent[active], entropy_quantile)
            keep = active & (ent >= threshold)
    per_token = torch.where(keep, values, zero)
    n = int(active.sum())
    masked = n - int(keep.sum())
    audit: dict[str, int | float | None]
    if n == 0:
        audit = {
            "token_observations": 0,
            "entropy_mask_applied_tokens": 0,
            "mean_policy_reference_log_ratio": None,
            "mean_estimator": None,
            "mean_masked_estimator": None,
        }
    else:

        def mean(t: torch.Tensor) -> float:
            return float(t.detach().to(torch.float64).sum()) / n

        audit = {
            "token_observations": n,
            "entropy_mask_applied_tokens": masked,
            "mean_policy_reference_log_ratio": mean(log_ratio),
            "mean_estimator": mean(torch.where(active, values, zero)),
            "mean_masked_estimator": mean(per_token),
        }
    return per_token, audit


def aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Reduce a ``[B, T]`` per-token loss the way ``loss_aggregation`` says.

    ``token_level``: a scalar Σ_{b,t} m·loss / Σ_{b,t} m over the whole group (one optimizer
    step per group). ``per_sample``: ``[B]``, each completion's Σ_t m·loss / Σ_t m (one step
    per completion). No active token gives 0 (still connected to the graph).
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_aggregation {mode!r}; choose one of {', '.join(LOSS_AGGREGATIONS)}")
    active = active_mask(mask, per_token_loss)
    masked = torch.where(active, per_token_loss, torch.zeros_like(per_token_loss))
    if mode == "token_level":
        return masked.sum() / active.sum().clamp(min=1).to(masked.dtype)
    return masked.sum(dim=-1) / active.sum(dim=-1).clamp(min=1).to(masked.dtype)


# --- EMA reference ----------------------------------------------------------------------


class EmaReference:
    """An exponential moving average of the LoRA tensors, the KL reference ``{kind: ema}``.

    Starts as a copy of ``params`` (the adapter at the start of training). After the
    ``groups_committed``-th committed group, when that count is a multiple of
    ``refresh_every``: ref ← decay·ref + (1 − decay)·current, tensor by tensor in sorted name
    order (deterministic). ``state_dict`` is what ``reference.safetensors`` stores.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], *, decay: float, refresh_every: int) -> None:
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must lie in [0, 1], got {decay}")
        if isinstance(refresh_every, bool) or not isinstance(refresh_every, int) or refresh_every < 1:
            raise ValueError(f"EMA refresh_every must be an integer >= 1, got {refresh_every!r}")
        self.decay = float(decay)
        self.refresh_every = refresh_every
        self._tensors = {name: params[name].detach().clone() for name in sorted(params)}

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        """The reference tensors by name (live; do not modify)."""
        return self._tensors

    def groups_since_refresh(self, groups_committed: int) -> int:
        """The checkpoint's EMA cadence cursor after ``groups_committed`` committed groups."""
        return groups_committed % self.refresh_every

    def update(self, params: Mapping[str, torch.Tensor], groups_committed: int) -> bool:
        """Account for the ``groups_committed``-th committed group (1-based); True when it refreshed."""
        if groups_committed < 1:
            raise ValueError(f"groups_committed counts committed groups from 1, got {groups_committed}")
        self._check_names(params, "params")
        if groups_committed % self.refresh_every:
            return False
        with torch.no_grad():
            for name, ref in self._tensors.items():
                ref.mul_(self.decay).add_(params[name].detach().to(ref.dtype), alpha=1.0 - self.decay)
        return True

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: tensor.detach().clone().contiguous() for name, tensor in self._tensors.items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Restore the reference; the names, shapes and dtypes must match exactly."""
        self._check_names(state, "the EMA reference state")
        for name, ref in self._tensors.items():
            tensor = state[name]
            if tuple(tensor.shape) != tuple(ref.shape) or tensor.dtype != ref.dtype:
                raise ValueError(
                    f"EMA reference tensor {name!r} is {tuple(tensor.shape)} {tensor.dtype}, the adapter needs {tuple(ref.shape)} {ref.dtype}"
                )
        with torch.no_grad():
            for name, ref in self._tensors.items():
                ref.copy_(state[name])

    def _check_names(self, tensors: Mapping[str, Any], what: str) -> None:
        missing, extra = sorted(set(self._tensors) - set(tensors)), sorted(set(tensors) - set(self._tensors))
        if missing or extra:
            name = (missing or extra)[0]
            where = "has no tensor" if missing else "has a tensor the reference does not"
            raise ValueError(f"{what} {where} {name!r} ({len(missing)} missing, {len(extra)} extra)")


# --- run-level accumulators -------------------------------------------------------------


def _lesser(a: float | None, b: float) -> float:
    return b if a is None else min(a, b)


def _greater(a: float | None, b: float) -> float:
    return b if a is None else max(a, b)


@dataclass
class ImportanceSamplingAccumulator:
    """Run-level importance-sampling evidence; its fields are the loop state's ``GrpoLoopImportanceSampling``."""

    ratio_scope: str | None = None
    action_tokens: int = 0
    ratio_observations: int = 0
    ratio_sum: float = 0.0
    min_ratio: float | None = None
    max_ratio: float | None = None
    below_clip_count: int = 0
    above_clip_count: int = 0

    def add(self, audit: Mapping[str, Any]) -> None:
        """Merge one ``policy_loss`` audit."""
        self.action_tokens += audit["action_tokens"]
        n = audit["ratio_observations"]
        if n == 0:
            return
        scope = audit["ratio_scope"]
        if self.ratio_scope is not None and scope != self.ratio_scope:
            raise ValueError(f"a {scope!r} ratio audit cannot join a run that observed {self.ratio_scope!r} ratios")
        self.ratio_scope = scope
        self.ratio_observations += n
        self.ratio_sum += audit["mean_ratio"] * n
        self.min_ratio = _lesser(self.min_ratio, audit["min_ratio"])
        self.max_ratio = _greater(self.max_ratio, audit["max_ratio"])
        self.below_clip_count += audit["below_clip_count"]
        self.above_clip_count += audit["above_clip_count"]

    def loop_state(self) -> dict[str, Any]:
        return {
            "ratio_scope": self.ratio_scope,
            "action_tokens": self.action_tokens,
            "ratio_observations": self.ratio_observations,
            "ratio_sum": self.ratio_sum,
            "min_ratio": self.min_ratio,
            "max_ratio": self.max_ratio,
            "below_clip_count": self.below_clip_count,
            "above_clip_count": self.above_clip_count,
        }

    @classmethod
    def from_loop_state(cls, state: Mapping[str, Any]) -> ImportanceSamplingAccumulator:
        check_members(state, cls().loop_state(), "the importance-sampling loop state")
        return cls(**state)

    def as_receipt(self) -> dict[str, Any]:
        """``TrainReceiptGrpoImportanceSampling``."""
        n = self.ratio_observations
        return {
            "ratio_scope": self.ratio_scope,
            "action_tokens": self.action_tokens,
            "ratio_observations": n,
            "mean_ratio": self.ratio_sum / n if n else None,
            "min_ratio": self.min_ratio,
            "max_ratio": self.max_ratio,
            "below_clip_count": self.below_clip_count,
            "above_clip_count": self.above_clip_count,
            "outside_clip_fraction": (self.below_clip_count + self.above_clip_count) / n if n else None,
        }


@dataclass
class KlReferenceAccumulator:
    """Run-level KL-reference evidence; its fields are the loop state's ``GrpoLoopKlReference``."""

    token_observations: int = 0
    entropy_mask_applied_tokens: int = 0
    log_ratio_sum: float = 0.0
    estimator_sum: float = 0.0
    masked_estimator_sum: float = 0.0

    def add(self, audit: Mapping[str, Any]) -> None:
        """Merge one ``kl_estimate`` audit."""
        n = audit["token_observations"]
        if n == 0:
            return
        self.token_observations += n
        self.entropy_mask_applied_tokens += audit["entropy_mask_applied_tokens"]
        self.log_ratio_sum += audit["mean_policy_reference_log_ratio"] * n
        self.estimator_sum += audit["mean_estimator"] * n
        self.masked_estimator_sum += audit["mean_masked_estimator"] * n

    def loop_state(self) -> dict[str, Any]:
        return {
            "token_observations": self.token_observations,
            "entropy_mask_applied_tokens": self.entropy_mask_applied_tokens,
            "log_ratio_sum": self.log_ratio_sum,
            "estimator_sum": self.estimator_sum,
            "masked_estimator_sum": self.masked_estimator_sum,
        }

    @classmethod
    def from_loop_state(cls, state: Mapping[str, Any]) -> KlReferenceAccumulator:
        check_members(state, cls().loop_state(), "the KL-reference loop state")
        return cls(**state)

    def as_receipt(self) -> dict[str, Any]:
        """``TrainReceiptGrpoKlReference``."""
        n = self.token_observations
        return {
            "token_observations": n,
            "entropy_mask_applied_tokens": self.entropy_mask_applied_tokens,
            "mean_policy_reference_log_ratio": self.log_ratio_sum / n if n else None,
            "mean_estimator": self.estimator_sum / n if n else None,
            "mean_masked_estimator": self.masked_estimator_sum / n if n else None,
        }


def policy_audit_receipt(
    importance: ImportanceSamplingAccumulator,
    kl: KlReferenceAccumulator,
    recorded_provenance: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """``TrainReceiptGrpoPolicyAudit`` (``kiln.grpo-policy-audit.v1``).

    ``recorded_provenance`` is the receipt's ``TrainReceiptGrpoRecordedProvenance`` block
    (built where the behaviour-source digests are); None means no recorded provenance.
    """
    return {
        "schema": POLICY_AUDIT_SCHEMA,
        "importance_sampling": importance.as_receipt(),
        "kl_reference": kl.as_receipt(),
        "recorded_provenance": dict(EMPTY_RECORDED_PROVENANCE if recorded_provenance is None else recorded_provenance),
    }
