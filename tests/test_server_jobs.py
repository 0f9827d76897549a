"""The job store, the FIFO queue and the worker, without a model: a fake runner trains."""

from __future__ import annotations

import threading

import pytest

from kiln import contracts
from kiln.errors import CapacityError, ConflictError, NotFoundError
from kiln.server._jobs import LOSS_HISTORY_LIMIT, Job, JobManager, JobStore, Outcome


def _fields(name: str, steps: int = 3) -> dict:
    return {
        "job_type": "sft",
        "adapter_name": name,
        "effective_seed": "7",
        "request": {"examples": [], "config": {"epochs": 1}},
        "fingerprint": {},
        "auto_load": False,
        "total_steps": steps,
    }


class FakeRunner:
    """Reports one loss per step; blocks on ``gate`` before each step when given one."""

    def __init__(self, gate: threading.Event | None = None):
        self.ran: list[str] = []
        self.gate = gate

    def __call__(self, job, cancel, report):
        self.ran.append(job.job_id)
        for step in range(1, job.total_steps + 1):
            if self.gate is not None:
                self.gate.wait(10)
            report({"step": step, "total": job.total_steps, "loss": 1.0 / step, "tokens": 10})
            if cancel.is_set():
                return Outcome("failed", f"cancelled: stopped after step {step}")
        return Outcome("completed", None, "/r/train_receipt.json", "/r/adapter")


def _wait(predicate, timeout=10.0):
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_jobs_run_in_submission_order_and_statuses_validate(tmp_path):
    runner = FakeRunner()
    manager = JobManager(JobStore(tmp_path / "jobs.db"), max_queued=8, runner=runner)
    ids = [manager.submit(**_fields(f"a{i}")).job_id for i in range(3)]
    manager.start()
    _wait(lambda: all(manager.get(i).state == "completed" for i in ids))
    manager.stop()
    assert runner.ran == ids
    for job_id in ids:
        status = manager.get(job_id).status()
        assert contracts.problems("TrainingStatus", status) == []
        assert status["progress"] == 1.0
        assert status["current_loss"] == pytest.approx(1 / 3)


def test_a_full_queue_refuses_without_queueing(tmp_path):
    manager = JobManager(JobStore(tmp_path / "jobs.db"), max_queued=2, runner=FakeRunner())
    manager.submit(**_fields("a"))
    manager.submit(**_fields("b"))
    with pytest.raises(CapacityError) as info:
        manager.submit(**_fields("c"))
    assert info.value.code == "queue_full"
    assert [j.adapter_name for j in manager.queued()] == ["a", "b"]


def test_two_active_jobs_cannot_write_the_same_adapter(tmp_path):
    manager = JobManager(JobStore(tmp_path / "jobs.db"), max_queued=8, runner=FakeRunner())
    manager.submit(**_fields("same"))
    with pytest.raises(ConflictError) as info:
        manager.submit(**_fields("same"))
    assert info.value.code == "adapter_exists"


def test_cancelling_a_queued_job_fails_it_at_once_and_it_never_runs(tmp_path):
    gate = threading.Event()
    runner = FakeRunner(gate)
    manager = JobManager(JobStore(tmp_path / "jobs.db"), max_queued=8, runner=runner)
    first = manager.submit(**_fields("a"))
    second = manager.submit(**_fields("b"))
    manager.start()
    _wait(lambda: manager.get(first.job_id).state == "running")
    assert manager.cancel(second.job_id) == "cancelled"
    assert manager.get(second.job_id).state == "failed"
    assert manager.get(second.job_id).error.startswith("cancelled:")
    assert manager.cancel(first.job_id) == "cancelling"
    gate.set()
    _wait(lambda: manager.get(first.job_id).terminal)
    manager.stop()
    assert runner.ran == [first.job_id]
    assert manager.get(first.job_id).error.startswith("cancelled:")
    with pytest.raises(NotFoundError):
        manager.cancel(first.job_id)


def test_a_restart_keeps_queued_jobs_and_fails_the_interrupted_one(tmp_path):
    store = tmp_path / "jobs.db"
    gate = threading.Event()
    first_runner = FakeRunner(gate)
    manager = JobManager(JobStore(store), max_queued=8, runner=first_runner)
    running = manager.submit(**_fields("a"))
    waiting = manager.submit(**_fields("b"))
    manager.start()
    _wait(lambda: first_runner.ran)  # the runner starts only after the `running` row is written
    # the process "dies" here: a second manager reads the same store
    again = JobManager(JobStore(store), max_queued=8, runner=FakeRunner())
    assert again.get(running.job_id).state == "failed"
    assert again.get(running.job_id).error.startswith("interrupted:")
    assert [j.job_id for j in again.queued()] == [waiting.job_id]
    again.start()
    _wait(lambda: again.get(waiting.job_id).state == "completed")
    again.stop()
    gate.set()
    manager.stop()


def test_only_terminal_jobs_can_be_forgotten(tmp_path):
    manager = JobManager(JobStore(tmp_path / "jobs.db"), max_queued=8, runner=FakeRunner())
    job = manager.submit(**_fields("a"))
    with pytest.raises(ConflictError) as info:
        manager.forget(job.job_id)
    assert info.value.code == "job_not_terminal"
    manager.cancel(job.job_id)
    worker_files = manager.store.job_directory(job.job_id)
    worker_files.mkdir(parents=True)
    (worker_files / "events.jsonl").write_text("{}\n")
    assert manager.forget(job.job_id) is True
    assert not worker_files.exists()  # the worker's spec, events and log go with the job
    with pytest.raises(NotFoundError):
        manager.get(job.job_id)
    assert JobManager(JobStore(tmp_path / "jobs.db"), max_queued=8, runner=FakeRunner()).jobs == {}


def test_a_runner_crash_fails_the_job_and_the_worker_goes_on(tmp_path):
    calls = []

    def runner(job, cancel, report):
        calls.append(job.adapter_name)
        if job.adapter_name == "bad":
            raise RuntimeError("boom")
        return Outcome("completed")

    manager = JobManager(JobStore(tmp_path / "jobs.db"), max_queued=8, runner=runner)
    bad, good = manager.submit(**_fields("bad")), manager.submit(**_fields("good"))
    manager.start()
    _wait(lambda: manager.get(good.job_id).terminal)
    manager.stop()
    assert manager.get(bad.job_id).error == "internal_error: RuntimeError: boom"
    assert manager.get(good.job_id).state == "completed"


def test_long_loss_curves_are_thinned_and_keep_the_newest_point():
    job = Job("j", 1, "sft", "a", "1", {}, {}, False, 100_000)
    for step in range(1, 5001):
        job.record_loss(float(step), step, 100_000, 100_000)
    assert len(job.loss_history) <= LOSS_HISTORY_LIMIT
    assert job.loss_history[-1]["loss"] == 5000.0
    steps = [p["loss"] for p in job.loss_history]
    assert steps == sorted(steps)
