"""Render ``kiln_contracts/client.py``: a typed HTTP client built from the ``x-kiln-routes`` lists.

One method per route, named by its ``operation_id``; request and response types are the
generated pydantic models (imported from ``.models``, never from ``kiln``). A route with a
``stream_response`` also gets ``<operation_id>_stream``, which reads server-sent events. A route
with a ``request_media_type`` takes its body as raw bytes (or a binary file), sent with that
``Content-Type``.
Everything that would make the client wrong -- a duplicate or reserved method name, a
definition without a generated class, a path parameter that is not an identifier -- is a
``SchemaSourceError`` here rather than a surprise at import time.
"""

from __future__ import annotations

import ast
import keyword
import re
import subprocess
import sys
import textwrap
from typing import Any

from codegen._bundle import SchemaSourceError
from codegen._models import module_name

RUFF_FORMAT = ["-m", "ruff", "format", "--isolated", "--line-length", "120", "--target-version", "py311"]

# names the client class defines itself; an operation_id may not shadow them
RESERVED_NAMES = frozenset({"close", "base_url"})
# names a generated method body uses besides its path parameters (model classes are capitalised)
METHOD_LOCALS = frozenset({"self", "body", "payload", "response", "data", "dict", "isinstance", "str"})
# builtin types a RootModel's root may use, next to classes of its own module
ROOT_BUILTINS = frozenset({"list", "dict", "str", "int", "float", "bool", "None"})

_PARAM = re.compile(r"\{([^{}]*)\}")

RUNTIME = '''
__all__ = ["KilnApiError", "KilnClient", "KilnConnectionError"]

DEFAULT_BASE_URL = "http://localhost:8420"


class KilnApiError(Exception):
    """The server answered with a non-2xx status.

    ``code``, ``message``, ``hint`` and ``pointer`` come from the ``ErrorEnvelope`` body
    (``{"error": {...}}``); a body that is not an envelope gives ``code == "internal_error"``
    and the raw body text as ``message``. ``retry_after`` is the ``Retry-After`` header in
    seconds (``queue_full`` answers carry it), or None.
    """

    def __init__(
        self,
        status_code: int,
        code: str,
        message: str,
        *,
        hint: str | None = None,
        pointer: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        self.status_code = status_code
        self.code = code
        self.message = message
        self.hint = hint
        self.pointer = pointer
        self.retry_after = retry_after
        text = f"HTTP {status_code} {code}: {message}"
        if pointer is not None:
            text += f" (at {pointer!r})"
        if hint:
            text += f"; hint: {hint}"
        if retry_after is not None:
            text += f"; retry after {retry_after}s"
        super().__init__(text)


class KilnConnectionError(Exception):
    """The server could not be reached, did not answer in time, or broke off a stream."""

    def __init__(self, message: str, *, url: str) -> None:
        self.url = url
        super().__init__(message)


def _retry_after(value: str | None) -> int | None:
    if value is None or not value.strip().isdigit():
        return None
    return int(value.strip())


def _error_from_body(status_code: int, text: str, retry_after: int | None) -> KilnApiError:
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict) and isinstance(error.get("code"), str) and isinstance(error.get("message"), str):
        hint, pointer = error.get("hint"), error.get("pointer")
        return KilnApiError(
            status_code,
            error["code"],
            error["message"],
            hint=hint if isinstance(hint, str) else None,
            pointer=pointer if isinstance(pointer, str) else None,
            retry_after=retry_after,
        )
    message = text if text.strip() else f"HTTP {status_code} with an empty body"
    return KilnApiError(status_code, "internal_error", message, retry_after=retry_after)


def _api_error(response: httpx.Response) -> KilnApiError:
    return _error_from_body(response.status_code, response.text, _retry_after(response.headers.get("Retry-After")))


def _json(response: httpx.Response) -> Any:
    try:
        return json.loads(response.content)
    except ValueError:
        raise KilnApiError(
            response.status_code, "internal_error", "expected a JSON body, got: " + response.text
        ) from None


def _payload(body: BaseModel | dict[str, Any]) -> Any:
    """A model is dumped as JSON with only the fields that were set; a dict is sent as-is."""
    if isinstance(body, BaseModel):
        return body.model_dump(mode="json", exclude_unset=True, by_alias=True)
    return body


def _segment(value: str) -> str:
    """One URL path segment: every reserved character (``/`` included) percent-encoded."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"a path parameter must be a non-empty string, got {value!r}")
    return quote(value, safe="")


def _sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined with newlines)."""
    buffer: list[str] = []
    for line in lines:
        if not line:
            if buffer:
                yield "\\n".join(buffer)
                buffer = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            buffer.append(value[1:] if value.startswith(" ") else value)
    if buffer:
        yield "\\n".join(buffer)


class KilnClient:
    """Typed client of the Kiln HTTP API (``kiln serve``).

    Every method raises ``KilnApiError`` for a non-2xx answer and ``KilnConnectionError``
    when the server cannot be reached. Request bodies are the generated models or plain
    dicts (sent as-is: the server rejects unknown fields). Use it as a context manager or
    call ``close()``.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        *,
        api_key: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        """Close the underlying connection pool."""
        self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _connection_error(self, exc: httpx.TransportError, path: str) -> KilnConnectionError:
        url = self.base_url + path
        if isinstance(exc, httpx.ConnectError):
            message = f"cannot connect to the Kiln server at {url} ({exc}); is `kiln serve` running there?"
        elif isinstance(exc, httpx.TimeoutException):
            message = (
                f"no answer from the Kiln server at {url} within {self._timeout}s ({type(exc).__name__}); "
                "is `kiln serve` running and reachable?"
            )
        else:
            message = f"the connection to the Kiln server at {url} failed ({type(exc).__name__}: {exc})"
        return KilnConnectionError(message, url=url)

    def _request(
        self, method: str, path: str, *, body: Any = None, content: Any = None, media_type: str | None = None
    ) -> httpx.Response:
        try:
            if media_type is not None:
                response = self._http.request(method, path, content=content, headers={"Content-Type": media_type})
            else:
                response = self._http.request(method, path, json=body)
        except httpx.TransportError as exc:
            raise self._connection_error(exc, path) from exc
        if not response.is_success:
            raise _api_error(response)
        return response

    def _stream(self, method: str, path: str, *, body: Any) -> Iterator[Any]:
        """The JSON object of each server-sent event, up to ``data: [DONE]``."""
        try:
            with self._http.stream(method, path, json=body, headers={"Accept": "text/event-stream"}) as response:
                if not response.is_success:
                    response.read()
                    raise _api_error(response)
                media_type = response.headers.get("Content-Type", "").partition(";")[0].strip()
                if media_type != "text/event-stream":
                    response.read()
                    raise KilnApiError(
                        response.status_code,
                        "internal_error",
                        f"expected text/event-stream, got {media_type or 'no content type'}: {response.text}",
                    )
                for data in _sse_data(response.iter_lines()):
                    if data == "[DONE]":
                        return
                    try:
                        event = json.loads(data)
                    except ValueError:
                        raise KilnApiError(
                            response.status_code, "internal_error", "expected a JSON event, got: " + data
                        ) from None
                    if isinstance(event, dict) and "error" in event:
                        raise _error_from_body(response.status_code, data, None)
                    yield event
        except httpx.TransportError as exc:
            raise self._connection_error(exc, path) from exc
        raise KilnConnectionError(
            f"the event stream from {self.base_url + path} ended before `data: [DONE]`", url=self.base_url + path
        )
'''


