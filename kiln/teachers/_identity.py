"""The teacher identity (``kiln.teacher-identity.v1``), computed by one function.

``teacher_identity_for(model_dir, served_model_id=..., adapter_dir=...)`` is what a ``local``
teacher pins at registration and what ``kiln serve`` publishes in ``GET /v1/models`` (so a
Kiln server registered as a ``remote`` teacher pins the same digests as the same directory
registered as ``local``, up to ``served_model_id``). Every digest is raw hex:

* ``base_model_sha256``       the ``kiln.base-model-content.v1`` aggregate of every ``*.safetensors``
                              shard (the base-weight shard manifest's ``aggregate_sha256``);
* ``tokenizer_vocab_sha256``  SHA-256 of ``tokenizer.json``;
* ``tokenizer_config_sha256`` SHA-256 of ``tokenizer_config.json``;
* ``adapter``                 null, or the adapter's name and the SHA-256 of ``adapter_model.safetensors``
                              and ``adapter_config.json``;
* ``inference_config_sha256`` SHA-256 of the canonical JSON of ``INFERENCE_CONFIG`` (how scores are
                              computed: float32, raw ``log_softmax``, stable descending top-K).

Limits: ``vocab_size`` and ``max_model_len`` (``max_position_embeddings``, or ``n_positions``) from ``config.json``;
``max_top_k`` = ``max_prompt_logprob_candidates`` = ``MAX_TOP_K``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from kiln import __version__, contracts
from kiln.adapters import AdapterDirectory
from kiln.documents.digests import file_sha256, raw_hex
from kiln.documents.jsonio import canonical_json, read_json_file
from kiln.errors import KilnError, NotFoundError, RequestError, UpstreamError

__all__ = [
    "IDENTITY_SCHEMA",
    "IMPLEMENTATION",
    "INFERENCE_CONFIG",
    "MAX_TOP_K",
    "PROTOCOL",
    "identity_differences",
    "teacher_identity_for",
]

IDENTITY_SCHEMA = "kiln.teacher-identity.v1"
PROTOCOL = "vllm.prompt-logprobs.numeric-token-ids.causal.v1"
MAX_TOP_K = 64  # the most top-K candidates Kiln returns (and requests) per position
IMPLEMENTATION = f"kiln {__version__} (torch-cpu)"
INFERENCE_CONFIG = {
    "schema": "kiln.teacher-inference-config.v1",
    "dtype": "float32",
    "logprobs": "raw log_softmax of the logits (temperature 1, no processing)",
    "top_k_order": "descending log-probability, ties by ascending token id (stable sort)",
    "positions": "causal: position p is scored by the logits at p - 1",
    "forward": "kiln's invariant forward where the model has one (kiln.invariant.v1), else the model's own",
}


def _refuse(message: str, hint: str | None = None) -> RequestError:
    return RequestError(message, code="training_invalid_request", hint=hint)


def _raw_file_sha256(path: Path, what: str) -> str:
    if not path.is_file():
        raise _refuse(f"{path} does not exist: a teacher identity needs the {what}")
    return file_sha256(path)[0]


def _config_int(config: dict[str, Any], key: str, path: Path, *aliases: str) -> int:
    """The first positive integer among ``key`` and its ``aliases`` (other families' names for it), in the config
    or its ``text_config``."""
    for source in (config, config.get("text_config") or {}):
        for name in (key, *aliases):
            value = source.get(name) if isinstance(source, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    raise _refuse(f"{path} has no positive integer {key!r}; Kiln cannot state the teacher's limits without it")


def model_limits(model_dir: Path) -> tuple[int, int]:
    """(vocab_size, max_model_len) of a model directory, from its ``config.json``."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise _refuse(
            f"{model_dir} is not a Hugging Face model directory (no config.json)",
            hint="give the directory that holds config.json, *.safetensors and the tokenizer files",
        )
    try:
        config = read_json_file(path)
    except KilnError as exc:
        raise _refuse(f"{path} is not readable strict JSON: {exc.message}") from None
    if not isinstance(config, dict):
        raise _refuse(f"{path} is not a JSON object")
    # GPT-2-style configs call the context length n_positions (as kiln.model.max_positions reads it)
    return _config_int(config, "vocab_size", path), _config_int(
        config, "max_position_embeddings", path, "n_positions", "max_sequence_length", "seq_length"
    )


