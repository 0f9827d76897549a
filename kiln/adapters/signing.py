"""Signing an adapter directory the way model publishers sign models: OpenSSF model signing.

``sign_adapter`` writes ``model.sig`` in the adapter directory through the ``model-signing`` library (the
``kiln[signing]`` extra): a Sigstore bundle whose DSSE envelope signs an in-toto Statement listing every file of
the directory with its SHA-256 (``predicateType https://model_signing/signature/v1.0``). Signing uses an elliptic
curve private key (PEM), or a key and its signing certificate with the certificate chain; keyless Sigstore
signing needs the network and is the library's business. Two files stay out of the signature, and the signature
itself records that they do (``ignore_paths``), so the upstream verifier skips them too:

* ``model.sig`` itself;
* ``adapter_canary_status.json``, the server's record of its serving canary, written after publication;
* ``README.md``, a model card ``kiln adapters export`` writes beside the files for a hub (documentation, derived
  from the receipt, not the adapter's content).

Only a directory that reads as a Kiln adapter -- its manifest bound to the bytes -- is signed: a signature over
files the manifest does not bind would vouch for something Kiln never checked. Signing writes one new file and
changes no byte the manifest binds; the signature appears by one rename, complete or not at all.

``verify_signature`` checks a signed directory. With a public key (or a certificate chain) it is the upstream
verification, unchanged: the signature is cryptographically valid for that key and the directory holds exactly
the signed files, byte for byte. Without a key it checks only the binding (``signature_binding_problems``): the
signed statement lists exactly the directory's files with their digests -- what a restore can check before the
receiving side decides which key it trusts. ``signature_facts`` describes a signature without verifying it: the
key fingerprint (``sha256:`` of the signer's PEM public key, as the bundle's key hint records it) or the signing
certificate's fingerprint.

The upstream command a consumer runs, unchanged::

    model_signing verify key ADAPTER_DIR --signature ADAPTER_DIR/model.sig --public_key PUBLIC_KEY.pem
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kiln.adapters._directory import CANARY_FILE, AdapterDirectory
from kiln.artifacts.adapter_files import SIGNATURE_FILE
from kiln.documents.digests import file_sha256
from kiln.errors import AdapterError, RequestError
from kiln.host.fs import fsync_dir

__all__ = [
    "SIGNATURE_FILE",
    "UNSIGNED_FILES",
    "locate",
    "sign_adapter",
    "signature_binding_problems",
    "signature_facts",
    "verify_signature",
]

# the signature, server state written after publication, and a model card written for a hub (kiln adapters export)
MODEL_CARD = "README.md"
UNSIGNED_FILES = (SIGNATURE_FILE, CANARY_FILE, MODEL_CARD)
_GIT_PATHS = (".git", ".gitattributes", ".github", ".gitignore")  # the library's own default ignores
_PREDICATE = "https://model_signing/signature/v1.0"
_MAX_SIGNATURE_BYTES = 4 * 2**20


def locate(name_or_path: str, registry: str | os.PathLike[str] | None) -> Path:
    """An existing directory as given, else the adapter of that name in ``registry`` (None: the configured one)."""
    from kiln.host.config import configured_registry
    from kiln.host.fs import name_problem

    if os.path.isdir(name_or_path):
        return Path(os.path.abspath(name_or_path))
    why = name_problem(name_or_path, kind="adapter")
    if why is not None:
        raise RequestError(f"{name_or_path!r} is neither a directory nor an adapter name: {why}")
    return Path(os.path.abspath(configured_registry(registry))) / name_or_path


def _library() -> Any:
    try:
        import model_signing
    except ImportError as exc:
        raise RequestError(
            f"signing needs the model-signing package ({exc.name or exc} is missing)",
            code="training_backend_unsupported",
            hint="pip install 'kiln[signing]' (model-signing and pyOpenSSL)",
        ) from None
    return model_signing


def _hashing(model_signing: Any) -> Any:
    return model_signing.hashing.Config().set_ignored_paths(paths=list(UNSIGNED_FILES), ignore_git_paths=True)


def sign_adapter(
    directory: str | os.PathLike[str],
    *,
    private_key: str | os.PathLike[str],
    password: str | None = None,
    certificate: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
) -> dict[str, Any]:
    """Sign the adapter at ``directory`` (``model.sig``, replacing an earlier signature); returns
    ``signature_facts``. ``certificate``: sign with the key and this signing certificate (and ``certificate_chain``)
    instead of the bare key."""
    model_signing = _library()
    path = Path(directory)
    AdapterDirectory(path).read()  # a Kiln adapter whose manifest binds its bytes, or AdapterError
    for given, what in ((private_key, "private key"), (certificate, "signing certificate")):
        if given is not None and not Path(given).is_file():
            raise RequestError(f"the {what} {given} is not a file", code="training_invalid_request")
    config = model_signing.signing.Config().set_hashing_config(_hashing(model_signing))
    if certificate is None:
        config = config.use_elliptic_key_signer(private_key=Path(private_key), password=password)
    else:
        config = config.use_certificate_signer(
            private_key=Path(private_key),
            signing_certificate=Path(certificate),
            certificate_chain=[Path(p) for p in certificate_chain],
        )
    staged = path / f".{SIGNATURE_FILE}.incomplete-{uuid.uuid4().hex[:12]}"  # hidden: never part of what is hashed
    try:
        try:
            config.sign(path, staged)  # hashes the directory first, then writes the bundle
        except (ValueError, TypeError, OSError) as exc:
            raise RequestError(
                f"could not sign {path}: {exc}",
                code="training_invalid_request",
                hint="pass an elliptic-curve private key in PEM (and its password), e.g. from "
                "`openssl ecparam -name prime256v1 -genkey -noout -out key.pem`",
            ) from None
        with staged.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(staged, path / SIGNATURE_FILE)
        fsync_dir(path)
    finally:
        staged.unlink(missing_ok=True)
    facts = signature_facts(path)
    assert facts is not None
    return facts


def _bundle(path: Path) -> dict[str, Any]:
    signature = path / SIGNATURE_FILE
    try:
        with signature.open("rb") as handle:
            raw = handle.read(_MAX_SIGNATURE_BYTES + 1)
        if len(raw) > _MAX_SIGNATURE_BYTES:
            raise ValueError(f"larger than {_MAX_SIGNATURE_BYTES} bytes")
        bundle = json.loads(raw)
        if not isinstance(bundle, dict):
            raise ValueError("not a JSON object")
        return bundle
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{signature} is not a readable signature bundle: {exc}") from None


def _statement(bundle: dict[str, Any], where: Path) -> dict[str, Any]:
    try:
        payload = base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True)
        statement = json.loads(payload)
        if statement.get("predicateType") != _PREDICATE:
            raise ValueError(f"its predicate type is {statement.get('predicateType')!r}, not {_PREDICATE}")
        resources = statement["predicate"]["resources"]
        if not isinstance(resources, list):
            raise ValueError("its resources are not a list")
        return dict(statement)
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"{where / SIGNATURE_FILE} does not hold a model-signing statement: {exc}") from None


def signature_facts(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """``{"file", "method", "key_fingerprint", "signed_files"}`` of the adapter's signature, None when unsigned.
    Nothing is verified: ``verify_signature`` does that."""
    path = Path(directory)
    if not (path / SIGNATURE_FILE).is_file():
        return None
    bundle = _bundle(path)
    material = bundle.get("verificationMaterial") or {}
    hint = (material.get("publicKey") or {}).get("hint") if isinstance(material, dict) else None
    chain = material.get("x509CertificateChain") if isinstance(material, dict) else None
    leaf = material.get("certificate") if isinstance(material, dict) else None
    fingerprint: str | None
    if isinstance(hint, str) and hint:
        method, fingerprint = "public_key", f"sha256:{hint}"
    elif isinstance(leaf, dict) or isinstance(chain, dict):
        cert = leaf if isinstance(leaf, dict) else (chain.get("certificates") or [{}])[0]  # type: ignore[union-attr]
        raw = base64.b64decode(cert.get("rawBytes", "")) if isinstance(cert, dict) else b""
        method, fingerprint = "certificate", f"sha256:{hashlib.sha256(raw).hexdigest()}" if raw else None
    else:
        method, fingerprint = "unknown", None
    statement = _statement(bundle, path)
    return {
        "file": SIGNATURE_FILE,
        "method": method,
        "key_fingerprint": fingerprint,
        "signed_files": sorted(str(r.get("name")) for r in statement["predicate"]["resources"]),
    }


def signature_binding_problems(directory: str | os.PathLike[str]) -> list[str]:
    """Where the signed statement and the directory disagree: a file changed, added or removed (no key needed)."""
    path = Path(directory)
    statement = _statement(_bundle(path), path)
    ignored = set(statement["predicate"].get("serialization", {}).get("ignore_paths", ())) | set(_GIT_PATHS)
    signed = {str(r.get("name")): str(r.get("digest")) for r in statement["predicate"]["resources"]}
    present = {
        entry.name
        for entry in os.scandir(path)
        if entry.name not in ignored and not entry.name.startswith(f".{SIGNATURE_FILE}.")
    }
    problems = []
    for name in sorted(present - set(signed)):
        problems.append(f"{name} is in the directory but not in the signature")
    for name in sorted(set(signed) - present):
        problems.append(f"{name} is signed but missing from the directory")
    for name in sorted(present & set(signed)):
        file = path / name
        if not file.is_file() or file.is_symlink():
            problems.append(f"{name} is not a regular file")
        elif file_sha256(file)[0] != signed[name]:
            problems.append(f"{name} differs from the signed bytes")
    return problems


def verify_signature(
    directory: str | os.PathLike[str],
    *,
    public_key: str | os.PathLike[str] | None = None,
    certificate_chain: Sequence[str | os.PathLike[str]] = (),
) -> dict[str, Any]:
    """Verify the adapter's signature: with ``public_key`` (or ``certificate_chain``) cryptographically, through the
    upstream verifier; without, its binding to the files only. Returns ``signature_facts`` plus ``verified``
    (``"key"``, ``"certificate"`` or ``"binding"``); raises ``AdapterError`` naming the first difference."""
    path = Path(directory)
    facts = signature_facts(path)
    if facts is None:
        raise AdapterError(
            f"{path} has no {SIGNATURE_FILE}: it is not signed",
            hint="sign it with `kiln adapters sign NAME --key PRIVATE_KEY.pem`",
        )
    problems = signature_binding_problems(path)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise AdapterError(f"the signature of {path} does not match its files: {problems[0]}{more}")
    if public_key is None and not certificate_chain:
        return {**facts, "verified": "binding"}
    model_signing = _library()
    config = model_signing.verifying.Config()
    if public_key is not None:
        config = config.use_elliptic_key_verifier(public_key=Path(public_key))
        how = "key"
    else:
        config = config.use_certificate_verifier(certificate_chain=[Path(p) for p in certificate_chain])
        how = "certificate"
    try:
        config.verify(path, path / SIGNATURE_FILE)
    except Exception as exc:  # noqa: BLE001 -- the library raises ValueError and its crypto errors alike
        raise AdapterError(f"the signature of {path} does not verify with the given key: {exc}") from None
    return {**facts, "verified": how}
