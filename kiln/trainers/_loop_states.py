"""The committed state of each trainer's loop, and its loop-state document (``<kind>_loop_state.json``).

A checkpoint stores the document; a resume restores the state from it. The loops themselves -- what a step does --
stay in the trainer files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.batch_plan import grouped_order, steps_per_epoch
from kiln.digests import json_sha256
from kiln.epoch_order import epoch_order
from kiln.errors import TrainingFailedError
from kiln.trainers._grpo_parts import equal_rewards
from kiln.training.grpo_objective import EchoAccumulator, ImportanceSamplingAccumulator, KlReferenceAccumulator
from kiln.training.opd_objective import CollapseAccumulator

__all__ = ["GrpoLoop", "OpdLoop", "SftLoop", "grpo_cursor", "grpo_token_counts", "phase_timings"]

DIVERGENCE_RATIO = 8.0
DIVERGENCE_MARGIN = 5.0
TIMED_PHASES = ("reference_forward_ms", "policy_forward_ms", "backward_ms", "optimizer_ms")


def phase_timings(tokenize_ms: float, timings: dict[str, float]) -> dict[str, float]:
    """The loop state's ``phase_timings``: tokenisation, and the time of each phase of this process so far."""
    return {"tokenize_ms": tokenize_ms, "mask_build_ms": 0.0, **{k: timings.get(k, 0.0) for k in TIMED_PHASES}}


# ----------------------------------------------------------------------------- SFT


@dataclass
class SftLoop:
    """The SFT loop's committed state; ``as_document`` is ``sft_loop_state.json``.

    ``rows`` is the rows per optimizer step and ``lengths`` the row lengths when the order is grouped by length
    (``kiln.batch_plan``); ``order`` is the current epoch's order and ``cursor`` the position of its next row.
    """

    items: int
    epochs: int
    seed: int
    rows: int = 1
    lengths: list[int] | None = None
    global_step: int = 0
    epoch_index: int = 0
    cursor: int = 0
    losses: list[float] = field(default_factory=list)
    epoch_sum: float = 0.0
    first_epoch_loss: float | None = None
    best_epoch_loss: float | None = None
    grad_norms: dict[str, list[float]] = field(default_factory=dict)  # module -> [count, sum, min, max]
    order: list[int] = field(default_factory=list)

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.items, self.rows)

    @property
    def total(self) -> int:
        return self.epochs * self.steps_per_epoch

    @property
    def rows_consumed(self) -> int:
        """Rows trained so far, over all epochs."""
        return self.epoch_index * self.items + self.cursor

    def step_rows(self) -> list[int]:
        """The row indices of the next optimizer step."""
        return self.order[self.cursor : self.cursor + self.rows]

    def refresh_order(self) -> None:
        if self.global_step >= self.total:
            self.order = []
            return
        order = epoch_order(self.seed, self.epoch_index, self.items)
        self.order = order if self.lengths is None else grouped_order(order, self.lengths, self.rows)

    def commit(self, loss: float, norms: dict[str, float], rows: int = 1) -> bool:
        """Record one optimizer step over ``rows`` rows; True when it ended an epoch."""
        self.losses.append(loss)
        self.global_step += 1
        self.cursor += rows
        self.epoch_sum += loss
        for module, value in sorted(norms.items()):
            acc = self.grad_norms.get(module)
            if acc is None:
                self.grad_norms[module] = [1, value, value, value]
            else:
                acc[0] += 1
                acc[1] += value
                acc[2] = min(acc[2], value)
                acc[3] = max(acc[3], value)
        if self.cursor < self.items:
            return False
        mean = self.epoch_sum / self.steps_per_epoch
        if self.first_epoch_loss is None:
            self.first_epoch_loss = self.best_epoch_loss = mean
        else:
            _check_divergence(self.epoch_index + 1, mean, self.first_epoch_loss, self.best_epoch_loss)
            self.best_epoch_loss = min(self.best_epoch_loss, mean)
        self.epoch_index += 1
        self.cursor = 0
        self.epoch_sum = 0.0
        self.refresh_order()
        return True

    def as_document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema_version": 1,
            "state_type": "kiln.sft-loop-state.v1",
            "global_step": self.global_step,
            "epoch_index": self.epoch_index,
            "cursor_in_epoch": self.cursor,
        }
        if self.rows > 1:
            doc["rows_per_step"] = self.rows
        doc.update(
            {
                "loss_history": list(self.losses),
                "last_loss": self.losses[-1] if self.losses else None,
                "current_epoch_loss_sum": self.epoch_sum,
                "current_epoch_items": self.cursor,
                "lora_grad_norms": [
                    {"module": m, "sample_count": int(a[0]), "sum": a[1], "min": a[2], "max": a[3]}
                    for m, a in sorted(self.grad_norms.items())
                ],
            }
        )
        if self.epoch_index > 0:
            doc["first_epoch_loss"] = self.first_epoch_loss
            doc["best_epoch_loss"] = self.best_epoch_loss
        return doc

    def restore(self, doc: dict[str, Any]) -> None:
        """Take the committed state of a checkpoint's loop-state document (same plan: rows, lengths, seed)."""
        self.global_step, self.epoch_index, self.cursor = doc["global_step"], doc["epoch_index"], doc["cursor_in_epoch"]
        self.losses = list(doc["loss_history"])
        self.epoch_sum = doc["current_epoch_loss_sum"]
        self.first_epoch_loss = doc.get("first_epoch_loss")
        self.best_epoch_loss = doc.get("best_epoch_loss")
        self.grad_norms = {
            g["module"]: [g["sample_count"], g["sum"], g["min"], g["max"]] for g in doc["lora_grad_norms"]
        }
        self.refresh_order()


