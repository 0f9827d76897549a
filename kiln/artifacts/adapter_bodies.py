"""Adapter registry bodies and the adapter command receipts:

* ``adapter_canary_status.json`` (``kiln_adapter_canary_status``): the serving canary of a
  newly trained adapter, ``passed`` or ``quarantined``;
* ``AdapterDiskEntry`` and ``GET /v1/adapters`` (``AdaptersResponse``): one registry
  directory as listed, and the listing with the loaded/active adapter (older member names
  ``active`` and ``available_adapters`` duplicate ``active_adapter`` and ``available``);
* the JSON receipts ``kiln adapters restore`` (``AdapterRestoreReceipt``) and
  ``kiln adapters verify`` (``AdapterVerifyReceipt``) print.

A manifest embedded in a disk entry is checked by the adapter-manifest rules.

``load_adapter_canary_status`` (strict), ``write_adapter_canary_status`` (canonical, atomic),
``load_adapter_restore_receipt`` / ``render_adapter_restore_receipt`` and
``load_adapter_verify_receipt`` / ``render_adapter_verify_receipt`` (strict; render returns the
canonical bytes the command prints).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

from kiln.artifacts.adapter_files import CONFIG_FILE, MANIFEST_FILE, RECEIPT_FILE, WEIGHTS_FILE
from kiln.artifacts.receipt import alpha_over_rank_matches
from kiln.documents import pipeline
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

CANARY = "AdapterCanaryStatus"
ENTRY = "AdapterDiskEntry"
LISTING = "AdaptersResponse"
RESTORE = "AdapterRestoreReceipt"
VERIFY = "AdapterVerifyReceipt"

RESTORE_REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE)
OFFLINE_CHECKS = (
    "directory_exists",
    "layout",
    "config_json",
    "rank_declared",
    "alpha_declared",
    "target_modules_declared",
    "safetensors_readable",
    "tensor_consistency",
    "measurable",
)
MANIFEST_CHECK = "manifest_hashes"
SIGNATURE_CHECK = "signature"
SERVER_CHECKS = ("server_load", "server_listed", "server_generation")
CHECK_ORDER = (*OFFLINE_CHECKS, MANIFEST_CHECK, SIGNATURE_CHECK, *SERVER_CHECKS)

__all__ = [
    "load_adapter_canary_status",
    "load_adapter_restore_receipt",
    "load_adapter_verify_receipt",
    "render_adapter_restore_receipt",
    "render_adapter_verify_receipt",
    "write_adapter_canary_status",
]


# --- adapter_canary_status.json ------------------------------------------------------------


@semantic_rule(CANARY, "canary.status-consistency")
def _canary_status(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    failed = [check["name"] for check in doc["checks"] if not check["passed"]]
    reason = doc["failure_reason"]
    if doc["status"] == "passed":
        if failed:
            yield Problem("inconsistent_fields", ptr(at, "status"), f"status is 'passed' but checks failed: {failed}")
        if reason is not None:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "failure_reason"),
                f"status is 'passed' but failure_reason is {reason!r}; it must be null",
            )
        return
    if reason is None:
        yield Problem(
            "inconsistent_fields", ptr(at, "failure_reason"), "a quarantined canary must name its failure_reason"
        )
    if not failed:
        yield Problem("inconsistent_fields", ptr(at, "status"), "status is 'quarantined' but every check passed")


@semantic_rule(CANARY, "canary.check-reasons")
def _canary_checks(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    seen: set[str] = set()
    for i, check in enumerate(doc["checks"]):
        name = check["name"]
        if name in seen:
            yield Problem("inconsistent_fields", ptr(at, "checks", i, "name"), f"check {name!r} is listed twice")
        seen.add(name)
        if check["passed"] == ("failure_reason" in check):
            what = "passed but carries a failure_reason" if check["passed"] else "failed without a failure_reason"
            yield Problem("inconsistent_fields", ptr(at, "checks", i, "failure_reason"), f"check {name!r}: {what}")


# --- registry listing ----------------------------------------------------------------------


@semantic_rule(ENTRY, "adapter-entry.validity")
def _entry_validity(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    complete = doc["has_config"] and doc["has_weights"]
    status, error = doc["status"], doc["error"]
    if status == "dry_run" and (doc["has_config"] or doc["has_weights"]):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "status"),
            "status is 'dry_run' but the directory has serving files: a dry run's directory holds its receipt only",
        )
    elif not complete and status not in ("invalid", "dry_run"):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "status"),
            f"status is {status!r} but has_config is {doc['has_config']} and has_weights is {doc['has_weights']}: "
            "a directory without both serving files is 'invalid' (or a dry run's receipt, 'dry_run')",
        )
    if status == "invalid" and error is None:
        yield Problem("inconsistent_fields", ptr(at, "error"), "an 'invalid' entry must say why in error")
    if status != "invalid" and error is not None:
        yield Problem(
            "inconsistent_fields", ptr(at, "error"), f"error is {error!r} but status is {status!r}, not 'invalid'"
        )


@semantic_rule(ENTRY, "adapter-entry.manifest")
def _entry_manifest(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    manifest, error = doc["adapter_manifest"], doc["adapter_manifest_error"]
    if manifest is not None and error is not None:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "adapter_manifest_error"),
            f"adapter_manifest_error is {error!r} although a valid adapter_manifest is reported",
        )
    if (manifest is not None or error is not None) and doc["adapter_manifest_path"] is None:
        which = "adapter_manifest" if manifest is not None else "adapter_manifest_error"
        yield Problem(
            "inconsistent_fields",
            ptr(at, "adapter_manifest_path"),
            f"{which} is set but adapter_manifest_path is null",
        )


@semantic_rule(ENTRY, "adapter-entry.canary")
def _entry_canary(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    canary, path = doc["canary_status"], doc["canary_status_path"]
    if (canary == "unknown") != (path is None):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "canary_status"),
            f"canary_status is {canary!r} but canary_status_path is {path!r}: "
            "it is 'unknown' exactly when there is no canary status file",
        )
    if canary == "quarantined" and doc["status"] not in ("quarantined", "loaded"):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "status"),
            f"the canary quarantined this adapter but status is {doc['status']!r}, not 'quarantined' or 'loaded'",
        )
    reason = doc["canary_failure_reason"]
    if (reason is not None) != (canary == "quarantined"):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "canary_failure_reason"),
            f"canary_failure_reason is {reason!r} with canary_status {canary!r}: it is set exactly when quarantined",
        )


@semantic_rule(ENTRY, "adapter-entry.scale")
def _entry_scale(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    alpha, rank, ratio = doc["alpha"], doc["rank"], doc["alpha_over_rank"]
    if alpha is None or rank is None or ratio is None or rank <= 0:
        return
    if not alpha_over_rank_matches(alpha, rank, ratio):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "alpha_over_rank"),
            f"alpha_over_rank is {ratio!r} but alpha / rank = {alpha!r} / {rank!r}",
        )


@semantic_rule(LISTING, "adapters.aliases")
def _listing_aliases(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if doc["active"] != doc["active_adapter"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "active"),
            f"active ({doc['active']!r}) is the older name of active_adapter ({doc['active_adapter']!r}) "
            "and must equal it",
        )
    if doc["available_adapters"] != doc["available"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "available_adapters"),
            "available_adapters is the older name of available and must be the same list",
        )


@semantic_rule(LISTING, "adapters.loaded")
def _listing_loaded(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    loaded, identity, names = doc["loaded_adapter"], doc["loaded_adapter_identity"], doc["loaded_adapters"]
    identity_name = identity["name"] if identity is not None else None
    if loaded != identity_name:
        if loaded is None:
            pointer = ptr(at, "loaded_adapter")
        else:
            pointer = ptr(at, "loaded_adapter_identity", *(("name",) if identity is not None else ()))
        yield Problem(
            "inconsistent_fields",
            pointer,
            f"loaded_adapter is {loaded!r} but loaded_adapter_identity names {identity_name!r}",
        )
    if loaded is not None and loaded not in names:
        yield Problem(
            "inconsistent_fields", ptr(at, "loaded_adapters"), f"loaded_adapter {loaded!r} is not in loaded_adapters"
        )
    listed_loaded = set()
    for i, entry in enumerate(doc["available"]):
        if entry["status"] == "loaded":
            listed_loaded.add(entry["name"])
            if entry["name"] not in names:
                yield Problem(
                    "inconsistent_fields",
                    ptr(at, "available", i, "status"),
                    f"adapter {entry['name']!r} is listed as 'loaded' but is not in loaded_adapters",
                )
    for j, name in enumerate(names):
        if name not in listed_loaded:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "loaded_adapters", j),
                f"{name!r} is in loaded_adapters but no entry of available has status 'loaded' under that name",
            )


# --- kiln adapters restore / verify --------------------------------------------------------


@semantic_rule(RESTORE, "restore.copied-files")
def _restore_files(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    copied = doc["copied_files"]
    for name in RESTORE_REQUIRED_FILES:
        if name not in copied:
            yield Problem("inconsistent_fields", ptr(at, "copied_files"), f"copied_files lacks {name!r}")
    verified = "receipt_hash" in doc["verified_hashes"]
    if (RECEIPT_FILE in copied) != verified:
        state = "lists" if RECEIPT_FILE in copied else "does not list"
        yield Problem(
            "inconsistent_fields",
            ptr(at, "copied_files"),
            f"copied_files {state} {RECEIPT_FILE!r} but verified_hashes "
            f"{'has' if verified else 'has no'} receipt_hash: the receipt is copied exactly when it is verified",
        )


@semantic_rule(RESTORE, "restore.target")
def _restore_target(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    restored = PurePosixPath(doc["restored_adapter_dir"])
    if restored.name != doc["adapter_name"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "restored_adapter_dir"),
            f"restored_adapter_dir {doc['restored_adapter_dir']!r} does not end in "
            f"adapter_name {doc['adapter_name']!r}",
        )
    if PurePosixPath(doc["manifest_path"]).parent != PurePosixPath(doc["source_adapter_dir"]):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "manifest_path"),
            f"manifest_path {doc['manifest_path']!r} is not inside source_adapter_dir {doc['source_adapter_dir']!r}",
        )


@semantic_rule(VERIFY, "verify.status")
def _verify_status(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    failed = [check["name"] for check in doc["checks"] if not check["pass"]]
    if (doc["status"] == "ok") != (not failed):
        detail = f"checks failed: {failed}" if failed else "every check passed"
        yield Problem("inconsistent_fields", ptr(at, "status"), f"status is {doc['status']!r} but {detail}")


def _allowed_next(previous: str | None) -> tuple[str, ...]:
    """The checks that may run right after ``previous`` passed (None: the first check)."""
    if previous is None:
        return (CHECK_ORDER[0],)
    if previous == OFFLINE_CHECKS[-1]:  # the manifest and signature checks run only when there is one
        return (MANIFEST_CHECK, SIGNATURE_CHECK, SERVER_CHECKS[0])
    if previous == MANIFEST_CHECK:
        return (SIGNATURE_CHECK, SERVER_CHECKS[0])
    index = CHECK_ORDER.index(previous)
    return CHECK_ORDER[index + 1 : index + 2]


def _generation_summary_problems(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    ran = any(check["name"] == SERVER_CHECKS[-1] for check in doc["checks"])
    if ran != (doc["logit_delta_summary"] is not None):
        state = "ran" if ran else "did not run"
        yield Problem(
            "inconsistent_fields",
            ptr(at, "logit_delta_summary"),
            f"server_generation {state} but logit_delta_summary is {'null' if ran else 'set'}: "
            "it is set exactly when the generation comparison ran",
        )


@semantic_rule(VERIFY, "verify.check-order")
def _verify_order(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    yield from _generation_summary_problems(doc, at)
    checks = doc["checks"]
    previous: str | None = None
    for i, check in enumerate(checks):
        name = check["name"]
        allowed = _allowed_next(previous)
        if name not in allowed:
            after = f"after {previous!r}" if previous else "first"
            expected = " or ".join(map(repr, allowed))
            yield Problem(
                "inconsistent_fields",
                ptr(at, "checks", i, "name"),
                f"check {name!r} cannot run {after}: checks run once each in the fixed order, so {expected} comes next",
            )
            return
        if not check["pass"] and i != len(checks) - 1:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "checks", i, "pass"),
                f"check {name!r} failed but further checks follow: verification stops at the first failure",
            )
            return
        previous = name
    last = checks[-1]
    if last["pass"] and last["name"] not in (OFFLINE_CHECKS[-1], MANIFEST_CHECK, SIGNATURE_CHECK, SERVER_CHECKS[-1]):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "checks", len(checks) - 1, "name"),
            f"the checks stop after {last['name']!r} although it passed: "
            f"{' or '.join(map(repr, _allowed_next(last['name'])))} should have run next",
        )


@semantic_rule(VERIFY, "verify.lora-facts")
def _verify_lora(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    lora, summary = doc["lora"], doc["tensor_summary"]
    if lora is not None:
        alpha, rank, ratio = lora["alpha"], lora["rank"], lora["alpha_over_rank"]
        if None not in (alpha, rank, ratio) and not alpha_over_rank_matches(alpha, rank, ratio):
            yield Problem(
                "inconsistent_fields",
                ptr(at, "lora", "alpha_over_rank"),
                f"lora.alpha_over_rank is {ratio!r} but alpha / rank = {alpha!r} / {rank!r}",
            )
        if lora["tensor_count"] is not None and summary is not None and lora["tensor_count"] != summary["tensor_count"]:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "lora", "tensor_count"),
                f"lora.tensor_count is {lora['tensor_count']} but "
                f"tensor_summary.tensor_count is {summary['tensor_count']}",
            )
    if summary is None:
        return
    measurable = summary["nonzero_tensor_count"] > 0 and summary["lora_update_l2_upper_bound"] > 0
    for i, check in enumerate(doc["checks"]):
        if check["name"] == "measurable" and check["pass"] != measurable:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "checks", i, "pass"),
                f"the measurable check {'passed' if check['pass'] else 'failed'} but tensor_summary has "
                f"{summary['nonzero_tensor_count']} non-zero tensors and lora_update_l2_upper_bound "
                f"{summary['lora_update_l2_upper_bound']!r}",
            )


def load_adapter_canary_status(source: pipeline.Source) -> Any:
    return pipeline.load(CANARY, source)


def write_adapter_canary_status(path: str | os.PathLike[str], status: Any) -> Path:
    return pipeline.write(CANARY, path, status)


def load_adapter_restore_receipt(source: pipeline.Source) -> Any:
    return pipeline.load(RESTORE, source)


def render_adapter_restore_receipt(receipt: Any) -> bytes:
    return pipeline.render(RESTORE, receipt)


def load_adapter_verify_receipt(source: pipeline.Source) -> Any:
    return pipeline.load(VERIFY, source)


def render_adapter_verify_receipt(receipt: Any) -> bytes:
    return pipeline.render(VERIFY, receipt)
