"""Reward scorers: one interface (``Scorer.score``), four kinds, each with a recorded identity.

A scorer is asked about the completions of one group at a time (``ScoreRequest``: the task as given, its prompt
conversation, the completion's text) and answers one ``Scored`` per completion, in order: a finite ``reward`` and
whatever else it chose to say (``details``, kept beside the reward). Any failure -- an exception, a non-zero exit, a
timeout, an answer that is not ``{"reward": <finite number>}``, an HTTP scorer out of retries -- raises
``ScorerError`` naming the task and the scorer, with the scorer's stderr tail or error; nothing is half-written.

Kinds, chosen by the spec string (``scorer_of``):

* ``builtin:exact`` / ``builtin:regex`` / ``builtin:json`` -- Kiln's own verifiable rewards, for a first run with no
  code: the completion equals the task's ``answer`` (whitespace at the ends ignored); the task's ``pattern`` (a
  Python regular expression) is found in it; it parses as JSON and, when the task carries a ``schema``, is valid
  against that JSON Schema. 1.0 or 0.0.
* ``module:function`` -- a Python entry point, called once per group the way TRL calls a reward function:
  ``function(prompts=..., completions=..., completion_ids=..., **columns)`` with one list entry per completion (the
  prompt conversations; the completions as ``[{"role": "assistant", "content": text}]`` for a task given as
  ``messages``, as plain text for a task given as ``prompt``; every other task field as a column) returning a list of
  numbers (or of ``{"reward": ...}`` objects). A TRL reward function works as it is.
* ``http://...`` / ``https://...`` -- an HTTP endpoint: one POST per completion with the body an executable reads
  as a line, the answer an object like an executable's line; ``timeout`` seconds per attempt, connection failures
  and 5xx answers retried at most ``retries`` times, a 4xx answer not retried.
* anything else is a path to an executable, run without a shell once per group: the group's requests on stdin as
  JSON lines (``{"task": ..., "messages": [...], "completion": "..."}``), its answers on stdout as JSON lines
  (``{"reward": number, ...}``), one per request in order, within ``timeout`` seconds.

Identity (``Scorer.identity``, recorded in every rollout's provenance and the summary): the builtin's name and
Kiln's version; the entry point, the digest of its module's source file and its distribution's name and version
when it has one; the URL; the executable's resolved path and the SHA-256 of its bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import math
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kiln.errors import RequestError, ScorerError

__all__ = [
    "BUILTIN_SCORERS",
    "BuiltinScorer",
    "EntryPointScorer",
    "ExecutableScorer",
    "HttpScorer",
    "ScoreRequest",
    "Scored",
    "Scorer",
    "scorer_of",
]

TAIL_CHARS = 2000  # the stderr tail an error carries
_ENTRY_POINT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ScoreRequest:
    """One completion to score: the task as given (its JSON object), its id, the prompt conversation and the
    completion's text (the end-of-turn token not included)."""

    task: dict[str, Any]
    task_id: str
    messages: list[dict[str, Any]]
    completion: str
    completion_ids: tuple[int, ...] = ()

    def line(self) -> dict[str, Any]:
        """The JSON object an executable reads (one line) and an HTTP scorer is posted."""
        return {"task": self.task, "messages": self.messages, "completion": self.completion}


@dataclass(frozen=True)
class Scored:
    """A scorer's answer for one completion: a finite reward and the other fields it returned."""

    reward: float
    details: dict[str, Any] = field(default_factory=dict)


class Scorer(Protocol):
    """What every kind offers: a stable ``name`` for messages, an ``identity`` for the record, ``score``."""

    name: str

    @property
    def identity(self) -> dict[str, Any]: ...

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]: ...


def _fail(scorer: str, request: ScoreRequest | None, what: str, tail: str = "") -> ScorerError:
    where = f"task {request.task_id!r}" if request is not None else "a group"
    message = f"scorer {scorer} failed on {where}: {what}"
    if tail.strip():
        message += f"\n--- scorer stderr (tail) ---\n{tail[-TAIL_CHARS:].rstrip()}"
    return ScorerError(message, hint="fix the scorer or the task, then run again (a training run resumes from its "
                       "last checkpoint)")  # fmt: skip


def _answer(scorer: str, request: ScoreRequest, value: Any, tail: str = "") -> Scored:
    """``value`` as a ``Scored``: a number, or an object with a finite ``reward`` (other members kept)."""
    if isinstance(value, dict):
        details = {k: v for k, v in value.items() if k != "reward"}
        value = value.get("reward")
    else:
        details = {}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(scorer, request, f'answered {json.dumps(value)[:200]} where {{"reward": <number>}} is needed', tail)
    reward = float(value)
    if not math.isfinite(reward):
        raise _fail(scorer, request, f"answered the non-finite reward {reward}", tail)
    return Scored(reward, details)


