"""Hypothesis profiles for the whole suite (tests/ and conformance/), loaded as a pytest plugin (``-p`` in
``pyproject.toml``'s ``addopts``) before any test module is collected.

* ``deterministic`` (the default, and what CI runs): derandomized draws -- the same examples on every machine and
  every run -- no example database, and shrinking bounded to 60 seconds so a failure is reported promptly.
* ``explore`` (``scripts/test --hypothesis-explore``, or ``KILN_HYPOTHESIS_PROFILE=explore``): random draws, five
  times the examples, full shrinking and a local example database under ``.hypothesis/``. What it finds becomes a
  committed case (``conformance/cases/regressions.json``), so the deterministic run keeps checking it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.internal.conjecture import engine as _hypothesis_engine

PROFILE = os.environ.get("KILN_HYPOTHESIS_PROFILE", "deterministic")
SHRINK_SECONDS = {"deterministic": 60, "explore": 300}

settings.register_profile(
    "deterministic",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile(
    "explore",
    derandomize=False,
    database=DirectoryBasedExampleDatabase(".hypothesis/examples"),
    deadline=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
if PROFILE not in SHRINK_SECONDS:
    raise SystemExit(f"KILN_HYPOTHESIS_PROFILE={PROFILE!r}: use one of {sorted(SHRINK_SECONDS)}")
settings.load_profile(PROFILE)
# Hypothesis has no public setting for the shrink budget; its engine reads this module constant on every run.
if not hasattr(_hypothesis_engine, "MAX_SHRINKING_SECONDS"):
    raise SystemExit("hypothesis no longer has engine.MAX_SHRINKING_SECONDS: bound shrinking another way")
_hypothesis_engine.MAX_SHRINKING_SECONDS = SHRINK_SECONDS[PROFILE]
