"""The client commands over HTTP against a real ``kiln serve``: train, status, cancel, adapters, health, verify.

Commands run in-process through ``kiln.cli.main`` (a subprocess where a signal matters); every
``--json`` form validates against its schema definition, every error is one clear line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading

import pytest
from _server import ServerProcess, wait_for
from conftest import ADAPTER_CONVERSATIONS
from kiln_contracts.client import KilnClient

from kiln import __version__, contracts
from kiln.cli import build_parser, main

GRPO_REQUEST = {
    "groups": [
        {
            "messages": [{"role": "user", "content": "What is 17 * 3?"}],
            "completions": [{"text": "51", "reward": 1.0}, {"text": "41", "reward": 0.0}],
        }
    ],
    "config": {"kl_coeff": 0.1},
}
OPD_PROMPTS = [{"messages": [{"role": "user", "content": "Explain recursion to a ten-year-old."}]}]


def _valid(definition, body):
    problems = contracts.problems(definition, body)
    assert problems == [], f"{definition}: {problems}"
    return body


def _run(capsys, *argv):
    """(exit status, stdout, stderr) of ``kiln ARGV``."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _json(capsys, definition, *argv, status=0):
    code, out, err = _run(capsys, *argv, "--json")
    assert code == status, err
    return _valid(definition, json.loads(out))


def _jsonl(path, rows=ADAPTER_CONVERSATIONS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def _no_client_environment(monkeypatch):
    monkeypatch.delenv("KILN_URL", raising=False)
    monkeypatch.delenv("KILN_API_KEY", raising=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    roots = {"KILN_TRAINING_DATA_ROOTS": str(tmp_path_factory.getbasetemp())}  # the tests' teacher models
    with ServerProcess(tmp_path_factory.mktemp("cli-http") / "home", tiny_model_dir, env=roots) as proc:
        yield proc


@pytest.fixture(scope="module")
def trained(server):
    """An adapter named ``bot`` trained on the server (not auto-loaded)."""
    with KilnClient(server.url, timeout=60) as client:
        job = client.submit_sft_training(
            {
                "examples": ADAPTER_CONVERSATIONS,
                "config": {"output_name": "bot", "epochs": 2, "seed": 21, "auto_load": False},
            }
        )
        done = wait_for(lambda: (d := client.get_training_job(job.job_id)).state.value in ("completed", "failed") and d)
    assert done.state.value == "completed", done.error
    return server.home / "adapters" / "bot"


# ----------------------------------------------------------------------------- train sft


def test_sft_from_a_jsonl_file_is_uploaded_submitted_as_the_stored_path_and_followed_to_completion(
    server, tmp_path, capsys
):
    data = _jsonl(tmp_path / "rows.jsonl")
    code, out, err = _run(
        capsys, "train", "sft", "-f", data, "--adapter", "from-jsonl", "--epochs", 2, "--seed", 5,
        "--no-auto-load", "--wait", "--url", server.url,
    )  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "✓ SFT training job submitted"
    job_id = re.fullmatch(r"Job ID: (job-\w+)", lines[1])[1]
    assert lines[2] == "Effective seed: 5"
    assert lines[3].startswith(f"Check status: kiln train status --job-id {job_id}")
    assert f"✓ job {job_id} completed: adapter from-jsonl" in out
    assert f"{job_id}: 100%" in err  # the progress, as whole lines in a non-terminal
    detail = _json(capsys, "TrainingJobDetail", "train", "status", "--job-id", job_id, "--url", server.url)
    digest = hashlib.sha256(data.read_bytes()).hexdigest()
    stored = server.home / "data" / "uploads" / f"{digest}.jsonl"  # the server reads only inside its data roots
    assert f"Uploaded {data} ({data.stat().st_size} bytes, sha256:{digest})" in err
    assert detail["replay_request"]["dataset_path"] == str(stored)
    assert stored.read_bytes() == data.read_bytes()
    assert detail["replay_request"]["config"]["auto_load"] is False
    assert detail["replay_request"]["config"]["epochs"] == 2


def test_sft_from_a_json_file_sends_inline_examples_and_json_forms_are_the_server_bodies(server, tmp_path, capsys):
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"examples": ADAPTER_CONVERSATIONS}), encoding="utf-8")
    argv = ["train", "sft", "--adapter", "from-json", "--seed", "8", "--no-auto-load", "--url", server.url]
    detail = _json(capsys, "TrainingJobDetail", *argv, "-f", wrapped, "--wait")
    assert detail["state"] == "completed"
    assert detail["effective_seed"] == "8"
    assert detail["replay_request"]["examples"] == ADAPTER_CONVERSATIONS

    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(ADAPTER_CONVERSATIONS), encoding="utf-8")
    answer = _json(capsys, "TrainingResponse", *argv[:3], "from-bare-json", *argv[4:], "-f", bare)
    assert answer["state"] == "queued"
    assert answer["effective_seed"] == "8"


