"""``kiln adapters restore``: bring an adapter back into a registry from its manifest.

``restore_adapter(manifest_path, registry, *, name=None, overwrite=False)`` follows spec/50:

1. read the manifest once (its bytes are what is validated and what is copied) and load it
   strictly as ``AdapterManifest``; the embedded records are checked by their own rules;
2. choose the target ``<registry>/<name or adapter_name>``; the name must be an adapter
   name (``require_adapter_name``, the rule ``kiln.adapters.publish.check_target`` applies; an unsafe
   name raises ``RequestError`` ``training_invalid_request``). Any existing entry under that
   name is refused with ``ConflictError`` ``adapter_exists`` unless ``overwrite``;
3. copy the files the manifest names (plain file names beside the manifest) into a hidden
   directory ``<registry>/.<name>.restore-*`` under the canonical names, hashing each byte
   as it is copied (one streamed pass); the manifest is copied too, and the request lineage
   (``replay.jsonl``, ``lineage.json``) when the receipt links one (``request_lineage``);
4. compare every digest with the manifest: ``<label> mismatch for <source file>: expected
   <digest>, got <digest>`` (``AdapterError`` ``adapter_invalid``);
5. validate the layout (both serving files, a LoRA config by the one parser's rules --
   ``kiln.adapters.parse_lora_config``, as verify and the server read it --, a readable
   safetensors header, the receipt as a successful ``TrainReceipt`` of this adapter), then
   fsync every file, rename into place and fsync the registry (``staged_adapter``).

Every failure raises before the rename and removes the hidden directory, so nothing is left
behind and an existing target is untouched.

``overwrite`` is destructive: the adapter already registered under the target name is
deleted, even if a server has it loaded or active (restore is local and never asks a
server), and it cannot be recovered. To keep the window small the old target is removed
only after every copy has been verified: it is renamed to a hidden
``.<name>.replaced-*`` directory, the new adapter is renamed into place, then the old one
is deleted (``staged_adapter(..., overwrite=True)``). A crash in between leaves the old
adapter in that hidden directory, never a half-written target.

When the manifest names its files by other names than the canonical ones, the restored
manifest is rewritten (canonical JSON, same digests) so that its ``files`` name the
restored files; otherwise the manifest bytes are copied unchanged. Its ``adapter_name``
stays the name the adapter was trained as, also under ``name``.

Restore never contacts a server, never imports torch, and does not prove the destination
has the recorded base weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln.adapters._directory import (
    BINDINGS,
    CONFIG_FILE,
    MANIFEST_FILE,
    RECEIPT_FILE,
    WEIGHTS_FILE,
    LoraConfigProblem,
    parse_lora_config,
    require_adapter_name,
    staged_adapter,
)
from kiln.artifacts.lineage import LINEAGE_FILE
from kiln.artifacts.replay_log import REPLAY_LOG
from kiln.documents.digests import prefixed
from kiln.documents.jsonio import MAX_DOCUMENT_BYTES, parse_json, read_json_file
from kiln.errors import AdapterError, ConflictError, ContractError, InternalError, KilnError
from kiln.host.fs import name_problem

__all__ = ["restore_adapter"]

_CHUNK = 8 * 1024 * 1024


def restore_adapter(
    manifest_path: str | os.PathLike[str],
    registry: str | os.PathLike[str],
    *,
    name: str | None = None,
    overwrite: bool = False,
    public_key: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Restore the adapter described by ``manifest_path`` into ``registry``; return the receipt.

    A signed adapter's ``model.sig`` is carried across and must match the restored files (a signature that would
    not verify on the copy is refused, naming the file); with ``public_key`` it is verified cryptographically too.

    The receipt is the ``AdapterRestoreReceipt`` dict ``{status, manifest_path,
    source_adapter_dir, restored_adapter_dir, adapter_name, copied_files, verified_hashes}``
    with absolute paths. Raises ``AdapterError`` (``adapter_invalid``) for a bad manifest,
    a missing or mismatching file or a bad layout; ``RequestError``
    (``training_invalid_request``) for a target name that is not path-safe; ``ConflictError``
    (``adapter_exists``) for an existing target without ``overwrite``.
    """
    manifest_file = Path(os.path.abspath(manifest_path))
    source_dir = manifest_file.parent
    raw, manifest = _read_manifest(manifest_file)

    target_name = require_adapter_name(manifest["adapter_name"] if name is None else name)
    registry_dir = Path(os.path.abspath(registry))
    target = registry_dir / target_name
    if not overwrite:
        _refuse_existing(target)

    sources = _sources(manifest, source_dir)
    copied: list[str] = []
    verified: dict[str, str] = {}
    receipt = {
        "status": "ok",
        "manifest_path": str(manifest_file),
        "source_adapter_dir": str(source_dir),
        "restored_adapter_dir": str(target),
        "adapter_name": target_name,
        "copied_files": copied,
        "verified_hashes": verified,
    }

    registry_dir.mkdir(parents=True, exist_ok=True)
    with staged_adapter(registry_dir, target_name, purpose="restore", overwrite=overwrite) as staging:
        for binding in BINDINGS:  # the manifest digest field is also the verified_hashes key, as the reference has it
            if binding.role not in sources:
                continue
            source = sources[binding.role]
            got = prefixed(_copy_hashing(source, staging / binding.file_name))
            expected = manifest[binding.field]
            if got != expected:
                raise AdapterError(f"{binding.field} mismatch for {source}: expected {expected}, got {got}")
            copied.append(binding.file_name)
            verified[binding.field] = got
        copied.extend(_copy_lineage(source_dir, staging))
        _write_manifest_copy(staging / MANIFEST_FILE, raw, manifest)
        copied.append(MANIFEST_FILE)
        _check_layout(staging, manifest, sources)
        copied.extend(_copy_signature(source_dir, staging, public_key))
        problems = contracts.problems("AdapterRestoreReceipt", receipt)
        if problems:  # a bug, not a bad input: say so before touching the registry
            raise InternalError(f"the restore receipt is invalid: {'; '.join(map(str, problems))}")
        if not overwrite:  # appeared while copying
            _refuse_existing(target)
    return receipt


