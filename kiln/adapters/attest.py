"""What produced an adapter, in the words supply chains already read: an in-toto Statement v1 with the SLSA
Provenance v1 predicate, and a Hub-ready export with a model card.

``attestation(directory)`` derives the statement from the adapter's receipt and manifest (a Kiln adapter whose
manifest binds its bytes; ``AdapterError`` otherwise). The mapping:

* ``subject``: every file of the adapter directory except ``model.sig`` and the server's canary status, by name,
  with its SHA-256 -- the files the manifest binds (serving files, receipt) and the manifest itself;
* ``predicate.buildDefinition.buildType``: ``BUILD_TYPE`` (a Kiln LoRA training run);
* ``externalParameters``: what the caller asked for -- the training kind and the effective training configuration
  (every default resolved, the seed filled in);
* ``internalParameters``: what Kiln decided -- the SFT loss route and chunk, the training precision, the memory
  plan, the execution provenance's digest;
* ``resolvedDependencies``: the base-weight shards (and their content aggregate), the model config, the tokenizer
  config and vocabulary, the chat template, the training data, a warm-start base adapter, an OPD teacher's pinned
  identity -- each with its SHA-256 as the receipt records it;
* ``runDetails``: the builder (Kiln, its version and source commit), when the run ended and how long it took, and
  as byproducts the request lineage (``replay.jsonl``, ``lineage.json``) with their digests.

``export_hf(directory, out)`` writes a directory ready to upload to a model hub: the serving files, the manifest,
the receipt, the request lineage and the signature when there is one, copied with every digest checked (the
adapter is read and bound first, and the copy is verified against the bytes read), plus a generated ``README.md``
model card (YAML front matter: ``library_name: peft``, ``base_model``, ``tags``, the training data's digest). The
directory appears by one rename, complete or not at all.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.adapters._directory import CONFIG_FILE, MANIFEST_FILE, RECEIPT_FILE, WEIGHTS_FILE, AdapterDirectory
from kiln.adapters.signing import UNSIGNED_FILES
from kiln.artifacts.adapter_files import SIGNATURE_FILE
from kiln.artifacts.lineage import LINEAGE_FILE
from kiln.artifacts.replay_log import REPLAY_LOG
from kiln.documents.digests import file_sha256, json_sha256, raw_hex
from kiln.documents.jsonio import canonical_json
from kiln.errors import AdapterError, ConflictError
from kiln.host.fs import publish_dir

__all__ = ["BUILDER_ID", "BUILD_TYPE", "PREDICATE_TYPE", "STATEMENT_TYPE", "attestation", "export_hf", "model_card"]

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "urn:kiln:build-type:lora-training:v1"
BUILDER_ID = "urn:kiln:builder:kiln-train"
LINEAGE_FILES = (REPLAY_LOG, LINEAGE_FILE)


def _hex(value: object) -> str | None:
    return raw_hex(value) if isinstance(value, str) and value.startswith("sha256:") else None


def _dependency(name: str, digest: object, **extra: Any) -> dict[str, Any] | None:
    found = _hex(digest)
    return None if found is None else {"name": name, "digest": {"sha256": found}, **extra}


def _bound(directory: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The receipt of a Kiln adapter whose manifest binds its bytes, and every attested file's digest (the model
    card, the signature and the server's canary status are not the adapter's content)."""
    AdapterDirectory(directory).read()
    receipt_path = directory / RECEIPT_FILE
    if not receipt_path.is_file():
        raise AdapterError(f"{directory} has no {RECEIPT_FILE}: only an adapter Kiln trained can be attested")
    receipt = json.loads(receipt_path.read_bytes())
    files = {}
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name in UNSIGNED_FILES or entry.name.startswith("."):
            continue
        if not entry.is_file(follow_symlinks=False):
            raise AdapterError(f"{directory / entry.name} is not a regular file")
        files[entry.name] = file_sha256(directory / entry.name)[0]
    return receipt, files


