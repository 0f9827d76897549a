"""The request log (``replay.jsonl``) beside an adapter: one canonical JSON record per line.

* ``ReplayRequestRecord`` (``record_type`` ``request``): a training request as Kiln trains it -- id, kind, adapter,
  effective config and data digest, seed, source commit, when the trainer took it, the checkpoint it resumed from.
  Appended and synced to disk before the first optimizer step of its run.
* ``ReplayOutcomeRecord`` (``record_type`` ``outcome``): how that run ended (``completed``, ``failed``,
  ``cancelled``), appended when it ends; ``replay-outcome.status`` ties the status to the failure reason.

``replay-log.order`` (checked here over a whole file, ``verify_replay_log``): the first record is a request; request
ids are unique; an outcome ends the latest request above it and no request has two; a request without an outcome
is one whose run died without one (a killed worker), so only a later request may follow it. A published adapter's
log ends with the ``completed`` outcome of its last request (``published=True``).

``load_replay_record`` (strict, either kind), ``load_replay_log`` (strict, every line; a problem names the file and
line), ``append_replay_record`` (canonical; the whole file rewritten crash-atomically: old lines + the new one,
synced -- a crash leaves the old file or the new, never a torn line), ``write_replay_log`` (canonical, atomic),
``verify_replay_log``; ``pending_log``: where a run keeps its log until its adapter is published.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.documents import pipeline
from kiln.documents.jsonio import MAX_DOCUMENT_BYTES, canonical_json, parse_json
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import ContractError, DocumentReadError, Problem
from kiln.host.fs import atomic_write_bytes

REPLAY_LOG = "replay.jsonl"
REQUEST = "ReplayRequestRecord"
OUTCOME = "ReplayOutcomeRecord"
KINDS = {"request": REQUEST, "outcome": OUTCOME}
MAX_LOG_BYTES = 64 * 1024 * 1024

__all__ = [
    "KINDS",
    "REPLAY_LOG",
    "LogLine",
    "append_replay_record",
    "load_replay_log",
    "load_replay_record",
    "pending_log",
    "render_replay_log",
    "requests_of",
    "verify_replay_log",
    "write_replay_log",
]


@dataclass(frozen=True)
class LogLine:
    """One record of a log and the 1-based line it is on."""

    line: int
    record: dict[str, Any]

    @property
    def is_request(self) -> bool:
        return self.record["record_type"] == "request"

    @property
    def request_id(self) -> str:
        return str(self.record["request_id"])


@semantic_rule(OUTCOME, "replay-outcome.status")
def _outcome_status(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    status, reason = doc["status"], doc["failure_reason"]
    wrong = (
        (status == "completed" and reason is not None)
        or (status == "failed" and reason in (None, "cancelled"))
        or (status == "cancelled" and reason != "cancelled")
    )
    if wrong:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "failure_reason"),
            f"status {status!r} with failure_reason {reason!r}: completed has none, cancelled has 'cancelled', "
            "failed has another reason",
        )


def _kind_of(value: Any, document: str | None) -> str:
    kind = value.get("record_type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in KINDS:  # any JSON may stand there: a list is not hashable
        raise ContractError(
            [
                Problem(
                    "value_not_allowed" if isinstance(value, dict) else "wrong_type",
                    "/record_type" if isinstance(value, dict) else "",
                    f"a replay record is an object whose record_type is 'request' or 'outcome', not {kind!r}",
                )
            ],
            document=document,
        )
    return KINDS[kind]


def load_replay_record(source: pipeline.Source, *, document: str | None = None) -> dict[str, Any]:
    """One record, strictly (its ``record_type`` picks the schema); returned as plain JSON data, numbers canonical."""
    value, document = pipeline.read_source(source, document=document)
    kind = _kind_of(value, document)
    pipeline.load(kind, value, document=document)
    return pipeline.canonical(kind, value)


def load_replay_log(path: str | os.PathLike[str]) -> list[LogLine]:
    """Every record of a log file, strictly; the first bad line raises ``ContractError`` naming ``<file>:<line>``."""
    p = Path(path)
    try:
        with p.open("rb") as fh:
            if os.fstat(fh.fileno()).st_size > MAX_LOG_BYTES:
                raise DocumentReadError(
                    [Problem("document_too_large", "", f"larger than {MAX_LOG_BYTES} bytes")], document=str(p)
                )
            data = fh.read()
    except OSError as exc:
        raise DocumentReadError(
            [Problem("document_unreadable", "", f"cannot read {p}: {exc.strerror or exc}")], document=str(p)
        ) from None
    if data and not data.endswith(b"\n"):
        lines = data.count(b"\n") + 1
        raise DocumentReadError(
            [Problem("invalid_json", "", f"line {lines} is not terminated by a newline (a torn write)")],
            document=f"{p}:{lines}",
        )
    out = []
    for number, raw in enumerate(data.split(b"\n")[:-1], start=1):
        where = f"{p}:{number}"
        record = load_replay_record(parse_json(raw, source=where, limit=MAX_DOCUMENT_BYTES), document=where)
        if canonical_json(record) != raw:  # what the writer writes: canonical JSON of canonical numbers
            raise ContractError(
                [Problem("schema_violation", "", "the line is not the canonical JSON of its record")], document=where
            )
        out.append(LogLine(number, record))
    return out


def verify_replay_log(lines: Sequence[LogLine], *, published: bool, source: str = REPLAY_LOG) -> list[Problem]:
    """``replay-log.order`` over a whole log: each problem's pointer is ``/<line>``, its message names the request."""
    problems: list[Problem] = []
    seen: set[str] = set()
    open_request: str | None = None  # the latest request, while it has no outcome

    def bad(line: LogLine, message: str) -> None:
        problems.append(Problem("inconsistent_fields", f"/{line.line}", message))

    if not lines:
        problems.append(Problem("inconsistent_fields", "", f"{source} holds no record"))  # pointer "/<n>": line n
        return problems
    for line in lines:
        rid = line.request_id
        if line.is_request:
            if rid in seen:
                bad(line, f"request {rid!r} appears twice")
            seen.add(rid)
            open_request = rid
        elif rid != open_request:
            bad(
                line,
                f"outcome of request {rid!r} does not follow that request's record (latest open: {open_request!r})",
            )
        else:
            open_request = None
    if not lines[0].is_request:
        bad(lines[0], "the first record is not a request")
    last = lines[-1]
    if published and (last.is_request or last.record["status"] != "completed"):
        what = "request" if last.is_request else f"{last.record['status']} outcome"
        bad(last, f"the log of a published adapter ends with the completed outcome of its last request, not the "
                  f"{what} of request {last.request_id!r}")  # fmt: skip
    return problems


def requests_of(lines: Iterable[LogLine]) -> list[LogLine]:
    return [line for line in lines if line.is_request]


def pending_log(registry: str | os.PathLike[str], adapter_name: str) -> Path:
    """Where the log of ``adapter_name`` is kept while no adapter of it is published: the hidden
    ``<registry>/.<adapter>.replay.jsonl`` beside its directory (``kiln.trainers._lineage`` writes it)."""
    return Path(registry) / f".{adapter_name}.{REPLAY_LOG}"


def _line(record: dict[str, Any]) -> bytes:
    return pipeline.render(_kind_of(record, None), record) + b"\n"


def render_replay_log(records: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(_line(r) for r in records)


def write_replay_log(path: str | os.PathLike[str], records: Iterable[dict[str, Any]]) -> Path:
    """The whole log, canonical and crash-atomic."""
    atomic_write_bytes(path, render_replay_log(records))
    return Path(path)


def append_replay_record(path: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Add one record at the end, synced to disk before returning (the file is rewritten crash-atomically)."""
    p = Path(path)
    try:
        old = p.read_bytes()
    except FileNotFoundError:
        old = b""
    atomic_write_bytes(p, old + _line(record))
    return p
