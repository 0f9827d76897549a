"""Audits on the server: ``POST /v1/audits`` queues an audit of a registry adapter's run (``docs/audit.md``).

An audit job is a ``Job`` of type ``audit`` in the one queue, so it never trains beside a training job. The worker
runs it in a process of its own -- ``python -m kiln.cli audit ADAPTER_DIR --out RECORD`` with the server's home and
base model -- so a re-execution that runs out of memory fails the job, not the server. Cancelling terminates that
process, which removes its temporary registry; nothing of it remains. The job completes with its
``kiln.training-audit.v1`` record whatever the verdict (a verdict is a result); it fails when no record was
produced (cancelled, interrupted, or the audit could not start), with the process's last output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from kiln import contracts
from kiln.documents.jsonio import JsonObject, read_json_file
from kiln.errors import ContractError, NotFoundError

if TYPE_CHECKING:
    from kiln.server._app import Server
    from kiln.server._jobs import Job, Outcome
    from kiln.server._training import Engine

__all__ = ["audit_detail", "run_job", "submit"]

POLL_S = 0.2
STOP_TIMEOUT_S = 60


def submit(server: Server, body: object) -> JsonObject:
    """``POST /v1/audits``: check the request and the adapter now (``adapter_not_found`` before queueing), then
    queue."""
    from kiln.adapters import RECEIPT_FILE, require_adapter_name

    found = contracts.problems("AuditRequest", body)
    if found:
        raise ContractError(found, document="AuditRequest")
    request = contracts.canonical("AuditRequest", body)
    name = require_adapter_name(request["adapter"])
    if not (server.settings.registry / name / RECEIPT_FILE).is_file():
        raise NotFoundError(
            f"adapter {name!r} has no published run in {server.settings.registry}",
            code="adapter_not_found",
            hint="list adapters with GET /v1/adapters",
        )
    job = server.jobs.submit(
        job_type="audit",
        adapter_name=name,
        effective_seed="0",
        request={k: v for k, v in request.items() if v is not None},
        fingerprint={},
        auto_load=False,
        total_steps=1,
    )
    return audit_detail(job)


def _argv(engine: Engine, job: Job, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "kiln.cli", "audit", str(engine.settings.registry / job.adapter_name)]
    # the base model and the intra-op threads the server's training workers run with: the envelope of its runs
    argv += ["--out", str(out), "--model", str(engine.model_path), "--threads", str(engine.worker_threads())]
    if job.request.get("segments") is not None:
        argv += ["--segments", str(job.request["segments"])]
    if job.request.get("seed") is not None:
        argv += ["--seed", str(job.request["seed"])]
    return argv


def run_job(engine: Engine, job: Job, cancel: threading.Event) -> Outcome:
    """The worker's side of an audit job: the audit in a process of its own, stopped on cancel."""
    from kiln.artifacts.training_audit import load_training_audit
    from kiln.server._jobs import Outcome

    directory = engine.jobs.store.job_directory(job.job_id)
    directory.mkdir(parents=True, exist_ok=True)
    out, log_path = directory / "audit.json", directory / "audit.log"
    env = {**os.environ, "KILN_HOME": str(engine.settings.home), "PYTHONUNBUFFERED": "1"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            _argv(engine, job, out), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env
        )
        while proc.poll() is None:
            if cancel.wait(POLL_S):
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return Outcome("failed", "cancelled: the audit process was stopped; nothing of it remains")
    if not out.is_file():
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-2000:].strip()
        return Outcome("failed", f"audit_failed: the audit process exited {proc.returncode} without a record: {tail}")
    load_training_audit(out)  # strictly: schema, verdict rules
    job.result = read_json_file(out)
    job.progress = 1.0
    return Outcome("completed")


def audit_detail(job: Job) -> JsonObject:
    """``AuditJobDetail``."""
    out: JsonObject = {
        "job_id": job.job_id,
        "state": job.state,
        "adapter": job.adapter_name,
        "segments": job.request.get("segments"),
        "seed": job.request.get("seed"),
        "submitted_unix_ms": job.submitted_ms,
        "record": job.result,
    }
    return {**out, **job.ending()}