def _check_divergence(epoch_number: int, mean: float, first: float, best: float) -> None:
    if mean > DIVERGENCE_RATIO * first and mean > best + DIVERGENCE_MARGIN:
        raise TrainingFailedError(
            f"training diverged: epoch {epoch_number} mean loss {mean:.4f} exceeds {DIVERGENCE_RATIO:g}x the "
            f"first epoch ({first:.4f}) and the best epoch ({best:.4f}) by more than {DIVERGENCE_MARGIN:g}",
        )


# ----------------------------------------------------------------------------- GRPO


def grpo_token_counts(groups: list[Any]) -> dict[str, int]:
    """``token_counts`` of the completions of ``groups``."""
    action = sum(c.action_tokens for g in groups for c in g.completions)
    env = sum(c.observation_tokens for g in groups for c in g.completions)
    warning = sum(c.warning_tokens for g in groups for c in g.completions)
    total = sum(len(c.input_ids) for g in groups for c in g.completions)
    return {
        "action_tokens": action,
        "env_tokens": env,
        "env_tokens_before_warning_filter": env + warning,
        "env_tokens_after_warning_filter": env,
        "warning_tokens_filtered": warning,
        "context_tokens": total - action - env,
    }


def grpo_cursor(ingestion: Any, consumed: int, ema: Any, committed: int, *, loop: bool = False) -> dict[str, Any]:
    """The progress-dependent members shared by the GRPO loop state and ``auxiliary_state``: the streamed source's
    byte offset, lines consumed (and, in the manifest, their digest) and the EMA reference's cadence."""
    out: dict[str, Any] = {}
    if ingestion.route == "jsonl":
        position = ingestion.positions[consumed - 1] if consumed else None
        out["source_byte_offset"] = position.source_byte_offset if position else 0
        out["source_lines_consumed"] = position.source_lines_consumed if position else 0
        if not loop:
            out["consumed_lines_sha256"] = position.consumed_lines_sha256 if position else json_sha256([])
    if ema is not None:
        out["ema_groups_since_refresh"] = ema.groups_since_refresh(committed)
    return out


