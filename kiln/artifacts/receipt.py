"""Train receipt (``kiln_train_receipt``, ``train_receipt.json``): the machine-readable
account of one training attempt, written for every attempt, successful or failed -- the
envelope (name, time, status, failure fields), the identity of the build, model,
tokenizer, adapters and training input, the resolved hyperparameters, the mode-specific
blocks (``grpo``, ``opd``, ``data.sft_ingestion``), counters, timings, runtime and the full
effective trainer configuration.

Readers are lenient (unknown members are ignored, the "W, D" members may be missing, and
the older member names ``grpo.reference_policy`` and ``config_hashes.kiln_env_config_hash``
are honoured); Kiln itself writes the closed writer shape.

``receipt.embedded-records`` is enforced by the rules of the embedded definitions, which run
wherever those records sit in a receipt: ``model.base_weight_shard_manifest`` (sorted unique
shards, total size, aggregate digest), ``runtime.execution_provenance`` (self-digest,
kernel-contract digest, sorted features, text fields) and ``data.sft_ingestion`` (row
counts, rejected-row order, kept-corpus digest); ``runtime.training_precision`` and
``opd.teacher_identity`` have no rules beyond their closed schemas. The teacher identity
revision is checked here under ``receipt.opd-teacher``.

``load_train_receipt`` (lenient reader schema, every rule), ``write_train_receipt`` (strict
writer schema, canonical, atomic).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from datetime import date
from pathlib import Path
from typing import Any

from kiln.documents import pipeline
from kiln.documents.digests import effective_config_hash, teacher_identity_revision
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

DOC = "TrainReceipt"
DRY_RUN_SOURCE = "jsonl_grpo_groups_dry_run"
ALPHA_OVER_RANK_RTOL = 1e-6
SFT_ONLY = (("data", "sft_ingestion"), ("runtime", "sft_loss_route"), ("tokenizer", "training_chat_template_hash"))
_RFC3339 = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt](\d{2}):(\d{2}):(\d{2})(\.\d+)?(?:[Zz]|([+-])(\d{2}):(\d{2}))",
    re.ASCII,
)

__all__ = ["load_train_receipt", "write_train_receipt"]


def rfc3339_problem(text: str) -> str | None:
    """Why ``text`` is not an RFC 3339 date-time with an offset, or None when it is one."""
    m = _RFC3339.fullmatch(text)
    if not m:
        return "is not an RFC 3339 date-time with an offset (YYYY-MM-DDTHH:MM:SS[.frac](Z|±HH:MM))"
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    try:
        date(year, month, day)
    except ValueError:
        return "names a calendar date that does not exist"
    if hour > 23 or minute > 59 or second > 60:  # 60: a leap second
        return "has a time of day out of range"
    if m.group(8) and (int(m.group(9)) > 23 or int(m.group(10)) > 59):
        return "has an offset out of range"
    return None


def alpha_over_rank_matches(alpha: float, rank: int, alpha_over_rank: float) -> bool:
    """Whether ``alpha_over_rank`` is ``alpha / rank`` within a relative 1e-6 (single-precision writers)."""
    try:
        return math.isclose(alpha_over_rank, alpha / rank, rel_tol=ALPHA_OVER_RANK_RTOL)
    except (OverflowError, ZeroDivisionError):
        return False


def _blank(value: Any) -> bool:
    return isinstance(value, str) and not value.strip()


@semantic_rule(DOC, "receipt.failure-consistency")
def _failure(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    reason, message = doc["failure_reason"], doc.get("failure_message")
    if doc["status"] == "success":
        if reason is not None:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "failure_reason"),
                f"a successful receipt carries failure_reason {reason!r}; it must be null",
            )
        if message is not None:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "failure_message"),
                f"a successful receipt carries failure_message {message!r}; it must be absent or null",
            )
        return
    if reason is None:
        yield Problem("inconsistent_fields", ptr(at, "failure_reason"), "a failed receipt must name its failure_reason")
    if _blank(message):
        yield Problem("inconsistent_fields", ptr(at, "failure_message"), f"failure_message {message!r} is blank")


@semantic_rule(DOC, "receipt.mode-blocks")
def _mode_blocks(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    mode = doc["hyperparameters"]["mode"]
    if (doc["grpo"] is not None) != (mode == "grpo"):
        state = "null" if doc["grpo"] is None else "set"
        yield Problem(
            "inconsistent_fields",
            ptr(at, "grpo"),
            f"grpo is {state} but hyperparameters.mode is {mode!r}: it is set exactly for grpo",
        )
    if ("opd" in doc) != (mode == "opd"):
        state = "present" if "opd" in doc else "absent"
        yield Problem(
            "inconsistent_fields",
            ptr(at, "opd"),
            f"opd is {state} but hyperparameters.mode is {mode!r}: it is present exactly for opd",
        )
    if mode != "sft":
        for section, key in SFT_ONLY:
            if key in doc[section]:
                yield Problem(
                    "inconsistent_fields",
                    ptr(at, section, key),
                    f"{section}.{key} appears only in SFT receipts, but hyperparameters.mode is {mode!r}",
                )


@semantic_rule(DOC, "receipt.alpha-over-rank")
def _alpha_over_rank(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    hp = doc["hyperparameters"]
    ratio = hp["alpha_over_rank"]
    if ratio is not None and not alpha_over_rank_matches(hp["alpha"], hp["rank"], ratio):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "hyperparameters", "alpha_over_rank"),
            f"alpha_over_rank is {hp['alpha_over_rank']!r} but alpha / rank = {hp['alpha']!r} / {hp['rank']!r}",
        )


def _template_copies(doc: dict[str, Any], at: str, receipt_key: str, provenance_key: str) -> list[tuple[str, str, str]]:
    """``(label, pointer, value)`` of every present copy of one template digest."""
    places: list[tuple[dict[str, Any] | None, tuple[str, ...]]] = [
        (doc["tokenizer"], ("tokenizer", receipt_key)),
        (doc.get("config_hashes"), ("config_hashes", receipt_key)),
    ]
    provenance = doc["runtime"].get("execution_provenance")
    if provenance is not None:
        places.append((provenance["model"], ("runtime", "execution_provenance", "model", provenance_key)))
    return [
        (".".join(path), ptr(at, *path), holder[path[-1]])
        for holder, path in places
        if holder is not None and path[-1] in holder
    ]


@semantic_rule(DOC, "receipt.template-digests-agree")
def _templates_agree(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    for tokenizer_key, provenance_key in (
        ("training_chat_template_hash", "training_chat_template_sha256"),
        ("chat_template_hash", "chat_template_sha256"),
    ):
        copies = _template_copies(doc, at, tokenizer_key, provenance_key)
        if not copies:
            continue
        first_label, _, first = copies[0]
        for label, pointer, value in copies[1:]:
            if value != first:
                yield Problem("inconsistent_fields", pointer, f"{label} is {value} but {first_label} is {first}")


def _effective_hash(doc: dict[str, Any], at: str) -> tuple[str, str] | None:
    """``(pointer, value)`` of ``config_hashes.effective_config_hash`` (or its older name), if present."""
    hashes = doc.get("config_hashes")
    if hashes is None:
        return None
    for key in ("effective_config_hash", "kiln_env_config_hash"):
        if isinstance(hashes.get(key), str):
            return ptr(at, "config_hashes", key), hashes[key]
    return None


@semantic_rule(DOC, "receipt.config-hash-copies-agree")
def _hash_copies(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    hashes = doc.get("config_hashes") or {}
    effective = _effective_hash(doc, at)
    # (original, its value, the copy's path, the copy's value); the problem points at the copy
    pairs: list[tuple[str, Any, tuple[str, str], Any]] = [
        (
            "tokenizer.tokenizer_config_hash",
            doc["tokenizer"].get("tokenizer_config_hash"),
            ("config_hashes", "tokenizer_config_hash"),
            hashes.get("tokenizer_config_hash"),
        ),
        (
            "model.config_hash",
            doc["model"]["config_hash"],
            ("config_hashes", "model_config_hash"),
            hashes.get("model_config_hash"),
        ),
        (
            "config_hashes.effective_config_hash",
            effective[1] if effective else None,
            ("kiln", "env_config_hash"),
            doc["kiln"].get("env_config_hash"),
        ),
    ]
    for label, value, copy_path, copy in pairs:
        if value is not None and copy is not None and value != copy:
            where = ".".join(copy_path)
            yield Problem("inconsistent_fields", ptr(at, *copy_path), f"{where} is {copy} but {label} is {value}")


@semantic_rule(DOC, "receipt.effective-config-hash", integrity=True)
def _effective_config_hash(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    recorded = _effective_hash(doc, at)
    if recorded is None:
        return
    pointer, value = recorded
    expected = effective_config_hash(doc["config"])
    if value != expected:
        yield Problem(
            "digest_mismatch",
            pointer,
            f"effective_config_hash does not recompute from config: recorded {value}, computed {expected}",
        )


@semantic_rule(DOC, "receipt.sft-ingestion-binding")
def _sft_binding(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    ingestion = doc["data"].get("sft_ingestion")
    if ingestion is None:
        return
    data, training, hp = doc["data"], doc["training_data"], doc["hyperparameters"]
    if hp["mode"] != "sft":
        yield Problem(
            "inconsistent_fields",
            ptr(at, "hyperparameters", "mode"),
            f"data.sft_ingestion is present but hyperparameters.mode is {hp['mode']!r}, not 'sft'",
        )
    bindings = [
        (ptr(at, "training_data", "source"), "training_data.source", training["source"],
         "sft_ingestion.source", ingestion["source"]),
        (ptr(at, "training_data", "path"), "training_data.path", training["path"],
         "sft_ingestion.source_locator", ingestion.get("source_locator")),
        (ptr(at, "training_data", "sha256"), "training_data.sha256", training["sha256"],
         "sft_ingestion.kept_corpus_sha256", ingestion["kept_corpus_sha256"]),
        (ptr(at, "data", "examples_read"), "data.examples_read", data["examples_read"],
         "sft_ingestion.rows_read", ingestion["rows_read"]),
        (ptr(at, "data", "examples_filtered"), "data.examples_filtered", data["examples_filtered"],
         "sft_ingestion.rows_rejected", ingestion["rows_rejected"]),
        (ptr(at, "config", "invalid_row_policy"), "config.invalid_row_policy", doc["config"].get("invalid_row_policy"),
         "sft_ingestion.invalid_row_policy", ingestion["invalid_row_policy"]),
    ]  # fmt: skip
    for pointer, label, value, bound_label, bound in bindings:
        if value != bound:
            yield Problem("inconsistent_fields", pointer, f"{label} is {value!r} but {bound_label} is {bound!r}")
    expected = ingestion["rows_kept"] * hp["epochs"]
    trained = data["examples_trained"]
    if trained > expected or (doc["status"] == "success" and trained != expected):
        relation = "equal" if doc["status"] == "success" else "be at most"
        yield Problem(
            "inconsistent_fields",
            ptr(at, "data", "examples_trained"),
            f"data.examples_trained is {trained} but must {relation} sft_ingestion.rows_kept × epochs = "
            f"{ingestion['rows_kept']} × {hp['epochs']} = {expected} on a {doc['status']} receipt",
        )


@semantic_rule(DOC, "receipt.adapter-files")
def _adapter_files(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    for which in ("base", "output"):
        entry = doc["adapters"][which]
        digest, size = entry["adapter_model_sha256"], entry["adapter_model_bytes"]
        if (digest is None) != (size is None):
            missing = "adapter_model_bytes" if size is None else "adapter_model_sha256"
            yield Problem(
                "inconsistent_fields",
                ptr(at, "adapters", which, missing),
                f"adapters.{which}.adapter_model_sha256 and adapter_model_bytes are null together or set together; "
                f"only {missing} is null",
            )
    source = doc["training_data"]["source"]
    if doc["status"] == "success" and source != DRY_RUN_SOURCE:
        output = doc["adapters"]["output"]
        for key in ("path", "adapter_model_sha256", "adapter_model_bytes"):
            if output[key] is None:
                yield Problem(
                    "inconsistent_fields",
                    ptr(at, "adapters", "output", key),
                    f"a successful receipt (training_data.source {source!r}) must record adapters.output.{key}",
                )


@semantic_rule(DOC, "receipt.token-counts")
def _token_counts(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    counts = doc["token_counts"]
    after = counts.get("env_tokens_after_warning_filter")
    if after is not None and after != counts["env_tokens"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "token_counts", "env_tokens"),
            f"env_tokens ({counts['env_tokens']}) must equal env_tokens_after_warning_filter ({after})",
        )
    before, filtered = counts.get("env_tokens_before_warning_filter"), counts.get("warning_tokens_filtered")
    if None not in (before, after, filtered) and before != after + filtered:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "token_counts", "env_tokens_before_warning_filter"),
            f"env_tokens_before_warning_filter ({before}) must equal env_tokens_after_warning_filter ({after}) "
            f"+ warning_tokens_filtered ({filtered})",
        )


def _kl_reference(grpo: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """``(member name, value)`` of the KL reference policy (the older name ``reference_policy`` on read)."""
    for key in ("kl_reference_policy", "reference_policy"):
        value = grpo.get(key)
        if isinstance(value, dict) and isinstance(value.get("kind"), str):
            return key, value
    return None


def _grpo_reference_problems(grpo: dict[str, Any], at: str) -> Iterable[Problem]:
    found = _kl_reference(grpo)
    if found is None:
        return
    key, policy = found
    ema = policy["kind"] == "ema"
    for member in ("decay", "refresh_every"):
        if (member in policy) != ema:
            state = "present" if member in policy else "absent"
            yield Problem(
                "inconsistent_fields",
                ptr(at, "grpo", key, member),
                f"grpo.{key}.{member} is {state} with kind {policy['kind']!r}: it is present exactly for 'ema'",
            )


def _importance_problems(grpo: dict[str, Any], sampling: dict[str, Any], at: str) -> Iterable[Problem]:
    base = ptr(at, "grpo", "policy_audit", "importance_sampling")
    expected = "sequence" if grpo["is_level"] == "sequence" else "token"
    scope = sampling["ratio_scope"]
    if scope != expected and not (scope is None and sampling["ratio_observations"] == 0):
        yield Problem(
            "inconsistent_fields",
            ptr(base, "ratio_scope"),
            f"ratio_scope is {scope!r} for is_level {grpo['is_level']!r} with {sampling['ratio_observations']} "
            f"observations; it must be {expected!r} (or null when nothing was observed)",
        )
    if grpo["is_level"] == "cispo" and sampling["below_clip_count"] != 0:
        yield Problem(
            "inconsistent_fields",
            ptr(base, "below_clip_count"),
            f"below_clip_count is {sampling['below_clip_count']} but CISPO clips from above only, so it is 0",
        )


def _provenance_problems(recorded: dict[str, Any], at: str) -> Iterable[Problem]:
    base = ptr(at, "grpo", "policy_audit", "recorded_provenance")
    sources = recorded.get("behavior_sources")
    count = len(sources) if sources is not None else 0
    if recorded["unique_behavior_sources"] != count:
        yield Problem(
            "inconsistent_fields",
            ptr(base, "unique_behavior_sources"),
            f"unique_behavior_sources is {recorded['unique_behavior_sources']} but {count} behavior_sources are listed",
        )
    if ("behavior_source_manifest_sha256" in recorded) != (sources is not None):
        state = "present" if sources is not None else "absent"
        yield Problem(
            "inconsistent_fields",
            ptr(base, "behavior_source_manifest_sha256"),
            "behavior_source_manifest_sha256 must be present exactly when behavior_sources is; "
            f"behavior_sources is {state}",
        )
    for key in ("completion_count", "sampled_action_tokens", "forced_action_tokens"):
        total = sum(source[key] for source in sources or ())
        if recorded[key] != total:
            yield Problem(
                "inconsistent_fields",
                ptr(base, key),
                f"recorded_provenance.{key} is {recorded[key]} but the behavior sources add up to {total}",
            )


@semantic_rule(DOC, "receipt.grpo-audit")
def _grpo_audit(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    grpo = doc["grpo"]
    if grpo is None:
        return
    yield from _grpo_reference_problems(grpo, at)
    audit = grpo.get("policy_audit")
    if audit is None:
        return
    yield from _importance_problems(grpo, audit["importance_sampling"], at)
    yield from _provenance_problems(audit["recorded_provenance"], at)


@semantic_rule(DOC, "receipt.opd-teacher")
def _opd_teacher_presence(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    opd = doc.get("opd")
    if opd is not None and "teacher_identity_revision" in opd and "teacher_identity" not in opd:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "opd", "teacher_identity_revision"),
            "opd.teacher_identity_revision is present without the opd.teacher_identity it is the revision of",
        )


@semantic_rule(DOC, "receipt.opd-teacher", integrity=True)
def _opd_teacher_revision(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    opd = doc.get("opd")
    if opd is None or "teacher_identity_revision" not in opd or "teacher_identity" not in opd:
        return
    expected = teacher_identity_revision(opd["teacher_identity"])
    if opd["teacher_identity_revision"] != expected:
        yield Problem(
            "digest_mismatch",
            ptr(at, "opd", "teacher_identity_revision"),
            f"opd.teacher_identity_revision does not recompute from opd.teacher_identity: "
            f"recorded {opd['teacher_identity_revision']}, computed {expected}",
        )


def load_train_receipt(source: pipeline.Source) -> Any:
    """Read a receipt leniently (unknown members ignored), then apply every semantic rule."""
    return pipeline.load(DOC, source)


def write_train_receipt(path: str | os.PathLike[str], receipt: Any) -> Path:
    """Write a receipt against the closed writer schema, canonical and crash-atomic."""
    return pipeline.write(DOC, path, receipt)
