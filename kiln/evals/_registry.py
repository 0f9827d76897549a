"""The suite registry: content-addressed ``kiln.eval-suite.v1`` suites under ``<KILN_HOME>/eval-suites/``.

Layout::

    <root>/<name>.json            the suite, canonical JSON (what ``suite_sha256`` hashes)
    <root>/.entries/<name>.json   its ``EvalSuiteEntry`` (digests, example count, registration time)

Suite names are ``AdapterName``s that also pass ``kiln.host.fs.name_problem`` (kind ``suite``:
never starting with ``.``, ``<name>.json`` a file name), so the hidden ``.entries``
directory and the temp files cannot collide with a suite. Both files are written once,
crash-atomically and exclusively (temp file, fsync, hard link that fails if the name
exists, directory fsync); the entry is written second and is the commit point: a suite
file without an entry (a crash between the two) is not listed, is completed by
registering the same content again and is cleaned up by ``remove``.

A suite is stored and hashed in its canonical form, canonical numbers included
(``kiln.contracts.canonical``): ``"max_tokens": 16.0`` and ``16`` are one suite with one digest.
``get`` hashes the suite file's bytes first (they are the canonical JSON ``suite_sha256``
covers): a file whose digest no longer matches its entry is refused before it is parsed
(``IntegrityError``, ``digest_mismatch``); then both are read strictly, the file must be exactly
the canonical JSON of the suite it holds, and the entry's other facts (generation digest,
example count, name) are checked against the suite.
"""

from __future__ import annotations

import contextlib
import hashlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln.documents.digests import json_sha256, prefixed
from kiln.documents.jsonio import parse_json, read_json_file
from kiln.errors import ConflictError, ContractError, IntegrityError, NotFoundError, Problem
from kiln.host.fs import create_exclusive, fsync_dir, name_problem

__all__ = ["SuiteRegistry", "generation_sha256", "suite_sha256", "suites_root"]

SUITE = "EvalSuite"
ENTRY = "EvalSuiteEntry"
SUFFIX = ".json"  # the ``suite`` kind of ``kiln.host.fs.name_problem`` counts it
ENTRIES = ".entries"


def suites_root(home: Path) -> Path:
    """Where the registry lives under a Kiln home: ``<home>/eval-suites``."""
    return Path(home) / "eval-suites"


def suite_sha256(suite: dict[str, Any]) -> str:
    """``sha256:`` digest of the suite's canonical JSON (spec/20), its numbers canonical."""
    return json_sha256(contracts.canonical(SUITE, suite))


def generation_sha256(generation: dict[str, Any]) -> str:
    """``sha256:`` digest of the canonical JSON of a suite's pinned generation settings (as the canonical suite
    holds them)."""
    return json_sha256(generation)


def _bytes_sha256(data: bytes) -> str:
    return prefixed(hashlib.sha256(data).hexdigest())


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _not_found(name: str, root: Path) -> NotFoundError:
    return NotFoundError(
        f"no evaluation suite {name!r} is registered in {root}",
        code="eval_suite_not_found",
        hint="GET /v1/eval/suites (or `kiln eval suites list`) lists the registered suites",
    )


def _conflict(name: str) -> ConflictError:
    return ConflictError(
        f"evaluation suite {name!r} is already registered with other content; suites are content-addressed and "
        "immutable",
        code="eval_suite_conflict",
        hint=f"register the changed suite under another name, or remove {name!r} first (DELETE /v1/eval/suites/{name})",
    )


