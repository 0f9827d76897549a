"""Training in a worker process: a SIGKILLed worker fails only its job -- the server keeps serving, the queue goes
on, the last checkpoint resumes the job -- and a kill by the kernel's OOM killer is told apart from other deaths."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from _server import ServerProcess, wait_for
from conftest import ADAPTER_CONVERSATIONS

from kiln import contracts
from kiln.jobs.worker import EventReader
from kiln.server._worker_process import classify_exit, oom_kills

ROWS = ADAPTER_CONVERSATIONS * 2


def _submit(http, config):
    answer = http.post("/v1/train/sft", json={"examples": ROWS, "config": config})
    assert answer.status_code == 200, answer.text
    return answer.json()["job_id"]


def _detail(http, job_id):
    answer = http.get(f"/v1/train/jobs/{job_id}")
    assert answer.status_code == 200, answer.text
    assert contracts.problems("TrainingJobDetail", answer.json()) == []
    return answer.json()


def _worker_pids(job_id: str) -> list[int]:
    """Processes running ``python -m kiln.jobs.worker`` on this job's spec."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"kiln.jobs.worker" in words and any(job_id.encode() in w for w in words):
            found.append(int(entry.name))
    return found


@pytest.mark.slow
def test_a_sigkilled_worker_fails_its_job_and_nothing_else(tmp_path, tiny_model_dir):
    config = {"epochs": 40, "seed": 5, "checkpoint_interval": 2, "auto_load": False}
    with ServerProcess(tmp_path / "home", tiny_model_dir) as server, server.client() as http:
        doomed = _submit(http, {**config, "output_name": "doomed"})
        queued = _submit(http, {"epochs": 1, "seed": 6, "output_name": "next", "auto_load": False})
        running = wait_for(
            lambda: (d := _detail(http, doomed))["latest_checkpoint"] is not None and d["state"] == "running" and d,
            timeout=300,
        )
        pids = _worker_pids(doomed)
        assert len(pids) == 1, pids
        assert pids[0] != server.proc.pid  # training is not in the server's process
        os.kill(pids[0], signal.SIGKILL)
        failed = wait_for(lambda: (d := _detail(http, doomed))["state"] == "failed" and d, timeout=120)
        assert failed["error"].startswith("training_error: the training worker"), failed["error"]
        assert "killed by SIGKILL (exit status -9)" in failed["error"]
        checkpoint = failed["latest_checkpoint"]
        assert checkpoint is not None
        assert checkpoint["global_step"] >= running["latest_checkpoint"]["global_step"]
        assert checkpoint["resume_checkpoint"] in failed["error"]  # the message says what resumes it
        # the server is up, the queue went on, and the checkpoint resumes the job
        assert http.get("/health").status_code == 200
        assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "max_tokens": 2}).status_code == 200  # fmt: skip
        nxt = wait_for(lambda: (d := _detail(http, queued))["state"] in ("completed", "failed") and d, timeout=300)
        assert nxt["state"] == "completed", nxt.get("error")
        # the worker trained on all of the server's threads but one (training.worker_threads' default)
        device = nxt["train_receipt"]["runtime"]["execution_provenance"]["backend"]["device"]
        assert device.endswith(f", {max(1, torch.get_num_threads() - 1)} threads)"), device
        resumed = _submit(
            http, {**config, "output_name": "doomed", "resume_checkpoint": checkpoint["resume_checkpoint"]}
        )
        done = wait_for(lambda: (d := _detail(http, resumed))["state"] in ("completed", "failed") and d, timeout=600)
        assert done["state"] == "completed", done.get("error")
        assert done["train_receipt"]["status"] == "success"


@pytest.mark.slow
def test_a_worker_does_not_outlive_its_server(tmp_path, tiny_model_dir):
    server = ServerProcess(tmp_path / "home", tiny_model_dir).start()
    try:
        with server.client() as http:
            job = _submit(http, {"epochs": 40, "seed": 5, "auto_load": False, "output_name": "orphan"})
            assert wait_for(lambda: _detail(http, job)["state"] == "running" and _worker_pids(job), timeout=300)
    finally:
        server.kill()  # a crash: SIGKILL, no shutdown
    assert wait_for(lambda: not _worker_pids(job), timeout=30), "the worker kept training after its server died"


