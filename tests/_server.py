"""A real ``kiln serve`` process on loopback for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``python -m kiln.cli serve`` with its own KILN_HOME; ``start()`` waits for ``Ready on``."""

    def __init__(self, home: Path, model: Path, *, port: int | None = None, env: dict[str, str] | None = None):
        self.home, self.model = home, model
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra_env = env or {}
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []

    def start(self, timeout: float = 180.0) -> ServerProcess:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        env.update(
            {"KILN_HOME": str(self.home), "KILN_MODEL_PATH": str(self.model), "PYTHONUNBUFFERED": "1", **self.extra_env}
        )
        self.output = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "serve", "--port", str(self.port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                if line.startswith("Ready on "):
                    ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kiln serve did not become ready:\n" + "".join(self.output))
        return self

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60.0, **kwargs)

    def _reap(self) -> None:
        assert self.proc is not None
        self._pump.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def kill(self) -> None:
        """Die like a crash: SIGKILL, nothing flushed."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
            self._reap()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._reap()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for(predicate, timeout: float = 120.0, interval: float = 0.05):
    """Poll until ``predicate()`` returns a truthy value; return it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {predicate}")
