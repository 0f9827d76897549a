"""The request lineage (``lineage.json``) beside an adapter, and its verification (``kiln replay verify``).

``lineage.json`` names the base model (config and weight digests, the path for information), the warm-start parent
(its name, the digest its weights had, its ``replay_hash``), every request record of ``replay.jsonl`` by id and
digest in file order, and ``replay_hash`` (``kiln.documents.digests.replay_hash``, ``kiln.replay-hash.v1``): the parent's
replay hash, the hashed base-model fields and every request record chained into one digest. Outcome records are
not covered; the train receipt's ``request_lineage`` binds both files whole by digest, and the adapter manifest binds
the receipt.

``lineage.unique-requests`` is checked here; ``lineage.replay-hash`` needs the log and the parent and is checked
by ``verify_lineage``, which walks an adapter's ancestry root to leaf, each parent resolved as a sibling directory
of the same registry, and stops at the first problem with an error naming the file, line and request:

1. from the leaf up, each ``lineage.json`` loads strictly and names a parent that is a sibling directory; a name
   seen twice on the way up is a cycle;
2. then from the root down, per adapter: ``replay.jsonl`` reads strictly, line by line; its request records are
   those the lineage lists, one by one (id, then digest: an edited, deleted, inserted or reordered record is named
   by line and id); its records are in order (``kiln.artifacts.replay_log.verify_replay_log``); the parent's
   weights still hash to the recorded digest and its (already verified) replay hash is the one recorded; the replay
   hash recomputes; and the adapter manifest binds the train receipt, whose ``request_lineage`` binds both
   files and that replay hash.

``load_lineage`` (strict), ``write_lineage`` (canonical, atomic), ``build_lineage``, ``lineage_link``,
``binding_problems``, ``verify_lineage``. Nothing here trains or generates: the audit checks integrity only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.artifacts.adapter_files import MANIFEST_FILE, WEIGHTS_FILE
from kiln.artifacts.replay_log import REPLAY_LOG, LogLine, load_replay_log, requests_of, verify_replay_log
from kiln.documents import pipeline
from kiln.documents.digests import REPLAY_HASH_ALGORITHM, file_sha256, json_sha256, prefixed, replay_hash
from kiln.documents.jsonio import read_json_file
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import ContractError, IntegrityError, Problem

DOC = "RequestLineage"
LINEAGE_FILE = "lineage.json"

__all__ = [
    "LINEAGE_FILE",
    "VerifiedAdapter",
    "binding_problems",
    "build_lineage",
    "lineage_link",
    "load_lineage",
    "verify_lineage",
    "write_lineage",
]


@semantic_rule(DOC, "lineage.unique-requests")
def _unique_requests(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    seen: set[str] = set()
    for i, entry in enumerate(doc["requests"]):
        if entry["request_id"] in seen:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "requests", i, "request_id"),
                f"request {entry['request_id']!r} is listed twice",
            )
        seen.add(entry["request_id"])


def load_lineage(source: pipeline.Source) -> Any:
    return pipeline.load(DOC, source)


def write_lineage(path: str | os.PathLike[str], lineage: dict[str, Any]) -> Path:
    return pipeline.write(DOC, path, lineage)


def build_lineage(
    adapter_name: str, base_model: dict[str, Any], parent: dict[str, Any] | None, requests: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """The lineage document of ``requests`` (the request records of the log, in file order)."""
    return {
        "schema_version": 1,
        "lineage_type": "kiln_request_lineage",
        "adapter_name": adapter_name,
        "hash_algorithm": REPLAY_HASH_ALGORITHM,
        "base_model": dict(base_model),
        "parent": None if parent is None else dict(parent),
        "requests": [{"request_id": r["request_id"], "record_sha256": json_sha256(r)} for r in requests],
        "replay_hash": _recompute(parent, base_model, requests),
    }


def _recompute(parent: dict[str, Any] | None, base_model: dict[str, Any], requests: Sequence[dict[str, Any]]) -> str:
    return replay_hash(
        parent["replay_hash"] if parent else None, base_model["config_hash"], base_model["weights_sha256"], requests
    )


def _digest(path: Path) -> str:
    return prefixed(file_sha256(path)[0])


def lineage_link(directory: Path, lineage: dict[str, Any]) -> dict[str, Any]:
    """The ``RequestLineageLink`` of the two files in ``directory`` (receipt and manifest ``request_lineage``)."""
    return {
        "replay_log_sha256": _digest(directory / REPLAY_LOG),
        "lineage_sha256": _digest(directory / LINEAGE_FILE),
        "replay_hash": lineage["replay_hash"],
        "request_count": len(lineage["requests"]),
    }


def binding_problems(directory: Path, receipt: Any) -> list[str]:
    """``manifest.file-hashes`` carried one step further: the manifest binds the receipt, the receipt's
    ``request_lineage`` binds ``replay.jsonl`` and ``lineage.json``. What differs between that link and the files
    beside it (nothing when the receipt links none)."""
    link = receipt.get("request_lineage") if isinstance(receipt, dict) else None
    if not isinstance(link, dict):
        return []
    problems = []
    for name, field in ((REPLAY_LOG, "replay_log_sha256"), (LINEAGE_FILE, "lineage_sha256")):
        path = directory / name
        if not path.is_file() or path.is_symlink():
            problems.append(f"train receipt's request_lineage.{field}: {name} is missing")
            continue
        actual = _digest(path)
        if actual != link.get(field):
            problems.append(
                f"train receipt's request_lineage.{field} is {link.get(field)} but {name} hashes to {actual}"
            )
    return problems


@dataclass(frozen=True)
class VerifiedAdapter:
    """One adapter of a verified ancestry."""

    name: str
    path: Path
    replay_hash: str
    requests: int
    outcomes: int
    parent: str | None


def _fail(code: str, where: str, message: str, pointer: str = "") -> ContractError:
    problem = Problem(code, pointer, message)
    return (
        IntegrityError([problem], document=where)
        if code == "digest_mismatch"
        else ContractError([problem], document=where)
    )


def _ancestry(leaf: Path) -> list[tuple[Path, dict[str, Any]]]:
    """``(directory, lineage)`` from the root to ``leaf``; a missing parent or a cycle raises."""
    chain: list[tuple[Path, dict[str, Any]]] = []
    seen: dict[str, Path] = {}
    current = leaf
    while True:
        key = os.path.realpath(current)
        if key in seen:
            names = " -> ".join(p.name for p, _ in chain) + f" -> {current.name}"
            raise _fail("inconsistent_fields", str(current / LINEAGE_FILE), f"the parent links form a cycle: {names}",
                        "/parent/adapter_name")  # fmt: skip
        seen[key] = current
        path = current / LINEAGE_FILE
        if not path.is_file():
            raise _fail(
                "document_unreadable", str(path), f"{current.name} has no {LINEAGE_FILE}: it has no request lineage"
            )
        lineage = read_json_file(path)
        pipeline.load(DOC, lineage, document=str(path))
        chain.append((current, lineage))
        parent = lineage["parent"]
        if parent is None:
            return chain[::-1]
        nxt = current.parent / parent["adapter_name"]
        if not nxt.is_dir():
            raise _fail("inconsistent_fields", str(path),
                        f"parent adapter {parent['adapter_name']!r} is not a sibling directory of {current.name} "
                        f"in {current.parent}", "/parent/adapter_name")  # fmt: skip
        current = nxt


def _check_requests(path: Path, requests: list[LogLine], lineage: dict[str, Any]) -> None:
    """The log's request records are exactly those the lineage lists, one by one."""
    listed = lineage["requests"]
    for i, line in enumerate(requests):
        where = f"{path}:{line.line}"
        if i >= len(listed):
            raise _fail("inconsistent_fields", where,
                        f"request {line.request_id!r} is not in {LINEAGE_FILE} (it lists {len(listed)} requests)")  # fmt: skip
        expected = listed[i]
        if line.request_id != expected["request_id"]:
            others = [e["request_id"] for e in listed]
            found = (
                f"listed as request {others.index(line.request_id) + 1}" if line.request_id in others else "not listed"
            )
            raise _fail("inconsistent_fields", where,
                        f"request {i + 1} is {line.request_id!r} ({found}), but {LINEAGE_FILE} lists "
                        f"{expected['request_id']!r} there: a request record was deleted, inserted or reordered")  # fmt: skip
        actual = json_sha256(line.record)
        if actual != expected["record_sha256"]:
            raise _fail("digest_mismatch", where,
                        f"request {line.request_id!r} hashes to {actual} but {LINEAGE_FILE} records "
                        f"{expected['record_sha256']}: the record was edited")  # fmt: skip
    if len(requests) < len(listed):
        missing = listed[len(requests)]["request_id"]
        after = f" after line {requests[-1].line}" if requests else ""
        raise _fail("inconsistent_fields", str(path),
                    f"request {missing!r} ({len(requests) + 1} of {len(listed)} in {LINEAGE_FILE}) is missing{after}: "
                    "a request record was deleted")  # fmt: skip


