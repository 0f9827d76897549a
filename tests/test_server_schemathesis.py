"""Property tests of the served OpenAPI document: schemathesis against a live server.

Every operation gets generated requests, valid and invalid; no answer may be a 5xx, and
every answer must match its documented status, content type and schema. Job, adapter
and receipt routes get real identifiers (a finished job and its adapter) so the tests
reach past the 404s.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from _server import ServerProcess, wait_for
from conftest import ADAPTER_CONVERSATIONS

pytestmark = pytest.mark.slow

CHECKS = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"


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
            ),
            encoding="utf-8",
        )
        run = subprocess.run(
            [
                cli,
                "--config-file",
                str(config),
                "run",
                f"{proc.url}/openapi.json",
                "--checks",
                CHECKS,
                "--phases",
                "examples,fuzzing",
                "--max-examples",
                "25",
                "--workers",
                "2",
                "--seed",
                "20261129",
                "--request-timeout",
                "300",  # a 4,096-token completion on a busy 2-core CI machine is slow, not wrong
                "--exclude-operation-id",
                "delete_training_job",  # would forget the job the other routes are pointed at
                "--exclude-operation-id",
                "delete_adapter",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,  # schemathesis keeps a .schemathesis/ folder in its working directory
            check=False,
        )
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        assert "passed" in run.stdout
