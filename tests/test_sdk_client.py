"""The generated SDK (kiln_contracts.client): one typed method per route, errors and streams as documented."""

from __future__ import annotations

import copy
import inspect
import json
import re
import socket
from pathlib import Path

import httpx
import kiln_contracts.client as sdk
import pytest
from kiln_contracts import openapi_document
from kiln_contracts.client import KilnApiError, KilnClient, KilnConnectionError
from kiln_contracts.models.kiln_control_plane_v1_schema import (
    CancelTrainingJobResponse2,
    ChatCompletionChunk,
    ChatCompletionRequest,
    SftRequest,
    TrainingResponse,
    TrainingStatus,
)
from pydantic import RootModel

from codegen._bundle import SchemaSourceError
from codegen._client import generate_client

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES: dict[str, list] = {}
for _path in sorted((ROOT / "schemas").glob("*.schema.json")):
    for _name, _examples in json.loads(_path.read_text(encoding="utf-8")).get("x-kiln-examples", {}).items():
        EXAMPLES.setdefault(_name, []).extend(_examples)

OPERATIONS = [
    (path, method, op)
    for path, ops in sorted(openapi_document()["paths"].items())
    for method, op in sorted(ops.items())
]


def _ref_name(content: dict | None) -> str | None:
    schema = (content or {}).get("application/json", {}).get("schema", {})
    return schema["$ref"].rsplit("/", 1)[1] if "$ref" in schema else None


def _call(client: KilnClient, op: dict, body: object = None, *, suffix: str = ""):
    """Call the method of an operation with placeholder path parameters and the given body."""
    args: list[object] = ["x"] * len([p for p in op.get("parameters", []) if p["in"] == "path"])
    if "requestBody" in op:
        raw = "application/json" not in op["requestBody"]["content"]  # an upload takes bytes
        args.append((b"{}\n" if raw else {}) if body is None else body)
    return getattr(client, op["operationId"] + suffix)(*args)


def _client(handler, **kwargs) -> KilnClient:
    return KilnClient("http://kiln.test", transport=httpx.MockTransport(handler), **kwargs)


def _json_answer(body: object, status: int = 200, **headers: str):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body, headers=headers)

    return handler


def _chunk(content: str | None, finish: str | None = None) -> dict:
    delta = {"content": content} if content is not None else {}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }


def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SFT_EXAMPLE = {
    "examples": [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
}


def test_every_route_in_the_openapi_document_has_a_client_method():
    expected = {op["operationId"] for _, _, op in OPERATIONS}
    expected |= {
        op["operationId"] + "_stream"
        for _, _, op in OPERATIONS
        if "text/event-stream" in op["responses"]["200"].get("content", {})
    }
    methods = {n for n, v in vars(KilnClient).items() if callable(v) and not n.startswith("_")} - {"close"}
    assert methods == expected


@pytest.mark.parametrize(("path", "method", "op"), OPERATIONS, ids=[op["operationId"] for _, _, op in OPERATIONS])
def test_each_method_calls_its_route_and_is_typed_and_documented(path, method, op):
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(500, text="stop here")

    with _client(handler) as client, pytest.raises(KilnApiError):
        _call(client, op)
    assert seen[0].method == method.upper()
    assert seen[0].url.path == re.sub(r"\{[^}]+\}", "x", path)
    function = getattr(KilnClient, op["operationId"])
    assert " ".join(inspect.getdoc(function).split("\n\n")[0].split()) == op["summary"]
    returned = inspect.signature(function).return_annotation  # a string: the module uses postponed annotations
    name = _ref_name(op["responses"]["200"].get("content"))
    if name is None:
        assert returned == "str"
    else:
        assert returned == name or issubclass(getattr(sdk, name), RootModel)


def test_path_parameters_are_quoted_into_a_single_segment():
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=EXAMPLES["TrainReceipt"][0])

    with _client(handler) as client:
        client.get_adapter_receipt("a/b c?d#e%")
        with pytest.raises(ValueError, match="non-empty"):
            client.get_training_job("")
    assert seen[0].url.raw_path == b"/v1/adapters/a%2Fb%20c%3Fd%23e%25/receipt"


def test_the_api_key_is_sent_as_a_bearer_header_and_omitted_without_one():
    headers: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get("Authorization"))
        return httpx.Response(200, text="# metrics\n")

    with _client(handler, api_key="s3cret") as client:
        client.get_metrics()
    with _client(handler) as client:
        client.get_metrics()
    assert headers == ["Bearer s3cret", None]