def inference_config_sha256() -> str:
    return hashlib.sha256(canonical_json(INFERENCE_CONFIG)).hexdigest()


def adapter_identity(adapter_dir: Path) -> dict[str, str]:
    """``TeacherAdapterIdentityV1`` of an adapter directory (raw digests of its two serving files)."""
    if not adapter_dir.is_dir():
        raise _refuse(f"adapter directory {adapter_dir} does not exist", hint="`kiln adapters list` shows the registry")
    adapter = AdapterDirectory(adapter_dir)
    return {
        "name": adapter.name,
        "weights_sha256": _raw_file_sha256(adapter.weights_path, "adapter weights"),
        "config_sha256": _raw_file_sha256(adapter.config_path, "adapter config"),
    }


def teacher_identity_for(
    model_dir: Path,
    *,
    served_model_id: str,
    adapter_dir: Path | None = None,
    base_weight_manifest: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``TeacherIdentityV1`` of ``model_dir`` (plus ``adapter_dir``) served as ``served_model_id``.

    ``base_weight_manifest`` (the ``kiln.base-weight-shards.v1`` record of the same directory,
    when the caller already hashed it) saves hashing every shard a second time.
    """
    from kiln.artifacts.base_weights import build_base_weight_manifest
    from kiln.model import weights_cache_dir

    model_dir = Path(model_dir)
    vocab_size, max_model_len = model_limits(model_dir)
    if base_weight_manifest is None:
        try:
            base_weight_manifest = build_base_weight_manifest(model_dir, cache_dir=weights_cache_dir())
        except FileNotFoundError as exc:
            raise _refuse(f"{exc}; Kiln only loads safetensors weights") from None
    identity = {
        "schema": IDENTITY_SCHEMA,
        "protocol": PROTOCOL,
        "served_model_id": served_model_id,
        "base_model_sha256": raw_hex(base_weight_manifest["aggregate_sha256"]),
        "tokenizer_vocab_sha256": _raw_file_sha256(model_dir / "tokenizer.json", "tokenizer vocabulary"),
        "tokenizer_config_sha256": _raw_file_sha256(model_dir / "tokenizer_config.json", "tokenizer configuration"),
        "adapter": None if adapter_dir is None else adapter_identity(Path(adapter_dir)),
        "vocab_size": vocab_size,
        "max_top_k": MAX_TOP_K,
        "max_model_len": max_model_len,
        "max_prompt_logprob_candidates": MAX_TOP_K,
        "logprobs_mode": "raw_logprobs",
        "implementation": IMPLEMENTATION,
        "inference_config_sha256": inference_config_sha256(),
    }
    problems = contracts.problems("TeacherIdentityV1", identity)
    if problems:
        detail = "; ".join(str(p) for p in problems)
        raise _refuse(f"the identity of {model_dir} is not a valid kiln.teacher-identity.v1 record: {detail}")
    return identity


def identity_differences(pinned: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """One line per member that differs: ``<member> changed: <pinned> (registered) != <now> (probed now)``."""
    lines = []
    for key in sorted(set(pinned) | set(now)):
        before, after = pinned.get(key), now.get(key)
        if before != after:
            lines.append(f"{key} changed: {_show(before)} (registered) != {_show(after)} (probed now)")
    return lines


def _show(value: Any) -> str:
    return value if isinstance(value, str) else canonical_json(value).decode("utf-8")


# ----------------------------------------------------------------------------- remote teachers

PROBE_TIMEOUT_S = 30.0
CONNECT_TIMEOUT_S = 5.0


def credential_env(credential_id: str) -> str:
    """The environment variable holding a credential: ``KILN_CREDENTIAL_<ID>`` (upper case, non-alnum → ``_``)."""
    return "KILN_CREDENTIAL_" + "".join(c if c.isascii() and c.isalnum() else "_" for c in credential_id.upper())


def auth_headers(credential_id: str | None) -> dict[str, str]:
    """``Authorization: Bearer <secret>`` from the credential's environment variable (never stored)."""
    if credential_id is None:
        return {}
    name = credential_env(credential_id)
    secret = os.environ.get(name)
    if not secret:
        raise NotFoundError(
            f"credential {credential_id!r} is not set: Kiln reads it from the environment variable {name}",
            code="not_found",
            hint=f"export {name}=<token> in the environment of the process that talks to the teacher",
        )
    return {"Authorization": f"Bearer {secret}"}


def base_url(url: str) -> str:
    """The teacher's base URL without a trailing slash; refused unless http(s) with a host."""
    from urllib.parse import urlsplit

    bad = any(ord(c) < 0x21 or ord(c) == 0x7F for c in url)
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if bad or parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise _refuse(
            f"teacher url {url!r} is not an http(s) URL with a host", hint="for example http://10.0.0.12:8000"
        )
    return url.rstrip("/")


def probe_remote_identity(url: str, model_id: str, credential_id: str | None) -> dict[str, Any]:
    """``GET {url}/v1/models``: the ``teacher_identity`` of the card whose id is ``model_id``.

    Raises ``RequestError`` (``training_invalid_request``) saying why no identity can be pinned:
    unreachable, not a model list, no such card, no ``teacher_identity``, an invalid one.
    """
    import httpx

    from kiln.documents.jsonio import parse_json

    endpoint = base_url(url) + "/v1/models"
    headers = auth_headers(credential_id)
    try:
        with httpx.Client(timeout=httpx.Timeout(PROBE_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)) as client:
            answer = client.get(endpoint, headers=headers, follow_redirects=False)
    except (httpx.HTTPError, httpx.InvalidURL, UnicodeError) as exc:
        raise UpstreamError(f"cannot reach the teacher at {endpoint}: {type(exc).__name__}: {exc}") from None
    if answer.status_code != 200:
        raise UpstreamError(f"GET {endpoint} answered HTTP {answer.status_code}: {answer.text[:300]}")
    try:
        listing = parse_json(answer.content, source=endpoint)
    except KilnError as exc:
        raise UpstreamError(f"GET {endpoint} did not answer strict JSON: {exc.message}") from None
    cards = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(cards, list):
        raise UpstreamError(f"GET {endpoint} did not answer a model list ({{'object': 'list', 'data': [...]}})")
    card = next((c for c in cards if isinstance(c, dict) and c.get("id") == model_id), None)
    if card is None:
        served = ", ".join(repr(c.get("id")) for c in cards if isinstance(c, dict)) or "none"
        raise _refuse(f"the teacher at {url} serves no model {model_id!r} (it serves {served})")
    identity = card.get("teacher_identity")
    if identity is None:
        raise _refuse(
            f"the model card of {model_id!r} at {url} has no teacher_identity, so Kiln cannot pin an identity "
            "(model and tokenizer digests, limits) and refuses to register it",
            hint="serve the model with an endpoint that publishes Kiln's teacher_identity in GET /v1/models "
            "(kiln serve does), or pre-score the data and register a fixture teacher",
        )
    problems = contracts.problems("TeacherIdentityV1", identity)
    if problems:
        detail = "; ".join(str(p) for p in problems)
        raise _refuse(
            f"the teacher_identity of {model_id!r} at {url} is not a valid kiln.teacher-identity.v1: {detail}"
        )
    if identity["served_model_id"] != model_id:
        raise _refuse(
            f"the teacher_identity of {model_id!r} at {url} names served_model_id {identity['served_model_id']!r}"
        )
    return contracts.canonical("TeacherIdentityV1", identity)  # pinned and hashed: one spelling per number
