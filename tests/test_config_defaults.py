"""Every training-config default is written once, in the schema, and the effective-config code applies exactly it.

For ``SftConfig``, ``GrpoConfig`` and ``OpdConfig`` the effective configuration of an empty config equals the
schema's ``default`` of every field that has one (a sub-object with its own members' defaults filled in); the
learning rate follows the ``x-kiln-default-by`` table; every other field of the effective configuration is listed
below with the reason it has no schema default, and every schema default the effective configuration does not
record is listed with the reason. This file reads the bundle itself, independently of ``kiln.training._defaults``.
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

import kiln_contracts
import pytest
from _effective import grpo_effective as effective_grpo_config
from _effective import opd_effective as effective_opd_config
from _effective import optimizer_effective as effective_optimizer
from _effective import sft_effective as effective_config
from kiln_contracts.models import kiln_control_plane_v1_schema as models

from codegen._bundle import SchemaSourceError, load_sources
from kiln.training import grpo_objective as objective

DEFS = kiln_contracts.load_bundle()["$defs"]
CONFIGS = ("SftConfig", "GrpoConfig", "OpdConfig")
CONTEXT_LENGTH = 64  # the student's context length handed to the OPD resolver


def _effective(definition: str, config: dict[str, Any]) -> dict[str, Any]:
    if definition == "SftConfig":
        return effective_config(config, "defaults-bot")
    if definition == "GrpoConfig":
        return effective_grpo_config(config, "defaults-bot")
    # a teacher that allows any executable top-K, so the requested (default) one is used
    return effective_opd_config(config, "defaults-bot", teacher_max_top_k=32, model_max_len=CONTEXT_LENGTH)


WHY_NO_SCHEMA_DEFAULT = {
    "output_name": "the adapter's registry name: the caller passes it (the server picks a fresh one when omitted)",
    "seed": "drawn at admission (a fresh random u64) when omitted, then recorded",
    "learning_rate": "depends on the optimizer kind: x-kiln-default-by, checked below",
    "precision": "the server's training.precision (auto unless configured), resolved against the model at admission",
    "gradient_checkpointing": "the server's training.gradient_checkpointing (auto unless configured), resolved by "
    "the memory planner at admission",
    "quantization": "the server's training.quantization (none unless configured)",
}
NO_SCHEMA_DEFAULT = {
    "SftConfig": WHY_NO_SCHEMA_DEFAULT,
    "GrpoConfig": WHY_NO_SCHEMA_DEFAULT,
    "OpdConfig": {**WHY_NO_SCHEMA_DEFAULT, "max_tokens": "the student model's context length, known at admission"},
}
WHY_NOT_RECORDED = {
    "auto_load": "taken out by the server before admission: it decides activation after the run, not training",
    "detect_anomaly": "refused when true, so it never shapes a run",
    "adapter_smoke_test": "refused when true (not available yet), so it never shapes a run",
}
NOT_RECORDED = {
    "SftConfig": WHY_NOT_RECORDED,
    "GrpoConfig": WHY_NOT_RECORDED,
    "OpdConfig": {k: v for k, v in WHY_NOT_RECORDED.items() if k != "adapter_smoke_test"},
}


def _deref(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = DEFS[schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _non_null(schema: dict[str, Any]) -> dict[str, Any]:
    schema = _deref(schema)
    branches = [_deref(b) for b in schema.get("anyOf", []) if _deref(b).get("type") != "null"]
    return branches[0] if len(branches) == 1 and "properties" not in schema else schema


def _json_type(schema: dict[str, Any]) -> str | None:
    return _non_null(schema).get("type")


def _branch(union: dict[str, Any], value: dict[str, Any]) -> dict[str, Any]:
    """The ``oneOf`` branch whose constant tag ``value`` carries."""
    for branch in map(_deref, union["oneOf"]):
        tags = {name: p["const"] for name, p in branch.get("properties", {}).items() if "const" in p}
        if tags and all(value.get(name) == const for name, const in tags.items()):
            return branch
    raise AssertionError(f"no branch of the union matches {value}")


def _expanded(schema: dict[str, Any], value: Any) -> Any:
    """A default with the defaults of its own object's members filled in (what the effective config records)."""
    if not isinstance(value, dict):
        return value
    target = _non_null(schema)
    if "oneOf" in target:
        target = _branch(target, value)
    members = target.get("properties", {})
    filled = {name: _expanded(p, p["default"]) for name, p in members.items() if "default" in p and name not in value}
    return {**value, **filled}


