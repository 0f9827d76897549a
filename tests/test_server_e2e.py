"""End to end over loopback against a real ``kiln serve`` process.

Submit SFT with a checkpoint interval, watch progress, cancel, resume through the HTTP
``resume_checkpoint`` field and finish; the resumed adapter equals an uninterrupted run's.
Restart the server mid-queue and find the jobs intact. Several clients submit at once
against a small queue bound: each submission is either queued or refused with 503 and
``Retry-After``, and nothing accepted is lost. Every body validates against Kiln's
schemas.
"""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import threading

import pytest
from _server import ServerProcess, wait_for
from conftest import ADAPTER_CONVERSATIONS

from kiln import contracts

pytestmark = pytest.mark.slow

ROWS = ADAPTER_CONVERSATIONS * 2  # 4 conversations


def _valid(definition: str, body):
    problems = contracts.problems(definition, body)
    assert problems == [], f"{definition}: {problems}"
    return body


def _submit(http, config, examples=ROWS):
    answer = http.post("/v1/train/sft", json={"examples": examples, "config": config})
    assert answer.status_code == 200, answer.text
    return _valid("TrainingResponse", answer.json())


def _detail(http, job_id):
    answer = http.get(f"/v1/train/jobs/{job_id}")
    assert answer.status_code == 200, answer.text
    return _valid("TrainingJobDetail", answer.json())


def _finished(http, job_id):
    return wait_for(lambda: (d := _detail(http, job_id))["state"] in ("completed", "failed") and d, timeout=300)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    with ServerProcess(tmp_path_factory.mktemp("serve") / "home", tiny_model_dir) as proc:
        yield proc


def test_cancel_then_resume_over_http_equals_an_uninterrupted_run(server):
    config = {"epochs": 30, "seed": 11, "checkpoint_interval": 3, "auto_load": False}
    with server.client() as http:
        first = _submit(http, {**config, "output_name": "interrupted"})
        assert first["effective_seed"] == "11"
        seen = wait_for(lambda: (d := _detail(http, first["job_id"]))["progress"] > 0.05 and d)
        assert seen["state"] == "running"
        assert seen["current_loss"] is not None
        cancel = http.delete(f"/v1/train/queue/{first['job_id']}")
        assert cancel.status_code == 200
        assert _valid("CancelTrainingJobResponse", cancel.json())["status"] == "cancelling"
        stopped = _finished(http, first["job_id"])
        assert stopped["state"] == "failed"
        assert stopped["error"].startswith("cancelled:")
        checkpoint = stopped["latest_checkpoint"]
        assert checkpoint is not None
        assert 0 < checkpoint["global_step"] < checkpoint["total_steps"]
        assert stopped["train_receipt"]["failure_reason"] == "cancelled"

        resumed = _submit(
            http, {**config, "output_name": "interrupted", "resume_checkpoint": checkpoint["resume_checkpoint"]}
        )
        early = _detail(http, resumed["job_id"])
        assert len(early["loss_history"]) >= checkpoint["global_step"]  # the curve is restored from the checkpoint
        done = _finished(http, resumed["job_id"])
        assert done["state"] == "completed", done.get("error")
        assert done["train_receipt"]["status"] == "success"

        straight = _finished(http, _submit(http, {**config, "output_name": "straight"})["job_id"])
        assert straight["state"] == "completed"
        a = (server.home / "adapters" / "interrupted" / "adapter_model.safetensors").read_bytes()
        b = (server.home / "adapters" / "straight" / "adapter_model.safetensors").read_bytes()
        assert a == b


def test_bad_submissions_get_the_error_envelope_with_the_schema_status(server):
    with server.client() as http:
        cases = [
            ({"examples": ROWS, "config": {"batch_size": 4}}, 400, "unknown_field"),
            ({"config": {}}, 400, None),
            (
                {"examples": ROWS, "config": {"resume_checkpoint": "nope-checkpoint-step-00000001.kiln-checkpoint"}},
                400,
                None,
            ),
            ({"examples": ROWS, "dataset": "hub/thing"}, 400, None),
            ({"dataset_path": "relative/file.jsonl"}, 400, "unsafe_path"),
        ]
        for body, status, code in cases:
            answer = http.post("/v1/train/sft", json=body)
            assert answer.status_code == status, (body, answer.text)
            envelope = _valid("ErrorEnvelope", answer.json())
            if code:
                assert envelope["error"]["code"] == code
        broken = http.post("/v1/train/sft", content=b'{"examples": [], "examples": []}')
        assert broken.status_code == 400
        assert broken.json()["error"]["code"] == "invalid_json"
        missing = http.get("/v1/train/jobs/job-does-not-exist")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "not_found"
        assert http.get("/v1/no/such/route").json()["error"]["code"] == "not_found"