def test_a_cancelled_job_reports_its_resume_checkpoint_and_a_working_resume_command(server, tmp_path, capsys):
    data = _jsonl(tmp_path / "rows.jsonl")
    argv = ["train", "sft", "-f", data, "--adapter", "long", "--epochs", 300, "--checkpoint-interval", 3,
            "--seed", 3, "--no-auto-load", "--url", server.url]  # fmt: skip
    result = {}
    follower = threading.Thread(target=lambda: result.setdefault("code", main([str(a) for a in [*argv, "--wait"]])))
    follower.start()
    with KilnClient(server.url) as client:

        def running_with_checkpoint():
            jobs = [j for j in client.list_training_status() if j.adapter_name == "long"]
            detail = jobs and client.get_training_job(jobs[-1].job_id)
            return detail and detail.state.value == "running" and detail.latest_checkpoint is not None and detail

        job_id = wait_for(running_with_checkpoint).job_id
    assert main(["train", "cancel", "--job-id", job_id, "--url", server.url]) == 0
    follower.join(120)
    assert result["code"] == 1
    out, err = capsys.readouterr()
    assert "✓ cancellation requested (the job stops at its next step and publishes a checkpoint)" in out
    assert f"✗ job {job_id} failed: cancelled" in err
    checkpoint = re.search(
        r"Resume checkpoint: (long-checkpoint-step-(\d{8})\.kiln-checkpoint) \(step (\d+)/600\)", err
    )
    assert checkpoint, err
    assert int(checkpoint[2]) == int(checkpoint[3]) > 0
    resume = shlex.split(err.split("Resume with:\n", 1)[1].strip().splitlines()[0])
    assert resume[:3] == ["kiln", "train", "sft"]
    assert "--local" not in resume
    assert resume[-2:] == ["--resume-checkpoint", checkpoint[1]]

    code, out, err = _run(capsys, "train", "status", "--job-id", job_id, "--url", server.url)
    assert code == 0, err
    assert "State: failed" in out
    assert "Error: cancelled:" in out
    assert "Effective seed: 3" in out
    assert f"Resume checkpoint: {checkpoint[1]} (step {checkpoint[3]}/600)" in out
    code, out, _ = _run(capsys, "train", "status", "--url", server.url)
    assert re.search(rf"^{job_id}\s+sft\s+failed\s+\d+%\s+[\d.]+\s+long$", out, re.MULTILINE), out
    _json(capsys, "TrainingStatusList", "train", "status", "--url", server.url)

    code, out, err = _run(capsys, *resume[1:])  # admission fully loads and checks the checkpoint
    assert code == 0, err
    resumed = re.search(r"Job ID: (job-\w+)", out)[1]
    cancel = _json(capsys, "CancelTrainingJobResponse", "train", "cancel", "--job-id", resumed, "--url", server.url)
    assert cancel["job_id"] == resumed


def _kind_source(kind, tmp_path, capsys, server):
    """(file, extra flags) of a run of ``kind`` long enough to be cancelled after its first checkpoint."""
    if kind == "sft":
        rows = _jsonl(tmp_path / "rows.jsonl", ADAPTER_CONVERSATIONS * 2)
        return rows, ["--epochs", "60", "--checkpoint-interval", "5"]
    if kind == "grpo":
        groups = [{**GRPO_REQUEST["groups"][0], "completions": [{"text": "51", "reward": 1.0},
                                                                {"text": f"4{i}", "reward": 0.0}]}
                  for i in range(120)]  # fmt: skip
        return _jsonl(tmp_path / "groups.jsonl", groups), ["--checkpoint-interval", "4"]
    from kiln.model import create_tiny

    teacher = create_tiny(tmp_path / "teacher-model", seed=2)
    code, _, err = _run(capsys, "teachers", "add", "cli-tutor", "--kind", "local", "--model", teacher,
                        "--server", server.url)  # fmt: skip
    assert code == 0, err
    prompts = tmp_path / "prompts.json"
    config = {"samples_per_prompt": 2, "max_tokens": 8, "top_k": 16}
    prompts.write_text(json.dumps({"prompts": OPD_PROMPTS * 2, "config": config}), encoding="utf-8")
    return prompts, ["--teacher", "cli-tutor", "--epochs", "30", "--checkpoint-interval", "3"]


