"""The same GRPO or OPD request trains the same way in Kiln and in the reference: every default agrees.

The field lists come from the reference's control-plane contract (``GrpoRequest``, ``GrpoConfig``, its ``LossConfig``
and ``EchoConfig``, ``OpdRequest``, ``OpdConfig``); the contract publishes no ``default`` keywords, so the reference's
default of each field is written below with where the reference documents it (the specification's chapters 11, 30,
40 and 50 restate it). A field the reference gives no documented default is listed as such, with nothing to compare.
A field the contract gains makes the first test fail until it is classified here. Differences that remain are in
``DIFFERENCES`` with their reason (``docs/contracts.md`` lists them too), and each must still be a real difference.
"""

from __future__ import annotations

from typing import Any

import pytest
from _effective import check_grpo_request
from _effective import grpo_effective as effective_grpo_config
from _effective import opd_effective as effective_opd_config
from _upstream import needs_upstream, upstream_definition
from kiln_contracts.models import kiln_control_plane_v1_schema as control_plane

from kiln import contracts
from kiln.errors import ContractError

pytestmark = needs_upstream

MODEL_MAX_LEN = 64  # the student's context length handed to the OPD resolver


class Undocumented:
    """The reference documents no default for the field: nothing to compare."""


class Input:
    """A request input (data, teacher, the adapter's name, the seed drawn when omitted): no default to compare."""


class Alias:
    """Another name of a field compared under its canonical name."""


class ModelBound:
    """Bounded by the model's context length."""


class FieldByField:
    """A sub-object whose members are compared one by one under their own definition."""


ECHO = {"lambda": 0.05, "env_mask_mode": "env_only", "warning_filter": True}  # spec/40 "GRPO"
MUON = {"kind": "muon", "momentum": 0.95, "nesterov": True, "ns_iters": 5, "weight_decay": 0.0}  # spec/40 "Shared"

REFERENCE = {
    "GrpoRequest": {
        **dict.fromkeys(("groups", "agentic_groups", "dataset_path", "dataset"), Input),
        "dataset_split": "train",  # the contract: "dataset_split ... defaults to train"
        "config": FieldByField,
        "post_eval": None,  # no gate unless asked
    },
    "GrpoConfig": {
        "learning_rate": 2e-3,  # spec/40: GRPO/OPD muon 2e-3
        "kl_coeff": 0.1,
        "clip_epsilon": 0.2,
        "clip_eps_high": None,  # optional
        "cispo_max_weight": 5.0,  # spec/11 3.3
        "advantage_mode": "dr_grpo",
        "loss_aggregation": "token_level",
        "kl_estimator": "k1",
        "dynamic_sampling": True,
        "is_level": "token",
        "behavior_policy": "no_importance_correction",
        "kl_reference_policy": {"kind": "base_per_step"},  # the frozen base each step
        "reference_policy": Alias,
        "entropy_aware_kl_quantile": None,  # optional
        "reward_saturation_threshold": 0.95,  # all-pass at >= 0.95
        "reward_low_variance_threshold": 1e-12,  # degenerate at <= 1e-12
        "reward_filter_var_min": None,  # the variance filter is optional
        "reward_filter_var_max": None,
        "reward_filter_min_groups": Undocumented,
        "reward_filter_on_empty": Undocumented,
        "lora_rank": 16,
        "lora_alpha": 32.0,
        "base_adapter": None,
        "allow_adapter_shape_conversion": Undocumented,
        "allow_high_lora_scale": False,  # the guardrail holds unless allowed
        "output_name": Input,
        "auto_load": True,  # spec/50
        "checkpoint_interval": None,  # spec/30: no request default; the server's setting applies
        "resume_checkpoint": None,
        "grad_checkpoint_segments": Undocumented,
        "detect_anomaly": Undocumented,
        "seed": Input,
        "optimizer": MUON,
        "adapter_smoke_test": Undocumented,
        "adapter_smoke_prompts": Undocumented,
        "shared_prefix_reference": Undocumented,
        "loss": FieldByField,
    },
    "LossConfig": {"echo": FieldByField, "opd": None, "no_policy_loss": False},
    "EchoConfig": ECHO,
    "OpdRequest": {
        "prompts": Input,
        "dataset_path": Input,
        "teacher": Input,
        "config": FieldByField,
        "post_eval": None,
    },
    "OpdConfig": {  # spec/40 "OPD" and the contract's semantic constraints
        "training_mode": "on_policy",
        "objective": "reverse_kl",
        "loss": "teacher_top_k",
        "top_k": 32,
        "samples_per_prompt": 4,
        "temperature": 1.0,
        "top_p": 0.9,
        "max_tokens": ModelBound,
        "sampler_segments": Undocumented,
        "rollout_prompt_rendering": Undocumented,
        "stable_opd": {"mode": "off"},
        "discount": 0.0,
        "clip_epsilon": 0.0,
        "learning_rate": 2e-3,
        "lora_rank": 16,
        "lora_alpha": 32.0,
        "allow_high_lora_scale": False,
        "base_adapter": None,
        "output_name": Input,
        "auto_load": True,
        "checkpoint_interval": 25,
        "resume_checkpoint": None,
        "grad_checkpoint_segments": Undocumented,
        "detect_anomaly": Undocumented,
        "seed": Input,
        "optimizer": MUON,
        "echo": Undocumented,  # the reference turns ECHO on by default for GRPO only
        "epochs": 1,
        "max_cost_usd": None,
    },
}

