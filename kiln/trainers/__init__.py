"""The trainers, picked from a closed registry keyed by the schema's ``TrainingJobType``.

Every caller -- the server's admission and worker, the CLI's ``--local`` runs -- goes through ``TRAINERS``:
``TRAINERS[kind].admit(request, adapter_name=..., context=TrainingContext(...))`` parses the request at the door
(JSON becomes the kind's generated request model, once), checks what it may read, and returns an admitted job (an
``AdmittedJob``: typed effective config, step counts, fingerprint, resumed history, memory estimate);
``TRAINERS[kind].run(job, ...)`` trains it and returns a ``TrainResult``. Each trainer is one file read top to bottom
(``sft.py``, ``grpo.py``, ``opd.py``); what they share are the kit's components (``_kit.py``, ``_admission.py``,
``_requests.py``, ``_resume.py``, ``_sources.py``, ``_checkpointing.py``, ``_receipts.py``, ``_lineage.py``,
``_forwards.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln_contracts.models.kiln_control_plane_v1_schema import (
    GrpoConfig,
    GrpoRequest,
    OpdConfig,
    OpdRequest,
    SftConfig,
    SftRequest,
)
from pydantic import BaseModel

from kiln.documents.jsonio import JsonObject
from kiln.errors import ContractError
from kiln.trainers import grpo, opd, sft
from kiln.trainers._admission import AdmittedJob, TrainingContext, single_process
from kiln.trainers._kit import FinalState, RunTexts, TrainResult
from kiln.trainers._requests import Request, dataset_path_of, parse_request, refuse_named_dataset
from kiln.trainers._sources import check_sources
from kiln.training import EffectiveConfig

__all__ = [
    "TRAINERS",
    "AdmittedJob",
    "FinalState",
    "Request",
    "TrainResult",
    "Trainer",
    "TrainingContext",
    "TrainingRequest",
    "check_sources",
]

TrainingRequest = Request[SftRequest] | Request[GrpoRequest] | Request[OpdRequest]
Admitted = AdmittedJob[EffectiveConfig]


@dataclass(frozen=True)
class Trainer:
    """One training kind: its request model, its admission and its run."""

    kind: str  # a TrainingJobType value
    request_model: type[BaseModel]  # the generated model of its HTTP request body
    config_model: type[SftConfig] | type[GrpoConfig] | type[OpdConfig]  # the generated model of its config
    admit_request: Callable[..., Admitted]  # (typed request, *, adapter_name, context) -> admitted job
    run: Callable[..., TrainResult]  # (job, *, progress=None, cancel=None, on_checkpoint=None) -> result
    texts: RunTexts  # how the command line describes its runs
    data_parallel: bool = False  # whether it trains over several ranks (kiln.training.DataParallel)

    @property
    def request_type(self) -> str:
        """The schema definition of its request body."""
        return self.request_model.__name__

    def parse(self, body: JsonObject | Request[Any]) -> Request[Any]:
        """The request past the door: its generated model and what was sent (``kiln.trainers._requests``)."""
        return parse_request(self.request_model, body)

    def config_of(self, request: Request[Any]) -> SftConfig | GrpoConfig | OpdConfig:
        """The request's config model (an absent config is the empty one: every schema default)."""
        config: SftConfig | GrpoConfig | OpdConfig = request.model.config or self.config_model()
        return config

    def check_door(self, parsed: Request[Any], context: TrainingContext) -> None:
        """What ``request`` may read, checked before anything opens a file it names: no named dataset (Kiln has no
        dataset registry), a ``dataset_path`` inside the caller's data roots, a ``base_adapter`` of its registry
        (``kiln.trainers._sources``)."""
        request = parsed.model
        refuse_named_dataset(request)
        config = request.config
        base = None if config is None or config.base_adapter is None else config.base_adapter.root
        online = getattr(request, "online", None)
        try:
            check_sources(
                context,
                dataset_path=dataset_path_of(request),
                base_adapter=base,
                tasks_path=None
                if online is None or online.tasks_path is None
                else str(getattr(online.tasks_path, "root", online.tasks_path)),
                scorer=None if online is None else str(getattr(online.scorer, "root", online.scorer)),
            )
        except ContractError as exc:
            raise ContractError(exc.problems, document=self.request_type) from None

    def admit(self, request: JsonObject | Request[Any], *, adapter_name: str, context: TrainingContext) -> Admitted:
        """Admit ``request`` (JSON or already parsed): a world size the kind can train at, the door, what it may read,
        then the kind's own rules; raises ``KilnError``."""
        if not self.data_parallel:
            single_process(context, self.kind.upper())
        typed = self.parse(request)
        self.check_door(typed, context)
        return self.admit_request(typed, adapter_name=adapter_name, context=context)


TRAINERS: dict[str, Trainer] = {
    "sft": Trainer("sft", SftRequest, SftConfig, sft.admit_request, sft.run_sft, sft.TEXTS, data_parallel=True),
    "grpo": Trainer("grpo", GrpoRequest, GrpoConfig, grpo.admit_request, grpo.run_grpo, grpo.TEXTS, data_parallel=True),
    "opd": Trainer("opd", OpdRequest, OpdConfig, opd.admit_request, opd.run_opd, opd.TEXTS, data_parallel=True),
}
