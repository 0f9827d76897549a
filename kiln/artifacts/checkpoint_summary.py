"""Checkpoint summary (``TrainingCheckpointSummary``, ``latest_checkpoint`` in a job's
detail): the newest checkpoint of the job's adapter whose manifest validates, projected
for clients -- the directory basename to pass back as ``config.resume_checkpoint``, the
checkpoint id, progress (the next epoch and cursor), whether the run is complete, the
effective configuration, the data identity (digest prefixed here, bare in the manifest)
and, for OPD, the teacher's alias and revisions.

``summary.manifest-projection`` compares the summary with the manifest it summarises and is
enforced where the summary is built from the checkpoint directory; the "for the job's
adapter" half of ``summary.names`` needs the job and is checked there too. What a summary
says about itself is checked here.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

DOC = "TrainingCheckpointSummary"
TEACHER_FIELDS = ("teacher_id", "teacher_identity_revision", "teacher_content_revision")

__all__: list[str] = []


@semantic_rule(DOC, "summary.complete")
def _complete(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    finished = doc["global_step"] == doc["total_steps"]
    if doc["complete"] != finished:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "complete"),
            f"complete is {doc['complete']} but global_step is {doc['global_step']} of total_steps {doc['total_steps']}",
        )


@semantic_rule(DOC, "summary.step-bounds")
def _step_bounds(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if doc["global_step"] > doc["total_steps"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "global_step"),
            f"global_step ({doc['global_step']}) exceeds total_steps ({doc['total_steps']})",
        )


@semantic_rule(DOC, "summary.names")
def _names(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    step = doc["global_step"]
    expected_id = f"{doc['training_kind']}-step-{step:08d}"
    if doc["checkpoint_id"] != expected_id:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "checkpoint_id"),
            f"checkpoint_id is {doc['checkpoint_id']!r} but training_kind and global_step make it {expected_id!r}",
        )
    suffix = f"-checkpoint-step-{step:08d}.kiln-checkpoint"
    if not doc["resume_checkpoint"].endswith(suffix):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "resume_checkpoint"),
            f"resume_checkpoint {doc['resume_checkpoint']!r} does not name the checkpoint of global_step {step} "
            f"(<adapter>{suffix})",
        )


@semantic_rule(DOC, "summary.teacher-fields")
def _teacher_fields(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    opd = doc["training_kind"] == "opd"
    for name in TEACHER_FIELDS:
        if (name in doc) != opd:
            need = "required" if opd else "only allowed"
            yield Problem(
                "inconsistent_fields",
                ptr(at, name),
                f"{name} is {need} for opd checkpoints (training_kind is {doc['training_kind']!r})",
            )
