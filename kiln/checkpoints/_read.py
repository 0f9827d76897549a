"""The strict checkpoint loader: ``inspect`` (bounded metadata) and ``load`` (every byte).

Both refuse, before any state reaches a trainer, each case of the spec's list with its
own ``reason``. ``inspect`` checks the directory, the manifest document and the file set
with sizes, and never reads a tensor file, so its cost does not grow with checkpoint
size. ``load`` adds the bytes: it reads each file once through a descriptor opened
without following links, checks its size and SHA-256 against the manifest, validates
the loop-state file against its schema and the manifest, and hands the verified bytes
to the caller (what was checked is exactly what is used).
"""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from kiln.artifacts.adapter_files import SERVING_FILES
from kiln.artifacts.checkpoint_manifest import DOC, INCOMPLETE_SENTINEL, MANIFEST_FILE
from kiln.artifacts.loop_state import LOOP_STATE_TYPES
from kiln.checkpoints._names import checkpoint_name, parse_checkpoint_name
from kiln.documents import pipeline
from kiln.documents.jsonio import MAX_DOCUMENT_BYTES, parse_json
from kiln.errors import CheckpointError, ContractError, Problem

MAX_FILES = 64
MAX_ENTRIES = 256  # directory entries walked before giving up (bounds inspect on a hostile tree)
SUMMARY = "TrainingCheckpointSummary"
_CHUNK = 1 << 20

__all__ = ["CheckpointInfo", "LoadedCheckpoint", "inspect_checkpoint", "load_checkpoint", "summarize"]


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint that passed the metadata-only read."""

    path: Path
    manifest: dict[str, Any]
    summary: dict[str, Any]

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint that passed the full load, with the verified bytes of every file."""

    info: CheckpointInfo
    blobs: dict[str, bytes] = field(repr=False)
    loop_state: dict[str, Any] = field(repr=False)

    @property
    def manifest(self) -> dict[str, Any]:
        return self.info.manifest

    @property
    def path(self) -> Path:
        return self.info.path


def _fail(
    reason: str, message: str, *, code: str = "checkpoint_invalid", hint: str | None = None, **kw: Any
) -> NoReturn:
    problems = kw.pop("problems", None) or [Problem(reason, kw.get("pointer") or "", message)]
    raise CheckpointError(message, code=code, reason=reason, hint=hint, problems=problems, **kw)


_NEVER_EDIT = "a checkpoint is immutable: never edit it; resume from another checkpoint or start a fresh run"


def _check_root(path: Path) -> os.stat_result:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        _fail("not_found", f"{path} does not exist", hint="list the checkpoints with `kiln checkpoints list`")
    except OSError as exc:
        _fail("unreadable", f"cannot read {path}: {exc.strerror or exc}")
    if stat.S_ISLNK(st.st_mode):
        _fail("symlinked_root", f"{path} is a symlink; a checkpoint must be a real directory in the adapter registry")
    if not stat.S_ISDIR(st.st_mode):
        _fail("not_a_directory", f"{path} is not a directory")
    if parse_checkpoint_name(path.name) is None:
        if all((path / f).exists() for f in SERVING_FILES):
            _fail(
                "non_canonical_name",
                f"{path} is a PEFT adapter directory, not an exact-resume checkpoint: it is not resumable "
                "(it has weights but no optimizer state, data cursor or random streams)",
                code="checkpoint_not_resumable",
                hint="use `base_adapter` for a weights-only warm start from an adapter",
            )
        _fail(
            "non_canonical_name",
            f"{path.name!r} is not a checkpoint directory name (<adapter>-checkpoint-step-<8 digits>.kiln-checkpoint)",
            hint="a checkpoint directory is never renamed",
        )
    return st