def _check_parent(directory: Path, lineage: dict[str, Any], verified: dict[str, VerifiedAdapter]) -> None:
    parent = lineage["parent"]
    if parent is None:
        return
    where = str(directory / LINEAGE_FILE)
    parent_dir = directory.parent / parent["adapter_name"]
    weights = parent_dir / WEIGHTS_FILE
    actual = _digest(weights) if weights.is_file() else None
    if actual != parent["adapter_model_sha256"]:
        raise _fail("digest_mismatch", where,
                    f"parent {parent['adapter_name']!r}: {WEIGHTS_FILE} "
                    f"{'is missing' if actual is None else 'hashes to ' + actual} but this lineage records "
                    f"{parent['adapter_model_sha256']}", "/parent/adapter_model_sha256")  # fmt: skip
    above = verified.get(os.path.realpath(parent_dir))
    recorded = parent["replay_hash"]
    if recorded is not None and (above is None or above.replay_hash != recorded):
        have = "no request lineage" if above is None else f"replay hash {above.replay_hash}"
        raise _fail("digest_mismatch", where,
                    f"parent {parent['adapter_name']!r} has {have} but this lineage chains {recorded}",
                    "/parent/replay_hash")  # fmt: skip


def _check_binding(directory: Path, lineage: dict[str, Any]) -> None:
    """The manifest binds the receipt (by ``receipt_hash``), the receipt links both files and this replay hash."""
    path = directory / MANIFEST_FILE
    if not path.exists():
        raise _fail(
            "inconsistent_fields",
            str(path),
            f"{MANIFEST_FILE} is missing: nothing binds {REPLAY_LOG} and {LINEAGE_FILE}",
        )
    manifest = read_json_file(path)
    pipeline.load("AdapterManifest", manifest, document=str(path))
    name = manifest["files"]["train_receipt"]
    receipt_path = directory / name if name else None
    if receipt_path is None or not receipt_path.is_file():
        raise _fail(
            "inconsistent_fields", str(path), f"{MANIFEST_FILE} binds no train receipt, which links the request lineage"
        )
    if _digest(receipt_path) != manifest["receipt_hash"]:
        raise _fail("digest_mismatch", str(receipt_path), f"{name} hashes to {_digest(receipt_path)} but {MANIFEST_FILE} "
                    f"records {manifest['receipt_hash']}")  # fmt: skip
    receipt = read_json_file(receipt_path)
    link = receipt.get("request_lineage") if isinstance(receipt, dict) else None
    if not isinstance(link, dict):
        raise _fail(
            "inconsistent_fields", str(receipt_path), f"{name} links no request lineage, but {LINEAGE_FILE} is here"
        )
    problems = binding_problems(directory, receipt)
    if problems:
        raise _fail("digest_mismatch", str(receipt_path), "; ".join(problems), "/request_lineage")
    if link.get("replay_hash") != lineage["replay_hash"]:
        raise _fail("digest_mismatch", str(receipt_path), f"request_lineage.replay_hash is {link.get('replay_hash')} "
                    f"but {LINEAGE_FILE} records {lineage['replay_hash']}", "/request_lineage/replay_hash")  # fmt: skip


