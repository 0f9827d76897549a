"""Crash safety of checkpoint publication (spec/30, "The property that proves it").

An SFT run that publishes a checkpoint after every step is SIGKILLed over and over, each
time resumed from the newest checkpoint, until a last resume runs to completion. Some
kills are timed at random after a committed step (the checkpoint of that step is being
published then); the others stop the process at an exact point of the publication -- just
before one of its file-system calls (mkdir, open, write -- then torn in half --, fsync,
unlink, rename), drawn at random, always including just before and just after the
rename -- and kill it there. After every kill:

* every canonical checkpoint in the registry loads (``load_checkpoint``: every byte
  hashed), their steps run 1..newest without a gap, and each one holds exactly the state
  files of the uninterrupted run A's checkpoint of the same step;
* nothing else is discoverable: ``list_checkpoints`` and ``latest_checkpoint`` see only
  canonical names, every other registry entry is a hidden staging directory
  (``orphaned_staging_dirs``) that does not load, and no adapter was published.

Finally the resumed run equals run A exactly: loss history, final adapter bytes (in
memory and the published ``adapter_model.safetensors``), optimizer bytes and loop state.

Every run is its own process with one environment and one build identity
(tests/_crash_driver.py forks them from one preloaded parent, so a run costs a fork, not
an interpreter start): the intra-op thread count changes float bits, and resume
admission refuses another execution provenance (a commit landing in the checkout
mid-test would otherwise split the runs into two builds).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kiln.artifacts.replay_log import pending_log
from kiln.checkpoints import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    orphaned_staging_dirs,
    parse_checkpoint_name,
)
from kiln.errors import CheckpointError

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the driver forks its training processes (POSIX)")

DRIVER = Path(__file__).with_name("_crash_driver.py")
ADAPTER = "bot"
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"How do I change setting number {i}?"},
                  {"role": "assistant", "content": f"Open Settings, pick page {i}, then press Save."}]}
    for i in range(10)
]  # fmt: skip
EPOCHS = 2
TOTAL = EPOCHS * len(CONVERSATIONS)  # 20 steps: checkpoints 1..19 (none at the final step)
LINE_TIMEOUT = 120.0  # seconds to wait for one protocol line (generous for a loaded CI machine)


class Zygote:
    """The driver's preloaded parent: forks one training process per submitted spec."""

    def __init__(self, tmp_path: Path):
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.stderr_path = tmp_path / "driver.stderr"
        self._stderr = self.stderr_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            cwd=tmp_path,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.child: int | None = None  # the running child, until the zygote reports its exit
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.expect("READY")

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put(raw.decode().rstrip("\n"))
        self.lines.put(None)

    def _fail(self, why: str):
        pytest.fail(f"{why}\n--- driver stderr ---\n{self.stderr_path.read_text(errors='replace')[-6000:]}")

    def next_line(self) -> str:
        try:
            line = self.lines.get(timeout=LINE_TIMEOUT)
        except queue.Empty:
            self._fail(f"no line from the driver in {LINE_TIMEOUT:g} s")
        if line is None:
            self._fail("the driver exited")
        return line

    def expect(self, prefix: str) -> str:
        line = self.next_line()
        if not line.startswith(prefix):
            self._fail(f"expected {prefix!r} from the driver, got {line!r}")
        return line

    def submit(self, spec: dict) -> int:
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()
        self.child = int(self.expect("PID").split()[1])
        return self.child

    def close(self) -> None:
        if self.child is not None:  # a failed test may leave a child paused in a publication
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signal.SIGKILL)
        self.proc.stdin.close()  # the zygote's loop ends: it exits
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(timeout=30)
        self.proc.stdout.close()
        self._stderr.close()


@dataclass
class Run:
    """One child: every protocol line it printed, until the zygote reaped it."""

    pid: int
    lines: list[str] = field(default_factory=list)
    exit_code: int | None = None

    def follow(self, zygote: Zygote, until) -> str | None:
        """Read lines until ``until(line)`` holds (returned) or the child exits (None)."""
        while True:
            line = zygote.next_line()
            if line.startswith("EXIT "):
                _, pid, code = line.split()
                assert int(pid) == self.pid, line
                self.exit_code = int(code)
                zygote.child = None
                return None
            self.lines.append(line)
            if until(line):
                return line

    def published_steps(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("PUBLISHED ")]


def _spec(tmp_path, model, registry, config, *, resume=None, pause=None, result="result.json"):
    return {
        "model": str(model),
        "registry": str(registry),
        "data": str(tmp_path / "data.jsonl"),
        "adapter": ADAPTER,
        "config": config,
        "resume": resume,
        "result": str(tmp_path / result),
        "pause": pause,
    }


def _run_to_completion(zygote: Zygote, spec: dict) -> tuple[Run, dict]:
    run = Run(zygote.submit(spec))
    run.follow(zygote, lambda line: False)
    if run.exit_code != 0:
        zygote._fail(f"run {run.pid} exited with {run.exit_code}; lines: {run.lines}")
    assert run.lines[-1] == "DONE", run.lines
    return run, json.loads(Path(spec["result"]).read_text())


