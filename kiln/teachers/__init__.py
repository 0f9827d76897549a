"""OPD teachers: the registry of pinned teachers, their identity and their scorers.

``TeacherRegistry(root)``       ``add`` / ``list`` / ``get`` / ``remove`` under ``<KILN_HOME>/teachers``
                                (``teachers_root(home)``), one immutable record per alias
``PinnedTeacher``               what a job uses: kind, model id, url, adapter, pinned identity, revisions
``reprobe(pinned)``             recompute the identity now; ``teacher_identity_mismatch`` on any change
``teacher_identity_for(dir)``   the ``kiln.teacher-identity.v1`` record of a model directory (local
                                teachers and ``kiln serve``'s ``GET /v1/models`` use this one function)
``top_k_logprobs(model, ...)``  the one definition of a teacher score (stable descending top-K)
``open_scorer(pinned, ...)``    a ``LocalScorer`` or ``RemoteScorer`` (``score``, ``max_top_k``, ``close``)
"""

from __future__ import annotations

from kiln.teachers._identity import MAX_TOP_K, credential_env, teacher_identity_for
from kiln.teachers._registry import PinnedTeacher, TeacherRegistry, read_off_policy_file, reprobe, teachers_root
from kiln.teachers._scoring import (
    LocalScorer,
    RemoteScorer,
    TeacherScorer,
    log_probabilities,
    open_scorer,
    ranks_of,
    stable_top_k,
    top_k_logprobs,
)

__all__ = [
    "MAX_TOP_K",
    "LocalScorer",
    "PinnedTeacher",
    "RemoteScorer",
    "TeacherRegistry",
    "TeacherScorer",
    "credential_env",
    "log_probabilities",
    "open_scorer",
    "ranks_of",
    "read_off_policy_file",
    "reprobe",
    "stable_top_k",
    "teacher_identity_for",
    "teachers_root",
    "top_k_logprobs",
]
