"""Kiln's one exception tree. Every error carries a stable ``code`` from the schema's
``ErrorCode`` enum (``schemas/kiln-control-plane-v1.schema.json``), a message that says
what to do, an optional ``hint`` and, for documents, the JSON pointer of the bad value.

::

    KilnError
    ├── ContractError            a JSON document breaks its schema or semantic rules
    │   ├── DocumentReadError    unreadable, not strict JSON, too large
    │   ├── UnknownDocumentTypeError  no loader for this document
    │   └── IntegrityError       a recomputed digest does not match (fail fast)
    ├── CheckpointError          checkpoint_invalid / _incompatible / _not_resumable / _exists
    ├── RequestError             training_invalid_request, config_invalid, training_backend_unsupported,
    │   │                        unsupported_media_type
    │   └── TrainingDataError    training data refused (a bad group, an empty file); ``reason`` is the receipt
    │                            category a dry run records for it
    ├── NotFoundError            not_found, adapter_not_found, teacher_not_found, eval_suite_not_found
    ├── MethodNotAllowedError    method_not_allowed: a route asked with a method it does not answer
    ├── AdapterError             adapter_invalid
    ├── ConflictError            adapter_active, adapter_exists, adapter_revision_conflict,
    │                            teacher_conflict, teacher_identity_mismatch, job_not_terminal,
    │                            eval_suite_conflict
    ├── CapacityError            queue_full, memory_budget_exceeded, payload_too_large, serving_unavailable
    ├── AuthError                unauthorized
    ├── AccessError              path_not_allowed: a path outside what the server may read
    ├── UpstreamError            teacher_unreachable: a remote teacher did not answer its probe as a teacher does
    ├── RegistryError            registry_unwritable: the adapter registry cannot be written
    ├── ScorerError              scorer_failed: a reward scorer failed, timed out or gave no finite reward
    └── InternalError            internal_error

A run that fails *after* admission does not raise to its caller: it ends with a failed train receipt whose
``failure_reason`` (the schema's ``TrainReceiptFailureReason`` enum) comes from the type of the failure raised
where it was detected, never from message text::

    TrainingFailedError          training_error: anything else that stopped a run (divergence, a changed file)
    ├── DataSchemaError          data_schema_error
    ├── AdapterLoadError         adapter_load_failed
    ├── ZeroGroupsError          zero_groups (carries the filter counts)
    ├── ZeroActionTokensError    zero_action_tokens
    ├── ZeroEnvTokensError       zero_env_tokens
    ├── CancelledError           cancelled: cooperative cancellation at a step boundary
    ├── UnsupportedLossConfigError  unsupported_loss_config
    ├── NonFiniteLossError       nan_loss
    ├── OutOfMemoryError       oom
    ├── ShapeMismatchError       shape_mismatch
    ├── UnsafeLoraScaleError     unsafe_lora_scale
    ├── BaseAdapterMissingError  base_adapter_missing
    └── StorageFailureError      storage_error: the file system refused a write (read-only or permission denied,
                                 no space or quota left, a name too long); the message names the path

Only the CLI and the server turn these into exit codes and HTTP statuses.
"""

from __future__ import annotations

import errno as _errno
import os as _os
from dataclasses import dataclass
from typing import ClassVar

