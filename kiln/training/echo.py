"""ECHO, the term GRPO and OPD share: λ times the cross-entropy of the observation tokens (what the environment said),
trained alongside the objective so the policy keeps modelling its inputs. Like the GRPO objective it imports only
torch and the standard library; the effective term of a config is ``kiln.training.Echo``.

* ``echo_loss``: ``(λ·CE, CE)`` over the observation tokens of one share of a step, from the log-probabilities of their
  targets (``echo_from_logits``: from the logits at their positions); ``step_echo_ce``: a step's CE from its shares;
* ``EchoAccumulator``: the run-level state (``LoopEchoMetrics`` of a loop state) and the receipt's ``echo`` block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.training._checks import active_mask, check_members

__all__ = ["ECHO_NEVER_CONTRIBUTED", "EchoAccumulator", "echo_from_logits", "echo_loss", "step_echo_ce"]

ECHO_NEVER_CONTRIBUTED = "no optimizer step had observation tokens for the ECHO term"


def echo_loss(
    logp_on_observation_targets: torch.Tensor, observation_mask: torch.Tensor, lam: float
) -> tuple[torch.Tensor, float | None]:
    """ECHO: ``(λ·CE, CE)`` with CE = −Σ m·logπθ / Σ m over the observation tokens.

    CE (a float, unweighted) is what the receipt records as the environment cross-entropy;
    it is None when there is no observation token, and the loss is then a connected 0.
    """
    if not lam >= 0:
        raise ValueError(f"ECHO lambda must be >= 0, got {lam}")
    active = active_mask(observation_mask, logp_on_observation_targets)
    logp = torch.where(active, logp_on_observation_targets, torch.zeros_like(logp_on_observation_targets))
    n = int(active.sum())
    ce = -logp.sum() / max(n, 1)
    return lam * ce, (float(ce.detach()) if n else None)


def echo_from_logits(
    rows: torch.Tensor, targets: torch.Tensor, lam: float, weight: float
) -> tuple[torch.Tensor, tuple[float, int] | None]:
    """ECHO's part of a step's loss from the logits ``rows`` of a sequence's observation targets ``targets``: λ times
    their mean cross-entropy, times ``weight`` (its share of the step); and ``(CE, tokens)`` (None: no token)."""
    taken = torch.log_softmax(rows.float(), dim=-1).gather(-1, targets.to(rows.device).unsqueeze(-1)).squeeze(-1)
    term, env_ce = echo_loss(taken, torch.ones_like(taken, dtype=torch.bool), lam)
    return (term if weight == 1.0 else term * weight), (None if env_ce is None else (env_ce, len(targets)))


def step_echo_ce(found: Sequence[tuple[float, int] | None]) -> float | None:
    """An optimizer step's ECHO cross-entropy from its shares' ``(CE, observation tokens)`` (None: a share without
    one): the mean over all the step's observation tokens; a single share's CE exactly; None when no share has one."""
    seen = [f for f in found if f is not None]
    if len(seen) <= 1:
        return seen[0][0] if seen else None
    return sum(ce * n for ce, n in seen) / sum(n for _, n in seen)


@dataclass
class EchoAccumulator:
    """Run-level ECHO state; its fields are the loop state's ``LoopEchoMetrics``."""

    contributed: bool = False
    observations: int = 0
    initial_env_ce: float | None = None
    last_env_ce: float | None = None

    def add(self, env_ce: float | None) -> None:
        """Record the environment CE of one optimizer step the term contributed to (None: it did not)."""
        if env_ce is None:
            return
        self.contributed = True
        self.observations += 1
        if self.initial_env_ce is None:
            self.initial_env_ce = env_ce
        self.last_env_ce = env_ce

    def loop_state(self) -> dict[str, Any]:
        return {
            "contributed": self.contributed,
            "observations": self.observations,
            "initial_env_ce": self.initial_env_ce,
            "last_env_ce": self.last_env_ce,
        }

    @classmethod
    def from_loop_state(cls, state: Mapping[str, Any]) -> EchoAccumulator:
        check_members(state, cls().loop_state(), "the ECHO loop state")
        return cls(**state)

    def as_receipt(
        self,
        *,
        lam: float | None,
        env_mask_mode: str | None,
        warning_filter: bool | None,
        dropped_reason: str | None = None,
    ) -> dict[str, Any]:
        """``TrainReceiptEcho``; pass None for all three settings when ECHO was not configured.

        A configured term that never contributed gets ``dropped_reason`` (a generic one
        when the caller gives none).
        """
        configured = lam is not None
        if not configured and (env_mask_mode is not None or warning_filter is not None or self.contributed):
            raise ValueError("ECHO settings or contributions without a configured lambda")
        receipt: dict[str, Any] = {
            "enabled": self.contributed,
            "lambda": lam,
            "env_mask_mode": env_mask_mode,
            "warning_filter": warning_filter,
            "initial_env_ce": self.initial_env_ce,
            "final_env_ce": self.last_env_ce,
        }
        if configured and not self.contributed:
            receipt["dropped_reason"] = dropped_reason or ECHO_NEVER_CONTRIBUTED
        return receipt
