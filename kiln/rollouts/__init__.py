"""Rollouts Kiln samples and scores itself: reward scorers and scored GRPO groups with recorded provenance.

    _scorers    ``Scorer``: builtin (exact, regex, json), a Python entry point (TRL's reward-function call),
                an HTTP endpoint, an executable (JSON lines); ``scorer_of`` picks one from its spec string
    _generate   tasks and a request template in; groups sampled by the one batched decoder, scored, each action
                token's behaviour log-probability recorded (``kiln.rollout-provenance.v1``); the run's summary

Below the trainers (an online GRPO run samples through it), above the model, the data readers and the LoRA
attachment it reuses.
"""

from __future__ import annotations

from kiln.rollouts._generate import (
    PROVENANCE_SCHEMA,
    SUMMARY_TYPE,
    BehaviourPolicy,
    RequestTemplate,
    RolloutGroup,
    Task,
    Timings,
    read_request_template,
    read_tasks,
    sample_groups,
    summary_of,
    tasks_of,
)
from kiln.rollouts._scorers import (
    BUILTIN_SCORERS,
    BuiltinScorer,
    EntryPointScorer,
    ExecutableScorer,
    HttpScorer,
    Scored,
    Scorer,
    ScoreRequest,
    scorer_of,
)

__all__ = [
    "BUILTIN_SCORERS",
    "PROVENANCE_SCHEMA",
    "SUMMARY_TYPE",
    "BehaviourPolicy",
    "BuiltinScorer",
    "EntryPointScorer",
    "ExecutableScorer",
    "HttpScorer",
    "RequestTemplate",
    "RolloutGroup",
    "ScoreRequest",
    "Scored",
    "Scorer",
    "Task",
    "Timings",
    "read_request_template",
    "read_tasks",
    "sample_groups",
    "scorer_of",
    "summary_of",
    "tasks_of",
]
