"""Data roots: the server reads a training request's files only where its configuration allows (issue 19, item 4).

Replayed as a hostile client against a live ``kiln serve`` (127.0.0.1 only): a ``dataset_path`` outside
``training.data_roots`` (``<home>/data`` by default) -- ``/etc/passwd``, ``/proc/self/environ``, a symlink inside a
root that points out of it, a path that does not exist -- is refused with 403 ``path_not_allowed`` before the file
is opened, and the refusal names the rule, never the file's content, size, rows, digests or a symlink's target;
a ``base_adapter`` outside the registry is refused the same way, and a missing one at admission. A client's own
file reaches the server through ``POST /v1/datasets`` (content-addressed, streamed to disk, bounded), which the
CLI uses for every ``.jsonl`` it sends.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
from pathlib import Path

import pytest
from _server import ServerProcess, wait_for
from conftest import ADAPTER_CONVERSATIONS

from kiln import contracts
from kiln.cli import main
from kiln.errors import AccessError, RequestError
from kiln.host.fs import within_roots
from kiln.trainers import TrainingContext, check_sources

UPLOAD_LIMIT = 64 * 1024  # the module server's server.max_upload_bytes


def _rows(path: Path, rows=ADAPTER_CONVERSATIONS) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    home = tmp_path_factory.mktemp("roots") / "home"
    with ServerProcess(home, tiny_model_dir, env={"KILN_SERVER_MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT)}) as proc:
        yield proc


def _sft(http, dataset_path: str, name: str, **config):
    return http.post(
        "/v1/train/sft",
        json={"dataset_path": dataset_path, "config": {"epochs": 1, "seed": 5, "output_name": name, **config}},
    )


def _finished(http, job_id: str) -> dict:
    return wait_for(
        lambda: (d := http.get(f"/v1/train/jobs/{job_id}").json())["state"] in ("completed", "failed") and d,
        timeout=300,
    )


# ----------------------------------------------------------------------------- the rule, in process


def test_within_roots_resolves_symlinks_and_never_matches_a_sibling_prefix(tmp_path):
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "data-other").mkdir()
    (root / "out").symlink_to(tmp_path / "data-other")
    assert within_roots(str(root / "sub" / "a.jsonl"), [root])
    assert within_roots(str(root), [root])
    assert not within_roots(str(tmp_path / "data-other" / "a.jsonl"), [root]), "a sibling sharing the prefix"
    assert not within_roots(str(root / "out" / "a.jsonl"), [root]), "a symlink out of the root"
    assert not within_roots(str(root / ".." / "data-other"), [root])
    assert not within_roots("relative/a.jsonl", [root])
    assert within_roots(str(tmp_path / "data-other" / "a.jsonl"), [root, tmp_path / "data-other"])


def test_a_local_run_reads_any_file_but_a_restricted_one_only_inside_its_roots(tmp_path):
    data = _rows(tmp_path / "outside" / "rows.jsonl")
    registry = tmp_path / "adapters"
    check_sources(TrainingContext(registry=registry), dataset_path=str(data), base_adapter=None)  # --local: anywhere
    restricted = TrainingContext(registry=registry, data_roots=(tmp_path / "roots",))
    with pytest.raises(AccessError) as refused:
        check_sources(restricted, dataset_path=str(data), base_adapter=None)
    assert refused.value.code == "path_not_allowed"
    assert refused.value.pointer == "/dataset_path"
    allowed = TrainingContext(registry=registry, data_roots=(tmp_path / "outside",))
    check_sources(allowed, dataset_path=str(data), base_adapter=None)


def test_a_missing_base_adapter_is_refused_at_admission_everywhere(tmp_path):
    registry = tmp_path / "adapters"
    for context in (TrainingContext(registry=registry), TrainingContext(registry=registry, data_roots=())):
        with pytest.raises(RequestError) as refused:
            check_sources(context, dataset_path=None, base_adapter="nope")
        assert refused.value.code == "training_invalid_request"
        assert refused.value.pointer == "/config/base_adapter"


# ----------------------------------------------------------------------------- live: refusals that disclose nothing


def _refusal(http, path: str) -> dict:
    answer = _sft(http, path, "never")
    assert answer.status_code == 403, answer.text
    error = answer.json()["error"]
    assert error["code"] == "path_not_allowed"
    assert error["pointer"] == "/dataset_path"
    return error


@pytest.mark.slow
def test_live_a_dataset_path_outside_the_data_roots_is_refused_403_and_says_nothing_about_the_file(server, tmp_path):
    root = server.home / "data"
    root.mkdir(parents=True, exist_ok=True)
    (root / "passwd.jsonl").symlink_to("/etc/passwd")
    secret = _rows(tmp_path / "secret" / "rows.jsonl")
    with server.client() as http:
        refusals = {
            "etc-passwd": _refusal(http, "/etc/passwd"),
            "proc-environ": _refusal(http, "/proc/self/environ"),
            "symlink-out-of-a-root": _refusal(http, str(root / "passwd.jsonl")),
            "a-readable-jsonl-elsewhere": _refusal(http, str(secret)),
            "nothing-there": _refusal(http, str(tmp_path / "no-such-file.jsonl")),
        }
        assert http.get("/v1/train/status").json() == [], "nothing was queued"
    pid = str(server.proc.pid)
    for case, error in refusals.items():
        text = error["message"] + (error["hint"] or "")
        assert "training.data_roots" in text, case
        for leak in ("sha256", "row ", "line ", "bytes", "root:", pid, "does not exist", "not a regular"):
            assert leak not in text, (case, leak, text)
    # an existing file and a missing one get the same answer but for the path they were sent as: no oracle
    shape = {c: e["message"].split("'", 2)[2] for c, e in refusals.items()}
    assert len(set(shape.values())) == 1, shape
    assert "/etc/passwd" not in refusals["symlink-out-of-a-root"]["message"], "a symlink's target is not named"


@pytest.mark.slow
def test_live_a_base_adapter_outside_the_registry_or_missing_is_refused_before_queueing(server, tmp_path):
    outside = tmp_path / "outside" / "copied-adapter"
    outside.mkdir(parents=True)
    (outside / "adapter_config.json").write_text("{}", encoding="utf-8")
    (outside / "adapter_model.safetensors").write_bytes(b"x")
    with server.client() as http:
        for base in ("../../outside/copied-adapter", str(outside), "/etc"):
            answer = http.post(
                "/v1/train/sft", json={"examples": ADAPTER_CONVERSATIONS, "config": {"base_adapter": base}}
            )
            assert answer.status_code == 403, (base, answer.text)
            assert answer.json()["error"]["code"] == "path_not_allowed"
            assert answer.json()["error"]["pointer"] == "/config/base_adapter"
        answer = http.post(
            "/v1/train/sft", json={"examples": ADAPTER_CONVERSATIONS, "config": {"base_adapter": "nope"}}
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["code"] == "training_invalid_request"
        assert answer.json()["error"]["pointer"] == "/config/base_adapter"
        assert http.get("/v1/train/status").json() == [], "nothing was queued"


# ----------------------------------------------------------------------------- live: what is allowed


@pytest.mark.slow
def test_live_uploads_are_content_addressed_streamed_and_bounded_and_train_like_any_dataset_path(server, tmp_path):
    data = _rows(tmp_path / "rows.jsonl").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    uploads = server.home / "data" / "uploads"
    with server.client() as http:
        first = http.post("/v1/datasets", content=data, headers={"Content-Type": "application/jsonl"})
        assert first.status_code == 200, first.text
        stored = first.json()
        assert contracts.problems("DatasetUploadResponse", stored) == []
        assert stored["sha256"] == f"sha256:{digest}"
        assert stored["bytes"] == len(data)
        assert stored["created"] is True
        assert Path(stored["dataset_path"]) == uploads / f"{digest}.jsonl"
        assert Path(stored["dataset_path"]).read_bytes() == data
        again = http.post("/v1/datasets", content=data, headers={"Content-Type": "application/x-ndjson"}).json()
        assert again == {**stored, "created": False}

        assert http.post("/v1/datasets", content=data, headers={"Content-Type": "text/plain"}).status_code == 415
        empty = http.post("/v1/datasets", content=b"", headers={"Content-Type": "application/jsonl"})
        assert empty.status_code == 400, empty.text
        declared = http.post(
            "/v1/datasets", content=b"x" * (UPLOAD_LIMIT + 1), headers={"Content-Type": "application/jsonl"}
        )
        assert declared.status_code == 413
        assert declared.json()["error"]["code"] == "payload_too_large"

        answer = _sft(http, stored["dataset_path"], "from-upload")
        assert answer.status_code == 200, answer.text
        detail = _finished(http, answer.json()["job_id"])
        assert detail["state"] == "completed", detail
        receipt = json.loads((server.home / "adapters" / "from-upload" / "train_receipt.json").read_text())
        assert receipt["training_data"]["path"] == stored["dataset_path"]

    # a chunked upload without a length is cut off as soon as it passes the limit, and leaves nothing behind
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        head = (
            "POST /v1/datasets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/jsonl\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        chunk = b"y" * 16384
        answer = b""
        for _ in range(UPLOAD_LIMIT // len(chunk) + 4):
            try:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.settimeout(30)
        while b"\r\n\r\n" not in answer:
            part = sock.recv(65536)
            if not part:
                break
            answer += part
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sorted(p.name for p in uploads.iterdir()) == [f"{digest}.jsonl"], "no temp file stays"


@pytest.mark.slow
def test_live_the_cli_uploads_a_jsonl_file_from_any_directory(server, tmp_path, capsys, monkeypatch):
    rows = _rows(tmp_path / "anywhere" / "rows.jsonl")
    monkeypatch.chdir(tmp_path / "anywhere")
    code = main(["train", "sft", "-f", "rows.jsonl", "--adapter", "cli-upload", "--epochs", "1", "--no-auto-load",
                 "--wait", "--url", server.url])  # fmt: skip
    _out, err = capsys.readouterr()
    assert code == 0, err
    digest = hashlib.sha256(rows.read_bytes()).hexdigest()
    assert f"Uploaded {rows}" in err or "Uploaded rows.jsonl" in err
    assert f"sha256:{digest}" in err
    receipt = json.loads((server.home / "adapters" / "cli-upload" / "train_receipt.json").read_text())
    assert receipt["training_data"]["path"] == str(server.home / "data" / "uploads" / f"{digest}.jsonl")
    with server.client() as http:
        config = http.get("/v1/config").json()
    assert config["resolved_paths"]["data_roots"] == [str(server.home / "data")]
    assert config["resolved_paths"]["uploads"] == str(server.home / "data" / "uploads")
    assert os.path.isfile(receipt["training_data"]["path"])


@pytest.mark.slow
def test_live_a_local_teacher_is_read_only_from_the_data_roots_the_models_directory_or_the_served_model(
    server, tmp_path
):
    elsewhere = tmp_path / "elsewhere-model"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}", encoding="utf-8")
    with server.client() as http:
        for model_id in ("/etc", str(elsewhere), str(tmp_path / "missing-model")):
            answer = http.post("/v1/teachers", json={"alias": "outsider", "kind": "local", "model_id": model_id})
            assert answer.status_code == 403, (model_id, answer.text)
            error = answer.json()["error"]
            assert error["code"] == "path_not_allowed"
            assert error["pointer"] == "/model_id"
            assert "config.json" not in error["message"], "nothing is said about the directory"
        assert http.get("/v1/teachers").json()["teachers"] == []
        served = http.post("/v1/teachers", json={"alias": "self", "kind": "local", "model_id": str(server.model)})
        assert served.status_code == 200, served.text  # the served model may teach
        assert http.delete("/v1/teachers/self").status_code == 200


# ----------------------------------------------------------------------------- online GRPO: no request runs code


@pytest.mark.parametrize(
    "scorer",
    ["/bin/sh", "./grade.py", "os:system", "subprocess:run", "http://127.0.0.1:9/score", "grade.py"],
)
def test_a_server_runs_only_builtin_scorers_a_request_names(tmp_path, scorer):
    registry = tmp_path / "adapters"
    restricted = TrainingContext(registry=registry, data_roots=(tmp_path / "roots",))
    with pytest.raises(AccessError) as refused:
        check_sources(restricted, dataset_path=None, base_adapter=None, scorer=scorer)
    assert refused.value.code == "path_not_allowed"
    assert refused.value.pointer == "/online/scorer"
    check_sources(restricted, dataset_path=None, base_adapter=None, scorer="builtin:json")
    check_sources(TrainingContext(registry=registry), dataset_path=None, base_adapter=None, scorer=scorer)  # --local


def test_an_online_tasks_path_follows_the_dataset_path_rule(tmp_path):
    tasks = _rows(tmp_path / "outside" / "tasks.jsonl", [{"prompt": "hi"}])
    restricted = TrainingContext(registry=tmp_path / "adapters", data_roots=(tmp_path / "roots",))
    with pytest.raises(AccessError) as refused:
        check_sources(restricted, dataset_path=None, base_adapter=None, tasks_path=str(tasks))
    assert refused.value.pointer == "/online/tasks_path"


@pytest.mark.slow
def test_live_an_online_request_naming_a_command_is_refused_403_before_anything_runs(server, tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "evil.sh"
    script.write_text(f"#!/bin/sh\ntouch {marker}\n")
    script.chmod(0o755)
    body = {
        "online": {"tasks": [{"prompt": "hi", "pattern": "x"}], "scorer": str(script), "group_size": 2},
        "config": {"output_name": "never", "seed": 1},
    }
    with server.client() as http:
        answer = http.post("/v1/train/grpo", json=body)
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"]["pointer"] == "/online/scorer"
        answer = http.post("/v1/train/grpo", json={**body, "online": {**body["online"], "scorer": "os:system"}})
        assert answer.status_code == 403, answer.text
        queued = http.get("/v1/train/status").json()  # the module's server also runs other tests' jobs
        assert all(job["adapter_name"] != "never" for job in queued), "nothing was queued"
    assert not marker.exists()


@pytest.mark.slow
def test_live_an_online_run_with_a_builtin_scorer_trains_on_the_server(server):
    body = {
        "online": {
            "tasks": [
                {"id": "d", "prompt": "A digit?", "pattern": "[0-9]"},
                {"id": "e", "prompt": "An e?", "pattern": "e"},
            ],
            "scorer": "builtin:regex",
            "group_size": 4,
            "sampling": {"temperature": 1.0, "top_k": 20, "max_tokens": 4},
        },
        "config": {"output_name": "online-served", "seed": 3, "auto_load": False},
    }
    with server.client() as http:
        answer = http.post("/v1/train/grpo", json=body)
        assert answer.status_code == 200, answer.text
        detail = _finished(http, answer.json()["job_id"])
    assert detail["state"] == "completed", detail
    receipt = json.loads((server.home / "adapters" / "online-served" / "train_receipt.json").read_text())
    assert receipt["grpo"]["online"]["task_visits"] == 2
    assert receipt["grpo"]["online"]["max_behavior_logprob_gap"] in (0.0, None)