def _with_default(definition: str) -> dict[str, dict[str, Any]]:
    return {name: p for name, p in DEFS[definition]["properties"].items() if "default" in p}


@pytest.mark.parametrize("definition", CONFIGS)
def test_the_effective_config_of_an_empty_config_is_the_schema_defaults(definition):
    effective = _effective(definition, {})
    properties = DEFS[definition]["properties"]
    with_default = _with_default(definition)
    assert set(effective) <= set(properties), "the effective config records fields that are not request fields"
    assert not set(with_default) & set(NO_SCHEMA_DEFAULT[definition]), "a listed field now has a schema default"
    assert set(effective) - set(with_default) == set(NO_SCHEMA_DEFAULT[definition])
    assert set(with_default) - set(effective) == set(NOT_RECORDED[definition])
    for name, prop in with_default.items():
        if name in effective:
            assert effective[name] == _expanded(prop, prop["default"]), name


@pytest.mark.parametrize("definition", CONFIGS)
def test_defaults_are_recorded_in_the_json_type_of_their_field(definition):
    """``0`` and ``0.0`` differ in canonical JSON: a ``number`` default is recorded as a float, an integer as an int."""
    effective = _effective(definition, {})
    for name, prop in _with_default(definition).items():
        if name in effective and prop["default"] is not None:
            expected = {"number": float, "integer": int}.get(_json_type(prop))
            if expected is not None:
                assert type(effective[name]) is expected, name


@pytest.mark.parametrize("definition", CONFIGS)
def test_the_learning_rate_default_follows_the_optimizer_kind_as_the_schema_says(definition):
    properties = DEFS[definition]["properties"]
    rule = properties["learning_rate"]["x-kiln-default-by"]
    assert rule["pointer"] == "/optimizer/kind"
    kinds = {_deref(b)["properties"]["kind"]["const"] for b in DEFS["Optimizer"]["oneOf"]}
    assert set(rule["defaults"]) == kinds
    for kind, rate in rule["defaults"].items():
        for config in ({"optimizer": {"kind": kind}}, {"optimizer": {"kind": kind}, "learning_rate": None}):
            learning_rate = _effective(definition, config)["learning_rate"]
            assert learning_rate == rate, (kind, config)
            assert type(learning_rate) is float, (kind, config)
    default_kind = properties["optimizer"]["default"]["kind"]
    assert _effective(definition, {})["learning_rate"] == rule["defaults"][default_kind]


def test_each_optimizer_kind_records_every_setting_with_its_schema_default():
    for branch in map(_deref, DEFS["Optimizer"]["oneOf"]):
        kind = branch["properties"]["kind"]["const"]
        settings = {name: p for name, p in branch["properties"].items() if name != "kind"}
        assert all("default" in p for p in settings.values()), f"{kind}: a setting without a default"
        assert effective_optimizer({"kind": kind}) == {"kind": kind, **{n: p["default"] for n, p in settings.items()}}


def test_an_ema_reference_and_an_echo_term_get_the_schema_defaults_of_their_members():
    union = DEFS["GrpoConfig"]["properties"]["kl_reference_policy"]
    ema = effective_grpo_config({"kl_reference_policy": {"kind": "ema"}}, "g")["kl_reference_policy"]
    assert ema == _expanded(union, {"kind": "ema"})
    assert set(ema) == {"kind", "decay", "refresh_every"}
    echo = _expanded(DEFS["GrpoLossConfig"]["properties"]["echo"], {})
    assert set(echo) == set(DEFS["EchoConfig"]["properties"])
    assert effective_grpo_config({"loss": {"echo": {}}}, "g")["loss"]["echo"] == echo
    assert _effective("OpdConfig", {"echo": {}})["echo"] == echo


def test_opd_executes_only_the_default_of_the_fields_it_cannot_vary():
    defaults = {name: p["default"] for name, p in _with_default("OpdConfig").items()}
    for field in ("objective", "loss", "rollout_prompt_rendering", "stable_opd", "discount", "clip_epsilon"):
        assert _effective("OpdConfig", {field: defaults[field]})[field] == defaults[field]


