"""What the client commands share: the ``--url``/``--api-key``/``--json`` options, the SDK client, error output.

Client commands (``kiln train sft|grpo|opd|status|cancel``, ``kiln adapters list|load|unload|delete``,
``kiln health``, ``kiln eval``, ``kiln teachers`` with a server) talk to a running ``kiln serve`` through
the generated SDK (``kiln_contracts.client``). Their machine form (``--json``) is the server's JSON body.
Every error leaves the same way: ``error [<code>]: <message>`` and ``hint: …`` on stderr (or, with
``--json``, the ``ErrorEnvelope`` on stdout) and exit status 1; an unreachable server is one line naming
the URL. ``Interrupt`` is how a command that follows a job takes Ctrl-C; ``url_flag`` repeats ``--url`` in
the follow-up commands it prints. Imports of the SDK (httpx, pydantic models) happen on use.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

DEFAULT_URL = "http://localhost:8420"
TIMEOUT_S = 300.0  # admission ingests the whole dataset and generation runs on the server's device

__all__ = [
    "DEFAULT_URL",
    "Interrupt",
    "add_client_options",
    "api_error",
    "api_key",
    "body",
    "connect",
    "connection_error",
    "print_json",
    "run",
    "server_url",
    "unreachable",
    "url_flag",
]


def add_client_options(parser: argparse.ArgumentParser, *, json_help: str = "print the server's JSON body") -> None:
    """``--url``, ``--api-key`` and ``--json`` (defaults are read from the environment when the command runs)."""
    parser.add_argument("--url", help=f"Kiln server to talk to (default: $KILN_URL, else {DEFAULT_URL})", metavar="URL")
    parser.add_argument("--api-key", help="bearer key of the server (default: $KILN_API_KEY)", metavar="KEY")
    parser.add_argument("--json", action="store_true", help=json_help)


def server_url(args: argparse.Namespace) -> str:
    return (getattr(args, "url", None) or os.environ.get("KILN_URL") or DEFAULT_URL).rstrip("/")


def url_flag(args: argparse.Namespace) -> str:
    """`` --url URL`` when the command was given one: the tail of the follow-up commands it prints."""
    return f" --url {shlex.quote(args.url)}" if getattr(args, "url", None) else ""


def api_key(args: argparse.Namespace) -> str | None:
    return getattr(args, "api_key", None) or os.environ.get("KILN_API_KEY") or None


@contextmanager
def connect(args: argparse.Namespace) -> Iterator[Any]:
    """A ``KilnClient`` for the command's server, closed on exit."""
    from kiln_contracts.client import KilnClient

    with KilnClient(server_url(args), api_key=api_key(args), timeout=TIMEOUT_S) as client:
        yield client


class Interrupt:
    """Ctrl-C while a command watches something: the first one sets ``event``, a second one aborts.

    Python raises ``KeyboardInterrupt`` wherever the main thread is when it checks for signals -- and inside a
    finalizer (``__del__``, run by garbage collection at arbitrary allocations) that exception is printed as
    "Exception ignored" and lost, so a loop that waits for ``KeyboardInterrupt`` may never see it. Here the handler
    only sets an event, which the loop checks and waits on (``event.wait(poll_s)`` instead of ``time.sleep``).
    A request already in flight finishes first (the client's timeout bounds it).
    """

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():  # signals reach only the main thread
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def body(value: Any) -> Any:
    """The JSON body behind an SDK answer (a model, a list of models, or plain data)."""
    if isinstance(value, list):
        return [body(item) for item in value]
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_unset=True, by_alias=True)
    return value


def print_json(value: Any) -> None:
    print(json.dumps(body(value), indent=2, ensure_ascii=False))


def api_error(args: argparse.Namespace, exc: Any) -> int:
    """A ``KilnApiError``: its envelope on stdout with ``--json``, else code, message and hint on stderr."""
    if getattr(args, "json", False):
        error: dict[str, Any] = {"code": exc.code, "message": exc.message, "hint": exc.hint}
        if exc.pointer is not None:
            error["pointer"] = exc.pointer
        print(json.dumps({"error": error}, indent=2, ensure_ascii=False))
        return 1
    where = f" (at {exc.pointer})" if exc.pointer else ""
    print(f"error [{exc.code}]: {exc.message}{where}", file=sys.stderr)
    if exc.hint:
        print(f"hint: {exc.hint}", file=sys.stderr)
    if exc.retry_after is not None:
        print(f"hint: retry after {exc.retry_after} s", file=sys.stderr)
    return 1


def unreachable(url: str) -> str:
    return f"cannot reach the Kiln server at {url} (is `kiln serve` running?)"


def connection_error(args: argparse.Namespace, exc: Any) -> int:
    print(f"error: {unreachable(server_url(args))}", file=sys.stderr)
    cause = exc.__cause__
    if cause is not None and "Timeout" in type(cause).__name__:
        print(f"hint: it did not answer in time ({type(cause).__name__})", file=sys.stderr)
    else:
        print("hint: start one with `kiln serve`, or point --url / KILN_URL at a running one", file=sys.stderr)
    return 1


def run(args: argparse.Namespace, action: Callable[[Any], int]) -> int:
    """Call ``action(client)``; SDK errors become the CLI's error output and exit status 1."""
    from kiln_contracts.client import KilnApiError, KilnConnectionError

    try:
        with connect(args) as client:
            return action(client)
    except KilnApiError as exc:
        return api_error(args, exc)
    except KilnConnectionError as exc:
        return connection_error(args, exc)
