"""Status reads while a job trains: ``GET /v1/train/jobs/{id}`` and ``GET /v1/adapters``.

    python bench/bench_server.py [--quick] [--adapters 1000] [--seconds 10] [--adapters-seconds 20]
                                 [--concurrency 1,8] [--checkpoint-interval 250] [--sweep 300]
                                 [--dir DIR] [--keep] [--no-profile] [--no-strace]

What it does, in one process (the load client) plus one ``kiln serve`` subprocess:

1. Set-up. A temporary KILN_HOME; the tiny model; one real adapter trained in-process
   (``admit_sft``/``run_sft``, one epoch of ``examples/sft_corrections.jsonl``); then
   ``--adapters`` copies of it restored into the registry with
   ``restore_adapter(manifest, registry, name=...)`` (every file copied, hashed against
   the manifest, fsynced and renamed into place, so every entry is a valid, "available"
   adapter; the manifest keeps the ``adapter_name`` it was trained as, exactly what
   ``kiln adapters restore --name`` produces). A second adapter is trained in-process
   with a checkpoint after every step (``--sweep`` steps) in a separate registry, for the
   checkpoint-count sweep of part 5.
2. ``python -m kiln.cli serve`` on a free loopback port; a long SFT job (the same 12
   rows, 100,000 epochs, ``--checkpoint-interval``) is submitted and trains during the
   whole measurement (it is cancelled at the end).
3. Load. For each endpoint and each concurrency: an idle window (no requests: the
   training step rate at rest), then a warm-up and a measured window with N client
   threads in this process, each with its own keep-alive ``httpx.Client``, issuing GETs
   back to back (closed loop). Reported: requests/s (completions in the window / window),
   p50/p99/max latency of the requests completed in the window, the body size, the CPU
   the server and the client processes used in the window (100 % = one core), and the
   training step rate in the window against the idle window before it. Step counts come
   from the job's own loss history (each point carries the server's elapsed time), read
   once at the end, so no request is added at the window edges.
4. No rehash. (a) ``rchar`` of ``/proc/<server>/io`` (bytes returned by read syscalls,
   page cache included) over sequential requests, beside the training thread's own reads
   in an idle stretch of the same length, compared with the bytes of the adapter weights (or
   checkpoint tensors) a rehash would have to read; (b) ``strace -f -e trace=openat`` of
   the server during one request of each endpoint: which files it opens.
5. Where the time goes. py-spy (when installed) samples the server during one more
   single-client window per endpoint; inclusive share of each function under the route
   handler. After the server stops: ``list_adapters`` on the same registry
   taken apart step by step, and ``latest_checkpoint`` (what the job detail calls) against
   1, 10, 100 and ``--sweep`` checkpoints of one adapter beside the adapters.

Everything it starts it stops; the work directory is removed unless ``--keep``. Results
and notes: bench/README.md.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from _machine import cpu_model, filesystem_of, stop_process

ROOT = Path(__file__).resolve().parent.parent
DATASET = ROOT / "examples" / "sft_corrections.jsonl"
JOB_ADAPTER = "trainee"
SWEEP_ADAPTER = "sweep"
JOB_EPOCHS = 50_000  # x 12 rows: under admission's bound of 1,000,000 steps
CLK_TCK = os.sysconf("SC_CLK_TCK")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ms(seconds: float) -> float:
    return seconds * 1000


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


# ----------------------------------------------------------------------------- set-up


def build_registry(work: Path, count: int, sweep_steps: int) -> dict[str, Any]:
    """Tiny model, one trained adapter restored ``count`` times, and a checkpoint-per-step sweep run."""
    os.environ["KILN_HOME"] = str(work / "home")
    from kiln.adapters import restore_adapter
    from kiln.adapters._registry import list_adapters
    from kiln.model import create_tiny
    from kiln.trainers.sft import admit_sft, run_sft

    facts: dict[str, Any] = {}
    start = time.perf_counter()
    model = create_tiny(work / "models" / "kiln-tiny", seed=0)
    facts["model"] = model
    job = admit_sft(
        adapter_name="seed",
        registry=work / "trained",
        config={"epochs": 1, "seed": 7},
        dataset_path=DATASET,
        model_path=str(model),
    )
    result = run_sft(job)
    if result.status != "success":
        raise SystemExit(f"training the seed adapter failed: {result.receipt.get('failure_reason')}")
    seed_dir = result.adapter_dir
    facts["files"] = {p.name: p.stat().st_size for p in sorted(seed_dir.iterdir())}
    registry = work / "home" / "adapters"
    restored = time.perf_counter()
    for i in range(count):
        restore_adapter(seed_dir / "adapter_manifest.json", registry, name=f"adapter-{i:04d}")
    facts["restore_s"] = time.perf_counter() - restored
    listing = list_adapters(registry)
    statuses = collections.Counter(entry["status"] for entry in listing["available"])
    if statuses != {"available": count}:
        raise SystemExit(f"the restored registry does not list {count} available adapters: {dict(statuses)}")
    facts["statuses"] = dict(statuses)
    facts["registry"] = registry
    facts["weights_bytes"] = sum(
        (registry / e["name"] / "adapter_model.safetensors").stat().st_size for e in listing["available"]
    )
    facts["registry_bytes"] = sum(e["size_bytes"] for e in listing["available"])
    facts["setup_s"] = time.perf_counter() - start

    swept = time.perf_counter()
    rows = sum(1 for line in DATASET.read_text(encoding="utf-8").splitlines() if line.strip())
    sweep = admit_sft(
        adapter_name=SWEEP_ADAPTER,
        registry=work / "sweep",
        config={"epochs": -(-sweep_steps // rows), "seed": 7, "checkpoint_interval": 1},
        dataset_path=DATASET,
        model_path=str(model),
    )
    sweep_result = run_sft(sweep)
    if sweep_result.status != "success":
        raise SystemExit(f"the checkpoint sweep run failed: {sweep_result.receipt.get('failure_reason')}")
    facts["sweep_checkpoints"] = sorted(sweep_result.checkpoints)[:sweep_steps]
    facts["sweep_s"] = time.perf_counter() - swept
    return facts


# ----------------------------------------------------------------------------- the server process


class Server:
    """``python -m kiln.cli serve`` with its own KILN_HOME, ready once it prints ``Ready on``."""

    def __init__(self, home: Path, model: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = env or {}
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
        env.update({"KILN_HOME": str(home), "KILN_MODEL_PATH": str(model), "PYTHONUNBUFFERED": "1", **extra})
        self.output: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.cli", "serve", "--port", str(self.port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.pid = self.proc.pid
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line)
                if line.startswith("Ready on "):
                    ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        deadline = time.monotonic() + 300
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("kiln serve did not become ready:\n" + "".join(self.output))

    def cpu_seconds(self) -> float:
        """utime + stime of every thread of the server so far."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def io(self) -> dict[str, int]:
        with open(f"/proc/{self.pid}/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}

    def stop(self) -> None:
        stop_process(self.proc)
        self._pump.join(10)


def client_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


# ----------------------------------------------------------------------------- load


@dataclass
class Window:
    """Clock readings at one edge of a window."""

    perf: float
    wall: float
    server_cpu: float
    client_cpu: float


def edge(server: Server) -> Window:
    return Window(time.perf_counter(), time.time(), server.cpu_seconds(), client_cpu_seconds())


def sleep_until(target: float) -> None:
    while (left := target - time.perf_counter()) > 0:
        time.sleep(min(left, 0.5))


@dataclass
class Phase:
    endpoint: str
    clients: int
    start: Window
    end: Window
    latencies: list[float] = field(default_factory=list)  # seconds, requests completed in the window
    body_bytes: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    idle: tuple[Window, Window] | None = None

    @property
    def seconds(self) -> float:
        return self.end.perf - self.start.perf

    def cpu(self, which: str) -> float:
        """Percent of one core used in the window by the server or the client process."""
        return 100 * (getattr(self.end, which) - getattr(self.start, which)) / self.seconds


def idle_window(server: Server, seconds: float) -> tuple[Window, Window]:
    start = edge(server)
    sleep_until(start.perf + seconds)
    return start, edge(server)


def drive(
    server: Server, endpoint: str, path: str, clients: int, warmup: float, seconds: float, min_requests: int
) -> Phase:
    """``clients`` threads GET ``path`` back to back; the window starts after ``warmup`` and lasts
    ``seconds``, or longer (up to 4x) until ``min_requests`` requests have completed in it."""
    results: list[tuple[float, float, int, int]] = []  # (start, end, status, bytes)
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)
    stop = threading.Event()

    def worker() -> None:
        with httpx.Client(base_url=server.url, timeout=600.0) as http:
            barrier.wait()
            while not stop.is_set():
                t0 = time.perf_counter()
                answer = http.get(path)
                size = len(answer.content)
                t1 = time.perf_counter()
                with lock:
                    results.append((t0, t1, answer.status_code, size))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    begin = time.perf_counter()
    sleep_until(begin + warmup)
    start = edge(server)
    sleep_until(start.perf + seconds)
    limit = start.perf + 4 * seconds
    while time.perf_counter() < limit:
        with lock:
            done = sum(1 for _, t1, _, _ in results if t1 >= start.perf)
        if done >= min_requests:
            break
        time.sleep(0.1)
    end = edge(server)
    stop.set()
    for t in threads:
        t.join()
    phase = Phase(endpoint, clients, start, end)
    for t0, t1, status, size in results:
        if start.perf <= t1 <= end.perf:
            if status != 200:
                phase.errors.append(str(status))
            phase.latencies.append(t1 - t0)
            phase.body_bytes.append(size)
    return phase


