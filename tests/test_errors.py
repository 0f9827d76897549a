"""The exception tree and the schema's closed ErrorCode enum stay one set."""

from __future__ import annotations

import kiln_contracts
import pytest
from kiln_contracts.models import kiln_control_plane_v1_schema as cp

from kiln import errors

ERROR_CODE = kiln_contracts.load_bundle()["$defs"]["ErrorCode"]


def test_exception_codes_equal_the_schema_enum():
    assert errors.all_codes() == set(ERROR_CODE["enum"])
    assert {m.value for m in cp.ErrorCode} == set(ERROR_CODE["enum"])


def test_every_code_has_an_http_status_and_a_description():
    statuses = ERROR_CODE["x-kiln-http-status"]
    descriptions = ERROR_CODE["x-kiln-enum-descriptions"]
    for code in ERROR_CODE["enum"]:
        assert statuses[code] in {400, 401, 403, 404, 405, 409, 413, 415, 500, 502, 503}, code
        assert descriptions[code].strip(), code


def test_conflict_codes_map_to_409_and_not_found_codes_to_404():
    statuses = ERROR_CODE["x-kiln-http-status"]
    for code in errors.ConflictError.codes:
        assert statuses[code] == 409, code
    for code in errors.NotFoundError.codes:
        assert statuses[code] == 404, code
    assert statuses["queue_full"] == 503


def test_each_code_belongs_to_exactly_one_leaf_family():
    owners: dict[str, list[str]] = {}
    for cls in (
        errors.DocumentReadError,
        errors.UnknownDocumentTypeError,
        errors.IntegrityError,
        errors.CheckpointError,
        errors.RequestError,
        errors.NotFoundError,
        errors.AdapterError,
        errors.ConflictError,
        errors.CapacityError,
        errors.AuthError,
        errors.InternalError,
    ):
        for code in cls.codes:
            owners.setdefault(code, []).append(cls.__name__)
    assert all(len(v) == 1 for v in owners.values()), owners


def test_an_error_refuses_a_code_outside_its_family():
    with pytest.raises(ValueError):
        errors.NotFoundError("x", code="queue_full")


def test_contract_error_reports_the_first_problem_and_counts_the_rest():
    exc = errors.ContractError(
        [
            errors.Problem("missing_field", "/a", "required field 'a' is absent"),
            errors.Problem("wrong_type", "/b", "bad"),
        ],
        document="doc.json",
    )
    assert exc.code == "missing_field"
    assert exc.pointer == "/a"
    assert "doc.json" in str(exc)
    assert "and 1 more" in str(exc)
    envelope = exc.as_envelope()
    assert envelope["error"]["code"] == "missing_field"
    assert envelope["error"]["pointer"] == "/a"


def test_error_envelope_validates_against_the_schema():
    from kiln import contracts

    exc = errors.ConflictError(
        "adapter 'x' is active; unload it first", code="adapter_active", hint="kiln adapters unload x"
    )
    assert contracts.problems("ErrorEnvelope", exc.as_envelope()) == []


def test_failure_classes_carry_exactly_the_receipt_failure_reasons():
    reasons = kiln_contracts.load_bundle()["$defs"]["TrainReceiptFailureReason"]["enum"]
    assert errors.all_failure_reasons() == set(reasons)
    leaves = list(errors.TrainingFailedError.__subclasses__())
    assert len({c.reason for c in leaves}) == len(leaves)  # one class per reason


def test_a_failure_is_classified_by_its_type_never_by_its_message():
    from kiln.training import classify_failure

    assert classify_failure(errors.NonFiniteLossError("x")) == ("nan_loss", "x")
    assert classify_failure(errors.ZeroGroupsError("none left", {"dynamic": 1})) == ("zero_groups", "none left")
    assert classify_failure(KeyboardInterrupt()) == ("cancelled", "training was interrupted")
    assert classify_failure(MemoryError("no room"))[0] == "oom"
    # text that used to be matched no longer decides the category
    assert classify_failure(RuntimeError("CUDA out of memory"))[0] == "training_error"
    assert classify_failure(RuntimeError("size mismatch for weight"))[0] == "training_error"
    assert classify_failure(ValueError("bad shape"))[0] == "training_error"


def test_torch_out_of_memory_is_an_oom_failure():
    import torch

    from kiln.training import classify_failure

    assert classify_failure(torch.OutOfMemoryError("no memory on the device"))[0] == "oom"