def _read_manifest_bytes(path: Path) -> bytes:
    target = path / MANIFEST_FILE
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        peft = all((path / f).exists() for f in SERVING_FILES)
        _fail(
            "missing_manifest",
            f"{path} has no {MANIFEST_FILE}: "
            + (
                "it is a PEFT adapter snapshot, which is not resumable (it has weights but no optimizer state, "
                "data cursor or random streams)"
                if peft
                else "it is not an exact-resume checkpoint (a PEFT snapshot is not resumable)"
            ),
            code="checkpoint_not_resumable",
            hint="use `base_adapter` for a weights-only warm start, or resume from a .kiln-checkpoint directory",
        )
    if stat.S_ISLNK(st.st_mode):
        _fail("manifest_symlink", f"{target} is a symlink", pointer="", hint=_NEVER_EDIT)
    if not stat.S_ISREG(st.st_mode):
        _fail("manifest_special_file", f"{target} is not a regular file")
    if st.st_nlink > 1:
        _fail("manifest_hard_link", f"{target} has {st.st_nlink} hard links; a checkpoint file must have one")
    if st.st_size > MAX_DOCUMENT_BYTES:
        _fail("manifest_too_large", f"{target} is {st.st_size} bytes; the limit is {MAX_DOCUMENT_BYTES}")
    data, _ = _read_regular(target, limit=MAX_DOCUMENT_BYTES, what="manifest")
    return data


def _read_regular(target: Path, *, limit: int | None = None, what: str = "file") -> tuple[bytes, str]:
    """Bytes and SHA-256 of a regular, singly-linked file opened without following links."""
    try:
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        _fail("unreadable", f"cannot open {target}: {exc.strerror or exc}")
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            _fail("special_file", f"{target} is not a regular file")
        if st.st_nlink > 1:
            _fail("hard_link", f"{target} has {st.st_nlink} hard links; a checkpoint file must have one")
        if limit is not None and st.st_size > limit:
            _fail("manifest_too_large", f"{target} is {st.st_size} bytes; the limit is {limit}")
        digest = hashlib.sha256()
        parts = []
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            parts.append(chunk)
    return b"".join(parts), digest.hexdigest()


def _parse_manifest(path: Path, data: bytes) -> dict[str, Any]:
    source = str(path / MANIFEST_FILE)
    try:
        value = parse_json(data, source=source)
        found = pipeline.problems_of(DOC, value)
    except ContractError as exc:
        found = exc.problems
        value = None
    if found:
        first = found[0]
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        _fail(
            first.code,
            f"{source}: {first}{more}",
            pointer=first.pointer,
            problems=found,
            hint="checkpoint_manifest.json is written by Kiln and must never be edited; "
            "a manifest that fails validation means the checkpoint cannot be trusted",
        )
    return value


def _check_name(path: Path, manifest: dict[str, Any]) -> None:
    expected = checkpoint_name(manifest["adapter_name"], manifest["progress"]["global_step"])
    if path.name != expected:
        _fail(
            "name_mismatch",
            f"directory {path.name!r} does not match its manifest (adapter {manifest['adapter_name']!r}, "
            f"global_step {manifest['progress']['global_step']}), which names it {expected!r}",
            hint="a checkpoint directory is never renamed",
        )
    if manifest["training_kind"] not in LOOP_STATE_TYPES:
        _fail(
            "training_kind_not_resumable",
            f"{path.name} is a {manifest['training_kind']!r} checkpoint, which Kiln reads but never resumes",
            code="checkpoint_not_resumable",
        )
    expected_loop = f"{manifest['training_kind']}_loop_state.json"
    if manifest["state_files"].get("loss_history") != expected_loop:
        _fail(
            "inconsistent_fields",
            f"state_files.loss_history must be {expected_loop!r} for a {manifest['training_kind']} checkpoint",
            pointer="/state_files/loss_history",
        )


