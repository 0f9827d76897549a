"""Model layer: the deterministic tiny default, path resolution, identity capture."""

from __future__ import annotations

import hashlib
import os

import pytest

from kiln import contracts
from kiln.errors import RequestError
from kiln.model import capture_identity, create_tiny, load_base_model, resolve_model_path
from kiln.model._identity import REDACTED, environment_digest


def _digests(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def test_the_tiny_model_is_byte_identical_for_the_same_seed(tmp_path, tiny_model_dir):
    again = create_tiny(tmp_path / "again", seed=0)
    assert _digests(again) == _digests(tiny_model_dir)


def test_a_different_seed_changes_the_weights_but_not_the_tokenizer(tmp_path, tiny_model_dir):
    other = _digests(create_tiny(tmp_path / "teacher", seed=2))
    base = _digests(tiny_model_dir)
    assert other["model.safetensors"] != base["model.safetensors"]
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        assert other[name] == base[name], name


def test_create_tiny_refuses_an_existing_path(tiny_model_dir):
    with pytest.raises(FileExistsError):
        create_tiny(tiny_model_dir, seed=0)


def test_the_default_model_is_materialised_under_kiln_home_on_first_use(tmp_path):
    path, is_default = resolve_model_path()
    assert is_default
    assert path == (tmp_path / "kiln-home" / "models" / "kiln-tiny").resolve()
    assert (path / "model.safetensors").is_file()
    again, _ = resolve_model_path()
    assert again == path


def test_an_explicit_model_wins_over_the_environment(tmp_path, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("KILN_MODEL_PATH", str(tmp_path / "nowhere"))
    path, is_default = resolve_model_path(tiny_model_dir)
    assert path == tiny_model_dir.resolve()
    assert not is_default
    with pytest.raises(RequestError) as info:
        resolve_model_path()
    assert f"model path {tmp_path / 'nowhere'} does not exist" in info.value.message
    (tmp_path / "nowhere").mkdir()
    with pytest.raises(RequestError) as info:
        resolve_model_path()
    assert "not a Hugging Face model directory (no config.json)" in info.value.message


def test_identity_records_validate_and_bind_the_model_files(tiny_model_dir):
    loaded = load_base_model(tiny_model_dir)
    assert not any(p.requires_grad for p in loaded.model.parameters())
    identity = capture_identity(tiny_model_dir, loaded.tokenizer)
    assert contracts.problems("ExecutionProvenanceV1", identity.execution_provenance) == []
    assert contracts.problems("BaseWeightShardManifest", identity.base_weight_shard_manifest) == []
    weights = (tiny_model_dir / "model.safetensors").read_bytes()
    shard = identity.base_weight_shard_manifest["shards"][0]
    assert shard == {
        "filename": "model.safetensors",
        "size_bytes": len(weights),
        "sha256": "sha256:" + hashlib.sha256(weights).hexdigest(),
    }
    model_ids = identity.execution_provenance["model"]
    assert model_ids["model_config_sha256"] == identity.config_hash
    assert model_ids["training_chat_template_sha256"] == identity.training_chat_template_hash


def test_the_environment_digest_redacts_secrets_but_notices_them():
    plain = environment_digest({"KILN_SERVER_PORT": "8420"})
    with_key = environment_digest({"KILN_SERVER_PORT": "8420", "KILN_API_KEY": "hunter2"})
    other_key = environment_digest({"KILN_SERVER_PORT": "8420", "KILN_API_KEY": "other"})
    assert plain != with_key
    assert with_key == other_key, "a secret's value never reaches the digest"
    assert environment_digest({"PATH": os.environ.get("PATH", "")}) == environment_digest({})
    assert REDACTED == "<redacted-present>"