def _body_name(spec: str, route: dict[str, Any], owner: dict[str, str]) -> tuple[str, str]:
    """``Def`` or ``file.schema.json#Def`` -> ``(Def, model module of the owning schema file)``."""
    file, _, name = spec.rpartition("#")
    where = f"route {route['method']} {route['path']}"
    if name not in owner:
        raise SchemaSourceError(f"{where}: {spec!r} names no definition")
    if file and owner[name] != file:
        raise SchemaSourceError(f"{where}: {name} is defined in {owner[name]}, not {file}")
    return name, module_name(owner[name])


class _Imports:
    """The model classes the client imports, checked against the generated module texts."""

    def __init__(self, model_texts: dict[str, str]) -> None:
        self._texts = model_texts
        self._trees: dict[str, ast.Module] = {}
        self.names: dict[str, str] = {}  # class name -> module

    def _classes(self, module: str) -> dict[str, ast.ClassDef]:
        if module not in self._trees:
            if module not in self._texts:
                raise SchemaSourceError(f"client: no generated model module {module}")
            self._trees[module] = ast.parse(self._texts[module])
        return {n.name: n for n in self._trees[module].body if isinstance(n, ast.ClassDef)}

    def add(self, name: str, module: str) -> ast.ClassDef:
        node = self._classes(module).get(name)
        if node is None:
            raise SchemaSourceError(f"client: models/{module}.py has no class {name} to import")
        if self.names.setdefault(name, module) != module:
            raise SchemaSourceError(f"client: class {name} would be imported from both {self.names[name]} and {module}")
        return node

    def response_type(self, name: str, module: str) -> tuple[str, bool]:
        """``(annotation, unwrap)``: a RootModel answer is returned as its root value."""
        node = self.add(name, module)
        for base in node.bases:
            if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Name) and base.value.id == "RootModel":
                classes = self._classes(module)
                for part in ast.walk(base.slice):
                    if isinstance(part, ast.Attribute) or (
                        isinstance(part, ast.Name) and part.id not in ROOT_BUILTINS and part.id not in classes
                    ):
                        raise SchemaSourceError(
                            f"client: cannot type the root of {name} ({ast.unparse(base.slice)}); "
                            "make the response an object or a list/union of named definitions"
                        )
                    if isinstance(part, ast.Name) and part.id in classes:
                        self.add(part.id, module)
                return ast.unparse(base.slice), True
        return name, False

    def render(self) -> str:
        by_module: dict[str, list[str]] = {}
        for name, module in self.names.items():
            by_module.setdefault(module, []).append(name)
        return "".join(
            f"from .models.{module} import {', '.join(sorted(names))}\n" for module, names in sorted(by_module.items())
        )