JSON_ROUTES = [
    (op, example)
    for _, _, op in OPERATIONS
    for example in EXAMPLES.get(_ref_name(op["responses"]["200"].get("content")) or "", [])[:1]
]


@pytest.mark.parametrize(("op", "example"), JSON_ROUTES, ids=[op["operationId"] for op, _ in JSON_ROUTES])
def test_a_200_json_body_is_returned_as_the_route_model(op, example):
    with _client(_json_answer(example)) as client:
        result = _call(client, op)
    name = _ref_name(op["responses"]["200"]["content"])
    model = getattr(sdk, name)
    if issubclass(model, RootModel):  # returned as its root value: a list of models or one union branch
        result = model(result)
    else:
        assert type(result) is model
    assert result.model_dump(mode="json", exclude_unset=True, by_alias=True) == example


def test_root_model_answers_are_returned_as_their_root_value():
    status = max(EXAMPLES["TrainingStatusList"], key=len)
    cancelled = next(e for e in EXAMPLES["CancelTrainingJobResponse"] if e["status"] == "cancelled")
    with _client(_json_answer(status)) as client:
        listed = client.list_training_status()
    with _client(_json_answer(cancelled)) as client:
        cancel = client.cancel_training_job("job-1")
    assert isinstance(listed, list)
    assert listed
    assert all(isinstance(item, TrainingStatus) for item in listed)
    assert isinstance(cancel, CancelTrainingJobResponse2)
    assert (cancel.job_id, cancel.status) == (cancelled["job_id"], "cancelled")


def test_text_routes_return_the_body_as_a_string():
    with _client(lambda request: httpx.Response(200, text="kiln_queue_depth 0\n")) as client:
        assert client.get_metrics() == "kiln_queue_depth 0\n"


def test_a_queue_full_envelope_raises_an_api_error_with_its_code_and_retry_after():
    envelope = {"error": {"code": "queue_full", "message": "the queue holds 8 jobs", "hint": "retry later"}}
    with _client(_json_answer(envelope, 503, **{"Retry-After": "30"})) as client, pytest.raises(KilnApiError) as info:
        client.submit_sft_training(SFT_EXAMPLE)
    error = info.value
    assert (error.status_code, error.code, error.message) == (503, "queue_full", "the queue holds 8 jobs")
    assert (error.hint, error.pointer, error.retry_after) == ("retry later", None, 30)
    assert "queue_full" in str(error)


def test_an_envelope_pointer_is_kept_and_retry_after_is_none_without_the_header():
    envelope = {"error": {"code": "unknown_field", "message": "unknown field bogus", "hint": None, "pointer": "/bogus"}}
    with _client(_json_answer(envelope, 400)) as client, pytest.raises(KilnApiError) as info:
        client.submit_sft_training({"bogus": 1})
    assert (info.value.code, info.value.pointer, info.value.hint, info.value.retry_after) == (
        "unknown_field",
        "/bogus",
        None,
        None,
    )


@pytest.mark.parametrize("body", ["Internal Server Error", '{"detail": "Not Found"}', ""])
def test_a_non_envelope_error_body_still_raises_an_api_error(body):
    with _client(lambda request: httpx.Response(500, text=body)) as client, pytest.raises(KilnApiError) as info:
        client.get_health()
    assert (info.value.status_code, info.value.code) == (500, "internal_error")
    assert info.value.message == (body or "HTTP 500 with an empty body")


def test_the_event_stream_yields_chunks_and_stops_at_done():
    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        body = (
            b": keep-alive\n\n"
            + _sse(json.dumps(_chunk("Hel")), json.dumps(_chunk("lo", "stop")), "[DONE]")
            + b"data: not json, never read\n\n"
        )
        return httpx.Response(200, content=body, headers={"Content-Type": "text/event-stream; charset=utf-8"})

    with _client(handler) as client:
        chunks = list(client.create_chat_completion_stream(ChatCompletionRequest.model_validate(CHAT)))
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert [c.choices[0].delta.content for c in chunks] == ["Hel", "lo"]
    assert sent == [{**CHAT, "stream": True}]


def test_a_stream_cut_before_done_raises_a_connection_error():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200, content=_sse(json.dumps(_chunk("Hel"))), headers={"Content-Type": "text/event-stream"}
        )

    with _client(handler) as client:
        stream = client.create_chat_completion_stream(CHAT)
        assert next(stream).choices[0].delta.content == "Hel"
        with pytest.raises(KilnConnectionError, match=r"ended before `data: \[DONE\]`"):
            next(stream)


