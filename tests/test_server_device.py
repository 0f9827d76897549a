"""The server's device and the serving copy beside a training job: ``kiln serve --device``, ``/health``'s device and
``serving`` state, ``training.serving_copy`` (keep, release, auto) with ``training.while_released`` (unavailable: 503
with Retry-After; cpu: a CPU copy serves), the active adapter kept across a release, and the planner's arithmetic.

Jobs train in a thread of the in-process server; a job is held at its start by an Event (the serving copy is already
released by then: the release runs before the worker), never by a sleep.
"""

from __future__ import annotations

import re
import shutil
import threading
import time

import pytest
import torch

from kiln import contracts
from kiln.errors import CapacityError, RequestError
from kiln.training import (
    MemoryBudget,
    ServingCopy,
    budget_beside_serving_copy,
    serving_copy_bytes_during,
    serving_copy_released,
)

MESSAGES = [{"role": "user", "content": "How do I reset my password?"}]
GREEDY = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
ROWS = [
    {"messages": [{"role": "user", "content": f"How do I open panel {i}?"},
                  {"role": "assistant", "content": f"Press F{i}, then choose Open."}]}
    for i in range(2)
]  # fmt: skip
GIB = 2**30


# ----------------------------------------------------------------------------- the planner's arithmetic


@pytest.mark.parametrize(
    ("policy", "serving", "job", "released"),
    [
        ("auto", "cuda:0", "cuda:0", True),  # one GPU: never two copies
        ("auto", "cuda:0", "cuda:1", False),
        ("auto", "cpu", "cpu", False),  # host memory: auto keeps it
        ("auto", "cuda:0", "cpu", False),
        ("keep", "cuda:0", "cuda:0", False),
        ("release", "cpu", "cpu", True),
        ("release", "cuda:0", "cuda:1", True),
    ],
)
def test_the_release_rule_follows_the_policy_and_the_devices(policy, serving, job, released):
    assert serving_copy_released(policy, serving_device=serving, job_device=job) is released


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError):
        serving_copy_released("sometimes", serving_device="cpu", job_device="cpu")


@pytest.mark.parametrize(
    ("policy", "serving", "job", "taken"),
    [
        ("keep", "cuda:0", "cuda:0", 3 * GIB),  # both copies resident on the job's device
        ("keep", "cuda:0", "cuda:1", 0),  # another device
        ("keep", "cpu", "cpu", 3 * GIB),  # host memory, beside a CPU job
        ("keep", "cpu", "cuda:0", 0),
        ("auto", "cuda:0", "cuda:0", 0),  # released for the job
        ("release", "cpu", "cpu", 0),
    ],
)
def test_the_bytes_taken_by_the_serving_copy_while_the_job_trains(policy, serving, job, taken):
    assert serving_copy_bytes_during(3 * GIB, serving_device=serving, job_device=job, policy=policy) == taken


def test_a_configured_limit_on_the_copys_cuda_device_loses_the_copy_it_cannot_see():
    limit = MemoryBudget(40 * GIB, "configured_limit")
    budget = budget_beside_serving_copy(limit, during=3 * GIB, now=3 * GIB, job_device="cuda:0")
    assert (budget.bytes, budget.source, budget.serving_copy_bytes, budget.moved_by) == (
        37 * GIB,
        "configured_limit",
        3 * GIB,
        -3 * GIB,
    )
    assert "less the 3.00 GiB the server's serving copy keeps on this device" in budget.describe()


def test_a_measured_free_figure_already_excludes_a_resident_copy_that_stays():
    free = MemoryBudget(20 * GIB, "device_memory")
    budget = budget_beside_serving_copy(free, during=3 * GIB, now=3 * GIB, job_device="cuda:0")
    assert (budget.bytes, budget.serving_copy_bytes, budget.moved_by) == (20 * GIB, 3 * GIB, 0)


def test_a_measured_figure_gains_the_copy_that_is_released_for_the_job():
    free = MemoryBudget(20 * GIB, "device_memory")
    budget = budget_beside_serving_copy(free, during=0, now=3 * GIB, job_device="cuda:0")
    assert (budget.bytes, budget.serving_copy_bytes, budget.moved_by) == (23 * GIB, 0, 3 * GIB)
    assert "frees when it is released" in budget.describe()
    host = budget_beside_serving_copy(
        MemoryBudget(8 * GIB, "host_available_memory"), during=0, now=GIB, job_device="cpu"
    )
    assert host.bytes == 9 * GIB


