"""The strict checkpoint loader and the crash-safe publication protocol (spec/30).

One SFT run on the tiny model publishes two real checkpoints (steps 2 and 4) once per
module; every test copies one of them into its own registry and tampers with the copy.
Each refusal is asserted by its exact ``code`` and ``reason`` and by a message that names
the offending file or field, through both ``inspect_checkpoint`` (metadata only) and
``load_checkpoint`` (every byte) unless the case is one only the full load can see.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kiln import contracts
from kiln.checkpoints import (
    REASONS,
    inspect_checkpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    orphaned_staging_dirs,
    publish_checkpoint,
    resolve_checkpoint_path,
)
from kiln.errors import SCHEMA_CODES, CheckpointError, KilnError, StorageFailureError

ADAPTER = "bot"
STEP2 = "bot-checkpoint-step-00000002.kiln-checkpoint"
STEP4 = "bot-checkpoint-step-00000004.kiln-checkpoint"
MANIFEST = "checkpoint_manifest.json"
LOOP = "sft_loop_state.json"
ADAPTER_FILE = "adapter.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
DECLARED = {*REASONS, *SCHEMA_CODES, "invalid_json", "digest_mismatch"}

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "How do I reset my password?"},
                  {"role": "assistant", "content": "Open Settings, then Security."}]},
    {"messages": [{"role": "user", "content": "Where is my order?"},
                  {"role": "assistant", "content": "Please share the order number."}]},
    {"messages": [{"role": "user", "content": "Can I change my email?"},
                  {"role": "assistant", "content": "Yes: Settings, Account, Email."}]},
]  # fmt: skip


@dataclass(frozen=True)
class Trained:
    registry: Path
    step2: Path
    step4: Path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir) -> Trained:
    """3 conversations x 2 epochs, adam_w, a checkpoint every 2 steps: steps 2 and 4 (6 is final)."""
    from kiln.trainers.sft import admit_sft, run_sft

    root = tmp_path_factory.mktemp("checkpoint-loader")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS), encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:  # the autouse KILN_HOME isolation is per test, not per module
        mp.setenv("KILN_HOME", str(root / "kiln-home"))
        for name in ("KILN_PATHS_HOME", "KILN_MODEL_PATH", "KILN_MODEL_ADAPTER_DIR"):
            mp.delenv(name, raising=False)
        job = admit_sft(
            adapter_name=ADAPTER,
            registry=root / "adapters",
            config={"epochs": 2, "seed": 7, "checkpoint_interval": 2, "optimizer": {"kind": "adam_w"}},
            dataset_path=data,
            model_path=str(tiny_model_dir),
        )
        result = run_sft(job)
    assert result.status == "success", result.receipt.get("failure_message")
    assert [p.name for p in result.checkpoints] == [STEP2, STEP4]
    return Trained(root / "adapters", *result.checkpoints)


def _copy(source: Path, registry: Path, name: str | None = None) -> Path:
    """A writable copy of a published checkpoint (the publisher makes every file 0o444)."""
    registry.mkdir(parents=True, exist_ok=True)
    target = registry / (name or source.name)
    shutil.copytree(source, target)
    for directory, _, names in os.walk(target):
        os.chmod(directory, 0o755)
        for name_ in names:
            os.chmod(Path(directory, name_), 0o644)
    return target


@pytest.fixture
def checkpoint(trained, tmp_path) -> Path:
    """A fresh, writable copy of the step-4 checkpoint in its own registry."""
    return _copy(trained.step4, tmp_path / "adapters")


@pytest.fixture
def outside(tmp_path) -> Path:
    path = tmp_path / "outside"
    path.mkdir()
    return path


def _manifest(ckpt: Path) -> dict[str, Any]:
    return json.loads((ckpt / MANIFEST).read_text(encoding="utf-8"))


def _rewrite(ckpt: Path, edit) -> None:
    """Edit the manifest and write it back with plain ``json.dumps`` (not Kiln's canonical form)."""
    manifest = _manifest(ckpt)
    edit(manifest)
    (ckpt / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def _record(ckpt: Path, rel: str, data: bytes) -> None:
    """Replace a state file and re-record its size and SHA-256, so only its content is wrong."""
    (ckpt / rel).write_bytes(data)
    entry = {"size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _rewrite(ckpt, lambda m: m["files"][rel].update(entry))


def _refusal(call, path: Path) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        call(path)
    err = info.value
    assert err.reason in DECLARED, err.reason
    assert err.problems, "every refusal lists its problems"
    if err.reason == "loop_state_invalid":  # carries the loop-state file's own problems
        assert err.problems[0].code in err.message
    else:
        assert err.problems[0].code == err.reason
    return err


def _assert_refused(path: Path, *, reason: str, names: tuple[str, ...], code: str = "checkpoint_invalid", pointer=None):
    for call in (inspect_checkpoint, load_checkpoint):
        err = _refusal(call, path)
        assert (err.code, err.reason) == (code, reason), (call.__name__, err.code, err.reason, err.message)
        for fragment in names:
            assert fragment in err.message, (call.__name__, fragment, err.message)
        if pointer is not None:
            assert err.pointer == pointer, (call.__name__, err.pointer)


def _encoded(ckpt: Path) -> tuple[dict[str, Any], dict[str, tuple[str, bytes]]]:
    """What a trainer's ``encode`` returns, rebuilt from a published checkpoint."""
    manifest = _manifest(ckpt)
    listed = manifest.pop("files")
    return manifest, {rel: (entry["role"], (ckpt / rel).read_bytes()) for rel, entry in listed.items()}


def _tree(path: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


# ----------------------------------------------------------------------------- the valid case


def test_a_published_checkpoint_inspects_and_loads_with_verified_bytes(trained, checkpoint):
    for ckpt in (trained.step2, trained.step4):
        for path in [ckpt, *ckpt.iterdir()]:
            if path.is_file():
                assert path.stat().st_mode & 0o222 == 0, f"{path.name} is writable after publication"
    info = inspect_checkpoint(checkpoint)
    manifest = _manifest(checkpoint)
    assert info.manifest == manifest
    assert sorted(manifest["files"]) == [ADAPTER_FILE, OPTIMIZER_FILE, LOOP]
    assert contracts.problems("TrainingCheckpointSummary", info.summary) == []
    summary = info.summary
    assert summary["resume_checkpoint"] == STEP4
    assert summary["checkpoint_id"] == "sft-step-00000004"
    assert (summary["global_step"], summary["total_steps"]) == (4, 6)
    assert (summary["next_epoch_index"], summary["next_cursor_in_epoch"]) == (1, 1)
    assert summary["complete"] is False
    assert summary["data_content_sha256"] == "sha256:" + manifest["data"]["content_sha256"]
    assert summary["data_item_count"] == len(CONVERSATIONS)

    loaded = load_checkpoint(checkpoint)
    assert loaded.info.summary == summary
    assert sorted(loaded.blobs) == sorted(manifest["files"])
    for rel, entry in manifest["files"].items():
        assert hashlib.sha256(loaded.blobs[rel]).hexdigest() == entry["sha256"], rel
        assert len(loaded.blobs[rel]) == entry["size_bytes"], rel
        assert loaded.blobs[rel] == (checkpoint / rel).read_bytes(), rel
    assert loaded.loop_state["global_step"] == 4
    assert loaded.loop_state == json.loads(loaded.blobs[LOOP])


def test_a_manifest_rewritten_with_plain_json_dumps_but_unchanged_still_loads(checkpoint):
    _rewrite(checkpoint, lambda m: None)  # the control for every rewrite below: formatting alone is not refused
    assert load_checkpoint(checkpoint).manifest == inspect_checkpoint(checkpoint).manifest


# ----------------------------------------------------------------------------- refused by inspect and load


def _extra_file(ckpt, outside):
    (ckpt / "notes.txt").write_text("hello")


def _hidden_extra_file(ckpt, outside):
    (ckpt / ".DS_Store").write_bytes(b"")


def _missing_file(ckpt, outside):
    (ckpt / OPTIMIZER_FILE).unlink()


def _symlinked_file(ckpt, outside):
    (ckpt / ADAPTER_FILE).rename(outside / ADAPTER_FILE)
    (ckpt / ADAPTER_FILE).symlink_to(outside / ADAPTER_FILE)


def _symlinked_subdirectory(ckpt, outside):
    (ckpt / "extra").symlink_to(outside, target_is_directory=True)


def _hard_link(ckpt, outside):
    os.link(ckpt / ADAPTER_FILE, outside / "adapter-alias.safetensors")
    assert (ckpt / ADAPTER_FILE).stat().st_nlink == 2


def _manifest_hard_link(ckpt, outside):
    os.link(ckpt / MANIFEST, outside / MANIFEST)


def _manifest_symlink(ckpt, outside):
    (ckpt / MANIFEST).rename(outside / MANIFEST)
    (ckpt / MANIFEST).symlink_to(outside / MANIFEST)


def _manifest_directory(ckpt, outside):
    (ckpt / MANIFEST).unlink()
    (ckpt / MANIFEST).mkdir()


def _manifest_missing(ckpt, outside):
    (ckpt / MANIFEST).unlink()


def _manifest_too_large(ckpt, outside):
    os.truncate(ckpt / MANIFEST, 16 * 1024 * 1024 + 1)  # sparse: the size alone must refuse it


def _manifest_unparsable(ckpt, outside):
    (ckpt / MANIFEST).write_bytes(b'{"schema_version": 1,')


def _manifest_duplicate_key(ckpt, outside):
    text = (ckpt / MANIFEST).read_text(encoding="utf-8")
    (ckpt / MANIFEST).write_text('{"files": {}, ' + text.lstrip()[1:], encoding="utf-8")


def _size_drift(ckpt, outside):
    with open(ckpt / ADAPTER_FILE, "ab") as fh:
        fh.write(b"\0")


def _sentinel(ckpt, outside):
    (ckpt / ".incomplete").write_bytes(b"")


def _fifo(ckpt, outside):
    os.mkfifo(ckpt / "pipe")


def _empty_subdirectory(ckpt, outside):
    (ckpt / "scratch").mkdir()


def _file_in_subdirectory(ckpt, outside):
    (ckpt / "scratch").mkdir()
    (ckpt / "scratch" / "x.bin").write_bytes(b"x")


def _too_many_entries(ckpt, outside):
    for i in range(300):
        (ckpt / f"e{i:03d}").write_bytes(b"")


def _unknown_field(ckpt, outside):
    _rewrite(ckpt, lambda m: m.update(surprise=True))


def _schema_version_2(ckpt, outside):
    _rewrite(ckpt, lambda m: m.update(schema_version=2))


def _other_manifest_type(ckpt, outside):
    _rewrite(ckpt, lambda m: m.update(manifest_type="kiln.training-checkpoint.v2"))


def _traversal_key(ckpt, outside):
    (outside / "x").write_bytes(b"x")
    entry = {"role": "rng-state", "size_bytes": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    _rewrite(ckpt, lambda m: m["files"].update({"../x": entry}))


def _absolute_key(ckpt, outside):
    entry = {"role": "rng-state", "size_bytes": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    _rewrite(ckpt, lambda m: m["files"].update({"/etc/hostname": entry}))


def _backslashed_key(ckpt, outside):
    entry = {"role": "rng-state", "size_bytes": 1, "sha256": hashlib.sha256(b"x").hexdigest()}
    _rewrite(ckpt, lambda m: m["files"].update({"sub\\x": entry}))


def _traversal_state_file(ckpt, outside):
    def edit(m):
        m["files"]["../optimizer.safetensors"] = m["files"].pop(OPTIMIZER_FILE)
        m["optimizer"]["state_file"] = m["state_files"]["optimizer_state"] = "../optimizer.safetensors"

    _rewrite(ckpt, edit)


def _global_step_changed(ckpt, outside):
    _rewrite(ckpt, lambda m: m["progress"].update(global_step=5))


def _cursor_beyond_order(ckpt, outside):
    _rewrite(ckpt, lambda m: m["progress"].update(cursor_in_epoch=7))


def _optimizer_step_changed(ckpt, outside):
    _rewrite(ckpt, lambda m: m["optimizer"].update(step=3))


def _scheduler_step_changed(ckpt, outside):
    _rewrite(ckpt, lambda m: m["scheduler"].update(step=5))


def _lora_init_seed_changed(ckpt, outside):
    _rewrite(ckpt, lambda m: m["rng_states"]["lora-init"].update(seed=8))


def _data_order_not_recomputed(ckpt, outside):
    _rewrite(ckpt, lambda m: m["progress"].update(data_order=list(reversed(m["progress"]["data_order"]))))


def _provenance_edited(ckpt, outside):
    _rewrite(ckpt, lambda m: m["auxiliary_state"]["execution_provenance"]["build"].update(git_commit="0" * 40))


def _consistently_another_step(ckpt, outside):
    def edit(m):
        m["progress"].update(global_step=5, cursor_in_epoch=2)
        m["checkpoint_id"] = "sft-step-00000005"
        m["optimizer"]["step"] = m["scheduler"]["step"] = 5

    _rewrite(ckpt, edit)


def _renamed_to_another_step(ckpt, outside):
    return ckpt.rename(ckpt.with_name("bot-checkpoint-step-00000006.kiln-checkpoint"))


def _renamed_to_another_adapter(ckpt, outside):
    return ckpt.rename(ckpt.with_name("other-checkpoint-step-00000004.kiln-checkpoint"))


REFUSED = [
    pytest.param(_extra_file, "extra_file", ("notes.txt",), None, id="extra-file"),
    pytest.param(_hidden_extra_file, "extra_file", (".DS_Store",), None, id="hidden-extra-file"),
    pytest.param(_missing_file, "missing_file", (OPTIMIZER_FILE,), f"/files/{OPTIMIZER_FILE}", id="missing-file"),
    pytest.param(_symlinked_file, "symlink", (ADAPTER_FILE, "symlink"), None, id="symlinked-file"),
    pytest.param(_symlinked_subdirectory, "symlink", ("'extra'", "symlink"), None, id="symlinked-subdirectory"),
    pytest.param(_hard_link, "hard_link", (ADAPTER_FILE, "2 hard links"), None, id="hard-link"),
    pytest.param(_manifest_hard_link, "manifest_hard_link", (MANIFEST, "2 hard links"), None, id="manifest-hard-link"),
    pytest.param(_manifest_symlink, "manifest_symlink", (MANIFEST, "symlink"), None, id="manifest-symlink"),
    pytest.param(_manifest_directory, "manifest_special_file", (MANIFEST,), None, id="manifest-directory"),
    pytest.param(_manifest_too_large, "manifest_too_large", (MANIFEST, "16777217", "16777216"), None, id="manifest-16mib"),
    pytest.param(_manifest_unparsable, "invalid_json", (MANIFEST, "not valid JSON"), None, id="manifest-unparsable"),
    pytest.param(_manifest_duplicate_key, "invalid_json", (MANIFEST, "duplicate key 'files'"), None, id="duplicate-key"),
    pytest.param(_size_drift, "size_mismatch", (ADAPTER_FILE, "153249", "153248"), f"/files/{ADAPTER_FILE}/size_bytes",
                 id="size-drift"),
    pytest.param(_sentinel, "sentinel_present", (".incomplete",), None, id="sentinel"),
    pytest.param(_fifo, "special_file", ("'pipe'", "FIFO"), None, id="fifo"),
    pytest.param(_empty_subdirectory, "extra_file", ("empty directory 'scratch'",), None, id="empty-subdirectory"),
    pytest.param(_file_in_subdirectory, "extra_file", ("scratch/x.bin",), None, id="file-in-subdirectory"),
    pytest.param(_too_many_entries, "too_many_files", ("256 entries",), None, id="too-many-entries"),
    pytest.param(_unknown_field, "unknown_field", (MANIFEST, "'surprise'"), "/surprise", id="unknown-field"),
    pytest.param(_schema_version_2, "unsupported_schema_version", ("schema_version 2",), "/schema_version",
                 id="schema-version-2"),
    pytest.param(_other_manifest_type, "wrong_type_tag", ("kiln.training-checkpoint.v2",), "/manifest_type",
                 id="other-manifest-type"),
    # The contract's path pattern fires before the ``manifest.file-paths`` rule (conformance pins
    # ``pattern_mismatch`` at /files for this), so ``unsafe_path`` is never the first problem here.
    pytest.param(_traversal_key, "pattern_mismatch", ('"../x"',), "/files", id="traversal-key"),
    pytest.param(_absolute_key, "pattern_mismatch", ("/etc/hostname",), "/files", id="absolute-key"),
    pytest.param(_backslashed_key, "pattern_mismatch", ("sub\\\\x",), "/files", id="backslashed-key"),
    pytest.param(_traversal_state_file, "pattern_mismatch", ("../optimizer.safetensors", "and 2 more"), "/files",
                 id="traversal-state-file"),
    pytest.param(_global_step_changed, "inconsistent_fields", ("checkpoint_id", "sft-step-00000005"), "/checkpoint_id",
                 id="global-step-vs-checkpoint-id"),
    pytest.param(_cursor_beyond_order, "inconsistent_fields", ("cursor_in_epoch (7)", "data_order"),
                 "/progress/cursor_in_epoch", id="cursor-beyond-data-order"),
    pytest.param(_optimizer_step_changed, "inconsistent_fields", ("optimizer.step is 3",), "/optimizer/step",
                 id="optimizer-step"),
    pytest.param(_scheduler_step_changed, "inconsistent_fields", ("scheduler.step is 5",), "/scheduler/step",
                 id="scheduler-step"),
    pytest.param(_lora_init_seed_changed, "inconsistent_fields", ("seed",), "/rng_states/lora-init/seed",
                 id="rng-seed"),
    pytest.param(_data_order_not_recomputed, "inconsistent_fields", ("data_order",), "/progress/data_order",
                 id="data-order"),
    pytest.param(_provenance_edited, "digest_mismatch", ("provenance_sha256",),
                 "/auxiliary_state/execution_provenance/provenance_sha256", id="auxiliary-provenance"),
    pytest.param(_consistently_another_step, "name_mismatch", (STEP4, "bot-checkpoint-step-00000005.kiln-checkpoint"),
                 None, id="manifest-of-another-step"),
    pytest.param(_renamed_to_another_step, "name_mismatch", ("bot-checkpoint-step-00000006.kiln-checkpoint", STEP4),
                 None, id="renamed-to-another-step"),
    pytest.param(_renamed_to_another_adapter, "name_mismatch", ("other-checkpoint-step-00000004", "'bot'"), None,
                 id="renamed-to-another-adapter"),
]  # fmt: skip


@pytest.mark.parametrize(("tamper", "reason", "names", "pointer"), REFUSED)
def test_a_tampered_checkpoint_is_refused_by_inspect_and_load(checkpoint, outside, tamper, reason, names, pointer):
    path = tamper(checkpoint, outside) or checkpoint
    _assert_refused(path, reason=reason, names=names, pointer=pointer)


def test_a_checkpoint_without_a_manifest_is_not_resumable(checkpoint):
    _manifest_missing(checkpoint, None)
    _assert_refused(
        checkpoint,
        code="checkpoint_not_resumable",
        reason="missing_manifest",
        names=(MANIFEST, "not resumable"),
    )


# ----------------------------------------------------------------------------- refused by the full load only


def _flip_last_byte(ckpt: Path, rel: str) -> None:
    data = bytearray((ckpt / rel).read_bytes())
    data[-1] ^= 0x01
    (ckpt / rel).write_bytes(bytes(data))


@pytest.mark.parametrize("rel", [OPTIMIZER_FILE, ADAPTER_FILE, LOOP])
def test_checksum_drift_passes_inspection_but_fails_the_full_load(checkpoint, rel):
    size = (checkpoint / rel).stat().st_size
    _flip_last_byte(checkpoint, rel)
    assert (checkpoint / rel).stat().st_size == size
    inspect_checkpoint(checkpoint)  # metadata only: it never hashes the bytes
    err = _refusal(load_checkpoint, checkpoint)
    assert (err.code, err.reason) == ("checkpoint_invalid", "checksum_mismatch")
    assert rel in err.message
    assert _manifest(checkpoint)["files"][rel]["sha256"] in err.message
    assert err.pointer == f"/files/{rel}/sha256"


def test_a_state_file_swapped_for_the_same_size_file_of_an_older_checkpoint_fails_the_full_load(trained, checkpoint):
    older = (trained.step2 / ADAPTER_FILE).read_bytes()
    assert len(older) == (checkpoint / ADAPTER_FILE).stat().st_size
    assert older != (checkpoint / ADAPTER_FILE).read_bytes()
    (checkpoint / ADAPTER_FILE).write_bytes(older)
    inspect_checkpoint(checkpoint)
    err = _refusal(load_checkpoint, checkpoint)
    assert (err.code, err.reason) == ("checkpoint_invalid", "checksum_mismatch")
    assert ADAPTER_FILE in err.message


def test_a_valid_loop_state_of_another_step_recorded_in_the_manifest_is_a_loop_state_mismatch(trained, checkpoint):
    _record(checkpoint, LOOP, (trained.step2 / LOOP).read_bytes())  # self-consistent, but for step 2
    inspect_checkpoint(checkpoint)
    err = _refusal(load_checkpoint, checkpoint)
    assert (err.code, err.reason) == ("checkpoint_invalid", "loop_state_mismatch")
    assert LOOP in err.message
    assert "global_step is 2" in err.message
    assert "progress.global_step is 4" in err.message
    assert err.pointer == "/global_step"


def test_a_loop_state_edited_against_progress_and_recorded_in_the_manifest_is_invalid(checkpoint):
    state = json.loads((checkpoint / LOOP).read_bytes())
    state["global_step"] = 3
    _record(checkpoint, LOOP, json.dumps(state).encode())
    inspect_checkpoint(checkpoint)
    err = _refusal(load_checkpoint, checkpoint)
    assert (err.code, err.reason) == ("checkpoint_invalid", "loop_state_invalid")
    assert LOOP in err.message
    assert "global_step is 3" in err.message


def test_a_loop_state_that_breaks_its_schema_is_invalid(checkpoint):
    _record(checkpoint, LOOP, b"{}")
    err = _refusal(load_checkpoint, checkpoint)
    assert (err.code, err.reason) == ("checkpoint_invalid", "loop_state_invalid")
    assert LOOP in err.message
    assert "missing_field" in err.message


# ----------------------------------------------------------------------------- the root


def test_a_symlinked_checkpoint_root_is_refused(checkpoint, tmp_path):
    elsewhere = _copy(checkpoint, tmp_path / "elsewhere")
    link = tmp_path / "linked-registry" / STEP4
    link.parent.mkdir()
    link.symlink_to(elsewhere, target_is_directory=True)
    _assert_refused(link, reason="symlinked_root", names=(str(link), "symlink"))


def test_a_missing_path_and_a_file_are_not_checkpoints(tmp_path):
    _assert_refused(tmp_path / STEP4, reason="not_found", names=(STEP4,))
    (tmp_path / STEP4).write_text("{}")
    _assert_refused(tmp_path / STEP4, reason="not_a_directory", names=(STEP4,))


def test_a_non_canonical_directory_name_is_refused(checkpoint):
    renamed = checkpoint.rename(checkpoint.with_name("bot-checkpoint-step-4.kiln-checkpoint"))
    _assert_refused(renamed, reason="non_canonical_name", names=("'bot-checkpoint-step-4.kiln-checkpoint'",))


@pytest.mark.parametrize(
    ("name", "reason"),
    [(STEP4, "missing_manifest"), ("bot", "non_canonical_name"), ("bot-final", "non_canonical_name")],
)
def test_a_peft_adapter_directory_is_not_resumable(tmp_path, name, reason):
    peft = tmp_path / "adapters" / name
    peft.mkdir(parents=True)
    (peft / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    (peft / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    _assert_refused(peft, code="checkpoint_not_resumable", reason=reason, names=(name, "PEFT", "not resumable"))
    err = _refusal(inspect_checkpoint, peft)
    assert "base_adapter" in err.hint


# ----------------------------------------------------------------------------- publication


def _publisher(manifest: dict[str, Any], files: dict[str, tuple[str, bytes]]):
    def encode(snapshot):
        return json.loads(json.dumps(manifest)), dict(files)

    return encode


def test_publication_writes_a_canonical_read_only_checkpoint_and_holds_the_lock_only_to_capture(trained, tmp_path):
    manifest, files = _encoded(trained.step4)
    lock = threading.Lock()
    seen = {}

    def capture():
        seen["capture_locked"] = lock.locked()
        return "snapshot"

    def encode(snapshot):
        seen["snapshot"] = snapshot
        seen["encode_locked"] = lock.locked()
        return _publisher(manifest, files)(snapshot)

    registry = tmp_path / "registry"
    published = publish_checkpoint(registry, capture, encode, lock=lock)
    assert seen == {"capture_locked": True, "snapshot": "snapshot", "encode_locked": False}
    assert published.path == registry / STEP4
    assert sorted(p.name for p in registry.iterdir()) == [STEP4], "no staging directory is left behind"
    assert sorted(p.name for p in published.path.iterdir()) == sorted([*files, MANIFEST])
    for path in published.path.iterdir():
        assert path.stat().st_mode & 0o777 == 0o444, path.name
    assert (published.path / MANIFEST).read_bytes() == (trained.step4 / MANIFEST).read_bytes()
    assert published.manifest == _manifest(trained.step4)
    assert min(published.timings.capture_ms, published.timings.encode_ms, published.timings.write_ms) >= 0
    loaded = load_checkpoint(published.path)
    assert {rel: data for rel, (_, data) in files.items()} == loaded.blobs


def test_a_manifest_encoded_with_integral_floats_is_published_with_canonical_numbers(trained, tmp_path):
    manifest, files = _encoded(trained.step4)
    manifest["progress"] = {k: float(v) if type(v) is int else v for k, v in manifest["progress"].items()}
    published = publish_checkpoint(tmp_path / "registry", lambda: None, _publisher(manifest, files))
    assert (published.path / MANIFEST).read_bytes() == (trained.step4 / MANIFEST).read_bytes()


def test_publishing_an_existing_name_is_refused_and_the_published_checkpoint_is_untouched(trained, tmp_path):
    manifest, files = _encoded(trained.step4)
    registry = tmp_path / "registry"
    first = publish_checkpoint(registry, lambda: None, _publisher(manifest, files))
    before = _tree(registry)
    with pytest.raises(CheckpointError) as info:
        publish_checkpoint(registry, lambda: None, _publisher(manifest, files))
    err = info.value
    assert (err.code, err.reason) == ("checkpoint_exists", "checkpoint_exists")
    assert STEP4 in err.message
    assert "archive" in err.hint
    assert _tree(registry) == before
    load_checkpoint(first.path)


def test_a_failing_encode_writes_nothing(trained, tmp_path):
    registry = tmp_path / "registry"

    def encode(snapshot):
        raise RuntimeError("encoder exploded")

    with pytest.raises(RuntimeError, match="encoder exploded"):
        publish_checkpoint(registry, lambda: None, encode)
    assert not registry.exists()


def test_a_manifest_that_fails_validation_is_refused_before_anything_is_written(trained, tmp_path):
    manifest, files = _encoded(trained.step4)
    registry = tmp_path / "registry"
    registry.mkdir()
    (registry / "marker").write_text("unchanged")
    bad = json.loads(json.dumps(manifest))
    bad["optimizer"]["step"] = 3
    with pytest.raises(KilnError) as info:
        publish_checkpoint(registry, lambda: None, _publisher(bad, files))
    assert info.value.code == "inconsistent_fields"
    assert "optimizer.step" in info.value.message
    assert _tree(registry) == {"marker": b"unchanged"}

    stale = {**files, LOOP: ("loss-history", (trained.step2 / LOOP).read_bytes())}
    with pytest.raises(CheckpointError) as info:
        publish_checkpoint(registry, lambda: None, _publisher(manifest, stale))
    assert info.value.reason == "loop_state_mismatch"
    assert _tree(registry) == {"marker": b"unchanged"}


def _rename_fails(monkeypatch):
    def rename(*args, **kwargs):
        raise OSError(5, "simulated I/O error during rename")

    monkeypatch.setattr(os, "rename", rename)
    return "simulated I/O error during rename"


def _manifest_write_fails(monkeypatch):
    import kiln.checkpoints._publish as publish_module

    real = publish_module._create

    def create(path, data):
        if Path(path).name == MANIFEST:
            raise OSError(28, "simulated full disk while writing the manifest")
        return real(path, data)

    monkeypatch.setattr(publish_module, "_create", create)
    return "simulated full disk"


@pytest.mark.parametrize("fault", [_rename_fails, _manifest_write_fails], ids=["rename", "manifest-write"])
def test_a_failure_while_writing_leaves_neither_the_canonical_name_nor_a_staging_directory(
    trained, tmp_path, monkeypatch, fault
):
    manifest, files = _encoded(trained.step4)
    registry = tmp_path / "registry"
    message = fault(monkeypatch)
    with pytest.raises(StorageFailureError) as refused:  # the file system's refusal, typed and naming the path
        publish_checkpoint(registry, lambda: None, _publisher(manifest, files))
    assert isinstance(refused.value.__cause__, OSError)
    assert re.search(message, str(refused.value.__cause__))
    assert str(registry) in refused.value.message
    assert refused.value.reason == "storage_error"
    monkeypatch.undo()
    assert list(registry.iterdir()) == []
    assert orphaned_staging_dirs(registry) == []
    assert list_checkpoints(registry) == []


def test_a_writer_that_wins_the_name_during_publication_is_never_overwritten(trained, tmp_path, monkeypatch):
    manifest, files = _encoded(trained.step4)
    registry = tmp_path / "registry"
    target = registry / STEP4
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        if Path(path).name == ".incomplete" and not target.exists():  # between the sentinel and the rename
            target.mkdir()
            (target / "theirs").write_text("the other writer's checkpoint")

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(CheckpointError) as info:
        publish_checkpoint(registry, lambda: None, _publisher(manifest, files))
    monkeypatch.undo()
    assert (info.value.code, info.value.reason) == ("checkpoint_exists", "checkpoint_exists")
    assert _tree(registry) == {STEP4: None, f"{STEP4}/theirs": b"the other writer's checkpoint"}


def test_an_orphaned_staging_directory_is_invisible_and_does_not_block_publication(trained, tmp_path):
    registry = tmp_path / "registry"
    orphan = _copy(trained.step4, registry, f".{STEP4}.incomplete-x1y2z3w4")
    (orphan / ".incomplete").write_bytes(b"")
    assert list_checkpoints(registry) == []
    assert latest_checkpoint(registry, ADAPTER) is None
    assert orphaned_staging_dirs(registry) == [orphan]
    _assert_refused(orphan, reason="non_canonical_name", names=(orphan.name,))

    manifest, files = _encoded(trained.step4)
    published = publish_checkpoint(registry, lambda: None, _publisher(manifest, files))
    assert [c.path for c in list_checkpoints(registry)] == [published.path]
    assert latest_checkpoint(registry, ADAPTER)["resume_checkpoint"] == STEP4
    assert orphaned_staging_dirs(registry) == [orphan], "the orphan is reported, never adopted"
    load_checkpoint(published.path)


# ----------------------------------------------------------------------------- listing


def test_checkpoints_are_listed_by_step_filtered_by_adapter_and_the_newest_valid_one_is_latest(trained, tmp_path):
    registry = tmp_path / "registry"
    _copy(trained.step4, registry)
    _copy(trained.step2, registry)
    manifest, files = _encoded(trained.step4)
    manifest["adapter_name"] = manifest["effective_config"]["output_name"] = "alt"
    alt = publish_checkpoint(registry, lambda: None, _publisher(manifest, files)).path
    (registry / ADAPTER).mkdir()  # the adapter directory itself, and unrelated files, are never listed
    (registry / "notes.txt").write_text("x")

    listed = list_checkpoints(registry, ADAPTER)
    assert [(c.adapter, c.global_step, c.path.name) for c in listed] == [(ADAPTER, 2, STEP2), (ADAPTER, 4, STEP4)]
    assert all(c.info is not None and c.error is None for c in listed)
    assert [(c.adapter, c.global_step) for c in list_checkpoints(registry)] == [("alt", 4), (ADAPTER, 2), (ADAPTER, 4)]
    assert [c.path for c in list_checkpoints(registry, "alt")] == [alt]
    assert list_checkpoints(registry, "nobody") == []
    latest = latest_checkpoint(registry, ADAPTER)
    assert latest["resume_checkpoint"] == STEP4
    assert latest["global_step"] == 4
    assert contracts.problems("TrainingCheckpointSummary", latest) == []
    assert latest_checkpoint(registry, "alt")["resume_checkpoint"] == alt.name

    (registry / STEP4 / ".incomplete").write_bytes(b"")
    listed = list_checkpoints(registry, ADAPTER)
    assert [c.global_step for c in listed] == [2, 4], "an invalid checkpoint is still listed"
    broken = listed[1]
    assert broken.info is None
    assert broken.error.reason == "sentinel_present"
    assert latest_checkpoint(registry, ADAPTER)["resume_checkpoint"] == STEP2, "and skipped by latest"

    (registry / STEP2 / "extra.bin").write_bytes(b"")
    assert latest_checkpoint(registry, ADAPTER) is None


def test_status_reads_do_not_hash_so_checksum_drift_is_found_only_at_load(trained, tmp_path):
    registry = tmp_path / "registry"
    ckpt = _copy(trained.step4, registry)
    _flip_last_byte(ckpt, ADAPTER_FILE)
    assert latest_checkpoint(registry, ADAPTER)["resume_checkpoint"] == STEP4
    assert _refusal(load_checkpoint, ckpt).reason == "checksum_mismatch"


def test_a_missing_or_empty_registry_lists_nothing(tmp_path):
    assert list_checkpoints(tmp_path / "absent") == []
    assert latest_checkpoint(tmp_path / "absent", ADAPTER) is None
    assert orphaned_staging_dirs(tmp_path / "absent") == []
    (tmp_path / "empty").mkdir()
    assert list_checkpoints(tmp_path / "empty") == []


# ----------------------------------------------------------------------------- where a resume may point


def test_a_resume_may_name_a_basename_or_an_absolute_path_directly_in_the_registry(tmp_path):
    registry = tmp_path / "adapters"
    (registry / STEP4).mkdir(parents=True)
    assert resolve_checkpoint_path(registry, STEP4) == registry / STEP4
    assert resolve_checkpoint_path(registry, str(registry / STEP4)) == registry / STEP4
    assert resolve_checkpoint_path(registry, str(registry.resolve() / STEP4)) == registry / STEP4


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        pytest.param(f"sub/{STEP4}", "outside_registry", id="relative-nested"),
        pytest.param(f"../{STEP4}", "outside_registry", id="relative-traversal"),
        pytest.param(f"./{STEP4}", "outside_registry", id="relative-dot"),
        pytest.param("..", "outside_registry", id="dot-dot"),
        pytest.param("", "outside_registry", id="empty"),
        pytest.param(f"sub\\{STEP4}", "outside_registry", id="backslash"),
        pytest.param("{elsewhere}/" + STEP4, "outside_registry", id="absolute-elsewhere"),
        pytest.param("{registry}/nested/" + STEP4, "outside_registry", id="absolute-nested"),
        pytest.param("{registry}/../adapters/" + STEP4, "outside_registry", id="absolute-with-dot-dot"),
        pytest.param("bot", "non_canonical_name", id="adapter-name"),
        pytest.param("bot-checkpoint-step-4.kiln-checkpoint", "non_canonical_name", id="unpadded-step"),
        pytest.param(f".{STEP4}.incomplete-xyz", "non_canonical_name", id="staging-directory"),
        pytest.param("{registry}/bot", "non_canonical_name", id="absolute-non-canonical"),
    ],
)
def test_a_resume_that_points_anywhere_else_is_refused(tmp_path, value, reason):
    registry = tmp_path / "adapters"
    (registry / "nested" / STEP4).mkdir(parents=True)
    (tmp_path / "elsewhere" / STEP4).mkdir(parents=True)
    value = value.format(registry=registry, elsewhere=tmp_path / "elsewhere")
    with pytest.raises(CheckpointError) as info:
        resolve_checkpoint_path(registry, value)
    err = info.value
    assert (err.code, err.reason) == ("checkpoint_invalid", reason)
    assert (repr(value) if value else "empty") in err.message or repr(Path(value).name) in err.message, err.message
    assert "kiln checkpoints list" in err.hint
