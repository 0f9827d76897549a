"""One name rule for every registry: ``kiln.host.fs.name_problem`` by kind, and the callers that apply it.

Each ``..._was_accepted_by_...`` test is a name one of the old checkers let through while another refused it.
"""

from __future__ import annotations

import os

import pytest

from kiln.adapters import delete_adapter, read_canary_status, require_adapter_name, verify_adapter
from kiln.adapters.publish import check_target
from kiln.artifacts import adapter_manifest
from kiln.artifacts import checkpoint_manifest as cm
from kiln.checkpoints import checkpoint_name
from kiln.errors import ConflictError, ContractError, RequestError
from kiln.host import fs
from kiln.host.fs import NAME_KINDS, name_problem, staging_dir

BOUNDS = {"adapter": 193, "checkpoint": 234, "teacher": 250, "suite": 250, "file": 255}

UNSAFE = [
    pytest.param("", id="empty"),
    pytest.param(".", id="dot"),
    pytest.param("..", id="dotdot"),
    pytest.param("x..y", id="inner-dotdot"),
    pytest.param(".hidden", id="hidden"),
    pytest.param("a/b", id="slash"),
    pytest.param("a\\b", id="backslash"),
    pytest.param("nul\x00byte", id="nul"),
    pytest.param("tab\tname", id="control"),
    pytest.param("del\x7f", id="del"),
    pytest.param("bad\udcffbyte", id="not-utf8"),
]


# --- the rule --------------------------------------------------------------------------------


def test_every_kind_has_its_documented_byte_bound():
    assert {kind: fs.name_max_bytes(kind) for kind in NAME_KINDS} == BOUNDS


@pytest.mark.parametrize("kind", sorted(BOUNDS))
@pytest.mark.parametrize("name", UNSAFE)
def test_a_name_that_is_not_exactly_one_plain_directory_entry_is_refused_for_every_kind(kind, name):
    assert name_problem(name, kind=kind)


@pytest.mark.parametrize("kind", sorted(BOUNDS))
@pytest.mark.parametrize("name", ["bot", "support-bot_v2.1", "ünïcode", "a.b", "x."])
def test_ordinary_names_pass_for_every_kind(kind, name):
    assert name_problem(name, kind=kind) is None


