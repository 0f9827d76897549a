"""``kiln adapters verify``: check one adapter directory offline and describe it.

The checks run in the order of ``OFFLINE_CHECKS`` and stop at the first failure (spec/50):
the directory exists; it holds ``adapter_config.json`` and ``adapter_model.safetensors``;
the config parses to an object declaring ``r`` (with any ``rank_pattern``), ``lora_alpha`` and
``target_modules`` by the rules of ``kiln.adapters.parse_lora_config`` -- the server reads
adapters by the same rules, so what verify accepts the server applies --, its first problem
failing that key's check; the weights file is readable; every tensor is a 2-D ``lora_A``
(``[r, in]``) or ``lora_B`` (``[out, r]``) of a declared target with its module's rank and
complete pairs (and finite values: the receipt cannot carry NaN); the update is measurable.
Then, when ``adapter_manifest.json`` exists, its bindings must match the files
(``manifest_problems``, the check the server's load makes on the bytes it reads).

*Measurable* follows the schema's ``verify.lora-facts`` rule, stricter than "some tensor is
non-zero": at least one tensor is non-zero **and** ``Σ‖A‖₂·‖B‖₂ > 0``. A freshly
initialised adapter (random A, zero B) has non-zero tensors but cannot change the model,
so it fails.

``--url``: once every offline check passed, the server checks run through the generated SDK,
in the schema's order and with the same short-circuit:

``server_load``        a greedy chat completion with ``{"adapter": NAME}`` succeeds: the server
                       read the adapter, checked its manifest hashes and tensors and applied it
                       (for that request only: the served adapter is left as it was), and the
                       ``adapter_manifest.json`` it loaded has the local file's digest;
``server_listed``      ``GET /v1/adapters`` lists NAME with a valid manifest whose weight, config
                       and receipt digests are those of the local files;
``server_generation``  a greedy completion with ``{"base_model": true}`` on the same prompt
                       succeeds; the two texts are compared (``logit_delta_summary``). It passes
                       when the text changed or the offline update is measurable (which the
                       ``measurable`` check already required), with the diagnosis recorded.

An unreachable server or an error answer fails the check that was running with a clear
message (never a traceback). Offline verification never opens a socket.

The receipt is validated against ``AdapterVerifyReceipt`` before it is returned.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kiln import contracts
from kiln.adapters._directory import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    LoraConfig,
    LoraConfigProblem,
    lora_facts,
    manifest_problems,
    parse_lora_config,
    problem_text,
)
from kiln.artifacts.adapter_bodies import MANIFEST_CHECK, OFFLINE_CHECKS, SERVER_CHECKS, SIGNATURE_CHECK
from kiln.artifacts.adapter_manifest import load_adapter_manifest
from kiln.documents.digests import file_sha256, prefixed
from kiln.documents.jsonio import read_json_file
from kiln.errors import ContractError, InternalError, KilnError, RequestError
from kiln.host.config import configured_registry
from kiln.host.fs import name_problem

DEFAULT_PROMPT = "Say hello in one short sentence."
SERVER_MAX_TOKENS = 32
SERVER_TIMEOUT_S = 300.0

_PORTABLE = re.compile(r"^[A-Za-z0-9._-]+$")
# PEFT's saved names: `<prefix>.<module path>.lora_A.weight` (linear) or `...lora_embedding_A` (embedding).
_KEY = re.compile(r"^(?P<path>.+)\.(?:lora_(?P<ab>[AB])\.weight|lora_embedding_(?P<eab>[AB]))$")
_PEFT_PREFIX = "base_model.model."
_MAX_LISTED = 5

__all__ = ["verify_adapter"]


def verify_adapter(
    name_or_path: str | os.PathLike[str],
    registry: str | os.PathLike[str] | None,
    *,
    url: str | None = None,
    prompt: str | None = None,
    api_key: str | None = None,
    public_key: str | os.PathLike[str] | None = None,
    certificate_chain: tuple[str | os.PathLike[str], ...] = (),
) -> dict[str, Any]:
    """The ``AdapterVerifyReceipt`` of one adapter (``status`` is ``ok`` or ``failed``).

    ``name_or_path`` is an existing directory, else an adapter name (``kiln.host.fs.name_problem``) in ``registry``
    (``None``: the configured registry). With ``url`` the server checks run against that
    server (``api_key`` as its bearer key); ``prompt`` is used only by their generations.
    ``public_key`` / ``certificate_chain``: the ``signature`` check verifies ``model.sig`` with them (it must
    exist); without, a signed directory's signature is checked against its files only.
    """
    given = os.fspath(name_or_path)
    if not given:
        raise RequestError("name the adapter to verify: a registry name or a directory path")
    adapter_path, adapter_dir, name = _resolve(given, registry)
    receipt: dict[str, Any] = {
        "status": "failed",
        "input": given,
        "name": name,
        "adapter_dir": adapter_dir,
        "adapter_path": str(adapter_path),
        "checks": [],
        "files": [],
        "lora": None,
        "tensor_summary": None,
        "logit_delta_summary": None,
    }
    passed = (
        _offline(receipt, adapter_path)
        and _manifest(receipt, adapter_path)
        and _signature(receipt, adapter_path, public_key, certificate_chain)
    )
    if passed and url is not None:
        _server(receipt, url.rstrip("/"), api_key, prompt or DEFAULT_PROMPT)
    receipt["status"] = "ok" if all(check["pass"] for check in receipt["checks"]) else "failed"
    found = contracts.problems("AdapterVerifyReceipt", receipt)
    if found:
        raise InternalError(f"kiln adapters verify built an invalid receipt: {found[0]}")
    return receipt


# --- resolution and bookkeeping --------------------------------------------------------------


def _resolve(given: str, registry: str | os.PathLike[str] | None) -> tuple[Path, str, str | None]:
    """(adapter path, registry or parent directory, name or None)."""
    if not os.path.isdir(given) and name_problem(given, kind="adapter") is None:
        root = os.path.abspath(configured_registry(registry))
        return Path(root, given), root, given
    path = Path(os.path.abspath(given))
    return path, str(path.parent), path.name or None


def _record(receipt: dict[str, Any], name: str, ok: bool, message: str) -> bool:
    receipt["checks"].append({"name": name, "pass": ok, "message": message})
    return ok


def _listed(problems: list[str]) -> str:
    head = "; ".join(problems[:_MAX_LISTED])
    return head + (f"; and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else "")


def _hash_files(path: Path) -> list[dict[str, Any]]:
    """Digest and size of each regular file (by portable name) in the adapter directory."""
    out = []
    for entry in sorted(path.iterdir(), key=lambda p: p.name):
        if entry.is_file() and _PORTABLE.match(entry.name):
            digest, size = file_sha256(entry)
            out.append({"name": entry.name, "sha256": prefixed(digest), "size_bytes": size})
    return out


# --- offline checks -------------------------------------------------------------------------


def _offline(receipt: dict[str, Any], path: Path) -> bool:
    record = _record  # short local name: one call per check below
    exists, layout, config_json, rank_c, alpha_c, targets_c, readable, consistency, measurable = OFFLINE_CHECKS
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        return record(receipt, exists, False, f"{path} {what}")
    record(receipt, exists, True, f"found {path}")
    receipt["files"] = _hash_files(path)

    missing = [f for f in (CONFIG_FILE, WEIGHTS_FILE) if not (path / f).is_file()]
    if missing:
        return record(receipt, layout, False, "missing " + " and ".join(missing))
    record(receipt, layout, True, f"{CONFIG_FILE} and {WEIGHTS_FILE} present")

    try:
        config = read_json_file(path / CONFIG_FILE)
    except KilnError as exc:
        return record(receipt, config_json, False, f"{CONFIG_FILE} does not parse: {problem_text(exc)}")
    if not isinstance(config, dict):
        return record(receipt, config_json, False, f"{CONFIG_FILE} is a JSON {type(config).__name__}, not an object")
    record(receipt, config_json, True, f"{CONFIG_FILE} parses")

    lora = lora_facts(config)
    receipt["lora"] = lora
    parsed = parse_lora_config(config)  # its first problem fails the check of its key; the checks before it pass
    if isinstance(parsed, LoraConfigProblem) and parsed.key == "r":
        return record(receipt, rank_c, False, parsed.reason)
    record(receipt, rank_c, True, f"r = {config['r']}" + _overrides(config.get("rank_pattern")))
    if isinstance(parsed, LoraConfigProblem) and parsed.key == "lora_alpha":
        return record(receipt, alpha_c, False, parsed.reason)
    record(receipt, alpha_c, True, f"lora_alpha = {lora['alpha']:g}")
    if isinstance(parsed, LoraConfigProblem):
        return record(receipt, targets_c, False, parsed.reason)
    record(receipt, targets_c, True, ", ".join(lora["target_modules"]))

    tensors, why = _read_tensors(path / WEIGHTS_FILE)
    if tensors is None:
        return record(receipt, readable, False, why)
    lora["tensor_count"] = len(tensors)
    record(receipt, readable, True, f"{len(tensors)} tensors")

    pairs, problems = _consistency(tensors, parsed)
    if problems:
        return record(receipt, consistency, False, _listed(problems))
    layers = {layer for layer, _ in pairs}
    record(receipt, consistency, True, f"{len(pairs)} complete A/B pairs over {len(layers)} layers")

    summary = _summary(tensors, pairs, len(layers))
    receipt["tensor_summary"] = summary
    nonzero, bound = summary["nonzero_tensor_count"], summary["lora_update_l2_upper_bound"]
    if nonzero == 0:
        return record(receipt, measurable, False, f"all {len(tensors)} tensors are zero: the adapter is a no-op")
    if bound <= 0:
        return record(
            receipt,
            measurable,
            False,
            f"{nonzero} of {len(tensors)} tensors non-zero, but every pair has a zero A or B "
            "(Σ‖A‖₂·‖B‖₂ = 0): the adapter cannot change the model (untrained?)",
        )
    return record(receipt, measurable, True, f"{nonzero} of {len(tensors)} tensors non-zero; Σ‖A‖₂·‖B‖₂ = {bound:.6g}")


def _overrides(rank_pattern: object) -> str:
    return f" (rank_pattern: {len(rank_pattern)} overrides)" if isinstance(rank_pattern, dict) and rank_pattern else ""


def _read_tensors(weights: Path) -> tuple[dict[str, dict[str, Any]] | None, str]:
    """Per tensor: shape and the statistics the summary needs, or (None, why unreadable)."""
    import torch
    from safetensors import SafetensorError, safe_open

    out: dict[str, dict[str, Any]] = {}
    try:
        with safe_open(str(weights), framework="pt") as fh:
            for key in sorted(fh.keys()):
                tensor = fh.get_tensor(key)
                values = tensor.detach().to(torch.float64)
                finite = bool(torch.isfinite(values).all())
                out[key] = {
                    "shape": tuple(tensor.shape),
                    "numel": tensor.numel(),
                    "finite": finite,
                    "nonzero": bool((values != 0).any()),
                    "max_abs": float(values.abs().max()) if finite and tensor.numel() else 0.0,
                    "norm": float(values.norm()) if finite else 0.0,
                }
    except (SafetensorError, OSError) as exc:
        return None, f"{WEIGHTS_FILE} is not readable: {exc}"
    return out, ""


def _layer_of(module_path: str) -> str:
    """The block a module belongs to: the path up to its last numeric component (else its parent)."""
    parts = module_path.split(".")
    numeric = [i for i, p in enumerate(parts[:-1]) if p.isdigit()]
    return ".".join(parts[: numeric[-1] + 1]) if numeric else ".".join(parts[:-1])


def _consistency(tensors: dict[str, dict[str, Any]], config: LoraConfig) -> tuple[list[tuple[str, str]], list[str]]:
    """Complete (layer, module path) pairs, and every problem found."""
    problems: list[str] = []
    halves: dict[str, dict[str, str]] = {}
    for key, info in tensors.items():
        match = _KEY.match(key)
        if not match:
            problems.append(f"{key} is not a LoRA A or B tensor (<module>.lora_A.weight / <module>.lora_B.weight)")
            continue
        path = match["path"].removeprefix(_PEFT_PREFIX)
        which = match["ab"] or match["eab"]
        if not config.targets(path):
            problems.append(f"{key} belongs to {path!r}, which is not a declared target module")
            continue
        shape = info["shape"]
        if len(shape) != 2:
            problems.append(f"{key} has shape {list(shape)}, not 2-D")
            continue
        expected = config.rank_for(path)
        if which == "A" and shape[0] != expected:
            problems.append(f"{key} has shape {list(shape)}: A is [r, in] and r = {expected}")
        if which == "B" and shape[1] != expected:
            problems.append(f"{key} has shape {list(shape)}: B is [out, r] and r = {expected}")
        if not info["finite"]:
            problems.append(f"{key} holds NaN or infinite values")
        halves.setdefault(path, {})[which] = key
    pairs = []
    for path, found in sorted(halves.items()):
        if len(found) == 2:
            pairs.append((_layer_of(path), path))
            continue
        have, lack = ("A", "B") if "A" in found else ("B", "A")
        problems.append(f"{found[have]} has no matching lora_{lack}")
    if not pairs and not problems:
        problems.append("the weights file holds no LoRA A/B pair")
    return pairs, problems


def _summary(tensors: dict[str, dict[str, Any]], pairs: list[tuple[str, str]], layer_count: int) -> dict[str, Any]:
    by_path: dict[str, dict[str, float]] = {}
    for key, info in tensors.items():
        match = _KEY.match(key)
        if match is None:  # only keys the offline checks accepted reach here
            continue
        path = match["path"].removeprefix(_PEFT_PREFIX)
        by_path.setdefault(path, {})[match["ab"] or match["eab"]] = info["norm"]
    bound = sum(by_path[path]["A"] * by_path[path]["B"] for _, path in pairs)
    return {
        "tensor_count": len(tensors),
        "pair_count": len(pairs),
        "layer_count": layer_count,
        "parameter_count": sum(info["numel"] for info in tensors.values()),
        "nonzero_tensor_count": sum(info["nonzero"] for info in tensors.values()),
        "max_abs_value": max((info["max_abs"] for info in tensors.values()), default=0.0),
        "lora_update_l2_upper_bound": bound,
    }


# --- manifest -------------------------------------------------------------------------------


def _signature(
    receipt: dict[str, Any],
    path: Path,
    public_key: str | os.PathLike[str] | None,
    chain: tuple[str | os.PathLike[str], ...],
) -> bool:
    """``signature`` when the directory is signed or a key was given (True when neither)."""
    from kiln.adapters.signing import SIGNATURE_FILE, verify_signature

    keyed = public_key is not None or bool(chain)
    if not keyed and not (path / SIGNATURE_FILE).exists():
        return True
    try:
        found = verify_signature(path, public_key=public_key, certificate_chain=chain)
    except KilnError as exc:
        return _record(receipt, SIGNATURE_CHECK, False, exc.message)
    who = f"signed by {found['method'].replace('_', ' ')} {found['key_fingerprint'] or '(no fingerprint)'}"
    how = {
        "key": "verified with the given public key",
        "certificate": "verified with the given certificate chain",
        "binding": "its files match the signed digests (no key given: not verified cryptographically)",
    }[found["verified"]]
    return _record(receipt, SIGNATURE_CHECK, True, f"{SIGNATURE_FILE} {who}; {how}")


def _manifest(receipt: dict[str, Any], path: Path) -> bool:
    """``manifest_hashes`` when the manifest exists (True when there is none)."""
    manifest_path = path / MANIFEST_FILE
    if not manifest_path.exists():
        return True
    try:
        value = read_json_file(manifest_path)
    except KilnError as exc:
        return _record(receipt, MANIFEST_CHECK, False, f"{MANIFEST_FILE} is unreadable: {problem_text(exc)}")
    try:
        manifest = load_adapter_manifest(value)
    except ContractError as exc:
        found = [str(p) for p in exc.problems]
        return _record(receipt, MANIFEST_CHECK, False, f"{MANIFEST_FILE} is invalid: {_listed(found)}")
    digests = {f["name"]: f["sha256"] for f in receipt["files"]}

    def digest_of(file_name: str) -> str | None:
        if file_name not in digests and (path / file_name).is_file():
            digests[file_name] = prefixed(file_sha256(path / file_name)[0])
        return digests.get(file_name)

    problems, matched = manifest_problems(manifest, path, digest_of, lambda name: read_json_file(path / name))
    if problems:
        return _record(receipt, MANIFEST_CHECK, False, _listed(problems))
    names = ", ".join(matched[:-1]) + f" and {matched[-1]}" if len(matched) > 1 else matched[0]
    return _record(receipt, MANIFEST_CHECK, True, f"{names} match")


# --- server checks ---------------------------------------------------------------------------


def _server(receipt: dict[str, Any], url: str, api_key: str | None, prompt: str) -> bool:
    """``server_load``, ``server_listed`` and ``server_generation`` against ``url``, stopping at the first failure."""
    from kiln_contracts.client import KilnApiError, KilnClient, KilnConnectionError

    load, listed, generation = SERVER_CHECKS
    name = receipt["name"]
    if name is None or name_problem(name, kind="adapter") is not None:
        return _record(receipt, load, False, f"{receipt['adapter_path']} has no adapter name to ask the server about")
    local = {f["name"]: f["sha256"] for f in receipt["files"]}
    messages = [{"role": "user", "content": prompt}]
    request = {"messages": messages, "temperature": 0, "max_tokens": SERVER_MAX_TOKENS}
    check = load
    try:
        with KilnClient(url, api_key=api_key, timeout=SERVER_TIMEOUT_S) as client:
            adapted = _dump(client.create_chat_completion({**request, "adapter": name}))
            if not _record(receipt, load, *_load_result(adapted, name, local)):
                return False
            check = listed
            if not _record(receipt, listed, *_listed_result(_dump(client.list_adapters()), name, local)):
                return False
            check = generation
            base = _dump(client.create_chat_completion({**request, "base_model": True}))
    except KilnConnectionError:
        return _record(receipt, check, False, f"cannot reach the Kiln server at {url} (is `kiln serve` running?)")
    except KilnApiError as exc:
        hint = f" (hint: {exc.hint})" if exc.hint else ""
        return _record(receipt, check, False, f"the server at {url} answered [{exc.code}] {exc.message}{hint}")
    summary = _comparison(receipt, url, prompt, base, adapted)
    receipt["logit_delta_summary"] = summary
    return _record(receipt, generation, summary["passed"], summary["diagnosis"])


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_unset=True, by_alias=True)


def _load_result(answer: dict[str, Any], name: str, local: dict[str, str]) -> tuple[bool, str]:
    weights = answer["kiln"]
    if weights["adapter"] != name:
        return False, f"asked for adapter {name!r}, the server generated with {weights['adapter']!r}"
    served, mine = weights["adapter_manifest_sha256"], local.get(MANIFEST_FILE)
    if mine is not None and served != mine:
        return False, f"the server loaded an {MANIFEST_FILE} hashing to {served}, the local one hashes to {mine}"
    tokens = answer["usage"]["completion_tokens"]
    return True, f"the server applied {name} to a completion ({tokens} tokens; {MANIFEST_FILE} {served})"


def _listed_result(listing: dict[str, Any], name: str, local: dict[str, str]) -> tuple[bool, str]:
    entry = next((e for e in listing["available"] if e["name"] == name), None)
    if entry is None:
        return False, f"GET /v1/adapters does not list {name!r} (registry {listing['adapter_dir']})"
    manifest = entry["adapter_manifest"]
    if manifest is None:
        why = entry["adapter_manifest_error"] or f"it has no {MANIFEST_FILE}"
        return False, f"the server lists {name} without a valid manifest: {why}"
    problems = []
    for field, role in (
        ("safetensors_hash", "adapter_model"),
        ("config_hash", "adapter_config"),
        ("receipt_hash", "train_receipt"),
    ):
        file_name, recorded = manifest["files"][role], manifest[field]
        if file_name is None or recorded is None:
            continue
        mine = local.get(file_name)
        if mine != recorded:
            problems.append(
                f"{field} is {recorded} on the server but the local {file_name} hashes to {mine or 'nothing (missing)'}"
            )
    if problems:
        return False, _listed(problems)
    return True, f"listed ({entry['status']}) with a valid manifest; its hashes match the local files"


def _comparison(
    receipt: dict[str, Any], url: str, prompt: str, base: dict[str, Any], adapted: dict[str, Any]
) -> dict[str, Any]:
    """``logit_delta_summary``: the greedy base and adapter texts and what their difference means."""
    summary = receipt["tensor_summary"] or {}
    measurable = summary.get("nonzero_tensor_count", 0) > 0 and summary.get("lora_update_l2_upper_bound", 0) > 0
    base_text = base["choices"][0]["message"]["content"]
    adapter_text = adapted["choices"][0]["message"]["content"]
    changed = base_text != adapter_text
    if changed:
        diagnosis = "the adapter changes the greedy output on this prompt"
    elif measurable:
        diagnosis = (
            "identical greedy text, but the offline update is measurable "
            f"(Σ‖A‖₂·‖B‖₂ = {summary['lora_update_l2_upper_bound']:.6g}): a small update can leave every argmax "
            "unchanged on one prompt"
        )
    else:
        diagnosis = "identical greedy text and no measurable offline update: the adapter does not change the model"
    return {
        "url": url,
        "prompt": prompt,
        "base_output": base_text,
        "adapter_output": adapter_text,
        "text_changed": changed,
        "offline_update_measurable": measurable,
        "passed": changed or measurable,
        "diagnosis": diagnosis,
    }
