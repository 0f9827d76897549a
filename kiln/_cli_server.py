"""``kiln serve``: the HTTP control plane."""

from __future__ import annotations

import argparse
import sys
from typing import Any

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
    p.add_argument("--config", help="kiln.toml to read (default: $KILN_HOME/kiln.toml)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from kiln.server import serve

    try:
        return serve(
            host=args.host, port=args.port, model=args.model, adapter_dir=args.adapter_dir, config_path=args.config
        )
    except KilnError as exc:
        print(f"error [{exc.code}]: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"hint: {exc.hint}", file=sys.stderr)
        return 1
