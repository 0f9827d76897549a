"""The teacher protocol of ``kiln serve`` against a live server: ``GET /v1/models`` with the
teacher identity, ``POST /v1/completions`` in vLLM's prompt-logprobs layout, the teacher routes,
and a second Kiln (this test process) using the server as its ``remote`` teacher: the remote
scores equal a local scorer's on the same model directory bit for bit.

The server serves a tiny teacher (the student's tokenizer, weights from seed 2). Every body is
checked against its schema definition.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from _server import ServerProcess

from kiln import contracts
from kiln.errors import ConflictError
from kiln.model import create_tiny, load_base_model, sequence_logprobs
from kiln.teachers import (
    MAX_TOP_K,
    LocalScorer,
    RemoteScorer,
    TeacherRegistry,
    open_scorer,
    reprobe,
    teacher_identity_for,
    teachers_root,
    top_k_logprobs,
)


def _valid(definition, doc):
    assert contracts.problems(definition, doc) == [], definition
    return doc


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return create_tiny(tmp_path_factory.mktemp("teacher") / "tiny-teacher", seed=2)


@pytest.fixture(scope="module")
def server(tmp_path_factory, teacher_dir):
    roots = {"KILN_TRAINING_DATA_ROOTS": str(tmp_path_factory.getbasetemp())}  # the tests' teacher models
    with ServerProcess(tmp_path_factory.mktemp("serve") / "home", teacher_dir, env=roots) as proc:
        yield proc


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def teacher(teacher_dir):
    return load_base_model(teacher_dir)


def _score(http, prompt, **fields):
    answer = http.post("/v1/completions", json={"model": "tiny-teacher", "prompt": prompt, **fields})
    assert answer.status_code == 200, answer.text
    return _valid("CompletionResponse", answer.json())


def _refused(http, status, code, body, path="/v1/completions"):
    answer = http.post(path, json=body)
    assert answer.status_code == status, answer.text
    error = _valid("ErrorEnvelope", answer.json())["error"]
    assert error["code"] == code, error
    return error


def test_models_lists_the_served_model_with_its_teacher_identity(http, teacher_dir):
    listing = _valid("ModelList", http.get("/v1/models").json())
    assert len(listing["data"]) == 1
    card = listing["data"][0]
    assert card["id"] == "tiny-teacher"
    assert card["owned_by"] == "kiln"
    assert card["max_model_len"] == card["teacher_identity"]["max_model_len"] == 4096
    assert card["teacher_identity"] == teacher_identity_for(teacher_dir, served_model_id="tiny-teacher")


def test_completions_answer_in_the_vllm_prompt_logprobs_layout(http, teacher):
    import torch

    teacher_model = teacher.model
    prompt = [1, 52, 3, 90, 91, 92]
    doc = _score(http, prompt, max_tokens=1, prompt_logprobs=3, temperature=0)
    choice = doc["choices"][0]
    assert doc["usage"] == {"prompt_tokens": 6, "completion_tokens": 1, "total_tokens": 7}
    scores = choice["prompt_logprobs"]
    assert scores[0] is None
    want_ids, want_values = top_k_logprobs(teacher_model, prompt, 1, 3)
    with torch.no_grad():  # the invariant forward's log-softmax: what every Kiln scorer answers
        full = sequence_logprobs(teacher_model, prompt)
    for p in range(1, len(prompt)):
        entry = scores[p]
        top = sorted((e["rank"], int(t), e["logprob"]) for t, e in entry.items() if e["rank"] <= 3)
        assert [r for r, _, _ in top] == [1, 2, 3]
        assert [t for _, t, _ in top] == want_ids[p - 1].tolist()
        assert [v for _, _, v in top] == want_values[p - 1].tolist()  # bit for bit through JSON
        own = entry[str(prompt[p])]
        assert own["logprob"] == float(full[p - 1, prompt[p]])
        assert own["rank"] == 1 + int((full[p - 1] > full[p - 1, prompt[p]]).sum())
        assert len(entry) == (3 if own["rank"] <= 3 else 4)
        assert all(e["decoded_token"] is not None for e in entry.values())
    greedy = int(full[-1].argmax())  # the first maximum
    if choice["finish_reason"] == "stop":
        assert teacher.tokenizer.convert_ids_to_tokens(greedy) in ("<|im_end|>", "<|endoftext|>")
        assert choice["text"] == ""
    else:
        assert choice["finish_reason"] == "length"
        assert choice["text"] == teacher.tokenizer.decode([greedy], skip_special_tokens=True)

    bare = _score(http, prompt, max_tokens=0)
    assert bare["choices"][0]["prompt_logprobs"] is None
    assert bare["choices"][0]["text"] == ""
    assert bare["usage"]["completion_tokens"] == 0
    only_own = _score(http, prompt, max_tokens=0, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
    assert all(list(entry) == [str(prompt[p])] for p, entry in enumerate(only_own) if p)


def test_completions_refuse_other_models_foreign_ids_long_prompts_and_large_top_k(http):
    base = {"model": "tiny-teacher", "prompt": [1, 2, 3]}
    _refused(http, 404, "not_found", {**base, "model": "kiln-tiny-default"})
    error = _refused(http, 400, "out_of_range", {**base, "prompt": [1, 627, 3]})
    assert error["pointer"] == "/prompt/1"
    _refused(http, 400, "out_of_range", {**base, "prompt": [1] * 4097})
    _refused(http, 400, "out_of_range", {**base, "prompt_logprobs": MAX_TOP_K + 1})
    _refused(http, 400, "wrong_type", {**base, "prompt": {"text": "not a prompt"}})
    _refused(http, 400, "invalid_length", {**base, "prompt": ""})  # the schema states a text prompt is non-empty
    _refused(http, 400, "out_of_range", {**base, "max_tokens": 4097})


def test_integral_json_numbers_are_scored_as_integers(http):
    doc = _score(http, [1.0, 52.0, 3], prompt_logprobs=2.0, max_tokens=0)
    assert all(key.isdigit() for entry in doc["choices"][0]["prompt_logprobs"][1:] for key in entry)
    assert (
        doc["choices"][0]["prompt_logprobs"]
        == _score(http, [1, 52, 3], prompt_logprobs=2, max_tokens=0)["choices"][0]["prompt_logprobs"]
    )


def test_a_second_kiln_scores_with_the_server_as_its_remote_teacher_bit_for_bit(tmp_path, server, teacher_dir):
    import torch

    registry = TeacherRegistry(teachers_root(tmp_path / "kiln-home"), adapter_registry=tmp_path / "adapters")
    remote = _valid(
        "TeacherEntry",
        registry.add(
            {"alias": "over-http", "kind": "remote", "provider": "vllm", "url": server.url, "model_id": "tiny-teacher"}
        ),
    )
    local = registry.add({"alias": "in-process", "kind": "local", "model_id": str(teacher_dir)})
    assert remote["spec"]["identity"] == local["spec"]["identity"]  # one function computes both
    assert remote["identity_revision"] == local["identity_revision"]

    pinned = registry.get("over-http")
    reprobe(pinned)
    far = open_scorer(pinned, registry_dir=tmp_path / "adapters")
    near = open_scorer(registry.get("in-process"), registry_dir=tmp_path / "adapters")
    assert isinstance(far, RemoteScorer)
    assert isinstance(near, LocalScorer)
    assert far.max_top_k == near.max_top_k == MAX_TOP_K
    for prefix, action, k in (
        ([1, 40, 41], [42, 43, 3], 16),
        ([7], [8], 1),
        ([5, 6, 7, 8, 9] * 6, list(range(10, 40)), 64),
    ):
        remote_ids, remote_values = far.score(prefix, action, k)
        local_ids, local_values = near.score(prefix, action, k)
        assert remote_ids.dtype == torch.long
        assert remote_values.dtype == torch.float32
        assert remote_ids.shape == (len(action), k)
        assert torch.equal(remote_ids, local_ids)
        assert torch.equal(remote_values, local_values)
    far.close()
    near.close()

    changed = dataclasses.replace(pinned, identity={**pinned.identity, "base_model_sha256": "0" * 64})
    with pytest.raises(ConflictError, match=r"base_model_sha256 changed: 0{64} \(registered\)") as caught:
        reprobe(changed)
    assert caught.value.code == "teacher_identity_mismatch"
    gone = dataclasses.replace(pinned, model_id="no-such-model")
    with pytest.raises(ConflictError, match="serves no model 'no-such-model'"):
        reprobe(gone)


def test_the_server_registers_lists_and_removes_teachers(http, server, tiny_model_dir):
    local = http.post("/v1/teachers", json={"alias": "seed-zero", "kind": "local", "model_id": str(tiny_model_dir)})
    assert local.status_code == 200, local.text
    assert _valid("TeacherEntry", local.json())["status"] == "verified"
    itself = http.post(
        "/v1/teachers",
        json={"alias": "itself", "kind": "remote", "provider": "vllm", "url": server.url, "model_id": "tiny-teacher"},
    )
    assert itself.status_code == 200, itself.text
    fixture = http.post("/v1/teachers", json={"alias": "arith", "kind": "fixture", "model_id": "arith-v1"})
    assert _valid("TeacherEntry", fixture.json())["status"] == "configured"

    _refused(http, 409, "teacher_conflict", {"alias": "seed-zero", "kind": "fixture", "model_id": "x"}, "/v1/teachers")
    _refused(http, 400, "unsafe_path", {"alias": "../up", "kind": "fixture", "model_id": "x"}, "/v1/teachers")
    _refused(http, 400, "inconsistent_fields", {"alias": "r", "kind": "remote", "model_id": "x"}, "/v1/teachers")
    error = _refused(
        http,
        400,
        "training_invalid_request",
        {"alias": "r", "kind": "remote", "provider": "vllm", "url": server.url, "model_id": "nope"},
        "/v1/teachers",
    )
    assert "serves no model 'nope'" in error["message"]

    listing = _valid("TeachersListResponse", http.get("/v1/teachers").json())
    assert [e["spec"]["alias"] for e in listing["teachers"]] == ["arith", "itself", "seed-zero"]
    records = Path(server.home) / "teachers"
    assert sorted(p.name for p in records.iterdir()) == ["arith.json", "itself.json", "seed-zero.json"]
    for path in records.iterdir():
        _valid("TeacherRegistryRecord", json.loads(path.read_text()))

    answer = http.delete("/v1/teachers/itself")
    assert answer.status_code == 200
    assert _valid("DeleteTeacherResponse", answer.json()) == {"status": "deleted", "alias": "itself"}
    missing = http.delete("/v1/teachers/itself")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "teacher_not_found"
    for alias in ("seed-zero", "arith"):
        assert http.delete(f"/v1/teachers/{alias}").status_code == 200
    assert http.get("/v1/teachers").json() == {"teachers": []}


def test_the_server_refuses_a_teacher_whose_vocabulary_differs_from_its_model(http, tmp_path, teacher_dir):
    wide = shutil.copytree(teacher_dir, tmp_path / "wide-teacher")
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps({**config, "vocab_size": 4096}))
    error = _refused(
        http, 400, "training_invalid_request", {"alias": "wide", "kind": "local", "model_id": str(wide)}, "/v1/teachers"
    )
    assert "vocab_size is 4096 but the student's is 627" in error["message"]
    assert http.get("/v1/teachers").json() == {"teachers": []}
