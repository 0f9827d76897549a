"""GRPO's components: the training plan, the log-probabilities of a completion, the reference policy.

* The plan -- which groups train, in which order, and the counts of those the filters dropped -- is decided before
  training from the rewards alone (``dynamic_sampling`` drops groups whose completions all got the same
reward; the reward-variance filter keeps groups whose variance lies in ``[reward_filter_var_min,
reward_filter_var_max]``, with ``reward_filter_on_empty`` deciding what happens when fewer than
``reward_filter_min_groups`` remain), so the trainable order is known up front and a checkpoint can bind it.
* ``ReferencePolicy``: the KL reference's log-probabilities of the taken tokens -- the frozen base (the adapter
  disabled for one forward) or the EMA of the LoRA tensors (swapped in for one forward, then back).
"""

from __future__ import annotations

import time
from typing import Any

from kiln.errors import ZeroGroupsError
from kiln.training import grpo_objective as obj

__all__ = ["ReferencePolicy", "equal_rewards", "filter_groups", "logprobs", "plan_groups"]


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
    return kept, counts


def equal_rewards(group: Any) -> bool:
    """Every completion of the group got the same reward (what dynamic sampling drops)."""
    rewards = [c.reward for c in group.completions]
    return max(rewards) == min(rewards)


def plan_groups(job: Any) -> tuple[list[Any], dict[str, int]]:
    """The trainable groups in order (empty when the filters leave nothing) and the filter counts."""
    try:
        return filter_groups(job)
    except ZeroGroupsError as exc:
        return [], exc.counts


def logprobs(model: Any, ids: Any) -> tuple[Any, Any]:
    """Log-probabilities of every next token ``[T-1, V]`` and of the taken ones ``[T-1]``, from the model's own
    logits (``kiln.model.forward_logits``: after its soft-cap or scaling)."""
    import torch

    from kiln.model import forward_logits

    logits = forward_logits(model, ids)[:-1]
    logp = torch.log_softmax(logits, dim=-1)
    return logp, logp.gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)


class ReferencePolicy:
    """``reference(ids)``: the reference's log-probabilities of the taken tokens of ``ids`` (no gradient).

    Call it before the policy forward of the same step: an EMA reference is swapped into the LoRA tensors, which
    must not happen between a policy forward and its backward."""

    def __init__(self, model: Any, params: dict[str, Any], ema: Any, timings: dict[str, float]) -> None:
        self.model, self.params, self.ema, self.timings = model, params, ema, timings

    def __call__(self, ids: Any) -> Any:
        import torch

        t0 = time.perf_counter()
        with torch.no_grad():
            if self.ema is None:  # base_per_step: the frozen base model
                with self.model.disable_adapter():
                    _, taken = logprobs(self.model, ids)
            else:  # ema: the averaged LoRA tensors in place for one forward
                saved = {n: p.detach().clone() for n, p in self.params.items()}
                for name, tensor in self.ema.tensors.items():
                    self.params[name].copy_(tensor)
                _, taken = logprobs(self.model, ids)
                for name, tensor in saved.items():
                    self.params[name].copy_(tensor)
        self.timings["reference_forward_ms"] += (time.perf_counter() - t0) * 1000
        return taken
