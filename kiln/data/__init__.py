"""Training data ingestion: rows in, tokenized examples and provable ingestion records out."""

from __future__ import annotations

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
    "IGNORE_INDEX",
    "REJECTION_REASONS",
    "ROLES",
    "SFT_INGESTION_SCHEMA",
    "SftExample",
    "SftIngestion",
    "ingest_sft",
]