def test_a_copy_released_before_the_figure_was_read_moves_nothing():
    """The worker plans after the release: the free figure it reads already has the room."""
    free = MemoryBudget(23 * GIB, "device_memory")
    assert budget_beside_serving_copy(free, during=0, now=0, job_device="cuda:0").bytes == 23 * GIB


def test_a_configured_limit_on_the_cpu_bounds_the_run_alone_and_no_budget_stays_none():
    limit = MemoryBudget(8 * GIB, "configured_limit")
    assert budget_beside_serving_copy(limit, during=GIB, now=GIB, job_device="cpu").bytes == 8 * GIB
    unknown = budget_beside_serving_copy(MemoryBudget(None, "unknown"), during=GIB, now=GIB, job_device="cpu")
    assert (unknown.bytes, unknown.serving_copy_bytes) == (None, GIB)


def test_a_budget_never_goes_below_zero():
    limit = MemoryBudget(GIB, "configured_limit")
    assert budget_beside_serving_copy(limit, during=3 * GIB, now=3 * GIB, job_device="cuda:0").bytes == 0


def test_the_serving_copy_record_applies_the_rule_for_the_jobs_device():
    kept = ServingCopy(device="cuda:0", bytes=3 * GIB, policy="keep", resident=True)
    assert kept.budget(MemoryBudget(40 * GIB, "configured_limit"), "cuda:0").bytes == 37 * GIB
    assert kept.budget(MemoryBudget(40 * GIB, "configured_limit"), "cuda:1").bytes == 40 * GIB
    released = ServingCopy(device="cuda:0", bytes=3 * GIB, policy="auto", resident=True)
    assert released.released_for("cuda:0")
    assert released.budget(MemoryBudget(20 * GIB, "device_memory"), "cuda:0").bytes == 23 * GIB
    after = ServingCopy(device="cuda:0", bytes=3 * GIB, policy="auto", resident=False)  # the worker, after release
    assert after.budget(MemoryBudget(23 * GIB, "device_memory"), "cuda:0").bytes == 23 * GIB


def test_a_jobs_budget_beside_a_server_counts_the_serving_copy_its_source_cannot_see(monkeypatch, tmp_path):
    """The wiring in admission (``budget_for``): a configured limit on the copy's CUDA device loses a kept copy; the
    device's free memory (which sees it already) does not; a copy released for the job gives its room back."""
    import kiln.model
    from kiln.trainers import TrainingContext
    from kiln.trainers._admission import budget_for
    from kiln.training import MemorySettings

    monkeypatch.setattr(kiln.model, "device_free_bytes", lambda device: 20 * GIB if device.startswith("cuda") else None)

    def budget(limit, policy, device="cuda:0"):
        copy = ServingCopy(device="cuda:0", bytes=3 * GIB, policy=policy, resident=True)
        memory = MemorySettings(memory_limit_bytes=limit, serving_copy=copy)
        return budget_for(TrainingContext(registry=tmp_path, memory=memory), device)

    assert budget(40 * GIB, "keep").bytes == 37 * GIB
    assert budget(None, "keep").bytes == 20 * GIB
    assert budget(None, "auto").bytes == 23 * GIB
    assert budget(40 * GIB, "auto").bytes == 40 * GIB  # released: the limit is the job's alone
    assert budget(40 * GIB, "keep", device="cuda:1").bytes == 40 * GIB
    plain = budget_for(TrainingContext(registry=tmp_path, memory=MemorySettings(memory_limit_bytes=40 * GIB)), "cuda:0")
    assert (plain.bytes, plain.serving_copy_bytes) == (40 * GIB, None)