@dataclass
class GrpoLoop:
    """The GRPO loop's committed state; ``as_document`` is ``grpo_loop_state.json``."""

    route: str
    audits: dict[str, Any]
    timings: dict[str, float]
    groups_committed: int = 0  # trainable groups done (the cursor into the trainable order)
    losses: list[float] = field(default_factory=list)
    completions: int = 0

    def consumed(self, kept: list[Any]) -> int:
        """Groups of the source read so far (the trainable ones done and those filtered before them)."""
        return kept[self.groups_committed - 1].index + 1 if self.groups_committed else 0

    def as_document(self, job: Any, kept: list[Any], ema: Any) -> dict[str, Any]:
        groups = job.ingestion.groups
        consumed = self.consumed(kept)
        done = kept[: self.groups_committed]
        filtered = consumed - self.groups_committed
        dynamic = (
            sum(1 for g in groups[:consumed] if g not in done and equal_rewards(g))
            if job.config["dynamic_sampling"]
            else 0
        )
        doc: dict[str, Any] = {
            "schema_version": 1,
            "state_type": "kiln.grpo-loop-state.v1",
            "route": self.route,
            "global_step": len(self.losses),
            "processed_completions": self.completions,
            "loss_history": list(self.losses),
            "last_loss": self.losses[-1] if self.losses else None,
            "data_stats": {
                "groups_read": consumed,
                "groups_filtered": filtered,
                "groups_trained": self.groups_committed,
                "completions_read": sum(len(g.completions) for g in groups[:consumed]),
                "completions_trained": self.completions,
            },
            "token_counts": grpo_token_counts(done),
            "dynamic_groups_filtered": min(dynamic, filtered),
            "echo_metrics": self.audits["echo"].loop_state(),
            "lora_grad_norms": [],
            "policy_audit": {
                "importance_sampling": self.audits["is"].loop_state(),
                "kl_reference": self.audits["kl"].loop_state(),
                "recorded_provenance": {
                    "completion_count": 0,
                    "sampled_action_tokens": 0,
                    "forced_action_tokens": 0,
                    "behavior_sources": [],
                },
            },
            "phase_timings": phase_timings(job.tokenize_ms, self.timings),
            "writer_timings": {"gpu_writer_wait_ms": 0.0, "gpu_writer_held_ms": 0.0, "gpu_writer_acquisitions": 0},
        }
        doc.update(grpo_cursor(job.ingestion, consumed, ema, self.groups_committed, loop=True))
        return doc

    def restore(self, resume: Any, ema: Any) -> None:
        """The committed state, audits and EMA reference of the checkpoint a run resumes from."""
        from safetensors.torch import load as load_tensors

        manifest, state = resume.manifest, resume.loop_state
        if ema is not None:
            ema.load_state_dict(load_tensors(resume.blobs[manifest["state_files"]["reference_state"]]))
        self.losses.extend(state["loss_history"])
        self.completions = state["processed_completions"]
        self.groups_committed = manifest["progress"]["cursor_in_epoch"]
        audit = state["policy_audit"]
        self.audits["is"] = ImportanceSamplingAccumulator.from_loop_state(audit["importance_sampling"])
        self.audits["kl"] = KlReferenceAccumulator.from_loop_state(audit["kl_reference"])
        self.audits["echo"] = EchoAccumulator.from_loop_state(state["echo_metrics"])


# ----------------------------------------------------------------------------- OPD


@dataclass
class OpdLoop:
    """The OPD loop's committed state; ``as_document`` is ``opd_loop_state.json``."""

    items: int
    per_step: int = 1  # candidates an optimizer step consumes
    epoch_index: int = 0
    cursor: int = 0
    consumed: int = 0
    empty: int = 0
    losses: list[float] = field(default_factory=list)
    action_tokens: int = 0
    env_tokens: int = 0
    collapse: CollapseAccumulator = field(default_factory=CollapseAccumulator)
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    echo: EchoAccumulator = field(default_factory=EchoAccumulator)
    timings: dict[str, float] = field(default_factory=dict)
    rollouts_sampled: int = 0

    @property
    def global_step(self) -> int:
        return len(self.losses)

    def settle(self) -> None:
        """One candidate consumed: advance the cursor (into the next epoch at the end of one)."""
        self.consumed += 1
        self.cursor += 1
        if self.cursor == self.items:
            self.epoch_index += 1
            self.cursor = 0

    def as_document(self, job: Any) -> dict[str, Any]:
        steps = {"candidates_per_step": self.per_step} if self.per_step > 1 else {}  # absent: 1, as before batches
        return {
            "schema_version": 1,
            "state_type": "kiln.opd-loop-state.v1",
            "global_step": self.global_step,
            "epoch_index": self.epoch_index,
            "cursor_in_epoch": self.cursor,
            "candidates_consumed": self.consumed,
            **steps,
            "empty_rollouts": self.empty,
            "loss_history": list(self.losses),
            "last_loss": self.losses[-1] if self.losses else None,
            "action_tokens": self.action_tokens,
            "env_tokens": self.env_tokens,
            "echo_metrics": self.echo.loop_state(),
            "collapse_guardrail": self.collapse.state(),
            "collapse_snapshots": list(self.snapshots),
            "teacher_id": job.teacher.alias,
            "teacher_identity_revision": job.teacher_identity_revision,
            "teacher_content_revision": job.teacher_content_revision,
            "lora_grad_norms": [],
            "phase_timings": phase_timings(job.source.tokenize_ms, self.timings),
        }

    @classmethod
    def restore(cls, items: int, state: dict[str, Any]) -> OpdLoop:
        loop = cls(items=items, per_step=state.get("candidates_per_step", 1))
        loop.epoch_index, loop.cursor = state["epoch_index"], state["cursor_in_epoch"]
        loop.consumed, loop.empty = state["candidates_consumed"], state["empty_rollouts"]
        loop.losses = list(state["loss_history"])
        loop.action_tokens, loop.env_tokens = state["action_tokens"], state["env_tokens"]
        loop.collapse = CollapseAccumulator.from_state(
            state["collapse_guardrail"], nonempty_rollouts=state["candidates_consumed"] - state["empty_rollouts"]
        )
        loop.snapshots = list(state["collapse_snapshots"])
        loop.echo = EchoAccumulator.from_loop_state(state["echo_metrics"])
        return loop
