"""The FastAPI application: routes, error envelope, bearer auth and body bounds.

Longer than 600 lines: every route of the HTTP API is declared here, so the route table reads as the API; each
handler only parses, authorises and delegates to the module that does the work.

Bodies are read and parsed here with Kiln's strict JSON reader (duplicate keys, NaN and
oversized bodies are refused) and validated against the generated schemas, so every
error, from a malformed body to a full queue, leaves as ``{"error": {code, message,
hint[, pointer]}}`` with the HTTP status the schema assigns to the code. FastAPI's own
OpenAPI generation is off: ``/openapi.json`` serves the document codegen built from the
schemas.
"""

from __future__ import annotations

import copy
import hmac
import ipaddress
import json
import logging
import os
import resource
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import kiln_contracts
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln import __version__, contracts
from kiln.documents.jsonio import JsonObject, parse_json
from kiln.errors import (
    AuthError,
    CapacityError,
    ContractError,
    InternalError,
    KilnError,
    NotFoundError,
    Problem,
    RequestError,
)
from kiln.host.config import Settings, resolve_settings
from kiln.host.fs import writable_problem
from kiln.server import _audits, _datasets, _evals, _openai, _tokenize, _training
from kiln.server._drain import drain_refused, unread
from kiln.server._jobs import Job, JobManager, JobStore, Outcome, Runner, family

log = logging.getLogger("kiln.server")
STATIC = Path(__file__).parent / "static"
RETRY_AFTER_S = 30
OPEN_ROUTES = ("/health", "/ui")  # everything else needs the bearer key when one is configured


def _http_statuses() -> dict[str, int]:
    return kiln_contracts.load_bundle()["$defs"]["ErrorCode"]["x-kiln-http-status"]


OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/tokenizer_info")


def openai_fields(error: JsonObject, status: int) -> JsonObject:
    """``error`` (an ``ErrorBody``) with OpenAI's ``type`` (from the status) and ``param`` (the pointer, dotted):
    what the official clients read as ``e.type`` and ``e.param``."""
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error"}.get(status)
    if kind is None and error.get("code") == "queue_full":
        kind = "rate_limit_error"
    if kind is None:
        kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    pointer = error.get("pointer")
    param = ".".join(pointer.strip("/").split("/")) if isinstance(pointer, str) and pointer.strip("/") else None
    return {**error, "type": kind, "param": param}


def error_response(exc: KilnError, path: str | None = None) -> JSONResponse:
    """The error envelope of ``exc`` at its status; on the OpenAI-compatible routes (``path``) with OpenAI's fields."""
    status = _HTTP_STATUS.get(exc.code, 500)
    headers = {}
    if exc.code in ("queue_full", "serving_unavailable"):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    if exc.code == "unauthorized":
        headers["WWW-Authenticate"] = "Bearer"
    error = exc.as_envelope()["error"]
    assert isinstance(error, dict)
    return JSONResponse(_envelope(error, status, path), status_code=status, headers=headers)


def _envelope(error: JsonObject, status: int, path: str | None) -> JsonObject:
    """``{"error": error}``, with OpenAI's fields on the OpenAI-compatible routes."""
    openai = path is not None and path.startswith(OPENAI_PATHS)
    return {"error": openai_fields(error, status) if openai else error}


_HTTP_STATUS = _http_statuses()


@dataclass
class Server:
    """Everything the routes read: settings, model identity, jobs, generation and counters."""

    settings: Settings
    engine: _training.Engine
    jobs: JobManager
    generator: Any
    identity: Any  # kiln.model.ModelIdentity of the served base model
    model_name: str
    model_source: str
    started: float = field(default_factory=time.time)
    webhook_failures: int = 0
    adapter_cache: dict[str, Any] = field(default_factory=dict)  # registry entries by stat key
    adapter_lock: threading.Lock = field(default_factory=threading.Lock)  # one listing at a time
    teacher_protocol: Any = None  # kiln.server._teacher_protocol.TeacherProtocol (base card, prompt scoring)
    model_path: Path | None = None  # the served model's directory

    @property
    def registry(self) -> Path:
        return self.settings.registry

    @property
    def teachers(self) -> Any:
        """The teacher registry under the server's home (``kiln.teachers.TeacherRegistry``)."""
        from kiln.teachers import TeacherRegistry, teachers_root

        roots = (*self.settings.data_roots, self.settings.models_dir)
        if self.model_path is not None:
            roots = (*roots, self.model_path)  # the served model may teach
        return TeacherRegistry(
            teachers_root(self.settings.home), adapter_registry=self.settings.registry, model_roots=roots
        )


# ----------------------------------------------------------------------------- building the server


def by_job_type(runners: Mapping[str, Runner]) -> Runner:
    """One runner from the handler of each job type (each training kind, ``eval``): the queue runs every job the same
    way, and each type's module runs its own."""

    def run(job: Job, cancel: threading.Event, report: Callable[[dict[str, Any]], None]) -> Outcome:
        handler = runners.get(job.job_type)
        if handler is None:
            return Outcome("failed", f"internal_error: no handler runs jobs of type {job.job_type!r}")
        return handler(job, cancel, report)

    return run


