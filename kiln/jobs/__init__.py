"""The job runner: one training job in a process of its own (``python -m kiln.jobs.worker SPEC``).

``worker``  loads a ``kiln.worker-spec.v1`` strictly (``kiln.artifacts.worker_spec``), re-admits its request against
            the admitted fingerprint, trains through ``kiln.trainers.TRAINERS`` and reports on an append-only event
            file; ``follow`` is the launching side (the server's, ``kiln train --local`` over several ranks)
"""

from __future__ import annotations

__all__ = ["worker"]
