"""The adapter directory, owned here: where an adapter is, how it is read, and every change the registry sees.

Longer than 600 lines: it is the one owner of the directory's layout, reading and changes; split, the facts it keeps
in one place (file names, the LoRA rules, the manifest's bindings, the crash-safe renames) would be spread again.

Names
    An adapter is the directory ``<registry>/<name>`` holding the files named in ``kiln.artifacts.adapter_files``
    (``CONFIG_FILE``, ``WEIGHTS_FILE``, ``RECEIPT_FILE``, ``MANIFEST_FILE``, ``CANARY_FILE``; exported here).
    ``require_adapter_name`` raises the registry's name rule (``kiln.host.fs.name_problem``, kind ``adapter``) as
    ``training_invalid_request``; ``adapter_directory`` finds a registry adapter by name and answers
    ``adapter_not_found`` for a name the rule refuses (a demoted ``<name>.failed``, a checkpoint, a hidden staging
    directory), a symlink or nothing; ``base_adapter_dir`` is where a warm start's base adapter is.

Reading
    ``AdapterDirectory.read`` reads the adapter once into memory and checks, in order: a directory holding a
    receipt but no manifest is refused (Kiln binds every adapter it publishes; a plain PEFT directory has neither
    and nothing to bind); the serving files are regular files; the manifest loads strictly and its bindings match
    the bytes read (``manifest_problems``); the config is a LoRA config (``parse_lora_config``). Every refusal is
    ``AdapterError`` (``adapter_invalid``) naming the adapter. The result, ``AdapterFiles``, carries the bytes, the
    manifest as its generated model and the digests of exactly what was read, so nothing is read twice.

    ``parse_lora_config`` is the one reading of a LoRA config, for ``kiln adapters verify``, ``restore`` and the
    server alike. In order: ``r`` is a positive integer, and ``rank_pattern`` (absent, or an object) maps patterns
    that compile to positive integers; ``lora_alpha`` is a finite number; ``target_modules`` is ``"all-linear"``
    (every module), another string -- a regular expression that must compile, matched against the whole module path
    -- or a non-empty list of module names, each matching a path equal to it or ending in ``.<name>``. A module's
    rank is the value of the first ``rank_pattern`` entry whose pattern matches the end of its path, else ``r``;
    its scale is ``lora_alpha / rank`` (``/ sqrt(rank)`` with ``use_rslora``) -- peft's rules.

    ``manifest_problems`` compares what a manifest binds with digests of the files as a caller read them: the
    serving files under their canonical names, the receipt under the name the manifest gives it, and -- once the
    receipt matched -- the request lineage its ``request_lineage`` links (``kiln.artifacts.lineage``).

Changes
    ``staged_adapter`` is how a directory appears at an adapter's name (publication, restore): built in a hidden
    staging directory and renamed into place complete (``kiln.host.fs.publish_dir``), superseding in that rename an
    earlier attempt's receipt there (``holds_attempt_record_only``: a failed or dry run leaves only that), and with
    ``overwrite`` any adapter. ``demote`` takes an adapter out of service under ``<name>.failed`` (steps in its
    docstring); ``delete_adapter`` removes an adapter and the checkpoints it owns. Each change is crash-safe: cut
    short, it leaves hidden directories, never a listed one that looks like a valid adapter.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import RootModel

from kiln import contracts
from kiln.artifacts.adapter_bodies import write_adapter_canary_status
from kiln.artifacts.adapter_files import (
    CANARY_FILE,
    CONFIG_FILE,
    MANIFEST_FILE,
    RECEIPT_FILE,
    SERVING_FILES,
    WEIGHTS_FILE,
)
from kiln.artifacts.adapter_manifest import load_adapter_manifest
from kiln.artifacts.lineage import binding_problems
from kiln.artifacts.receipt import load_train_receipt
from kiln.checkpoints import parse_checkpoint_name, parse_checkpoint_staging_name
from kiln.documents.digests import prefixed
from kiln.documents.jsonio import MAX_DOCUMENT_BYTES, canonical_json, parse_json, read_json_file
from kiln.errors import AdapterError, ContractError, KilnError, NotFoundError, RequestError
from kiln.host.fs import fsync_dir, name_max_bytes, name_problem, publish_dir, superseded_entries

if TYPE_CHECKING:
    from kiln_contracts.models.kiln_artifacts_v1_schema import AdapterManifest, TrainReceipt

__all__ = [
    "BINDINGS",
    "CANARY_FILE",
    "CONFIG_FILE",
    "MANIFEST_FILE",
    "RECEIPT_FILE",
    "SERVING_FILES",
    "WEIGHTS_FILE",
    "AdapterDirectory",
    "AdapterFiles",
    "Binding",
    "LoraConfig",
    "LoraConfigProblem",
    "adapter_directory",
    "base_adapter_dir",
    "content_revision",
    "delete_adapter",
    "demote",
    "holds_attempt_record_only",
    "is_listed",
    "lora_facts",
    "manifest_problems",
    "parse_lora_config",
    "problem_text",
    "read_canary_status",
    "require_adapter_name",
    "staged_adapter",
]

_ALL_LINEAR = "all-linear"  # peft's shorthand for every linear module
_CHECKPOINT_SUFFIX = ".kiln-checkpoint"
_SUPERSEDED = (RECEIPT_FILE,)  # what an attempt that published no weights leaves at the adapter's name
_INT64_LIMIT = 2**63


# --- names ------------------------------------------------------------------------------------------------------------


def require_adapter_name(name: str) -> str:
    """``name`` when it can name an adapter in the registry, else ``RequestError`` with the reason."""
    why = name_problem(name, kind="adapter")
    if why is not None:
        raise RequestError(
            f"adapter name {name!r} is refused by the registry name rule: {why}",
            code="training_invalid_request",
            hint=f"an adapter name is one plain, non-blank file name of at most {name_max_bytes('adapter')} UTF-8 "
            "bytes that no checkpoint, staging or demotion name can be mistaken for (docs/server.md, Names)",
        )
    return name


def base_adapter_dir(registry: Path, base_adapter: str) -> Path:
    """A warm start's base adapter: a registry name, or an absolute path of a PEFT adapter directory."""
    path = Path(base_adapter)
    return path if path.is_absolute() else registry / base_adapter


