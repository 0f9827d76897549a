"""The generated SDK drives a whole SFT job against a real server, and the wire bodies it
saw validate against Kiln's schemas and, for the objects spec/10 names, against the
reference implementation's published contracts (skipped when ``../shared`` is absent)."""

from __future__ import annotations

import json

import httpx
import pytest
from _server import ServerProcess, wait_for
from _upstream import UPSTREAM, upstream_validator
from conftest import ADAPTER_CONVERSATIONS
from kiln_contracts.client import KilnApiError, KilnClient
from kiln_contracts.models import kiln_control_plane_v1_schema as cp

from kiln import contracts

pytestmark = pytest.mark.slow

# route template -> (Kiln definition, spec/10 compatibility target or None)
ROUTES = {
    ("POST", "/v1/train/sft"): ("TrainingResponse", "TrainingResponse"),
    ("GET", "/v1/train/jobs/{id}"): ("TrainingJobDetail", "TrainingJobDetail"),
    ("GET", "/v1/train/status"): ("TrainingStatusList", None),
    ("GET", "/v1/train/queue"): ("QueueResponse", "QueueResponse"),
    ("GET", "/v1/adapters"): ("AdaptersResponse", "AdaptersResponse"),
    ("POST", "/v1/adapters/load"): ("LoadAdapterResponse", "LoadAdapterResponse"),
    ("POST", "/v1/adapters/unload"): ("UnloadAdapterResponse", "UnloadAdapterResponse"),
    ("DELETE", "/v1/adapters/{name}"): ("DeleteAdapterResponse", "DeleteAdapterResponse"),
    ("POST", "/v1/chat/completions"): ("ChatCompletionResponse", None),
    ("GET", "/health"): ("HealthResponse", None),
    ("GET", "/v1/config"): ("ConfigResponse", None),
}


class Recorder(httpx.HTTPTransport):
    """Keeps every JSON answer with its method and path, as the SDK received it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str, int, object]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if response.headers.get("content-type", "").startswith("application/json"):
            response.read()
            self.seen.append((request.method, request.url.path, response.status_code, json.loads(response.content)))
        return response


def _v(value: object) -> object:
    """The plain value of a generated RootModel (pattern-checked strings are RootModels)."""
    return getattr(value, "root", value)


def _template(method: str, path: str) -> tuple[str, str]:
    parts = path.split("/")
    if path.startswith("/v1/train/jobs/"):
        return method, "/v1/train/jobs/{id}"
    if method == "DELETE" and path.startswith("/v1/adapters/"):
        return method, "/v1/adapters/{name}"
    return method, "/".join(parts)


def test_the_sdk_drives_a_full_sft_job_and_every_body_matches_both_contracts(tmp_path, tiny_model_dir):
    recorder = Recorder()
    with (
        ServerProcess(tmp_path / "home", tiny_model_dir) as proc,
        KilnClient(proc.url, transport=recorder) as kiln,
    ):
        request = cp.SftRequest.model_validate(
            {"examples": ADAPTER_CONVERSATIONS, "config": {"epochs": 3, "seed": "99", "output_name": "sdk-bot"}}
        )
        submitted = kiln.submit_sft_training(request)
        assert _v(submitted.effective_seed) == "99"
        assert submitted.state == "queued"
        done = wait_for(
            lambda: (j := kiln.get_training_job(_v(submitted.job_id))).state.value in ("completed", "failed") and j
        )
        assert done.state.value == "completed", done.error
        assert done.progress == 1.0
        assert len(done.loss_history) == 3 * len(ADAPTER_CONVERSATIONS)
        assert done.train_receipt is not None
        assert [_v(s.job_id) for s in kiln.list_training_status()] == [_v(submitted.job_id)]
        kiln.get_training_queue()

        adapters = kiln.list_adapters()  # auto_load (the default) served it once its canary passed
        assert _v(adapters.active_adapter) == "sdk-bot"
        entry = next(a for a in adapters.available if _v(a.name) == "sdk-bot")
        assert entry.canary_status.value == "passed"
        assert kiln.get_adapter_receipt("sdk-bot").status.value == "success"

        answer = kiln.create_chat_completion({"messages": [{"role": "user", "content": "How do I reset my password?"}]})
        assert _v(answer.kiln.adapter) == "sdk-bot"
        streamed = "".join(
            c.choices[0].delta.content or ""
            for c in kiln.create_chat_completion_stream(
                {"messages": [{"role": "user", "content": "How do I reset my password?"}]}
            )
        )
        assert streamed == answer.choices[0].message.content

        with pytest.raises(KilnApiError) as refused:
            kiln.delete_adapter("sdk-bot")
        assert refused.value.code == "adapter_active"
        assert refused.value.status_code == 409
        kiln.unload_adapter()
        assert _v(kiln.load_adapter({"name": "sdk-bot"}).name) == "sdk-bot"
        kiln.unload_adapter()
        assert kiln.delete_adapter("sdk-bot").status == "deleted"
        kiln.get_health()
        kiln.get_config()

    checked = 0
    for method, path, status, body in recorder.seen:
        key = _template(method, path)
        if status != 200 or key not in ROUTES:
            continue
        ours, upstream = ROUTES[key]
        assert contracts.problems(ours, body) == [], (method, path)
        if upstream and UPSTREAM.is_dir():
            validator, _ = upstream_validator(upstream)
            errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]
            assert errors == [], (method, path, errors)
        checked += 1
    assert checked >= len(ROUTES)
