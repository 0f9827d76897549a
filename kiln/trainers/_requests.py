"""The door of every trainer: a training request or config as JSON becomes its generated model here, once.

``parse_request(model, body)`` loads a request body strictly (``kiln.contracts.load``: schema, numbers in their
canonical type, semantic rules, the typed model); a refusal is the loader's ``ContractError`` with the pointer of
each problem. ``json_rows`` gives a request's inline data rows back as JSON: rows are data, judged one by one by the
ingestion's row rules (and a row policy), and their digests are taken over their JSON. ``refuse_gate``: a local run
has no ``post_eval`` gate. ``parse_config(model, config, label)`` does the same for a bare config, refused as
``training_invalid_request`` ("invalid SFT config: ...", pointing inside the config) -- what a caller that holds
only a config (``admit_sft``, the effective-config tests) gets. Below the door everything is typed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from kiln import contracts
from kiln._jsonio import JsonObject
from kiln.errors import ContractError, RequestError

__all__ = ["json_rows", "parse_config", "parse_request", "refuse_gate", "request_json"]

M = TypeVar("M", bound=BaseModel)


def parse_request(model: type[M], body: JsonObject | M) -> M:
    """``body`` as its request model (already one: returned as it is)."""
    if not isinstance(body, dict):
        return body
    loaded = contracts.load(model.__name__, body, document=model.__name__)
    assert isinstance(loaded, model)
    return loaded


def parse_config(model: type[M], config: JsonObject | M | None, label: str) -> M:
    """``config`` (None: empty) as its config model; a refusal names every problem, pointing inside the config."""
    if config is not None and not isinstance(config, dict):
        return config
    try:
        loaded = contracts.load(model.__name__, {} if config is None else config)
    except ContractError as exc:
        detail = "; ".join(f"{p.pointer or '/'}: {p.message}" for p in exc.problems)
        raise RequestError(
            f"invalid {label} config: {detail}", code="training_invalid_request", pointer=exc.problems[0].pointer
        ) from None
    assert isinstance(loaded, model)
    return loaded


def request_json(request: BaseModel) -> JsonObject:
    """A parsed request as JSON again: the members it was sent with, numbers canonical."""
    body: JsonObject = request.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return body


def json_rows(rows: Sequence[BaseModel] | None) -> list[JsonObject] | None:
    """A request's inline rows (None: none sent) as the JSON they were sent as."""
    if rows is None:
        return None
    return [row.model_dump(mode="json", by_alias=True, exclude_unset=True) for row in rows]


def refuse_gate(post_eval: Any) -> None:
    """A ``post_eval`` gate reaching a trainer: the server takes it out before admission; elsewhere it is refused."""
    if post_eval is not None:
        raise RequestError(
            "post_eval: the evaluation gate runs on the server, which owns what is served; a local run has "
            "nothing to promote into",
            code="training_backend_unsupported",
            hint="submit the request to `kiln serve` (drop --local), or evaluate afterwards with `kiln eval run`",
        )