@pytest.mark.slow
def test_thread_mode_trains_in_the_server_process(tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    with ServerProcess(home, tiny_model_dir, env={"KILN_TRAINING_WORKER": "thread"}) as server, server.client() as http:
        assert http.get("/v1/config").json()["effective_config"]["training"]["worker"] == "thread"
        job = _submit(http, {"epochs": 1, "seed": 3, "output_name": "here", "auto_load": False})
        done = wait_for(lambda: (d := _detail(http, job))["state"] in ("completed", "failed") and d, timeout=300)
        assert done["state"] == "completed", done.get("error")
        assert done["train_receipt"]["status"] == "success"
    assert not (home / "server" / "jobs" / job).exists()  # no worker spec, events or log: it never left the server


def test_exits_are_classified_by_how_the_worker_died():
    assert classify_exit(-signal.SIGKILL, 3, 4)[0] == "oom"  # the cgroup's oom_kill count rose: the OOM killer
    category, how = classify_exit(-signal.SIGKILL, 3, 3)
    assert (category, how) == ("training_error", "killed by SIGKILL (exit status -9)")
    assert classify_exit(-signal.SIGKILL, None, None)[0] == "training_error"  # no counter: no claim of OOM
    assert classify_exit(-signal.SIGSEGV, 0, 1) == ("training_error", "killed by SIGSEGV (exit status -11)")
    assert classify_exit(1, 0, 0) == ("training_error", "exited with status 1")
    # torchrun (several ranks) ends with status 1 when a rank died: with the OOM count risen, that was the kernel
    assert classify_exit(1, 0, 1, ranks=2) == (
        "oom",
        "exited with status 1: the kernel's OOM killer ended it (the cgroup's oom_kill count rose)",
    )
    assert classify_exit(1, 0, 0, ranks=2)[0] == "training_error"
    assert classify_exit(1, 0, 1)[0] == "training_error"  # one process exiting 1 was not killed


def test_the_oom_counter_is_read_from_the_cgroup_file(tmp_path):
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 2\noom 1\noom_kill 1\noom_group_kill 0\n")
    assert oom_kills(events) == 1
    events.write_text("oom_kill 7\n")
    assert oom_kills(events) == 7
    assert oom_kills(tmp_path / "absent") is None


def test_the_event_reader_yields_only_complete_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    reader = EventReader(path)
    assert list(reader.read()) == []  # not there yet
    path.write_bytes(b'{"event": "progress", "step": 1}\n{"event": "prog')
    assert list(reader.read()) == [{"event": "progress", "step": 1}]
    with open(path, "ab") as f:
        f.write(b'ress", "step": 2}\n')
    assert list(reader.read()) == [{"event": "progress", "step": 2}]


def _rank_pids(job_id: str) -> dict[int, int]:
    """The ranks torchrun started for this job: local rank -> pid (the worker processes that carry a ``LOCAL_RANK``)."""
    ranks = {}
    for pid in _worker_pids(job_id):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"LOCAL_RANK="):
                ranks[int(entry.split(b"=", 1)[1])] = pid
    return ranks


@pytest.mark.slow
def test_a_server_trains_sft_and_grpo_over_two_ranks_and_survives_a_rank_killed_mid_step(tmp_path, tiny_model_dir):
    env = {"KILN_TRAINING_NPROC_PER_NODE": "2"}
    with ServerProcess(tmp_path / "home", tiny_model_dir, env=env) as server, server.client() as http:
        assert http.get("/v1/config").json()["effective_config"]["training"]["nproc_per_node"] == 2
        short = _submit(http, {"epochs": 1, "seed": 4, "output_name": "pair", "auto_load": False})
        done = wait_for(lambda: (d := _detail(http, short))["state"] in ("completed", "failed") and d, timeout=300)
        assert done["state"] == "completed", done.get("error")
        assert len(done["loss_history"]) == 2  # 4 conversations at 2 a step (micro-batch 1 x 2 ranks)
        plan = {"world_size": 2, "backend": "gloo", "sharding": "kiln.sft-step-round-robin.v1"}
        assert done["train_receipt"]["runtime"]["data_parallel"] == plan
        device = done["train_receipt"]["runtime"]["execution_provenance"]["backend"]["device"]
        assert device.endswith(f", {max(1, max(1, torch.get_num_threads() - 1) // 2)} threads)"), device

        # a GRPO job trains over the same ranks, under its own rule (tests/test_data_parallel_rl.py has the proofs)
        group = {"messages": [{"role": "user", "content": "Is the sky blue?"}],
                 "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}]}  # fmt: skip
        answer = http.post("/v1/train/grpo", json={"groups": [group] * 2, "config": {"seed": 4, "output_name": "rl-pair", "auto_load": False}})  # fmt: skip
        assert answer.status_code == 200, answer.text
        rl = answer.json()["job_id"]
        rl_done = wait_for(lambda: (d := _detail(http, rl))["state"] in ("completed", "failed") and d, timeout=300)
        assert rl_done["state"] == "completed", rl_done.get("error")
        assert rl_done["train_receipt"]["runtime"]["data_parallel"] == {
            **plan,
            "sharding": "kiln.grpo-step-completions.v1",
        }

        config = {"epochs": 60, "seed": 5, "checkpoint_interval": 2, "auto_load": False}
        doomed = _submit(http, {**config, "output_name": "doomed"})
        wait_for(lambda: (d := _detail(http, doomed))["latest_checkpoint"] is not None and d["state"] == "running",
                 timeout=300)  # fmt: skip
        ranks = wait_for(lambda: len(pids := _rank_pids(doomed)) == 2 and pids, timeout=60)
        os.kill(ranks[1], signal.SIGKILL)  # not rank 0, which reports the group's end
        failed = wait_for(lambda: (d := _detail(http, doomed))["state"] == "failed" and d, timeout=300)
        assert "torchrun exited with status 1" in failed["error"], failed["error"]
        checkpoint = failed["latest_checkpoint"]
        assert checkpoint is not None
        assert checkpoint["resume_checkpoint"] in failed["error"]  # the message says what resumes it
        assert wait_for(lambda: not _worker_pids(doomed), timeout=60)  # no rank outlives the group
        assert http.get("/health").status_code == 200
        resumed = _submit(
            http, {**config, "output_name": "doomed", "resume_checkpoint": checkpoint["resume_checkpoint"]}
        )
        finished = wait_for(
            lambda: (d := _detail(http, resumed))["state"] in ("completed", "failed") and d, timeout=600
        )
        assert finished["state"] == "completed", finished.get("error")
