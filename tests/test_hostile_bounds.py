"""Bounds at the door, replayed as a hostile client against a live ``kiln serve`` (127.0.0.1 only).

Every request body is bounded before it is buffered (the declared ``Content-Length``, then the bytes of a
chunked body as they arrive), must be JSON by its content type, and every number a hostile client could
inflate -- inline rows, epochs, the learning rate, total optimizer steps, tokens per row -- is refused at
admission with 400 naming the limit. The job store keeps an inline dataset once: a progress tick writes a few
kilobytes, not the dataset again.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from _server import ServerProcess
from conftest import ADAPTER_CONVERSATIONS

from kiln.server._jobs import Job, JobManager, JobStore, Outcome

DEFAULT_BODY_LIMIT = 8 * 1024 * 1024  # server.max_request_bytes default
MAX_INLINE_ITEMS = 10_000  # examples, groups, agentic_groups, prompts
MAX_EPOCHS = 100_000
MAX_LEARNING_RATE = 1
MAX_TOTAL_STEPS = 1_000_000
TINY_CONTEXT = 4096  # the tiny model's max_position_embeddings: the tokens-per-row limit
LONG_TEXT = "word " * 4000  # well over 4096 tokens with the tiny model's tokenizer

GROUP = {
    "messages": [{"role": "user", "content": "Say yes."}],
    "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}],
}
PROMPT = {"messages": [{"role": "user", "content": "Say yes."}]}
BODIES = {  # one valid minimal body per training route, by kind
    "sft": lambda: {"examples": list(ADAPTER_CONVERSATIONS)},
    "grpo": lambda: {"groups": [GROUP]},
    "opd": lambda: {"teacher": "tutor", "prompts": [PROMPT]},
}
INLINE_FIELD = {"sft": "examples", "grpo": "groups", "opd": "prompts"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    with ServerProcess(tmp_path_factory.mktemp("hostile") / "home", tiny_model_dir) as proc:
        with proc.client() as http:
            teacher = http.post(
                "/v1/teachers", json={"alias": "tutor", "kind": "local", "model_id": str(tiny_model_dir)}
            )
            assert teacher.status_code == 200, teacher.text
        yield proc


def _refused(server, answer) -> dict:
    """The error body of a refusal; an admitted job (the bug) is cancelled so it cannot hold the worker."""
    if answer.status_code == 200:
        with server.client() as http:
            http.delete(f"/v1/train/queue/{answer.json()['job_id']}")
    return answer.json()["error"]


# ----------------------------------------------------------------------------- the body limit


def _raw_exchange(port: int, head: str, chunks: list[bytes] = ()) -> tuple[int, dict]:
    """Send ``head`` and then each of ``chunks`` on one connection, then read the whole answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode("ascii"))
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before we were done: what a bound should do
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer) < _expected_length(answer):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    status_line, _, rest = answer.partition(b"\r\n")
    body = rest.partition(b"\r\n\r\n")[2]
    return int(status_line.split()[1]), json.loads(body)


def _expected_length(answer: bytes) -> int:
    head, _, _ = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(answer) + 1


def test_the_default_body_limit_is_documented_8_mib_and_reported_by_the_config(server):
    with server.client() as http:
        config = http.get("/v1/config").json()
    assert config["effective_config"]["server"]["max_request_bytes"] == DEFAULT_BODY_LIMIT
    assert config["fields"]["server.max_request_bytes"]["source"] == "default"


def test_a_declared_body_over_the_limit_is_refused_413_before_a_byte_of_it_is_sent(server):
    head = (
        "POST /v1/train/sft HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {DEFAULT_BODY_LIMIT + 1}\r\n\r\n"
    )
    status, body = _raw_exchange(server.port, head)
    assert status == 413
    assert body["error"]["code"] == "payload_too_large"
    assert str(DEFAULT_BODY_LIMIT) in body["error"]["message"]


def test_a_chunked_body_is_refused_413_as_soon_as_it_passes_the_limit_without_waiting_for_its_end(server):
    head = (
        "POST /v1/train/sft HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        "Transfer-Encoding: chunked\r\n\r\n"
    )
    piece = b" " * (1024 * 1024)
    count = DEFAULT_BODY_LIMIT // len(piece)
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * count + [b"1\r\n \r\n"]  # limit + 1 bytes, no final chunk
    status, body = _raw_exchange(server.port, head, chunks)
    assert status == 413
    assert body["error"]["code"] == "payload_too_large"


# ----------------------------------------------------------------------------- content types and HEAD


