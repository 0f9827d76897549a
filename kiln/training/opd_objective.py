"""The OPD objective and its collapse diagnostics (torch only).

Loss (spec/40 "OPD"): at every action position the teacher returns its top-K ids with
log-probabilities. Student and teacher distributions are both restricted to those K ids
and renormalised: p̂ = softmax(student logits[ids]) (the student, which is being
trained), q̂ = softmax(teacher logprobs). The per-position loss is the reverse KL
KL(p̂ ‖ q̂) = Σ_k p̂_k (log p̂_k − log q̂_k), and a candidate's loss is the mean over its
action positions. Restricting the student's logits to K ids and renormalising equals
renormalising its full softmax over those ids, so the full log-softmax is never needed.

Collapse diagnostics (``CollapseAccumulator``) are running sums over every settled
candidate (empty rollouts included): rollouts, truncated rollouts (stopped by the token
limit rather than an end-of-turn), response tokens, the sum and count of per-rollout mean
KL, and the sum of compression ratios (raw UTF-8 length / zlib level-9 compressed length of
the response decoded with its special tokens; higher means more repetitive; 1.0 for a
response that decodes to no bytes) over rollouts with at least one token. A snapshot turns
them into means (``OpdCollapseSnapshot``; in the receipt ``repetition_rate`` is the mean
compression ratio).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["CollapseAccumulator", "compression_ratio", "top_k_reverse_kl"]


def top_k_reverse_kl(student_logits: Any, teacher_ids: Any, teacher_logprobs: Any) -> tuple[Any, Any]:
    """Mean and per-position reverse KL of the renormalised top-K distributions.

    ``student_logits`` ``[A, V]`` (differentiable), ``teacher_ids`` ``[A, K]`` (long),
    ``teacher_logprobs`` ``[A, K]`` (on any device: they are read where the student's logits are). Returns
    ``(loss, per_position [A])``.
    """
    import torch

    picked = student_logits.float().gather(-1, teacher_ids.to(student_logits.device))
    log_p = picked - torch.logsumexp(picked, dim=-1, keepdim=True)
    teacher = teacher_logprobs.to(log_p.device, log_p.dtype)
    log_q = teacher - torch.logsumexp(teacher, dim=-1, keepdim=True)
    per_position = (log_p.exp() * (log_p - log_q)).sum(-1)
    return per_position.mean(), per_position


def compression_ratio(text: str) -> float | None:
    """Raw UTF-8 length / zlib (level 9) length; None for an empty text."""
    raw = text.encode("utf-8")
    if not raw:
        return None
    return len(raw) / len(zlib.compress(raw, 9))


@dataclass
class CollapseAccumulator:
    """``OpdCollapseAccumulators``: running sums over settled candidates."""

    rollouts: int = 0
    truncated_rollouts: int = 0
    response_tokens: int = 0
    kl_sum: float = 0.0
    kl_observations: int = 0
    compression_ratio_sum: float = 0.0
    nonempty_rollouts: int = 0  # derived (rollouts with a compression ratio); not serialised

    def add(self, *, tokens: int, truncated: bool, mean_kl: float | None, text: str) -> None:
        self.rollouts += 1
        self.truncated_rollouts += int(truncated)
        self.response_tokens += tokens
        if mean_kl is not None:
            self.kl_sum += float(mean_kl)
            self.kl_observations += 1
        if tokens:
            self.compression_ratio_sum += compression_ratio(text) or 1.0
            self.nonempty_rollouts += 1

    def state(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("nonempty_rollouts")
        return out

    @classmethod
    def from_state(cls, state: Mapping[str, Any], nonempty_rollouts: int) -> CollapseAccumulator:
        expected = set(cls().state())
        if set(state) != expected:
            raise ValueError(f"collapse accumulators have members {sorted(state)}, expected {sorted(expected)}")
        return cls(**{**state, "kl_sum": float(state["kl_sum"])}, nonempty_rollouts=nonempty_rollouts)

    def snapshot(self, global_step: int) -> dict[str, Any]:
        """``OpdCollapseSnapshot`` at ``global_step``."""
        return {
            "global_step": global_step,
            "candidates_consumed": self.rollouts,
            "mean_kl": self.kl_sum / self.kl_observations if self.kl_observations else None,
            "truncation_rate": self.truncated_rollouts / self.rollouts if self.rollouts else 0.0,
            "mean_compression_ratio": (
                self.compression_ratio_sum / self.nonempty_rollouts if self.nonempty_rollouts else None
            ),
            "mean_response_tokens": self.response_tokens / self.rollouts if self.rollouts else None,
        }


def receipt_snapshot(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """The receipt's ``TrainReceiptOpdCollapseSnapshot`` view of a loop-state snapshot."""
    rollouts = snapshot["candidates_consumed"]
    return {
        "global_step": snapshot["global_step"],
        "mean_kl": snapshot["mean_kl"],
        "truncation_rate": snapshot["truncation_rate"] if rollouts else None,
        "repetition_rate": snapshot["mean_compression_ratio"],
        "mean_response_tokens": snapshot["mean_response_tokens"],
    }
