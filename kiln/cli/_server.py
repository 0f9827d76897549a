"""``kiln serve`` (the HTTP control plane) and ``kiln health`` (asks a running one how it is)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kiln.cli._client import add_client_options, api_error, body, connect, connection_error, print_json
from kiln.cli._train import DEVICE_HELP, device_setting
from kiln.errors import KilnError


def add_serve_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="start the training server (HTTP API, job queue, chat completions, /ui)",
        description="Resolve the configuration (flags > KILN_<SECTION>_<FIELD> > kiln.toml > defaults), load the "
        "base model, capture its identity, open the job store and serve until interrupted. Prints "
        "`Ready on http://HOST:PORT` when it accepts requests.",
    )
    p.add_argument("--host", help="bind address (default 127.0.0.1; server.host)")
    p.add_argument("--port", type=int, help="TCP port (default 8420; server.port)")
    p.add_argument("--model", help="local Hugging Face model directory (default: the built-in tiny model)")
    p.add_argument("--adapter-dir", help="adapter registry directory (default: $KILN_HOME/adapters)")
    p.add_argument(
        "--device",
        type=device_setting,
        metavar="DEVICE",
        help=f"{DEVICE_HELP}: where the server holds its serving copy of the base model and, for a job that sets "
        "none, where it trains (sets model.device and training.device; default auto)",
    )
    p.add_argument("--config", help="kiln.toml to read (default: $KILN_HOME/kiln.toml)")
    p.set_defaults(func=cmd_serve)


def add_health_parser(sub: Any) -> None:
    p = sub.add_parser(
        "health",
        help="ask a running server how it is: status, model, identities, queue, active adapter and job",
        description="GET /health (no API key needed): one line per fact. Exit 0 when the server is ok, 1 when it "
        "is degraded (the failing checks are listed) or cannot be reached.",
    )
    add_client_options(p, json_help="print the server's HealthResponse")
    p.set_defaults(func=cmd_health)


def cmd_serve(args: argparse.Namespace) -> int:
    from kiln.server import serve

    try:
        return serve(
            host=args.host,
            port=args.port,
            model=args.model,
            adapter_dir=args.adapter_dir,
            config_path=args.config,
            device=args.device,
        )
    except KilnError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 1


def cmd_health(args: argparse.Namespace) -> int:
    from kiln_contracts.client import KilnApiError, KilnConnectionError

    try:
        with connect(args) as client:
            health = body(client.get_health())
    except KilnApiError as exc:
        health = _degraded(exc)
        if health is None:
            return api_error(args, exc)
    except KilnConnectionError as exc:
        return connection_error(args, exc)
    if args.json:
        print_json(health)
    else:
        _print_health(health)
    return 0 if health["status"] == "ok" else 1


def _degraded(exc: Any) -> dict[str, Any] | None:
    """A degraded server answers 503 with the HealthResponse itself (not an error envelope)."""
    import json

    from kiln import contracts

    if exc.status_code != 503:
        return None
    try:
        value = json.loads(exc.message)
    except ValueError:
        return None
    return value if not contracts.problems("HealthResponse", value) else None


def _print_health(health: dict[str, Any]) -> None:
    execution, weights, training = health["execution_identity"], health["base_weight_identity"], health["training"]
    failed = [check["name"] for check in health["checks"] if not check["pass"]]
    print(f"status: {health['status']}" + (f" (failing: {', '.join(failed)})" if failed else ""))
    print(f"model: {health['model']} ({health['model_source']})")
    print(f"version: kiln {health['version']}")
    print(f"execution identity: {execution['provenance_sha256'] if execution else 'not captured'}")
    print(f"base weights: {weights['aggregate_sha256'] if weights else 'not identified'}")
    print(f"queue: {training['queued']}/{training['queue_capacity']}")
    print(f"active adapter: {health['active_adapter'] or 'none (base model)'}")
    job = training["active_job"]
    if job is None:
        print("active job: none")
    else:
        print(
            f"active job: {job['job_id']} ({job['job_type']}, adapter {job['adapter_name']}, "
            f"{job['progress'] * 100:.0f}%" + (", cancelling)" if job["cancel_requested"] else ")")
        )
    serving = health.get("serving")  # absent from a server older than the serving copy's release
    if serving is not None:
        print(f"serving copy: {serving} ({health['memory']['device']})")
