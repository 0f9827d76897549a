"""The door of every trainer: a training request or config as JSON becomes its generated model here, once.

``parse_request(model, body)`` loads a request body strictly (``kiln.contracts.load``: schema, numbers in their
canonical type, semantic rules, the typed model) into a ``Request``: the typed model, and the JSON as sent, from which
the inline data rows are taken -- rows are data, judged one by one by the ingestion's row rules (and a row policy),
and hashed as sent, as the file route hashes the file's bytes (docs/contracts.md, "Numbers"). A refusal is the
loader's ``ContractError`` with the pointer of each problem. ``parse_config(model, config, label)`` does the same
for a bare config, refused as ``training_invalid_request`` ("invalid SFT config: ...", pointing inside the config) --
what a caller that holds only a config (``admit_sft``, the effective-config tests) gets. ``refuse_gate``: a local
run has no ``post_eval`` gate. Below the door everything but the data rows is typed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from kiln import contracts
from kiln.documents.jsonio import JsonObject
from kiln.errors import ContractError, Problem, RequestError

__all__ = ["Request", "parse_config", "parse_request", "refuse_gate"]

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Request(Generic[M]):
    """A training request past the door: its generated model, and the JSON it was sent as (its data rows)."""

    model: M
    sent: JsonObject

    def rows(self, member: str) -> list[JsonObject] | None:
        """The inline data rows under ``member`` as sent (None: none sent)."""
        found = self.sent.get(member)
        return None if found is None else list(found)

    def without_gate(self) -> Request[M]:
        """The request without its ``post_eval`` gate (the server's business, not the trainer's)."""
        return Request(
            self.model.model_copy(update={"post_eval": None}),
            {k: v for k, v in self.sent.items() if k != "post_eval"},
        )


def parse_request(model: type[M], body: JsonObject | Request[M]) -> Request[M]:
    """``body`` as a request of ``model`` (already one: returned as it is)."""
    if isinstance(body, Request):
        return body
    if not isinstance(body, dict):  # a parsed JSON body of another kind (a string is never read as JSON text)
        found = contracts.problems(model.__name__, body)
        raise ContractError(
            found or [Problem("wrong_type", "", "the body must be a JSON object")], document=model.__name__
        )
    loaded = contracts.load(model.__name__, body, document=model.__name__)
    assert isinstance(loaded, model)
    return Request(loaded, body)


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


def refuse_gate(post_eval: Any) -> None:
    """A ``post_eval`` gate reaching a trainer: the server takes it out before admission; elsewhere it is refused."""
    if post_eval is not None:
        raise RequestError(
            "post_eval: the evaluation gate runs on the server, which owns what is served; a local run has "
            "nothing to promote into",
            code="training_backend_unsupported",
            hint="submit the request to `kiln serve` (drop --local), or evaluate afterwards with `kiln eval run`",
        )


def dataset_path_of(request: BaseModel) -> str | None:
    """A request's ``dataset_path`` as text (the generated models hold it as a constrained string model), or None."""
    value = getattr(request, "dataset_path", None)
    return None if value is None else str(getattr(value, "root", value))


def refuse_named_dataset(request: BaseModel) -> None:
    """A named dataset (``dataset``, ``dataset_split``): the schema carries the members for the reference's requests
    and accepts them only as null, since Kiln has no dataset registry; this guards a typed request built without the
    schema."""
    if getattr(request, "dataset", None) is not None or getattr(request, "dataset_split", None) is not None:
        raise RequestError(
            "named datasets (dataset, dataset_split) are not supported: Kiln has no dataset registry",
            code="training_backend_unsupported",
            hint="send the rows inline, or upload a JSONL file (POST /v1/datasets) and send its dataset_path",
        )
