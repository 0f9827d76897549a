"""Admission of one large inline SFT request: ``POST /v1/train/sft`` with a ~20 MB body.

    python bench/bench_admission.py [--rows 10000] [--body-mb 20] [--dir DIR] [--keep]

What it does, in one process (the client) plus one ``kiln serve`` subprocess per case:

1. Set-up. A temporary work directory; the built-in tiny model (``kiln.model.create_tiny``, seed 0) written
   into it; one request body built once: ``--rows`` inline conversations (at most 10,000, the schema's
   ``maxItems``), each assistant turn sized so that the whole JSON body is about ``--body-mb`` MB, and each row
   far below the tiny model's context length in tokens (the server refuses a longer row); config
   ``{"epochs": 1, "auto_load": false}``. SFT has no dry run, so the job is a normal one, cancelled right after
   its admission.
2. ``admitted``: ``python -m kiln.cli serve`` with its own KILN_HOME and
   ``KILN_SERVER_MAX_REQUEST_BYTES=33554432`` (32 MiB, above the body). Before the request: the server's
   ``VmRSS`` and ``VmHWM`` (``/proc/<pid>/status``). The body is POSTed; reported: the wall time from send to
   the response, the HTTP status, then ``VmHWM`` (the peak resident set so far, admission included) and
   ``VmRSS`` read right after the response. The job is cancelled (``DELETE /v1/train/queue/{id}``) and awaited.
3. ``default_limit``: the same server without the override (``server.max_request_bytes`` default, 8 MiB) and
   the same body: the wall time to the 413 (declared ``Content-Length`` over the limit is refused before a
   byte of the body is read), and the same memory readings.

One JSON line of results on stdout. Everything it starts it stops; the work directory is removed unless
``--keep``. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _machine import cpu_model
from bench_server import Server

LIMIT_BYTES = 33_554_432  # the admitted case's server.max_request_bytes: 32 MiB
MAX_ROWS = 10_000  # SftRequest.examples maxItems
WORDS = ("press", "the", "key", "then", "choose", "open", "and", "read", "the", "panel", "before", "you", "close")


def proc_status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` of ``pid`` in KiB."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0])
    return found


def mib(kib: int) -> float:
    return round(kib / 1024, 1)


# ----------------------------------------------------------------------------- the body


def text_of(size: int, seed: int) -> str:
    words, length, i = [], 0, seed
    while length < size:
        word = WORDS[i % len(WORDS)]
        words.append(word)
        length += len(word) + 1
        i += 7
    return " ".join(words)[:size]


def build_body(rows: int, body_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """An SftRequest of ``rows`` conversations whose JSON is about ``body_bytes`` bytes."""

    def body_with(chars: int) -> bytes:
        examples = [
            {
                "messages": [
                    {"role": "user", "content": f"How do I open panel {i}?"},
                    {"role": "assistant", "content": text_of(chars, i)},
                ]
            }
            for i in range(rows)
        ]
        request = {"examples": examples, "config": {"epochs": 1, "auto_load": False, "output_name": "bench"}}
        return json.dumps(request, separators=(",", ":")).encode("utf-8")

    overhead = len(body_with(0))
    chars = max(1, (body_bytes - overhead) // rows)
    body = body_with(chars)
    return body, {"rows": rows, "assistant_chars_per_row": chars, "body_bytes": len(body)}


def row_tokens(model: Path, body: bytes) -> dict[str, int]:
    """Tokens of the first row under the model's chat template, and the model's context length."""
    from kiln.model import load_base_model

    loaded = load_base_model(model)
    first = json.loads(body)["examples"][0]["messages"]
    text = loaded.tokenizer.apply_chat_template(first, tokenize=False)
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    return {"row_tokens": len(ids), "context_length": int(loaded.model.config.max_position_embeddings)}


# ----------------------------------------------------------------------------- the server


def wait_terminal(http: httpx.Client, job_id: str, timeout: float = 120.0) -> str:
    """The job's terminal state and the start of its error (``failed (cancelled: ...)``), or its state at timeout."""
    deadline = time.monotonic() + timeout
    detail: dict[str, Any] = {"state": "unknown"}
    while time.monotonic() < deadline:
        detail = http.get(f"/v1/train/jobs/{job_id}").json()
        if detail["state"] in ("completed", "failed", "cancelled"):
            error = (detail.get("error") or "").split(":", 1)[0]
            return f"{detail['state']} ({error})" if error else detail["state"]
        time.sleep(0.1)
    return f"{detail['state']} after {timeout:.0f} s"


def run_case(work: Path, name: str, model: Path, body: bytes, env: dict[str, str]) -> dict[str, Any]:
    server = Server(work / name / "home", model, env)
    try:
        before = proc_status(server.pid)
        with httpx.Client(base_url=server.url, timeout=600.0) as http:
            start = time.perf_counter()
            try:
                answer = http.post("/v1/train/sft", content=body, headers={"content-type": "application/json"})
                status, text = answer.status_code, answer.text
            except httpx.HTTPError as exc:  # the server may answer and close before the whole body is sent
                status, text = None, f"{type(exc).__name__}: {exc}"
            wall = time.perf_counter() - start
            after = proc_status(server.pid)
            out: dict[str, Any] = {
                "status": status,
                "wall_s": round(wall, 3),
                "rss_before_mib": mib(before["VmRSS"]),
                "hwm_before_mib": mib(before["VmHWM"]),
                "peak_rss_mib": mib(after["VmHWM"]),
                "rss_after_mib": mib(after["VmRSS"]),
            }
            try:
                doc = json.loads(text)
            except ValueError:
                doc = {}
            if status == 200:
                out["job_id"] = doc["job_id"]
                cancel = http.delete(f"/v1/train/queue/{doc['job_id']}")
                out["cancel_status"] = cancel.status_code
                out["job_state"] = wait_terminal(http, doc["job_id"])
            else:
                error = doc.get("error") or {}
                out["error_code"] = error.get("code")
                out["error_message"] = error.get("message", text[:300])
        return out
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, default=MAX_ROWS)
    parser.add_argument("--body-mb", type=float, default=20.0)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    if not 0 < args.rows <= MAX_ROWS:
        raise SystemExit(f"--rows must be 1..{MAX_ROWS}")
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-admission-", dir=args.dir))
    try:
        os.environ["KILN_HOME"] = str(work / "setup-home")
        from kiln.model import create_tiny

        model = create_tiny(work / "models" / "kiln-tiny", seed=0)
        body, shape = build_body(args.rows, int(args.body_mb * 1_000_000))
        shape.update(row_tokens(model, body))
        admitted = run_case(work, "admitted", model, body, {"KILN_SERVER_MAX_REQUEST_BYTES": str(LIMIT_BYTES)})
        default = run_case(work, "default-limit", model, body, {})
        result = {
            "bench": "admission",
            "machine": {
                "python": platform.python_version(),
                "cpu": cpu_model(),
                "cores": os.cpu_count(),
            },
            "body": shape,
            "admitted": {"max_request_bytes": LIMIT_BYTES, **admitted},
            "default_limit": {"max_request_bytes": "default", **default},
        }
        print(json.dumps(result))
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