class StepClock:
    """Training steps at any wall time, from the job's loss history (each point: elapsed, progress)."""

    def __init__(self, detail: dict[str, Any], total_steps: int):
        started = datetime.fromisoformat(detail["started_at"].replace("Z", "+00:00")).timestamp()
        points = [(started + p["elapsed_secs"], p["progress"] * total_steps) for p in detail["loss_history"]]
        self.times = [t for t, _ in points]
        self.steps = [s for _, s in points]

    def at(self, wall: float) -> float:
        i = bisect.bisect_left(self.times, wall)
        if i == 0 or i == len(self.times):
            raise ValueError("time outside the loss history")
        t0, t1, s0, s1 = self.times[i - 1], self.times[i], self.steps[i - 1], self.steps[i]
        return s0 + (s1 - s0) * (wall - t0) / (t1 - t0) if t1 > t0 else s1

    def rate(self, start: Window, end: Window) -> float:
        return (self.at(end.wall) - self.at(start.wall)) / (end.wall - start.wall)


def count_checkpoints(registry: Path, adapter: str) -> int:
    prefix = f"{adapter}-checkpoint-step-"
    return sum(1 for name in os.listdir(registry) if name.startswith(prefix) and name.endswith(".kiln-checkpoint"))


# ----------------------------------------------------------------------------- no rehash