# ----------------------------------------------------------------------------- builtins


def _exact(request: ScoreRequest) -> float:
    if "answer" not in request.task:
        raise ValueError('the task has no "answer"')
    answer = request.task["answer"]
    return float(request.completion.strip() == (answer if isinstance(answer, str) else json.dumps(answer)).strip())


def _regex(request: ScoreRequest) -> float:
    pattern = request.task.get("pattern")
    if not isinstance(pattern, str):
        raise ValueError('the task has no "pattern" string')
    return float(re.search(pattern, request.completion) is not None)


def _json(request: ScoreRequest) -> float:
    try:
        value = json.loads(request.completion)
    except ValueError:
        return 0.0
    schema = request.task.get("schema")
    if schema is None:
        return 1.0
    import jsonschema_rs

    return float(jsonschema_rs.validator_for(schema).is_valid(value))


BUILTIN_SCORERS: dict[str, Callable[[ScoreRequest], float]] = {"exact": _exact, "regex": _regex, "json": _json}


class BuiltinScorer:
    """``builtin:exact``, ``builtin:regex`` or ``builtin:json`` (see the module docstring)."""

    def __init__(self, name: str) -> None:
        if name not in BUILTIN_SCORERS:
            raise RequestError(
                f"there is no builtin scorer {name!r}",
                hint=f"the builtin scorers are {', '.join('builtin:' + n for n in BUILTIN_SCORERS)}",
            )
        self.name = f"builtin:{name}"
        self._score = BUILTIN_SCORERS[name]

    @property
    def identity(self) -> dict[str, Any]:
        from kiln import __version__

        return {"kind": "builtin", "name": self.name, "kiln_version": __version__}

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        out = []
        for request in requests:
            try:
                out.append(Scored(self._score(request)))
            except (ValueError, re.error) as exc:
                raise _fail(self.name, request, str(exc)) from None
        return out


# ----------------------------------------------------------------------------- a Python entry point


class EntryPointScorer:
    """``module:function``, called once per group with TRL's reward-function arguments."""

    def __init__(self, spec: str, *, search: Path | None = None) -> None:
        """``search``: a directory to import the module from when the installed packages lack it (the command
        line's working directory, where a user's reward module sits)."""
        module_name, _, attr = spec.partition(":")
        self.name = spec
        added = search is not None and str(search) not in sys.path
        if added:
            sys.path.append(str(search))
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise RequestError(f"scorer {spec}: module {module_name!r} cannot be imported: {exc}") from None
        finally:
            if added:
                sys.path.remove(str(search))
        function = getattr(module, attr, None)
        if not callable(function):
            raise RequestError(f"scorer {spec}: {module_name} has no function {attr!r}")
        self._function = function
        self._module = module

    @property
    def identity(self) -> dict[str, Any]:
        found: dict[str, Any] = {"kind": "entry_point", "entry_point": self.name}
        source = getattr(self._module, "__file__", None)
        if source and Path(source).is_file():
            found["module_sha256"] = hashlib.sha256(Path(source).read_bytes()).hexdigest()
        top = self.name.split(".", 1)[0].split(":", 1)[0]
        from importlib.metadata import PackageNotFoundError, packages_distributions, version

        dists = packages_distributions().get(top)
        if dists:
            found["distribution"] = dists[0]
            with contextlib.suppress(PackageNotFoundError):  # metadata is best effort; the module digest binds code
                found["version"] = version(dists[0])
        return found

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        if not requests:
            return []
        conversational = "messages" in requests[0].task
        columns: dict[str, list[Any]] = {}
        for key in requests[0].task:
            if key not in ("messages", "prompt"):
                columns[key] = [r.task.get(key) for r in requests]
        prompts: list[Any] = [r.messages if conversational else r.task.get("prompt", "") for r in requests]
        completions: list[Any] = [
            [{"role": "assistant", "content": r.completion}] if conversational else r.completion for r in requests
        ]
        try:
            values = self._function(
                prompts=prompts,
                completions=completions,
                completion_ids=[list(r.completion_ids) for r in requests],
                **columns,
            )
        except Exception as exc:  # noqa: BLE001 -- a user's function may raise anything; it becomes a scorer failure
            raise _fail(self.name, requests[0], f"raised {type(exc).__name__}: {exc}") from None
        if not isinstance(values, (list, tuple)) or len(values) != len(requests):
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise _fail(self.name, requests[0], f"returned {count} values for {len(requests)} completions")
        return [_answer(self.name, r, v) for r, v in zip(requests, values, strict=True)]


# ----------------------------------------------------------------------------- an HTTP endpoint


