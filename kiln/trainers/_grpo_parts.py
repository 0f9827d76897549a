"""GRPO's components: the training plan, the log-probabilities of a completion, the reference policy.

* The plan -- which groups train, in which order, and the counts of those the filters dropped -- is decided before
  training from the rewards alone (``dynamic_sampling`` drops groups whose completions all got the same
reward; the reward-variance filter keeps groups whose variance lies in ``[reward_filter_var_min,
reward_filter_var_max]``, with ``reward_filter_on_empty`` deciding what happens when fewer than
``reward_filter_min_groups`` remain), so the trainable order is known up front and a checkpoint can bind it.
  Nothing left is ``zero_groups``; ECHO-only training (``no_policy_loss``) whose groups hold no observation token is
  ``zero_env_tokens``. Both are failures of the run (a failed receipt), never refusals at admission.
* ``ingest``: the request's groups read and tokenised; a dry run whose data is refused gets no groups and the failure
  its receipt records (a dry run exists to leave its verdict on disk).
* ``ReferencePolicy``: the KL reference's log-probabilities of the taken tokens -- the frozen base (the adapter
  disabled for one forward) or the EMA of the LoRA tensors (swapped in for one forward, then back).
* ``group_logprobs``: several completions in one right-padded forward (``micro_batch_size`` > 1), the model's
  logits (its head and post-processing, ``kiln.training.model_head``) computed only at the positions a loss reads
  -- action and observation targets -- instead of a ``[T, V]`` log-softmax per completion.
* ``completion_loss``, ``share_loss``: a completion's loss terms, and a share's part of a step's loss.
* ``step_plan``: which completions each optimizer step takes (``gradient_accumulation_steps``), and ``step_weights``,
  each member's share of the step's loss.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kiln.errors import (
    DataSchemaError,
    TrainingDataError,
    TrainingFailedError,
    ZeroActionTokensError,
    ZeroEnvTokensError,
    ZeroGroupsError,
)
from kiln.trainers._forwards import selected_logits
from kiln.training import grpo_objective as obj

__all__ = [
    "BatchedForwards",
    "ReferencePolicy",
    "completion_loss",
    "equal_rewards",
    "filter_groups",
    "group_logprobs",
    "ingest",
    "logprobs",
    "plan_groups",
    "share_loss",
    "step_plan",
    "step_weights",
]


def filter_groups(job: Any) -> tuple[list[Any], dict[str, int]]:
    """The groups that train, and the counts of those dropped (dynamic sampling, variance filter)."""
    cfg = job.config
    kept, dynamic, variance = [], 0, 0
    for group in job.ingestion.groups:
        keep, reason = obj.keep_group(
            [c.reward for c in group.completions],
            dynamic_sampling=cfg["dynamic_sampling"],
            var_min=cfg["reward_filter_var_min"],
            var_max=cfg["reward_filter_var_max"],
        )
        if keep:
            kept.append(group)
        elif reason == obj.DROP_EQUAL_REWARDS:
            dynamic += 1
        else:
            variance += 1
    counts = {"dynamic": dynamic, "variance": variance}
    filtering = cfg["reward_filter_var_min"] is not None or cfg["reward_filter_var_max"] is not None
    if filtering and len(kept) < cfg["reward_filter_min_groups"]:
        if cfg["reward_filter_on_empty"] == "fail":
            raise ZeroGroupsError(
                f"the reward-variance filter kept {len(kept)} group(s), fewer than reward_filter_min_groups "
                f"{cfg['reward_filter_min_groups']}",
                counts,
            )
        if cfg["reward_filter_on_empty"] == "train-all":
            kept = [g for g in job.ingestion.groups if not (cfg["dynamic_sampling"] and equal_rewards(g))]
            counts["variance"] = 0
        else:  # skip: finish without an update
            kept = []
    elif not kept:
        raise ZeroGroupsError("every group was filtered out; nothing would train", counts)
    if cfg["loss"]["no_policy_loss"] and not any(c.observation_tokens for g in kept for c in g.completions):
        raise ZeroEnvTokensError(
            "loss.no_policy_loss trains the ECHO term alone, but no group that would train has an observation "
            "token; nothing would train",
            counts,
        )
    return kept, counts


def equal_rewards(group: Any) -> bool:
    """Every completion of the group got the same reward (what dynamic sampling drops)."""
    rewards = [c.reward for c in group.completions]
    return max(rewards) == min(rewards)


def plan_groups(job: Any) -> tuple[list[Any], dict[str, int]]:
    """The trainable groups in order (empty when the filters leave nothing) and the filter counts."""
    try:
        return filter_groups(job)
    except (ZeroGroupsError, ZeroEnvTokensError) as exc:
        return [], exc.counts


# the failure a dry run records for training data refused at admission, by the refusal's reason
DRY_RUN_FAILURES: dict[str, type[TrainingFailedError]] = {
    "data_schema_error": DataSchemaError,
    "zero_action_tokens": ZeroActionTokensError,
    "zero_groups": ZeroGroupsError,
}


def ingest(request: dict[str, Any], tokenizer: Any, cfg: dict[str, Any], pin: str | None) -> tuple[Any, Any]:
    """``(ingestion, refusal)``: the request's groups read and tokenised (``kiln.data.read_groups``), and None. Data
    refused in a dry run gives an ingestion without groups (the pinned file's path and digest) and the failure the
    dry run's receipt records; any other run's refusal raises (nothing is written for a refused request)."""
    from kiln.data import read_groups, refused_ingestion

    echo = cfg["loss"]["echo"]
    try:
        ingestion = read_groups(
            tokenizer=tokenizer,
            groups=request.get("groups"),
            agentic_groups=request.get("agentic_groups"),
            dataset_path=request.get("dataset_path"),
            warning_filter=echo["warning_filter"] if echo else True,
            behavior_policy=cfg["behavior_policy"],
        )
    except TrainingDataError as refused:
        if not request.get("dry_run") or pin is None:
            raise
        return refused_ingestion(request["dataset_path"], pin), DRY_RUN_FAILURES[refused.reason](refused.message)
    return ingestion, None


def step_plan(kept: list[Any], aggregation: str, accumulation: int) -> list[list[tuple[int, list[int]]]]:
    """The run's optimizer steps in order, each a list of shares ``(group number from 1, completion indices)``: one
    backward each, their gradients added up before the step.

    ``token_level``: ``accumulation`` consecutive groups, a share per group with all its completions (the last step
    takes what is left). ``per_sample``: ``accumulation`` consecutive completions of one group, a share per
    completion; a step never spans two groups, so every group ends on a step boundary."""
    if aggregation == "token_level":
        numbered = [(n, list(range(len(g.completions)))) for n, g in enumerate(kept, start=1)]
        return [numbered[i : i + accumulation] for i in range(0, len(numbered), accumulation)]
    return [
        [(n, [i]) for i in range(start, min(start + accumulation, len(g.completions)))]
        for n, g in enumerate(kept, start=1)
        for start in range(0, len(g.completions), accumulation)
    ]


def step_weights(kept: list[Any], shares: list[tuple[int, list[int]]], aggregation: str) -> list[tuple[float, float]]:
    """Per share of a step, ``(loss weight, ECHO weight)``: the factors that turn the share's own reduction (the
    token mean over its action tokens) and its ECHO term (λ times its observation-token mean) into its part of the
    step's loss -- the token mean over all the step's action tokens (``per_sample``: the mean of the per-completion
    means) plus λ times the mean cross-entropy over all its observation tokens. A step of one share has weights
    (1, 1): today's arithmetic exactly."""
    if len(shares) == 1:
        return [(1.0, 1.0)]

    def count(number: int, indices: list[int], mask: str) -> int:
        return sum(sum(bool(m) for m in getattr(kept[number - 1].completions[i], mask)) for i in indices)

    actions = [count(n, idx, "action_mask") for n, idx in shares]
    observed = [count(n, idx, "observation_mask") for n, idx in shares]
    total, total_obs = max(sum(actions), 1), max(sum(observed), 1)
    per_sample = aggregation == "per_sample"
    return [
        (1.0 / len(shares) if per_sample else a / total, o / total_obs) for a, o in zip(actions, observed, strict=True)
    ]


