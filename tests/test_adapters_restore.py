"""``kiln adapters restore`` (spec/50): copy, verify, validate, rename; nothing left on failure."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys

import pytest

from kiln import contracts
from kiln.adapters._restore import restore_adapter
from kiln.errors import AdapterError, ConflictError, RequestError

FILES = [
    "adapter_config.json", "adapter_manifest.json", "adapter_model.safetensors", "lineage.json", "replay.jsonl",
    "train_receipt.json",
]  # fmt: skip


@pytest.fixture
def source(tmp_path, trained_adapter):
    """A private copy of the trained adapter, free to tamper with."""
    return shutil.copytree(trained_adapter, tmp_path / "transfer" / "bot")


def _sha(path):
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _registry_entries(registry):
    return sorted(p.name for p in registry.iterdir()) if registry.exists() else []


def _edit_manifest(source, **changes):
    path = source / "adapter_manifest.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))
    return path


def test_restore_round_trips_an_adapter_between_two_registries(tmp_path, trained_adapter):
    receipt = restore_adapter(trained_adapter / "adapter_manifest.json", tmp_path / "first")
    restored = tmp_path / "first" / "bot"
    assert contracts.problems("AdapterRestoreReceipt", receipt) == []
    assert receipt["restored_adapter_dir"] == str(restored)
    assert receipt["source_adapter_dir"] == str(trained_adapter)
    assert receipt["adapter_name"] == "bot"
    assert receipt["copied_files"] == [
        "adapter_config.json", "adapter_model.safetensors", "train_receipt.json", "replay.jsonl", "lineage.json",
        "adapter_manifest.json",
    ]  # fmt: skip
    for name in FILES:
        assert (restored / name).read_bytes() == (trained_adapter / name).read_bytes(), name

    again = restore_adapter(restored / "adapter_manifest.json", tmp_path / "second", name="bot-copy")
    copy = tmp_path / "second" / "bot-copy"
    assert again["adapter_name"] == "bot-copy"
    assert again["verified_hashes"] == receipt["verified_hashes"]
    assert sorted(p.name for p in copy.iterdir()) == FILES
    manifest = contracts.load("AdapterManifest", copy / "adapter_manifest.json")
    raw = json.loads((copy / "adapter_manifest.json").read_text())
    assert manifest.adapter_name == "bot", "the manifest keeps the name the adapter was trained as"
    assert raw["safetensors_hash"] == _sha(copy / "adapter_model.safetensors")
    assert raw["config_hash"] == _sha(copy / "adapter_config.json")
    assert raw["receipt_hash"] == _sha(copy / "train_receipt.json")
    assert _registry_entries(tmp_path / "second") == ["bot-copy"], "no hidden staging directory is left"


@pytest.mark.parametrize(
    ("file_name", "label"),
    [
        ("adapter_model.safetensors", "safetensors_hash"),
        ("adapter_config.json", "config_hash"),
        ("train_receipt.json", "receipt_hash"),
    ],
)
def test_a_tampered_file_is_refused_by_its_label_and_nothing_is_left_behind(tmp_path, source, file_name, label):
    expected = _sha(source / file_name)
    with (source / file_name).open("ab") as fh:
        fh.write(b" ")
    registry = tmp_path / "adapters"
    with pytest.raises(AdapterError) as info:
        restore_adapter(source / "adapter_manifest.json", registry)
    assert info.value.code == "adapter_invalid"
    got = _sha(source / file_name)
    assert info.value.message == f"{label} mismatch for {source / file_name}: expected {expected}, got {got}"
    assert _registry_entries(registry) == [], "neither the target nor a hidden staging directory remains"


def test_a_missing_file_is_refused_and_nothing_is_left_behind(tmp_path, source):
    (source / "train_receipt.json").unlink()
    registry = tmp_path / "adapters"
    with pytest.raises(AdapterError, match="cannot read"):
        restore_adapter(source / "adapter_manifest.json", registry)
    assert _registry_entries(registry) == []


def test_an_existing_target_is_refused_without_overwrite_and_replaced_with_it(tmp_path, trained_adapter):
    registry = tmp_path / "adapters"
    old = registry / "bot"
    old.mkdir(parents=True)
    (old / "adapter_model.safetensors").write_bytes(b"old weights")
    (old / "stale.txt").write_text("from the old adapter")

    with pytest.raises(ConflictError) as info:
        restore_adapter(trained_adapter / "adapter_manifest.json", registry)
    assert info.value.code == "adapter_exists"
    assert (old / "adapter_model.safetensors").read_bytes() == b"old weights", "the existing target is untouched"
    assert _registry_entries(registry) == ["bot"]

    receipt = restore_adapter(trained_adapter / "adapter_manifest.json", registry, overwrite=True)
    assert receipt["restored_adapter_dir"] == str(old)
    assert sorted(p.name for p in old.iterdir()) == FILES
    assert (old / "adapter_model.safetensors").read_bytes() == (
        trained_adapter / "adapter_model.safetensors"
    ).read_bytes()
    assert _registry_entries(registry) == ["bot"], "neither staging nor the replaced adapter remains"


def test_a_failed_overwrite_leaves_the_existing_target_untouched(tmp_path, source):
    registry = tmp_path / "adapters"
    old = registry / "bot"
    old.mkdir(parents=True)
    (old / "adapter_model.safetensors").write_bytes(b"old weights")
    with (source / "adapter_model.safetensors").open("ab") as fh:
        fh.write(b"\0")
    with pytest.raises(AdapterError, match="safetensors_hash mismatch"):
        restore_adapter(source / "adapter_manifest.json", registry, overwrite=True)
    assert (old / "adapter_model.safetensors").read_bytes() == b"old weights"
    assert _registry_entries(registry) == ["bot"]


@pytest.mark.parametrize(
    "name", ["a/b", "a\\b", "..", "x..y", ".hidden", "", "n" * 256, "n" * 194, "é" * 100, "tab\tname", "nul\x00"]
)
def test_a_target_name_that_is_not_path_safe_is_refused(tmp_path, trained_adapter, name):
    registry = tmp_path / "adapters"
    with pytest.raises(RequestError) as info:
        restore_adapter(trained_adapter / "adapter_manifest.json", registry, name=name)
    assert info.value.code == "training_invalid_request"
    assert "refused by the registry name rule" in info.value.message
    assert not registry.exists()


@pytest.mark.parametrize("file_name", ["../adapter_model.safetensors", "sub/adapter_model.safetensors", "/etc/passwd"])
def test_a_manifest_file_entry_that_is_not_a_plain_file_name_is_refused(tmp_path, source, file_name):
    manifest = _edit_manifest(source, files={**json.loads((source / "adapter_manifest.json").read_text())["files"],
                                             "adapter_model": file_name})  # fmt: skip
    registry = tmp_path / "adapters"
    with pytest.raises(AdapterError) as info:
        restore_adapter(manifest, registry)
    assert info.value.code == "adapter_invalid"
    assert "files/adapter_model" in info.value.message or "files.adapter_model" in info.value.message
    assert _registry_entries(registry) == []


def test_a_manifest_with_an_unknown_field_is_refused(tmp_path, source):
    manifest = _edit_manifest(source, surprise=True)
    registry = tmp_path / "adapters"
    with pytest.raises(AdapterError) as info:
        restore_adapter(manifest, registry)
    assert info.value.code == "adapter_invalid"
    assert "unknown_field" in info.value.message
    assert _registry_entries(registry) == []


def test_files_under_other_names_are_restored_under_the_canonical_names(tmp_path, source):
    (source / "adapter_model.safetensors").rename(source / "weights.safetensors")
    raw = json.loads((source / "adapter_manifest.json").read_text())
    manifest = _edit_manifest(source, files={**raw["files"], "adapter_model": "weights.safetensors"})
    receipt = restore_adapter(manifest, tmp_path / "adapters")
    restored = tmp_path / "adapters" / "bot"
    assert sorted(p.name for p in restored.iterdir()) == FILES
    assert receipt["verified_hashes"]["safetensors_hash"] == raw["safetensors_hash"]
    rewritten = json.loads((restored / "adapter_manifest.json").read_text())
    assert rewritten["files"]["adapter_model"] == "adapter_model.safetensors"
    assert rewritten["safetensors_hash"] == _sha(restored / "adapter_model.safetensors")


def test_a_manifest_without_a_receipt_restores_only_the_serving_files(tmp_path, source):
    (source / "train_receipt.json").unlink()
    raw = json.loads((source / "adapter_manifest.json").read_text())
    manifest = _edit_manifest(source, receipt_hash=None, files={**raw["files"], "train_receipt": None})
    receipt = restore_adapter(manifest, tmp_path / "adapters")
    assert "receipt_hash" not in receipt["verified_hashes"]
    assert receipt["copied_files"] == ["adapter_config.json", "adapter_model.safetensors", "adapter_manifest.json"]
    assert contracts.problems("AdapterRestoreReceipt", receipt) == []


def test_a_config_without_a_rank_is_refused_even_when_its_digest_matches(tmp_path, source):
    config_path = source / "adapter_config.json"
    config = json.loads(config_path.read_text())
    del config["r"]
    config_path.write_text(json.dumps(config))
    manifest = _edit_manifest(source, config_hash=_sha(config_path))
    registry = tmp_path / "adapters"
    with pytest.raises(AdapterError, match="r must be a positive integer"):
        restore_adapter(manifest, registry)
    assert _registry_entries(registry) == []


def test_restore_never_imports_torch():
    code = "import sys, kiln.adapters._restore; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