@pytest.mark.parametrize(
    "body", ["null", "3", "true", '"{}"', json.dumps(json.dumps({"examples": ADAPTER_CONVERSATIONS}))]
)
def test_a_json_body_that_is_not_an_object_is_refused_400_on_every_json_route(server, body):
    """A JSON scalar (null, a number, a boolean) or a string -- even one that spells a valid request -- is never
    parsed again nor crashes the door: 400 naming the body's kind."""
    with server.client() as http:
        for route in (
            "/v1/train/sft",
            "/v1/train/grpo",
            "/v1/train/opd",
            "/v1/chat/completions",
            "/v1/completions",
            "/tokenize",
            "/detokenize",
            "/v1/eval/suites",
            "/v1/teachers",
            "/v1/audits",
            "/v1/adapters/load",
        ):
            answer = http.post(route, content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code == 400, (route, body, answer.text)
            assert _refused(server, answer)["code"] in ("wrong_type", "null_not_allowed"), (route, body)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "text/json"])
def test_a_body_that_is_not_declared_json_is_refused_415_on_a_json_route(server, content_type):
    body = json.dumps({"examples": ADAPTER_CONVERSATIONS, "config": {"epochs": 1, "auto_load": False}})
    with server.client() as http:
        for route in ("/v1/train/sft", "/v1/chat/completions"):
            answer = http.post(route, content=body, headers={"Content-Type": content_type})
            assert answer.status_code == 415, (route, answer.text)
            error = _refused(server, answer)
            assert error["code"] == "unsupported_media_type"
            assert "application/json" in error["message"]


def test_json_with_a_charset_a_json_suffix_or_no_content_type_is_accepted(server):
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    with server.client() as http:
        for headers in (
            {"Content-Type": "application/json; charset=utf-8"},
            {"Content-Type": "Application/JSON"},
            {"Content-Type": "application/vnd.openai+json"},
            {},
        ):
            answer = http.post("/v1/chat/completions", content=body, headers=headers)
            assert answer.status_code == 200, (headers, answer.text)


def test_head_health_answers_200_without_a_body(server):
    with server.client() as http:
        answer = http.head("/health")
        assert answer.status_code == 200
        assert answer.content == b""
        assert http.get("/health").status_code == 200


# ----------------------------------------------------------------------------- numeric ranges from the schema


@pytest.mark.parametrize("kind", ["sft", "opd"])
def test_a_billion_epochs_is_refused_400_naming_the_maximum(server, kind):
    with server.client() as http:
        answer = http.post(f"/v1/train/{kind}", json={**BODIES[kind](), "config": {"epochs": 1_000_000_000}})
    assert answer.status_code == 400, answer.text
    error = _refused(server, answer)
    assert error["code"] == "out_of_range"
    assert error["pointer"] == "/config/epochs"
    assert str(MAX_EPOCHS) in error["message"]


@pytest.mark.parametrize("kind", ["sft", "grpo", "opd"])
def test_a_learning_rate_of_1e308_is_refused_400_at_admission(server, kind):
    with server.client() as http:
        answer = http.post(f"/v1/train/{kind}", json={**BODIES[kind](), "config": {"learning_rate": 1e308}})
    assert answer.status_code == 400, answer.text
    error = _refused(server, answer)
    assert error["code"] == "out_of_range"
    assert error["pointer"] == "/config/learning_rate"
    assert "maximum of 1" in error["message"]


@pytest.mark.parametrize("kind", ["sft", "grpo", "opd"])
def test_more_inline_items_than_the_limit_are_refused_400_naming_it(server, kind):
    body = BODIES[kind]()
    field = INLINE_FIELD[kind]
    body[field] = (body[field] * (MAX_INLINE_ITEMS + 1))[: MAX_INLINE_ITEMS + 1]
    with server.client() as http:
        answer = http.post(f"/v1/train/{kind}", json=body)
    assert answer.status_code == 400, answer.text
    error = _refused(server, answer)
    assert error["code"] == "invalid_length"
    assert error["pointer"] == f"/{field}"
    assert str(MAX_INLINE_ITEMS) in error["message"]


# ----------------------------------------------------------------------------- limits that need the data


def test_epochs_times_rows_above_the_total_step_limit_is_refused_400_naming_it(server):
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
        for i in range(20)
    ]
    with server.client() as http:
        answer = http.post("/v1/train/sft", json={"examples": rows, "config": {"epochs": 60_000, "auto_load": False}})
    assert answer.status_code == 400, answer.text
    error = _refused(server, answer)
    assert error["code"] == "training_invalid_request"
    assert "1200000" in error["message"]
    assert str(MAX_TOTAL_STEPS) in error["message"]