def logprobs(model: Any, ids: Any) -> tuple[Any, Any]:
    """Log-probabilities of every next token ``[T-1, V]`` and of the taken ones ``[T-1]``, from the model's own
    logits (``kiln.model.forward_logits``: after its soft-cap or scaling)."""
    import torch

    from kiln.model import forward_logits

    logits = forward_logits(model, ids)[:-1]
    logp = torch.log_softmax(logits, dim=-1)
    return logp, logp.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)


def group_logprobs(
    model: Any, head: Any, sequences: list[Any], wanted: list[Any], *, entropy: bool = False
) -> list[tuple[Any, Any]]:
    """Per sequence ``(taken [T-1], entropy [T-1] or None)`` from one right-padded forward of all of them.

    Only the positions where ``wanted[i]`` (a bool ``[T_i - 1]``) is true are computed; the others are 0 (the
    objective masks them). Row ``p`` is the distribution of token ``p + 1`` under the model's own logits: the head
    (and bias) and ``head.logit_map`` applied to the decoder's hidden states, in fp32."""
    import torch

    found = selected_logits(model, head, sequences, wanted)
    positions, targets = found.positions, found.targets
    logp = torch.log_softmax(found.rows, dim=-1)
    taken = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
    spread = -(logp.exp() * logp).sum(-1) if entropy else None
    results, start = [], 0
    for seq, pos in zip(sequences, positions, strict=True):
        stop = start + pos.numel()
        zeros = torch.zeros(len(seq) - 1, dtype=taken.dtype)
        row = zeros.index_put((pos,), taken[start:stop])
        results.append((row, None if spread is None else zeros.index_put((pos,), spread[start:stop].detach())))
        start = stop
    return results


