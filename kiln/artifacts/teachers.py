"""Teacher registry bodies: ``POST /v1/teachers`` (``RegisterTeacherRequest``), a stored
teacher (``TeacherSpec``) and a listed one (``TeacherEntry``: spec, resolved capabilities,
status, usability and the revision of the pinned identity), plus the pinned identity itself
(``TeacherIdentityV1``, ``kiln.teacher-identity.v1``), whose revision is the raw SHA-256 of
its canonical JSON (``sha256:``-prefixed in ``TeacherEntry.identity_revision``).

Whether an alias is registered, a credential exists or a probe still matches the pinned
identity needs the server and is checked at admission, not here.

``teacher_identity_revision_of`` (raw revision of a strictly validated identity),
``load_teacher_identity``, ``load_teacher_entry``, ``load_register_teacher_request`` (strict).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kiln.documents import pipeline
from kiln.documents.digests import prefixed, teacher_identity_revision
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import Problem

IDENTITY = "TeacherIdentityV1"
ENTRY = "TeacherEntry"
REQUEST = "RegisterTeacherRequest"
SPEC = "TeacherSpec"
REMOTE_PROVIDER = "vllm"

__all__ = [
    "load_register_teacher_request",
    "load_teacher_entry",
    "load_teacher_identity",
    "teacher_identity_revision_of",
]


def _kind_field_problems(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    kind = doc["kind"]
    if kind == "remote" and doc.get("provider") != REMOTE_PROVIDER:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "provider"),
            f"a remote teacher needs provider {REMOTE_PROVIDER!r}; it is {doc.get('provider')!r}",
        )
    needs = {"remote": ("model_id", "url"), "fixture": ("model_id",)}.get(kind, ())
    for key in needs:
        if not doc.get(key):
            yield Problem(
                "inconsistent_fields",
                ptr(at, key),
                f"a {kind} teacher needs a non-empty {key}; it is {doc.get(key)!r}",
            )
    forbidden = {"remote": ("adapter",), "fixture": ("provider", "url", "credential_id", "adapter")}.get(
        kind, ("provider", "url", "credential_id")
    )
    for key in forbidden:
        if doc.get(key) is not None:
            yield Problem(
                "inconsistent_fields",
                ptr(at, key),
                f"{key} is {doc[key]!r} but a {kind} teacher has none; it must be null or absent",
            )


@semantic_rule(REQUEST, "teacher.kind-fields")
def _request_kind_fields(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    yield from _kind_field_problems(doc, at)


@semantic_rule(SPEC, "teacher-spec.kind-fields")
def _spec_kind_fields(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    yield from _kind_field_problems(doc, at)


@semantic_rule(ENTRY, "teacher-entry.identity-revision")
def _revision_presence(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    has_identity, has_revision = "identity" in doc["spec"], "identity_revision" in doc
    if has_identity != has_revision:
        detail = "spec.identity is absent" if has_revision else "spec.identity is present"
        yield Problem(
            "inconsistent_fields",
            ptr(at, "identity_revision"),
            f"identity_revision is {'present' if has_revision else 'absent'} but {detail}: "
            "it is present exactly when there is an identity",
        )


@semantic_rule(ENTRY, "teacher-entry.identity-revision", integrity=True)
def _revision_digest(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if "identity" not in doc["spec"] or "identity_revision" not in doc:
        return
    expected = prefixed(teacher_identity_revision(doc["spec"]["identity"]))
    if doc["identity_revision"] != expected:
        yield Problem(
            "digest_mismatch",
            ptr(at, "identity_revision"),
            f"identity_revision does not recompute from spec.identity: recorded {doc['identity_revision']}, "
            f"computed {expected}",
        )


@semantic_rule(ENTRY, "teacher-entry.capabilities")
def _capabilities(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    spec, caps = doc["spec"], doc["capabilities"]
    identity = spec.get("identity")
    if caps is not None and caps["teacher_id"] != spec["alias"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "capabilities", "teacher_id"),
            f"capabilities.teacher_id is {caps['teacher_id']!r} but spec.alias is {spec['alias']!r}",
        )
    if identity is None:
        return
    vocab = identity["vocab_size"]
    if spec["vocab_size"] != vocab:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "spec", "vocab_size"),
            f"spec.vocab_size is {spec['vocab_size']!r} but the pinned identity's vocab_size is {vocab}",
        )
    if caps is None:
        return
    if caps["vocab_size"] != vocab:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "capabilities", "vocab_size"),
            f"capabilities.vocab_size is {caps['vocab_size']} but the pinned identity's vocab_size is {vocab}",
        )
    if caps["max_top_k"] > identity["max_top_k"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "capabilities", "max_top_k"),
            f"capabilities.max_top_k is {caps['max_top_k']} but the pinned identity allows at most "
            f"{identity['max_top_k']}",
        )


@semantic_rule(ENTRY, "teacher-entry.status")
def _status(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if doc["status"] == "verified" and "identity" not in doc["spec"]:
        yield Problem("inconsistent_fields", ptr(at, "status"), "status is 'verified' but spec.identity is absent")
    if doc["status"] == "unavailable" and doc["usable"]:
        yield Problem("inconsistent_fields", ptr(at, "usable"), "an 'unavailable' teacher cannot be usable")


def teacher_identity_revision_of(identity: Any) -> str:
    """Raw revision (64 hex) of a ``TeacherIdentityV1`` model or dict, after strict validation (of its canonical
    form: ``"vocab_size": 32000.0`` and ``32000`` are one identity)."""
    data = pipeline.to_json(identity)
    pipeline.load(IDENTITY, data)
    return teacher_identity_revision(pipeline.canonical(IDENTITY, data))


def load_teacher_identity(source: pipeline.Source) -> Any:
    return pipeline.load(IDENTITY, source)


def load_teacher_entry(source: pipeline.Source) -> Any:
    return pipeline.load(ENTRY, source)


def load_register_teacher_request(source: pipeline.Source) -> Any:
    return pipeline.load(REQUEST, source)
