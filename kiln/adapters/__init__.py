"""Adapters as content-bound file sets (spec/50), locally.

The adapter directory (``_directory``): its file names (``CONFIG_FILE``, ``WEIGHTS_FILE``, ``RECEIPT_FILE``,
``MANIFEST_FILE``, ``CANARY_FILE``, ``SERVING_FILES``; ``BINDINGS``: the files a manifest binds, by role and digest
field), finding and reading an adapter
(``adapter_directory`` -> ``AdapterDirectory.read`` -> ``AdapterFiles``; ``parse_lora_config`` -> ``LoraConfig``;
``content_revision``; ``read_canary_status``), and every change to the registry:

``staged_adapter``            a directory appears at an adapter's name complete, or not at all
``holds_attempt_record_only`` whether a name holds only an earlier attempt's receipt (which a publication supersedes)
``demote``                    take an adapter out of service under ``<name>.failed``, crash-safely
``delete_adapter``            remove an adapter and every ``<name>-checkpoint-*`` directory
``require_adapter_name``      the registry's name rule, raised as ``training_invalid_request``
``base_adapter_dir``          where a warm start's base adapter is

Commands over it:

``list_adapters``    the registry as ``GET /v1/adapters`` reports it (no rehashing; ``adapter_entry`` per directory)
``restore_adapter``  copy an adapter in from its manifest, every hash verified, atomically
``verify_adapter``   the ordered offline checks (and, with a URL, the server checks)
"""

from __future__ import annotations

from typing import Any

from kiln.adapters._directory import (
    BINDINGS,
    CANARY_FILE,
    CONFIG_FILE,
    MANIFEST_FILE,
    RECEIPT_FILE,
    SERVING_FILES,
    WEIGHTS_FILE,
    AdapterDirectory,
    AdapterFiles,
    Binding,
    LoraConfig,
    LoraConfigProblem,
    adapter_directory,
    base_adapter_dir,
    content_revision,
    delete_adapter,
    demote,
    holds_attempt_record_only,
    parse_lora_config,
    read_canary_status,
    require_adapter_name,
    staged_adapter,
)
from kiln.adapters._registry import adapter_entry, attempt_record, list_adapters

__all__ = [
    "BINDINGS",
    "CANARY_FILE",
    "CONFIG_FILE",
    "MANIFEST_FILE",
    "RECEIPT_FILE",
    "SERVING_FILES",
    "WEIGHTS_FILE",
    "AdapterDirectory",
    "AdapterFiles",
    "Binding",
    "LoraConfig",
    "LoraConfigProblem",
    "adapter_directory",
    "adapter_entry",
    "attempt_record",
    "base_adapter_dir",
    "content_revision",
    "delete_adapter",
    "demote",
    "holds_attempt_record_only",
    "list_adapters",
    "parse_lora_config",
    "read_canary_status",
    "require_adapter_name",
    "restore_adapter",
    "staged_adapter",
    "verify_adapter",
]


def __getattr__(name: str) -> Any:  # restore and verify load on first use
    if name == "restore_adapter":
        from kiln.adapters._restore import restore_adapter

        return restore_adapter
    if name == "verify_adapter":
        from kiln.adapters._verify import verify_adapter

        return verify_adapter
    raise AttributeError(name)
