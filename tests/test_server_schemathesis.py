"""Property tests of the served OpenAPI document: schemathesis against a live server.

Every operation gets generated requests, valid and invalid (schemathesis's coverage and fuzzing phases -- fuzzing
only for the training bodies, whose coverage phase alone takes minutes --, a fixed seed, one worker). No answer may
be a server fault (a 5xx other than the designed 502 of an unreachable teacher and 503 of a full queue); every
answer must match its documented status, content type and schema; a request the schema allows must not be refused as
malformed (``positive_data_acceptance``, on every operation but the three training submissions and the suite
registration: see ``TRAINING``) and a request it forbids must be (``negative_data_rejection``): the schema states
what the server enforces. Those two checks accept schemathesis's default statuses plus 413 (the server's configured
body limit, a deployment setting no schema states). Job, adapter and receipt routes get real identifiers (a finished
job and its adapter) so the tests reach past the 404s. docs/server.md ("What the schema states") lists what only the
server's state can refuse.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from _server import ServerProcess, wait_for
from conftest import ADAPTER_CONVERSATIONS

pytestmark = pytest.mark.slow

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
    "positive_data_acceptance,negative_data_rejection"
)
# Whether these are accepted also depends on what no JSON Schema can state -- a training submission's rows tokenized
# by the served model, the bytes of an uploaded file it names, the teacher registry; an evaluation suite's regex
# compiled by Python's re (JSON Schema's `regex` format is ECMA-262, which disagrees with it both ways) -- so they run
# every check but positive_data_acceptance. Every other rule a request body can break by itself is in its schema.
TRAINING = ("submit_sft_training", "submit_grpo_training", "submit_opd_training", "register_eval_suite")
DESTRUCTIVE = (
    "delete_training_job",
    "delete_adapter",
)  # would forget the job and adapter the other routes are pointed at
SERVER_OK = ["2xx", "3xx", "4xx", "502", "503"]  # 502 teacher_unreachable, 503 queue_full: designed answers, not faults
POSITIVE = [200, 201, 202, 401, 403, 404, 409, 413, 429, 500, 501, 502, 503]  # schemathesis's defaults, plus 413
NEGATIVE = [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]


def test_schemathesis_finds_no_server_error_and_no_schema_violation(tmp_path, tiny_model_dir):
    cli = shutil.which("schemathesis")
    assert cli, "schemathesis is a dev dependency (pip install -e '.[dev]')"
    with ServerProcess(tmp_path / "home", tiny_model_dir) as proc, proc.client() as http:
        job = http.post(
            "/v1/train/sft",
            json={
                "examples": ADAPTER_CONVERSATIONS,
                "config": {"epochs": 1, "output_name": "fuzzed", "auto_load": False},
            },
        ).json()["job_id"]
        wait_for(lambda: http.get(f"/v1/train/jobs/{job}").json()["state"] == "completed")
        config = tmp_path / "schemathesis.toml"
        config.write_text(
            "[parameters]\n"
            + "".join(
                f'"path.{name}" = {json.dumps(value)}\n'
                for name, value in (("job_id", job), ("name", "fuzzed"), ("alias", "no-such-teacher"))
            )
            + f"\n[checks.not_a_server_error]\nexpected-statuses = {json.dumps(SERVER_OK)}\n"
            + f"\n[checks.positive_data_acceptance]\nexpected-statuses = {json.dumps(POSITIVE)}\n"
            + f"\n[checks.negative_data_rejection]\nexpected-statuses = {json.dumps(NEGATIVE)}\n",
            encoding="utf-8",
        )
        for operations, checks, phases in (
            ([f"--exclude-operation-id={op}" for op in (*TRAINING, *DESTRUCTIVE)], CHECKS, "examples,coverage,fuzzing"),
            # the coverage phase of the training bodies alone takes two minutes on two cores; fuzzing still sends
            # them valid and invalid data
            (
                [f"--include-operation-id={op}" for op in TRAINING],
                CHECKS.replace(",positive_data_acceptance", ""),
                "examples,fuzzing",
            ),
        ):
            run = subprocess.run(
                [
                    cli,
                    "--config-file",
                    str(config),
                    "run",
                    f"{proc.url}/openapi.json",
                    "--checks",
                    checks,
                    "--phases",
                    phases,
                    "--max-examples",
                    "25",
                    "--workers",
                    "1",  # hypothesis's lambda descriptions are not thread-safe on Python 3.11 (an AST recursion error)
                    "--seed",
                    "20261129",
                    "--request-timeout",
                    "300",  # a 4,096-token completion on a busy 2-core CI machine is slow, not wrong
                    *operations,
                ],
                capture_output=True,
                text=True,
                timeout=900,
                cwd=tmp_path,  # schemathesis keeps a .schemathesis/ folder in its working directory
                check=False,
            )
            assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
            assert "passed" in run.stdout