def adapter_directory(registry: Path, name: str) -> AdapterDirectory:
    """The registry adapter ``name``; ``adapter_not_found`` for a name the registry rule refuses, a symlink or no
    directory."""
    if name_problem(name, kind="adapter") is None:
        path = Path(registry) / name
        if not path.is_symlink() and path.is_dir():
            return AdapterDirectory(path)
    raise NotFoundError(
        f"no adapter {name!r} in the registry {registry}",
        code="adapter_not_found",
        hint="GET /v1/adapters (kiln adapters list) lists the installed adapters",
    )


def is_listed(entry: os.DirEntry[str]) -> bool:
    """Whether a registry entry is an adapter directory as listing shows them (hidden entries and checkpoints are
    not)."""
    hidden_or_checkpoint = entry.name.startswith(".") or entry.name.endswith(_CHECKPOINT_SUFFIX)
    return not hidden_or_checkpoint and entry.is_dir(follow_symlinks=False)


# --- the LoRA config --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraConfig:
    """A LoRA config as ``parse_lora_config`` read it: what verify checks and the server applies."""

    rank: int
    alpha: float
    target_modules: str | tuple[str, ...]  # "all-linear", a regular expression, or module names
    rank_pattern: tuple[tuple[str, int], ...]  # (pattern, rank), in the config's order
    peft_type: object  # the declared ``peft_type`` ("LORA" when absent)
    enabled: frozenset[str]  # the keys whose value is set (truthy): the features the config turns on

    @property
    def all_linear(self) -> bool:
        """Whether ``target_modules`` is peft's ``all-linear``: every linear module but the output layer."""
        return self.target_modules == _ALL_LINEAR

    def targets(self, module_path: str) -> bool:
        """Whether the config adapts the module at ``module_path`` (peft's matching; ``all-linear``: any)."""
        if self.all_linear:
            return True
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module_path) is not None
        return any(module_path == t or module_path.endswith("." + t) for t in self.target_modules)

    def rank_for(self, module_path: str) -> int:
        """The rank of the module at ``module_path``: its ``rank_pattern`` entry, else ``r``."""
        for pattern, rank in self.rank_pattern:
            if re.fullmatch(rf"(.*\.)?({pattern})", module_path):
                return rank
        return self.rank

    def scale(self, rank: int) -> float:
        """peft's scale of a module of ``rank``: ``lora_alpha / rank``, or ``/ sqrt(rank)`` with ``use_rslora``."""
        return self.alpha / (rank**0.5 if "use_rslora" in self.enabled else rank)