def _notify(settings: Settings, server_ref: list[Server]) -> Any:
    url = settings.training.webhook_url

    def on_terminal(job: Any) -> None:
        if not url:
            return

        def post() -> None:
            import httpx

            body = {"event": "training_job.terminal", "job": job.status()}
            try:
                httpx.post(url, json=body, timeout=5.0, follow_redirects=False)
            except httpx.HTTPError as exc:
                log.warning("webhook %s failed for job %s: %s", url, job.job_id, exc)
                if server_ref:
                    server_ref[0].webhook_failures += 1

        threading.Thread(target=post, name="kiln-webhook", daemon=True).start()

    return on_terminal


def build_server(settings: Settings) -> Server:
    """Resolve the serving device, load the base model onto it, capture its identity, open the job store and start
    the worker."""
    import dataclasses

    from kiln.model import (
        apply_determinism,
        capture_identity,
        load_base_model,
        load_weights,
        resolve_device,
        resolve_model_path,
    )
    from kiln.server._generation import Generator
    from kiln.server._serving import Serving, served_bytes
    from kiln.server._teacher_protocol import build_protocol
    from kiln.trainers import TRAINERS

    # a device this machine lacks stops the server here (training_backend_unsupported), before any weight loads;
    # CUDA's determinism settings before anything initialises it
    device = resolve_device(str(settings.model.device), field="model.device", pointer=None)
    apply_determinism(device)
    path, is_default = resolve_model_path(settings=settings)
    loaded = load_base_model(path, is_default=is_default)
    # training works on private copies of pristine weights, in host memory, with a tokenizer of its own; generation
    # owns `served` (on `device`) and may wrap it with adapters
    base = dataclasses.replace(loaded, tokenizer=copy.deepcopy(loaded.tokenizer))
    if device == "cpu":
        base = dataclasses.replace(base, model=copy.deepcopy(loaded.model))
    served = load_weights(loaded, device=device)  # onto the device: a copy, the host one stays `base`'s
    identity = capture_identity(path, served.tokenizer, device=device, server_config=settings.redacted())
    model_name = "kiln-tiny-default" if is_default else path.name
    generator = Generator(served, settings.registry, model_name)
    protocol = build_protocol(generator, served, model_name, identity.base_weight_shard_manifest)
    serving = Serving(
        generator=generator,
        path=Path(path),
        is_default=is_default,
        device=device,
        precision=served.precision,
        bytes=served_bytes(served.model) + generator.packed_bytes,
        policy=str(settings.training.serving_copy),
        while_released=str(settings.training.while_released),
    )
    engine = _training.Engine(
        settings=settings,
        base=base,
        generator=generator,
        base_sha256=identity.base_weight_shard_manifest["aggregate_sha256"],
        model_path=Path(path),
        model_is_default=is_default,
        serving=serving,
    )
    ref: list[Server] = []
    jobs = JobManager(
        JobStore(settings.job_store),
        max_queued=settings.training.max_queued_jobs,
        runner=by_job_type(
            {
                **{kind: partial(_training.run, engine) for kind in TRAINERS},
                "eval": lambda job, cancel, _report: _evals.run_job(engine, job, cancel),
                "audit": lambda job, cancel, _report: _audits.run_job(engine, job, cancel),
            }
        ),
        on_terminal=_notify(settings, ref),
        interrupted=lambda job: interrupted_reason(settings.registry, job),
    )
    engine.jobs = jobs
    server = Server(
        settings=settings,
        engine=engine,
        jobs=jobs,
        generator=generator,
        identity=identity,
        model_name=model_name,
        model_source="builtin_default" if is_default else "local_path",
        teacher_protocol=protocol,
        model_path=Path(path),
    )
    ref.append(server)
    return server


# ----------------------------------------------------------------------------- the app


def _json_media_type(content_type: str | None) -> bool:
    """``application/json`` or ``application/<anything>+json``, any parameters; an absent header reads as JSON."""
    if content_type is None:
        return True
    kind, _, subtype = content_type.partition(";")[0].strip().lower().partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _too_large(size: str, limit: int) -> CapacityError:
    return CapacityError(
        f"request body {size} exceeds server.max_request_bytes ({limit} bytes)",
        code="payload_too_large",
        hint="send the rows as a dataset_path file, or raise server.max_request_bytes (KILN_SERVER_MAX_REQUEST_BYTES)",
    )