class ReferencePolicy:
    """``reference(ids)``: the reference's log-probabilities of the taken tokens of ``ids`` (no gradient).

    Call it before the policy forward of the same step: an EMA reference is swapped into the LoRA tensors, which
    must not happen between a policy forward and its backward."""

    def __init__(self, model: Any, params: dict[str, Any], ema: Any, timings: dict[str, float]) -> None:
        self.model, self.params, self.ema, self.timings = model, params, ema, timings

    @contextmanager
    def _as_reference(self) -> Iterator[None]:
        """No gradient, and the reference in place: the adapter disabled, or the EMA tensors swapped in."""
        import torch

        with torch.no_grad():
            if self.ema is None:  # base_per_step: the frozen base model
                with self.model.disable_adapter():
                    yield
                return
            saved = {n: p.detach().clone() for n, p in self.params.items()}  # ema: the averaged LoRA tensors
            for name, tensor in self.ema.tensors.items():
                self.params[name].copy_(tensor)
            try:
                yield
            finally:
                for name, tensor in saved.items():
                    self.params[name].copy_(tensor)

    def __call__(self, ids: Any) -> Any:
        t0 = time.perf_counter()
        with self._as_reference():
            _, taken = logprobs(self.model, ids)
        self.timings["reference_forward_ms"] += (time.perf_counter() - t0) * 1000
        return taken

    def group(self, head: Any, sequences: list[Any], wanted: list[Any]) -> list[Any]:
        """The reference's taken log-probabilities of several sequences: one batched forward (``group_logprobs``)
        inside one ``disable_adapter()`` or one EMA swap."""
        t0 = time.perf_counter()
        with self._as_reference():
            found = group_logprobs(self.model, head, sequences, wanted)
        self.timings["reference_forward_ms"] += (time.perf_counter() - t0) * 1000
        return [taken for taken, _ in found]