@dataclass(frozen=True)
class LoraConfigProblem:
    """Why a config declares no usable LoRA: the key at fault (``r`` also for ``rank_pattern``) and the reason."""

    key: Literal["r", "lora_alpha", "target_modules"]
    reason: str


def _positive_int(value: object) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _INT64_LIMIT:
        return value
    return None


def _finite_float(value: object) -> float | None:
    """``value`` as a finite float, or None (booleans, huge integers and non-numbers included)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _rank_pattern(value: object) -> tuple[tuple[tuple[str, int], ...], str | None]:
    """peft's per-module rank overrides (none when absent), or why they are not."""
    if value is None or value == {}:
        return (), None
    if not isinstance(value, dict):
        return (), f"rank_pattern is {type(value).__name__}, not an object"
    for pattern, rank in value.items():
        if _positive_int(rank) is None:
            return (), f"rank_pattern[{pattern!r}] is {rank!r}, not a positive integer"
        try:
            re.compile(pattern)
        except re.error as exc:
            return (), f"rank_pattern key {pattern!r} is not a valid regular expression: {exc}"
    return tuple(value.items()), None


def _target_modules(value: object) -> tuple[str | tuple[str, ...] | None, str]:
    """The declared targets, or (None, why not)."""
    if isinstance(value, str) and value:
        if value != _ALL_LINEAR:
            try:
                re.compile(value)
            except re.error as exc:
                return None, f"target_modules {value!r} is not a valid regular expression: {exc}"
        return value, ""
    if isinstance(value, list) and value and all(isinstance(t, str) and t for t in value):
        return tuple(value), ""
    if value is None:
        return None, "target_modules is missing; target_modules must name the adapted modules"
    return None, f"target_modules is {value!r}, not a non-empty list of module names or a regular expression"


def parse_lora_config(config: Mapping[str, Any]) -> LoraConfig | LoraConfigProblem:
    """The LoRA ``config`` (a JSON object) read by the rules of the module docstring, or its first problem."""
    rank = _positive_int(config.get("r"))
    if rank is None:
        why = (
            "is missing; r must be a positive integer"
            if "r" not in config
            else f"is {config['r']!r}, not a positive integer"
        )
        return LoraConfigProblem("r", f"r {why}")
    patterns, pattern_problem = _rank_pattern(config.get("rank_pattern"))
    if pattern_problem is not None:
        return LoraConfigProblem("r", pattern_problem)
    alpha = _finite_float(config.get("lora_alpha"))
    if alpha is None:
        why = (
            "is missing; lora_alpha must be a finite number"
            if "lora_alpha" not in config
            else f"is {config['lora_alpha']!r}, not a finite number"
        )
        return LoraConfigProblem("lora_alpha", f"lora_alpha {why}")
    targets, why = _target_modules(config.get("target_modules"))
    if targets is None:
        return LoraConfigProblem("target_modules", why)
    return LoraConfig(
        rank=rank,
        alpha=alpha,
        target_modules=targets,
        rank_pattern=patterns,
        peft_type=config.get("peft_type", "LORA"),
        enabled=frozenset(key for key, value in config.items() if value),
    )