async def _body(request: Request, server: Server) -> Any:
    """The JSON body, bounded before it is buffered: a declared length over the limit is refused before a byte is
    read, a chunked body as soon as the bytes read pass it; a body declared as anything but JSON is refused."""
    content_type = request.headers.get("content-type")
    if not _json_media_type(content_type):
        raise unread(
            RequestError(
                f"the body is declared as {content_type!r}; this route reads application/json",
                code="unsupported_media_type",
                hint="send Content-Type: application/json",
            )
        )
    limit = server.settings.server.max_request_bytes
    declared = request.headers.get("content-length", "").strip()
    if declared.isdigit() and int(declared) > limit:
        raise unread(_too_large(f"of {declared} bytes", limit))
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise _too_large(f"of more than {limit} bytes", limit)
    if not data.strip():
        raise ContractError([Problem("missing_field", "", "the request needs a JSON body")])
    return parse_json(bytes(data), source="request body", limit=limit)


def _check(definition: str, body: Any) -> None:
    found = contracts.problems(definition, body)
    if found:
        raise ContractError(found, document=definition)


def create_app(server: Server, *, own_lifecycle: bool = True) -> FastAPI:
    """The ASGI app over a built ``Server``; with ``own_lifecycle`` the app starts and stops the worker."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> Any:
        if own_lifecycle:
            server.jobs.start()
        yield
        if own_lifecycle:
            server.jobs.stop()

    app = FastAPI(title="Kiln", version=__version__, openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan)
    api_key = server.settings.server.api_key

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if api_key and request.url.path not in OPEN_ROUTES:
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                return error_response(
                    AuthError(
                        "missing or wrong bearer token",
                        hint="send Authorization: Bearer <key> (the server's server.api_key / KILN_API_KEY)",
                    ),
                    request.url.path,
                )
        try:
            return await call_next(request)
        except KilnError as exc:
            await drain_refused(request, exc)
            return error_response(exc, request.url.path)

    @app.exception_handler(KilnError)
    async def kiln_error(request: Request, exc: KilnError) -> JSONResponse:
        await drain_refused(request, exc)
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """The router's own refusals: no route (404), or a route that does not answer this method (405, with the
        ``Allow`` header naming those it does, as HTTP asks)."""
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "internal_error")
        allowed = (exc.headers or {}).get("Allow")
        hint = f"this route answers {allowed}" if code == "method_not_allowed" and allowed else None
        error = {"code": code, "message": f"{request.method} {request.url.path}: {exc.detail}", "hint": hint}
        body = _envelope(error, exc.status_code, request.url.path)
        return JSONResponse(body, status_code=exc.status_code, headers={"Allow": allowed} if allowed else None)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        error = {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}", "hint": None}
        return JSONResponse(_envelope(error, 500, request.url.path), status_code=500)

    # ------------------------------------------------------------------ training

    def submit(kind: str, body: Any) -> dict[str, Any]:
        fields = _training.admit(server.engine, kind, body, server.jobs)
        job = server.jobs.submit(**fields)
        return {
            "job_id": job.job_id,
            "state": "queued",
            "effective_seed": job.effective_seed,
            "message": f"{kind.upper()} job queued at position {len(server.jobs.queue)} "
            f"({job.total_steps} steps, adapter {job.adapter_name})",
        }

    @app.post("/v1/train/sft")
    async def submit_sft(request: Request) -> JSONResponse:
        body = await _body(request, server)
        return JSONResponse(await _threaded(submit, "sft", body))

    @app.post("/v1/train/grpo")
    async def submit_grpo(request: Request) -> JSONResponse:
        return JSONResponse(await _threaded(submit, "grpo", await _body(request, server)))

    @app.post("/v1/train/opd")
    async def submit_opd(request: Request) -> JSONResponse:
        return JSONResponse(await _threaded(submit, "opd", await _body(request, server)))

    @app.post("/v1/datasets")
    async def upload_dataset(request: Request) -> JSONResponse:
        limit = server.settings.server.max_upload_bytes
        return JSONResponse(await _datasets.receive(request, server.settings.uploads, limit))

    @app.get("/v1/train/status")
    def list_status() -> JSONResponse:
        return JSONResponse([job.status() for job in server.jobs.ordered(kind="training")])

    @app.get("/v1/train/jobs/{job_id}")
    def job_detail(job_id: str) -> JSONResponse:
        return JSONResponse(detail(server, job_id))

    @app.get("/v1/train/queue")
    def queue() -> JSONResponse:
        running = server.jobs.jobs.get(server.jobs.running) if server.jobs.running else None
        training = running is not None and family(running.job_type) == "training"  # evals and audits list elsewhere
        return JSONResponse(
            {
                "running": running.status() if running and training else None,
                "queued": [
                    {"job_id": j.job_id, "job_type": j.job_type, "adapter_name": j.adapter_name, "position": i}
                    for i, j in enumerate(
                        (j for j in server.jobs.queued() if family(j.job_type) == "training"), start=1
                    )
                ],
                "completed": [j.status() for j in server.jobs.ordered(kind="training") if j.terminal],
            }
        )

    @app.delete("/v1/train/queue/{job_id}")
    def cancel(job_id: str) -> JSONResponse:
        outcome = server.jobs.cancel(job_id)
        if outcome == "cancelled":
            return JSONResponse({"status": "cancelled", "job_id": job_id})
        return JSONResponse(
            {
                "status": "cancelling",
                "job_id": job_id,
                "message": "stop requested \u2014 the trainer aborts at the next step boundary",
            }
        )

    @app.delete("/v1/train/jobs/{job_id}")
    def forget(job_id: str) -> JSONResponse:
        removed = server.jobs.forget(job_id)
        return JSONResponse({"job_id": job_id, "status": "deleted", "removed_archive_file": removed})

    # ------------------------------------------------------------------ adapters

    @app.get("/v1/adapters")
    def adapters() -> JSONResponse:
        from kiln.adapters import list_adapters

        with server.adapter_lock:  # concurrent polls wait for one listing instead of each redoing it
            body = list_adapters(server.registry, loaded=server.generator.active(), cache=server.adapter_cache)
        return JSONResponse(body)

    @app.post("/v1/adapters/load")
    async def load(request: Request) -> JSONResponse:
        body = await _body(request, server)
        _check("LoadAdapterRequest", body)
        return JSONResponse(
            await _threaded(
                server.generator.load,
                body["name"],
                allow_quarantined=bool(body.get("allow_quarantined", False)),
                reload=bool(body.get("reload", False)),
            )
        )

    @app.post("/v1/adapters/unload")
    def unload() -> JSONResponse:
        return JSONResponse(server.generator.unload())

    @app.delete("/v1/adapters/{name}")
    def delete(name: str) -> JSONResponse:
        from kiln.adapters import delete_adapter
        from kiln.errors import ConflictError

        active = server.generator.active()
        if active and active["name"] == name:
            raise ConflictError(
                f"adapter {name!r} is being served",
                code="adapter_active",
                hint="unload it first: POST /v1/adapters/unload",
            )
        writer = server.jobs.writer_of(name)
        if writer is not None:
            raise ConflictError(
                f"job {writer.job_id} ({writer.state}) is writing adapter {name!r}",
                code="adapter_active",
                hint=f"cancel it first: DELETE /v1/train/queue/{writer.job_id}",
            )
        delete_adapter(server.registry, name)
        return JSONResponse({"status": "deleted", "name": name})

    @app.get("/v1/adapters/{name}/receipt")
    def receipt(name: str) -> JSONResponse:
        return JSONResponse(adapter_receipt(server, name))

    # ------------------------------------------------------------------ evaluation

    @app.get("/v1/eval/suites")
    def eval_suites() -> JSONResponse:
        return JSONResponse({"suites": _evals.registry(server.settings).list()})

    @app.post("/v1/eval/suites")
    async def register_eval_suite(request: Request) -> JSONResponse:
        body = await _body(request, server)
        return JSONResponse(await _threaded(_evals.registry(server.settings).register, body))

    @app.delete("/v1/eval/suites/{name}")
    def delete_eval_suite(name: str) -> JSONResponse:
        return JSONResponse(_evals.delete_suite(server, name))

    @app.post("/v1/eval/jobs")
    async def submit_eval(request: Request) -> JSONResponse:
        body = await _body(request, server)
        return JSONResponse(await _threaded(_evals.submit, server, body))

    @app.get("/v1/eval/jobs")
    def eval_jobs() -> JSONResponse:
        return JSONResponse([_evals.eval_detail(job) for job in server.jobs.ordered(kind="eval")])

    @app.get("/v1/eval/jobs/{job_id}")
    def eval_job(job_id: str) -> JSONResponse:
        return JSONResponse(_evals.eval_detail(server.jobs.get(job_id, kind="eval")))

    @app.delete("/v1/eval/jobs/{job_id}")
    def cancel_eval(job_id: str) -> JSONResponse:
        job = server.jobs.get(job_id, kind="eval")
        if job.role not in (None, "standalone"):
            from kiln.errors import ConflictError

            raise ConflictError(
                f"evaluation {job_id} belongs to the gate of training job {job.linked_training_job_id}",
                code="job_not_terminal",
                hint=f"cancel the training job instead: DELETE /v1/train/queue/{job.linked_training_job_id}",
            )
        if not job.terminal:
            server.jobs.cancel(job_id, kind="eval")
        return JSONResponse(_evals.eval_detail(job))

    # ------------------------------------------------------------------ teachers

    @app.get("/v1/teachers")
    def teachers() -> JSONResponse:
        try:
            listed = server.teachers.list()
        except ContractError as exc:  # a record on the server's disk broke its contract: not the caller's fault
            raise InternalError(f"the teacher registry holds an invalid record: {exc.message}") from None
        return JSONResponse({"teachers": listed})

    @app.post("/v1/teachers")
    async def register_teacher(request: Request) -> JSONResponse:
        body = await _body(request, server)
        _check("RegisterTeacherRequest", body)
        return JSONResponse(await _threaded(server.teachers.add, body, student=server.engine.base))

    @app.delete("/v1/teachers/{alias}")
    def delete_teacher(alias: str) -> JSONResponse:
        from kiln.errors import ConflictError

        user = next(
            (
                job
                for job in server.jobs.ordered()
                if not job.terminal and job.request.get("teacher") == alias  # only a distillation names one
            ),
            None,
        )
        if user is not None:
            raise ConflictError(
                f"job {user.job_id} ({user.state}) distils from teacher {alias!r}",
                code="teacher_conflict",
                hint=f"wait for it or cancel it first: DELETE /v1/train/queue/{user.job_id}",
            )
        return JSONResponse(server.teachers.remove(alias))

    # ------------------------------------------------------------------ audits

    @app.post("/v1/audits")
    async def submit_audit(request: Request) -> JSONResponse:
        body = await _body(request, server)
        return JSONResponse(await _threaded(_audits.submit, server, body))

    @app.get("/v1/audits")
    def audits() -> JSONResponse:
        return JSONResponse([_audits.audit_detail(job) for job in server.jobs.ordered(kind="audit")])

    @app.get("/v1/audits/{job_id}")
    def audit(job_id: str) -> JSONResponse:
        return JSONResponse(_audits.audit_detail(server.jobs.get(job_id, kind="audit")))

    @app.delete("/v1/audits/{job_id}")
    def cancel_audit(job_id: str) -> JSONResponse:
        job = server.jobs.get(job_id, kind="audit")
        if not job.terminal:
            server.jobs.cancel(job_id, kind="audit")
        return JSONResponse(_audits.audit_detail(job))

    # ------------------------------------------------------------------ generation

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await _body(request, server)
        if isinstance(body, dict) and body.get("stream"):
            chunks = await _threaded(lambda: _first_then_rest(_openai.chat_chunks(server.generator, body)))
            return StreamingResponse(_sse(chunks), media_type="text/event-stream", headers=_seed_header(chunks[0]))
        answer = await _threaded(_openai.chat_completion, server.generator, body)
        return JSONResponse(answer, headers=_seed_header(answer))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(request, server)
        if isinstance(body, dict) and body.get("stream"):
            chunks = await _threaded(lambda: _first_then_rest(_openai.completion_chunks(server, body)))
            return StreamingResponse(_sse(chunks), media_type="text/event-stream", headers=_seed_header(chunks[0]))
        answer = await _threaded(_openai.completion, server, body)
        return JSONResponse(answer, headers=_seed_header(answer))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body = await _body(request, server)
        return JSONResponse(await _threaded(_tokenize.tokenize, server, body))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body = await _body(request, server)
        return JSONResponse(await _threaded(_tokenize.detokenize, server, body))

    @app.get("/tokenizer_info")
    def tokenizer_info() -> JSONResponse:
        return JSONResponse(_tokenize.tokenizer_info(server))

    @app.get("/v1/models")
    def models() -> JSONResponse:
        return JSONResponse(_openai.model_list(server))

    @app.get("/v1/models/{model_id:path}")
    def model(model_id: str) -> JSONResponse:
        return JSONResponse(_openai.model_card(server, model_id))

    # ------------------------------------------------------------------ observability

    @app.get("/health")
    def health() -> JSONResponse:
        doc = health_body(server)
        return JSONResponse(doc, status_code=200 if doc["status"] == "ok" else 503)

    @app.head("/health")
    def health_head() -> Response:
        """What a GET would answer, without the body (load balancers and probes send HEAD)."""
        ok = health_body(server)["status"] == "ok"
        return Response(status_code=200 if ok else 503, media_type="application/json")

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics_text(server), media_type="text/plain; version=0.0.4")

    @app.get("/v1/config")
    def config() -> JSONResponse:
        return JSONResponse(server.settings.response())

    @app.get("/openapi.json")
    def openapi() -> JSONResponse:
        return JSONResponse(served_openapi(server))

    @app.get("/ui")
    def ui() -> HTMLResponse:
        return HTMLResponse((STATIC / "dashboard.html").read_text(encoding="utf-8"))

    return app


async def _threaded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args, **kwargs)


def served_openapi(server: Server) -> JsonObject:
    """The OpenAPI document codegen built, with the bounds only the served model knows filled in: a token id is below
    the served tokenizer's vocabulary (``TokenId.maximum``) and a token prompt fits the model's context
    (``TokenIdPrompt.maxItems``), so the document states every bound the server enforces."""
    document = copy.deepcopy(kiln_contracts.openapi_document())
    schemas = document["components"]["schemas"]
    protocol = server.teacher_protocol
    if "TokenId" in schemas:
        schemas["TokenId"] = {
            "type": "integer",
            "minimum": 0,
            "maximum": protocol.vocab_size - 1,
            "description": f"A token id of the served tokenizer: below its vocabulary size {protocol.vocab_size}.",
        }
    if "TokenIdPrompt" in schemas:
        schemas["TokenIdPrompt"] = {
            **schemas["TokenIdPrompt"],
            "maxItems": protocol.max_model_len,
            "description": f"A prompt as token ids of the served tokenizer, at most the model's {protocol.max_model_len}.",
        }
    return document


def _seed_header(document: Any) -> dict[str, str]:
    """``X-Kiln-Seed``: the seed an answer's first choice sampled with (its ``system_fingerprint`` says it too)."""
    found = str(document.get("system_fingerprint") or "") if isinstance(document, dict) else ""
    return {"X-Kiln-Seed": found.removeprefix("kiln-seed-")} if found.startswith("kiln-seed-") else {}


