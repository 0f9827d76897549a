"""`kiln adapters verify` offline: a trained adapter passes; each kind of damage stops the checks."""

from __future__ import annotations

import json
import shutil
import socket
import struct

import pytest

from kiln import contracts
from kiln.adapters._verify import verify_adapter
from kiln.artifacts.adapter_bodies import (
    CHECK_ORDER,
    MANIFEST_CHECK,
    OFFLINE_CHECKS,
    SERVER_CHECKS,
    load_adapter_verify_receipt,
    render_adapter_verify_receipt,
)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MANIFEST = "adapter_manifest.json"


@pytest.fixture
def adapter(tmp_path, trained_adapter):
    """A private copy of the trained adapter in a fresh registry, free to tamper with."""
    target = tmp_path / "registry" / "bot"
    shutil.copytree(trained_adapter, target)
    return target


def _verify(path, **kwargs):
    receipt = verify_adapter(str(path), path.parent, **kwargs)
    assert contracts.problems("AdapterVerifyReceipt", receipt) == []
    render_adapter_verify_receipt(receipt)  # the canonical bytes the command prints
    return receipt


def _assert_stopped_at(receipt, failed_check, message_part):
    """Checks ran in order up to ``failed_check``, which failed; nothing after it ran (the ``signature`` check runs
    only for a signed directory or with a key: these adapters are unsigned)."""
    names = [c["name"] for c in receipt["checks"]]
    ran = CHECK_ORDER[: CHECK_ORDER.index(failed_check) + 1]
    assert names == [name for name in ran if name != "signature" or name == failed_check]
    assert [c["pass"] for c in receipt["checks"]] == [True] * (len(names) - 1) + [False]
    assert message_part in receipt["checks"][-1]["message"], receipt["checks"][-1]["message"]
    assert receipt["status"] == "failed"
    assert receipt["logit_delta_summary"] is None


def _tensors(path):
    from safetensors.torch import load_file

    return load_file(path / WEIGHTS)


def _save(path, tensors):
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, path / WEIGHTS, metadata={"format": "pt"})


def _edit_config(path, **changes):
    config = json.loads((path / CONFIG).read_text())
    for key, value in changes.items():
        if value is _DROP:
            del config[key]
        else:
            config[key] = value
    (path / CONFIG).write_text(json.dumps(config))


_DROP = object()


def test_a_trained_adapter_passes_every_offline_check_and_the_manifest_check(adapter):
    receipt = _verify(adapter)
    assert receipt["status"] == "ok"
    assert [c["name"] for c in receipt["checks"]] == [*OFFLINE_CHECKS, MANIFEST_CHECK]
    assert all(c["pass"] for c in receipt["checks"])
    assert receipt["name"] == "bot"
    assert receipt["adapter_path"] == str(adapter)
    assert receipt["adapter_dir"] == str(adapter.parent)
    assert [f["name"] for f in receipt["files"]] == sorted(p.name for p in adapter.iterdir())
    manifest = json.loads((adapter / MANIFEST).read_text())
    by_name = {f["name"]: f for f in receipt["files"]}
    assert by_name[WEIGHTS]["sha256"] == manifest["safetensors_hash"]
    assert by_name[WEIGHTS]["size_bytes"] == (adapter / WEIGHTS).stat().st_size
    config = json.loads((adapter / CONFIG).read_text())
    lora = receipt["lora"]
    assert lora["rank"] == config["r"]
    assert lora["alpha"] == config["lora_alpha"]
    assert lora["alpha_over_rank"] == config["lora_alpha"] / config["r"]
    assert lora["target_modules"] == sorted(config["target_modules"])
    assert lora["base_model_name_or_path"] == config["base_model_name_or_path"]
    summary = receipt["tensor_summary"]
    tensors = _tensors(adapter)
    assert summary["tensor_count"] == lora["tensor_count"] == len(tensors)
    assert summary["pair_count"] == len(tensors) // 2
    assert summary["parameter_count"] == sum(t.numel() for t in tensors.values())
    assert summary["nonzero_tensor_count"] == len(tensors)
    assert summary["max_abs_value"] == pytest.approx(max(float(t.abs().max()) for t in tensors.values()))
    bound = sum(
        float(a.double().norm()) * float(tensors[k.replace("lora_A", "lora_B")].double().norm())
        for k, a in tensors.items()
        if ".lora_A." in k
    )
    assert summary["lora_update_l2_upper_bound"] == pytest.approx(bound)
    assert receipt["logit_delta_summary"] is None
    assert load_adapter_verify_receipt(render_adapter_verify_receipt(receipt)) is not None