def test_observability_bodies_validate(server):
    with server.client() as http:
        health = http.get("/health")
        assert health.status_code == 200
        body = _valid("HealthResponse", health.json())
        assert body["status"] == "ok"
        assert body["model_source"] == "local_path"
        config = _valid("ConfigResponse", http.get("/v1/config").json())
        assert config["effective_config"]["server"]["port"] == server.port
        assert config["fields"]["server.port"]["source"] == "command_line"
        assert body["execution_identity"]["effective_server_config_sha256"] == config["effective_server_config_sha256"]
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert "kiln_queue_depth" in metrics.text
        assert http.get("/openapi.json").json() == json.loads(
            json.dumps(__import__("kiln_contracts").openapi_document())
        )
        _valid("QueueResponse", http.get("/v1/train/queue").json())
        _valid("TrainingStatusList", http.get("/v1/train/status").json())
        _valid("AdaptersResponse", http.get("/v1/adapters").json())


def test_restart_mid_queue_keeps_every_job(tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    long = {"epochs": 200, "seed": 3, "checkpoint_interval": 2, "auto_load": False}
    proc = ServerProcess(home, tiny_model_dir).start()
    try:
        with proc.client() as http:
            running = _submit(http, {**long, "output_name": "first"})["job_id"]
            waiting = [_submit(http, {"epochs": 1, "seed": 5, "output_name": f"next{i}"})["job_id"] for i in range(2)]
            wait_for(lambda: _detail(http, running)["progress"] > 0.01)
            wait_for(lambda: _detail(http, running)["latest_checkpoint"] is not None)
    finally:
        proc.kill()
    proc = ServerProcess(home, tiny_model_dir, port=proc.port).start()
    try:
        with proc.client() as http:
            interrupted = _detail(http, running)
            assert interrupted["state"] == "failed"
            assert interrupted["error"].startswith("interrupted:")
            assert interrupted["latest_checkpoint"]["resume_checkpoint"].startswith("first-checkpoint-step-")
            for job_id in waiting:
                assert _finished(http, job_id)["state"] == "completed"
            listed = [s["job_id"] for s in http.get("/v1/train/status").json()]
            assert listed == [running, *waiting]
    finally:
        proc.stop()


def test_concurrent_clients_respect_the_queue_bound_and_lose_nothing(tmp_path, tiny_model_dir):
    env = {"KILN_TRAINING_MAX_QUEUED_JOBS": "3"}
    with ServerProcess(tmp_path / "home", tiny_model_dir, env=env) as proc, proc.client() as http:
        blocker = _submit(http, {"epochs": 300, "seed": 1, "output_name": "blocker", "auto_load": False})["job_id"]
        wait_for(lambda: _detail(http, blocker)["state"] == "running")

        def submit(i):
            with proc.client() as own:
                return own.post(
                    "/v1/train/sft", json={"examples": ROWS, "config": {"epochs": 1, "output_name": f"c{i}"}}
                )

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(submit, range(8)))
        accepted = [a.json()["job_id"] for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code != 200]
        assert len(accepted) == 3
        for answer in refused:
            assert answer.status_code == 503
            assert answer.headers["retry-after"] == "30"
            assert answer.json()["error"]["code"] == "queue_full"
        queue = _valid("QueueResponse", http.get("/v1/train/queue").json())
        assert {q["job_id"] for q in queue["queued"]} == set(accepted)
        assert [q["position"] for q in queue["queued"]] == [1, 2, 3]
        http.delete(f"/v1/train/queue/{blocker}")
        for job_id in accepted:
            assert _finished(http, job_id)["state"] == "completed"


