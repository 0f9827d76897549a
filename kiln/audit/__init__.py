"""Training audit: re-execute a published run between its checkpoints and prove -- or disprove -- its bytes.

Kiln's artifacts prove integrity (every file bound by its digest); an audit proves provenance. Within one execution
envelope Kiln's trainers are byte-deterministic, so re-executing the recorded run from its recorded sources must
reproduce every published checkpoint and the published adapter exactly. ``audit(target)`` does that in full, or
for ``segments`` randomly chosen spans between consecutive checkpoints (each replayed from the published checkpoint
that starts it), and returns a ``kiln.training-audit.v1`` record with one of three verdicts:

* ``reproduced`` -- every boundary it re-executed, and the end, equal what was published;
* ``not_reproduced`` -- the first difference, named: the file, the tensor or field, the step, the largest absolute
  difference;
* ``cannot_audit`` -- the re-execution could not stand where the run stood (another device, thread count, build or
  torch version; a data file or base model that changed or is missing; a missing checkpoint), naming the field.
  Never reported as a mismatch.

``kiln.audit._engine`` plans and runs the segments; ``kiln.audit._compare`` names differences. ``docs/audit.md``
says what an audit proves and what it does not.
"""

from __future__ import annotations

from kiln.audit._compare import UNMEASURED, Difference
from kiln.audit._engine import AUDIT_SCHEMA, ENVELOPE, AuditSources, audit, draw_segments

__all__ = ["AUDIT_SCHEMA", "ENVELOPE", "UNMEASURED", "AuditSources", "Difference", "audit", "draw_segments"]