def lora_facts(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a config declares, as ``AdapterVerifyLora`` reports it: each fact null unless declared validly."""
    rank, alpha = _positive_int(config.get("r")), _finite_float(config.get("lora_alpha"))
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets] if targets else []
    elif isinstance(targets, list):
        targets = sorted({t for t in targets if isinstance(t, str) and t})
    else:
        targets = []
    base = config.get("base_model_name_or_path")
    return {
        "rank": rank,
        "alpha": alpha,
        "alpha_over_rank": alpha / rank if rank is not None and alpha is not None else None,
        "target_modules": targets,
        "base_model_name_or_path": base if isinstance(base, str) and base else None,
        "tensor_count": None,
    }


# --- the manifest's bindings ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Binding:
    """One file a manifest binds: its ``files`` role, the name it has in an adapter directory, its digest field."""

    role: Literal["adapter_config", "adapter_model", "train_receipt"]
    file_name: str
    field: Literal["config_hash", "safetensors_hash", "receipt_hash"]

    def bound(self, manifest: AdapterManifest) -> tuple[str | None, str | None]:
        """The file name and digest ``manifest`` (an ``AdapterManifest``) records for this role (None, None: it
        binds no such file)."""
        return _plain(getattr(manifest.files, self.role)), _plain(getattr(manifest, self.field))


def _plain(value: object) -> Any:
    """A field of a generated model as its JSON value (a ``RootModel`` unwrapped)."""
    return value.root if isinstance(value, RootModel) else value


BINDINGS = (
    Binding("adapter_config", CONFIG_FILE, "config_hash"),
    Binding("adapter_model", WEIGHTS_FILE, "safetensors_hash"),
    Binding("train_receipt", RECEIPT_FILE, "receipt_hash"),
)


def problem_text(exc: KilnError, *, count: bool = True) -> str:
    """A Kiln error in one line: its first problem (and, with ``count``, how many more), else its message."""
    if isinstance(exc, ContractError):
        more = len(exc.problems) - 1
        return str(exc.problems[0]) + (f" (and {more} more)" if count and more else "")
    return exc.message


def manifest_problems(
    manifest: AdapterManifest,
    directory: Path,
    digest_of: Callable[[str], str | None],
    receipt_of: Callable[[str], object],
) -> tuple[list[str], list[str]]:
    """What differs between ``manifest`` (an ``AdapterManifest``) and the files beside it in ``directory``, and the
    digest fields that match (``request_lineage`` too once the receipt's link matched).

    ``digest_of(file name)`` is the ``sha256:<hex>`` of the file as the caller read it, None when it is missing;
    ``receipt_of(file name)`` is the bound receipt's JSON value (raising ``KilnError`` when it is unreadable).
    """
    problems: list[str] = []
    matched: list[str] = []
    for binding in BINDINGS:
        named, recorded = binding.bound(manifest)
        if named is None:
            continue
        if binding.role != "train_receipt" and named != binding.file_name:
            problems.append(
                f"files.{binding.role} is {named!r}, not {binding.file_name!r}: the manifest does not bind it"
            )
            continue
        actual = digest_of(named)
        if actual is None:
            problems.append(f"{binding.field}: {named} is missing")
        elif actual != recorded:
            problems.append(f"{binding.field} is {recorded} but {named} hashes to {actual}")
        else:
            matched.append(binding.field)
    if "receipt_hash" in matched:  # the bound receipt's request_lineage binds replay.jsonl and lineage.json
        receipt_name = _plain(manifest.files.train_receipt)
        try:
            receipt = receipt_of(receipt_name)
        except KilnError as exc:
            receipt = None
            problems.append(f"{receipt_name} is unreadable: {problem_text(exc)}")
        lineage = binding_problems(directory, receipt)
        problems.extend(lineage)
        if isinstance(receipt, dict) and receipt.get("request_lineage") is not None and not lineage:
            matched.append("request_lineage")
    return problems, matched


def _sha256(data: bytes) -> str:
    return prefixed(hashlib.sha256(data).hexdigest())


def content_revision(config_bytes: bytes, weights_bytes: bytes) -> str:
    """The revision of an adapter's serving files, a raw SHA-256: of the canonical JSON
    ``{"adapter_config_sha256": <hex of the config bytes>, "adapter_model_sha256": <hex of the weights bytes>}``.
    It changes whenever either file does and depends on nothing else."""
    return _revision(hashlib.sha256(config_bytes).hexdigest(), hashlib.sha256(weights_bytes).hexdigest())


def _revision(config_hex: str, weights_hex: str) -> str:
    record = {"adapter_config_sha256": config_hex, "adapter_model_sha256": weights_hex}
    return hashlib.sha256(canonical_json(record)).hexdigest()


# --- reading ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter read once: the serving files' bytes and what was checked on exactly those bytes."""

    name: str
    path: Path
    config: LoraConfig
    config_bytes: bytes
    weights_bytes: bytes
    manifest: AdapterManifest | None  # None for a plain PEFT directory
    manifest_sha256: str | None  # sha256:<hex> of the manifest as read; None for a plain PEFT directory
    weights_sha256: str  # sha256:<hex> of the weights as read
    content_revision: str  # ``content_revision`` of the serving files as read


@dataclass(frozen=True)
class AdapterDirectory:
    """One adapter's directory and its files by role (nothing is read until asked)."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS_FILE

    @property
    def receipt_path(self) -> Path:
        return self.path / RECEIPT_FILE

    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST_FILE

    @property
    def canary_path(self) -> Path:
        return self.path / CANARY_FILE

    def _invalid(self, why: str, hint: str | None = None) -> AdapterError:
        return AdapterError(f"adapter {self.name!r}: {why}", hint=hint)

    def read(self) -> AdapterFiles:
        """Read and check the adapter (module docstring, Reading); ``adapter_invalid`` names what is wrong."""
        manifest_bytes = self._manifest_bytes()
        config_bytes = self._read(CONFIG_FILE, MAX_DOCUMENT_BYTES)
        weights_bytes = self._read(WEIGHTS_FILE, None)
        manifest = None
        if manifest_bytes is not None:
            manifest = self._bound_manifest(manifest_bytes, {CONFIG_FILE: config_bytes, WEIGHTS_FILE: weights_bytes})
        try:
            value = parse_json(config_bytes, source=CONFIG_FILE)
        except KilnError as exc:
            raise self._invalid(f"{CONFIG_FILE} does not parse: {exc.message}") from None
        if not isinstance(value, dict):
            raise self._invalid(f"{CONFIG_FILE} is not a JSON object")
        config = parse_lora_config(value)
        if isinstance(config, LoraConfigProblem):
            raise self._invalid(f"{CONFIG_FILE} {config.reason}")
        weights_hex = hashlib.sha256(weights_bytes).hexdigest()
        return AdapterFiles(
            name=self.name,
            path=self.path,
            config=config,
            config_bytes=config_bytes,
            weights_bytes=weights_bytes,
            manifest=manifest,
            manifest_sha256=None if manifest_bytes is None else _sha256(manifest_bytes),
            weights_sha256=prefixed(weights_hex),
            content_revision=_revision(hashlib.sha256(config_bytes).hexdigest(), weights_hex),
        )

    def manifest_sha256(self) -> str:
        """The digest of the manifest file as it is now; ``adapter_not_found`` when there is none."""
        if self.manifest_path.is_symlink() or not self.manifest_path.is_file():
            raise NotFoundError(
                f"no adapter {self.name!r} with a manifest in {self.path.parent}", code="adapter_not_found"
            )
        return _sha256(self.manifest_path.read_bytes())

    def read_receipt(self) -> TrainReceipt:
        """The train receipt as its generated model (strict); ``not_found`` when there is none."""
        if not self.receipt_path.is_file():
            raise NotFoundError(f"adapter {self.name!r} has no {RECEIPT_FILE} (not trained by Kiln?)", code="not_found")
        return load_train_receipt(self.receipt_path)

    def canary_status(self) -> dict[str, Any] | None:
        """The serving canary's result (``read_canary_status``), None when it never ran."""
        return read_canary_status(self.canary_path) if os.path.lexists(self.canary_path) else None

    def write_canary_status(self, status: dict[str, Any]) -> Path:
        """Write the canary's ``AdapterCanaryStatus`` beside the adapter (validated, crash-atomic)."""
        return write_adapter_canary_status(self.canary_path, status)

    def _read(self, file_name: str, limit: int | None) -> bytes:
        path = self.path / file_name
        if path.is_symlink() or not path.is_file():
            raise self._invalid(f"{file_name} is missing (or not a regular file) in {self.path}")
        try:
            with open(path, "rb") as fh:
                data = fh.read() if limit is None else fh.read(limit + 1)
        except OSError as exc:
            raise self._invalid(f"cannot read {file_name}: {exc.strerror or exc}") from None
        if limit is not None and len(data) > limit:
            raise self._invalid(f"{file_name} is larger than {limit} bytes")
        return data

    def _manifest_bytes(self) -> bytes | None:
        """The manifest as read; None for a plain PEFT directory (neither a manifest nor a Kiln receipt)."""
        if os.path.lexists(self.manifest_path):
            return self._read(MANIFEST_FILE, MAX_DOCUMENT_BYTES)
        if os.path.lexists(self.receipt_path):
            raise self._invalid(
                f"{MANIFEST_FILE} is missing, but {RECEIPT_FILE} is here: Kiln binds every adapter it publishes with "
                "a manifest, so this one is unfinished or was altered",
                hint="retrain it, or restore it from a copy that has its manifest (kiln adapters restore)",
            )
        return None

    def _bound_manifest(self, manifest_bytes: bytes, read: dict[str, bytes]) -> AdapterManifest:
        """The manifest, loaded strictly, after its bindings matched the bytes ``read`` (and the receipt's)."""
        try:
            manifest = load_adapter_manifest(manifest_bytes)  # schema, semantic rules, embedded records
        except KilnError as exc:
            raise self._invalid(f"{MANIFEST_FILE} is invalid: {exc.message}") from None

        def digest_of(file_name: str) -> str | None:
            if file_name not in read:
                path = self.path / file_name
                if path.is_symlink() or not path.is_file():
                    return None
                read[file_name] = self._read(file_name, MAX_DOCUMENT_BYTES)
            return _sha256(read[file_name])

        def receipt_of(file_name: str) -> object:
            return parse_json(read[file_name], source=file_name)

        problems, _ = manifest_problems(manifest, self.path, digest_of, receipt_of)
        if problems:
            raise self._invalid(
                f"{MANIFEST_FILE} {problems[0]}",
                hint="the files changed after publication; restore the adapter or retrain it",
            )
        return manifest


def read_canary_status(path: Path) -> dict[str, Any]:
    """The canary result, or a quarantine when the file cannot be trusted (it never promotes)."""
    try:
        value = read_json_file(path)
        found = contracts.problems("AdapterCanaryStatus", value)
        why = str(found[0]) if found else None
    except KilnError as exc:
        value, why = None, problem_text(exc, count=False)
    if why is None:
        return value
    return {
        "status": "quarantined",
        "failure_reason": f"{CANARY_FILE} is invalid ({why}); an unreadable canary never promotes",
        "warnings": [],
        "checks": [],
    }


# --- changes ----------------------------------------------------------------------------------------------------------


def holds_attempt_record_only(target: Path) -> bool:
    """Whether ``target`` is a directory holding nothing but an earlier attempt's receipt (a failed or dry run's),
    or nothing: what a publication at that name supersedes."""
    return superseded_entries(target, _SUPERSEDED) is not None


@contextlib.contextmanager
def staged_adapter(
    registry: Path, name: str, *, purpose: str = "incomplete", overwrite: bool = False
) -> Iterator[Path]:
    """A hidden staging directory of ``registry`` for the block to fill, renamed to ``<registry>/<name>`` complete when
    it returns (``kiln.host.fs.publish_dir``: fsync, one rename, fsync the registry). An earlier attempt's receipt at
    the name is superseded by that rename; any other entry there is refused unless ``overwrite``, which replaces
    it. A failure before the rename leaves nothing behind and the name as it was."""
    with publish_dir(registry / name, purpose=purpose, overwrite=overwrite, supersede=_SUPERSEDED) as staging:
        yield staging


def _claim_demoted_name(registry: Path, name: str) -> Path:
    """``<name>.failed``, else ``<name>.failed-<n>`` for the first free n from 2, created empty: ``mkdir`` is
    exclusive, so no two demotions ever hold one name."""
    n = 1
    while True:
        claimed = registry / (f"{name}.failed" if n == 1 else f"{name}.failed-{n}")
        try:
            os.mkdir(claimed)
        except FileExistsError:
            n += 1
        else:
            return claimed


def demote(registry: Path, name: str) -> Path:
    """Take the adapter ``name`` out of service under ``<name>.failed`` (``.failed-<n>`` when taken); return its new
    directory. A name the registry rule refuses, or nothing to demote, is ``adapter_not_found``.

    1. rename ``<registry>/<name>`` to a hidden ``.<name>.demoting-XXXXXXXX``: from here no listing, load or second
       demotion finds it under its name;
    2. fsync the registry;
    3. claim the demoted name by creating it empty (``mkdir`` is exclusive);
    4. rename the hidden directory over the claimed one (rename(2) replaces an empty directory in one step);
    5. fsync the registry.

    Cut short after step 1 the adapter's files are in the hidden directory (after step 3 beside an empty claimed
    one, which listing shows as invalid): no listed directory looks like a valid adapter until step 4 put the files
    under the demoted name, which the registry rule keeps from ever being served.
    """
    source = adapter_directory(registry, name).path
    hidden = Path(registry) / f".{name}.demoting-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(source, hidden)
    except FileNotFoundError:  # another demotion or a deletion took it first
        raise NotFoundError(f"no adapter {name!r} in the registry {registry}", code="adapter_not_found") from None
    fsync_dir(registry)
    demoted = _claim_demoted_name(Path(registry), name)
    os.rename(hidden, demoted)
    fsync_dir(registry)
    return demoted


def _owned_by(entry_name: str, name: str) -> bool:
    """Whether a registry entry is one of ``name``'s checkpoints or a hidden leftover made from one's name."""
    parsed = parse_checkpoint_staging_name(entry_name) if entry_name.startswith(".") else None
    owner = parsed[0] if parsed else (parse_checkpoint_name(entry_name) or (None,))[0]
    return owner == name


def _doomed(registry: Path, name: str, *, owns_checkpoints: bool) -> list[Path]:
    """The adapter directory (when listing shows it), its checkpoints and their hidden leftovers."""
    found = []
    for entry in os.scandir(registry):
        if entry.name == name:
            if is_listed(entry):
                found.append(Path(entry.path))
        elif owns_checkpoints and _owned_by(entry.name, name) and entry.is_dir(follow_symlinks=False):
            found.append(Path(entry.path))
    return sorted(found)


def delete_adapter(registry: str | os.PathLike[str], name: str, *, dry_run: bool = False) -> list[Path]:
    """Remove ``name`` and exactly the checkpoints it owns; return what was (or would be) removed.

    A name the registry rule refuses is ``training_invalid_request`` unless listing shows a directory of that
    name (which is then removed alone); a name with nothing to remove is ``adapter_not_found``. Each directory is
    first renamed to a hidden ``.<entry>.deleting-XXXXXXXX`` (and the registry synced), then removed.
    """
    root = Path(registry)
    if name_problem(name, kind="file") is not None:  # not even one plain directory entry: never near the disk
        require_adapter_name(name)
    target = root / name
    if target.is_symlink():
        raise RequestError(
            f"{target} is a symlink, not an adapter directory; remove it by hand", code="training_invalid_request"
        )
    valid = name_problem(name, kind="adapter") is None
    doomed = _doomed(root, name, owns_checkpoints=valid) if root.is_dir() else []
    if not valid and not doomed:
        require_adapter_name(name)  # the rule, named
    if not doomed:
        raise NotFoundError(f"no adapter {name!r} (and no checkpoints of it) in {root}", code="adapter_not_found")
    if dry_run:
        return doomed
    for path in doomed:
        hidden = root / f".{path.name}.deleting-{uuid.uuid4().hex[:8]}"
        os.rename(path, hidden)
        fsync_dir(root)
        shutil.rmtree(hidden)
    return doomed
