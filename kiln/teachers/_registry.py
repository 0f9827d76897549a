"""The teacher registry: one ``TeacherRegistryRecord`` per alias under ``<KILN_HOME>/teachers/``.

``<root>/<alias>.json`` is written once, crash-atomically and exclusively (a temp file,
fsync, then a hard link that fails if the alias exists: aliases are immutable) and read
strictly (schema, semantic rules -- the identity revision recomputes -- and the bindings
of this module: the file name is the alias, the content revision is what the kind says).

Kinds (``RegisterTeacherRequest.kind``):

* ``local``    ``model_id`` is an absolute model directory (plus an optional registry
               ``adapter``); the identity is computed from disk; status ``verified``.
* ``remote``   ``provider`` ``vllm``, ``url``, ``model_id``; the identity is the
               ``teacher_identity`` of the model card ``GET {url}/v1/models`` lists for
               ``model_id`` (none: refused); ``credential_id`` names the environment
               variable ``KILN_CREDENTIAL_<ID>`` whose value is sent as a bearer token; status
               ``verified``.
* ``fixture``  no identity; status ``configured``. With a pre-scored file: its manifest
               line and every row are read strictly, and its path, bytes digest and
               manifest digest are pinned (``record.fixture``).

``reprobe(pinned)`` recomputes a pinned identity now and refuses any change
(``teacher_identity_mismatch``), naming each changed member.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln.documents.digests import file_sha256, json_sha256, prefixed, teacher_identity_revision
from kiln.documents.jsonio import parse_json, read_json_file
from kiln.errors import (
    AccessError,
    ConflictError,
    ContractError,
    IntegrityError,
    KilnError,
    NotFoundError,
    Problem,
    RequestError,
)
from kiln.host.config import configured_registry
from kiln.host.fs import create_exclusive, fsync_dir, name_problem, within_roots
from kiln.teachers._identity import (
    identity_differences,
    model_limits,
    probe_remote_identity,
    teacher_identity_for,
)

__all__ = [
    "RECORD",
    "RECORD_SCHEMA",
    "PinnedTeacher",
    "TeacherRegistry",
    "read_off_policy_file",
    "reprobe",
    "teachers_root",
]

RECORD = "TeacherRegistryRecord"
RECORD_SCHEMA = "kiln.teacher-registry-record.v1"
REQUEST = "RegisterTeacherRequest"
OFF_POLICY_MANIFEST = "OffPolicyDistillationManifestV1"
OFF_POLICY_ROW = "OffPolicyDistillationRow"
OFF_POLICY_MANIFEST_SCHEMA = "kiln.off-policy-distillation-manifest.v1"
SUFFIX = ".json"  # the ``teacher`` kind of ``kiln.host.fs.name_problem`` counts it


def teachers_root(home: Path) -> Path:
    """Where the registry lives under a Kiln home: ``<home>/teachers``."""
    return Path(home) / "teachers"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _refuse(message: str, hint: str | None = None) -> RequestError:
    return RequestError(message, code="training_invalid_request", hint=hint)


@dataclass(frozen=True)
class PinnedTeacher:
    """A registered teacher as a job uses it: what was pinned at registration."""

    alias: str
    kind: str
    model_id: str
    url: str | None
    credential_id: str | None
    adapter: str | None
    identity: dict[str, Any] | None
    identity_revision: str | None  # raw hex
    content_revision: str | None
    fixture: dict[str, Any] | None
    entry: dict[str, Any]
    adapter_dir: Path | None = None  # where a local teacher's adapter is, in the registry's adapter registry


# ----------------------------------------------------------------------------- pre-scored files


def _row_limits(row: dict[str, Any], manifest: dict[str, Any]) -> list[Problem]:
    """Admission checks of a row that need no tokenizer: K entries per position, ids below the vocabulary."""
    top_k, vocab = manifest["top_k"], manifest["vocab_size"]
    found = []
    for i, token in enumerate(row["teacher_tokens"]):
        if token["token_id"] >= vocab:
            found.append(
                Problem(
                    "out_of_range",
                    f"/teacher_tokens/{i}/token_id",
                    f"token id {token['token_id']} is not below the manifest's vocab_size {vocab}",
                )
            )
        if len(token["top_logprobs"]) != top_k:
            found.append(
                Problem(
                    "inconsistent_fields",
                    f"/teacher_tokens/{i}/top_logprobs",
                    f"position {i} has {len(token['top_logprobs'])} top log-probabilities; the manifest's top_k is "
                    f"{top_k}",
                )
            )
        for j, entry in enumerate(token["top_logprobs"]):
            if entry["token_id"] >= vocab:
                found.append(
                    Problem(
                        "out_of_range",
                        f"/teacher_tokens/{i}/top_logprobs/{j}/token_id",
                        f"token id {entry['token_id']} is not below the manifest's vocab_size {vocab}",
                    )
                )
    return found


def read_off_policy_file(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Strictly read a pre-scored JSONL file: ``(manifest, {"path", "sha256", "manifest_sha256"})``.

    The first non-blank line is the ``kiln.off-policy-distillation-manifest.v1`` record and
    every following non-blank line an ``OffPolicyDistillationRow``; a bad line raises
    ``ContractError`` naming its 1-based line number; the number of rows must equal
    ``row_count``.
    """
    path = Path(path).absolute()
    digest = hashlib.sha256()
    manifest: dict[str, Any] | None = None
    manifest_line = 0
    rows = 0
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise _refuse(f"cannot read the pre-scored file {path}: {exc.strerror or exc}") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            digest.update(line)
            if not line.strip():
                continue
            where = f"{path} line {number}"
            value = parse_json(line, source=where)
            definition = OFF_POLICY_MANIFEST if manifest is None else OFF_POLICY_ROW
            problems = contracts.problems(definition, value)
            if not problems and manifest is not None:
                problems = _row_limits(value, manifest)
            if problems:
                what = "the manifest line" if manifest is None else "this row"
                raise ContractError(problems, document=where, hint=f"fix {what} of the pre-scored file ({definition})")
            if manifest is None:
                manifest, manifest_line = value, number
            else:
                rows += 1
    if manifest is None:
        raise _refuse(
            f"the pre-scored file {path} is empty: its first line must be the {OFF_POLICY_MANIFEST_SCHEMA} record"
        )
    if rows != manifest["row_count"]:
        raise ContractError(
            [
                Problem(
                    "inconsistent_fields",
                    "/row_count",
                    f"the manifest announces {manifest['row_count']} rows but the file holds {rows}",
                )
            ],
            document=f"{path} line {manifest_line}",
        )
    pinned = {"path": str(path), "sha256": prefixed(digest.hexdigest()), "manifest_sha256": json_sha256(manifest)}
    return manifest, pinned