def verify_lineage(leaf: str | os.PathLike[str]) -> list[VerifiedAdapter]:
    """Verify the request lineage of the adapter in ``leaf`` and of every ancestor, root first (see the module
    docstring); returns them root first, or raises ``ContractError`` naming the first problem."""
    verified: dict[str, VerifiedAdapter] = {}
    out = []
    for directory, lineage in _ancestry(Path(leaf)):
        log_path = directory / REPLAY_LOG
        lines = load_replay_log(log_path)
        published = (directory / WEIGHTS_FILE).exists()
        requests = requests_of(lines)
        _check_requests(log_path, requests, lineage)  # first: the hashed records name an edit most precisely
        order = verify_replay_log(lines, published=published, source=str(log_path))
        if order:
            line = order[0].pointer.lstrip("/")
            raise ContractError(order, document=f"{log_path}:{line}" if line else str(log_path))
        _check_parent(directory, lineage, verified)
        records = [line.record for line in requests]
        actual = _recompute(lineage["parent"], lineage["base_model"], records)
        if actual != lineage["replay_hash"]:
            raise _fail("digest_mismatch", str(directory / LINEAGE_FILE),
                        f"replay_hash is {lineage['replay_hash']} but recomputes to {actual}", "/replay_hash")  # fmt: skip
        _check_binding(directory, lineage)
        parent = lineage["parent"]
        found = VerifiedAdapter(
            directory.name, directory, actual, len(requests), len(lines) - len(requests),
            parent["adapter_name"] if parent else None,
        )  # fmt: skip
        verified[os.path.realpath(directory)] = found
        out.append(found)
    return out
