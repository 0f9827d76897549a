"""Loop states (``<kind>_loop_state.json``, role ``loss-history`` in a checkpoint): the
trainer's own bookkeeping that an exact resume restores -- committed steps and cursors,
the loss history, running sums and diagnostics.

* ``kiln.sft-loop-state.v1`` (``SftLoopState``): step, epoch and cursor, one loss per
  committed step, the running sum of the current epoch and the per-epoch summaries the
  divergence check compares against.
* ``kiln.grpo-loop-state.v1`` (``GrpoLoopState``): route and streamed-source cursor, group
  and completion counters, token counts, ECHO metrics, the policy audit (importance
  sampling, KL reference, recorded behaviour provenance), timings and the EMA cadence.
* ``kiln.opd-loop-state.v1`` (``OpdLoopState``): optimizer step, candidate cursor and empty
  rollouts, collapse-guardrail accumulators and snapshots, teacher revisions.

Losses are compared exactly: the trainer writes the float64 values it accumulated, summed
left to right from 0.0, so a reader recomputes the same bits (an explicit loop, never
``sum()``, whose float algorithm differs between Python versions).

The ``*-loop.manifest-binding`` constraints compare a loop state with its checkpoint's
manifest and are enforced by the checkpoint directory loader.

``load_loop_state`` (strict), ``write_loop_state`` (canonical, atomic), both by training kind.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from kiln.documents import pipeline
from kiln.documents.batch_plan import steps_per_epoch
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

SFT = "SftLoopState"
GRPO = "GrpoLoopState"
OPD = "OpdLoopState"
LOOP_STATE_TYPES = {"sft": SFT, "grpo": GRPO, "opd": OPD}

__all__ = ["LOOP_STATE_TYPES", "float_sum", "load_loop_state", "loop_state_file_name", "write_loop_state"]


def float_sum(values: Sequence[float]) -> float:
    """The float64 sum of ``values``, left to right from 0.0, exactly as the trainers accumulate it."""
    total = 0.0
    for value in values:
        total += value
    return total


# -- shared by the three loop states ------------------------------------------------------


@semantic_rule(SFT, "sft-loop.loss-history-length")
@semantic_rule(GRPO, "grpo-loop.loss-history-length")
@semantic_rule(OPD, "opd-loop.loss-history-length")
def _loss_history_length(state: dict[str, Any], at: str) -> Iterable[Problem]:
    if len(state["loss_history"]) != state["global_step"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "loss_history"),
            f"loss_history has {len(state['loss_history'])} entries but global_step is {state['global_step']} (one loss per committed step)",
        )


@semantic_rule(SFT, "sft-loop.last-loss")
@semantic_rule(GRPO, "grpo-loop.last-loss")
@semantic_rule(OPD, "opd-loop.last-loss")
def _last_loss(state: dict[str, Any], at: str) -> Iterable[Problem]:
    last, history = state["last_loss"], state["loss_history"]
    if state["global_step"] == 0:
        if last is not None:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "last_loss"),
                f"last_loss is {last!r} but no step has been committed (global_step 0)",
            )
    elif last is None:
        yield Problem(
            "inconsistent_fields", ptr(at, "last_loss"), f"last_loss is null but global_step is {state['global_step']}"
        )
    elif history and last != history[-1]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "last_loss"),
            f"last_loss is {last!r} but the last entry of loss_history is {history[-1]!r}",
        )


@semantic_rule(SFT, "sft-loop.grad-norms")
@semantic_rule(GRPO, "grpo-loop.grad-norms")
@semantic_rule(OPD, "opd-loop.grad-norms")
def _grad_norms(state: dict[str, Any], at: str) -> Iterable[Problem]:
    norms = state["lora_grad_norms"]
    for i, entry in enumerate(norms):
        if i and entry["module"] <= norms[i - 1]["module"]:
            what = "repeats" if entry["module"] == norms[i - 1]["module"] else "is out of order after"
            yield Problem(
                "inconsistent_fields",
                ptr(at, "lora_grad_norms", i, "module"),
                f"module {entry['module']!r} {what} {norms[i - 1]['module']!r}: modules must be sorted and unique",
            )
        if entry["min"] > entry["max"]:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "lora_grad_norms", i, "min"),
                f"gradient-norm min {entry['min']!r} exceeds max {entry['max']!r} for {entry['module']!r}",
            )


@semantic_rule(GRPO, "grpo-loop.echo")
@semantic_rule(OPD, "opd-loop.echo")
def _echo(state: dict[str, Any], at: str) -> Iterable[Problem]:
    echo = state["echo_metrics"]
    observed = echo["observations"] > 0
    if echo["contributed"] != observed:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "echo_metrics", "contributed"),
            f"echo_metrics.contributed is {echo['contributed']} but observations is {echo['observations']}",
        )
    for name in ("initial_env_ce", "last_env_ce"):
        if (echo[name] is None) == observed:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "echo_metrics", name),
                f"echo_metrics.{name} is {echo[name]!r} with {echo['observations']} observations "
                "(null exactly when there are none)",
            )


# -- SFT -----------------------------------------------------------------------------------


@semantic_rule(SFT, "sft-loop.epoch-items")
def _sft_epoch_items(state: dict[str, Any], at: str) -> Iterable[Problem]:
    if state["current_epoch_items"] != state["cursor_in_epoch"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "current_epoch_items"),
            f"current_epoch_items is {state['current_epoch_items']} but cursor_in_epoch is {state['cursor_in_epoch']}",
        )


@semantic_rule(SFT, "sft-loop.step-boundary")
def _sft_step_boundary(state: dict[str, Any], at: str) -> Iterable[Problem]:
    rows = state.get("rows_per_step", 1)
    if state["cursor_in_epoch"] % rows:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "cursor_in_epoch"),
            f"cursor_in_epoch ({state['cursor_in_epoch']}) is not a multiple of rows_per_step ({rows}): a loop state "
            "lies between optimizer steps, never inside a gradient accumulation",
        )


def _sft_epoch_steps(state: dict[str, Any]) -> int:
    """Optimizer steps of the current epoch so far (``cursor_in_epoch`` rows at ``rows_per_step`` a step)."""
    return steps_per_epoch(state["cursor_in_epoch"], state.get("rows_per_step", 1))


@semantic_rule(SFT, "sft-loop.epoch-loss-sum")
def _sft_epoch_loss_sum(state: dict[str, Any], at: str) -> Iterable[Problem]:
    steps, history = _sft_epoch_steps(state), state["loss_history"]
    if steps > len(history):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "current_epoch_items"),
            f"the current epoch has {steps} steps so far (current_epoch_items {state['current_epoch_items']}) but "
            f"loss_history has only {len(history)} entries",
        )
        return
    expected = float_sum(history[len(history) - steps :])
    if state["current_epoch_loss_sum"] != expected:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "current_epoch_loss_sum"),
            f"current_epoch_loss_sum is {state['current_epoch_loss_sum']!r} but the last {steps} losses sum to {expected!r}",
        )


@semantic_rule(SFT, "sft-loop.epoch-summaries")
def _sft_epoch_summaries(state: dict[str, Any], at: str) -> Iterable[Problem]:
    epoch = state["epoch_index"]
    if epoch == 0:
        for name in ("first_epoch_loss", "best_epoch_loss"):
            if name in state:
                yield Problem(
                    "inconsistent_fields", ptr(at, name), f"{name} is present but no epoch has finished (epoch_index 0)"
                )
        return
    missing = [name for name in ("first_epoch_loss", "best_epoch_loss") if name not in state]
    for name in missing:
        yield Problem(
            "inconsistent_fields", ptr(at, name), f"{name} is required once an epoch has finished (epoch_index {epoch})"
        )
    # The steps per epoch s follow from global_step = epoch_index x s + the current epoch's steps.
    finished = state["global_step"] - _sft_epoch_steps(state)
    if finished <= 0 or finished % epoch:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "epoch_index"),
            f"global_step - the current epoch's steps = {finished} is not a positive multiple of epoch_index {epoch}, "
            "so the finished epochs cannot have had a whole number of steps each",
        )
        return
    count = finished // epoch
    history = state["loss_history"]
    if missing or len(history) < finished:  # loss-history-length reports a short history
        return
    means = [float_sum(history[e * count : (e + 1) * count]) / count for e in range(epoch)]
    if state["first_epoch_loss"] != means[0]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "first_epoch_loss"),
            f"first_epoch_loss is {state['first_epoch_loss']!r} but the mean loss of epoch 0 ({count} steps) is {means[0]!r}",
        )
    if state["best_epoch_loss"] != min(means):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "best_epoch_loss"),
            f"best_epoch_loss is {state['best_epoch_loss']!r} but the lowest mean loss of epochs 0..{epoch - 1} is {min(means)!r}",
        )


# -- GRPO ----------------------------------------------------------------------------------


@semantic_rule(GRPO, "grpo-loop.route-fields")
def _grpo_route_fields(state: dict[str, Any], at: str) -> Iterable[Problem]:
    cursor = state["route"] in ("jsonl", "online")  # a streamed file, or an online run's rollout log
    for name in ("source_byte_offset", "source_lines_consumed"):
        if (name in state) != cursor:
            need = "required" if cursor else "not allowed"
            yield Problem("inconsistent_fields", ptr(at, name), f"{name} is {need} with route {state['route']!r}")


@semantic_rule(GRPO, "grpo-loop.counters")
def _grpo_counters(state: dict[str, Any], at: str) -> Iterable[Problem]:
    stats, tokens = state["data_stats"], state["token_counts"]
    if stats["groups_read"] != stats["groups_trained"] + stats["groups_filtered"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "data_stats", "groups_read"),
            f"data_stats.groups_read ({stats['groups_read']}) must equal groups_trained ({stats['groups_trained']}) "
            f"+ groups_filtered ({stats['groups_filtered']})",
        )
    if state["dynamic_groups_filtered"] > stats["groups_filtered"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "dynamic_groups_filtered"),
            f"dynamic_groups_filtered ({state['dynamic_groups_filtered']}) exceeds data_stats.groups_filtered ({stats['groups_filtered']})",
        )
    if stats["completions_trained"] > stats["completions_read"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "data_stats", "completions_trained"),
            f"data_stats.completions_trained ({stats['completions_trained']}) exceeds completions_read ({stats['completions_read']})",
        )
    if state["processed_completions"] != stats["completions_trained"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "processed_completions"),
            f"processed_completions ({state['processed_completions']}) differs from data_stats.completions_trained "
            f"({stats['completions_trained']})",
        )
    if tokens["env_tokens"] != tokens["env_tokens_after_warning_filter"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "token_counts", "env_tokens"),
            f"token_counts.env_tokens ({tokens['env_tokens']}) differs from env_tokens_after_warning_filter "
            f"({tokens['env_tokens_after_warning_filter']})",
        )
    if (
        tokens["env_tokens_after_warning_filter"]
        != tokens["env_tokens_before_warning_filter"] - tokens["warning_tokens_filtered"]
    ):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "token_counts", "env_tokens_after_warning_filter"),
            f"token_counts.env_tokens_after_warning_filter ({tokens['env_tokens_after_warning_filter']}) must equal "
            f"env_tokens_before_warning_filter ({tokens['env_tokens_before_warning_filter']}) - warning_tokens_filtered "
            f"({tokens['warning_tokens_filtered']})",
        )


@semantic_rule(GRPO, "grpo-loop.policy-audit")
def _grpo_policy_audit(state: dict[str, Any], at: str) -> Iterable[Problem]:
    sampling = state["policy_audit"]["importance_sampling"]
    here = ptr(at, "policy_audit", "importance_sampling")
    observed = sampling["ratio_observations"] > 0
    for name in ("ratio_scope", "min_ratio", "max_ratio"):
        if (sampling[name] is None) == observed:
            yield Problem(
                "inconsistent_fields",
                ptr(here, name),
                f"importance_sampling.{name} is {sampling[name]!r} with {sampling['ratio_observations']} ratio observations "
                "(null exactly when there are none)",
            )
    if not observed and sampling["ratio_sum"] != 0:
        yield Problem(
            "inconsistent_fields",
            ptr(here, "ratio_sum"),
            f"importance_sampling.ratio_sum is {sampling['ratio_sum']!r} without any ratio observation",
        )
    if (
        sampling["min_ratio"] is not None
        and sampling["max_ratio"] is not None
        and sampling["min_ratio"] > sampling["max_ratio"]
    ):
        yield Problem(
            "inconsistent_fields",
            ptr(here, "min_ratio"),
            f"importance_sampling.min_ratio {sampling['min_ratio']!r} exceeds max_ratio {sampling['max_ratio']!r}",
        )
    clipped = sampling["below_clip_count"] + sampling["above_clip_count"]
    if clipped > sampling["ratio_observations"]:
        yield Problem(
            "inconsistent_fields",
            ptr(here, "above_clip_count"),
            f"below_clip_count + above_clip_count = {clipped} exceeds ratio_observations ({sampling['ratio_observations']})",
        )
    recorded = state["policy_audit"]["recorded_provenance"]
    here = ptr(at, "policy_audit", "recorded_provenance")
    sources = recorded["behavior_sources"]
    for i in range(1, len(sources)):
        if sources[i]["behavior_source_sha256"] <= sources[i - 1]["behavior_source_sha256"]:
            yield Problem(
                "inconsistent_fields",
                ptr(here, "behavior_sources", i, "behavior_source_sha256"),
                f"behavior source {sources[i]['behavior_source_sha256']} is repeated or out of order: "
                "sources are sorted by behavior_source_sha256 and unique",
            )
    total = sum(source["completion_count"] for source in sources)
    if total != recorded["completion_count"]:
        yield Problem(
            "inconsistent_fields",
            ptr(here, "completion_count"),
            f"recorded_provenance.completion_count is {recorded['completion_count']} but the behavior sources count {total}",
        )


# -- OPD -----------------------------------------------------------------------------------


@semantic_rule(OPD, "opd-loop.candidate-accounting")
def _opd_candidate_accounting(state: dict[str, Any], at: str) -> Iterable[Problem]:
    consumed, guard = state["candidates_consumed"], state["collapse_guardrail"]
    per_step, cursor, epoch = state.get("candidates_per_step", 1), state["cursor_in_epoch"], state["epoch_index"]
    steps, empty = state["global_step"], state["empty_rollouts"]
    if per_step == 1 and consumed != steps + empty:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "candidates_consumed"),
            f"candidates_consumed ({consumed}) must equal global_step ({steps}) + empty_rollouts "
            f"({empty}): every candidate yields a step or an empty rollout",
        )
    elif per_step > 1 and cursor % per_step:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "cursor_in_epoch"),
            f"cursor_in_epoch ({cursor}) is not a multiple of candidates_per_step ({per_step}): a loop state lies "
            "between optimizer steps, never inside a gradient accumulation",
        )
    elif per_step > 1:
        items = (consumed - cursor) // epoch if epoch else 0  # candidates per epoch (unknown, unneeded in epoch 0)
        positions = epoch * steps_per_epoch(items, per_step) + cursor // per_step
        if not steps <= positions <= steps + empty:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "global_step"),
                f"global_step ({steps}) must lie between the {positions} step positions consumed minus empty_rollouts "
                f"({empty}) and those positions: every step position yields an optimizer step or held only empty rollouts",
            )
    if guard["rollouts"] != consumed:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "collapse_guardrail", "rollouts"),
            f"collapse_guardrail.rollouts is {guard['rollouts']} but candidates_consumed is {consumed}",
        )
    for name in ("truncated_rollouts", "kl_observations"):
        if guard[name] > guard["rollouts"]:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "collapse_guardrail", name),
                f"collapse_guardrail.{name} ({guard[name]}) exceeds rollouts ({guard['rollouts']})",
            )


@semantic_rule(OPD, "opd-loop.collapse-snapshots")
def _opd_collapse_snapshots(state: dict[str, Any], at: str) -> Iterable[Problem]:
    snapshots = state["collapse_snapshots"]
    for i, snap in enumerate(snapshots):
        if i and snap["global_step"] <= snapshots[i - 1]["global_step"]:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "collapse_snapshots", i, "global_step"),
                f"snapshot global_step {snap['global_step']} does not follow {snapshots[i - 1]['global_step']}: "
                "snapshots are strictly increasing by step",
            )
        if i and snap["candidates_consumed"] < snapshots[i - 1]["candidates_consumed"]:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "collapse_snapshots", i, "candidates_consumed"),
                f"snapshot candidates_consumed {snap['candidates_consumed']} is below the previous "
                f"{snapshots[i - 1]['candidates_consumed']}",
            )
        if snap["global_step"] > state["global_step"]:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "collapse_snapshots", i, "global_step"),
                f"snapshot global_step {snap['global_step']} is after the loop's global_step {state['global_step']}",
            )


# -- documents -----------------------------------------------------------------------------


def _doc_type(training_kind: str) -> str:
    try:
        return LOOP_STATE_TYPES[training_kind]
    except KeyError:
        raise ValueError(
            f"no loop state for training kind {training_kind!r}; known: {', '.join(LOOP_STATE_TYPES)}"
        ) from None


def loop_state_file_name(training_kind: str) -> str:
    """``<kind>_loop_state.json``: where a checkpoint of ``training_kind`` keeps its loop state."""
    _doc_type(training_kind)
    return f"{training_kind}_loop_state.json"


def load_loop_state(training_kind: str, source: pipeline.Source) -> Any:
    return pipeline.load(_doc_type(training_kind), source)


def write_loop_state(training_kind: str, path: str | os.PathLike[str], state: Any) -> Path:
    return pipeline.write(_doc_type(training_kind), path, state)