def _docstring(paragraphs: list[str], args: list[tuple[str, str]]) -> str:
    """A method docstring: wrapped paragraphs, then ``Args:`` (Google style), indented for a method body."""
    width = 120 - 8
    blocks = [textwrap.fill(p, width=width) for p in paragraphs]
    if args:
        lines = ["Args:"]
        for name, text in args:
            lines.append(
                textwrap.fill(f"{name}: {text}", width=width, initial_indent="    ", subsequent_indent="        ")
            )
        blocks.append("\n".join(lines))
    text = "\n\n".join(blocks).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    if text.endswith('"'):
        text += " "
    body = "\n".join(("        " + line) if line else "" for line in text.split("\n"))
    return '        """' + body.lstrip() + ('\n        """\n' if "\n" in text else '"""\n')


def _path_expression(path: str) -> tuple[list[str], str]:
    """The path parameters and the Python expression of the URL path."""
    if any(c in path for c in "\"\\'") or not path.startswith("/"):
        raise SchemaSourceError(f"route path {path!r}: must start with / and contain no quotes or backslashes")
    params = _PARAM.findall(path)
    for param in params:
        if not param.isidentifier() or keyword.iskeyword(param) or param in METHOD_LOCALS or not param[0].islower():
            raise SchemaSourceError(f"route path {path}: path parameter {{{param}}} is not a usable Python name")
    if len(set(params)) != len(params):
        raise SchemaSourceError(f"route path {path}: a path parameter appears twice")
    if "{" in _PARAM.sub("", path) or "}" in _PARAM.sub("", path):
        raise SchemaSourceError(f"route path {path}: unbalanced braces")
    if not params:
        return [], f'"{path}"'
    return params, 'f"' + _PARAM.sub(lambda m: "{_segment(" + m.group(1) + ")}", path) + '"'


def _method_name(route: dict[str, Any], taken: dict[str, str]) -> str:
    name = route.get("operation_id")
    where = f"{route['method']} {route['path']}"
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
        raise SchemaSourceError(f"route {where}: operation_id {name!r} is not a public Python method name")
    if name in RESERVED_NAMES:
        raise SchemaSourceError(f"route {where}: operation_id {name!r} is reserved by KilnClient")
    if name in taken:
        raise SchemaSourceError(f"route {where}: client method {name!r} is already generated for {taken[name]}")
    taken[name] = where
    return name


def _success(route: dict[str, Any]) -> tuple[str, Any]:
    ok = sorted(s for s in route.get("responses", {}) if str(s).startswith("2"))
    if not ok:
        raise SchemaSourceError(f"route {route['method']} {route['path']}: no 2xx response")
    status = "200" if "200" in ok else ok[0]
    return status, route["responses"][status]


