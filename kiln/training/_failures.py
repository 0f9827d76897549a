"""Map a training failure to its receipt ``failure_reason`` (spec/10), keeping the message."""

from __future__ import annotations


class TrainingFailedError(Exception):
    """A failure after admission with a known receipt category."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def classify_failure(exc: BaseException) -> tuple[str, str]:
    """``(failure_reason, failure_message)`` for any exception raised while training."""
    if isinstance(exc, TrainingFailedError):
        return exc.reason, exc.message
    if isinstance(exc, KeyboardInterrupt):
        return "cancelled", "training was interrupted"
    if isinstance(exc, MemoryError):
        return "oom", f"out of host memory: {exc}"
    name = type(exc).__name__
    text = str(exc) or name
    if name == "OutOfMemoryError" or "out of memory" in text.lower():
        return "oom", text
    if "size mismatch" in text or ("shape" in text.lower() and isinstance(exc, (RuntimeError, ValueError))):
        return "shape_mismatch", text
    return "training_error", f"{name}: {text}"
