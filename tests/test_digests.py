"""Golden vectors for every digest of spec/20 (tests/golden/digests.json), plus the
byte framing spelled out independently of kiln.documents.digests."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest

from kiln.documents import digests

GOLDEN = json.loads((Path(__file__).parent / "golden" / "digests.json").read_text(encoding="utf-8"))


def test_file_digest_streams_and_matches_golden(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(GOLDEN["file_digest"]["input_utf8"].encode())
    assert digests.file_sha256(path) == (GOLDEN["file_digest"]["raw"], 5)
    big = io.BytesIO(b"x" * (9 * 1024 * 1024 + 3))
    assert digests.stream_sha256(big, chunk_size=1024 * 1024) == (
        hashlib.sha256(b"x" * (9 * 1024 * 1024 + 3)).hexdigest(),
        9 * 1024 * 1024 + 3,
    )


def test_canonical_json_sorts_keys_and_drops_spaces():
    vector = GOLDEN["canonical_json"]
    assert digests.canonical_json(vector["value"]).decode() == vector["text"]
    assert vector["text"] == '{"a":null,"b":[1,2.5,"é"],"c":{"y":1e-07,"z":true}}'


def test_canonical_json_refuses_non_finite_numbers():
    with pytest.raises(ValueError):
        digests.canonical_json({"x": float("nan")})


def test_effective_config_hash_matches_golden():
    vector = GOLDEN["effective_config_hash"]
    assert digests.effective_config_hash(vector["config"]) == vector["digest"]


def test_sft_row_hashes_match_golden_and_are_domain_separated():
    for vector in GOLDEN["sft_parsed_row_hash"]:
        assert digests.sft_parsed_row_hash(vector["row"]) == vector["digest"]
        expected = hashlib.sha256(b"kiln.sft-parsed-row.v1\x00" + digests.canonical_json(vector["row"])).hexdigest()
        assert vector["digest"] == "sha256:" + expected
    for vector in GOLDEN["sft_raw_row_hash"]:
        line = vector["line_utf8"].encode()
        assert digests.sft_raw_row_hash(line) == vector["digest"]
        assert vector["digest"] == "sha256:" + hashlib.sha256(b"kiln.sft-raw-row.v1\x00{not json").hexdigest()


def test_kept_corpus_digest_uses_big_endian_lengths_and_keeps_order():
    for vector in GOLDEN["sft_kept_corpus_digest"]:
        assert digests.sft_kept_corpus_digest(vector["kept_row_hashes"]) == vector["digest"]
    two = GOLDEN["sft_kept_corpus_digest"][1]
    manual = b"kiln.sft-kept-corpus.v1\x00"
    for h in two["kept_row_hashes"]:
        manual += (71).to_bytes(8, "big") + h.encode()
    assert two["digest"] == "sha256:" + hashlib.sha256(manual).hexdigest()
    little = manual.replace((71).to_bytes(8, "big"), (71).to_bytes(8, "little"))
    assert two["digest"] != "sha256:" + hashlib.sha256(little).hexdigest()
    assert GOLDEN["sft_kept_corpus_digest"][1]["digest"] != GOLDEN["sft_kept_corpus_digest"][2]["digest"]


def test_base_model_aggregate_uses_little_endian_and_ignores_names_and_order():
    vectors = GOLDEN["base_model_content_aggregate"]
    for vector in vectors:
        shards = [(s["sha256"], s["size_bytes"]) for s in vector["shards"]]
        assert digests.base_model_content_aggregate(shards) == vector["digest"]
        assert digests.base_model_content_aggregate(reversed(shards)) == vector["digest"]
    assert vectors[0]["digest"] == vectors[1]["digest"], "renaming or reordering shards must not change the aggregate"
    first = vectors[0]
    records = sorted((bytes.fromhex(s["sha256"]), s["size_bytes"]) for s in first["shards"])
    manual = b"kiln.base-model-content.v1\x00" + len(records).to_bytes(8, "little")
    for digest, size in records:
        manual += size.to_bytes(8, "little") + digest
    assert first["digest"] == "sha256:" + hashlib.sha256(manual).hexdigest()
    big = b"kiln.base-model-content.v1\x00" + len(records).to_bytes(8, "big")
    for digest, size in records:
        big += size.to_bytes(8, "big") + digest
    assert first["digest"] != "sha256:" + hashlib.sha256(big).hexdigest()
    duplicate = vectors[3]
    single = digests.base_model_content_aggregate([(duplicate["shards"][0]["sha256"], 7)])
    assert duplicate["digest"] != single, "duplicate shards are kept, not collapsed"


def test_base_model_aggregate_changes_with_bytes_or_size():
    a = hashlib.sha256(b"a").hexdigest()
    assert digests.base_model_content_aggregate([(a, 10)]) != digests.base_model_content_aggregate([(a, 11)])
    assert digests.base_model_content_aggregate([(a, 10)]) != digests.base_model_content_aggregate(
        [(hashlib.sha256(b"b").hexdigest(), 10)]
    )


def test_self_digests_match_golden():
    v = GOLDEN["execution_provenance_digest"]
    assert digests.execution_provenance_digest(v["record"]) == v["digest"]
    changed = dict(v["record"], provenance_sha256="sha256:" + "1" * 64)
    assert digests.execution_provenance_digest(changed) == v["digest"], "the digest excludes its own field"
    k = GOLDEN["kernel_contract_digest"]
    assert digests.kernel_contract_digest(k["versions"], k["compiled_features"]) == k["digest"]
    t = GOLDEN["teacher_identity_revision"]
    assert digests.teacher_identity_revision(t["identity"]) == t["raw"]
    assert len(t["raw"]) == 64


def test_replay_hash_matches_golden_with_big_endian_framing_spelled_out():
    for vector in GOLDEN["replay_hash"]:
        args = (vector["parent_replay_hash"], vector["base_config_hash"], vector["base_weights_sha256"])
        assert digests.replay_hash(*args, vector["request_records"]) == vector["digest"]
        manual = b"kiln.replay-hash.v1\x00"
        items = [(text or "").encode() for text in args] + [
            digests.canonical_json(r) for r in vector["request_records"]
        ]
        for item in items:
            manual += len(item).to_bytes(8, "big") + item
        assert vector["digest"] == "sha256:" + hashlib.sha256(manual).hexdigest()


def test_replay_hash_changes_with_record_order_and_parent():
    vector = GOLDEN["replay_hash"][1]
    args = (vector["parent_replay_hash"], vector["base_config_hash"], vector["base_weights_sha256"])
    records = vector["request_records"]
    assert digests.replay_hash(*args, records[::-1]) != vector["digest"]
    assert digests.replay_hash(None, *args[1:], records) != vector["digest"]
    assert digests.replay_hash(*args, records[:1]) != vector["digest"]