def _methods(route: dict[str, Any], owner: dict[str, str], imports: _Imports, taken: dict[str, str]) -> str:
    method = route["method"].upper()
    name = _method_name(route, taken)
    params, path_expr = _path_expression(route["path"])
    signature = ["self", *(f"{p}: str" for p in params)]
    call = f'self._request("{method}", {path_expr}'
    request_type = None
    raw_media_type = route.get("request_media_type")
    if raw_media_type and route.get("request"):
        raise SchemaSourceError(f"route {method} {route['path']}: a request_media_type body has no request schema")
    if raw_media_type:
        signature.append("data: bytes | Iterable[bytes] | BinaryIO")
        call += f', content=data, media_type="{raw_media_type}"'
    if route.get("request"):
        request_type, module = _body_name(route["request"], route, owner)
        imports.add(request_type, module)
        signature.append(f"body: {request_type} | dict[str, Any]")
        call += ", body=payload"
    call += ")"

    _, success_body = _success(route)
    if success_body:
        response_name, module = _body_name(success_body, route, owner)
        annotation, unwrap = imports.response_type(response_name, module)
        result = f"{response_name}.model_validate(_json(response))" + (".root" if unwrap else "")
    elif route.get("media_type"):
        annotation, result = "str", "response.text"
    else:
        annotation, result = "None", None

    summary = " ".join(str(route.get("summary") or route["operation_id"]).split())
    route_line = f"``{method} {route['path']}``"
    if success_body and unwrap:
        route_line += f"; returns the root of ``{response_name}`` (``{annotation}``)."
    elif success_body:
        route_line += f"; returns a ``{response_name}``."
    elif annotation == "str":
        route_line += f"; returns the ``{route['media_type']}`` body as text."
    else:
        route_line += "."
    args: list[tuple[str, str]] = []
    descriptions = route.get("path_parameters") or {}
    for param in params:
        args.append((param, " ".join(str(descriptions.get(param) or "Path parameter.").split())))
    if request_type:
        args.append(
            ("body", f"``{request_type}`` (only the fields that were set are sent) or a plain dict (sent as-is).")
        )
    if raw_media_type:
        args.append(
            ("data", f"the body, sent as ``{raw_media_type}``: bytes, an iterator of chunks, or a binary file.")
        )
    doc = [summary, route_line]

    out = [f"    def {name}({', '.join(signature)}) -> {annotation}:\n", _docstring(doc, args)]
    if request_type:
        out.append("        payload = _payload(body)\n")
        if route.get("stream_response"):
            out.append(
                '        if isinstance(payload, dict) and payload.get("stream") is True:\n'
                f'            raise ValueError("stream=True needs {name}_stream(), which reads the event stream")\n'
            )
    if result is None:
        out.append(f"        {call}\n")
    else:
        out.append(f"        response = {call}\n        return {result}\n")

    if route.get("stream_response"):
        if not request_type:
            raise SchemaSourceError(f"route {method} {route['path']}: a stream_response needs a request body")
        stream_name = _method_name({**route, "operation_id": name + "_stream"}, taken)
        chunk, module = _body_name(route["stream_response"], route, owner)
        chunk_annotation, chunk_unwrap = imports.response_type(chunk, module)
        stream_doc = [
            summary,
            f"``{method} {route['path']}`` with ``stream: true``: yields one ``{chunk}`` per server-sent event and "
            "stops at ``data: [DONE]``.",
        ]
        stream_args = [
            *args[:-1],
            ("body", f"``{request_type}`` or a plain dict; ``stream`` is set to true either way."),
        ]
        stream_sig = ", ".join([*signature])
        out += [
            "\n",
            f"    def {stream_name}({stream_sig}) -> Iterator[{chunk_annotation}]:\n",
            _docstring(stream_doc, stream_args),
            '        payload = {**_payload(body), "stream": True}\n',
            f'        for data in self._stream("{method}", {path_expr}, body=payload):\n',
            f"            yield {chunk}.model_validate(data)" + (".root\n" if chunk_unwrap else "\n"),
        ]
    return "".join(out)


def _format(source: str) -> str:
    proc = subprocess.run(
        [sys.executable, *RUFF_FORMAT, "--stdin-filename", "client.py", "-"],
        input=source,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SchemaSourceError(f"client: ruff format failed on the generated client:\n{proc.stderr}")
    return proc.stdout


def generate_client(
    routes: list[dict[str, Any]],
    route_files: list[str],
    owner: dict[str, str],
    model_texts: dict[str, str],
    digests: dict[str, str],
) -> str:
    """Return the text of ``client.py`` (header included).

    ``model_texts`` maps a model module name (``kiln_control_plane_v1_schema``) to its
    generated source, so that every imported class is known to exist.
    """
    imports = _Imports(model_texts)
    taken: dict[str, str] = {}
    methods = [_methods(route, owner, imports, taken) for route in routes]
    module_of = {module_name(file): file for file in digests}
    sources = sorted({*route_files, *(module_of[m] for m in imports.names.values())})
    header = "".join(
        [
            "# Generated by `python -m codegen` from the x-kiln-routes and models of:\n",
            *(f"#   schemas/{file} {digests[file]}\n" for file in sources),
            "# Do not edit: change the schema or the generator, then regenerate.\n",
        ]
    )
    operations = ", ".join(sorted(taken))
    source = (
        header
        + '"""Typed HTTP client of the Kiln API, generated from the schemas\' ``x-kiln-routes``. Do not edit.\n\n'
        + "    from kiln_contracts.client import KilnClient\n\n"
        + '    with KilnClient("http://localhost:8420", api_key="...") as kiln:\n'
        + "        job = kiln.submit_sft_training({...})\n\n"
        + textwrap.fill(f"Operations: {operations}.", width=100)
        + "\n"
        + '"""\n\n'
        + "from __future__ import annotations\n\n"
        + "import json\n"
        + "from collections.abc import Iterable, Iterator\n"
        + "from typing import Any, BinaryIO, Self\n"
        + "from urllib.parse import quote\n\n"
        + "import httpx\n"
        + "from pydantic import BaseModel\n\n"
        + imports.render()
        + RUNTIME
        + "\n"
        + "\n".join(methods)
    )
    return _format(source)
