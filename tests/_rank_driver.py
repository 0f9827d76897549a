"""One rank of a data-parallel SFT run for the tests, launched by ``torchrun`` (``python -m torch.distributed.run``).

``python -m torch.distributed.run --standalone --nproc-per-node N tests/_rank_driver.py PLAN.json``: every rank joins
the group, admits the plan's request and trains it through ``kiln.trainers.sft``; ``cancel_after_step`` makes rank 0
alone ask for cancellation once that step is committed (the group must agree on where to stop). Rank 0 writes what
the run ended with to the plan's ``result`` path: status, failure reason, losses, checkpoints and the final state.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from pathlib import Path


def main() -> int:
    from kiln.trainers import TRAINERS, TrainingContext
    from kiln.trainers.sft import run_sft
    from kiln.training import DataParallel

    plan = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    group = DataParallel.from_environment(threads=plan["threads"])  # what an admission in another process planned
    context = TrainingContext(registry=Path(plan["registry"]), model_path=plan["model"], data_parallel=group)
    job = TRAINERS["sft"].admit(plan["request"], adapter_name=plan["adapter"], context=context)
    cancel = threading.Event()
    at = plan.get("cancel_after_step")

    def progress(event: dict) -> None:
        if group.rank == 0 and at is not None and event["step"] == at:
            cancel.set()

    result = run_sft(job, progress=progress, cancel=cancel, keep_final_state=True)
    if group.publishes:
        final = result.final_state
        summary = {
            "status": result.status,
            "failure_reason": result.receipt.get("failure_reason"),
            "losses": result.losses,
            "checkpoints": [p.name for p in result.checkpoints],
            "adapter_sha256": hashlib.sha256(final.adapter).hexdigest() if final else None,
            "optimizer_sha256": hashlib.sha256(final.optimizer).hexdigest() if final and final.optimizer else None,
            "loop_state": final.loop_state if final else None,
        }
        Path(plan["result"]).write_text(json.dumps(summary), encoding="utf-8")
    group.leave()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