@pytest.mark.parametrize("kind", ["sft", "grpo", "opd"])
def test_a_job_cancelled_through_the_cli_resumes_with_the_printed_command_to_the_bytes_of_an_uninterrupted_run(
    kind, server, tmp_path, capsys
):
    source, extra = _kind_source(kind, tmp_path, capsys, server)
    name = f"cli-{kind}-resumed"
    argv = ["train", kind, "-f", source, *extra, "--seed", 9, "--no-auto-load", "--url", server.url]
    result = {}
    follower = threading.Thread(
        target=lambda: result.setdefault("code", main([str(a) for a in [*argv, "--adapter", name, "--wait"]]))
    )
    follower.start()
    with KilnClient(server.url) as client:

        def running_with_checkpoint():
            jobs = [j for j in client.list_training_status() if j.adapter_name == name]
            detail = jobs and client.get_training_job(jobs[-1].job_id)
            return detail and detail.state.value == "running" and detail.latest_checkpoint is not None and detail

        job_id = wait_for(running_with_checkpoint).job_id
    assert main(["train", "cancel", "--job-id", job_id, "--url", server.url]) == 0
    follower.join(120)
    assert result["code"] == 1
    _, err = capsys.readouterr()
    assert f"✗ job {job_id} failed: cancelled" in err
    checkpoint = re.search(rf"Resume checkpoint: ({name}-checkpoint-step-\d{{8}}\.kiln-checkpoint) \(step ", err)
    assert checkpoint, err
    resume = shlex.split(err.split("Resume with:\n", 1)[1].strip().splitlines()[0])
    assert resume[:3] == ["kiln", "train", kind]
    assert "--local" not in resume
    assert "--seed" not in resume  # the checkpoint holds the seed
    assert resume[-2:] == ["--resume-checkpoint", checkpoint[1]]

    code, out, err = _run(capsys, *resume[1:], "--wait")
    assert code == 0, err
    resumed = re.search(r"Job ID: (job-\w+)", out)[1]
    assert f"✓ job {resumed} completed: adapter {name}" in out
    code, out, err = _run(capsys, *argv, "--adapter", f"cli-{kind}-straight", "--wait")
    assert code == 0, err
    a = (server.home / "adapters" / name / "adapter_model.safetensors").read_bytes()
    b = (server.home / "adapters" / f"cli-{kind}-straight" / "adapter_model.safetensors").read_bytes()
    assert a == b

    # a completed job still shows the checkpoint its run left, and what that checkpoint is for
    detail = _json(capsys, "TrainingJobDetail", "train", "status", "--job-id", resumed, "--url", server.url)
    last = detail["latest_checkpoint"]
    assert detail["state"] == "completed"
    assert last is not None
    code, out, err = _run(capsys, "train", "status", "--job-id", resumed, "--url", server.url)
    assert code == 0, err
    assert "State: completed" in out
    line = f"Resume checkpoint: {last['resume_checkpoint']} (step {last['global_step']}/{last['total_steps']})"
    assert line in out
    after = out.split(line, 1)[1]
    assert "the run completed" in after
    assert f"kiln adapters delete {name}" in after


