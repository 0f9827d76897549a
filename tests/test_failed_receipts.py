"""Which failures leave a failed receipt (docs/training.md "Failed receipts"), category by category.

A request refused at admission writes nothing; a dry run records the data it finds bad as its failed receipt (and
still ends non-zero, naming the problem); a run that fails after admission writes a failed receipt. Each receipt
written here loads through the strict loader and carries its category.
"""

from __future__ import annotations

import json
import time

import pytest

from kiln import contracts
from kiln.cli import main
from kiln.errors import RequestError
from kiln.trainers.grpo import admit_grpo, run_grpo
from kiln.trainers.sft import admit_sft, run_sft

PROMPT = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
NO_ACTION = {  # the only assistant segment is context: nothing the policy wrote
    "messages": PROMPT,
    "completions": [
        {"text": "", "reward": 1.0, "trajectory": [{"role": "assistant", "content": "hmm", "kind": "context"}]},
        {"text": "no", "reward": 0.0},
    ],
}
EQUAL = {"messages": PROMPT, "completions": [{"text": "a", "reward": 1.0}, {"text": "b", "reward": 1.0}]}
PLAIN = {"messages": PROMPT, "completions": [{"text": "yes", "reward": 1.0}, {"text": "no", "reward": 0.0}]}


def _file(tmp_path, name, *lines):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _grpo(tmp_path, model, request, name="policy"):
    job = admit_grpo(adapter_name=name, registry=tmp_path / "adapters", request=request, model_path=str(model))
    return run_grpo(job)


def _receipt(path):
    """The receipt at ``path``, after the strict loader accepted it."""
    raw = json.loads(path.read_text(encoding="utf-8"))
    contracts.load("TrainReceipt", raw)
    return raw


def _strict(result, reason):
    assert result.status == "failed"
    loaded = _receipt(result.receipt_path)
    assert loaded["failure_reason"] == reason, loaded.get("failure_message")
    assert loaded["status"] == "failed"
    return loaded


@pytest.mark.parametrize(
    ("lines", "reason", "says"),
    [
        ([NO_ACTION], "zero_action_tokens", "zero_action_tokens"),
        ([EQUAL], "zero_groups", "every group was filtered out"),
        ([""], "zero_groups", "has no groups"),
        (["{not json"], "data_schema_error", "not valid JSON"),
    ],
    ids=["no-action-token", "all-filtered", "empty-file", "bad-line"],
)
def test_a_grpo_dry_run_records_the_data_it_finds_bad_as_a_failed_dry_run_receipt(
    tmp_path, tiny_model_dir, lines, reason, says
):
    data = _file(tmp_path, "groups", *lines)
    result = _grpo(tmp_path, tiny_model_dir, {"dataset_path": str(data), "dry_run": True})
    receipt = _strict(result, reason)
    assert says in receipt["failure_message"]
    assert receipt["training_data"]["source"] == "jsonl_grpo_groups_dry_run"
    assert receipt["training_data"]["path"] == str(data.resolve())
    assert result.manifest_path is None
    assert sorted(p.name for p in result.adapter_dir.iterdir()) == ["train_receipt.json"]


def test_the_same_bad_data_outside_a_dry_run_is_refused_at_admission_and_writes_nothing(tmp_path, tiny_model_dir):
    data = _file(tmp_path, "groups", NO_ACTION)
    with pytest.raises(RequestError, match="zero_action_tokens") as refused:
        _grpo(tmp_path, tiny_model_dir, {"dataset_path": str(data)})
    assert refused.value.code == "training_invalid_request"
    assert not (tmp_path / "adapters" / "policy").exists()


def test_echo_only_training_without_an_observation_token_fails_with_zero_env_tokens(tmp_path, tiny_model_dir):
    request = {"groups": [PLAIN], "config": {"seed": 1, "loss": {"no_policy_loss": True}}}
    receipt = _strict(_grpo(tmp_path, tiny_model_dir, request), "zero_env_tokens")
    assert "observation token" in receipt["failure_message"]
    assert receipt["no_policy_loss"] is True