def attestation(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The in-toto Statement v1 (SLSA Provenance v1 predicate) of the adapter at ``directory``."""
    path = Path(directory)
    receipt, files = _bound(path)
    model, tokenizer, runtime = receipt["model"], receipt["tokenizer"], receipt["runtime"]
    shards = model["base_weight_shard_manifest"]
    dependencies: list[dict[str, Any] | None] = [
        _dependency(f"base_model/{shard['filename']}", shard["sha256"], annotations={"size_bytes": shard["size_bytes"]})
        for shard in shards["shards"]
    ]
    dependencies += [
        _dependency(
            "base_model/content",
            shards["aggregate_sha256"],
            annotations={"algorithm": shards["aggregate_algorithm"], "path": model.get("path")},
        ),
        _dependency("base_model/config.json", model.get("config_hash")),
        _dependency("tokenizer/tokenizer_config.json", tokenizer.get("tokenizer_config_hash")),
        _dependency("tokenizer/chat_template", tokenizer.get("chat_template_hash")),
        _dependency(
            "training_data",
            receipt["training_data"].get("sha256"),
            annotations={
                "source": receipt["training_data"].get("source"),
                "path": receipt["training_data"].get("path"),
            },
        ),
        _dependency(
            f"base_adapter/{WEIGHTS_FILE}",
            (receipt.get("adapters") or {}).get("base", {}).get("adapter_model_sha256"),
            annotations={"path": (receipt.get("adapters") or {}).get("base", {}).get("path")},
        ),
    ]
    teacher = (receipt.get("opd") or {}).get("teacher_identity")
    if isinstance(teacher, dict):
        dependencies.append(
            {
                "name": f"opd_teacher/{(receipt.get('opd') or {}).get('teacher_id')}",
                "digest": {"sha256": raw_hex(json_sha256(teacher))},
                "annotations": {"identity": teacher},
            }
        )
    lineage = receipt.get("request_lineage") or {}
    byproducts = [
        _dependency(name, lineage.get(field))
        for name, field in zip(LINEAGE_FILES, ("replay_log_sha256", "lineage_sha256"), strict=True)
    ]
    finished = _parse_time(receipt["produced_at"])
    started = finished - timedelta(milliseconds=int(runtime.get("wall_clock_ms") or 0))
    internal = {
        key: runtime[key]
        for key in ("sft_loss_route", "sft_loss_chunk_size", "training_precision", "memory_plan")
        if runtime.get(key) is not None
    }
    internal["execution_provenance_sha256"] = runtime["execution_provenance"]["provenance_sha256"]
    kiln_block = receipt.get("kiln") or {}
    version = {"kiln": str(kiln_block.get("package_version") or __version__)}
    if kiln_block.get("git_commit"):
        version["git_commit"] = str(kiln_block["git_commit"])
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": digest}} for name, digest in files.items()],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {
                    "training_kind": receipt["hyperparameters"]["mode"],
                    "config": receipt["config"],
                },
                "internalParameters": internal,
                "resolvedDependencies": [d for d in dependencies if d is not None],
            },
            "runDetails": {
                "builder": {"id": BUILDER_ID, "version": version},
                "metadata": {
                    "invocationId": receipt["adapter_name"],
                    "startedOn": _format_time(started),
                    "finishedOn": _format_time(finished),
                },
                "byproducts": [d for d in byproducts if d is not None],
            },
        },
    }


def _parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _format_time(moment: datetime) -> str:
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def dsse_envelope(statement: dict[str, Any], private_key: str | os.PathLike[str], password: str | None = None) -> dict:
    """``statement`` in a DSSE envelope signed with an elliptic-curve private key (ECDSA P-256/384 over SHA-256):
    ``{"payloadType": "application/vnd.in-toto+json", "payload", "signatures": [{"keyid", "sig"}]}``."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = serialization.load_pem_private_key(
        Path(private_key).read_bytes(), password=None if password is None else password.encode()
    )
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise AdapterError(f"{private_key} is not an elliptic-curve private key")
    payload_type = "application/vnd.in-toto+json"
    payload = canonical_json(statement)
    pae = b"DSSEv1 %d %s %d %s" % (len(payload_type), payload_type.encode(), len(payload), payload)
    signature = key.sign(pae, ec.ECDSA(hashes.SHA256()))
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return {
        "payloadType": payload_type,
        "payload": base64.b64encode(payload).decode("ascii"),
        "signatures": [{"keyid": hashlib.sha256(public).hexdigest(), "sig": base64.b64encode(signature).decode()}],
    }


def model_card(directory: str | os.PathLike[str], *, base_model: str | None = None) -> str:
    """The ``README.md`` model card of the adapter at ``directory``: YAML front matter a hub reads, then what was
    trained, how, and how to verify it. ``base_model``: the base model's hub id (Kiln knows only the local path it
    trained from, which the adapter config records)."""
    path = Path(directory)
    return _card(path, *_bound(path), base_model=base_model)