def test_ctrl_c_during_wait_stops_watching_and_leaves_the_job_running(server, tmp_path):
    data = _jsonl(tmp_path / "rows.jsonl")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1")
    argv = ["train", "sft", "-f", str(data), "--adapter", "watched", "--epochs", "2000", "--no-auto-load",
            "--wait", "--url", server.url]  # fmt: skip
    with subprocess.Popen(  # pipes closed even when a check fails (else a later test sees them collected)
        [sys.executable, "-m", "kiln.cli", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        seen = bytearray()
        while not re.search(rb"job-\w+: \d+%, (queued|running)", seen):  # progress lines from the job's detail
            chunk = proc.stderr.read1(4096)
            assert chunk, seen.decode(errors="replace")
            seen.extend(chunk)
        proc.send_signal(signal.SIGINT)
        out, rest = proc.communicate(timeout=120)
        seen.extend(rest)
        assert proc.returncode == 130, seen.decode(errors="replace")
    out = out.decode()
    err = seen.decode(errors="replace")
    job_id = re.search(r"Job ID: (job-\w+)", out)[1]
    assert f"stopped watching; job {job_id} keeps running on the server" in err
    assert f"kiln train cancel --job-id {job_id}" in err
    assert "Traceback" not in err
    with KilnClient(server.url) as client:
        assert client.get_training_job(job_id).state.value in ("queued", "running")
        client.cancel_training_job(job_id)


# ----------------------------------------------------------------------------- grpo / opd


def test_grpo_and_opd_requests_are_built_from_the_file_and_the_flags(tmp_path):
    from kiln.cli._requests import build_request

    parser = build_parser()
    streamed = _jsonl(tmp_path / "groups.jsonl", [GRPO_REQUEST["groups"][0]])
    args = parser.parse_args(["train", "grpo", "-f", str(streamed), "--adapter", "g", "--dry-run", "--lr", "0.01"])
    body = _valid("GrpoRequest", build_request(args, streamed))
    assert body == {"dataset_path": str(streamed.resolve()), "dry_run": True,
                    "config": {"learning_rate": 0.01, "output_name": "g"}}  # fmt: skip

    inline = tmp_path / "grpo.json"
    inline.write_text(json.dumps(GRPO_REQUEST), encoding="utf-8")
    args = parser.parse_args(["train", "grpo", "-f", str(inline), "--adapter", "g2", "--no-auto-load"])
    body = _valid("GrpoRequest", build_request(args, inline))
    assert body["groups"] == GRPO_REQUEST["groups"]
    assert body["config"] == {"kl_coeff": 0.1, "output_name": "g2", "auto_load": False}

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(OPD_PROMPTS), encoding="utf-8")
    args = parser.parse_args(
        ["train", "opd", "-f", str(prompts), "--adapter", "d", "--teacher", "big", "--epochs", "2"]
    )
    body = _valid("OpdRequest", build_request(args, prompts))
    assert body == {"prompts": OPD_PROMPTS, "teacher": "big", "config": {"epochs": 2, "output_name": "d"}}


def test_grpo_and_opd_train_on_the_server_and_locally(server, tmp_path, capsys, tiny_model_dir):
    groups = tmp_path / "grpo.json"
    groups.write_text(json.dumps(GRPO_REQUEST), encoding="utf-8")
    code, out, err = _run(capsys, "train", "grpo", "-f", groups, "--adapter", "g-http", "--wait", "--url", server.url)
    assert code == 0, err
    assert "GRPO training job submitted" in out
    code, out, err = _run(capsys, "train", "grpo", "-f", groups, "--adapter", "g-local", "--local", "--seed", "3")
    assert code == 0, err
    assert "trained 1 groups" in out
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps({"prompts": OPD_PROMPTS, "config": {"max_tokens": 6, "samples_per_prompt": 2}}), encoding="utf-8"
    )
    argv = ["train", "opd", "-f", prompts, "--adapter", "d", "--teacher", "big"]
    code, out, err = _run(capsys, *argv, "--url", server.url)
    assert code == 1
    assert out == ""
    assert err.startswith("error [teacher_not_found]:")
    assert "Traceback" not in err
    envelope = _json(capsys, "ErrorEnvelope", *argv, "--url", server.url, status=1)
    assert envelope["error"]["code"] == "teacher_not_found"
    # locally, against the local teacher registry
    code, out, err = _run(capsys, "teachers", "add", "big", "--kind", "local", "--model", tiny_model_dir, "--local")
    assert code == 0, err
    code, out, err = _run(capsys, *argv, "--local", "--seed", "4", "--model", tiny_model_dir)
    assert code == 0, err
    assert "optimizer steps over 2 candidates" in out
    assert "reverse KL" in out
    code, _, err = _run(capsys, *argv, "--local")
    assert code == 2  # the adapter exists now: refused before any model work
    assert "error [adapter_exists]" in err


def test_server_submissions_refuse_local_only_options(tmp_path, capsys):
    data = _jsonl(tmp_path / "rows.jsonl")
    code, _, err = _run(capsys, "train", "sft", "-f", data, "--adapter", "x", "--model", tmp_path)
    assert code == 2
    assert "--local" in err


# ----------------------------------------------------------------------------- adapters