def test_a_registry_name_resolves_to_the_same_adapter_as_its_path(adapter):
    by_name = verify_adapter("bot", adapter.parent)
    by_path = verify_adapter(str(adapter), adapter.parent)
    assert by_name["input"] == "bot"
    assert {**by_name, "input": None} == {**by_path, "input": None}


def test_the_registry_defaults_to_the_configured_one(adapter, monkeypatch):
    monkeypatch.setenv("KILN_MODEL_ADAPTER_DIR", str(adapter.parent))
    assert verify_adapter("bot", None)["status"] == "ok"


def test_a_missing_adapter_fails_the_first_check_and_reports_nothing_else(tmp_path):
    receipt = verify_adapter("ghost", tmp_path / "registry")
    assert contracts.problems("AdapterVerifyReceipt", receipt) == []
    _assert_stopped_at(receipt, "directory_exists", "does not exist")
    assert receipt["files"] == []
    assert receipt["lora"] is None
    assert receipt["tensor_summary"] is None


def test_a_name_that_is_not_path_safe_is_never_looked_up_in_the_registry(tmp_path, adapter):
    hidden = adapter.parent / "..bot"
    shutil.copytree(adapter, hidden)
    receipt = verify_adapter("..bot", adapter.parent)
    assert receipt["adapter_path"] != str(hidden)
    _assert_stopped_at(receipt, "directory_exists", "does not exist")


def test_a_missing_config_fails_the_layout_check(adapter):
    (adapter / CONFIG).unlink()
    receipt = _verify(adapter)
    _assert_stopped_at(receipt, "layout", f"missing {CONFIG}")
    assert receipt["lora"] is None
    assert WEIGHTS in [f["name"] for f in receipt["files"]]


def test_a_missing_weights_file_fails_the_layout_check(adapter):
    (adapter / WEIGHTS).unlink()
    _assert_stopped_at(_verify(adapter), "layout", f"missing {WEIGHTS}")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"r": 16, "r": 8}'])
def test_an_unparsable_config_fails_the_config_check(adapter, text):
    (adapter / CONFIG).write_text(text)
    receipt = _verify(adapter)
    _assert_stopped_at(receipt, "config_json", CONFIG)
    assert receipt["lora"] is None


@pytest.mark.parametrize(
    ("changes", "failed_check", "message_part"),
    [
        ({"r": _DROP}, "rank_declared", "r is missing"),
        ({"r": "16"}, "rank_declared", "not a positive integer"),
        ({"r": 0}, "rank_declared", "not a positive integer"),
        ({"r": True}, "rank_declared", "not a positive integer"),
        ({"lora_alpha": _DROP}, "alpha_declared", "lora_alpha is missing"),
        ({"lora_alpha": "32"}, "alpha_declared", "not a finite number"),
        ({"target_modules": _DROP}, "target_modules_declared", "target_modules is missing"),
        ({"target_modules": []}, "target_modules_declared", "not a non-empty list"),
        ({"target_modules": "(unclosed"}, "target_modules_declared", "not a valid regular expression"),
    ],
)
def test_an_undeclared_lora_fact_stops_the_checks_at_its_own_check(adapter, changes, failed_check, message_part):
    _edit_config(adapter, **changes)
    receipt = _verify(adapter)
    _assert_stopped_at(receipt, failed_check, message_part)
    assert receipt["lora"] is not None
    assert receipt["lora"]["tensor_count"] is None
    assert receipt["tensor_summary"] is None