__all__ = [
    "AccessError",
    "AdapterError",
    "AdapterLoadError",
    "AuthError",
    "BaseAdapterMissingError",
    "CancelledError",
    "CapacityError",
    "CheckpointError",
    "ConflictError",
    "ContractError",
    "DataSchemaError",
    "DocumentReadError",
    "IntegrityError",
    "InternalError",
    "KilnError",
    "NonFiniteLossError",
    "NotFoundError",
    "OutOfMemoryError",
    "Problem",
    "RegistryError",
    "RequestError",
    "ScorerError",
    "ShapeMismatchError",
    "StorageFailureError",
    "TrainingDataError",
    "TrainingFailedError",
    "UnknownDocumentTypeError",
    "UnsafeLoraScaleError",
    "UnsupportedLossConfigError",
    "UpstreamError",
    "ZeroActionTokensError",
    "ZeroEnvTokensError",
    "ZeroGroupsError",
    "all_failure_reasons",
    "storage_condition",
]


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a document: stable code, JSON pointer, readable message."""

    code: str
    pointer: str
    message: str

    def as_dict(self) -> dict[str, str]:
        return {"code": self.code, "pointer": self.pointer, "message": self.message}

    def __str__(self) -> str:
        return f"{self.code} at {self.pointer or '/'}: {self.message}"


class KilnError(Exception):
    """Base of every Kiln error. ``codes`` lists the codes a class may carry."""

    codes: ClassVar[tuple[str, ...]] = ()
    default_code: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, hint: str | None = None, pointer: str | None = None):
        code = code or self.default_code
        if code not in self.codes:
            raise ValueError(f"{type(self).__name__} cannot carry code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint
        self.pointer = pointer

    def as_envelope(self) -> dict[str, object]:
        body: dict[str, object] = {"code": self.code, "message": self.message, "hint": self.hint}
        if self.pointer is not None:
            body["pointer"] = self.pointer
        return {"error": body}


SCHEMA_CODES = (
    "unsupported_schema_version",
    "wrong_type_tag",
    "unknown_field",
    "missing_field",
    "null_not_allowed",
    "wrong_type",
    "wrong_const",
    "value_not_allowed",
    "pattern_mismatch",
    "invalid_format",
    "out_of_range",
    "invalid_length",
    "schema_violation",
    "inconsistent_fields",
    "unsafe_path",
)


class ContractError(KilnError):
    """A document breaks its contract. ``problems`` holds every problem found."""

    codes: ClassVar[tuple[str, ...]] = (
        *SCHEMA_CODES,
        "digest_mismatch",
        "document_unreadable",
        "invalid_json",
        "document_too_large",
        "unknown_document_type",
    )
    default_code = "schema_violation"

    def __init__(self, problems: list[Problem], *, document: str | None = None, hint: str | None = None):
        if not problems:
            raise ValueError("ContractError needs at least one problem")
        self.problems = list(problems)
        self.document = document
        first = problems[0]
        where = f"{document}: " if document else ""
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        super().__init__(f"{where}{first}{more}", code=first.code, hint=hint, pointer=first.pointer)


class DocumentReadError(ContractError):
    """The bytes are not a readable strict JSON document (I/O, UTF-8, duplicate keys, NaN, size)."""

    codes = ("document_unreadable", "invalid_json", "document_too_large")
    default_code = "invalid_json"


class UnknownDocumentTypeError(ContractError):
    """No loader is registered for the document (unknown type tag or ``--type``)."""

    codes = ("unknown_document_type",)
    default_code = "unknown_document_type"


class IntegrityError(ContractError):
    """A digest recomputed from the content does not match the recorded one."""

    codes = ("digest_mismatch",)
    default_code = "digest_mismatch"


class CheckpointError(KilnError):
    """A checkpoint cannot be published, loaded or resumed.

    ``reason`` names the exact case (``sentinel_present``, ``checksum_mismatch``,
    ``effective_config.learning_rate`` ...; see ``kiln.checkpoints.REASONS``) and
    ``problems`` lists every finding, so a caller can act on each one.
    """

    codes = ("checkpoint_invalid", "checkpoint_incompatible", "checkpoint_not_resumable", "checkpoint_exists")
    default_code = "checkpoint_invalid"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        reason: str | None = None,
        hint: str | None = None,
        pointer: str | None = None,
        problems: list[Problem] | None = None,
    ):
        super().__init__(message, code=code, hint=hint, pointer=pointer)
        self.reason = reason or self.code
        self.problems = list(problems or [])


class RequestError(KilnError):
    codes = ("training_invalid_request", "config_invalid", "training_backend_unsupported", "unsupported_media_type")
    default_code = "training_invalid_request"


class TrainingDataError(RequestError):
    """Training data refused at admission. ``reason`` is the receipt category a dry run records instead of raising
    (a dry run exists to leave its verdict on disk): ``zero_action_tokens`` for a completion without an action token,
    ``zero_groups`` for a file without a group, ``data_schema_error`` for anything else."""

    reasons: ClassVar[tuple[str, ...]] = ("data_schema_error", "zero_action_tokens", "zero_groups")

    def __init__(self, message: str, *, reason: str = "data_schema_error", **kwargs: str | None):
        if reason not in self.reasons:
            raise ValueError(f"TrainingDataError cannot carry reason {reason!r}")
        super().__init__(message, **kwargs)
        self.reason = reason


class NotFoundError(KilnError):
    codes = ("not_found", "adapter_not_found", "teacher_not_found", "eval_suite_not_found")
    default_code = "not_found"


class MethodNotAllowedError(KilnError):
    """An HTTP route asked with a method it does not answer (the ``Allow`` header lists those it does)."""

    codes = ("method_not_allowed",)
    default_code = "method_not_allowed"


class AdapterError(KilnError):
    """An adapter directory is not a usable adapter (layout, config, tensors)."""

    codes = ("adapter_invalid",)
    default_code = "adapter_invalid"


class ConflictError(KilnError):
    codes = (
        "adapter_active",
        "adapter_exists",
        "adapter_revision_conflict",
        "teacher_conflict",
        "teacher_identity_mismatch",
        "job_not_terminal",
        "eval_suite_conflict",
    )
    default_code = "adapter_active"


class CapacityError(KilnError):
    codes = ("queue_full", "memory_budget_exceeded", "payload_too_large", "serving_unavailable")
    default_code = "queue_full"


class AuthError(KilnError):
    codes = ("unauthorized",)
    default_code = "unauthorized"


class AccessError(KilnError):
    """A request names a path outside what the server may read (its data roots, its adapter registry)."""

    codes = ("path_not_allowed",)
    default_code = "path_not_allowed"


class UpstreamError(KilnError):
    """A remote teacher could not be probed (no answer, an error status, a body that is not a model listing): the
    upstream failed, not the request."""

    codes = ("teacher_unreachable",)
    default_code = "teacher_unreachable"


class RegistryError(KilnError):
    """The adapter registry cannot be written (read-only, permission denied, full): nothing can be published."""

    codes = ("registry_unwritable",)
    default_code = "registry_unwritable"


class ScorerError(KilnError):
    """A reward scorer failed on a completion: it raised, exited non-zero, timed out, answered something that is not
    ``{"reward": <finite number>}`` or did not answer within its retries. The message names the task and the scorer
    and ends with the scorer's stderr tail (an executable's) or its error."""

    codes = ("scorer_failed",)
    default_code = "scorer_failed"


class InternalError(KilnError):
    codes = ("internal_error",)
    default_code = "internal_error"


def all_codes() -> set[str]:
    """Every code some error class can carry (a test pins this to the schema enum)."""
    found: set[str] = set()
    stack: list[type[KilnError]] = [KilnError]
    while stack:
        cls = stack.pop()
        found.update(cls.codes)
        stack.extend(cls.__subclasses__())
    return found


# ----------------------------------------------------------------------------- failures after admission


class TrainingFailedError(Exception):
    """A run stopped after admission; ``reason`` is its receipt's ``failure_reason``, fixed by the class."""

    reason: ClassVar[str] = "training_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class DataSchemaError(TrainingFailedError):
    reason = "data_schema_error"