class HttpScorer:
    """One POST per completion; ``retries`` more attempts after a connection failure or a 5xx answer."""

    def __init__(self, url: str, *, timeout: float = 30.0, retries: int = 2, backoff: float = 0.5) -> None:
        if not url.startswith(("http://", "https://")):
            raise RequestError(f"scorer {url}: an HTTP scorer's URL starts with http:// or https://")
        self.name, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff

    @property
    def identity(self) -> dict[str, Any]:
        return {"kind": "http", "url": self.name}

    def _post(self, request: ScoreRequest) -> Scored:
        body = json.dumps(request.line()).encode()
        problem, attempts = "", 0
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * attempt)
            attempts += 1
            headers = {"Content-Type": "application/json"}
            http = urllib.request.Request(self.name, data=body, headers=headers)  # noqa: S310 -- http(s) only
            try:
                with urllib.request.urlopen(http, timeout=self.timeout) as answer:  # noqa: S310 -- http(s) only
                    text = answer.read().decode("utf-8", "replace")
            except urllib.error.HTTPError as exc:
                with exc:  # the error answer holds the connection until it is closed
                    problem = f"HTTP {exc.code}: {exc.read().decode('utf-8', 'replace')[:500]}"
                if exc.code < 500:
                    problem += " (a 4xx answer is not retried)"
                    break
                continue
            except (urllib.error.URLError, TimeoutError, OSError) as exc:
                problem = f"no answer: {getattr(exc, 'reason', exc)}"
                continue
            try:
                return _answer(self.name, request, json.loads(text))
            except ValueError:
                raise _fail(self.name, request, f"answered {text[:200]!r}, which is not JSON") from None
        raise _fail(self.name, request, f"{problem} (after {attempts} attempt{'s' if attempts > 1 else ''})")

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        return [self._post(r) for r in requests]


# ----------------------------------------------------------------------------- an executable


class ExecutableScorer:
    """An executable run once per group, without a shell: JSON lines in, JSON lines out."""

    def __init__(self, path: str | Path, *, timeout: float = 60.0) -> None:
        resolved = Path(path).expanduser().resolve()
        if not resolved.is_file():
            raise RequestError(
                f"scorer {path}: no such file",
                hint="name an executable, a module:function, an http(s) URL or builtin:exact|regex|json",
            )
        self.path, self.name, self.timeout = resolved, str(path), timeout

    @property
    def identity(self) -> dict[str, Any]:
        return {
            "kind": "executable",
            "path": str(self.path),
            "sha256": hashlib.sha256(self.path.read_bytes()).hexdigest(),
        }

    def score(self, requests: Sequence[ScoreRequest]) -> list[Scored]:
        if not requests:
            return []
        stdin = "".join(json.dumps(r.line(), ensure_ascii=False) + "\n" for r in requests)
        try:
            done = subprocess.run(
                [str(self.path)], input=stdin, capture_output=True, text=True, timeout=self.timeout, check=False
            )
        except subprocess.TimeoutExpired as exc:
            tail = exc.stderr.decode("utf-8", "replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            raise _fail(self.name, requests[0], f"timed out after {self.timeout:g} s", tail) from None
        except OSError as exc:
            raise _fail(self.name, requests[0], f"could not be started: {exc}") from None
        if done.returncode != 0:
            raise _fail(self.name, requests[0], f"exited with status {done.returncode}", done.stderr)
        lines = [line for line in done.stdout.splitlines() if line.strip()]
        if len(lines) != len(requests):
            raise _fail(
                self.name, requests[0], f"wrote {len(lines)} answer lines for {len(requests)} completions", done.stderr
            )
        out = []
        for request, line in zip(requests, lines, strict=True):
            try:
                value = json.loads(line)
            except ValueError:
                raise _fail(self.name, request, f"wrote {line[:200]!r}, which is not JSON", done.stderr) from None
            out.append(_answer(self.name, request, value, done.stderr))
        return out


def scorer_of(spec: str, *, timeout: float | None = None, search: Path | None = None) -> Scorer:
    """The scorer a spec string names: ``builtin:NAME``, an ``http(s)://`` URL, ``module:function`` (imported from
    the installed packages, else from ``search``) or a path to an executable (a path that names an existing file
    always means the executable)."""
    if spec.startswith("builtin:"):
        return BuiltinScorer(spec.removeprefix("builtin:"))
    if spec.startswith(("http://", "https://")):
        return HttpScorer(spec, timeout=timeout or 30.0)
    if _ENTRY_POINT.match(spec) and not Path(spec).exists():
        return EntryPointScorer(spec, search=search)
    return ExecutableScorer(spec, timeout=timeout or 60.0)