def test_thegrpo_objective_keyword_defaults_are_the_config_defaults():
    grpo = {name: p["default"] for name, p in _with_default("GrpoConfig").items()}
    policy = inspect.signature(objective.policy_loss).parameters
    assert policy["clip_low"].default == grpo["clip_epsilon"]
    assert policy["cispo_max_weight"].default == grpo["cispo_max_weight"]
    for function in (objective.reward_stats, objective.RewardStatsAccumulator.__init__):
        parameters = inspect.signature(function).parameters
        assert parameters["saturation_threshold"].default == grpo["reward_saturation_threshold"]
        assert parameters["low_variance_threshold"].default == grpo["reward_low_variance_threshold"]


def test_the_generated_models_and_the_openapi_document_carry_the_defaults():
    assert models.SftConfig.model_fields["epochs"].default == DEFS["SftConfig"]["properties"]["epochs"]["default"]
    assert models.OpdConfig.model_fields["checkpoint_interval"].default == 25
    components = kiln_contracts.openapi_document()["components"]["schemas"]
    for definition in CONFIGS:
        for name, prop in DEFS[definition]["properties"].items():
            published = components[definition]["properties"][name]
            for keyword in ("default", "x-kiln-default-by"):
                assert published.get(keyword) == prop.get(keyword), (definition, name, keyword)
        assert "x-kiln-default-by" in components[definition]["properties"]["learning_rate"]


_PROSE_DEFAULT = re.compile(r"\b[Dd]efault(s to)?:? (is )?(`|\d|true\b|false\b|null\b)|\(the default\)")


def test_descriptions_do_not_repeat_a_default_the_schema_states():
    def walk(node: Any, where: str) -> list[str]:
        found = []
        if isinstance(node, dict):
            if isinstance(node.get("description"), str) and _PROSE_DEFAULT.search(node["description"]):
                found.append(where)
            for key, value in node.items():
                found += walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                found += walk(value, f"{where}/{index}")
        return found

    names = [*CONFIGS, "GrpoLossConfig", "EchoConfig", "KlReferencePolicy", "StableOpdMode", "Optimizer"]
    names += ["SgdOptimizer", "AdamWOptimizer", "MuonOptimizer"]
    names += ["SftInvalidRowPolicy", "AdvantageMode", "LossAggregation", "KlEstimator", "IsLevel"]
    names += ["BehaviorPolicy", "EnvMaskMode", "OpdTrainingMode", "OpdObjective", "OpdLossGranularity"]
    assert [w for name in names for w in walk(DEFS[name], name)] == []


def _schema_dir(tmp_path, learning_rate: dict[str, Any]):
    schema = {
        "type": "object",
        "properties": {"optimizer": {"type": "object"}, "learning_rate": {"type": "number", **learning_rate}},
    }
    doc = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://schemas.kiln.dev/v1/kiln-test-v1.schema.json",
        "$defs": {"Config": schema},
    }
    (tmp_path / "kiln-test-v1.schema.json").write_text(json.dumps(doc), encoding="utf-8")
    return tmp_path


def test_a_well_formed_default_by_is_accepted(tmp_path):
    rule = {"pointer": "/optimizer/kind", "defaults": {"muon": 0.001}}
    assert load_sources(_schema_dir(tmp_path, {"x-kiln-default-by": rule}))


@pytest.mark.parametrize(
    ("learning_rate", "message"),
    [
        ({"default": 0.1, "x-kiln-default-by": {"pointer": "/optimizer/kind", "defaults": {"a": 1}}}, "not both"),
        ({"x-kiln-default-by": {"pointer": "/optimiser/kind", "defaults": {"a": 1}}}, "sibling property"),
        ({"x-kiln-default-by": {"pointer": "optimizer.kind", "defaults": {"a": 1}}}, "sibling property"),
        ({"x-kiln-default-by": {"pointer": "/optimizer/kind", "defaults": {}}}, "map each value"),
        ({"x-kiln-default-by": {"pointer": "/optimizer/kind"}}, "exactly the members"),
    ],
)
def test_a_malformed_default_by_is_refused_by_codegen(tmp_path, learning_rate, message):
    with pytest.raises(SchemaSourceError, match=message):
        load_sources(_schema_dir(tmp_path, learning_rate))