# (definition, field): why Kiln differs. docs/contracts.md lists the same.
DIFFERENCES = {
    ("GrpoRequest", "dataset_split"): "Kiln has no dataset registry: its schema accepts `dataset` and `dataset_split` "
    "only as null, so there is no split to default",
}


def _kiln_effective(definition: str) -> dict[str, Any]:
    if definition in ("GrpoConfig", "LossConfig", "EchoConfig"):
        cfg = effective_grpo_config({"seed": 7}, "defaults-bot")
        return {"GrpoConfig": cfg, "LossConfig": cfg["loss"], "EchoConfig": cfg["loss"]["echo"]}[definition]
    if definition == "OpdConfig":
        return effective_opd_config({"seed": 7}, "defaults-bot", teacher_max_top_k=32, model_max_len=MODEL_MAX_LEN)
    return {}


KILN_DEFINITION = {"LossConfig": "GrpoLossConfig"}


def _kiln_default(definition: str, field: str) -> Any:
    """What Kiln uses when a request omits ``field``: the effective config's value, else the schema's default, else
    None (absent: not used)."""
    effective = _kiln_effective(definition)
    if field in effective:
        return effective[field]
    model = getattr(control_plane, KILN_DEFINITION.get(definition, definition))
    declared = model.model_fields.get(field) or next(
        (f for f in model.model_fields.values() if f.alias == field), None
    )  # the generated model holds the schema's defaults
    if declared is None or declared.is_required():
        return None
    value = declared.get_default(call_default_factory=True, validated_data={})
    return value.model_dump(mode="json", by_alias=True) if hasattr(value, "model_dump") else value


def test_every_reference_field_of_a_grpo_or_opd_request_is_classified():
    for definition, table in REFERENCE.items():
        fields = set(upstream_definition(definition)["properties"])
        assert fields == set(table), (definition, sorted(fields ^ set(table)))


@pytest.mark.parametrize("definition", list(REFERENCE))
def test_kiln_uses_the_reference_default_of_every_grpo_and_opd_field(definition):
    compared = 0
    for field, reference in REFERENCE[definition].items():
        if reference in (Undocumented, Input, Alias, FieldByField) or (definition, field) in DIFFERENCES:
            continue
        kiln = _kiln_default(definition, field)
        if reference is ModelBound:
            assert kiln == MODEL_MAX_LEN, field
        else:
            assert kiln == reference, f"{definition}.{field}: Kiln {kiln!r}, reference {reference!r}"
        compared += 1
    assert compared >= {"GrpoRequest": 1, "OpdRequest": 1}.get(definition, 2)


@pytest.mark.parametrize("definition", ["GrpoConfig", "OpdConfig"])
def test_a_config_spelling_out_every_reference_default_is_accepted_and_trains_like_an_empty_one(definition):
    spelled = {
        field: value
        for field, value in REFERENCE[definition].items()
        if value not in (Undocumented, Input, Alias, ModelBound, FieldByField)
        and (definition, field) not in DIFFERENCES
    }
    spelled["seed"] = 7
    if definition == "GrpoConfig":
        spelled["loss"] = {"echo": ECHO, "no_policy_loss": False}
    assert contracts.problems(definition, spelled) == []
    if definition == "GrpoConfig":
        assert effective_grpo_config(spelled, "defaults-bot") == _kiln_effective("GrpoConfig")
    else:
        assert effective_opd_config(
            spelled, "defaults-bot", teacher_max_top_k=32, model_max_len=MODEL_MAX_LEN
        ) == _kiln_effective("OpdConfig")


def test_the_listed_default_differences_are_still_real():
    assert set(DIFFERENCES) <= {(d, f) for d, table in REFERENCE.items() for f in table}
    body = {"dataset": "math", "dataset_split": "train"}
    with pytest.raises(ContractError) as refused:
        check_grpo_request(body)
    assert {(p.code, p.pointer) for p in refused.value.problems} >= {
        ("wrong_type", "/dataset"),
        ("wrong_type", "/dataset_split"),
    }
