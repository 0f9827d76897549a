"""Adapters as content-bound file sets (spec/50), locally.

``list_adapters``    the registry as ``GET /v1/adapters`` reports it (no rehashing)
``restore_adapter``  copy an adapter in from its manifest, every hash verified, atomically
``verify_adapter``   the ordered offline checks (and, with a URL, the server checks)
``delete_adapter``   remove an adapter and every ``<name>-checkpoint-*`` directory

``require_adapter_name``  the registry's name rule, raised as ``training_invalid_request``
``read_canary_status``    an adapter's serving-canary file (an untrusted one quarantines)
"""

from __future__ import annotations

from typing import Any

from kiln.adapters._registry import (
    adapter_entry,
    delete_adapter,
    list_adapters,
    read_canary_status,
    require_adapter_name,
)

__all__ = [
    "adapter_entry",
    "delete_adapter",
    "list_adapters",
    "read_canary_status",
    "require_adapter_name",
    "restore_adapter",
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