def _walk(path: Path) -> dict[str, os.stat_result]:
    """Every regular file under ``path`` by relative path; refuses links and special files."""
    found: dict[str, os.stat_result] = {}
    dirs: set[str] = set()
    seen = 0
    stack = [("", path)]
    while stack:
        prefix, directory = stack.pop()
        with os.scandir(directory) as entries:
            for entry in entries:
                seen += 1
                if seen > MAX_ENTRIES:
                    _fail(
                        "too_many_files",
                        f"{path} holds more than {MAX_ENTRIES} entries; a checkpoint has at most {MAX_FILES} files",
                    )
                rel = f"{prefix}{entry.name}"
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    _fail("symlink", f"{rel!r} in {path.name} is a symlink; a checkpoint holds only regular files")
                if stat.S_ISDIR(st.st_mode):
                    dirs.add(rel)
                    stack.append((f"{rel}/", Path(entry.path)))
                elif stat.S_ISREG(st.st_mode):
                    if st.st_nlink > 1:
                        _fail(
                            "hard_link",
                            f"{rel!r} in {path.name} has {st.st_nlink} hard links; a checkpoint file must have one",
                        )
                    found[rel] = st
                else:
                    _fail("special_file", f"{rel!r} in {path.name} is not a regular file (device, FIFO or socket)")
    for folder in dirs:
        if not any(name.startswith(f"{folder}/") for name in found):
            _fail("extra_file", f"{path.name} holds an empty directory {folder!r} that the manifest does not list")
    return found


def _check_file_set(path: Path, manifest: dict[str, Any], found: dict[str, os.stat_result]) -> None:
    if INCOMPLETE_SENTINEL in found:
        _fail(
            "sentinel_present",
            f"{path.name} still holds the {INCOMPLETE_SENTINEL} publication sentinel: it was never completely published",
            hint="resume from an older checkpoint; never remove the sentinel by hand",
        )
    found.pop(MANIFEST_FILE, None)
    listed = manifest["files"]
    if len(listed) > MAX_FILES:
        _fail("too_many_files", f"the manifest lists {len(listed)} files; a checkpoint has at most {MAX_FILES}")
    extra = sorted(set(found) - set(listed))
    if extra:
        _fail(
            "extra_file",
            f"{path.name} holds {extra[0]!r}, which its manifest does not list"
            + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""),
            hint=_NEVER_EDIT,
        )
    missing = sorted(set(listed) - set(found))
    if missing:
        _fail(
            "missing_file",
            f"{path.name} is missing {missing[0]!r}, which its manifest lists"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
            pointer=f"/files/{missing[0]}",
        )
    for rel, entry in sorted(listed.items()):
        if found[rel].st_size != entry["size_bytes"]:
            _fail(
                "size_mismatch",
                f"{rel!r} in {path.name} is {found[rel].st_size} bytes but the manifest records {entry['size_bytes']}",
                pointer=f"/files/{rel}/size_bytes",
                hint=_NEVER_EDIT,
            )


