"""The trainers, picked from a closed registry keyed by the schema's ``TrainingJobType``.

Every caller -- the server's admission and worker, the CLI's ``--local`` runs -- goes through ``TRAINERS``:
``TRAINERS[kind].admit(request, adapter_name=..., context=TrainingContext(...))`` returns an admitted job (an
``AdmittedJob``: step counts, fingerprint, resumed history, memory estimate), and ``TRAINERS[kind].run(job, ...)``
trains it and returns a ``TrainResult``. Each trainer is one file read top to bottom (``sft.py``, ``grpo.py``,
``opd.py``); what they share is in the kit (``_kit.py``, ``_admission.py``, ``_resume.py``, ``_checkpointing.py``,
``_receipts.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.trainers import grpo, opd, sft
from kiln.trainers._admission import AdmittedJob, TrainingContext
from kiln.trainers._kit import FinalState, TrainResult
from kiln.trainers._sources import check_sources

__all__ = ["TRAINERS", "AdmittedJob", "FinalState", "TrainResult", "Trainer", "TrainingContext", "check_sources"]


@dataclass(frozen=True)
class Trainer:
    """One training kind: its request definition, its admission and its run."""

    kind: str  # a TrainingJobType value
    request_type: str  # the schema definition of its HTTP request body
    admit_kind: Callable[..., AdmittedJob]  # the kind's own admission, after ``check_sources``
    run: Callable[..., TrainResult]  # (job, *, progress=None, cancel=None, on_checkpoint=None) -> result
    data_parallel: bool = False  # whether it trains over several ranks (kiln.training.DataParallel)

    def admit(self, request: dict[str, Any], *, adapter_name: str, context: TrainingContext) -> AdmittedJob:
        """Admit ``request``: what it may read (``kiln.trainers._sources``), then the kind's own rules; raises
        ``KilnError``."""
        check_sources(request, context)
        return self.admit_kind(request, adapter_name=adapter_name, context=context)


TRAINERS: dict[str, Trainer] = {
    "sft": Trainer("sft", "SftRequest", sft.admit_request, sft.run_sft, data_parallel=True),
    "grpo": Trainer("grpo", "GrpoRequest", grpo.admit_request, grpo.run_grpo),
    "opd": Trainer("opd", "OpdRequest", opd.admit_request, opd.run_opd),
}
