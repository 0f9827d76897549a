"""One rank of data-parallel runs for the tests, launched by ``torchrun`` (``python -m torch.distributed.run``).

``python -m torch.distributed.run --standalone --nproc-per-node N tests/_rank_driver.py PLAN.json``: every rank joins
the group, then for each run of the plan (the plan itself is one SFT run, or ``{"threads", "runs": [...]}`` several
runs of any kind, one after the other in the one group) admits its request through ``kiln.trainers.TRAINERS`` and
trains it; ``cancel_after_step`` makes rank 0 alone ask for cancellation once the run's progress reaches that step
(SFT: optimizer step, GRPO: group, OPD: candidate; the group must agree on where to stop). Rank 0 writes what each run
ended with to its ``result`` path: status, failure reason, losses, checkpoints, the adapter's digest, the receipt
and, for SFT, the final state.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from pathlib import Path


def train(group, plan: dict) -> None:
    from kiln.trainers import TRAINERS, TrainingContext
    from kiln.trainers.sft import run_sft

    kind = plan.get("kind", "sft")
    teachers = plan.get("teachers")
    context = TrainingContext(
        registry=Path(plan["registry"]),
        model_path=plan["model"],
        data_parallel=group,
        teachers_root=None if teachers is None else Path(teachers),
    )
    job = TRAINERS[kind].admit(plan["request"], adapter_name=plan["adapter"], context=context)
    cancel = threading.Event()
    at = plan.get("cancel_after_step")

    def progress(event: dict) -> None:
        if group.rank == 0 and at is not None and event["step"] == at:
            cancel.set()

    if kind == "sft":
        result = run_sft(job, progress=progress, cancel=cancel, keep_final_state=True)
    else:
        result = TRAINERS[kind].run(job, progress=progress, cancel=cancel)
    if group.publishes:
        final = result.final_state
        weights = result.adapter_dir / "adapter_model.safetensors"
        summary = {
            "status": result.status,
            "failure_reason": result.receipt.get("failure_reason"),
            "losses": result.losses,
            "checkpoints": [p.name for p in result.checkpoints],
            "adapter_sha256": hashlib.sha256(final.adapter).hexdigest()
            if final
            else hashlib.sha256(weights.read_bytes()).hexdigest()
            if weights.is_file()
            else None,
            "optimizer_sha256": hashlib.sha256(final.optimizer).hexdigest() if final and final.optimizer else None,
            "loop_state": final.loop_state if final else None,
            "receipt": result.receipt,
        }
        Path(plan["result"]).write_text(json.dumps(summary), encoding="utf-8")


def main() -> int:
    from kiln.training import DataParallel

    plan = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
    group = DataParallel.from_environment(threads=plan["threads"])  # what an admission in another process planned
    for run in plan.get("runs", [plan]):
        train(group, run)
        if group.active:  # the next run may read what rank 0 published (a checkpoint it resumes)
            import torch.distributed as dist

            dist.barrier()
    group.leave()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