class AdapterLoadError(TrainingFailedError):
    reason = "adapter_load_failed"


class ZeroGroupsError(TrainingFailedError):
    """Nothing trainable left after the group filters; ``counts`` keeps the filter counts for the receipt."""

    reason = "zero_groups"

    def __init__(self, message: str, counts: dict[str, int] | None = None):
        super().__init__(message)
        self.counts = dict(counts or {})


class ZeroActionTokensError(TrainingFailedError):
    reason = "zero_action_tokens"


class ZeroEnvTokensError(TrainingFailedError):
    """ECHO-only training (``no_policy_loss``) with no observation token among the groups that would train;
    ``counts`` keeps the group-filter counts for the receipt."""

    reason = "zero_env_tokens"

    def __init__(self, message: str, counts: dict[str, int] | None = None):
        super().__init__(message)
        self.counts = dict(counts or {})


class CancelledError(TrainingFailedError):
    reason = "cancelled"


class UnsupportedLossConfigError(TrainingFailedError):
    reason = "unsupported_loss_config"


class NonFiniteLossError(TrainingFailedError):
    reason = "nan_loss"


class OutOfMemoryError(TrainingFailedError):
    reason = "oom"


class ShapeMismatchError(TrainingFailedError):
    reason = "shape_mismatch"


class UnsafeLoraScaleError(TrainingFailedError):
    reason = "unsafe_lora_scale"


class BaseAdapterMissingError(TrainingFailedError):
    reason = "base_adapter_missing"


# the errno values a run reports as ``storage_error``: the file system refused a write Kiln had to make
STORAGE_ERRNOS = frozenset(
    (
        _errno.EROFS,
        _errno.EACCES,
        _errno.EPERM,
        _errno.ENOSPC,
        _errno.EDQUOT,
        _errno.EFBIG,
        _errno.ENAMETOOLONG,
        _errno.EIO,
    )
)


class StorageFailureError(TrainingFailedError):
    """The file system refused what a run had to write; ``path`` is where, ``errno`` the condition."""

    reason = "storage_error"

    def __init__(self, message: str, *, path: str | None = None, errno: int | None = None):
        super().__init__(message)
        self.path = path
        self.errno = errno

    @classmethod
    def from_os_error(cls, exc: OSError, *, doing: str, path: object = None) -> StorageFailureError | None:
        """``exc`` as a storage failure while ``doing`` (e.g. "publishing adapter 'bot'"), naming ``exc.filename``
        or else ``path``; None when its errno is not a storage condition (``STORAGE_ERRNOS``)."""
        if exc.errno not in STORAGE_ERRNOS:
            return None
        where = exc.filename if exc.filename is not None else path
        at = f" at {where}" if where is not None else ""
        return cls(
            f"{doing}: {storage_condition(exc.errno)}{at}", path=None if where is None else str(where), errno=exc.errno
        )


def storage_condition(err: int) -> str:
    """What the file system answered, in words and by name: ``Read-only file system (EROFS)``."""
    return f"{_os.strerror(err)} ({_errno.errorcode.get(err, err)})"


def all_failure_reasons() -> set[str]:
    """Every receipt failure reason some failure class carries (a test pins this to the schema enum)."""
    found: set[str] = set()
    stack: list[type[TrainingFailedError]] = [TrainingFailedError]
    while stack:
        cls = stack.pop()
        found.add(cls.reason)
        stack.extend(cls.__subclasses__())
    return found