def test_adapters_list_load_unload_delete_round_trip(server, tmp_path, capsys):
    data = _jsonl(tmp_path / "rows.jsonl")
    url = ["--url", server.url]
    code, _, err = _run(capsys, "train", "sft", "-f", data, "--adapter", "cycle", "--no-auto-load", "--wait", *url)
    assert code == 0, err
    code, out, _ = _run(capsys, "adapters", "list", *url)
    assert code == 0
    assert re.search(r"^cycle\s+available\s+16\s+32 .* sha256:[0-9a-f]{12}…\s+ok \(3 files bound\)$", out, re.M), out

    code, out, err = _run(capsys, "adapters", "load", "cycle", *url)
    assert code == 0, err
    assert out.startswith("✓ loaded cycle (content revision ")
    listing = _json(capsys, "AdaptersResponse", "adapters", "list", *url)
    assert listing["active_adapter"] == "cycle"
    _json(capsys, "LoadAdapterResponse", "adapters", "load", "cycle", "--reload", *url)

    code, _, err = _run(capsys, "adapters", "delete", "cycle", "--yes", *url)
    assert code == 1
    assert err.startswith("error [adapter_active]: ")
    assert "hint: unload it first" in err
    code, out, _ = _run(capsys, "adapters", "unload", *url)
    assert (code, out) == (0, "✓ unloaded: the server serves the base model\n")
    code, _, err = _run(capsys, "adapters", "delete", "cycle", *url)  # no terminal to confirm on
    assert code == 2
    assert "--yes" in err
    assert (server.home / "adapters" / "cycle").is_dir()
    deleted = _json(capsys, "DeleteAdapterResponse", "adapters", "delete", "cycle", "--yes", *url)
    assert deleted == {"status": "deleted", "name": "cycle"}
    assert not (server.home / "adapters" / "cycle").exists()
    assert "cycle" not in [e["name"] for e in _json(capsys, "AdaptersResponse", "adapters", "list", *url)["available"]]
    envelope = _json(capsys, "ErrorEnvelope", "adapters", "load", "cycle", *url, status=1)
    assert envelope["error"]["code"] == "adapter_not_found"


def test_adapters_list_with_an_adapter_dir_stays_local(tmp_path, capsys):
    code, out, _ = _run(capsys, "adapters", "list", "--adapter-dir", tmp_path / "empty", "--url", "http://127.0.0.1:9")
    assert code == 0
    assert out.startswith("no adapters in ")


def test_verify_with_a_url_passes_for_an_adapter_trained_on_that_server(server, trained, capsys):
    argv = ["adapters", "verify", "bot", "--adapter-dir", trained.parent, "--url", server.url]
    receipt = _json(capsys, "AdapterVerifyReceipt", *argv, "--prompt", "How do I reset my password?")
    assert receipt["status"] == "ok"
    assert [c["name"] for c in receipt["checks"]][-4:] == [
        "manifest_hashes", "server_load", "server_listed", "server_generation"
    ]  # fmt: skip
    summary = receipt["logit_delta_summary"]
    assert summary["url"] == server.url
    assert summary["passed"] is True
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    assert "✓ server_generation" in out


def test_verify_with_a_url_fails_when_the_server_holds_other_bytes_under_that_name(
    server, trained, trained_adapter, tmp_path, capsys
):
    local = tmp_path / "elsewhere" / "bot"  # a valid adapter named bot, trained elsewhere
    shutil.copytree(trained_adapter, local)
    receipt = _json(capsys, "AdapterVerifyReceipt", "adapters", "verify", local, "--url", server.url, status=1)
    last = receipt["checks"][-1]
    assert (last["name"], last["pass"]) == ("server_load", False)
    assert "the local one hashes to" in last["message"]


# ----------------------------------------------------------------------------- health, errors, auth


def test_health_prints_one_line_per_fact(server, capsys):
    code, out, err = _run(capsys, "health", "--url", server.url)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == "status: ok"
    assert lines[1].startswith("model: kiln-tiny")
    assert lines[2] == f"version: kiln {__version__}"
    assert re.fullmatch(r"execution identity: sha256:[0-9a-f]{64}", lines[3])
    assert re.fullmatch(r"base weights: sha256:[0-9a-f]{64}", lines[4])
    assert re.fullmatch(r"queue: \d+/32", lines[5])
    assert lines[6].startswith("active adapter: ")
    assert lines[7].startswith("active job: ")
    assert lines[8] == "serving copy: resident (cpu)"
    health = _json(capsys, "HealthResponse", "health", "--url", server.url)
    assert health["execution_identity"]["provenance_sha256"] == lines[3].split(": ")[1]