@pytest.mark.parametrize("kind", ["sft", "grpo", "opd"])
def test_a_row_longer_than_the_model_context_is_refused_400_naming_the_limit(server, kind):
    body = {
        "sft": {"examples": [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": LONG_TEXT}]}]},
        "grpo": {"groups": [{**GROUP, "completions": [{"text": LONG_TEXT, "reward": 1.0}, {"text": "no", "reward": 0.0}]}]},
        "opd": {"teacher": "tutor", "prompts": [{"messages": [{"role": "user", "content": LONG_TEXT}]}]},
    }[kind]  # fmt: skip
    with server.client() as http:
        answer = http.post(f"/v1/train/{kind}", json={**body, "config": {"auto_load": False}})
    assert answer.status_code == 400, answer.text
    error = _refused(server, answer)
    assert error["code"] == "training_invalid_request"
    assert str(TINY_CONTEXT) in error["message"]
    assert "tokens" in error["message"]


# ----------------------------------------------------------------------------- the job record


def _written() -> int:
    """Bytes this process has handed to write(2) and friends so far (``wchar`` of /proc/self/io)."""
    for line in Path("/proc/self/io").read_text(encoding="ascii").splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def _big_request(tag: str, rows: int = 12_000) -> dict:
    return {
        "examples": [
            {
                "messages": [
                    {"role": "user", "content": f"{tag} question {i}"},
                    {"role": "assistant", "content": "x" * 300},
                ]
            }
            for i in range(rows)
        ],
        "config": {"epochs": 1, "seed": 7, "output_name": tag},
    }


def _job(seq: int, request: dict) -> Job:
    return Job(f"job-{seq}", seq, "sft", request["config"]["output_name"], "7", request, {}, False, 12_000)


@pytest.mark.skipif(not Path("/proc/self/io").is_file(), reason="needs Linux /proc/self/io")
def test_a_progress_tick_writes_a_few_kilobytes_however_big_the_inline_dataset(tmp_path):
    store = JobStore(tmp_path / "jobs.sqlite3")
    job = _job(1, _big_request("big"))
    dataset_bytes = len(json.dumps(job.request["examples"]))
    assert dataset_bytes > 4_000_000
    before = _written()
    store.save(job)  # the submission: the dataset is written once
    submitted = _written() - before
    job.state = "running"
    store.save(job)
    ticks = []
    for step in range(1, 2501):  # past the loss-history limit, so the in-memory curve is thinned on the way
        job.record_loss(1.0 / step, step, job.total_steps, 12_000)
        if step % 10 == 0:
            before = _written()
            store.save(job)
            ticks.append(_written() - before)
    store.close()
    assert submitted >= dataset_bytes  # really on disk, and durable
    # a tick writes the job row and the new loss points: a few pages, never the dataset (nor the whole curve)
    # again; the one tick after the in-memory curve was thinned rewrites its 1,000-odd points once
    assert sorted(ticks)[len(ticks) // 2] < 32 * 1024, ticks
    assert sum(ticks) / len(ticks) < 32 * 1024, ticks
    assert max(ticks) < dataset_bytes / 8, ticks


def test_the_inline_dataset_is_stored_once_and_a_restart_recovers_every_queued_job(tmp_path):
    path = tmp_path / "jobs.sqlite3"
    shared, other = _big_request("shared", 3_000), _big_request("other", 3_000)

    def no_run(job, cancel, report):
        return Outcome("completed")

    manager = JobManager(JobStore(path), max_queued=8, runner=no_run)
    fields = {"job_type": "sft", "effective_seed": "7", "fingerprint": {}, "auto_load": False, "total_steps": 3_000}
    first = manager.submit(**fields, adapter_name="a", request=json.loads(json.dumps(shared)))
    second = manager.submit(**fields, adapter_name="b", request=json.loads(json.dumps(shared)))
    third = manager.submit(**fields, adapter_name="c", request=json.loads(json.dumps(other)))
    fourth = manager.submit(**fields, adapter_name="d", request=json.loads(json.dumps(shared)))
    manager.cancel(third.job_id)
    for step in range(1, 6):
        first.record_loss(0.5, step, 3_000, 3_000)
    manager.store.save(first)
    manager.store.close()
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    datasets = len(json.dumps(shared["examples"])) + len(json.dumps(other["examples"]))
    assert size < 1.3 * datasets  # each dataset once, however many jobs name it
    again = JobManager(JobStore(path), max_queued=8, runner=no_run)
    assert [j.job_id for j in again.queued()] == [first.job_id, second.job_id, fourth.job_id]
    for job in (first, second, fourth):
        assert again.get(job.job_id).request == shared
    assert again.get(third.job_id).request == other
    assert again.get(third.job_id).state == "failed"
    assert [p["loss"] for p in again.get(first.job_id).loss_history] == [0.5] * 5
    assert again.forget(third.job_id) is True
    again.store.close()
    third_again = JobManager(JobStore(path), max_queued=8, runner=no_run)
    assert sorted(third_again.jobs) == sorted([first.job_id, second.job_id, fourth.job_id])
    assert third_again.get(fourth.job_id).request == shared
    third_again.store.close()