class BatchedForwards:
    """A group's forwards, ``width`` (``micro_batch_size``) completions at a time; width 1 leaves each completion
    to its own dense forward (``policy`` answers None for it, ``references`` calls the reference per completion)."""

    def __init__(self, model: Any, head: Any, reference: ReferencePolicy, width: int, *, echo: bool, entropy: bool):
        self.model, self.head, self.reference, self.width = model, head, reference, width
        self.echo, self.entropy = echo, entropy

    def _batches(self, completions: list[Any]) -> list[list[Any]]:
        return [completions[i : i + self.width] for i in range(0, len(completions), self.width)]

    def _wanted(self, c: Any) -> list[bool]:
        """The positions a loss reads: the action targets, and ECHO's observation targets."""
        return [a or (self.echo and o) for a, o in zip(c.action_mask, c.observation_mask, strict=True)]

    def references(self, completions: list[Any]) -> list[Any]:
        import torch

        if self.width == 1:
            return [self.reference(torch.tensor(c.input_ids, dtype=torch.long)) for c in completions]
        return [
            taken
            for part in self._batches(completions)
            for taken in self.reference.group(self.head, [c.input_ids for c in part], [self._wanted(c) for c in part])
        ]

    def policy(self, completions: list[Any], timings: dict[str, float]) -> list[Any]:
        """Per completion ``(taken, entropy)`` with gradient, or None when each runs its own forward (width 1)."""
        if self.width == 1:
            return [None] * len(completions)
        t0 = time.perf_counter()
        found = [
            row
            for part in self._batches(completions)
            for row in group_logprobs(
                self.model,
                self.head,
                [c.input_ids for c in part],
                [self._wanted(c) for c in part],
                entropy=self.entropy,
            )
        ]
        timings["policy_forward_ms"] += (time.perf_counter() - t0) * 1000
        return found


def completion_loss(
    cfg: dict[str, Any],
    audits: dict[str, Any],
    c: Any,
    advantage: float,
    ref: Any,
    taken: Any,
    spread: Any,
    *,
    kl_on: bool,
) -> tuple[Any, Any, Any, Any]:
    """One completion: its per-token policy(+KL) loss and action mask ``[1, T-1]``, and the log-probabilities of its
    taken tokens with their observation mask ``[T-1]`` (ECHO). ``taken``/``spread``: the policy's log-probabilities of
    the taken tokens and its per-position entropy (None unless the KL is entropy-aware); ``ref``: the reference's."""
    import torch

    mask = torch.tensor(c.action_mask, dtype=torch.bool).unsqueeze(0)
    new = taken.unsqueeze(0)
    behavior = None
    if cfg["behavior_policy"] == "recorded":
        behavior = torch.zeros_like(new)
        behavior[mask] = torch.tensor(c.recorded_logprobs, dtype=new.dtype)
    per_token, is_audit = obj.policy_loss(
        new,
        behavior,
        torch.tensor([[advantage]], dtype=new.dtype),
        mask,
        is_level=cfg["is_level"],
        clip_low=cfg["clip_epsilon"],
        clip_high=cfg["clip_eps_high"],
        cispo_max_weight=cfg["cispo_max_weight"],
    )
    audits["is"].add(is_audit)
    if cfg["loss"]["no_policy_loss"]:
        per_token = torch.zeros_like(per_token)
    if kl_on:
        entropy = None if spread is None else spread.detach().unsqueeze(0)
        kl, kl_audit = obj.kl_estimate(
            new,
            ref.unsqueeze(0),
            mask,
            cfg["kl_estimator"],
            entropy=entropy,
            entropy_quantile=cfg["entropy_aware_kl_quantile"],
        )
        audits["kl"].add(kl_audit)
        per_token = per_token + cfg["kl_coeff"] * kl
    return per_token, mask, taken, torch.tensor(c.observation_mask, dtype=torch.bool)


def share_loss(
    parts: list[tuple[Any, Any, Any, Any]], weight: float, echo_weight: float, echo: dict[str, Any] | None
) -> tuple[Any, tuple[float, int] | None]:
    """A share's part of its step's loss (``step_weights``): the policy loss reduced over the parts' action tokens,
    plus ECHO's λ·CE over their observation tokens, each scaled by its weight; and ``(CE, observation tokens)``, None
    without ECHO or without an observation token."""
    import torch

    width = max(p.shape[-1] for p, _, _, _ in parts)
    per_token = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[-1])) for p, _, _, _ in parts])
    mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[-1])) for _, m, _, _ in parts])
    loss = obj.aggregate(per_token, mask, "token_level")
    if weight != 1.0:
        loss = loss * weight
    found = None
    if echo is not None:
        observation = torch.cat([o for _, _, _, o in parts])
        term, env_ce = obj.echo_loss(torch.cat([t for _, _, t, _ in parts]), observation, float(echo["lambda"]))
        if env_ce is not None:
            loss = loss + (term if echo_weight == 1.0 else term * echo_weight)
            found = (env_ce, int(observation.sum()))
    return loss, found
