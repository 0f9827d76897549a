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
import os
import shutil
import subprocess
import sys
import threading

import pytest
from _server import ServerProcess, free_port, wait_for
from conftest import ADAPTER_CONVERSATIONS

from kiln import contracts
from kiln.cli import main

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
    # the tests' files live under pytest's temporary directory: a configured data root (<home>/data is the other)
    roots = {"KILN_TRAINING_DATA_ROOTS": str(tmp_path_factory.getbasetemp())}
    with ServerProcess(tmp_path_factory.mktemp("serve") / "home", tiny_model_dir, env=roots) as proc:
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
        served = http.get("/openapi.json").json()
        built = json.loads(json.dumps(__import__("kiln_contracts").openapi_document()))
        bounds = {"TokenId", "TokenIdPrompt"}  # the served model's vocabulary and context fill these in
        assert {k: v for k, v in served["components"]["schemas"].items() if k not in bounds} == {
            k: v for k, v in built["components"]["schemas"].items() if k not in bounds
        }
        assert {k: v for k, v in served.items() if k != "components"} == {
            k: v for k, v in built.items() if k != "components"
        }
        assert served["components"]["schemas"]["TokenId"]["maximum"] >= 1
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
            assert f"{interrupted['latest_checkpoint']['resume_checkpoint']} " in interrupted["error"]
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


OPD_PROMPTS = [
    {"messages": [{"role": "user", "content": "Describe a river."}]},
    {"messages": [{"role": "user", "content": "Describe a hill."}]},
]


def test_an_opd_job_cancelled_over_http_resumes_over_http_to_the_bytes_of_an_uninterrupted_run(server, tmp_path):
    """OPD with a local teacher registered on the server: cancel after the first checkpoint, resume, compare."""
    from kiln.model import create_tiny

    teacher_dir = create_tiny(tmp_path / "teacher-model", seed=2)
    config = {"seed": 3, "samples_per_prompt": 2, "max_tokens": 8, "top_k": 16, "epochs": 30,
              "checkpoint_interval": 3, "auto_load": False}  # fmt: skip

    def submit(extra):
        body = {"teacher": "resume-tutor", "prompts": OPD_PROMPTS, "config": {**config, **extra}}
        answer = http.post("/v1/train/opd", json=body)
        assert answer.status_code == 200, answer.text
        return _valid("TrainingResponse", answer.json())["job_id"]

    with server.client() as http:
        registered = http.post(
            "/v1/teachers", json={"alias": "resume-tutor", "kind": "local", "model_id": str(teacher_dir)}
        )
        assert registered.status_code == 200, registered.text
        first = submit({"output_name": "opd-resumed"})
        wait_for(lambda: (d := _detail(http, first))["state"] == "running" and d["latest_checkpoint"] is not None)
        assert http.delete(f"/v1/train/queue/{first}").status_code == 200
        stopped = _finished(http, first)
        assert stopped["state"] == "failed"
        assert stopped["error"].startswith("cancelled:")
        checkpoint = stopped["latest_checkpoint"]
        assert checkpoint["training_kind"] == "opd"
        assert 0 < checkpoint["global_step"] < checkpoint["total_steps"]
        name = checkpoint["resume_checkpoint"]
        resumed = submit({"output_name": "opd-resumed", "resume_checkpoint": name})
        assert _detail(http, resumed)["replay_request"]["config"]["resume_checkpoint"] == name
        done = _finished(http, resumed)
        assert done["state"] == "completed", done.get("error")
        assert done["train_receipt"]["opd"]["teacher_id"] == "resume-tutor"
        straight = _finished(http, submit({"output_name": "opd-straight"}))
        assert straight["state"] == "completed", straight.get("error")
    a = (server.home / "adapters" / "opd-resumed" / "adapter_model.safetensors").read_bytes()
    b = (server.home / "adapters" / "opd-straight" / "adapter_model.safetensors").read_bytes()
    assert a == b


def _plain_peft_adapter(target, trained_adapter):
    """A plain PEFT directory (config, weights, model card), as peft's save_pretrained leaves it: no Kiln files."""
    target.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy2(trained_adapter / name, target / name)
    (target / "README.md").write_text("# a LoRA adapter saved by peft\n", encoding="utf-8")
    return target