def test_an_unreachable_server_is_one_clear_line_never_a_traceback(tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    data = _jsonl(tmp_path / "rows.jsonl")
    for argv in (
        ["train", "status"],
        ["train", "cancel", "--job-id", "job-x"],
        ["train", "sft", "-f", data, "--adapter", "x"],
        ["adapters", "list"],
        ["adapters", "unload"],
        ["health"],
    ):
        code, out, err = _run(capsys, *argv, "--url", url)
        assert code == 1, argv
        assert out == ""
        assert err.splitlines()[0] == f"error: cannot reach the Kiln server at {url} (is `kiln serve` running?)"
        assert "Traceback" not in err


def test_the_url_defaults_to_kiln_url(server, monkeypatch, capsys):
    monkeypatch.setenv("KILN_URL", server.url)
    code, out, _ = _run(capsys, "health")
    assert code == 0
    assert out.startswith("status: ok")


def test_a_server_with_an_api_key_refuses_without_it_and_works_with_it(
    tmp_path, tiny_model_dir, trained_adapter, monkeypatch, capsys
):
    def server_load(*argv):
        receipt = _json(capsys, "AdapterVerifyReceipt", "adapters", "verify", trained_adapter, *argv, status=1)
        assert receipt["checks"][-1]["name"] == "server_load"
        return receipt["checks"][-1]["message"]

    with ServerProcess(tmp_path / "home", tiny_model_dir, env={"KILN_API_KEY": "s3cret"}) as keyed:
        url = ["--url", keyed.url]
        code, out, err = _run(capsys, "train", "status", *url)
        assert (code, out) == (1, "")
        assert err.startswith("error [unauthorized]: ")
        envelope = _json(capsys, "ErrorEnvelope", "adapters", "list", *url, "--api-key", "wrong", status=1)
        assert envelope["error"]["code"] == "unauthorized"
        code, out, err = _run(capsys, "train", "status", *url, "--api-key", "s3cret")
        assert code == 0, err
        assert out.startswith("no training jobs on ")
        assert _run(capsys, "health", *url)[0] == 0  # /health needs no key
        assert "[unauthorized]" in server_load(*url)
        assert "[adapter_not_found]" in server_load(*url, "--api-key", "s3cret")  # admitted, but it has no bot
        monkeypatch.setenv("KILN_API_KEY", "s3cret")
        _json(capsys, "AdaptersResponse", "adapters", "list", *url)


class _DetailAfterSigint:
    """A client whose job detail, on the second poll, delivers SIGINT while Python runs a finalizer.

    Python raises ``KeyboardInterrupt`` wherever the main thread happens to be when it checks for signals; inside a
    ``__del__`` (garbage collection runs them at arbitrary allocations) the exception is printed as "Exception
    ignored" and swallowed. A follow loop that relies on catching ``KeyboardInterrupt`` then never stops watching.
    """

    def __init__(self, finished_state):
        self.polls = 0
        self.finished_state = finished_state

    def _detail(self, job_id):
        self.polls += 1

        class Finalized:
            def __del__(self):
                signal.raise_signal(signal.SIGINT)

        if self.polls == 2:
            Finalized()  # its __del__ runs here and receives the signal
        state = self.finished_state if self.polls >= 4 else "running"
        return {"job_id": job_id, "state": state, "progress": min(1.0, self.polls / 4), "current_loss": None,
                "result": None, "error": None, "adapter_name": "a", "adapter_path": None, "latest_checkpoint": None,
                "suite": "s", "adapter": None}  # fmt: skip

    get_training_job = _detail
    get_eval_job = _detail


@pytest.mark.parametrize("command", ["train", "eval"])
def test_ctrl_c_stops_watching_even_when_it_lands_inside_a_finalizer(command, capsys, monkeypatch):
    from kiln.cli import _evals, _jobs

    monkeypatch.setattr(_jobs, "POLL_S", 0.01)
    monkeypatch.setattr(_evals, "POLL_S", 0.01)
    client = _DetailAfterSigint("completed")
    args = build_parser().parse_args(["train", "status", "--url", "http://127.0.0.1:9"])
    args.json = False
    code = _jobs._follow(client, args, "job-x", "sft") if command == "train" else _evals._follow(client, args, "eval-x")
    err = capsys.readouterr().err
    assert code == 130, err
    assert client.polls == 2, "the loop went on polling after Ctrl-C"
    assert "keeps running on the server" in err