def _state_of(checkpoint) -> tuple[dict, dict]:
    manifest = {k: v for k, v in checkpoint.manifest.items() if k != "created_at"}
    return manifest, checkpoint.blobs


def _check_registry(registry: Path, reference: dict[int, tuple[dict, dict]]) -> tuple[int, set[str]]:
    """The invariants after a crash; returns the newest step (0: none) and the staging dirs."""
    listed = list_checkpoints(registry, ADAPTER)
    assert [c.path for c in list_checkpoints(registry)] == [c.path for c in listed]
    steps = [c.global_step for c in listed]
    assert steps == list(range(1, len(listed) + 1)), f"checkpoints lost or skipped: {steps}"
    for entry in listed:
        assert entry.error is None, f"{entry.path.name} is listed but does not validate: {entry.error}"
        assert parse_checkpoint_name(entry.path.name) == (ADAPTER, entry.global_step)
        loaded = load_checkpoint(entry.path)  # the full load: sizes, SHA-256, loop state
        assert loaded.loop_state["global_step"] == entry.global_step
        manifest, blobs = _state_of(loaded)
        assert blobs == reference[entry.global_step][1], f"{entry.path.name} differs from run A's state"
        assert manifest == reference[entry.global_step][0], f"{entry.path.name}'s manifest differs from run A's"

    orphans = set()
    staging = {p.name for p in orphaned_staging_dirs(registry)}
    # The run's request log (docs/lineage.md) is the one other hidden entry a crashed run may leave.
    request_log = pending_log(registry, ADAPTER).name
    for entry in sorted(registry.iterdir()) if registry.exists() else []:
        if entry.name == request_log:
            assert entry.is_file(), f"{entry.name} is not the run's request log"
            continue
        if entry.name.startswith(f".{request_log}.") and entry.name.endswith(".tmp"):
            # a kill inside the request log's atomic rewrite (kiln.host.fs) leaves its temporary file: hidden, never
            # read, and the log itself is the previous complete one
            assert entry.is_file(), f"{entry.name} is not a temporary file"
            continue
        if entry.name.startswith("."):
            assert entry.name in staging, f"unexpected hidden entry {entry.name}"
            assert ".incomplete-" in entry.name
            assert parse_checkpoint_name(entry.name) is None
            with pytest.raises(CheckpointError):
                load_checkpoint(entry)
            orphans.add(entry.name)
        else:
            assert entry in {c.path for c in listed}, f"{entry.name} is neither a checkpoint nor staging"
    latest = latest_checkpoint(registry, ADAPTER)
    if listed:
        assert latest is not None
        assert latest["resume_checkpoint"] == listed[-1].path.name
        assert latest["global_step"] == len(listed)
    else:
        assert latest is None
    return len(listed), orphans


def _kill_plan(rng: random.Random, ops: list[str], pauses: int, timed: int) -> list[tuple]:
    """Pauses at file-system calls of a publication, and random timed kills.

    ``ops`` are the calls one publication makes. The first kill stops a fresh run in its
    first publication, before the rename: no checkpoint exists, so the next run starts
    fresh, and its step-1 checkpoint is later published beside the orphaned staging
    directory of the same name. The pauses always include the moment before the rename
    (a complete staging directory) and the one after it (canonical, registry not yet
    fsynced); the rest are drawn at random.
    """
    rename = len(ops) - ops[::-1].index("rename" if "rename" in ops else "replace")  # 1-based
    first = rng.randint(1, rename)
    must = {rename, rename + 1}
    drawn = rng.sample(sorted(set(range(1, len(ops) + 1)) - must - {first}), pauses - 1 - len(must))
    points = [("pause", rng.choice([1, 1, 2]), event) for event in sorted(must | set(drawn))]
    timers = [("timer", rng.choice([0, 1, 1, 2]), rng.uniform(0.0, 0.06)) for _ in range(timed)]
    rest = points + timers
    rng.shuffle(rest)
    return [("pause", 1, first), *rest]