def test_a_worker_spec_carries_the_serving_copy_into_the_workers_plan(tmp_path, tiny_model_dir):
    from kiln.artifacts.worker_spec import build_worker_spec
    from kiln.jobs.worker import spec_context

    copy = {"device": "cpu", "bytes": 1234, "policy": "keep", "resident": True}
    spec = build_worker_spec(
        kind="sft",
        adapter_name="a",
        request={"examples": ROWS},
        fingerprint={"data_sha256": "sha256:" + "0" * 64, "seed": "1", "checkpoint": None},
        events=None,
        server_pid=1,
        launch={"nproc_per_node": 1, "threads_per_rank": 1},
        registry=tmp_path,
        model_path=tiny_model_dir,
        model_is_default=False,
        teachers_root=None,
        checkpoint_interval=None,
        data_roots=None,
        serving_copy=copy,
    )
    assert spec_context(spec).memory.serving_copy == ServingCopy(device="cpu", bytes=1234, policy="keep", resident=True)


# ----------------------------------------------------------------------------- kiln serve --device


def test_serve_device_is_checked_before_torch_loads(capsys):
    from kiln.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--device", "gpu"])
    assert exit_info.value.code == 2
    assert "'gpu' is not a device; use auto, cpu, cuda or cuda:N" in capsys.readouterr().err


def test_serve_device_sets_the_serving_and_the_training_device(monkeypatch, tmp_path, capsys):
    from kiln.cli import main
    from kiln.server import _app

    seen = []

    def build(settings):
        seen.append(settings)
        raise RequestError("stop here", code="training_backend_unsupported")

    monkeypatch.setattr(_app, "build_server", build)
    assert main(["serve", "--device", "cpu"]) == 1
    [settings] = seen
    assert (settings.model.device, settings.training.device) == ("cpu", "cpu")
    assert settings.origins["model.device"]["source"] == settings.origins["training.device"]["source"] == "command_line"


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusing CUDA needs a machine without it")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_serve_on_a_device_this_machine_lacks_stops_with_the_reason_and_no_traceback(
    monkeypatch, tmp_path, tiny_model_dir, capsys, device
):
    import uvicorn

    from kiln.cli import main

    def never(self, *args, **kwargs):
        raise AssertionError("uvicorn started")

    monkeypatch.setattr(uvicorn.Server, "run", never)
    monkeypatch.setenv("KILN_MODEL_PATH", str(tiny_model_dir))
    assert main(["serve", "--device", device]) == 1
    err = capsys.readouterr().err
    assert (
        f"error [training_backend_unsupported]: model.device: {device} needs a CUDA device, and this machine has none"
        in err
    )
    assert "hint: use --device cpu" in err
    assert "Traceback" not in err
    assert "loading the weights" not in err  # refused before any weight loads


# ----------------------------------------------------------------------------- the serving copy beside a job


class HeldJob:
    """Holds every job the server trains at its start until ``go``: by then the serving copy is released."""

    def __init__(self, monkeypatch):
        from kiln.server import _training

        self.started, self.go = threading.Event(), threading.Event()
        real = _training.run_spec

        def held(*args, **kwargs):
            self.started.set()
            assert self.go.wait(60), "the test never let the job go"
            return real(*args, **kwargs)

        monkeypatch.setattr(_training, "run_spec", held)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir, trained_adapter):
    """An in-process server on the CPU with ``serving_copy = release`` and ``while_released = unavailable``; jobs
    train in a thread; the registry holds ``bot``, which is active."""
    from fastapi.testclient import TestClient

    from kiln.host.config import resolve_settings
    from kiln.server._app import build_server, create_app

    home = tmp_path_factory.mktemp("device") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(home))
        settings = resolve_settings(
            {
                "paths.home": str(home),
                "model.path": str(tiny_model_dir),
                "model.device": "cpu",
                "training.worker": "thread",
                "training.serving_copy": "release",
                "training.while_released": "unavailable",
            }
        )
        settings.registry.mkdir(parents=True)
        shutil.copytree(trained_adapter, settings.registry / "bot")
        server = build_server(settings)
        with TestClient(create_app(server)) as http:
            assert http.post("/v1/adapters/load", json={"name": "bot"}).status_code == 200
            yield server, http


@pytest.fixture
def policy(served):
    """Set the serving copy's policy for one test (the module's server starts with release/unavailable)."""
    serving = served[0].engine.serving
    before = (serving.policy, serving.while_released)

    def set_policy(copy: str, meanwhile: str) -> None:
        serving.policy, serving.while_released = copy, meanwhile

    yield set_policy
    serving.policy, serving.while_released = before


