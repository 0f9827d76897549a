"""``kiln train`` over HTTP: submit SFT, GRPO and OPD jobs, follow them, status and cancel.

The request is built from the file and the flags by ``kiln.cli._requests`` (the same flags build the
same config as ``--local``), submitted with the generated SDK (``kiln_contracts.client``); the answer is
printed as the short human lines of spec/60, or as the server's JSON with ``--json``.
``--wait`` follows the job with a progress bar until it ends; a job of any kind that fails with a
checkpoint prints the command that resumes it on the same server. ``kiln.cli._train`` holds the parsers
and sends every command here that has no ``--local``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from kiln.cli._client import Interrupt, body, print_json, run, server_url, url_flag
from kiln.cli._requests import build_request, prepare, resume_command

TERMINAL = ("completed", "failed")
POLL_S = 0.5  # how often --wait asks for the job detail
BAR_STEPS = 1000  # resolution of the --wait progress bar (the server reports a fraction)


def submit(args: argparse.Namespace, kind: str) -> int:
    """Build the request, submit it and print the job; with ``--wait`` follow it to the end."""
    if args.adapter_dir or args.model:
        print(
            "error: --adapter-dir and --model apply to --local runs; a server trains with its own model into its own "
            "registry",
            file=sys.stderr,
        )
        return 2
    path = Path(args.file)
    request = prepare(path, lambda: build_request(args, path))
    if isinstance(request, int):
        return request

    def submit(client: Any) -> int:
        method = getattr(client, f"submit_{kind}_training")  # the SDK's method of the kind's route
        if request.get("dataset_path") is not None:
            request["dataset_path"] = _upload(client, args, Path(request["dataset_path"]))
        answer = body(method(request))
        job_id = answer["job_id"]
        if args.json and not args.wait:
            print_json(answer)
            return 0
        if not args.json:
            print(f"✓ {kind.upper()} training job submitted")
            print(f"Job ID: {job_id}")
            print(f"Effective seed: {answer['effective_seed']}")
            print(f"Check status: kiln train status --job-id {job_id}{url_flag(args)}")
        return _follow(client, args, job_id, kind) if args.wait else 0

    return run(args, submit)


def _upload(client: Any, args: argparse.Namespace, path: Path) -> str:
    """Upload a JSONL file to the server (which reads training files only inside its data roots); the
    ``dataset_path`` of the stored copy, named by its digest (the same bytes always get the same path)."""
    with path.open("rb") as handle:
        stored = body(client.upload_dataset(handle))
    if not args.json:
        again = "" if stored["created"] else ", already stored"
        print(f"Uploaded {path} ({stored['bytes']} bytes, {stored['sha256']}{again})", file=sys.stderr)
    return stored["dataset_path"]


def _follow(client: Any, args: argparse.Namespace, job_id: str, kind: str) -> int:
    """Poll the job until it ends (progress bar on stderr); Ctrl-C stops watching, not the job."""
    bar = None
    detail: dict[str, Any] = {"state": None}
    with Interrupt() as interrupt:
        try:
            if not args.json:
                from kiln.host.progress import counter

                bar = counter(
                    total=BAR_STEPS,
                    desc=job_id,
                    counts=False,  # a non-terminal prints the job's per cent, not its thousandths
                    bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}{postfix}]",
                )
            while not interrupt.event.is_set():
                detail = body(client.get_training_job(job_id))
                if bar is not None:
                    bar.n = round(detail["progress"] * BAR_STEPS)
                    loss = detail["current_loss"]
                    bar.set_postfix_str(detail["state"] + (f", loss {loss:.4f}" if loss is not None else ""))
                    bar.refresh()
                if detail["state"] in TERMINAL:
                    break
                interrupt.event.wait(POLL_S)
        finally:
            if bar is not None:
                bar.close()
    if detail["state"] in TERMINAL:
        return _outcome(args, detail, kind)
    print(f"\nstopped watching; job {job_id} keeps running on the server", file=sys.stderr)
    print(f"cancel it with: kiln train cancel --job-id {job_id}{url_flag(args)}", file=sys.stderr)
    return 130


def _checkpoint_line(checkpoint: dict[str, Any]) -> str:
    return (
        f"Resume checkpoint: {checkpoint['resume_checkpoint']} "
        f"(step {checkpoint['global_step']}/{checkpoint['total_steps']})"
    )


def _outcome(args: argparse.Namespace, detail: dict[str, Any], kind: str) -> int:
    ok = detail["state"] == "completed"
    if args.json:
        print_json(detail)
        return 0 if ok else 1
    if ok:
        loss = detail["current_loss"]
        print(f"✓ job {detail['job_id']} completed: adapter {detail['adapter_name']}")
        if detail["adapter_path"]:
            print(f"Adapter: {detail['adapter_path']}")
        if loss is not None:
            print(f"Final loss: {loss:.4f}")
        return 0
    print(f"✗ job {detail['job_id']} failed: {detail.get('error') or 'no reason given'}", file=sys.stderr)
    checkpoint = detail["latest_checkpoint"]
    if checkpoint is not None:
        print(_checkpoint_line(checkpoint), file=sys.stderr)
        resume = resume_command(args, checkpoint["resume_checkpoint"], args.checkpoint_interval, local=False)
        print(f"Resume with:\n  {resume}", file=sys.stderr)
    return 1


def _percent(progress: float) -> str:
    return f"{progress * 100:.0f}%"


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def cmd_train_status(args: argparse.Namespace) -> int:
    def table(client: Any) -> int:
        jobs = body(client.list_training_status())
        if args.json:
            print_json(jobs)
            return 0
        if not jobs:
            print(f"no training jobs on {server_url(args)}")
            return 0
        print(f"{'JOB ID':18} {'TYPE':5} {'STATE':10} {'PROGRESS':>8} {'LOSS':>8}  ADAPTER")
        for job in jobs:
            print(
                f"{job['job_id']:18} {job.get('job_type') or '-':5} {job['state']:10} "
                f"{_percent(job['progress']):>8} {_loss(job['current_loss']):>8}  {job['adapter_name'] or '-'}"
            )
        return 0

    def one(client: Any) -> int:
        detail = body(client.get_training_job(args.job_id))
        if args.json:
            print_json(detail)
            return 0
        epoch = f" (epoch {detail['epoch']})" if detail["epoch"] is not None else ""
        print(f"Job ID: {detail['job_id']}")
        print(f"Type: {detail.get('job_type') or '-'}")
        print(f"Adapter: {detail['adapter_name'] or '-'}")
        print(f"State: {detail['state']}")
        print(f"Progress: {_percent(detail['progress'])}{epoch}")
        print(f"Loss: {_loss(detail['current_loss'])}")
        print(f"Effective seed: {detail.get('effective_seed') or '-'}")
        if detail.get("error"):
            print(f"Error: {detail['error']}")
        verdict = detail.get("post_eval_verdict")
        if verdict is not None:
            print(f"Gate: {verdict['outcome']} -- {verdict['reason']}")
            print(f"Evaluations: {', '.join(detail['linked_eval_job_ids']) or '-'} (kiln eval status --job-id ID)")
        elif (detail.get("replay_request") or {}).get("post_eval") and detail["state"] in ("queued", "running"):
            print("Gate: pending (the adapter goes live only if the evaluation gate promotes it)")
        checkpoint = detail["latest_checkpoint"]
        if checkpoint is not None:
            print(_checkpoint_line(checkpoint))
            if detail["state"] == "completed":  # never the final step: the run published its adapter instead
                delete = f"kiln adapters delete {shlex.quote(detail['adapter_name'] or 'NAME')}{url_flag(args)}"
                print(
                    "  the run completed and published its adapter: nothing needs resuming. This is the last "
                    f"checkpoint it wrote on the way; it stays on disk until `{delete}` removes it with the adapter"
                )
        elif detail["checkpoint_error"]:
            print(f"Checkpoint: unusable ({detail['checkpoint_error']})")
        return 0

    return run(args, table if args.job_id is None else one)


def cmd_train_cancel(args: argparse.Namespace) -> int:
    def cancel(client: Any) -> int:
        answer = body(client.cancel_training_job(args.job_id))
        if args.json:
            print_json(answer)
        elif answer["status"] == "cancelled":
            print("✓ cancelled")
        else:
            print("✓ cancellation requested (the job stops at its next step and publishes a checkpoint)")
        return 0

    return run(args, cancel)