def _card(path: Path, receipt: dict[str, Any], files: dict[str, str], *, base_model: str | None) -> str:
    """``model_card`` of an adapter already read and bound (its receipt and its files' digests)."""
    config, hyper = receipt["config"], receipt["hyperparameters"]
    base = base_model or _base_model_name(path)
    data = receipt["training_data"]
    content = receipt["model"]["base_weight_shard_manifest"]["aggregate_sha256"]
    front: dict[str, Any] = {
        "library_name": "peft",
        "base_model": base,
        "tags": ["kiln", "lora", hyper["mode"]],
        "kiln": {
            "training_kind": hyper["mode"],
            "training_data_sha256": data.get("sha256"),
            "base_model_content_sha256": content,
            "adapter_model_sha256": "sha256:" + files[WEIGHTS_FILE],
            "manifest_sha256": "sha256:" + files[MANIFEST_FILE],
        },
    }
    signed = (path / SIGNATURE_FILE).is_file()
    lines = ["---", *_yaml(front), "---", "", f"# {receipt['adapter_name']}", ""]
    lines += [
        f"A LoRA adapter ({hyper['mode'].upper()}) for `{base}`, trained by Kiln "
        f"{(receipt.get('kiln') or {}).get('package_version') or __version__}.",
        "",
        "| setting | value |",
        "|---|---|",
        f"| LoRA rank / alpha | {hyper['rank']} / {hyper['alpha']:g} |",
        f"| targets | {', '.join(config.get('lora_target_modules') or [])} |",
        f"| learning rate | {hyper['learning_rate']:g} ({(config.get('optimizer') or {}).get('kind')}) |",
        f"| epochs | {hyper['epochs']} |",
        f"| seed | {hyper['seed']} |",
        f"| precision | {config.get('precision', 'fp32')} |",
        f"| training data | {data.get('source')}, {data.get('sha256')} |",
        f"| base model content | {content} |",
        "",
        f"`{RECEIPT_FILE}` records the whole run (configuration, data and model digests, timings, the execution",
        f"environment); `{MANIFEST_FILE}` binds the weights, config and receipt by SHA-256.",
        "",
        "## Verify",
        "",
        "```bash",
        "kiln adapters verify .                      # layout, tensors, every digest the manifest binds",
    ]
    if signed:
        lines += [
            "model_signing verify key . --signature model.sig --public_key PUBLIC_KEY.pem",
            "kiln adapters verify . --public-key PUBLIC_KEY.pem",
        ]
    lines += ["```", ""]
    if signed:
        facts = json.loads((path / SIGNATURE_FILE).read_bytes()).get("verificationMaterial", {})
        hint = (facts.get("publicKey") or {}).get("hint")
        if hint:
            lines += [f"Signed (`model.sig`, OpenSSF model signing) by the key with fingerprint `sha256:{hint}`.", ""]
    return "\n".join(lines)


def _base_model_name(path: Path) -> str:
    config = json.loads((path / CONFIG_FILE).read_bytes())
    name = config.get("base_model_name_or_path")
    return name if isinstance(name, str) and name else "unknown"


def _yaml(value: dict[str, Any], indent: str = "") -> list[str]:
    """Block YAML of a small mapping (strings JSON-quoted, which YAML reads as strings)."""
    out = []
    for key, item in value.items():
        if isinstance(item, dict):
            out.append(f"{indent}{key}:")
            out += _yaml(item, indent + "  ")
        elif isinstance(item, list):
            out.append(f"{indent}{key}:")
            out += [f"{indent}  - {json.dumps(element)}" for element in item]
        else:
            out.append(f"{indent}{key}: {json.dumps(item)}")
    return out


def export_hf(
    directory: str | os.PathLike[str], out: str | os.PathLike[str], *, base_model: str | None = None
) -> dict[str, Any]:
    """A hub-ready copy of the adapter at ``directory`` in the new directory ``out``; returns what it holds.
    ``base_model``: the hub id the model card names (default: the path the adapter config records)."""
    source = Path(directory)
    target = Path(os.path.abspath(out))
    if target.exists() or target.is_symlink():
        raise ConflictError(f"{target} already exists", code="adapter_exists", hint="export into a new directory")
    receipt, files = _bound(source)  # read, bound and hashed once: the card and the copy's checks use it
    card = _card(source, receipt, files, base_model=base_model)
    names = sorted(files)
    if (source / SIGNATURE_FILE).is_file():
        names.append(SIGNATURE_FILE)
    target.parent.mkdir(parents=True, exist_ok=True)
    with publish_dir(target, purpose="export") as staged:
        for name in names:
            shutil.copyfile(source / name, staged / name)
            if name in files and file_sha256(staged / name)[0] != files[name]:
                raise AdapterError(f"{source / name} changed while it was exported; export again")
        (staged / "README.md").write_text(card, encoding="utf-8")
        AdapterDirectory(staged).read()  # the copy is an adapter whose manifest binds its bytes
        if (staged / SIGNATURE_FILE).is_file():
            from kiln.adapters.signing import signature_binding_problems

            problems = signature_binding_problems(staged)
            if problems:
                raise AdapterError(f"the signature of {source} cannot come along: {problems[0]}")
    return {"directory": str(target), "files": sorted([*names, "README.md"])}