class SuiteRegistry:
    """Evaluation suites by name under ``root`` (``suites_root(settings.home)`` on a server)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def path(self, name: str) -> Path:
        return self.root / f"{name}{SUFFIX}"

    def entry_path(self, name: str) -> Path:
        return self.root / ENTRIES / f"{name}{SUFFIX}"

    # --- register -------------------------------------------------------------------------

    def register(self, suite: dict[str, Any]) -> dict[str, Any]:
        """Register ``suite`` (strict ``EvalSuite``); returns its ``EvalSuiteEntry``.

        Registering identical content again returns the existing entry (a no-op); the same
        name with other content is refused (``eval_suite_conflict``).
        """
        if not isinstance(suite, dict):
            raise ContractError([Problem("wrong_type", "", "an evaluation suite is a JSON object")], document=SUITE)
        problems = contracts.problems(SUITE, suite)
        if problems:
            raise ContractError(problems, document=SUITE)
        suite = contracts.canonical(SUITE, suite)
        name = suite["name"]
        why = name_problem(name, kind="suite")
        if why is not None:
            raise ContractError(
                [Problem("unsafe_path", "/name", f"suite name {name!r} is not path-safe: {why}")], document=SUITE
            )
        data = contracts.render(SUITE, suite)
        digest = suite_sha256(suite)
        if not self._link_new(self.path(name), data):
            try:
                existing = self.path(name).read_bytes()
            except FileNotFoundError:  # removed between the link and the read: try once more
                if not self._link_new(self.path(name), data):
                    raise _conflict(name) from None
            else:
                if existing != data:
                    raise _conflict(name)
        entry = {
            "name": name,
            "suite_sha256": digest,
            "generation_sha256": generation_sha256(suite["generation"]),
            "example_count": len(suite["examples"]),
            "registered_at": _now(),
        }
        if self._link_new(self.entry_path(name), contracts.render(ENTRY, entry)):
            return entry
        existing_entry = self._entry(name)
        if existing_entry["suite_sha256"] != digest:
            raise IntegrityError(
                [
                    Problem(
                        "digest_mismatch",
                        "/suite_sha256",
                        f"the entry of {name!r} records {existing_entry['suite_sha256']} but its suite file holds "
                        f"{digest}",
                    )
                ],
                document=str(self.entry_path(name)),
            )
        return existing_entry

    def _link_new(self, target: Path, data: bytes) -> bool:
        """Write ``data`` to ``target`` crash-atomically unless it exists; False when it does."""
        target.parent.mkdir(parents=True, exist_ok=True)
        return create_exclusive(target, data)

    # --- read -----------------------------------------------------------------------------

    def _entry(self, name: str) -> dict[str, Any]:
        path = self.entry_path(name)
        if name_problem(name, kind="suite") is not None or not path.is_file():
            raise _not_found(name, self.root)
        value = read_json_file(path)
        contracts.load(ENTRY, value, document=str(path))
        if value["name"] != name:
            raise ContractError(
                [Problem("inconsistent_fields", "/name", f"the entry of {name!r} names suite {value['name']!r}")],
                document=str(path),
            )
        return contracts.canonical(ENTRY, value)

    def list(self) -> list[dict[str, Any]]:
        """Every ``EvalSuiteEntry``, sorted by name (each entry loaded strictly)."""
        folder = self.root / ENTRIES
        if not folder.is_dir():
            return []
        names = sorted(
            p.name.removesuffix(SUFFIX)
            for p in folder.iterdir()
            if p.name.endswith(SUFFIX) and not p.name.startswith(".") and p.is_file()
        )
        return [self._entry(name) for name in names]

    def get(self, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(suite, entry)``; the suite file's bytes must hash to the entry's digest (checked first)."""
        entry = self._entry(name)
        path = self.path(name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise _not_found(name, self.root) from None
        found = []
        actual = _bytes_sha256(data)  # the file is canonical JSON, so this is suite_sha256
        if actual != entry["suite_sha256"]:
            found.append(
                Problem(
                    "digest_mismatch",
                    "/suite_sha256",
                    f"the entry of {name!r} records suite_sha256 {entry['suite_sha256']} but its suite file hashes "
                    f"to {actual}",
                )
            )
        else:
            suite = parse_json(data, source=str(path))
            contracts.load(SUITE, suite, document=str(path))
            if contracts.render(SUITE, suite) != data:
                found.append(
                    Problem(
                        "digest_mismatch",
                        "/suite_sha256",
                        f"the suite file of {name!r} is not the canonical JSON of the suite it holds (its numbers "
                        "or its layout differ from what registration writes)",
                    )
                )
            generation = generation_sha256(suite["generation"])
            if suite["name"] != name:
                found.append(Problem("digest_mismatch", "/name", f"the suite file of {name!r} names {suite['name']!r}"))
            if generation != entry["generation_sha256"]:
                found.append(
                    Problem(
                        "digest_mismatch",
                        "/generation_sha256",
                        f"the entry of {name!r} records generation_sha256 {entry['generation_sha256']} but its "
                        f"suite's settings give {generation}",
                    )
                )
            if entry["example_count"] != len(suite["examples"]):
                found.append(
                    Problem(
                        "digest_mismatch",
                        "/example_count",
                        f"the entry of {name!r} records {entry['example_count']} examples but its suite file holds "
                        f"{len(suite['examples'])}",
                    )
                )
        if found:
            raise IntegrityError(
                found,
                document=str(path),
                hint=f"the stored suite or its entry changed after registration; remove {name!r} and register it again",
            )
        return suite, entry

    # --- remove ---------------------------------------------------------------------------

    def remove(self, name: str) -> dict[str, Any]:
        """Remove the suite (``DeleteEvalSuiteResponse``); results that recorded its digest are unchanged."""
        if name_problem(name, kind="suite") is not None:
            raise _not_found(name, self.root)
        entry_path, path = self.entry_path(name), self.path(name)
        if entry_path.is_file():
            digest = self._entry(name)["suite_sha256"]
        elif path.is_file():  # a registration that crashed before its entry: clean it up
            digest = _bytes_sha256(path.read_bytes())
        else:
            raise _not_found(name, self.root)
        for target in (entry_path, path):  # the entry first: it is the commit point
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
                fsync_dir(target.parent)
        return {"deleted": name, "suite_sha256": digest}