@pytest.mark.parametrize(
    ("optimizer", "learning_rate", "paused_kills", "timed_kills", "seed"),
    [("adam_w", 0.01, 12, 8, 20240), ("muon", 0.02, 6, 3, 20241)],
)
def test_sigkill_at_random_points_never_leaves_a_bad_checkpoint_and_resume_reproduces_the_run(
    tmp_path, tiny_model_dir, optimizer, learning_rate, paused_kills, timed_kills, seed
):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS), encoding="utf-8")
    config = {
        "epochs": EPOCHS,
        "seed": 11,
        "checkpoint_interval": 1,
        "optimizer": {"kind": optimizer},
        "learning_rate": learning_rate,
    }
    rng = random.Random(seed)
    zygote = Zygote(tmp_path)
    try:
        # Run A, uninterrupted; its checkpoints are the reference for every crashed one.
        run_a, a = _run_to_completion(zygote, _spec(tmp_path, tiny_model_dir, tmp_path / "a", config, result="a.json"))
        assert a["status"] == "success"
        assert len(a["losses"]) == TOTAL
        assert run_a.published_steps() == list(range(1, TOTAL))
        calls = [line.split()[3].split(",") for line in run_a.lines if line.startswith("PUBLISHED ")]
        ops = calls[0]  # the file-system calls of one publication (fsyncs on worker threads may reorder)
        assert all(sorted(c) == sorted(ops) for c in calls), f"publications made different calls: {calls}"
        renames = [i for i, op in enumerate(ops) if op in ("rename", "replace")]
        assert len(renames) == 1, f"one atomic rename publishes the checkpoint: {ops}"
        assert "fsync" in ops[renames[0] + 1 :], f"the registry is fsynced after the rename: {ops}"
        assert {"mkdir", "open", "write", "fsync", "unlink"} <= set(ops[: renames[0]]), ops
        reference = {c.global_step: _state_of(load_checkpoint(c.path)) for c in list_checkpoints(tmp_path / "a")}
        assert sorted(reference) == list(range(1, TOTAL))

        registry = tmp_path / "b"
        newest, orphans = 0, set()
        log = []
        for plan in _kill_plan(rng, ops, paused_kills, timed_kills):
            kind, first, second = plan
            needed = first if kind == "pause" else first + 4  # steps this kill may publish, with margin
            if newest + needed >= TOTAL - 1:
                continue  # it could finish the run: skip it
            resume = f"{ADAPTER}-checkpoint-step-{newest:08d}.kiln-checkpoint" if newest else None
            spec = _spec(tmp_path, tiny_model_dir, registry, config, resume=resume)
            if kind == "pause":
                spec["pause"] = [first, second]
                run = Run(zygote.submit(spec))
                hit = run.follow(zygote, lambda line, p=f"PAUSE {first} {second} ": line.startswith(p))
            else:
                run = Run(zygote.submit(spec))
                anchor = f"STEP {newest + first}" if first else "ADMITTED"
                hit = run.follow(zygote, lambda line, a=anchor: line == a)
                if hit is not None:
                    time.sleep(second)
            if hit is None:
                zygote._fail(f"run {run.pid} ({plan}) ended with exit {run.exit_code} before its kill: {run.lines}")
            os.kill(run.pid, signal.SIGKILL)  # our own child, which the zygote has not reaped yet
            run.follow(zygote, lambda line: False)
            assert run.exit_code == -signal.SIGKILL, f"run {run.pid} exited with {run.exit_code}: {run.lines}"

            before = newest
            newest, now = _check_registry(registry, reference)
            assert newest >= before, "a published checkpoint disappeared"
            last = run.lines[-1]
            # A kill between the rename and the end of publish_checkpoint keeps that checkpoint too.
            renamed = newest - before - len(run.published_steps())
            assert renamed in (0, 1), (plan, before, newest, run.lines)
            assert not renamed or last == f"STEP {newest}" or last.startswith("PAUSE "), (plan, newest, run.lines)
            log.append(
                {
                    "plan": plan if kind == "timer" else [*plan, last.split()[3]],
                    "resumed_from": before,
                    "newest": newest,
                    "orphan": bool(now - orphans),
                    "in_publication": last.startswith(("STEP ", "PAUSE ")) and last != f"STEP {TOTAL}",
                }
            )
            orphans = now
            assert not (registry / ADAPTER).exists(), "a killed run published its adapter"

        assert len(log) >= paused_kills, log
        assert any(entry["orphan"] for entry in log if entry["plan"][0] == "pause")

        # The last resume runs to completion and reproduces run A exactly.
        assert newest > 0
        resume = f"{ADAPTER}-checkpoint-step-{newest:08d}.kiln-checkpoint"
        _, b = _run_to_completion(zygote, _spec(tmp_path, tiny_model_dir, registry, config, resume=resume))
    finally:
        zygote.close()
    assert b["status"] == "success", b["failure"]
    assert b["resumed_from"] == resume
    assert b["losses"] == a["losses"]
    assert b["loop_state"] == a["loop_state"]
    assert b["adapter_sha256"] == a["adapter_sha256"]
    assert b["optimizer_sha256"] == a["optimizer_sha256"]
    assert a["optimizer_sha256"] is not None
    assert b["published_adapter_sha256"] == a["published_adapter_sha256"]
    assert [parse_checkpoint_name(name)[1] for name in b["checkpoints"]] == list(range(newest + 1, TOTAL))
    final = list_checkpoints(registry, ADAPTER)
    assert [c.global_step for c in final] == list(range(1, TOTAL))
    assert all(_state_of(load_checkpoint(c.path)) == reference[c.global_step] for c in final)
    orphans = orphaned_staging_dirs(registry)
    assert any(o.name.startswith(f".{ADAPTER}-checkpoint-step-00000001.kiln-checkpoint.incomplete-") for o in orphans)
    assert sorted(p.name for p in registry.iterdir() if not p.name.startswith(".")) == sorted(
        [ADAPTER, *(c.path.name for c in final)]
    )
    in_publication = sum(e["in_publication"] for e in log)
    staged = sum(e["orphan"] for e in log)
    print(
        f"\n{optimizer}: {len(log)} kills, {in_publication} inside publish_checkpoint, {staged} left a staging dir",
        *(json.dumps(e) for e in log),
        sep="\n  ",
    )
