"""Batched decoding: concurrent chat requests and ``n`` choices against the same work one request at a time.

    python bench/bench_serving.py [--models tiny,wide] [--repeats 5] [--tokens 64] [--requests 8] [--threads T]
                                  [--live]

Each request is a chat completion that generates exactly ``--tokens`` tokens (``min_tokens`` = ``max_tokens``), with
temperature 1 and its own seed; the prompts are ``--requests`` different user messages. Two comparisons, side by
side, for each model:

(a) ``--requests`` requests sent at once from as many threads, against the same requests sent one after another;
(b) one request with ``n = --requests`` against ``--requests`` requests with ``n = 1`` (seeds ``seed + i``, what
    choice i of the first samples with) sent one after another.

By default the routes run in this process (``kiln.server._openai.chat_completion`` on a ``Generator``, which is
what the HTTP route calls in a worker thread): the measurement is the engine's, without HTTP. With ``--live`` the
requests go over HTTP to a ``kiln serve`` subprocess on loopback (one ``httpx.Client`` per thread). Each repeat runs
the four cases in turn; reported are the median wall time of each case over the repeats and the ratios batched /
sequential (targets: at most 0.4 on the tiny model; 0.3 for (a) and 0.25 for (b) on the wide one). ``--smoke`` runs
the smallest size (the suite runs it). Every repeat also checks that the batched answers equal the
sequential ones (choices and usage). Models: ``tiny`` (the built-in tiny model) and ``wide`` (the benches'
23.2 M-parameter model, ``_machine.make_wide``). Results: bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _machine import cpu_model, make_wide, stop_process

QUESTIONS = (
    "How do I reset my password?",
    "Can I change my email?",
    "What is the capital of France?",
    "Tell me about the weather today and tomorrow in Berlin.",
    "def add(a, b): what does this function return?",
    "How many days are in a week?",
    "My order has not arrived. What should I do?",
    "Count from one to twenty, please.",
)


def bodies(count: int, tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "model": "bench",
            "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS))}],
            "max_tokens": tokens,
            "min_tokens": tokens,
            "temperature": 1.0,
            "seed": 100 + i,
        }
        for i in range(count)
    ]


# (a) concurrent / sequential and (b) n=N / N x n=1 at most these (the wide model's from "One invariant forward")
TARGETS = {"tiny": (0.4, 0.4), "wide": (0.3, 0.25)}


# ----------------------------------------------------------------------------- the two ways to send


class InProcess:
    """The chat route in this process, as the HTTP route calls it (a worker thread per request)."""

    def __init__(self, model_dir: Path, work: Path):
        from kiln.model import load_base_model
        from kiln.server._generation import Generator
        from kiln.server._openai import chat_completion

        registry = work / "adapters"
        registry.mkdir(parents=True, exist_ok=True)
        self.generator = Generator(load_base_model(model_dir), registry, "bench")
        self._chat = chat_completion

    def client(self) -> Callable[[dict[str, Any]], dict[str, Any]]:
        return lambda body: self._chat(self.generator, body)

    def stop(self) -> None:
        pass


class Live:
    """``python -m kiln.cli serve`` on loopback with its own KILN_HOME; requests over HTTP."""

    def __init__(self, model_dir: Path, work: Path):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        env.update({"KILN_HOME": str(work / "home"), "KILN_MODEL_PATH": str(model_dir), "PYTHONUNBUFFERED": "1"})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "serve", "--port", str(self.port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        ready, output = threading.Event(), []

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                output.append(line)
                if line.startswith("Ready on "):
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 300
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("kiln serve did not become ready:\n" + "".join(output))
        self.model = model_dir.name

    def client(self) -> Callable[[dict[str, Any]], dict[str, Any]]:
        import httpx

        http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600.0)

        def send(body: dict[str, Any]) -> dict[str, Any]:
            response = http.post("/v1/chat/completions", json={**body, "model": self.model})
            response.raise_for_status()
            answer: dict[str, Any] = response.json()
            return answer

        return send

    def stop(self) -> None:
        stop_process(self.proc)


# ----------------------------------------------------------------------------- the cases


def timed(run: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = run()
    return time.perf_counter() - started, result


def answers(documents: list[dict[str, Any]]) -> list[Any]:
    """What must not change with batching: every choice (its index aside), in order, and the tokens counted."""
    return [{**c, "index": 0} for d in documents for c in d["choices"]] + [
        sum(d["usage"]["completion_tokens"] for d in documents)
    ]


def one_repeat(clients: list[Any], pool: ThreadPoolExecutor, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """The four cases once, in turn: their seconds, and whether the batched answers equal the sequential ones."""
    seconds: dict[str, float] = {}
    seconds["sequential"], one_by_one = timed(lambda: [clients[0](body) for body in requests])
    barrier = threading.Barrier(len(requests))

    def at_once(i: int, body: dict[str, Any]) -> dict[str, Any]:
        barrier.wait()
        return clients[i](body)

    seconds["concurrent"], together = timed(
        lambda: [f.result() for f in [pool.submit(at_once, i, b) for i, b in enumerate(requests)]]
    )
    same, n = requests[0], len(requests)
    singles = [{**same, "seed": same["seed"] + i} for i in range(n)]
    seconds["n=1 x N"], alone = timed(lambda: [clients[0](body) for body in singles])
    seconds["n=N"], choices = timed(lambda: [clients[0]({**same, "n": n})])
    identical = answers(together) == answers(one_by_one) and answers(choices) == answers(alone)
    tokens = sum(d["usage"]["completion_tokens"] for d in one_by_one)
    return {"seconds": seconds, "identical": identical, "tokens": tokens}


def run_model(name: str, model_dir: Path, work: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    target = (Live if args.live else InProcess)(model_dir, work)
    requests = bodies(args.requests, args.tokens)
    clients = [target.client() for _ in requests]
    pool = ThreadPoolExecutor(len(requests))
    times: dict[str, list[float]] = {"sequential": [], "concurrent": [], "n=1 x N": [], "n=N": []}
    try:
        clients[0]({**requests[0], "max_tokens": 4, "min_tokens": 4})  # warm-up: first-call costs out of the way
        for repeat in range(args.repeats):
            result = one_repeat(clients, pool, requests)
            for case, seconds in result["seconds"].items():
                times[case].append(seconds)
            print(
                f"{name} repeat {repeat}: sequential {times['sequential'][-1]:.3f} s, concurrent "
                f"{times['concurrent'][-1]:.3f} s, n=1 x {args.requests} {times['n=1 x N'][-1]:.3f} s, "
                f"n={args.requests} {times['n=N'][-1]:.3f} s ({result['tokens']} tokens a case; batched answers "
                f"identical: {'yes' if result['identical'] else 'NO'}; load "
                f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})",
                flush=True,
            )
            if not result["identical"]:
                raise SystemExit("batched answers differ from the sequential ones")
    finally:
        pool.shutdown()
        target.stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,wide")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--live", action="store_true", help="over HTTP to a kiln serve subprocess")
    parser.add_argument("--smoke", action="store_true", help="the smallest run (the suite's): tiny, 2 x 2 tokens")
    args = parser.parse_args()
    if args.smoke:
        args.models, args.repeats, args.tokens, args.requests = "tiny", 1, 2, 2
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the kiln serve subprocess too

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from kiln.model import create_tiny

    print(
        f"{cpu_model()}, {os.cpu_count()} cores, python {platform.python_version()}, torch {torch.__version__} "
        f"(torch threads: {torch.get_num_threads()}), {'HTTP to kiln serve' if args.live else 'in-process routes'}"
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-serving-") as tmp:
        work = Path(tmp)
        tiny = create_tiny(work / "models" / "kiln-tiny", seed=0)
        for name in args.models.split(","):
            model_dir = tiny
            if name == "wide":
                model_dir = work / "models" / "kiln-wide"
                make_wide(model_dir, tiny)
            results[name] = run_model(name, model_dir, work / name, args)
    n = args.requests
    print(f"\nmedian of {args.repeats} repeats, {n} requests x {args.tokens} tokens")
    print(f"{'model':<6} {'case':<34} {'sequential':>11} {'batched':>9} {'ratio':>8}  target")
    for name, times in results.items():
        for case, (slow, fast, target) in {
            f"(a) {n} concurrent vs one by one": ("sequential", "concurrent", TARGETS.get(name, (0.4, 0.4))[0]),
            f"(b) n={n} vs {n} x n=1": ("n=1 x N", "n=N", TARGETS.get(name, (0.4, 0.4))[1]),
        }.items():
            a, b = statistics.median(times[slow]), statistics.median(times[fast])
            verdict = "met" if b / a <= target else "not met"
            print(f"{name:<6} {case:<34} {a:>9.3f} s {b:>7.3f} s {b / a:>7.3f}x  <= {target}  {verdict}")


if __name__ == "__main__":
    main()