def _health(http) -> dict:
    answer = http.get("/health")
    body = answer.json()
    assert contracts.problems("HealthResponse", body) == [], body
    assert answer.status_code == 200, body
    return body


def _submit(http, name: str) -> str:
    config = {"epochs": 1, "seed": 3, "output_name": name, "auto_load": False}
    answer = http.post("/v1/train/sft", json={"examples": ROWS, "config": config})
    assert answer.status_code == 200, answer.text
    return answer.json()["job_id"]


def _finished(http, job_id: str) -> dict:
    deadline = time.monotonic() + 120
    while (detail := http.get(f"/v1/train/jobs/{job_id}").json())["state"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, detail
        time.sleep(0.02)  # polling the job's state, bounded by the deadline
    return detail


def _chat(http) -> dict:
    answer = http.post("/v1/chat/completions", json=GREEDY)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_the_server_holds_its_copy_on_the_device_it_was_given_and_reports_it(served):
    server, http = served
    body = _health(http)
    assert body["memory"]["device"] == "cpu"
    assert body["memory"]["device_total_bytes"] is None
    assert body["memory"]["device_allocated_bytes"] is None
    assert body["serving"] == "resident"
    assert body["execution_identity"]["device"].startswith("cpu")
    serving = server.engine.serving
    assert (serving.device, serving.policy, serving.while_released) == ("cpu", "release", "unavailable")
    assert serving.bytes == sum(p.numel() * p.element_size() for p in server.generator._model.parameters()) + sum(
        b.numel() * b.element_size() for b in server.generator._model.buffers()
    )
    assert next(server.engine.base.model.parameters()).device.type == "cpu"
    assert server.engine.base.model is not server.generator._model


def test_a_released_copy_answers_503_with_retry_after_and_comes_back_with_its_adapter(served, monkeypatch, capsys):
    server, http = served
    monkeypatch.setattr("kiln.host.progress._enabled", True)  # stage lines on, as under `kiln serve`
    before = _chat(http)
    assert before["kiln"]["adapter"] == "bot"
    held = HeldJob(monkeypatch)
    job_id = _submit(http, "while-released")
    assert held.started.wait(60)

    for route, body in (
        ("/v1/chat/completions", GREEDY),
        ("/v1/chat/completions", {**GREEDY, "stream": True}),
        ("/v1/completions", {"model": "kiln-tiny", "prompt": "Hello", "max_tokens": 2}),
        ("/v1/adapters/load", {"name": "bot", "reload": True}),
    ):
        refused = http.post(route, json=body)
        assert refused.status_code == 503, (route, refused.text)
        assert refused.headers["retry-after"] == "30"
        assert refused.json()["error"]["code"] == "serving_unavailable"
        assert contracts.problems("ErrorEnvelope", refused.json()) == []
    health = _health(http)
    assert (health["serving"], health["status"], health["active_adapter"]) == ("released", "ok", "bot")
    assert http.post("/tokenize", json={"prompt": "Hello"}).status_code == 200  # the tokenizer needs no weights
    assert server.generator._model is None

    held.go.set()
    detail = _finished(http, job_id)
    assert detail["state"] == "completed", detail
    assert detail["train_receipt"]["runtime"]["memory_plan"]["serving_copy_bytes"] == 0  # released for the job
    assert _health(http)["serving"] == "resident"
    after = _chat(http)
    assert after["choices"] == before["choices"]
    assert after["kiln"] == before["kiln"]  # the same adapter, bound to the reloaded copy
    assert _health(http)["active_adapter"] == "bot"
    err = capsys.readouterr().err
    assert "releasing the serving copy (cpu) for a job on cpu: generation answers 503 meanwhile…" in err
    assert re.search(r"^serving copy released in \d+\.\d\d s$", err, re.MULTILINE), err
    assert re.search(r"^serving copy back on cpu in \d+\.\d\d s$", err, re.MULTILINE), err


def test_while_released_cpu_serves_from_a_cpu_copy_during_the_job(served, policy, monkeypatch):
    _, http = served
    policy("release", "cpu")
    before = _chat(http)
    held = HeldJob(monkeypatch)
    job_id = _submit(http, "cpu-meanwhile")
    assert held.started.wait(60)
    assert _health(http)["serving"] == "released"
    during = _chat(http)  # the CPU copy, with the active adapter bound to it
    assert (during["choices"], during["kiln"]) == (before["choices"], before["kiln"])
    held.go.set()
    assert _finished(http, job_id)["state"] == "completed"
    assert _health(http)["serving"] == "resident"
    assert _chat(http)["choices"] == before["choices"]


def test_keep_never_releases_and_the_plan_counts_the_copy_beside_a_cpu_job(served, policy, monkeypatch):
    server, http = served
    policy("keep", "unavailable")
    model = server.generator._model
    held = HeldJob(monkeypatch)
    job_id = _submit(http, "kept")
    assert held.started.wait(60)
    assert _health(http)["serving"] == "resident"
    assert _chat(http)["kiln"]["adapter"] == "bot"
    held.go.set()
    detail = _finished(http, job_id)
    assert detail["state"] == "completed", detail
    plan = detail["train_receipt"]["runtime"]["memory_plan"]
    assert plan["serving_copy_bytes"] == server.engine.serving.bytes  # host memory MemAvailable already counts
    assert server.generator._model is model  # never swapped


def test_a_failed_job_brings_the_copy_back_too(served, monkeypatch):
    server, http = served
    from kiln.server import _training

    def failing(*args, **kwargs):
        assert server.generator._model is None  # released while the job "trains"
        return {"state": "failed", "error": "training_error: injected", "receipt_path": None, "adapter_path": None}

    monkeypatch.setattr(_training, "run_spec", failing)
    detail = _finished(http, _submit(http, "fails"))
    assert detail["state"] == "failed"
    assert _health(http)["serving"] == "resident"
    assert _chat(http)["kiln"]["adapter"] == "bot"


def test_a_stream_still_decoding_after_the_drain_ends_with_the_release_error(served):
    """A request holds the copy until its last chunk; a release that waited ``drain_s`` for it ends it."""
    from kiln.server._openai import chat_chunks
    from kiln.server._serving import reloaded, unavailable

    server, _ = served
    gen = server.generator
    chunks = chat_chunks(gen, {**GREEDY, "max_tokens": 16})
    next(chunks)  # the role chunk: admitted and holding the served copy
    assert gen.swap(None, refusal=unavailable("cpu"), drain_s=0) == 1
    with pytest.raises(CapacityError) as info:
        list(chunks)
    assert info.value.code == "serving_unavailable"
    with pytest.raises(CapacityError):
        gen.hold()
    from kiln.model import load_base_model

    serving = server.engine.serving
    gen.swap(load_base_model(serving.path, is_default=False).model, refusal=reloaded(), drain_s=1)
    assert gen.active()["name"] == "bot"


def test_a_reload_that_fails_leaves_the_copy_released_and_health_degraded_until_the_next_job(served, monkeypatch):
    import kiln.model
    from kiln.server import _training

    _, http = served
    outcome = {"state": "failed", "error": "training_error: injected", "receipt_path": None, "adapter_path": None}
    monkeypatch.setattr(_training, "run_spec", lambda *args, **kwargs: outcome)
    real_load = kiln.model.load_base_model

    def unreadable(*args, **kwargs):
        raise OSError("the model directory went away")

    monkeypatch.setattr(kiln.model, "load_base_model", unreadable)
    assert _finished(http, _submit(http, "reload-fails"))["state"] == "failed"
    answer = http.get("/health")
    body = answer.json()
    assert (answer.status_code, body["status"], body["serving"]) == (503, "degraded", "released")
    [check] = [c for c in body["checks"] if not c["pass"]]
    assert check["name"] == "model_loaded"
    assert check["detail"].endswith("OSError: the model directory went away")
    assert http.post("/v1/chat/completions", json=GREEDY).status_code == 503

    monkeypatch.setattr(kiln.model, "load_base_model", real_load)
    assert _finished(http, _submit(http, "reload-again"))["state"] == "failed"
    assert _health(http)["serving"] == "resident"
    assert _chat(http)["kiln"]["adapter"] == "bot"