def test_a_base_adapter_whose_weights_cannot_be_read_fails_with_adapter_load_failed(tmp_path, tiny_model_dir):
    broken = tmp_path / "adapters" / "broken"
    broken.mkdir(parents=True)
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": [*PROMPT, {"role": "assistant", "content": "yes"}]}) + "\n")
    job = admit_sft(
        adapter_name="warm",
        registry=tmp_path / "adapters",
        config={"epochs": 1, "seed": 1, "base_adapter": "broken"},
        dataset_path=data,
        model_path=str(tiny_model_dir),
    )
    receipt = _strict(run_sft(job), "adapter_load_failed")
    assert "could not be loaded" in receipt["failure_message"]


@pytest.mark.parametrize(
    "config",
    [{"lora_rank": 4, "lora_alpha": 64}, {"loss": {"opd": {"kind": "teacher"}}}, {"loss": {"no_policy_loss": True, "echo": None}}],
    ids=["unsafe-lora-scale", "opd-term", "no-loss-at-all"],
)  # fmt: skip
def test_config_refusals_write_nothing_even_in_a_dry_run(tmp_path, tiny_model_dir, config):
    data = _file(tmp_path, "groups", PLAIN)
    with pytest.raises(RequestError):
        _grpo(tmp_path, tiny_model_dir, {"dataset_path": str(data), "dry_run": True, "config": config})
    assert not (tmp_path / "adapters").exists() or not any((tmp_path / "adapters").iterdir())


def test_the_cli_dry_run_writes_the_failed_receipt_and_exits_non_zero_naming_the_problem(
    tmp_path, tiny_model_dir, capsys
):
    data = _file(tmp_path, "groups", NO_ACTION)
    registry = tmp_path / "adapters"
    argv = ["train", "grpo", "--local", "--dry-run", "-f", str(data), "--adapter", "dry"]
    code = main([*argv, "--model", str(tiny_model_dir), "--adapter-dir", str(registry)])
    err = capsys.readouterr().err
    assert code == 1
    assert "dry run failed (zero_action_tokens)" in err
    assert str(registry / "dry" / "train_receipt.json") in err
    assert _receipt(registry / "dry" / "train_receipt.json")["failure_reason"] == "zero_action_tokens"


@pytest.fixture
def http(tmp_path, tiny_model_dir, monkeypatch):
    """An in-process server on the tiny model that trains in its own thread; it may read files under tmp_path."""
    from fastapi.testclient import TestClient

    from kiln.host.config import resolve_settings
    from kiln.server._app import build_server, create_app

    home = tmp_path / "home"
    monkeypatch.setenv("KILN_HOME", str(home))
    settings = resolve_settings(
        {
            "paths.home": str(home),
            "model.path": str(tiny_model_dir),
            "training.worker": "thread",
            "training.data_roots": [str(tmp_path)],
        }
    )
    settings.registry.mkdir(parents=True)
    with TestClient(create_app(build_server(settings))) as client:
        client.registry = settings.registry
        yield client


def test_a_server_dry_run_of_bad_data_ends_failed_with_its_receipt_on_disk(tmp_path, http):
    data = _file(tmp_path, "groups", NO_ACTION)
    answer = http.post(
        "/v1/train/grpo", json={"dataset_path": str(data), "dry_run": True, "config": {"output_name": "dry"}}
    )
    assert answer.status_code == 200, answer.text
    job_id = answer.json()["job_id"]
    deadline = time.monotonic() + 120
    while (detail := http.get(f"/v1/train/jobs/{job_id}").json())["state"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, detail
        time.sleep(0.05)  # polling the job's state, bounded by the deadline
    assert detail["state"] == "failed"
    assert detail["train_receipt"]["failure_reason"] == "zero_action_tokens"
    assert "zero_action_tokens" in detail["error"]
    assert _receipt(http.registry / "dry" / "train_receipt.json")["failure_reason"] == "zero_action_tokens"
    refused = http.post("/v1/train/grpo", json={"dataset_path": str(data), "config": {"output_name": "real"}})
    assert refused.status_code == 400
    assert not (http.registry / "real").exists()
