"""Identity of the base model and of this process, captured once per process.

* the base-weight shard manifest (every ``*.safetensors`` shard hashed, in parallel, streamed -- once per file
  version: an unchanged shard's digest comes from the cache under the Kiln home, ``kiln.host.digest_cache``);
* digests of ``config.json``, ``tokenizer_config.json``, ``tokenizer.json`` (the vocabulary)
  and the chat template text (serving and training templates are the same text here);
* the execution provenance record (``kiln.execution-provenance.v1``) of this Python/PyTorch
  process, self-digested;
* the training precision record read from the live trainer.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.artifacts.base_weights import build_base_weight_manifest
from kiln.artifacts.provenance import seal_execution_provenance
from kiln.documents.digests import file_sha256, json_sha256, prefixed

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PRIVATE", "AUTH", "CREDENTIAL")
REDACTED = "<redacted-present>"
_DTYPE_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclass(frozen=True)
class ModelIdentity:
    path: str
    config_hash: str
    tokenizer_config_hash: str
    tokenizer_vocab_hash: str
    chat_template_hash: str
    training_chat_template_hash: str
    tokenizer_combined_hash: str
    base_weight_shard_manifest: dict[str, Any]
    execution_provenance: dict[str, Any]


def dtype_name(dtype: Any) -> str:
    return _DTYPE_NAMES.get(str(dtype).removeprefix("torch."), str(dtype).removeprefix("torch."))


def training_precision(
    *, parameter_dtype: str = "f32", optimizer_kind: str = "muon", activation_dtype: str | None = None
) -> dict[str, Any]:
    """The training-precision record of the native trainer: fp32 LoRA parameters, gradients and optimizer state
    (``parameter_dtype``), activations in the frozen base's compute dtype (``activation_dtype``: ``bf16`` under
    ``precision: bf16``), no accumulation in a narrower type."""
    return {
        "parameter_dtype": parameter_dtype,
        "optimizer_state_dtype": "none" if optimizer_kind == "sgd" else parameter_dtype,
        "activation_dtype": activation_dtype or parameter_dtype,
        "gradient_dtype": parameter_dtype,
        "stochastic_rounding": {"mode": "round_to_nearest"},
    }


def weights_cache_dir() -> Path:
    """Where shard digests are cached (``kiln.host.digest_cache``): under the configured home."""
    from kiln.host.config import resolve_settings
    from kiln.host.digest_cache import digest_cache_dir

    return digest_cache_dir(resolve_settings().home)


def _file_hash(path: Path) -> str:
    return prefixed(file_sha256(path)[0]) if path.is_file() else prefixed(hashlib.sha256(b"").hexdigest())


def _text_hash(text: str) -> str:
    return prefixed(hashlib.sha256(text.encode("utf-8")).hexdigest())


def environment_digest(environ: dict[str, str] | None = None) -> str:
    """Digest of the sorted ``KILN_*`` variables, secret-looking values redacted."""
    env = os.environ if environ is None else environ
    items = {}
    for name in sorted(k for k in env if k.startswith("KILN_")):
        secret = any(marker in name.upper() for marker in SECRET_MARKERS)
        items[name] = REDACTED if secret else env[name]
    return json_sha256(items)


@cache
def _executable_sha256() -> str:
    return prefixed(file_sha256(Path(os.path.realpath(sys.executable)))[0])


GIT_TIMEOUT_S = 60


@cache
def _source_identity() -> tuple[str, str | None, bool | None]:
    """(source tree digest over the installed kiln and generated packages, git commit, dirty)."""
    import kiln_contracts

    import kiln

    records = []
    for package in (kiln, kiln_contracts):
        root = Path(str(package.__file__)).parent
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".json"):
                records.append([f"{package.__name__}/{path.relative_to(root).as_posix()}", file_sha256(path)[0]])
    tree = json_sha256(records)
    commit, dirty = None, None
    repo = Path(kiln.__file__).resolve().parent.parent
    git = shutil.which("git")
    if git is None:
        return tree, None, None
    # The answer is part of a checkpoint's identity, so it must not depend on load: a generous timeout (several
    # processes -- a job's ranks, a busy machine -- may ask at once), and no index refresh written behind our back
    # (--no-optional-locks), so concurrent askers never contend for the index lock.
    try:
        out = subprocess.run(
            [git, "--no-optional-locks", "-C", str(repo), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
        if out.returncode == 0:
            commit = out.stdout.strip() or None
            status = subprocess.run(
                [git, "--no-optional-locks", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=GIT_TIMEOUT_S,
                check=False,
            )
            dirty = bool(status.stdout.strip()) if status.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        pass
    return tree, commit, dirty


def git_source() -> tuple[str | None, bool | None]:
    _, commit, dirty = _source_identity()
    return commit, dirty


def _versions() -> dict[str, str]:
    import peft
    import pydantic
    import safetensors
    import torch
    import transformers

    return {
        "kiln": __version__,
        "peft": peft.__version__,
        "pydantic": pydantic.VERSION,
        "python": platform.python_version(),
        "safetensors": safetensors.__version__,
        "torch": torch.__version__.split("+")[0],
        "transformers": transformers.__version__,
    }


def _runtime(device: str, threads: int | None = None) -> tuple[dict[str, Any], list[str], str]:
    import torch

    threads = torch.get_num_threads() if threads is None else threads
    capability = torch.backends.cpu.get_cpu_capability()
    features = {f"cpu_capability:{capability.lower()}"}
    if torch.backends.mkldnn.is_available():
        features.add("mkldnn")
    if torch.backends.openmp.is_available():
        features.add("openmp")
    if torch.cuda.is_available():
        features.add("cuda")
    runtime = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "build_config": torch.__config__.show(),
        "cpu_capability": capability,
        "intra_op_threads": threads,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }
    if device == "cpu":
        label = f"cpu ({platform.machine()}, {threads} threads)"
    else:
        # the device model, not its index: a run resumes on another card of the same model (the envelope binds it)
        index = torch.device(device).index or 0
        label = f"cuda ({torch.cuda.get_device_name(index)})" if torch.cuda.is_available() else device
    return runtime, sorted(features), label


def capture_identity(
    path: Path,
    tokenizer: Any,
    *,
    device: str = "cpu",
    inference_dtype: str = "f32",
    training_policy: dict[str, Any] | None = None,
    server_config: dict[str, Any] | None = None,
    intra_op_threads: int | None = None,
) -> ModelIdentity:
    """Capture the model's and the process's identity (hashes every weight shard). ``intra_op_threads``: the thread
    count of the process that will train (a data-parallel rank), when it is not this one's."""
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    config_hash = _file_hash(path / "config.json")
    tokenizer_config_hash = _file_hash(path / "tokenizer_config.json")
    vocab_hash = _file_hash(path / "tokenizer.json")
    template_hash = _text_hash(template)
    combined = json_sha256({"tokenizer_config": tokenizer_config_hash, "chat_template": template_hash})
    shards = build_base_weight_manifest(path, cache_dir=weights_cache_dir())
    runtime, features, device_label = _runtime(device, intra_op_threads)
    versions = _versions()
    tree, commit, dirty = _source_identity()
    build: dict[str, Any] = {
        "package_version": __version__,
        "target": f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}-"
        f"{platform.system().lower()}-{platform.machine()}",
        "executable_sha256": _executable_sha256(),
        "source_tree_sha256": tree,
    }
    if commit:
        build["git_commit"] = commit
    if dirty is not None:
        build["source_dirty"] = dirty
    policy = training_policy or training_precision()
    record = {
        "schema_version": 1,
        "provenance_type": "kiln.execution-provenance.v1",
        "backend": {
            "name": "torch-cuda" if device.startswith("cuda") else "torch-cpu",
            "device": device_label,
            "numerical_runtime_sha256": json_sha256(runtime),
        },
        "build": build,
        "model": {
            "model_config_sha256": config_hash,
            "tokenizer_vocab_sha256": vocab_hash,
            "tokenizer_config_sha256": tokenizer_config_hash,
            "chat_template_sha256": template_hash,
            "training_chat_template_sha256": template_hash,
        },
        "precision": {
            "inference_dtype": inference_dtype,
            "training_policy": ",".join(
                f"{k.removesuffix('_dtype')}={policy[k]}"
                for k in ("parameter_dtype", "optimizer_state_dtype", "activation_dtype", "gradient_dtype")
            )
            + f",rounding={policy['stochastic_rounding']['mode']}",
        },
        "kernels": {
            "contract_type": "kiln.kernel-contract.v1",
            "versions": versions,
            "compiled_features": features,
            "contract_sha256": "",
        },
        "configuration": {
            "effective_server_config_sha256": json_sha256(server_config or {}),
            "effective_environment_sha256": environment_digest(),
        },
        "provenance_sha256": "",
    }
    return ModelIdentity(
        path=str(path),
        config_hash=config_hash,
        tokenizer_config_hash=tokenizer_config_hash,
        tokenizer_vocab_hash=vocab_hash,
        chat_template_hash=template_hash,
        training_chat_template_hash=template_hash,
        tokenizer_combined_hash=combined,
        base_weight_shard_manifest=shards,
        execution_provenance=seal_execution_provenance(record),
    )
