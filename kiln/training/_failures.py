"""The receipt category of a failure raised while training: from its type, never from its message.

A trainer raises one of the ``TrainingFailedError`` classes of ``kiln.errors`` where it detects a failure
(``NonFiniteLossError`` at the step, ``ShapeMismatchError`` in the warm start, ``CancelledError`` at a step
boundary...); the class fixes the receipt's ``failure_reason``. Exceptions from below (torch, the file system) map
by type: ``MemoryError`` and torch's ``OutOfMemoryError`` are ``oom``, ``KeyboardInterrupt`` is ``cancelled``,
anything else is ``training_error`` with its type named in the message.
"""

from __future__ import annotations

import sys

from kiln.errors import TrainingFailedError

__all__ = ["classify_failure"]


def _is_device_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # never imported here: an exception of torch means torch is loaded
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(exc, oom)


def classify_failure(exc: BaseException) -> tuple[str, str]:
    """``(failure_reason, failure_message)`` for any exception raised while training."""
    if isinstance(exc, TrainingFailedError):
        return exc.reason, exc.message
    if isinstance(exc, KeyboardInterrupt):
        return "cancelled", "training was interrupted"
    if isinstance(exc, MemoryError):
        return "oom", f"out of host memory: {exc}"
    if _is_device_oom(exc):
        return "oom", f"out of device memory: {exc}"
    text = str(exc) or type(exc).__name__
    return "training_error", f"{type(exc).__name__}: {text}"
