"""Effective configurations as JSON, from a config given as JSON: the resolvers of ``kiln.trainers.{sft,grpo,opd}``
behind the door a caller with a bare config goes through (``parse_config``), for tests that compare recorded
configurations."""

from __future__ import annotations

from typing import Any

from kiln_contracts.models.kiln_control_plane_v1_schema import (
    GrpoConfig,
    GrpoRequest,
    OpdConfig,
    OpdRequest,
    Optimizer,
    SftConfig,
)

from kiln.trainers import grpo, opd, sft
from kiln.trainers._requests import parse_config, parse_request, refuse_named_dataset
from kiln.training import resolve_optimizer


def sft_effective(config: dict[str, Any], name: str) -> dict[str, Any]:
    return sft.resolve_config(parse_config(SftConfig, config, "SFT"), name).to_json()


def grpo_effective(config: dict[str, Any], name: str) -> dict[str, Any]:
    return grpo.resolve_config(parse_config(GrpoConfig, config, "GRPO"), name).to_json()


def opd_effective(config: dict[str, Any], name: str, **context: Any) -> dict[str, Any]:
    return opd.resolve_config(parse_config(OpdConfig, config, "OPD"), name, **context).to_json()


def check_grpo_request(body: dict[str, Any]) -> None:
    """The request-level refusals in the order the door gives them (``Trainer.check_door``, then the kind's own)."""
    request = parse_request(GrpoRequest, body)
    refuse_named_dataset(request.model)
    grpo.check_request(request)


def check_opd_request(body: dict[str, Any]) -> str:
    request = parse_request(OpdRequest, body)
    refuse_named_dataset(request.model)
    return opd.check_request(request)


def optimizer_effective(spec: dict[str, Any]) -> dict[str, Any]:
    return resolve_optimizer(Optimizer.model_validate(spec).root).to_json()