# --- steps -------------------------------------------------------------------------------


def _read_manifest(path: Path) -> tuple[bytes, dict[str, Any]]:
    """The manifest's bytes and its parsed value, after the strict ``AdapterManifest`` load."""
    try:
        with path.open("rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                raise AdapterError(f"manifest {path} is not a regular file")
            raw = fh.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise AdapterError(f"cannot read manifest {path}: {exc.strerror or exc}") from None
    try:
        contracts.load("AdapterManifest", raw, document=str(path))
        manifest = parse_json(raw, source=str(path))
    except ContractError as exc:
        details = "; ".join(str(p) for p in exc.problems)
        raise AdapterError(
            f"manifest {path} is not a valid adapter manifest: {details}",
            pointer=exc.pointer,
            hint=f"restore only from an {MANIFEST_FILE} written by Kiln for a successful run",
        ) from exc
    return raw, manifest


def _copy_lineage(source_dir: Path, staging: Path) -> list[str]:
    """The request lineage the (copied, verified) receipt links (``replay.jsonl``, ``lineage.json``), copied and
    hash-checked."""
    try:
        receipt = read_json_file(staging / RECEIPT_FILE) if (staging / RECEIPT_FILE).is_file() else None
    except KilnError:  # not a receipt at all: the layout check refuses it, naming why
        return []
    link = receipt.get("request_lineage") if isinstance(receipt, dict) else None
    if not isinstance(link, dict):
        return []
    copied = []
    for file_name, field in ((REPLAY_LOG, "replay_log_sha256"), (LINEAGE_FILE, "lineage_sha256")):
        got = prefixed(_copy_hashing(source_dir / file_name, staging / file_name))
        if got != link[field]:
            raise AdapterError(f"request_lineage.{field} mismatch for {source_dir / file_name}: "
                               f"expected {link[field]}, got {got}")  # fmt: skip
        copied.append(file_name)
    return copied


def _copy_signature(source_dir: Path, staging: Path, public_key: str | os.PathLike[str] | None) -> list[str]:
    """``model.sig`` copied when the source is signed, and checked on the copy: it lists exactly the restored files
    with their digests (and verifies with ``public_key`` when one is given)."""
    from kiln.adapters.signing import SIGNATURE_FILE, verify_signature

    source = source_dir / SIGNATURE_FILE
    if not source.is_file():
        if public_key is not None:
            raise AdapterError(f"{source_dir} is not signed (no {SIGNATURE_FILE}), but a public key was given")
        return []
    _copy_hashing(source, staging / SIGNATURE_FILE)
    try:
        verify_signature(staging, public_key=public_key)
    except AdapterError as exc:
        raise AdapterError(
            f"the signature of {source_dir} cannot come along: {exc.message.replace(str(staging), 'the copy')}",
            hint="re-sign the restored adapter (kiln adapters sign), or restore from a directory whose signature "
            "covers exactly its manifest's files",
        ) from None
    return [SIGNATURE_FILE]


def _refuse_existing(target: Path) -> None:
    if target.is_symlink() or target.exists():
        raise ConflictError(
            f"{target} already exists",
            code="adapter_exists",
            hint="choose another --name, or pass --overwrite to delete the existing adapter and replace it",
        )


def _sources(manifest: dict[str, Any], source_dir: Path) -> dict[str, Path]:
    """The source file of each role the manifest names; each must be a plain name beside it."""
    out: dict[str, Path] = {}
    for binding in BINDINGS:
        file_name = manifest["files"][binding.role]
        if file_name is None:
            continue
        why = name_problem(file_name, kind="file")  # the manifest's own rule already ran: this guards the copy
        if why is not None:
            raise AdapterError(
                f"files.{binding.role} {file_name!r} is not a plain file name beside the manifest: {why}"
            )
        out[binding.role] = source_dir / file_name
    return out


def _copy_hashing(source: Path, dest: Path) -> str:
    """Copy ``source`` to the new file ``dest`` in one streamed pass; return its raw digest (synced on publication)."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    try:
        src = open(source, "rb", buffering=0)  # noqa: SIM115 - closed below, with dst
    except OSError as exc:
        raise AdapterError(f"cannot read {source}: {exc.strerror or exc}") from None
    with src, open(dest, "xb", buffering=0) as dst:
        if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
            raise AdapterError(f"{source} is not a regular file")
        while n := src.readinto(view):
            chunk = view[:n]
            h.update(chunk)
            written = 0
            while written < n:
                written += dst.write(chunk[written:])
    return h.hexdigest()


def _write_manifest_copy(dest: Path, raw: bytes, manifest: dict[str, Any]) -> None:
    canonical_files: dict[str, str | None] = {binding.role: binding.file_name for binding in BINDINGS}
    if manifest["files"]["train_receipt"] is None:
        canonical_files["train_receipt"] = None
    if manifest["files"] == canonical_files:
        data = raw
    else:  # name the restored files; the digests stay the same
        data = contracts.render("AdapterManifest", {**manifest, "files": canonical_files})
    with open(dest, "xb") as fh:
        fh.write(data)


def _check_layout(staging: Path, manifest: dict[str, Any], sources: dict[str, Path]) -> None:
    for file_name in (CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE):
        if not (staging / file_name).is_file():
            raise AdapterError(f"the restored adapter lacks {file_name}")
    _check_config(staging / CONFIG_FILE, sources["adapter_config"])
    _check_safetensors_header(staging / WEIGHTS_FILE, sources["adapter_model"])
    if "train_receipt" in sources:
        _check_receipt(staging / RECEIPT_FILE, sources["train_receipt"], manifest)


def _check_config(path: Path, source: Path) -> None:
    try:
        config = parse_json(path.read_bytes(), source=str(source))
    except ContractError as exc:
        raise AdapterError(f"adapter config {source} is not valid JSON: {exc.message}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter config {source} is not a JSON object")
    parsed = parse_lora_config(config)
    if isinstance(parsed, LoraConfigProblem):
        raise AdapterError(f"adapter config {source}: {parsed.reason}")


def _check_safetensors_header(path: Path, source: Path) -> None:
    """The 8-byte little-endian header length and a JSON object header (the tensors are not read)."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        length = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        if length is None or length > min(size - 8, 100 * 1024 * 1024):
            raise AdapterError(f"adapter weights {source} are not a safetensors file (bad header length)")
        try:
            header = json.loads(fh.read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            raise AdapterError(f"adapter weights {source} have an unreadable safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise AdapterError(f"adapter weights {source} have a safetensors header that is not a JSON object")


def _check_receipt(path: Path, source: Path, manifest: dict[str, Any]) -> None:
    try:
        contracts.load("TrainReceipt", path, document=str(source))  # the lenient reader contract
        receipt = read_json_file(path)
    except ContractError as exc:
        details = "; ".join(str(p) for p in exc.problems)
        raise AdapterError(f"train receipt {source} is not a valid train receipt: {details}") from exc
    if receipt["status"] != "success":
        raise AdapterError(f"train receipt {source} records status {receipt['status']!r}, not 'success'")
    if receipt["adapter_name"] != manifest["adapter_name"]:
        raise AdapterError(
            f"train receipt {source} is for adapter {receipt['adapter_name']!r}, "
            f"but the manifest is for {manifest['adapter_name']!r}"
        )
    recorded = receipt["adapters"]["output"]["adapter_model_sha256"]
    if recorded is not None and recorded != manifest["safetensors_hash"]:
        raise AdapterError(
            f"train receipt {source} records adapter weights {recorded}, "
            f"but the manifest binds {manifest['safetensors_hash']}"
        )