def test_unreadable_weights_fail_the_safetensors_check(adapter):
    data = (adapter / WEIGHTS).read_bytes()
    (adapter / WEIGHTS).write_bytes(data[: len(data) // 2])
    receipt = _verify(adapter)
    _assert_stopped_at(receipt, "safetensors_readable", "not readable")
    assert receipt["lora"]["tensor_count"] is None


def test_a_declared_rank_that_does_not_match_the_tensors_fails_the_consistency_check(adapter):
    rank = json.loads((adapter / CONFIG).read_text())["r"]
    _edit_config(adapter, r=rank // 2, lora_alpha=rank)
    receipt = _verify(adapter)
    _assert_stopped_at(receipt, "tensor_consistency", f"A is [r, in] and r = {rank // 2}")
    assert receipt["checks"][OFFLINE_CHECKS.index("rank_declared")]["message"] == f"r = {rank // 2}"
    assert receipt["lora"]["tensor_count"] == len(_tensors(adapter))
    assert receipt["tensor_summary"] is None


def test_a_missing_b_tensor_fails_the_consistency_check(adapter):
    tensors = _tensors(adapter)
    dropped = sorted(k for k in tensors if ".lora_B." in k)[0]
    del tensors[dropped]
    _save(adapter, tensors)
    receipt = _verify(adapter)
    partner = dropped.replace(".lora_B.", ".lora_A.")
    _assert_stopped_at(receipt, "tensor_consistency", f"{partner} has no matching lora_B")


def test_a_tensor_that_is_not_2d_fails_the_consistency_check(adapter):
    tensors = _tensors(adapter)
    key = sorted(k for k in tensors if ".lora_A." in k)[0]
    tensors[key] = tensors[key].unsqueeze(1)
    _save(adapter, tensors)
    _assert_stopped_at(_verify(adapter), "tensor_consistency", f"{key} has shape")


def test_a_tensor_of_an_undeclared_target_fails_the_consistency_check(adapter):
    _edit_config(adapter, target_modules=["q_proj", "v_proj"])
    _assert_stopped_at(_verify(adapter), "tensor_consistency", "not a declared target module")


def test_a_key_that_is_not_a_lora_tensor_fails_the_consistency_check(adapter):
    import torch

    tensors = _tensors(adapter)
    tensors["base_model.model.lm_head.weight"] = torch.ones(2, 2)
    _save(adapter, tensors)
    _assert_stopped_at(_verify(adapter), "tensor_consistency", "is not a LoRA A or B tensor")


def test_non_finite_values_fail_the_consistency_check(adapter):
    tensors = _tensors(adapter)
    key = sorted(tensors)[0]
    tensors[key][0, 0] = float("nan")
    _save(adapter, tensors)
    _assert_stopped_at(_verify(adapter), "tensor_consistency", "NaN or infinite")


def test_an_all_zero_adapter_is_not_measurable(adapter):
    _save(adapter, {k: v.zero_() for k, v in _tensors(adapter).items()})
    receipt = _verify(adapter)
    _assert_stopped_at(receipt, "measurable", "tensors are zero")
    assert receipt["tensor_summary"]["nonzero_tensor_count"] == 0
    assert receipt["tensor_summary"]["lora_update_l2_upper_bound"] == 0


def test_an_untrained_adapter_with_zero_b_is_not_measurable_although_a_is_non_zero(adapter):
    tensors = _tensors(adapter)
    _save(adapter, {k: v.zero_() if ".lora_B." in k else v for k, v in tensors.items()})
    receipt = _verify(adapter)
    _assert_stopped_at(receipt, "measurable", "cannot change the model")
    assert receipt["tensor_summary"]["nonzero_tensor_count"] == len(tensors) // 2
    assert receipt["tensor_summary"]["lora_update_l2_upper_bound"] == 0


def test_one_changed_byte_of_the_weights_fails_the_manifest_check(adapter):
    data = bytearray((adapter / WEIGHTS).read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    data[8 + header_len] ^= 0x01  # the lowest mantissa bit of the first value: still a valid, finite tensor
    (adapter / WEIGHTS).write_bytes(bytes(data))
    receipt = _verify(adapter)
    _assert_stopped_at(receipt, MANIFEST_CHECK, f"but {WEIGHTS} hashes to")
    assert receipt["tensor_summary"] is not None


def test_an_edited_config_fails_the_manifest_check(adapter):
    _edit_config(adapter, inference_mode=False)
    _assert_stopped_at(_verify(adapter), MANIFEST_CHECK, "config_hash is sha256:")


def test_an_invalid_manifest_fails_the_manifest_check_with_its_problem(adapter):
    manifest = json.loads((adapter / MANIFEST).read_text())
    del manifest["safetensors_hash"]
    (adapter / MANIFEST).write_text(json.dumps(manifest))
    _assert_stopped_at(_verify(adapter), MANIFEST_CHECK, "safetensors_hash")


def test_an_unparsable_manifest_fails_the_manifest_check(adapter):
    (adapter / MANIFEST).write_text("{")
    _assert_stopped_at(_verify(adapter), MANIFEST_CHECK, f"{MANIFEST} is unreadable")


def test_without_a_manifest_the_offline_checks_decide(adapter):
    (adapter / MANIFEST).unlink()
    receipt = _verify(adapter)
    assert receipt["status"] == "ok"
    assert [c["name"] for c in receipt["checks"]] == list(OFFLINE_CHECKS)


def test_offline_verification_never_opens_a_socket(adapter, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("offline verify opened a socket")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    assert _verify(adapter)["status"] == "ok"


def test_with_a_url_an_unreachable_server_fails_the_first_server_check(adapter):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    receipt = _verify(adapter, url=f"http://127.0.0.1:{port}", prompt="Hello")
    _assert_stopped_at(receipt, SERVER_CHECKS[0], "cannot reach the Kiln server at")
    assert receipt["checks"][-2]["name"] == MANIFEST_CHECK


def test_with_a_url_an_offline_failure_still_stops_before_the_server_checks(adapter):
    (adapter / CONFIG).unlink()
    _assert_stopped_at(_verify(adapter, url="http://127.0.0.1:8420"), "layout", "missing")