def _first_then_rest(chunks: Any) -> Any:
    """Pull the first chunk before the response starts, so request errors still get a status code."""
    iterator = iter(chunks)
    first = next(iterator)
    return first, iterator


def _sse(pulled: Any) -> Any:
    """The server-sent events of a stream. A failure after the stream started (the status line and the first chunk
    are sent) ends it the way vLLM does, so a client sees it instead of a connection that just stops: one
    ``data: {"error": {...}}`` event -- Kiln's code, message, hint and pointer with OpenAI's ``type`` and ``param``
    -- then ``data: [DONE]``; the failure is logged with the stream's id, which the message names."""
    first, rest = pulled
    stream_id = str(first.get("id") or f"stream-{uuid.uuid4().hex[:12]}") if isinstance(first, dict) else "stream"

    def events() -> Any:
        yield f"data: {json.dumps(first, separators=(',', ':'))}\n\n"
        try:
            for chunk in rest:
                yield f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"
        except Exception as exc:
            log.exception("stream %s failed after it started", stream_id)
            yield f"data: {json.dumps(stream_error(exc, stream_id), separators=(',', ':'))}\n\n"
        yield "data: [DONE]\n\n"

    return events()


def stream_error(exc: Exception, stream_id: str) -> JsonObject:
    """The error event of a stream that failed after it started (``_sse``)."""
    error: JsonObject
    if isinstance(exc, KilnError):
        envelope = exc.as_envelope()["error"]
        error = dict(envelope) if isinstance(envelope, dict) else {"code": exc.code, "message": exc.message}
    else:
        error = {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}", "hint": None}
    error["message"] = f"{error['message']} (stream {stream_id} ended after it started)"
    return {"error": openai_fields(error, _HTTP_STATUS.get(str(error["code"]), 500))}