# ----------------------------------------------------------------------------- the registry


def _student_facts(student: Any) -> tuple[int, str | None]:
    """(vocab_size, raw tokenizer vocabulary digest) of the student ``LoadedModel``."""
    path = Path(student.path)
    config = getattr(getattr(student, "model", None), "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        vocab = model_limits(path)[0]
    tokenizer = path / "tokenizer.json"
    return vocab, (file_sha256(tokenizer)[0] if tokenizer.is_file() else None)


def _check_student(alias: str, student: Any, vocab_size: int | None, tokenizer_sha256: str | None) -> None:
    if student is None:
        return
    s_vocab, s_tokenizer = _student_facts(student)
    reasons = []
    if vocab_size is not None and vocab_size != s_vocab:
        reasons.append(f"its vocab_size is {vocab_size} but the student's is {s_vocab}")
    if tokenizer_sha256 is not None and s_tokenizer is not None and tokenizer_sha256 != s_tokenizer:
        reasons.append(
            f"its tokenizer vocabulary (tokenizer.json sha256 {tokenizer_sha256}) differs from the student's "
            f"({s_tokenizer})"
        )
    if reasons:
        raise _refuse(
            f"teacher {alias!r} cannot teach the served model {Path(student.path).name!r}: " + "; ".join(reasons),
            hint="distillation compares teacher and student distributions token id by token id: they need the same "
            "tokenizer and vocabulary",
        )


class TeacherRegistry:
    """Teachers by alias under ``root``; ``adapter_registry`` is where ``local`` teachers' adapters live
    (default: the adapter registry ``kiln.host.config`` resolves)."""

    def __init__(
        self, root: Path, *, adapter_registry: Path | None = None, model_roots: tuple[Path, ...] | None = None
    ):
        self.root = Path(root)
        self._adapters = Path(adapter_registry) if adapter_registry is not None else None
        # where a local teacher's model directory may be (the server's data roots and models); None: anywhere
        self.model_roots = model_roots

    @property
    def adapter_registry(self) -> Path:
        if self._adapters is not None:
            return self._adapters
        return configured_registry()

    def path(self, alias: str) -> Path:
        return self.root / f"{alias}{SUFFIX}"

    # --- add ------------------------------------------------------------------------------

    def add(self, request: dict[str, Any], *, fixture_file: Path | None = None, student: Any = None) -> dict[str, Any]:
        """Register ``request`` (``RegisterTeacherRequest``); returns the ``TeacherEntry``.

        ``fixture_file`` (``fixture`` only) pins a pre-scored file; ``student`` (a
        ``LoadedModel``) refuses a teacher whose vocabulary differs from it.
        """
        if not isinstance(request, dict):
            raise ContractError(
                [Problem("wrong_type", "", "a teacher registration is a JSON object")], document=REQUEST
            )
        request = dict(request)
        scored = None
        if fixture_file is not None and request.get("kind") == "fixture":
            scored = read_off_policy_file(fixture_file)  # every line strictly, before anything is written
            if request.get("model_id") is None:
                request["model_id"] = scored[0]["fixture_id"]  # model_id := the manifest's fixture_id
        problems = contracts.problems(REQUEST, request)
        if problems:
            raise ContractError(problems, document=REQUEST)
        alias, kind = request["alias"], request["kind"]
        why = name_problem(alias, kind="teacher")
        if why is not None:
            raise ContractError(
                [Problem("unsafe_path", "/alias", f"teacher alias {alias!r} is not path-safe: {why}")],
                document=REQUEST,
            )
        if fixture_file is not None and kind != "fixture":
            raise _refuse(f"a pre-scored file belongs to a fixture teacher; {alias!r} is a {kind} teacher")
        if self.path(alias).exists():
            raise self._conflict(alias)
        content_revision: str | None
        if kind == "local":
            entry, content_revision, fixture = self._local(request, student)
        elif kind == "remote":
            entry, content_revision, fixture = self._remote(request, student)
        else:
            entry, content_revision, fixture = self._fixture(request, scored, student)
        record = {
            "schema": RECORD_SCHEMA,
            "entry": entry,
            "content_revision": content_revision,
            "registered_at": _now(),
            "fixture": fixture,
        }
        self._write_new(alias, contracts.render(RECORD, record))
        return entry

    def _conflict(self, alias: str) -> ConflictError:
        return ConflictError(
            f"teacher alias {alias!r} is already registered; aliases are immutable",
            code="teacher_conflict",
            hint=f"register under another alias, or remove {alias!r} first (DELETE /v1/teachers/{alias})",
        )

    def _write_new(self, alias: str, data: bytes) -> None:
        """Crash-atomic and exclusive: temp file, fsync, hard link (fails when the alias exists), directory fsync."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not create_exclusive(self.path(alias), data):
            raise self._conflict(alias)

    def _spec(self, request: dict[str, Any], **facts: Any) -> dict[str, Any]:
        spec = {
            "alias": request["alias"],
            "kind": request["kind"],
            "provider": request.get("provider"),
            "model_id": request.get("model_id") or "",
            "max_top_k": None,
            "vocab_size": None,
            "supports_full_vocab": None,
            "tokenizer_hash": None,
            "url": request.get("url"),
            "notes": request.get("notes"),
            "adapter": request.get("adapter"),
        }
        spec.update(facts)
        if request.get("credential_id") is not None:
            spec["credential_id"] = request["credential_id"]
        return spec

    @staticmethod
    def _verified(spec: dict[str, Any], identity: dict[str, Any], *, full_vocab: bool) -> dict[str, Any]:
        top_k = min(identity["max_top_k"], identity["max_prompt_logprob_candidates"])
        tokenizer_hash = prefixed(identity["tokenizer_vocab_sha256"])
        spec.update(
            max_top_k=top_k,
            vocab_size=identity["vocab_size"],
            supports_full_vocab=full_vocab,
            tokenizer_hash=tokenizer_hash,
            identity=identity,
        )
        return {
            "spec": spec,
            "capabilities": {
                "teacher_id": spec["alias"],
                "vocab_size": identity["vocab_size"],
                "max_top_k": top_k,
                "supports_full_vocab": full_vocab,
                "supports_batched": False,  # one sequence per scoring call / completion request
                "tokenizer_hash": tokenizer_hash,
            },
            "status": "verified",
            "usable": True,
            "identity_revision": prefixed(teacher_identity_revision(identity)),
        }

    def _local(self, request: dict[str, Any], student: Any) -> tuple[dict, str, None]:
        alias, model_id = request["alias"], request.get("model_id")
        if not model_id or "\x00" in model_id or not Path(model_id).is_absolute():
            raise _refuse(
                f"a local teacher's model_id is the absolute path of its model directory; got {model_id!r}",
                hint="for example /srv/models/teacher (the CLI resolves --model PATH for you)",
            )
        if self.model_roots is not None and not within_roots(model_id, self.model_roots):
            listed = ", ".join(str(r) for r in self.model_roots)
            raise AccessError(
                f"model_id {model_id!r} is not inside a directory this server may read models from ({listed}), "
                "every symlink resolved",
                pointer="/model_id",
                hint="put the teacher's model directory under one of them (training.data_roots adds more), or "
                "register it on this machine with `kiln teachers add --local`",
            )
        model_dir = Path(model_id)
        if not (model_dir / "config.json").is_file():
            raise _refuse(f"{model_dir} is not a Hugging Face model directory (no config.json)")
        adapter_dir = None
        if request.get("adapter") is not None:
            name = request["adapter"]
            why = name_problem(name, kind="adapter")
            adapter_dir = self.adapter_registry / name
            if why is not None or not adapter_dir.is_dir():
                raise _refuse(
                    f"adapter {name!r} is not in the adapter registry {self.adapter_registry}",
                    hint="`kiln adapters list --local` shows the registry",
                )
        identity = teacher_identity_for(model_dir, served_model_id=model_dir.name, adapter_dir=adapter_dir)
        _check_student(alias, student, identity["vocab_size"], identity["tokenizer_vocab_sha256"])
        entry = self._verified(self._spec(request, model_id=str(model_dir)), identity, full_vocab=True)
        return entry, prefixed(identity["base_model_sha256"]), None

    def _remote(self, request: dict[str, Any], student: Any) -> tuple[dict, str, None]:
        from kiln.teachers._identity import base_url

        url = base_url(request["url"])
        identity = probe_remote_identity(url, request["model_id"], request.get("credential_id"))
        _check_student(request["alias"], student, identity["vocab_size"], identity["tokenizer_vocab_sha256"])
        entry = self._verified(self._spec(request, url=url), identity, full_vocab=False)
        return entry, prefixed(identity["base_model_sha256"]), None

    def _fixture(
        self, request: dict[str, Any], scored: tuple[dict[str, Any], dict[str, Any]] | None, student: Any
    ) -> tuple[dict, str | None, dict | None]:
        if scored is None:
            spec = self._spec(request, supports_full_vocab=False)
            return {"spec": spec, "capabilities": None, "status": "configured", "usable": True}, None, None
        manifest, pinned = scored
        if request["model_id"] != manifest["fixture_id"]:
            raise _refuse(
                f"model_id {request['model_id']!r} is not the pre-scored file's fixture_id {manifest['fixture_id']!r}",
                hint="leave model_id out (it defaults to the fixture_id) or give the fixture_id",
            )
        _check_student(request["alias"], student, manifest["vocab_size"], manifest["tokenizer_vocab_sha256"])
        tokenizer_hash = prefixed(manifest["tokenizer_vocab_sha256"])
        spec = self._spec(
            request,
            max_top_k=manifest["top_k"],
            vocab_size=manifest["vocab_size"],
            supports_full_vocab=False,
            tokenizer_hash=tokenizer_hash,
        )
        entry = {
            "spec": spec,
            "capabilities": {
                "teacher_id": spec["alias"],
                "vocab_size": manifest["vocab_size"],
                "max_top_k": manifest["top_k"],
                "supports_full_vocab": False,
                "supports_batched": True,  # every row is pre-scored
                "tokenizer_hash": tokenizer_hash,
            },
            "status": "configured",
            "usable": True,
            "off_policy_manifest": OFF_POLICY_MANIFEST_SCHEMA,
        }
        return entry, pinned["sha256"], pinned

    # --- read -----------------------------------------------------------------------------

    def _aliases(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            p.name.removesuffix(SUFFIX)
            for p in self.root.iterdir()
            if p.name.endswith(SUFFIX) and not p.name.startswith(".") and p.is_file()
        )

    def _record(self, alias: str) -> dict[str, Any]:
        path = self.path(alias)
        if name_problem(alias, kind="teacher") is not None or not path.is_file():
            raise NotFoundError(
                f"no teacher {alias!r} is registered in {self.root}",
                code="teacher_not_found",
                hint="GET /v1/teachers (or `kiln teachers list`) lists the registered aliases",
            )
        value = read_json_file(path)
        contracts.load(RECORD, value, document=str(path))
        _check_record(alias, value, str(path))
        return contracts.canonical(RECORD, value)

    def list(self) -> list[dict[str, Any]]:
        """Every ``TeacherEntry``, sorted by alias (each record loaded strictly)."""
        return [self._record(alias)["entry"] for alias in self._aliases()]

    def get(self, alias: str) -> PinnedTeacher:
        record = self._record(alias)
        entry = record["entry"]
        spec = entry["spec"]
        revision = entry.get("identity_revision")
        adapter = spec.get("adapter")
        return PinnedTeacher(
            alias=spec["alias"],
            kind=spec["kind"],
            model_id=spec["model_id"],
            url=spec.get("url"),
            credential_id=spec.get("credential_id"),
            adapter=adapter,
            identity=spec.get("identity"),
            identity_revision=None if revision is None else revision.removeprefix("sha256:"),
            content_revision=record["content_revision"],
            fixture=record["fixture"],
            entry=entry,
            adapter_dir=None if adapter is None else self.adapter_registry / adapter,
        )

    def remove(self, alias: str) -> dict[str, Any]:
        """Remove the alias (``DeleteTeacherResponse``); receipts that recorded it are unchanged."""
        path = self.path(alias)
        if name_problem(alias, kind="teacher") is not None or not path.is_file():
            raise NotFoundError(f"no teacher {alias!r} is registered in {self.root}", code="teacher_not_found")
        try:
            path.unlink()
        except FileNotFoundError:
            raise NotFoundError(
                f"no teacher {alias!r} is registered in {self.root}", code="teacher_not_found"
            ) from None
        fsync_dir(self.root)
        return {"status": "deleted", "alias": alias}


def _check_record(alias: str, record: dict[str, Any], where: str) -> None:
    """Bindings beyond the schema: file name = alias, content revision and fixture as the kind says."""
    entry = record["entry"]
    spec = entry["spec"]
    if spec["alias"] != alias:
        raise ContractError(
            [
                Problem(
                    "inconsistent_fields", "/entry/spec/alias", f"the record of {alias!r} names alias {spec['alias']!r}"
                )
            ],
            document=where,
        )
    identity = spec.get("identity")
    if spec["kind"] in ("local", "remote"):
        if identity is None:
            raise ContractError(
                [
                    Problem(
                        "inconsistent_fields", "/entry/spec/identity", f"a {spec['kind']} teacher has a pinned identity"
                    )
                ],
                document=where,
            )
        expected = prefixed(identity["base_model_sha256"])
        if record["content_revision"] != expected or record["fixture"] is not None:
            raise IntegrityError(
                [
                    Problem(
                        "digest_mismatch",
                        "/content_revision",
                        f"content_revision is {record['content_revision']} but the pinned identity's base weights give "
                        f"{expected} (and a {spec['kind']} teacher has no fixture file)",
                    )
                ],
                document=where,
            )
    else:
        fixture = record["fixture"]
        pinned: str | None = None if fixture is None else fixture["sha256"]
        if record["content_revision"] != pinned:
            raise IntegrityError(
                [
                    Problem(
                        "digest_mismatch",
                        "/content_revision",
                        f"content_revision is {record['content_revision']} but the fixture file pinned gives {pinned}",
                    )
                ],
                document=where,
            )


# ----------------------------------------------------------------------------- re-probing


def reprobe(pinned: PinnedTeacher, *, registry_dir: Path | None = None) -> None:
    """Recompute ``pinned``'s identity now; ``teacher_identity_mismatch`` naming every change.

    ``local``: from disk (``registry_dir``, the adapter registry, overrides where the pinned
    adapter is looked up); ``remote``: ``GET {url}/v1/models``; ``fixture``: nothing to probe.
    """
    if pinned.kind == "fixture" or pinned.identity is None:
        return
    try:
        if pinned.kind == "local":
            adapter_dir = None
            if pinned.adapter is not None:
                adapter_dir = Path(registry_dir) / pinned.adapter if registry_dir is not None else pinned.adapter_dir
            now = teacher_identity_for(
                Path(pinned.model_id),
                served_model_id=pinned.identity["served_model_id"],
                adapter_dir=adapter_dir,
            )
        else:
            now = probe_remote_identity(pinned.url or "", pinned.model_id, pinned.credential_id)
    except KilnError as exc:
        raise ConflictError(
            f"teacher {pinned.alias!r} cannot be re-probed, so its pinned identity cannot be confirmed: {exc.message}",
            code="teacher_identity_mismatch",
            hint=exc.hint,
        ) from None
    changes = identity_differences(pinned.identity, now)
    if changes:
        raise ConflictError(
            f"teacher {pinned.alias!r} no longer matches the identity pinned at registration: " + "; ".join(changes),
            code="teacher_identity_mismatch",
            hint=f"register the changed teacher under a new alias (aliases are immutable), or restore {pinned.alias!r}",
        )
