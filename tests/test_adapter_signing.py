"""One adapter, the ecosystem's verifiers: OpenSSF model signing, an in-toto/SLSA provenance statement, a Hub export.

* a Kiln-signed adapter verifies with the ``model_signing`` library's verify API and its CLI, unchanged; one changed
  byte, an added file and a removed file each fail (there and in ``kiln adapters verify --public-key``);
* signing changes no byte the manifest binds; restore carries the signature across; the listing names the key;
* the attestation parses into the in-toto Statement and SLSA Provenance v1 protos, validates, and its subjects are
  the files' digests; its DSSE envelope verifies with the public key;
* the export's model card parses as YAML front matter, and the exported directory passes ``kiln adapters verify``
  and the upstream verifier.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.adapters import restore_adapter, verify_adapter
from kiln.adapters.attest import attestation, dsse_envelope, export_hf
from kiln.adapters.signing import sign_adapter, signature_facts, verify_signature
from kiln.documents.digests import file_sha256
from kiln.errors import AdapterError

ROWS = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}] * 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    from kiln.trainers.sft import admit_sft, run_sft

    registry = tmp_path_factory.mktemp("registry")
    job = admit_sft(
        adapter_name="bot", registry=registry, config={"epochs": 1, "seed": 1}, examples=ROWS,
        model_path=str(tiny_model_dir),
    )  # fmt: skip
    result = run_sft(job)
    assert result.status == "success", result.receipt.get("failure_message")
    return result.adapter_dir


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    where = tmp_path_factory.mktemp("keys")
    made = {}
    for name in ("signer", "other"):
        key = ec.generate_private_key(ec.SECP256R1())
        private = where / f"{name}.pem"
        private.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        public = where / f"{name}.pub.pem"
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
        made[name] = (private, public)
    return made


@pytest.fixture
def signed(trained, keys, tmp_path):
    copy = tmp_path / "bot"
    shutil.copytree(trained, copy)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    facts = sign_adapter(copy, private_key=keys["signer"][0])
    after = {p.name: p.read_bytes() for p in copy.iterdir() if p.name != "model.sig"}
    assert after == before  # signing changes no byte: it adds model.sig
    assert facts["method"] == "public_key"
    return copy


def _upstream_verify(directory: Path, public_key: Path) -> None:
    import model_signing

    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public_key).verify(
        directory, directory / "model.sig"
    )


def _upstream_cli(directory: Path, public_key: Path) -> subprocess.CompletedProcess[str]:
    script = "import sys; from model_signing._cli import main; sys.exit(main())"
    argv = [
        "verify",
        "key",
        str(directory),
        "--signature",
        str(directory / "model.sig"),
        "--public_key",
        str(public_key),
    ]
    return subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, check=False, timeout=300
    )


def test_a_signed_adapter_verifies_with_the_upstream_library_and_cli(signed, keys):
    _upstream_verify(signed, keys["signer"][1])
    done = _upstream_cli(signed, keys["signer"][1])
    assert done.returncode == 0, done.stderr
    assert "Verification succeeded" in done.stdout + done.stderr
    with pytest.raises(ValueError):
        _upstream_verify(signed, keys["other"][1])
    assert verify_signature(signed, public_key=keys["signer"][1])["verified"] == "key"


@pytest.mark.parametrize("tamper", ["changed-byte", "added-file", "removed-file"])
def test_tampering_fails_upstream_and_in_kiln(tamper, signed, keys):
    if tamper == "changed-byte":
        weights = signed / "adapter_model.safetensors"
        blob = bytearray(weights.read_bytes())
        blob[-1] ^= 0x01
        weights.write_bytes(bytes(blob))
    elif tamper == "added-file":
        (signed / "notes.txt").write_text("added after signing\n", encoding="utf-8")
    else:
        (signed / "lineage.json").unlink()
    with pytest.raises(ValueError):
        _upstream_verify(signed, keys["signer"][1])
    assert _upstream_cli(signed, keys["signer"][1]).returncode != 0
    with pytest.raises(AdapterError) as info:
        verify_signature(signed)  # no key: the binding alone already fails
    expected = {"changed-byte": "adapter_model.safetensors differs", "added-file": "notes.txt is in the directory",
                "removed-file": "lineage.json is signed but missing"}[tamper]  # fmt: skip
    assert expected in info.value.message
    receipt = verify_adapter(signed, None, public_key=keys["signer"][1])
    assert receipt["status"] == "failed"


def test_kiln_verify_checks_the_signature_with_a_key_and_refuses_another(signed, keys, capsys):
    from kiln.cli import main

    assert main(["adapters", "verify", str(signed), "--public-key", str(keys["signer"][1])]) == 0
    out = capsys.readouterr().out
    assert "verified with the given public key" in out
    assert main(["adapters", "verify", str(signed), "--public-key", str(keys["other"][1])]) == 1
    receipt = verify_adapter(signed, None)  # signed, no key: the binding is checked
    assert receipt["status"] == "ok"
    assert receipt["checks"][-1]["name"] == "signature"
    assert "not verified cryptographically" in receipt["checks"][-1]["message"]


def test_an_unsigned_adapter_with_a_key_fails_verify(trained, keys):
    receipt = verify_adapter(trained, None, public_key=keys["signer"][1])
    assert receipt["status"] == "failed"
    assert "not signed" in receipt["checks"][-1]["message"]


def test_only_a_bound_adapter_is_signed(trained, keys, tmp_path):
    copy = tmp_path / "bot"
    shutil.copytree(trained, copy)
    config = copy / "adapter_config.json"
    config.write_bytes(config.read_bytes().replace(b"}", b" }", 1))
    with pytest.raises(AdapterError):
        sign_adapter(copy, private_key=keys["signer"][0])
    assert not (copy / "model.sig").exists()


def test_restore_carries_the_signature_and_the_listing_names_the_key(signed, keys, tmp_path):
    from kiln.adapters import list_adapters

    receipt = restore_adapter(signed / "adapter_manifest.json", tmp_path / "registry", public_key=keys["signer"][1])
    assert "model.sig" in receipt["copied_files"]
    restored = Path(receipt["restored_adapter_dir"])
    _upstream_verify(restored, keys["signer"][1])
    listing = list_adapters(tmp_path / "registry")
    entry = next(e for e in listing["available"] if e["name"] == "bot")
    assert entry["signature"]["key_fingerprint"] == signature_facts(signed)["key_fingerprint"]
    assert entry["signature"]["key_fingerprint"].startswith("sha256:")
    with pytest.raises(AdapterError):
        restore_adapter(signed / "adapter_manifest.json", tmp_path / "again", public_key=keys["other"][1])
    assert not (tmp_path / "again" / "bot").exists()


def test_the_attestation_is_an_in_toto_slsa_statement_over_the_files(trained, keys):
    from google.protobuf import json_format
    from in_toto_attestation.predicates.provenance.v1 import provenance_pb2
    from in_toto_attestation.v1 import statement_pb2
    from in_toto_attestation.v1.statement import Statement

    statement = attestation(trained)
    proto = json_format.ParseDict(statement, statement_pb2.Statement())  # unknown fields fail
    Statement.copy_from_pb(proto).validate()
    assert statement["predicateType"] == "https://slsa.dev/provenance/v1"
    json_format.ParseDict(statement["predicate"], provenance_pb2.Provenance())  # the SLSA v1 shape, strictly
    subjects = {s["name"]: s["digest"]["sha256"] for s in statement["subject"]}
    files = {p.name: file_sha256(p)[0] for p in trained.iterdir() if p.is_file()}
    assert subjects == files
    build = statement["predicate"]["buildDefinition"]
    receipt = json.loads((trained / "train_receipt.json").read_text())
    assert build["externalParameters"]["config"] == receipt["config"]
    names = {d["name"] for d in build["resolvedDependencies"]}
    assert {"base_model/model.safetensors", "base_model/content", "training_data"} <= names
    shard = receipt["model"]["base_weight_shard_manifest"]["shards"][0]["sha256"].removeprefix("sha256:")
    assert {"sha256": shard} in [d["digest"] for d in build["resolvedDependencies"]]

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    envelope = dsse_envelope(statement, keys["signer"][0])
    payload = base64.b64decode(envelope["payload"])
    assert json.loads(payload) == statement
    pae = b"DSSEv1 %d %s %d %s" % (len(envelope["payloadType"]), envelope["payloadType"].encode(), len(payload),
                                    payload)  # fmt: skip
    public = serialization.load_pem_public_key(keys["signer"][1].read_bytes())
    public.verify(base64.b64decode(envelope["signatures"][0]["sig"]), pae, ec.ECDSA(hashes.SHA256()))


def test_the_export_is_a_verified_hub_ready_copy_with_a_model_card(signed, keys, tmp_path, capsys):
    import yaml

    from kiln.cli import main

    out = tmp_path / "export"
    found = export_hf(signed, out, base_model="Qwen/Qwen2.5-0.5B-Instruct")
    assert {"README.md", "model.sig", "adapter_manifest.json"} <= set(found["files"])
    card = (out / "README.md").read_text(encoding="utf-8")
    assert card.startswith("---\n")
    front = yaml.safe_load(card.split("---\n", 2)[1])
    assert front["library_name"] == "peft"
    assert front["base_model"] == "Qwen/Qwen2.5-0.5B-Instruct"
    receipt = json.loads((signed / "train_receipt.json").read_text())
    assert front["kiln"]["training_data_sha256"] == receipt["training_data"]["sha256"]
    assert "sft" in front["tags"]
    assert main(["adapters", "verify", str(out), "--public-key", str(keys["signer"][1])]) == 0
    _upstream_verify(out, keys["signer"][1])  # the card is outside the signature, by the signature's own record
    with pytest.raises(Exception) as info:
        export_hf(signed, out)
    assert "already exists" in str(info.value)
    capsys.readouterr()