def test_an_error_answer_to_a_stream_request_raises_an_api_error():
    envelope = {"error": {"code": "adapter_not_found", "message": "no adapter nope", "hint": None}}
    with _client(_json_answer(envelope, 404)) as client, pytest.raises(KilnApiError) as info:
        list(client.create_chat_completion_stream({**CHAT, "adapter": "nope"}))
    assert (info.value.status_code, info.value.code) == (404, "adapter_not_found")


def test_the_non_streaming_method_refuses_stream_true():
    with _client(_json_answer({})) as client, pytest.raises(ValueError, match="create_chat_completion_stream"):
        client.create_chat_completion({**CHAT, "stream": True})


@pytest.mark.parametrize("seed", [7, "7", 18446744073709551615])
def test_dict_and_model_bodies_both_send_the_expected_json(seed):
    sent: list[object] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(200, json=EXAMPLES["TrainingResponse"][0])

    body = {**SFT_EXAMPLE, "config": {"seed": seed, "epochs": 2}}
    unknown = {**body, "not_a_field": True}
    with _client(handler) as client:
        assert isinstance(client.submit_sft_training(SftRequest.model_validate(body)), TrainingResponse)
        client.submit_sft_training(body)
        client.submit_sft_training(unknown)  # a dict goes out as-is: rejecting it is the server's job
    assert sent == [body, body, unknown]


REQUEST_EXAMPLES = [
    (op, example)
    for _, _, op in OPERATIONS
    if "requestBody" in op
    for example in EXAMPLES.get(_ref_name(op["requestBody"]["content"]) or "", [])
]


@pytest.mark.parametrize(("op", "example"), REQUEST_EXAMPLES, ids=[op["operationId"] for op, _ in REQUEST_EXAMPLES])
def test_every_request_example_is_sent_unchanged_as_a_model(op, example):
    sent: list[object] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(json.loads(request.content))
        return httpx.Response(500, text="stop here")

    model = getattr(sdk, _ref_name(op["requestBody"]["content"])).model_validate(copy.deepcopy(example))
    with _client(handler) as client, pytest.raises(KilnApiError):
        _call(client, op, model)
    assert sent == [example]


def test_connection_refused_raises_a_connection_error_naming_the_url():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with KilnClient(f"http://127.0.0.1:{port}/", timeout=5) as client, pytest.raises(KilnConnectionError) as info:
        client.get_health()
    assert info.value.url == f"http://127.0.0.1:{port}/health"
    assert info.value.url in str(info.value)
    assert "kiln serve" in str(info.value)
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def test_a_timeout_raises_a_connection_error():
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=request)

    with _client(handler, timeout=0.5) as client, pytest.raises(KilnConnectionError, match=r"within 0\.5s"):
        client.get_config()


def test_the_client_closes_its_connections_as_a_context_manager():
    with _client(_json_answer({})) as client:
        pass
    assert client._http.is_closed


ROUTE = {"method": "GET", "path": "/a", "operation_id": "get_a", "responses": {"200": "A"}, "summary": "A."}
MODEL_TEXT = {"kiln_x_v1_schema": "class A(BaseModel):\n    pass\n"}


@pytest.mark.parametrize(
    ("routes", "message"),
    [
        ([ROUTE, {**ROUTE, "path": "/b"}], "already generated"),
        ([{**ROUTE, "operation_id": "close"}], "reserved"),
        ([{**ROUTE, "operation_id": "get-a"}], "not a public Python method name"),
        ([{**ROUTE, "path": "/a/{class}"}], "not a usable Python name"),
        ([{**ROUTE, "responses": {"200": "Missing"}}], "names no definition"),
        ([{**ROUTE, "responses": {"200": "B"}}], "has no class B"),
        ([{**ROUTE, "responses": {"404": "A"}}], "no 2xx response"),
        (
            [
                {**ROUTE, "method": "POST", "request": "A", "stream_response": "A"},
                {**ROUTE, "path": "/b", "operation_id": "get_a_stream"},
            ],
            "already generated",
        ),
    ],
)
def test_codegen_refuses_colliding_names_and_unimportable_definitions(routes, message):
    owner = {"A": "kiln-x-v1.schema.json", "B": "kiln-x-v1.schema.json"}
    with pytest.raises(SchemaSourceError, match=message):
        generate_client(routes, ["kiln-x-v1.schema.json"], owner, MODEL_TEXT, {"kiln-x-v1.schema.json": "sha256:0"})
