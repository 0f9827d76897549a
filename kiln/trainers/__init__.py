"""The trainers, picked from a closed registry keyed by the schema's ``TrainingJobType``."""

from __future__ import annotations

from kiln.trainers.sft import SftResult, run_sft

TRAINERS = {"sft": run_sft}

__all__ = ["TRAINERS", "SftResult", "run_sft"]