def test_api_key_body_bound_and_terminal_webhook(tmp_path, tiny_model_dir):
    received: list[dict] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    env = {
        "KILN_API_KEY": "k-123",
        "KILN_SERVER_MAX_REQUEST_BYTES": "2048",
        "KILN_TRAINING_WEBHOOK_URL": f"http://127.0.0.1:{hook.server_address[1]}/done",
    }
    try:
        with ServerProcess(tmp_path / "home", tiny_model_dir, env=env) as proc:
            with proc.client() as anonymous:
                assert anonymous.get("/health").status_code == 200  # open: load balancers probe it
                refused = anonymous.get("/v1/train/status")
                assert refused.status_code == 401
                assert refused.json()["error"]["code"] == "unauthorized"
                assert anonymous.get("/v1/train/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
            with proc.client(headers={"Authorization": "Bearer k-123"}) as http_:
                big = {"examples": ROWS * 40, "config": {"epochs": 1}}
                too_large = http_.post("/v1/train/sft", json=big)
                assert too_large.status_code == 413
                assert too_large.json()["error"]["code"] == "payload_too_large"
                job = _submit(http_, {"epochs": 1, "seed": 2, "output_name": "hooked", "auto_load": False}, ROWS[:1])
                assert _finished(http_, job["job_id"])["state"] == "completed"
                wait_for(lambda: received)
                assert received[0]["event"] == "training_job.terminal"
                assert _valid("TrainingStatus", received[0]["job"])["job_id"] == job["job_id"]
                config = http_.get("/v1/config").json()
                assert config["effective_config"]["server"]["api_key"] == "<redacted-present>"
    finally:
        hook.shutdown()
        hook.server_close()


def test_a_dataset_changed_while_queued_fails_at_dequeue_naming_the_change(server, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    with server.client() as http:
        blocker = _submit(http, {"epochs": 300, "seed": 4, "output_name": "blocker-reval", "auto_load": False})
        wait_for(lambda: _detail(http, blocker["job_id"])["state"] == "running")
        answer = http.post(
            "/v1/train/sft", json={"dataset_path": str(data), "config": {"epochs": 1, "output_name": "reval"}}
        )
        assert answer.status_code == 200, answer.text
        queued = answer.json()["job_id"]
        data.write_text("".join(json.dumps(r) + "\n" for r in reversed(ROWS[:3])), encoding="utf-8")
        http.delete(f"/v1/train/queue/{blocker['job_id']}")
        failed = _finished(http, queued)
        assert failed["state"] == "failed"
        assert failed["error"].startswith("revalidation_failed:")
        assert "the training data" in failed["error"]
        assert not (server.home / "adapters" / "reval").exists()  # nothing was trained or written


GRPO_GROUP = {
    "messages": [{"role": "user", "content": "Is the sky blue?"}],
    "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}],
}


def test_grpo_jobs_train_and_dry_run_over_http(server, tmp_path):
    data = tmp_path / "groups.jsonl"
    data.write_text((json.dumps(GRPO_GROUP) + "\n") * 3, encoding="utf-8")
    with server.client() as http:
        trained = http.post(
            "/v1/train/grpo", json={"groups": [GRPO_GROUP] * 2, "config": {"seed": 9, "output_name": "rl-bot"}}
        )
        assert trained.status_code == 200, trained.text
        done = _finished(http, _valid("TrainingResponse", trained.json())["job_id"])
        assert done["state"] == "completed", done.get("error")
        assert done["job_type"] == "grpo"
        assert done["train_receipt"]["grpo"]["policy_audit"]["importance_sampling"]["ratio_scope"] == "token"
        dry = http.post(
            "/v1/train/grpo", json={"dataset_path": str(data), "dry_run": True, "config": {"output_name": "rl-dry"}}
        )
        assert dry.status_code == 200, dry.text
        checked = _finished(http, dry.json()["job_id"])
        assert checked["state"] == "completed", checked.get("error")
        assert checked["train_receipt"]["training_data"]["source"] == "jsonl_grpo_groups_dry_run"
        assert checked["adapter_path"] is None
        checkpointed = http.post(
            "/v1/train/grpo",
            json={"groups": [GRPO_GROUP] * 3, "config": {"checkpoint_interval": 1, "output_name": "rl-ckpt"}},
        )
        assert checkpointed.status_code == 200, checkpointed.text
        detail = _finished(http, checkpointed.json()["job_id"])
        assert detail["state"] == "completed", detail.get("error")
        assert detail["latest_checkpoint"]["training_kind"] == "grpo"
        assert detail["latest_checkpoint"]["global_step"] == 2


def test_a_grpo_job_cancelled_over_http_resumes_over_http_to_the_bytes_of_an_uninterrupted_run(server, tmp_path):
    """The replay request of a resumed GRPO job keeps its resume_checkpoint, so revalidation at dequeue admits the
    same resumed run (it once dropped it, and every GRPO resume over HTTP ended revalidation_failed)."""
    data = tmp_path / "groups.jsonl"
    groups = [{**GRPO_GROUP, "completions": [{"text": "yes", "reward": 1.0}, {"text": f"no {i}", "reward": 0.0}]}
              for i in range(120)]  # fmt: skip
    data.write_text("".join(json.dumps(g) + "\n" for g in groups), encoding="utf-8")
    config = {"seed": 5, "checkpoint_interval": 4, "auto_load": False}

    def submit(extra):
        answer = http.post("/v1/train/grpo", json={"dataset_path": str(data), "config": {**config, **extra}})
        assert answer.status_code == 200, answer.text
        return _valid("TrainingResponse", answer.json())["job_id"]

    with server.client() as http:
        first = submit({"output_name": "rl-resumed"})
        wait_for(lambda: (d := _detail(http, first))["state"] == "running" and d["latest_checkpoint"] is not None)
        assert http.delete(f"/v1/train/queue/{first}").status_code == 200
        stopped = _finished(http, first)
        assert stopped["state"] == "failed"
        assert stopped["error"].startswith("cancelled:")
        checkpoint = stopped["latest_checkpoint"]["resume_checkpoint"]
        resumed = submit({"output_name": "rl-resumed", "resume_checkpoint": checkpoint})
        assert _detail(http, resumed)["replay_request"]["config"]["resume_checkpoint"] == checkpoint
        done = _finished(http, resumed)
        assert done["state"] == "completed", done.get("error")
        straight = _finished(http, submit({"output_name": "rl-straight"}))
        assert straight["state"] == "completed", straight.get("error")
    a = (server.home / "adapters" / "rl-resumed" / "adapter_model.safetensors").read_bytes()
    b = (server.home / "adapters" / "rl-straight" / "adapter_model.safetensors").read_bytes()
    assert a == b