def summarize(path: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """The ``TrainingCheckpointSummary`` projection of a validated manifest."""
    progress, data = manifest["progress"], manifest["data"]
    summary: dict[str, Any] = {
        "resume_checkpoint": path.name,
        "checkpoint_id": manifest["checkpoint_id"],
        "training_kind": manifest["training_kind"],
        "data_source_kind": data["source_kind"],
        "global_step": progress["global_step"],
        "total_steps": progress["total_steps"],
        "next_epoch_index": progress["epoch_index"],
        "next_cursor_in_epoch": progress["cursor_in_epoch"],
        "complete": progress["global_step"] == progress["total_steps"],
        "created_at": manifest["created_at"],
        "effective_config": manifest["effective_config"],
        "data_content_sha256": f"sha256:{data['content_sha256']}",
        "data_item_count": data["item_count"],
    }
    aux = manifest["auxiliary_state"]
    if manifest["training_kind"] == "opd":
        for name in ("teacher_id", "teacher_identity_revision", "teacher_content_revision"):
            summary[name] = aux[name]
    return summary


def inspect_checkpoint(path: str | os.PathLike[str]) -> CheckpointInfo:
    """Metadata-only strict read: everything except the bytes of the state files."""
    root = Path(path)
    _check_root(root)
    manifest = _parse_manifest(root, _read_manifest_bytes(root))
    _check_name(root, manifest)
    _check_file_set(root, manifest, _walk(root))
    return CheckpointInfo(root, manifest, summarize(root, manifest))


def check_loop_state(manifest: dict[str, Any], data: bytes, *, source: str) -> dict[str, Any]:
    """The loop-state file as a document of its kind, bound to the manifest's progress."""
    definition = LOOP_STATE_TYPES[manifest["training_kind"]]
    try:
        value = parse_json(data, source=source)
        found = pipeline.problems_of(definition, value)
    except ContractError as exc:
        found, value = exc.problems, None
    if found:
        first = found[0]
        _fail("loop_state_invalid", f"{source}: {first}", problems=found, pointer=first.pointer)
    progress, aux = manifest["progress"], manifest["auxiliary_state"]
    for name in ("global_step", "epoch_index", "cursor_in_epoch"):  # the kinds that keep an epoch cursor
        if name in value and value[name] != progress[name]:
            _fail(
                "loop_state_mismatch",
                f"{source}: {name} is {value[name]} but the manifest's progress.{name} is {progress[name]}",
                pointer=f"/{name}",
            )
    if manifest["training_kind"] == "grpo":  # grpo-loop.manifest-binding: the cursors agree with auxiliary_state
        for name in ("route", "source_byte_offset", "source_lines_consumed", "ema_groups_since_refresh"):
            if value.get(name) != aux.get(name):
                _fail(
                    "loop_state_mismatch",
                    f"{source}: {name} is {value.get(name)!r} but auxiliary_state.{name} is {aux.get(name)!r}",
                    pointer=f"/{name}",
                )
    if manifest["training_kind"] == "opd":  # opd-loop.manifest-binding: candidate cursor, guardrail, teacher
        expected = progress["epoch_index"] * manifest["data"]["item_count"] + progress["cursor_in_epoch"]
        bound = {
            "candidates_consumed": (expected, "progress.epoch_index x data.item_count + progress.cursor_in_epoch"),
            **{
                name: (aux.get(name), f"auxiliary_state.{name}")
                for name in (
                    "collapse_guardrail",
                    "teacher_id",
                    "teacher_identity_revision",
                    "teacher_content_revision",
                )
            },
        }
        for name, (want, where) in bound.items():
            if value.get(name) != want or (name == "candidates_consumed" and aux.get(name) != want):
                _fail(
                    "loop_state_mismatch",
                    f"{source}: {name} is {value.get(name)!r} but {where} is {want!r}",
                    pointer=f"/{name}",
                )
    return value


def load_checkpoint(path: str | os.PathLike[str]) -> LoadedCheckpoint:
    """Full strict load: the metadata read plus the size and SHA-256 of every file."""
    info = inspect_checkpoint(path)
    blobs: dict[str, bytes] = {}
    for rel, entry in sorted(info.manifest["files"].items()):
        data, digest = _read_regular(info.path / rel)
        if len(data) != entry["size_bytes"]:
            _fail(
                "size_mismatch",
                f"{rel!r} in {info.name} is {len(data)} bytes but the manifest records {entry['size_bytes']}",
                pointer=f"/files/{rel}/size_bytes",
            )
        if digest != entry["sha256"]:
            _fail(
                "checksum_mismatch",
                f"{rel!r} in {info.name} has SHA-256 {digest} but the manifest records {entry['sha256']}: "
                "the file changed after publication",
                pointer=f"/files/{rel}/sha256",
                hint=_NEVER_EDIT,
            )
        blobs[rel] = data
    loop_file = info.manifest["state_files"]["loss_history"]
    loop_state = check_loop_state(info.manifest, blobs[loop_file], source=f"{info.name}/{loop_file}")
    return LoadedCheckpoint(info, blobs, loop_state)
