"""SFT ingestion record (``kiln.sft-ingestion.v1``): which rows of a training file were
kept or rejected and why, with per-row hashes and the kept-corpus digest that the
receipt's ``training_data.sha256`` must equal.

``load_sft_ingestion`` (strict), ``write_sft_ingestion`` (canonical, atomic).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kiln.documents import pipeline
from kiln.documents.digests import sft_kept_corpus_digest
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

DOC = "SftIngestion"

__all__ = ["load_sft_ingestion", "write_sft_ingestion"]


@semantic_rule(DOC, "sft-ingestion.row-counts")
def _counts(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if doc["rows_read"] != doc["rows_kept"] + doc["rows_rejected"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "rows_read"),
            f"rows_read ({doc['rows_read']}) must equal rows_kept ({doc['rows_kept']}) + rows_rejected ({doc['rows_rejected']})",
        )


@semantic_rule(DOC, "sft-ingestion.sequence-limit-counts")
def _sequence_limit(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    limit = doc.get("sequence_limit")
    if limit is None:
        return
    where = ptr(at, "sequence_limit")
    over, truncated, skipped = limit["rows_over"], limit["rows_truncated"], limit["rows_skipped"]
    policy = limit["overlong_row_policy"]
    if over != truncated + skipped:
        yield Problem(
            "inconsistent_fields",
            ptr(where, "rows_over"),
            f"rows_over ({over}) must equal rows_truncated ({truncated}) + rows_skipped ({skipped})",
        )
    if policy == "fail" and over:
        yield Problem("inconsistent_fields", ptr(where, "rows_over"), f"{over} rows over the limit under fail")
    if policy != "truncate" and truncated:
        yield Problem("inconsistent_fields", ptr(where, "rows_truncated"), f"{truncated} rows truncated under {policy}")
    if skipped > doc["rows_rejected"]:
        yield Problem(
            "inconsistent_fields",
            ptr(where, "rows_skipped"),
            f"rows_skipped ({skipped}) exceeds rows_rejected ({doc['rows_rejected']})",
        )


@semantic_rule(DOC, "sft-ingestion.kept-hashes-count")
def _kept_count(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if doc["rows_kept"] != len(doc["kept_row_hashes"]):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "kept_row_hashes"),
            f"{len(doc['kept_row_hashes'])} kept row hashes for rows_kept = {doc['rows_kept']}",
        )


@semantic_rule(DOC, "sft-ingestion.rejected-rows-count")
def _rejected_count(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if doc["rows_rejected"] != len(doc["rejected_rows"]):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "rejected_rows"),
            f"{len(doc['rejected_rows'])} rejected rows listed for rows_rejected = {doc['rows_rejected']}",
        )


@semantic_rule(DOC, "sft-ingestion.rejected-index-order")
def _rejected_order(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    previous = 0
    for i, row in enumerate(doc["rejected_rows"]):
        index = row["row_index"]
        if index <= previous or index > doc["rows_read"]:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "rejected_rows", i, "row_index"),
                f"row_index {index} must be strictly increasing and at most rows_read ({doc['rows_read']})",
            )
        previous = max(previous, index)


@semantic_rule(DOC, "sft-ingestion.kept-corpus-digest", integrity=True)
def _corpus(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    expected = sft_kept_corpus_digest(doc["kept_row_hashes"])
    if doc["kept_corpus_sha256"] != expected:
        yield Problem(
            "digest_mismatch",
            ptr(at, "kept_corpus_sha256"),
            f"kept_corpus_sha256 does not recompute from kept_row_hashes: recorded {doc['kept_corpus_sha256']}, computed {expected}",
        )


def load_sft_ingestion(source: pipeline.Source) -> Any:
    return pipeline.load(DOC, source)


def write_sft_ingestion(path: str | os.PathLike[str], record: Any) -> Path:
    return pipeline.write(DOC, path, record)
