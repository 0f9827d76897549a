"""Training data ingestion: rows in, tokenized examples and provable ingestion records out.

``kiln.data.sft``: SFT conversations with assistant-only labels. ``kiln.data.grpo``: GRPO groups
with action and observation masks. ``kiln.data.opd``: OPD prompts with the ECHO observation mask,
and the pre-scored off-policy teacher file.

The components they share: ``kiln.data.chat`` (message normalisation, the chat template: render,
locate message data by placeholders, tokenize cut at spans), ``kiln.data.trajectory`` (segments
after the messages, labelled prompt/action/observation/warning tokens, item refusals) and
``kiln.data.jsonl`` (JSONL lines as read, the pin of a dataset file and its re-check).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from kiln.data.chat import ROLES, match_skeleton, template_errors
from kiln.data.grpo import (
    BEHAVIOR_POLICIES,
    GRPO_SOURCES,
    SEGMENT_KINDS,
    GrpoCompletion,
    GrpoCounts,
    GrpoGroup,
    GrpoIngestion,
    GrpoSourcePosition,
    OnlineLog,
    iter_dataset_groups,
    online_ingestion,
    precheck_grpo_groups,
    read_groups,
    refused_ingestion,
    rollout_log_lines,
    spelled,
)
from kiln.data.jsonl import check_unchanged, dataset_sha256
from kiln.data.opd import (
    OFF_POLICY_SOURCE,
    PROMPTS_SOURCE,
    OffPolicyFile,
    OffPolicyRow,
    OpdPromptItem,
    OpdPrompts,
    precheck_off_policy_file,
    read_off_policy_file,
    read_prompts,
    tokenize_response,
)
from kiln.data.sft import (
    IGNORE_INDEX,
    REJECTION_REASONS,
    SFT_INGESTION_SCHEMA,
    SftExample,
    SftIngestion,
    ingest_sft,
    precheck_sft_rows,
)

__all__ = [
    "BEHAVIOR_POLICIES",
    "GRPO_SOURCES",
    "IGNORE_INDEX",
    "OFF_POLICY_SOURCE",
    "PROMPTS_SOURCE",
    "REJECTION_REASONS",
    "ROLES",
    "SEGMENT_KINDS",
    "SFT_INGESTION_SCHEMA",
    "GrpoCompletion",
    "GrpoCounts",
    "GrpoGroup",
    "GrpoIngestion",
    "GrpoSourcePosition",
    "OffPolicyFile",
    "OffPolicyRow",
    "OnlineLog",
    "OpdPromptItem",
    "OpdPrompts",
    "SftExample",
    "SftIngestion",
    "check_unchanged",
    "dataset_sha256",
    "ingest_sft",
    "iter_dataset_groups",
    "match_skeleton",
    "online_ingestion",
    "precheck_dataset_file",
    "precheck_sft_rows",
    "read_groups",
    "read_off_policy_file",
    "read_prompts",
    "refused_ingestion",
    "rollout_log_lines",
    "spelled",
    "template_errors",
    "tokenize_response",
]


def precheck_dataset_file(kind: str, path: str | os.PathLike[str], config: Mapping[str, Any]) -> int:
    """A training request's ``dataset_path`` checked the way ``kind`` (``sft`` | ``grpo`` | ``opd``) will read it, as
    far as that goes without a tokenizer or torch: what a command line runs before it loads a model. Returns the
    rows, groups or scored rows read; an OPD file of prompts to roll out (not pre-scored) is only counted."""
    if kind == "sft":
        return precheck_sft_rows(path, invalid_row_policy=str(config.get("invalid_row_policy") or "fail"))
    if kind == "grpo":
        return precheck_grpo_groups(path)
    if kind == "opd" and config.get("training_mode") == "off_policy":
        return precheck_off_policy_file(path)
    return 0
