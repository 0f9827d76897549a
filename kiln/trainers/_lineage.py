"""The request lineage every trainer writes through the kit (``kiln.trainers._kit``), on the publishing rank only.

While a run trains, its log is ``<registry>/.<adapter>.replay.jsonl`` (``kiln.artifacts.replay_log.pending_log``): hidden, so listing shows
nothing of it, and beside the adapter's directory, so neither a failed receipt nor a publication disturbs it:

* ``open_request`` (the kit's ``Policy``, before the first optimizer step): appends this run's request record,
  synced to disk. A run from step 0 starts a new log (an earlier attempt's is dropped); a resumed run keeps the
  records of the runs it continues (the log the cancelled or failed run left there) and adds its own, so the chain
  covers the whole history of the adapter (a resume whose log is gone starts one with its own request, which names
  the checkpoint it resumed from);
* ``close_request`` (a failed, cancelled, or adapter-less run): appends its outcome there; the log stays for a
  resume;
* ``stage_lineage`` (a successful run, inside the staging directory of its publication): ``replay.jsonl`` -- the
  log with the ``completed`` outcome -- and ``lineage.json`` beside the adapter, published in the same rename; the
  receipt and the manifest link them by digest (``request_lineage``). Once published, the pending log is removed.

A parent (the config's ``base_adapter``) is recorded, when the run starts, with the digest of its weights and its
``replay_hash`` (null when it has no lineage). Data-parallel ranks other than 0 and dry runs write nothing.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.adapters import AdapterDirectory, base_adapter_dir
from kiln.artifacts.lineage import LINEAGE_FILE, build_lineage, lineage_link, load_lineage, write_lineage
from kiln.artifacts.replay_log import (
    REPLAY_LOG,
    append_replay_record,
    load_replay_log,
    pending_log,
    write_replay_log,
)
from kiln.documents.digests import file_sha256, prefixed
from kiln.documents.jsonio import JsonObject
from kiln.errors import StorageFailureError
from kiln.training import EffectiveConfig

if TYPE_CHECKING:
    from kiln.trainers._admission import AdmittedJob
    from kiln.trainers._kit import Policy

    Job = AdmittedJob[EffectiveConfig]

_HEX = re.compile(r"(?:sha256:)?([0-9a-f]{64})")

__all__ = ["RequestLog", "close_request", "open_request", "published", "stage_lineage"]


@dataclass
class RequestLog:
    """This run's record in the adapter's pending request log."""

    path: Path
    request_id: str
    policy: Policy  # its steps_taken is the outcome's global_step
    base_model: JsonObject
    parent: JsonObject | None  # read when the run starts (a bad parent lineage fails it before training)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _digest(value: str) -> str | None:
    found = _HEX.fullmatch(value) if isinstance(value, str) else None
    return prefixed(found[1]) if found else None


def _base_model(job: Job) -> JsonObject:
    shards = job.identity.base_weight_shard_manifest
    return {
        "path": str(job.identity.path) if job.identity.path else None,
        "config_hash": job.identity.config_hash,
        "weights_sha256": shards["aggregate_sha256"] if shards else None,
    }


def _parent(job: Job) -> JsonObject | None:
    name = job.config.base_adapter
    if not name:
        return None
    directory = base_adapter_dir(job.registry, name)
    lineage = directory / LINEAGE_FILE
    return {
        "adapter_name": Path(directory).name,
        "adapter_model_sha256": prefixed(file_sha256(AdapterDirectory(directory).weights_path)[0]),
        "replay_hash": load_lineage(lineage).replay_hash if lineage.is_file() else None,
    }


def open_request(job: Job, policy: Policy) -> None:
    """Append this run's request record to the adapter's log, synced, before any optimizer step."""
    from kiln.model import git_source

    if not job.data_parallel.publishes or job.dry_run:
        return
    job.registry.mkdir(parents=True, exist_ok=True)
    path = pending_log(job.registry, job.adapter_name)
    if job.resume is None or not path.exists():
        path.unlink(missing_ok=True)  # a run from step 0 starts the history anew
    else:
        load_replay_log(path)  # a resume continues a log that reads strictly, or fails before training
    parent = _parent(job)
    resume = job.resume
    record: JsonObject = {
        "schema_version": 1,
        "record_type": "request",
        "request_id": f"req-{uuid.uuid4().hex}",
        "kind": job.kind,
        "adapter_name": job.adapter_name,
        "request": {"config": job.config.to_json(), "data_sha256": _digest(job.data_sha256)},
        "seed": job.config.seed,
        "commit": git_source()[0],
        "submitted_at": _now(),
        "resumed_from": None
        if resume is None
        else {"checkpoint": resume.path.name, "global_step": int(resume.manifest["progress"]["global_step"])},
    }
    try:
        append_replay_record(path, record)
    except OSError as exc:  # no training without its request on disk: the run fails storage_error, naming the path
        failure = StorageFailureError.from_os_error(
            exc, doing=f"writing the request log of adapter {job.adapter_name!r}", path=path
        )
        if failure is None:
            raise
        raise failure from exc
    job.request_log = RequestLog(path, record["request_id"], policy, _base_model(job), parent)


def _outcome(run: RequestLog, status: str, reason: str | None) -> JsonObject:
    return {
        "schema_version": 1,
        "record_type": "outcome",
        "request_id": run.request_id,
        "status": status,
        "failure_reason": reason,
        "global_step": int(run.policy.steps_taken),
        "finished_at": _now(),
    }


def close_request(job: Job, failure: tuple[str, str] | None) -> None:
    """Append the outcome of a run that publishes no adapter (``failure``: its reason and message; None: a success
    without an adapter). A log the file system refuses to extend stays without it, as after a crash."""
    run = job.request_log
    if run is None:
        return
    job.request_log = None
    reason = None if failure is None else failure[0]
    status = "completed" if failure is None else "cancelled" if reason == "cancelled" else "failed"
    try:
        append_replay_record(run.path, _outcome(run, status, reason))
    except OSError:  # the failed receipt that follows reports the storage failure; the log reads as a crash's
        return


def stage_lineage(job: Job, staging: Path) -> JsonObject | None:
    """Write ``replay.jsonl`` (the log and the completed outcome) and ``lineage.json`` into the staged adapter
    directory; returns the ``request_lineage`` link of the receipt (None when this run keeps no log)."""
    run = job.request_log
    if run is None:
        return None
    lines = load_replay_log(run.path)
    records = [line.record for line in lines]
    write_replay_log(staging / REPLAY_LOG, [*records, _outcome(run, "completed", None)])
    requests = [r for r in records if r["record_type"] == "request"]
    lineage = build_lineage(job.adapter_name, run.base_model, run.parent, requests)
    write_lineage(staging / LINEAGE_FILE, lineage)
    return lineage_link(staging, lineage)


def published(job: Job) -> None:
    """The adapter and its request lineage are published: the pending log is done with."""
    run, job.request_log = job.request_log, None
    if run is not None:
        run.path.unlink(missing_ok=True)
