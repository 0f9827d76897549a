"""OPD end to end over HTTP: one Kiln server is the remote teacher of another (the vLLM
prompt-logprobs protocol over loopback). The distilled adapter is byte-identical to one
distilled in-process from a local teacher of the same weights, the job and its artifacts
validate, and bad submissions are refused before queueing."""

from __future__ import annotations

import pytest
from _server import ServerProcess, wait_for

from kiln import contracts
from kiln.model import create_tiny
from kiln.teachers import TeacherRegistry
from kiln.trainers.opd import admit_opd, run_opd

PROMPTS = [
    {"messages": [{"role": "user", "content": "Describe a river."}]},
    {
        "messages": [{"role": "user", "content": "Describe a hill."}],
        "teacher_extra_messages": [{"role": "system", "content": "Answer in three words."}],
    },
]
CONFIG = {"seed": 3, "samples_per_prompt": 2, "max_tokens": 8, "top_k": 16, "epochs": 2, "checkpoint_interval": 3}


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("opd-servers")
    teacher_dir = create_tiny(root / "teacher-model", seed=2)
    teacher = ServerProcess(root / "teacher-home", teacher_dir).start()
    student = ServerProcess(root / "student-home", tiny_model_dir).start()
    try:
        yield teacher, student, teacher_dir
    finally:
        student.stop()
        teacher.stop()


def _wait_terminal(client, job_id):
    def done():
        detail = client.get(f"/v1/train/jobs/{job_id}").json()
        return detail if detail["state"] in ("completed", "failed") else None

    return wait_for(done, timeout=300, interval=0.2)


def test_a_kiln_server_distils_from_another_kiln_server(servers, tmp_path, tiny_model_dir):
    teacher, student, teacher_dir = servers
    with teacher.client() as t:
        models = t.get("/v1/models").json()
    contracts.load("ModelList", models)
    served = models["data"][0]["id"]
    with student.client() as s:
        entry = s.post(
            "/v1/teachers",
            json={
                "alias": "remote-tutor",
                "kind": "remote",
                "provider": "vllm",
                "url": teacher.url,
                "model_id": served,
            },
        )
        assert entry.status_code == 200, entry.text
        assert entry.json()["status"] == "verified"
        submitted = s.post(
            "/v1/train/opd",
            json={"teacher": "remote-tutor", "prompts": PROMPTS, "config": {**CONFIG, "output_name": "distilled"}},
        )
        assert submitted.status_code == 200, submitted.text
        detail = _wait_terminal(s, submitted.json()["job_id"])
        assert detail["state"] == "completed", detail
        contracts.load("TrainingJobDetail", detail)
        receipt = s.get("/v1/adapters/distilled/receipt").json()
    contracts.load("TrainReceipt", receipt)
    assert receipt["opd"]["teacher_id"] == "remote-tutor"
    assert receipt["opd"]["teacher_identity"]["served_model_id"] == served
    remote_adapter = student.home / "adapters" / "distilled"
    for name in ("train_receipt.json", "adapter_manifest.json"):
        report = contracts.validate_path(remote_adapter / name)
        assert report.valid, report.errors

    # the same run in-process with a local teacher of the same weights: identical bytes
    root = tmp_path / "teachers"
    TeacherRegistry(root).add({"alias": "local-tutor", "kind": "local", "model_id": str(teacher_dir)})
    local = run_opd(
        admit_opd(
            adapter_name="distilled",
            registry=tmp_path / "adapters",
            request={"teacher": "local-tutor", "prompts": PROMPTS, "config": CONFIG},
            teachers_root=root,
            model_path=str(tiny_model_dir),
        )
    )
    assert local.status == "success", local.receipt.get("failure_message")
    assert local.receipt["opd"]["initial_opd_loss"] == receipt["opd"]["initial_opd_loss"]
    assert (local.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        remote_adapter / "adapter_model.safetensors"
    ).read_bytes()
    assert local.receipt["opd"]["final_opd_loss"] == receipt["opd"]["final_opd_loss"]


def test_unknown_teachers_and_unexecuted_values_are_refused_before_queueing(servers):
    _, student, _ = servers
    with student.client() as s:
        missing = s.post("/v1/train/opd", json={"teacher": "nobody", "prompts": PROMPTS})
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "teacher_not_found"
        s.post("/v1/teachers", json={"alias": "fixture-only", "kind": "fixture", "model_id": "some-scores"})
        wrong = s.post("/v1/train/opd", json={"teacher": "fixture-only", "prompts": PROMPTS})
        assert wrong.status_code == 400
        assert "fixture" in wrong.json()["error"]["message"]
        k = s.post("/v1/train/opd", json={"teacher": "nobody", "prompts": PROMPTS, "config": {"top_k": 8}})
        assert k.status_code in (400, 404)
        statuses = s.get("/v1/train/status").json()
    assert all(job["state"] != "queued" for job in statuses)
