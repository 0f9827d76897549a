"""Training data ingestion: rows in, tokenized examples and provable ingestion records out.

``kiln.data.sft``: SFT conversations with assistant-only labels. ``kiln.data.grpo``: GRPO groups
with action and observation masks, and the pin of a streamed JSONL file.
"""

from __future__ import annotations

from kiln.data.grpo import (
    BEHAVIOR_POLICIES,
    GRPO_SOURCES,
    SEGMENT_KINDS,
    GrpoCompletion,
    GrpoCounts,
    GrpoGroup,
    GrpoIngestion,
    GrpoSourcePosition,
    check_unchanged,
    dataset_sha256,
    iter_dataset_groups,
    read_groups,
)
from kiln.data.sft import (
    IGNORE_INDEX,
    REJECTION_REASONS,
    ROLES,
    SFT_INGESTION_SCHEMA,
    SftExample,
    SftIngestion,
    ingest_sft,
)

__all__ = [
    "BEHAVIOR_POLICIES",
    "GRPO_SOURCES",
    "IGNORE_INDEX",
    "REJECTION_REASONS",
    "ROLES",
    "SEGMENT_KINDS",
    "SFT_INGESTION_SCHEMA",
    "GrpoCompletion",
    "GrpoCounts",
    "GrpoGroup",
    "GrpoIngestion",
    "GrpoSourcePosition",
    "SftExample",
    "SftIngestion",
    "check_unchanged",
    "dataset_sha256",
    "ingest_sft",
    "iter_dataset_groups",
    "read_groups",
]