def test_a_plain_peft_adapter_without_a_manifest_is_listed_loaded_and_served(server, trained_adapter):
    plain = _plain_peft_adapter(server.home / "adapters" / "plain-peft", trained_adapter)
    with server.client() as http:
        listed = {a["name"]: a for a in _valid("AdaptersResponse", http.get("/v1/adapters").json())["available"]}
        entry = listed["plain-peft"]
        assert entry["status"] == "available"
        assert (entry["adapter_manifest"], entry["adapter_manifest_error"], entry["error"]) == (None, None, None)
        assert entry["adapter_model_sha256"] is None  # nothing binds the weights; the listing never hashes
        assert entry["canary_status"] == "unknown"  # the canary runs after training, never on a copied directory

        loaded = http.post("/v1/adapters/load", json={"name": "plain-peft"})
        assert loaded.status_code == 200, loaded.text
        body = _valid("LoadAdapterResponse", loaded.json())
        assert body["name"] == "plain-peft"
        listing = _valid("AdaptersResponse", http.get("/v1/adapters").json())
        assert listing["active_adapter"] == "plain-peft"
        answer = http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "How do I reset my password?"}], "max_tokens": 8},
        )
        assert answer.status_code == 200, answer.text
        weights = _valid("ChatCompletionResponse", answer.json())["kiln"]
        assert weights == {"adapter": "plain-peft", "adapter_manifest_sha256": None}
        assert http.post("/v1/adapters/unload").status_code == 200

        # a directory that holds a Kiln receipt is a Kiln publication: without its manifest it is refused
        (plain / "train_receipt.json").write_bytes((trained_adapter / "train_receipt.json").read_bytes())
        refused = http.post("/v1/adapters/load", json={"name": "plain-peft"})
        assert refused.status_code == 400, refused.text
        error = _valid("ErrorEnvelope", refused.json())["error"]
        assert error["code"] == "adapter_invalid"
        assert "adapter_manifest.json is missing" in error["message"]


def test_a_job_interrupted_before_its_first_checkpoint_says_there_is_none_and_what_to_do(tmp_path, tiny_model_dir):
    home = tmp_path / "home"
    proc = ServerProcess(home, tiny_model_dir).start()
    try:
        with proc.client() as http:
            config = {"epochs": 2000, "seed": 3, "checkpoint_interval": 100000, "auto_load": False}
            job = _submit(http, {**config, "output_name": "no-ckpt"})["job_id"]
            wait_for(lambda: _detail(http, job)["progress"] > 0)
    finally:
        proc.kill()
    proc = ServerProcess(home, tiny_model_dir, port=proc.port).start()
    try:
        with proc.client() as http:
            interrupted = _detail(http, job)
    finally:
        proc.stop()
    assert interrupted["state"] == "failed"
    assert interrupted["latest_checkpoint"] is None
    error = interrupted["error"]
    assert error.startswith("interrupted:")
    assert "resumes it" not in error
    assert "no checkpoint" in error
    assert "replay_request" in error  # what to do: submit the admitted request again, from the start