@pytest.mark.parametrize("kind", sorted(BOUNDS))
def test_the_bound_counts_utf8_bytes_not_characters(kind):
    limit = BOUNDS[kind]
    assert name_problem("n" * limit, kind=kind) is None
    why = name_problem("n" * (limit + 1), kind=kind)
    assert f"{limit + 1} bytes" in why
    assert f"at most {limit}" in why
    assert name_problem("é" * (limit // 2), kind=kind) is None
    assert name_problem("é" * (limit // 2 + 1), kind=kind)  # fewer characters than the bound, more bytes


@pytest.mark.parametrize("name", [None, 7, b"bot"])
def test_a_name_that_is_not_a_string_is_refused(name):
    assert name_problem(name, kind="adapter") == "it must be a non-empty string"


def test_an_unknown_kind_is_a_programming_error():
    with pytest.raises(ValueError, match="kind"):
        name_problem("bot", kind="model")


def test_the_longest_adapter_name_fits_every_entry_the_registry_derives_from_it(tmp_path):
    adapter = "a" * BOUNDS["adapter"]
    checkpoint = checkpoint_name(adapter, 12345678)
    assert name_problem(checkpoint, kind="checkpoint") is None
    for name in (adapter, checkpoint):
        for purpose in ("incomplete", "restore", "replaced"):
            staged = staging_dir(tmp_path, name, purpose)  # an over-long name fails here with ENAMETOOLONG
            assert staged.name.startswith(f".{name}.{purpose}-")
            assert len(os.fsencode(staged.name)) <= 255
    assert name_problem(checkpoint_name("a" * (BOUNDS["adapter"] + 1), 0), kind="checkpoint")


def test_the_checkpoint_suffix_the_rule_counts_is_the_one_checkpoints_are_named_with():
    assert len(checkpoint_name("", 0)) == fs.CHECKPOINT_NAME_EXTRA


def test_staging_directories_never_take_a_purpose_longer_than_the_rule_counts(tmp_path):
    with pytest.raises(ValueError, match="purpose"):
        staging_dir(tmp_path, "bot", "much-too-long-purpose")


def test_a_staging_or_temp_name_for_an_arbitrary_long_target_is_shortened_to_fit(tmp_path):
    long = "é" * 127  # 254 bytes: a valid file name, too long to carry a staging suffix
    staged = staging_dir(tmp_path, long)
    assert len(os.fsencode(staged.name)) <= 255
    fs.atomic_write_bytes(tmp_path / long, b"{}")
    assert (tmp_path / long).read_bytes() == b"{}"


# --- adapter names: publication, deletion, restore, verify, the server's lookups ---------------


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("tab\tname", id="control-was-accepted-by-check_target"),
        pytest.param("nul\x00byte", id="nul-was-accepted-by-check_target"),
        pytest.param("n" * 194, id="194-bytes-was-accepted-by-check_target"),
        pytest.param("é" * 100, id="200-bytes-in-100-characters-was-accepted-by-restore"),
        pytest.param("bad\udcffbyte", id="not-utf8-was-accepted-by-every-checker"),
    ],
)
def test_an_adapter_name_an_old_checker_accepted_is_refused_at_admission_deletion_and_lookup(tmp_path, name):
    with pytest.raises(RequestError) as caught:
        check_target(tmp_path / "adapters", name)
    assert caught.value.code == "training_invalid_request"
    assert "is refused by the registry name rule: it " in caught.value.message
    assert caught.value.message.endswith(name_problem(name, kind="adapter"))
    with pytest.raises(RequestError) as caught:
        delete_adapter(tmp_path / "adapters", name)
    assert caught.value.code == "training_invalid_request"
    with pytest.raises(RequestError):
        require_adapter_name(name)
    assert not (tmp_path / "adapters").exists()


def test_require_adapter_name_returns_a_good_name():
    assert require_adapter_name("support-bot") == "support-bot"


def test_an_existing_adapter_is_still_refused_after_the_name_rule(tmp_path):
    (tmp_path / "bot").mkdir()
    (tmp_path / "bot" / "adapter_model.safetensors").write_bytes(b"x")
    with pytest.raises(ConflictError) as caught:
        check_target(tmp_path, "bot")
    assert caught.value.code == "adapter_exists"


def test_verify_looks_up_only_a_name_the_rule_accepts_in_the_registry(tmp_path, monkeypatch):
    registry = tmp_path / "registry"
    too_long = "x" * 200  # a file name, but no adapter name: its checkpoints could not be staged
    (registry / too_long).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    receipt = verify_adapter(too_long, registry)
    assert receipt["adapter_path"] == str(tmp_path / too_long)  # taken as a path, not looked up
    assert receipt["checks"][0] == {
        "name": "directory_exists",
        "pass": False,
        "message": f"{tmp_path / too_long} does not exist",
    }


def test_the_canary_reader_has_a_public_name(tmp_path):
    path = tmp_path / "adapter_canary_status.json"
    path.write_text("{}", encoding="utf-8")
    assert read_canary_status(path)["status"] == "quarantined"


def test_the_adapters_package_exports_its_public_names():
    import kiln.adapters
    import kiln.adapters.publish

    assert sorted(kiln.adapters.__all__) == [
        "AdapterDirectory", "AdapterFiles", "BINDINGS", "Binding", "CANARY_FILE", "CONFIG_FILE", "LoraConfig",
        "LoraConfigProblem",
        "MANIFEST_FILE", "RECEIPT_FILE", "SERVING_FILES", "WEIGHTS_FILE", "adapter_directory", "adapter_entry",
        "attempt_record", "base_adapter_dir", "content_revision", "delete_adapter", "demote", "holds_attempt_record_only",
        "list_adapters", "parse_lora_config", "read_canary_status", "require_adapter_name", "restore_adapter",
        "staged_adapter", "verify_adapter",
    ]  # fmt: skip
    assert sorted(kiln.adapters.publish.__all__) == [
        "PublishedAdapter", "adapter_file_receipt", "bind_adapter_manifest", "check_target", "publish_receipt",
        "publish_trained_adapter",
    ]  # fmt: skip
    assert not hasattr(
        kiln.adapters.publish, "write_adapter_manifest"
    )  # the name of kiln.artifacts.adapter_manifest's writer


# --- teacher aliases (suite names: tests/test_evals.py) ------------------------------------------------------------


def test_a_teacher_adapter_name_the_alias_rule_accepted_is_refused_by_the_adapter_rule(tmp_path, tiny_model_dir):
    from kiln.teachers import TeacherRegistry, teachers_root

    adapters = tmp_path / "adapters"
    name = "a" * 200  # 205 bytes as <name>.json: the alias rule let it through
    (adapters / name).mkdir(parents=True)
    registry = TeacherRegistry(teachers_root(tmp_path / "home"), adapter_registry=adapters)
    request = {"alias": "tutor", "kind": "local", "model_id": str(tiny_model_dir), "adapter": name}
    with pytest.raises(ContractError) as caught:  # the AdapterName schema states the rule's 193-character bound
        registry.add(request)
    assert caught.value.problems[0].code == "invalid_length"
    assert caught.value.problems[0].pointer == "/adapter"
    assert not registry.root.exists()


# --- file names inside artifacts ---------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(".hidden-config.json", id="hidden-was-accepted-by-the-manifest-rule"),
        pytest.param(".train_receipt.json.x1y2z3.tmp", id="a-writers-temp-file"),
        pytest.param("tab\tname.json", id="control-was-accepted-by-the-manifest-rule"),
        pytest.param("w" * 256, id="256-bytes-was-accepted-by-the-manifest-rule"),
    ],
)
def test_a_manifest_file_name_the_registry_rule_refused_is_now_refused_by_the_manifest_rule(name):
    assert adapter_manifest.unsafe_file_name(name)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        pytest.param(".hidden", "'.hidden' component", id="hidden-was-accepted"),
        pytest.param("rng/.state", "'.state' component", id="hidden-nested-was-accepted"),
        pytest.param("a" * 256, "component", id="256-byte-component-was-accepted"),
    ],
)
def test_a_checkpoint_path_component_the_registry_rule_refused_is_now_refused(path, why):
    assert why in cm.relative_path_problem(path)
