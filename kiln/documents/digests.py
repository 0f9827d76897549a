"""Every digest of spec/20, defined exactly once. All are SHA-256.

"Prefixed" is ``sha256:`` + 64 lowercase hex; "raw" is the 64 hex alone. Note the two
deliberate length framings: little-endian u64 in the base-model aggregate, big-endian
u64 in the SFT kept-corpus digest. Golden vectors: ``tests/golden/digests.json``.

Float text in canonical JSON follows Python's ``repr``; another language may print some
floats differently, so digests over floats are only portable between Python writers.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, BinaryIO

from kiln.documents.jsonio import canonical_json

__all__ = [
    "BASE_MODEL_CONTENT_ALGORITHM",
    "KERNEL_CONTRACT_TYPE",
    "REPLAY_HASH_ALGORITHM",
    "base_model_content_aggregate",
    "canonical_json",
    "checkpoint_manifest_identity",
    "effective_config_hash",
    "execution_provenance_digest",
    "file_sha256",
    "json_sha256",
    "kernel_contract_digest",
    "prefixed",
    "raw_hex",
    "replay_hash",
    "sft_kept_corpus_digest",
    "sft_parsed_row_hash",
    "sft_raw_row_hash",
    "stream_sha256",
    "teacher_identity_revision",
]

BASE_MODEL_CONTENT_ALGORITHM = "kiln.base-model-content.v1"
KERNEL_CONTRACT_TYPE = "kiln.kernel-contract.v1"
REPLAY_HASH_ALGORITHM = "kiln.replay-hash.v1"
_CHUNK = 4 * 1024 * 1024
_ASCII_WS = b" \t\n\r\x0b\x0c"


def prefixed(hex_digest: str) -> str:
    return "sha256:" + hex_digest


def raw_hex(digest: str) -> str:
    """Strip the ``sha256:`` prefix if present."""
    return digest.removeprefix("sha256:")


def stream_sha256(fh: BinaryIO, chunk_size: int = _CHUNK) -> tuple[str, int]:
    """Raw hex digest and byte count of a stream, read in chunks (never whole)."""
    h = hashlib.sha256()
    size = 0
    while block := fh.read(chunk_size):
        h.update(block)
        size += len(block)
    return h.hexdigest(), size


def file_sha256(path: str | os.PathLike[str]) -> tuple[str, int]:
    """Raw hex digest and size of a file, streamed."""
    with open(path, "rb") as fh:
        return stream_sha256(fh)


def json_sha256(value: Any) -> str:
    """Prefixed digest of the canonical JSON of ``value``."""
    return prefixed(hashlib.sha256(canonical_json(value)).hexdigest())


def effective_config_hash(config: Mapping[str, Any]) -> str:
    """Prefixed digest of the canonical JSON of the effective trainer config."""
    return json_sha256(config)


def sft_parsed_row_hash(row: Mapping[str, Any]) -> str:
    """Prefixed digest of a parsed SFT row (absent optional fields omitted, content a string)."""
    return prefixed(hashlib.sha256(b"kiln.sft-parsed-row.v1\x00" + canonical_json(row)).hexdigest())


def sft_raw_row_hash(line: bytes) -> str:
    """Prefixed digest of a row that is not valid JSON: the line with ASCII whitespace trimmed."""
    return prefixed(hashlib.sha256(b"kiln.sft-raw-row.v1\x00" + line.strip(_ASCII_WS)).hexdigest())


def sft_kept_corpus_digest(kept_row_hashes: Iterable[str]) -> str:
    """Prefixed digest over the ordered kept-row hashes, each framed by a big-endian u64 length."""
    h = hashlib.sha256(b"kiln.sft-kept-corpus.v1\x00")
    for row_hash in kept_row_hashes:
        data = row_hash.encode("ascii")
        h.update(struct.pack(">Q", len(data)))
        h.update(data)
    return prefixed(h.hexdigest())


def base_model_content_aggregate(shards: Iterable[tuple[str, int]]) -> str:
    """Prefixed ``kiln.base-model-content.v1`` aggregate of ``(digest, size)`` shard records.

    ``digest`` may be raw or prefixed. Records are sorted by (digest bytes, size) with
    duplicates kept, so file names and order do not matter; lengths are little-endian u64.
    """
    records = sorted((bytes.fromhex(raw_hex(d)), int(size)) for d, size in shards)
    h = hashlib.sha256(BASE_MODEL_CONTENT_ALGORITHM.encode("ascii") + b"\x00")
    h.update(struct.pack("<Q", len(records)))
    for digest, size in records:
        h.update(struct.pack("<Q", size))
        h.update(digest)
    return prefixed(h.hexdigest())


def execution_provenance_digest(record: Mapping[str, Any]) -> str:
    """Self-digest of an execution-provenance record: canonical JSON without ``provenance_sha256``."""
    return json_sha256({k: v for k, v in record.items() if k != "provenance_sha256"})


def kernel_contract_digest(versions: Mapping[str, str], compiled_features: Sequence[str]) -> str:
    return json_sha256([KERNEL_CONTRACT_TYPE, dict(versions), list(compiled_features)])


def teacher_identity_revision(identity: Mapping[str, Any]) -> str:
    """Raw digest of the canonical JSON of a ``TeacherIdentityV1`` record."""
    return hashlib.sha256(canonical_json(identity)).hexdigest()


def checkpoint_manifest_identity(manifest: Mapping[str, Any]) -> str:
    """Prefixed digest of a validated checkpoint manifest (queue-time revalidation)."""
    return json_sha256(manifest)


def replay_hash(
    parent_replay_hash: str | None,
    base_config_hash: str | None,
    base_weights_sha256: str | None,
    request_records: Iterable[Mapping[str, Any]],
) -> str:
    """Prefixed ``kiln.replay-hash.v1`` of a request lineage (docs/lineage.md).

    Input: ``b"kiln.replay-hash.v1\\x00"``, then items each framed by a big-endian u64 byte length: the parent's
    replay hash text, the base model's config hash text, the base-weight aggregate text (each the empty item when
    absent), then the canonical JSON of every request record in file order.
    """
    h = hashlib.sha256(REPLAY_HASH_ALGORITHM.encode("ascii") + b"\x00")
    items: list[bytes] = [
        (text or "").encode("ascii") for text in (parent_replay_hash, base_config_hash, base_weights_sha256)
    ]
    for item in (*items, *(canonical_json(dict(record)) for record in request_records)):
        h.update(struct.pack(">Q", len(item)))
        h.update(item)
    return prefixed(h.hexdigest())