def read_bytes_per_request(server: Server, path: str, requests: int) -> dict[str, float]:
    """rchar per request, corrected by the rchar rate of an idle window of the same length."""
    with httpx.Client(base_url=server.url, timeout=600.0) as http:
        http.get(path)
        before, t0 = server.io(), time.perf_counter()
        for _ in range(requests):
            answer = http.get(path)
            answer.raise_for_status()
        after, t1 = server.io(), time.perf_counter()
    loaded = t1 - t0
    quiet_before = server.io()
    time.sleep(loaded)
    quiet_after = server.io()
    idle_rate = (quiet_after["rchar"] - quiet_before["rchar"]) / loaded
    return {
        "requests": requests,
        "seconds": loaded,
        "rchar_per_request": (after["rchar"] - before["rchar"]) / requests,
        "idle_rchar_per_request": idle_rate * loaded / requests,
        "syscr_per_request": (after["syscr"] - before["syscr"]) / requests,
        "read_bytes_per_request": (after["read_bytes"] - before["read_bytes"]) / requests,
    }


OPENAT = re.compile(r'openat\([^,]+, "([^"]+)", ([A-Z_|]+)')


def strace_opens(server: Server, path: str, registry: Path) -> dict[str, int] | None:
    """Files under the registry opened by the server during one request, by kind (read-only opens)."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    out = Path(tempfile.mkstemp(prefix="kiln-bench-strace-", suffix=".txt")[1])
    tracer = subprocess.Popen(
        [strace, "-f", "-qq", "-e", "trace=openat", "-e", "signal=none", "-o", str(out), "-p", str(server.pid)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(2.0)  # attach to every thread
        with httpx.Client(base_url=server.url, timeout=600.0) as http:
            http.get(path).raise_for_status()
        time.sleep(0.3)
    finally:
        tracer.send_signal(signal.SIGINT)
        tracer.wait(30)
    counts: collections.Counter[str] = collections.Counter()
    prefix = str(registry) + "/"
    for line in out.read_text(errors="replace").splitlines():
        match = OPENAT.search(line)
        if not match or not match[1].startswith(prefix):
            continue
        if "O_WRONLY" in match[2] or "O_RDWR" in match[2]:
            continue  # the training thread writing a checkpoint
        rel = match[1][len(prefix) :]
        top, _, name = rel.partition("/")
        if not name:
            kind = "(registry directory)"
        elif top.endswith(".kiln-checkpoint"):
            kind = f"checkpoint/{name}"
        elif top.startswith("."):
            kind = f"hidden/{name}"
        else:
            kind = f"adapter/{name}"
        counts[kind] += 1
    out.unlink()
    return dict(sorted(counts.items()))


# ----------------------------------------------------------------------------- profiles


def profile(server: Server, path: str, seconds: float, handler: str) -> list[tuple[str, float]] | None:
    """py-spy samples during one single-client window; inclusive % of functions under ``handler``."""
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    out = Path(tempfile.mkstemp(prefix="kiln-bench-pyspy-", suffix=".txt")[1])
    command = [spy, "record", "--nonblocking", "-p", str(server.pid), "-r", "200", "-d", str(int(seconds))]
    recorder = subprocess.Popen(
        [*command, "-f", "raw", "-o", str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stop = threading.Event()

    def hammer() -> None:
        with httpx.Client(base_url=server.url, timeout=600.0) as http:
            while not stop.is_set():
                http.get(path)

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    recorder.wait(seconds + 60)
    stop.set()
    thread.join()
    inclusive: collections.Counter[str] = collections.Counter()
    loop_self: collections.Counter[str] = collections.Counter()
    other_self: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    for line in out.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        names = [f.split(" (")[0] for f in frames]
        at = next((i for i, n in enumerate(names) if n == handler or n.endswith(f".<locals>.{handler}")), None)
        if at is not None:
            kind = "route handler (threadpool)"
            for f in set(frames[at:]):
                inclusive[f] += count
        elif any("JobManager._work" in n for n in names):
            kind = "training thread"
        elif any("run_forever" in n for n in names):
            kind = "event loop (uvicorn, middleware, response send)"
            loop_self[frames[-1]] += count
        else:
            kind = "other"
            other_self[frames[-1]] += count
        kinds[kind] += count
    out.unlink()
    samples = sum(kinds.values()) or 1
    rows = [(f"[share of server samples] {k}", 100 * v / samples) for k, v in kinds.most_common()]
    handled = kinds["route handler (threadpool)"]
    if handled:
        rows += [(f"[handler, inclusive] {f}", 100 * v / handled) for f, v in inclusive.most_common(18)]
    looped = kinds["event loop (uvicorn, middleware, response send)"]
    if looped:
        rows += [(f"[event loop, self] {f}", 100 * v / looped) for f, v in loop_self.most_common(6)]
    if kinds["other"]:
        rows += [(f"[other, self] {f}", 100 * v / kinds["other"]) for f, v in other_self.most_common(4)]
    return rows


# ----------------------------------------------------------------------------- in-process breakdowns


def timed(fn: Any, reps: int) -> float:
    """Median seconds of ``reps`` calls."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def adapters_breakdown(registry: Path, reps: int) -> list[tuple[str, float]]:
    """``list_adapters`` on the registry, and the same work taken apart (ms for the whole registry)."""
    from kiln import contracts
    from kiln.adapters._registry import _adapter_dirs, adapter_entry, list_adapters
    from kiln.documents.jsonio import read_json_file

    dirs = [d for d in _adapter_dirs(registry) if (d / "adapter_manifest.json").is_file()]
    listing = list_adapters(registry)
    entries = [e for e in listing["available"] if e["adapter_manifest"] is not None]
    manifests = [read_json_file(d / "adapter_manifest.json") for d in dirs]

    def scan() -> None:
        for d in dirs:
            for e in os.scandir(d):
                e.stat(follow_symlinks=False)
            (d / "adapter_model.safetensors").stat()
            d.stat()

    def render() -> bytes:
        return json.dumps(listing, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()

    rows = [
        ("list_adapters (whole registry)", timed(lambda: list_adapters(registry), reps)),
        ("  adapter_entry x N", timed(lambda: [adapter_entry(d) for d in dirs], reps)),
        ("    scandir + stat of the files", timed(scan, reps)),
        (
            "    read + parse adapter_config.json",
            timed(lambda: [read_json_file(d / "adapter_config.json") for d in dirs], reps),
        ),
        (
            "    read + parse adapter_manifest.json",
            timed(lambda: [read_json_file(d / "adapter_manifest.json") for d in dirs], reps),
        ),
        (
            "    problems('AdapterManifest')",
            timed(lambda: [contracts.problems("AdapterManifest", m) for m in manifests], reps),
        ),
        (
            "    problems('AdapterDiskEntry') (manifest inside, again)",
            timed(lambda: [contracts.problems("AdapterDiskEntry", e) for e in entries], reps),
        ),
        ("    Path.resolve() x 3", timed(lambda: [(d.resolve(), d.resolve(), d.resolve()) for d in dirs], reps)),
        (
            "  available_adapters = json.loads(json.dumps(available))",
            timed(lambda: json.loads(json.dumps(entries)), reps),
        ),
        ("JSONResponse render (json.dumps + encode)", timed(render, reps)),
    ]
    return [(label, ms(s)) for label, s in rows] + [("body bytes", float(len(render())))]


def checkpoint_sweep(registry: Path, checkpoints: list[Path], reps: int) -> list[tuple[int, float, float]]:
    """``latest_checkpoint`` of an adapter with K checkpoints in the adapters' registry: (K, ms, ms per checkpoint)."""
    from kiln.checkpoints import latest_checkpoint, parse_checkpoint_name

    rows = []
    moved = 0
    levels = sorted({k for k in (1, 10, 100, len(checkpoints)) if k <= len(checkpoints)})
    for k in levels:
        for path in checkpoints[moved:k]:
            path.rename(registry / path.name)
        moved = k
        if latest_checkpoint(registry, SWEEP_ADAPTER) is None:
            raise SystemExit("the sweep checkpoints do not inspect")
        t = timed(lambda: latest_checkpoint(registry, SWEEP_ADAPTER), reps if k <= 100 else max(3, reps // 4))
        rows.append((k, ms(t), ms(t) / k))
    scan = timed(lambda: [parse_checkpoint_name(e.name) for e in os.scandir(registry)], reps)
    rows.append((0, ms(scan), 0.0))  # the registry scan alone (K = 0 row)
    return rows


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short windows, 100-step sweep, fewer samples")
    parser.add_argument("--adapters", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=None, help="measured window for the job detail (10; quick 3)")
    parser.add_argument(
        "--adapters-seconds", type=float, default=None, help="measured window for /v1/adapters (20; quick 5)"
    )
    parser.add_argument("--warmup", type=float, default=None, help="warm-up before each window (2; quick 1)")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--checkpoint-interval", type=int, default=250, help="of the training job")
    parser.add_argument("--sweep", type=int, default=None, help="checkpoints of the sweep adapter (300; quick 30)")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the work directory (default: system temp)")
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy windows")
    parser.add_argument("--no-strace", action="store_true")
    parser.add_argument("--worker", choices=("process", "thread"), default="process",
                        help="training.worker of the server: a worker process per job (default) or a server thread")  # fmt: skip
    parser.add_argument("--worker-threads", type=int, default=None,
                        help="training.worker_threads of the server (default: its own, all cores but one)")  # fmt: skip
    args = parser.parse_args()
    quick = args.quick
    args.seconds = args.seconds or (3.0 if quick else 10.0)
    args.adapters_seconds = args.adapters_seconds or (5.0 if quick else 20.0)
    args.warmup = args.warmup if args.warmup is not None else (1.0 if quick else 2.0)
    args.sweep = args.sweep or (30 if quick else 300)
    levels = [int(c) for c in args.concurrency.split(",")]

    base = args.dir if args.dir is not None else Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-server-", dir=base))
    try:
        run(work, args, levels)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def run(work: Path, args: argparse.Namespace, levels: list[int]) -> None:
    import torch

    print(
        f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus ({cpu_model()}), "
        f"torch {torch.__version__}, httpx {httpx.__version__}"
    )
    threads = args.worker_threads if args.worker_threads is not None else "default (all cores but one)"
    print(
        f"work dir {work} ({filesystem_of(work)}); load average {load()}; training.worker {args.worker}, "
        f"worker_threads {threads}"
    )
    facts = build_registry(work, args.adapters, args.sweep)
    registry: Path = facts["registry"]
    print(
        f"registry: {args.adapters} adapters restored with restore_adapter in {facts['restore_s']:.1f} s, "
        f"all 'available'; per adapter {facts['files']}; weights {facts['weights_bytes']:,} B in all, "
        f"files {facts['registry_bytes']:,} B"
    )
    print(f"sweep adapter: {len(facts['sweep_checkpoints'])} checkpoints (one per step) in {facts['sweep_s']:.1f} s")

    # the job reads the repository's example file: its directory is a data root of this server
    env = {"KILN_TRAINING_WORKER": args.worker, "KILN_TRAINING_DATA_ROOTS": str(DATASET.parent)}
    if args.worker_threads is not None:
        env["KILN_TRAINING_WORKER_THREADS"] = str(args.worker_threads)
    server = Server(work / "home", facts["model"], env=env)
    phases: list[Phase] = []
    try:
        http = httpx.Client(base_url=server.url, timeout=600.0)
        config = {
            "epochs": JOB_EPOCHS,
            "seed": 11,
            "checkpoint_interval": args.checkpoint_interval,
            "auto_load": False,
            "output_name": JOB_ADAPTER,
        }
        answer = http.post("/v1/train/sft", json={"dataset_path": str(DATASET), "config": config})
        if answer.status_code != 200:
            raise RuntimeError(f"the job was refused: {answer.status_code} {answer.text}")
        job_id = answer.json()["job_id"]
        total_steps = int(re.search(r"\((\d+) steps", answer.json()["message"])[1])
        detail_path, adapters_path = f"/v1/train/jobs/{job_id}", "/v1/adapters"
        deadline = time.monotonic() + 120
        while True:
            d = http.get(detail_path).json()
            if d["state"] == "running" and d["progress"] * total_steps >= 20:
                break
            if d["state"] not in ("queued", "running") or time.monotonic() > deadline:
                raise SystemExit(f"the training job did not start: {d}")
            time.sleep(0.2)
        http.get(adapters_path).raise_for_status()  # first-use imports
        print(
            f"server pid {server.pid} on {server.url}; job {job_id}: {total_steps:,} steps, "
            f"checkpoint every {args.checkpoint_interval} steps"
        )
        print(
            f"client: this process, N threads, one keep-alive httpx.Client each, GETs back to back; "
            f"warm-up {args.warmup:g} s, windows {args.seconds:g} s (detail) / {args.adapters_seconds:g} s (adapters)"
        )
        print()

        checkpoints: dict[int, tuple[int, int]] = {}
        for endpoint, path, seconds in (
            ("adapters", adapters_path, args.adapters_seconds),
            ("job detail", detail_path, args.seconds),
        ):
            for clients in levels:
                idle = idle_window(server, seconds)
                before = count_checkpoints(registry, JOB_ADAPTER)
                phase = drive(server, endpoint, path, clients, args.warmup, seconds, 2 * clients)
                phase.idle = idle
                checkpoints[len(phases)] = (before, count_checkpoints(registry, JOB_ADAPTER))
                phases.append(phase)
                print(f"  {endpoint} x{clients}: {len(phase.latencies)} requests in {phase.seconds:.1f} s", flush=True)

        print("\nno rehash: bytes the server read per request (rchar of /proc/<pid>/io)")
        n_adapters = 3 if args.quick else 10
        n_detail = 100 if args.quick else 1000
        rehash = {
            "adapters": read_bytes_per_request(server, adapters_path, n_adapters),
            "job detail": read_bytes_per_request(server, detail_path, n_detail),
        }
        k_now = count_checkpoints(registry, JOB_ADAPTER)
        ckpt_tensor_bytes = sum(
            (registry / name / f).stat().st_size
            for name in os.listdir(registry)
            if name.startswith(f"{JOB_ADAPTER}-checkpoint-")
            for f in ("adapter.safetensors", "optimizer.safetensors")
        )
        meta = sum(
            (registry / f"adapter-{i:04d}" / f).stat().st_size
            for i in range(args.adapters)
            for f in ("adapter_manifest.json", "adapter_config.json")
        )
        for name, r in rehash.items():
            print(
                f"  {name:11} {r['requests']:5} requests in {r['seconds']:.1f} s: {r['rchar_per_request']:,.0f} B read "
                f"per request ({r['syscr_per_request']:,.0f} read calls; training thread alone "
                f"{r['idle_rchar_per_request']:,.0f} B in the same time; from disk {r['read_bytes_per_request']:,.0f} B)"
            )
        print(
            f"  a rehash would read: adapters {facts['weights_bytes']:,} B of weights per request (the manifests "
            f"and configs it must read are {meta:,} B); job detail {ckpt_tensor_bytes:,} B of tensors in the "
            f"{k_now} checkpoints of {JOB_ADAPTER!r}"
        )
        if not args.no_strace:
            for name, path in (("adapters", adapters_path), ("job detail", detail_path)):
                opens = strace_opens(server, path, registry)
                if opens is None:
                    print("  strace not installed: open trace skipped")
                    break
                print(f"  strace, one {name} request, read-only opens under the registry: {opens or 'none'}")

        if not args.no_profile:
            seconds = 4 if args.quick else 10
            for name, path, handler in (
                ("adapters", adapters_path, "adapters"),
                ("job detail", detail_path, "job_detail"),
            ):
                rows = profile(server, path, seconds, handler)
                if rows is None:
                    print("\npy-spy not installed (pip install py-spy): profiles skipped")
                    break
                print(f"\nwhere the server's time goes, one client on {name} ({seconds} s, py-spy, on-CPU samples)")
                for label, share in rows:
                    print(f"  {share:5.1f}%  {label}")

        final = http.get(detail_path).json()
        clock = StepClock(final, total_steps)
        http.delete(f"/v1/train/queue/{job_id}")
        http.close()
    finally:
        server.stop()

    print()
    print(f"machine: {os.cpu_count()} cores shared by the server (training thread + request threads) and this client")
    print()
    print(
        "| endpoint | clients | n | req/s | p50 ms | p99 ms | max ms | body KB | server CPU % idle → loaded "
        "| client CPU % | steps/s idle → loaded | ratio | job checkpoints |"
    )
    print("|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for index, p in enumerate(phases):
        lat = [ms(x) for x in p.latencies]
        assert p.idle is not None
        idle_rate, loaded_rate = clock.rate(*p.idle), clock.rate(p.start, p.end)
        k0, k1 = checkpoints[index]
        errors = f" ({len(p.errors)} errors)" if p.errors else ""
        idle_cpu = 100 * (p.idle[1].server_cpu - p.idle[0].server_cpu) / (p.idle[1].perf - p.idle[0].perf)
        print(
            f"| `{p.endpoint}` | {p.clients} | {len(lat)}{errors} | {len(lat) / p.seconds:,.1f} | "
            f"{percentile(lat, 50):,.1f} | {percentile(lat, 99):,.1f} | {max(lat):,.1f} | "
            f"{statistics.median(p.body_bytes) / 1000:,.0f} | {idle_cpu:.0f} → {p.cpu('server_cpu'):.0f} | "
            f"{p.cpu('client_cpu'):.0f} | {idle_rate:.1f} → {loaded_rate:.1f} | {loaded_rate / idle_rate:.2f} | "
            f"{k0}-{k1} |"
        )
    print()
    print(f"load average at the end {load()}")

    print(
        "p99 is nearest-rank (with n < 100 it is the slowest request); ratio = training steps/s in the window "
        "over steps/s in the idle window just before it"
    )
    print(f"\nin-process, server stopped (load average {load()}): GET /v1/adapters work taken apart (ms, medians)")
    reps = 3 if args.quick else 7
    for label, value in adapters_breakdown(registry, reps):
        print(f"  {label:58} {value:>12,.1f}" if label != "body bytes" else f"  {label:58} {value:>12,.0f}")
    body = json.dumps(final, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()
    render_ms = ms(timed(lambda: json.dumps(final, ensure_ascii=False, allow_nan=False, separators=(",", ":")), reps))
    print(
        f"\nin-process: the last job detail body ({len(final['loss_history'])} loss points, "
        f"{len(body):,} B) renders in {render_ms:.2f} ms (json.dumps, as JSONResponse does)"
    )
    print("\nin-process: latest_checkpoint (the job detail's checkpoint read) vs checkpoints of the adapter")
    print(
        f"  registry also holds {args.adapters} adapters and {count_checkpoints(registry, JOB_ADAPTER)} checkpoints of {JOB_ADAPTER!r}"
    )
    print(f"  {'K':>6} {'ms':>9} {'ms/checkpoint':>14}")
    for k, t, per in checkpoint_sweep(registry, facts["sweep_checkpoints"], 20 if not args.quick else 5):
        label = f"{k:>6}" if k else "  scan"
        print(f"  {label} {t:>9.2f} {per:>14.3f}" if k else f"  {label} {t:>9.2f}  (scandir + name parse only)")


if __name__ == "__main__":
    main()