# ----------------------------------------------------------------------------- bodies


def detail(server: Server, job_id: str) -> dict[str, Any]:
    """``TrainingJobDetail``: the status plus loss curve, receipt, replay request and checkpoint."""
    from kiln.adapters import RECEIPT_FILE, AdapterDirectory
    from kiln.checkpoints import latest_checkpoint
    from kiln.errors import CheckpointError

    job = server.jobs.get(job_id)
    out = job.status()
    receipt, metadata_error = None, server.jobs.broken.get(job_id)
    if job.receipt_path:
        try:
            receipt = json.loads(Path(job.receipt_path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            metadata_error = f"{RECEIPT_FILE} unreadable: {exc}"
    checkpoint, checkpoint_error = None, None
    try:
        checkpoint = latest_checkpoint(server.registry, job.adapter_name)
    except (CheckpointError, OSError) as exc:
        checkpoint_error = str(exc)
    adapter_dir = AdapterDirectory(server.registry / job.adapter_name)
    out.update(
        {
            "epoch": job.epoch,
            "adapter_path": job.adapter_path or (str(adapter_dir.path) if adapter_dir.config_path.is_file() else None),
            "auto_load": job.auto_load,
            "linked_eval_job_ids": list(job.linked_eval_job_ids),
            "loss_history": list(job.loss_history),
            "train_receipt": receipt,
            "replay_request": job.request,
            "latest_checkpoint": checkpoint,
            "checkpoint_error": checkpoint_error,
            "metadata_error": metadata_error,
        }
    )
    if job.gate is not None:
        out["post_eval_verdict"] = job.gate
        out["gate_outcome"] = job.gate["outcome"]
    return out


def interrupted_reason(registry: Path, job: Any) -> str:
    """Why a job that was running when the server stopped failed, and what continues it: its adapter's newest
    checkpoint, or -- when it published none -- a fresh submission of its replay request."""
    from kiln.server._worker_process import continuation

    if family(job.job_type) == "audit":
        return "interrupted: the server stopped while this audit ran; nothing of it remains -- submit it again"
    return f"interrupted: the server stopped while this job was running; {continuation(registry, job.adapter_name)}"


def adapter_receipt(server: Server, name: str) -> dict[str, Any]:
    """``GET /v1/adapters/{name}/receipt``: a name the registry rule refuses and a missing adapter are
    ``adapter_not_found`` (404: no adapter can answer that GET), no receipt ``not_found``."""
    from kiln.adapters import adapter_directory, require_adapter_name

    try:
        valid = require_adapter_name(name)
    except KilnError:  # a name no adapter can have names none: not found, as on every GET
        raise NotFoundError(f"no adapter {name!r}: not a name an adapter can have", code="adapter_not_found") from None
    receipt = adapter_directory(server.registry, valid).read_receipt()
    return receipt.model_dump(mode="json", exclude_unset=True, by_alias=True)


def _memory(device: str) -> dict[str, Any]:
    """``HealthMemoryInfo``: the serving device's figures (CUDA only: every ``torch.cuda`` call guarded) and the
    host's."""
    from kiln.model import is_cuda

    total = None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = None
    rss = None
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            rss = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    figures: dict[str, int | None] = dict.fromkeys(
        ("device_total_bytes", "device_allocated_bytes", "device_reserved_bytes", "device_peak_allocated_bytes")
    )
    if is_cuda(device):
        import torch

        index = torch.device(device).index or 0
        figures = {
            "device_total_bytes": int(torch.cuda.get_device_properties(index).total_memory),
            "device_allocated_bytes": int(torch.cuda.memory_allocated(index)),
            "device_reserved_bytes": int(torch.cuda.memory_reserved(index)),
            "device_peak_allocated_bytes": int(torch.cuda.max_memory_allocated(index)),
        }
    return {
        "device": device,
        **figures,
        "host_total_bytes": total,
        "host_rss_bytes": rss,
        "host_peak_rss_bytes": peak,
    }


def _registry_check(registry: Path) -> dict[str, Any]:
    """``registry_writable``: a file can be created (one byte written, then removed) in the adapter registry."""
    problem = writable_problem(registry, probe=True)
    if problem is None:
        return {"name": "registry_writable", "pass": True}
    detail = f"{problem}; adapters, checkpoints and receipts cannot be published"
    return {"name": "registry_writable", "pass": False, "detail": detail}


def health_body(server: Server) -> dict[str, Any]:
    """``HealthResponse``: readiness checks, identities, training queue and memory."""
    identity = server.identity
    record = identity.execution_provenance
    shards = identity.base_weight_shard_manifest
    running = server.jobs.jobs.get(server.jobs.running) if server.jobs.running else None
    if running is not None and family(running.job_type) != "training":
        running = None  # an evaluation or an audit: /health reports the training worker's training job
    active = server.generator.active()
    serving = server.engine.serving
    checks = [
        _model_check(server),
        {"name": "execution_provenance_valid", "pass": not contracts.problems("ExecutionProvenanceV1", record)},
        {"name": "base_weights_identified", "pass": bool(shards.get("shards"))},
        {"name": "job_store_writable", "pass": server.jobs.store.writable()},
        {"name": "training_worker_alive", "pass": server.jobs.alive()},
        _registry_check(server.engine.registry),
    ]
    return {
        "status": "ok" if all(c["pass"] for c in checks) else "degraded",
        "version": __version__,
        "uptime_seconds": int(time.time() - server.started),
        "model": server.model_name,
        "model_source": server.model_source,
        "auth_required": server.settings.server.api_key is not None,
        "config_hashes": {
            "tokenizer_config_hash": identity.tokenizer_config_hash,
            "chat_template_hash": identity.chat_template_hash,
            "training_chat_template_hash": identity.training_chat_template_hash,
            "model_config_hash": identity.config_hash,
        },
        "base_weight_identity": {
            "manifest_type": shards["manifest_type"],
            "aggregate_algorithm": shards["aggregate_algorithm"],
            "aggregate_sha256": shards["aggregate_sha256"],
            "shard_count": len(shards["shards"]),
            "total_size_bytes": sum(s["size_bytes"] for s in shards["shards"]),
        },
        "execution_identity": {
            "provenance_type": record["provenance_type"],
            "backend": record["backend"]["name"],
            "device": record["backend"]["device"],
            "inference_dtype": record["precision"]["inference_dtype"],
            "training_policy": record["precision"]["training_policy"],
            "provenance_sha256": record["provenance_sha256"],
            "executable_sha256": record["build"]["executable_sha256"],
            "numerical_runtime_sha256": record["backend"]["numerical_runtime_sha256"],
            "kernel_contract_sha256": record["kernels"]["contract_sha256"],
            "effective_server_config_sha256": record["configuration"]["effective_server_config_sha256"],
            "effective_environment_sha256": record["configuration"]["effective_environment_sha256"],
        },
        "active_adapter": active["name"] if active else None,
        "loaded_adapter_count": 1 if active else 0,
        "training": {
            "active_job": None
            if running is None
            else {
                "job_id": running.job_id,
                "job_type": running.job_type,
                "adapter_name": running.adapter_name,
                "progress": min(1.0, running.progress),
                "cancel_requested": running.cancel_requested,
            },
            "queued": len(server.jobs.queue),
            "queue_capacity": server.jobs.max_queued,
        },
        "memory": _memory(serving.device if serving is not None else "cpu"),
        **({"serving": serving.state} if serving is not None else {}),
        "checks": checks,
    }


def _model_check(server: Server) -> dict[str, Any]:
    """``model_loaded``: the base model is loaded for training, and the serving copy is on its device or released
    for a job -- not released after a reload that failed."""
    if server.engine.base.model is None:
        return {"name": "model_loaded", "pass": False, "detail": "the base model is not loaded"}
    serving = server.engine.serving
    if serving is not None and serving.failure is not None and serving.state == "released":
        detail = f"the serving copy could not be loaded onto {serving.device} again after a job: {serving.failure}"
        return {"name": "model_loaded", "pass": False, "detail": detail}
    return {"name": "model_loaded", "pass": True}


def _summary(values: list[float]) -> tuple[float, float, int]:
    """(sum, max, count) of recent observations, for a Prometheus summary without quantiles."""
    return (sum(values), max(values) if values else 0.0, len(values))


def metrics_text(server: Server) -> str:
    """Prometheus text exposition (version 0.0.4)."""
    jobs = server.jobs
    by_state = dict.fromkeys(("queued", "running", "completed", "failed"), 0)
    for job in jobs.ordered():
        by_state[job.state] = by_state.get(job.state, 0) + 1
    lines = [
        "# HELP kiln_queue_depth Jobs waiting in the training queue (the running job is not counted).",
        "# TYPE kiln_queue_depth gauge",
        f"kiln_queue_depth {len(jobs.queue)}",
        "# HELP kiln_queue_capacity Most jobs that may wait in the queue.",
        "# TYPE kiln_queue_capacity gauge",
        f"kiln_queue_capacity {jobs.max_queued}",
        "# HELP kiln_jobs Training jobs known to the server, by state.",
        "# TYPE kiln_jobs gauge",
        *(f'kiln_jobs{{state="{state}"}} {count}' for state, count in sorted(by_state.items())),
    ]
    for name, help_text, values in (
        ("kiln_step_seconds", "Wall time of recent optimizer steps (last 100).", jobs.step_seconds),
        ("kiln_checkpoint_publish_seconds", "Time to publish recent checkpoints (last 100).", jobs.checkpoint_seconds),
    ):
        total, peak, count = _summary(list(values))
        lines += [
            f"# HELP {name} {help_text}",
            f"# TYPE {name} summary",
            f"{name}_sum {total:.6f}",
            f"{name}_count {count}",
            f"# HELP {name}_max Slowest of those.",
            f"# TYPE {name}_max gauge",
            f"{name}_max {peak:.6f}",
        ]
    lines += [
        "# HELP kiln_tokens_per_second Tokens per second of the most recent training step.",
        "# TYPE kiln_tokens_per_second gauge",
        f"kiln_tokens_per_second {jobs.tokens_per_second:.3f}",
        "# HELP kiln_webhook_failures_total Terminal-state notifications that could not be delivered.",
        "# TYPE kiln_webhook_failures_total counter",
        f"kiln_webhook_failures_total {server.webhook_failures}",
        "# HELP kiln_uptime_seconds Seconds since the server became ready.",
        "# TYPE kiln_uptime_seconds gauge",
        f"kiln_uptime_seconds {int(time.time() - server.started)}",
    ]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- kiln serve


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve(
    *,
    host: str | None = None,
    port: int | None = None,
    model: str | None = None,
    adapter_dir: str | None = None,
    config_path: str | None = None,
    device: str | None = None,
) -> int:
    """``kiln serve``: resolve the configuration, load everything, print ``Ready on …`` and serve. ``device`` (``--device``)
    sets where the serving copy lives and where a job that names no device trains (``model.device`` and
    ``training.device``)."""
    import uvicorn

    settings = resolve_settings(
        {
            "server.host": host,
            "server.port": port,
            "model.path": model,
            "model.adapter_dir": adapter_dir,
            "model.device": device,
            "training.device": device,
        },
        config_path=config_path,
    )
    bind_host, bind_port = settings.server.host, settings.server.port
    if not _loopback(bind_host) and settings.server.api_key is None:
        print(
            f"warning: binding {bind_host} without an API key: anyone who can reach this port can train and "
            "delete adapters; set KILN_API_KEY (or server.api_key)",
            file=sys.stderr,
        )
    print("Loading the base model and capturing its identity…", file=sys.stderr, flush=True)
    server = build_server(settings)
    app = create_app(server)
    config = uvicorn.Config(app, host=bind_host, port=bind_port, log_level="warning", access_log=False)
    web = uvicorn.Server(config)
    original_startup = web.startup

    async def startup(sockets: Any = None) -> None:
        await original_startup(sockets=sockets)
        if web.started:
            print(f"Ready on http://{bind_host}:{bind_port}", flush=True)

    web.startup = startup
    web.run()
    return 0