def _sharded_copy(tiny_model_dir, target):
    """The tiny model saved in several safetensors shards with their index, as large checkpoints ship."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(tiny_model_dir, target)
    (target / "model.safetensors").unlink()
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(target, max_shard_size="200KB")
    shards = sorted(target.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    assert (target / "model.safetensors.index.json").is_file()
    return target, shards


@pytest.mark.parametrize("layout", ["sharded", "single"])
def test_a_renamed_weight_shard_stops_serve_and_local_admission_naming_the_missing_file(
    layout, tmp_path, tiny_model_dir, capsys
):
    if layout == "sharded":  # one shard of the index renamed: the others are still there
        model, shards = _sharded_copy(tiny_model_dir, tmp_path / "model")
        missing, renamed = shards[1].name, shards[1].name + ".bak"
    else:  # the one weight file renamed: a *.safetensors file is there, but not the one transformers reads
        model = tmp_path / "model"
        shutil.copytree(tiny_model_dir, model)
        missing, renamed = "model.safetensors", "weights.safetensors"
    (model / missing).rename(model / renamed)

    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    served = subprocess.run(
        [sys.executable, "-m", "kiln.cli", "serve", "--model", str(model), "--port", str(free_port())],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert served.returncode == 1, served.stdout + served.stderr
    assert "Traceback" not in served.stderr
    first = next((line for line in served.stderr.splitlines() if line.startswith("error")), served.stderr)
    assert first.startswith("error [training_invalid_request]: "), served.stderr
    assert missing in first
    assert str(model) in first

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    code = main(["train", "sft", "--local", "-f", str(data), "--adapter", "shard-bot", "--model", str(model)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith("error [training_invalid_request]: ")
    assert missing in err.splitlines()[0]
    assert not (tmp_path / "kiln-home" / "adapters" / "shard-bot").exists()


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_a_schema_valid_tiny_temperature_is_answered_plain_and_streamed(server, route):
    """Any temperature below about 1.2e-38 used to make the sampler see inf/NaN: a 500, and mid-stream a dropped
    connection. It is greedy now, on both routes, streamed or not."""
    body = {"max_tokens": 4, "temperature": 1e-40, "seed": 1}
    body |= (
        {"messages": [{"role": "user", "content": "How do I reset my password?"}]}
        if route.endswith("chat/completions")
        else {"prompt": "How do I reset", "model": "kiln-tiny"}
    )
    with server.client() as http:
        plain = http.post(route, json=body)
        assert plain.status_code == 200, plain.text
        with http.stream("POST", route, json={**body, "stream": True}) as streamed:
            assert streamed.status_code == 200
            lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert all('"error"' not in line for line in lines)


def test_an_audit_job_reproduces_a_served_run_in_a_worker_process_and_can_be_cancelled(server, capsys):
    """``POST /v1/audits``: the run a served job published is re-executed in a worker process and reproduced;
    ``kiln audit NAME --url`` does the same through the SDK; a queued or running audit is cancelled; what cannot be
    audited is refused before it is queued."""
    data = "".join(json.dumps(r) + "\n" for r in ROWS).encode("utf-8")
    config = {"output_name": "audited", "epochs": 3, "checkpoint_interval": 4, "seed": 3, "auto_load": False}
    with server.client() as http:
        uploaded = http.post("/v1/datasets", content=data, headers={"Content-Type": "application/jsonl"})
        assert uploaded.status_code == 200, uploaded.text
        trained = http.post("/v1/train/sft", json={"dataset_path": uploaded.json()["dataset_path"], "config": config})
        assert trained.status_code == 200, trained.text
        assert _finished(http, trained.json()["job_id"])["state"] == "completed"

        queued = http.post("/v1/audits", json={"adapter": "audited"})
        assert queued.status_code == 200, queued.text
        job = _valid("AuditJobDetail", queued.json())
        done = wait_for(
            lambda: (d := http.get(f"/v1/audits/{job['job_id']}").json())["state"] in ("completed", "failed") and d,
            timeout=300,
        )
        _valid("AuditJobDetail", done)
        assert done["state"] == "completed", done.get("error")
        record = done["record"]
        assert record["verdict"] == "reproduced", (record["first_difference"], record["cannot_audit"])
        assert [c["global_step"] for c in record["checkpoints"]] == [4, 8]
        assert [j["job_id"] for j in _valid("AuditJobList", http.get("/v1/audits").json())][-1] == job["job_id"]
        assert http.get(f"/v1/train/jobs/{job['job_id']}").status_code == 404  # an audit is not a training job

        missing = http.post("/v1/audits", json={"adapter": "nobody"})
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "adapter_not_found")
        seedless = http.post("/v1/audits", json={"adapter": "audited", "seed": 4})
        assert (seedless.status_code, seedless.json()["error"]["code"]) == (400, "inconsistent_fields")

        stopped = http.post("/v1/audits", json={"adapter": "audited"}).json()
        cancelled = http.delete(f"/v1/audits/{stopped['job_id']}")
        assert cancelled.status_code == 200, cancelled.text
        final = wait_for(lambda: (d := http.get(f"/v1/audits/{stopped['job_id']}").json())["state"] == "failed" and d)
        assert final["error"].startswith("cancelled")
        assert final["record"] is None

    assert main(["audit", "audited", "--url", server.url, "--segments", "1", "--seed", "2"]) == 0
    assert "✓ reproduced" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("route", "content_type", "status", "code"),
    [
        ("/v1/train/sft", "application/json", 413, "payload_too_large"),  # 9 MiB over the default 8 MiB
        ("/v1/train/sft", "text/csv", 415, "unsupported_media_type"),
        ("/v1/datasets", "text/csv", 415, "unsupported_media_type"),
    ],
)
def test_a_body_refused_from_its_headers_is_answered_to_urllib_not_reset(server, route, content_type, status, code):
    """The server refuses before reading the body; it used to close the socket under a client still sending, so
    urllib saw ConnectionResetError and never the status. Now the refused body is read and dropped first."""
    import urllib.error
    import urllib.request

    data = b"x" * (9 * 1024 * 1024)
    request = urllib.request.Request(
        server.url + route, data=data, method="POST", headers={"Content-Type": content_type}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == status
    assert json.loads(info.value.read())["error"]["code"] == code


def test_a_wrong_method_is_405_with_allow_and_a_name_no_adapter_can_have_is_404(server):
    with server.client() as http:
        wrong = http.delete("/health")
        assert wrong.status_code == 405
        assert "GET" in {m.strip() for m in wrong.headers["allow"].split(",")}
        error = _valid("ErrorEnvelope", wrong.json())["error"]
        assert error["code"] == "method_not_allowed"
        assert "GET" in error["hint"]
        for name in ("team bot!", ".hidden"):
            missing = http.get(f"/v1/adapters/{name}/receipt")
            assert missing.status_code == 404, missing.text
            assert _valid("ErrorEnvelope", missing.json())["error"]["code"] == "adapter_not_found"
