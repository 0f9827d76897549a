"""One module per artifact: strict ``load_*``, canonical atomic ``write_*``, ``verify_*``.

Importing this package registers every semantic rule of the schemas.
"""

from __future__ import annotations

from kiln.artifacts import (
    adapter_bodies,
    adapter_files,
    adapter_manifest,
    base_weights,
    checkpoint_manifest,
    checkpoint_summary,
    evals,
    lineage,
    loop_state,
    off_policy,
    provenance,
    receipt,
    replay_log,
    server_bodies,
    sft_ingestion,
    teachers,
    training_audit,
    worker_spec,
)
from kiln.documents import rules

rules.mark_complete()

__all__ = [
    "adapter_bodies",
    "adapter_files",
    "adapter_manifest",
    "base_weights",
    "checkpoint_manifest",
    "checkpoint_summary",
    "evals",
    "lineage",
    "loop_state",
    "off_policy",
    "provenance",
    "receipt",
    "replay_log",
    "server_bodies",
    "sft_ingestion",
    "teachers",
    "training_audit",
    "worker_spec",
]
