"""Data parallelism: one optimizer step spread over several ranks (processes) of a ``torch.distributed`` group.

Each kind has its rule (recorded in the checkpoint's planning identity, the receipt and the adapter manifest as the
plan's ``sharding``); what they share:

* every rank holds the whole LoRA model and scales its losses by their share of the *step's* tokens (every rank
  knows the whole plan), so the sum of the ranks' gradients is the gradient of the step's loss: ``StepSync.reduce``
  sums the LoRA gradients, the loss shares and the ranks' cancellation flags in one collective, and every rank then
  takes the same optimizer step, checks the same loss for finiteness and agrees on the same step to stop at;
* what a rank learns about its own part of the step that the run records (GRPO's audits, OPD's per-rollout KL and
  ECHO cross-entropy) is gathered to every rank (``StepSync.gather``: JSON, never pickle) and added in the order one
  process would add it, so every rank's accumulators are the same;
* rank 0 alone publishes (checkpoints, receipt, adapter); ``StepSync.check_same`` proves before each publication
  that every rank holds byte-identical LoRA weights.

The rules:

* ``SHARDING_RULE`` (``kiln.sft-step-round-robin.v1``, SFT): a step consumes ``micro_batch_size x
  gradient_accumulation_steps x world_size`` consecutive rows of the epoch's seeded order
  (``kiln.documents.batch_plan.rows_per_step``), the last step of an epoch what is left; the step's rows are cut, in
  order, into micro-batches of ``micro_batch_size`` rows and micro-batch ``j`` goes to rank ``j mod world_size``
  (``DataParallel.micro_batches``). A rank may get none in a short last step.
* ``GRPO_SHARDING_RULE`` (``kiln.grpo-step-completions.v1``): a step is what one process takes. Under
  ``token_level`` each group of the step is split into ``world_size`` contiguous blocks of its completions (rank
  ``r`` takes ``[r*n//W, (r+1)*n//W)``: ``DataParallel.block``), so a rank's completions share their group's prompt;
  under ``per_sample`` the step's shares (a completion each) are dealt in turn (``DataParallel.deals``).
* ``OPD_SHARDING_RULE`` (``kiln.opd-step-candidates.v1``): a step is what one process takes. Every rank decodes all
  the step's rollouts from the one ``rollout-sampling`` generator (the generator is sequential, so the stream stays
  the single-process stream: a batched decode is memory-bound, and decoding the whole step costs a rank about what
  decoding its part would), then the step's micro-batches of candidates are dealt in turn
  (``DataParallel.micro_batches``): rank ``r`` has the teacher score, and trains, micro-batch ``j`` when
  ``j mod world_size == r``.

Every rank's cursor is the global cursor and no stream draws per rank (the epoch order, the LoRA initialisation and
OPD's rollouts are seeded and global), so the checkpoint binds each rank's position through the world size and the
rule; a checkpoint resumes only at the world size, backend and rule it was written with.

``DataParallel.from_environment`` reads the group ``torchrun`` describes (``WORLD_SIZE``, ``RANK``) and joins it
with the backend of the training device (``backend_for``): a job on the CPU sums CPU tensors over ``gloo`` (also on
a machine with GPUs, where ``nccl`` would refuse CPU tensors); a job on CUDA (``device`` ``cuda`` or ``auto``) puts
rank ``r`` of a node on ``cuda:LOCAL_RANK`` and sums over ``nccl``. Without ``torchrun`` it is the single-process plan, and nothing here runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.documents.jsonio import JsonValue
from kiln.errors import NonFiniteLossError, TrainingFailedError

__all__ = [
    "GRPO_SHARDING_RULE",
    "OPD_SHARDING_RULE",
    "SHARDING_RULE",
    "DataParallel",
    "RanksDivergedError",
    "StepSync",
]

SHARDING_RULE = "kiln.sft-step-round-robin.v1"  # SFT
GRPO_SHARDING_RULE = "kiln.grpo-step-completions.v1"
OPD_SHARDING_RULE = "kiln.opd-step-candidates.v1"
LEAVE_TIMEOUT_S = 60  # how long a rank waits at the closing barrier for the others
TRAINING_DEVICE = "cpu"  # the device a group is planned for before a job's own device is resolved


def backend_for(device: str) -> str:
    """The ``torch.distributed`` backend that sums tensors on ``device``: ``nccl`` for CUDA, ``gloo`` otherwise."""
    return "nccl" if device.startswith("cuda") else "gloo"


class RanksDivergedError(TrainingFailedError):
    """Two ranks hold different LoRA weights before a publication: the group is not in lockstep (``training_error``)."""


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel group: ``world_size`` ranks, this one ``rank``, the backend."""

    world_size: int = 1
    rank: int = 0
    backend: str | None = None  # "gloo" | "nccl"; None for a single process
    threads: int | None = None  # each rank's intra-op threads (None: whatever this process has)

    @property
    def active(self) -> bool:
        return self.world_size > 1

    @property
    def publishes(self) -> bool:
        """Whether this rank writes artifacts and events (rank 0 does, and a single process)."""
        return self.rank == 0

    def plan(self, sharding: str = SHARDING_RULE) -> dict[str, Any] | None:
        """The ``DataParallelPlan`` record under the kind's ``sharding`` rule, or None for a single process (the
        record is then omitted)."""
        if not self.active:
            return None
        return {"world_size": self.world_size, "backend": self.backend, "sharding": sharding}

    def micro_batches(self, rows: list[int], micro: int) -> list[list[int]]:
        """This rank's micro-batches of a step's ``rows``: the step cut in order, dealt to the ranks in turn."""
        batches = [rows[start : start + micro] for start in range(0, len(rows), micro)]
        return batches[self.rank :: self.world_size]

    def block(self, count: int) -> range:
        """This rank's contiguous block of ``count`` items split over the ranks: ``[r*count//W, (r+1)*count//W)``
        (the blocks tile the items in rank order; a rank's may be empty when ``count`` < ``world_size``)."""
        return range(self.rank * count // self.world_size, (self.rank + 1) * count // self.world_size)

    def deals(self, position: int) -> bool:
        """Whether item ``position`` of a sequence dealt to the ranks in turn is this rank's."""
        return position % self.world_size == self.rank

    def ranks(self) -> list[DataParallel]:
        """Every rank of this group, in order (what each one takes under a rule is a pure function of it)."""
        return [dataclasses.replace(self, rank=rank) for rank in range(self.world_size)]

    @classmethod
    def planned(cls, world_size: int, nproc_per_node: int | None = None, *, threads: int | None = None) -> DataParallel:
        """The group ``world_size`` ranks will form, as admission sees it: rank 0, the backend this machine gives,
        and ``threads`` (default: this process's intra-op threads) shared among the ``nproc_per_node`` ranks of a
        machine (all of them on one node by default), so the ranks do not oversubscribe the cores and admission
        records their identity. One process: a plan only when ``threads`` is given (a worker process of a server)."""
        import torch

        if world_size <= 1:
            return cls() if threads is None else cls(threads=threads)
        per_node = world_size if nproc_per_node is None else nproc_per_node
        total = torch.get_num_threads() if threads is None else threads
        return cls(
            world_size=world_size, rank=0, backend=backend_for(TRAINING_DEVICE), threads=max(1, total // per_node)
        )

    @classmethod
    def from_environment(
        cls, threads: int | None = None, environ: dict[str, str] | None = None, *, device: str = "cpu"
    ) -> DataParallel:
        """The group ``torchrun`` launched this process into, joined, with ``threads`` intra-op threads (what the
        job was admitted for); a single process without one. ``device``: the job's device setting -- when it trains
        on CUDA (``cuda``, or ``auto`` on a machine with CUDA), each rank takes the CUDA device of its
        ``LOCAL_RANK`` (so ``cuda`` resolves to it) and the group sums over NCCL; otherwise over gloo."""
        import torch

        if threads is not None:
            torch.set_num_threads(threads)
        env = os.environ if environ is None else environ
        world = int(env.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(threads=threads)
        import torch.distributed as dist

        backend = backend_for(TRAINING_DEVICE)
        if device in ("cuda", "auto") and torch.cuda.is_available():
            torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
            backend = backend_for("cuda")
        if not dist.is_initialized():
            dist.init_process_group(backend=backend)
        rank = dist.get_rank()
        return cls(world_size=dist.get_world_size(), rank=rank, backend=backend, threads=torch.get_num_threads())

    def leave(self) -> None:
        """Leave the process group (after the run; a single process has none).

        The ranks meet at a barrier first, so no rank tears its connections down while a peer's last collective
        is still in flight: a rank that destroyed its group early was seen to abort at exit ("terminate called
        without an active exception"). A peer that is already gone (its run failed) breaks the barrier; that
        failure is the group's and is reported by rank 0's outcome, so this rank still leaves."""
        if self.active:
            from datetime import timedelta

            import torch.distributed as dist

            if dist.is_initialized():
                try:
                    if self.backend == "gloo":  # names a missing rank, with a timeout
                        dist.monitored_barrier(timeout=timedelta(seconds=LEAVE_TIMEOUT_S))
                    else:
                        dist.barrier()
                except RuntimeError as exc:  # DistBackendError too: a peer already left
                    print(f"rank {self.rank}: leaving without the other ranks: {exc}", file=sys.stderr)
                dist.destroy_process_group()


class StepSync:
    """The one collective of a step: the ranks' LoRA gradients, loss shares and cancellation flags, summed.

    ``cancel`` is the event the loop's cadence watches: for a single process the caller's own, for a group one
    that is set on every rank at the same step, once any rank was asked to stop."""

    def __init__(self, group: DataParallel, params: dict[str, Any], cancel: threading.Event | None) -> None:
        self.group, self.params, self._asked = group, params, cancel
        self.cancel = threading.Event() if group.active else cancel

    def reduce(self, value: float, where: Callable[[], str]) -> float:
        """Sum the step's gradients over the ranks (into every parameter's ``grad``); returns the step's loss, the
        sum of the ranks' shares, after checking it is finite on every rank alike (``nan_loss`` naming ``where()``).
        A single process: ``value`` unchanged (its micro-batches were checked as they ran)."""
        if not self.group.active:
            return value
        import torch
        import torch.distributed as dist

        tensors = list(self.params.values())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in tensors]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        asked = self._asked is not None and self._asked.is_set()
        scalars = torch.tensor([value, 1.0 if asked else 0.0], dtype=torch.float64, device=flat.device)
        dist.all_reduce(scalars, op=dist.ReduceOp.SUM)
        offset = 0
        for param in tensors:
            size = param.numel()
            param.grad = flat[offset : offset + size].view_as(param).clone()
            offset += size
        total, flags = scalars.tolist()
        if not math.isfinite(total):
            raise NonFiniteLossError(
                f"non-finite loss {total} at {where()} (summed over {self.group.world_size} ranks)"
            )
        if flags > 0 and self.cancel is not None:
            self.cancel.set()
        return total

    def gather(self, payload: JsonValue) -> list[JsonValue]:
        """Every rank's ``payload`` (a JSON value: numbers, strings, lists, objects), in rank order, on every rank:
        one collective of the encodings' lengths, one of the encodings (JSON text: Python floats round-trip exactly,
        and nothing is unpickled). A single process: ``[payload]``."""
        if not self.group.active:
            return [payload]
        import torch
        import torch.distributed as dist

        data = json.dumps(payload, separators=(",", ":")).encode()
        device = "cuda" if self.group.backend == "nccl" else "cpu"  # NCCL gathers CUDA tensors (the rank's device)
        length = torch.tensor([len(data)], dtype=torch.int64, device=device)
        lengths = [torch.zeros_like(length) for _ in range(self.group.world_size)]
        dist.all_gather(lengths, length)
        sizes = [int(n.item()) for n in lengths]
        mine = torch.zeros(max(sizes), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(device)
        gathered = [torch.zeros_like(mine) for _ in sizes]
        dist.all_gather(gathered, mine)
        return [json.loads(bytes(t[:n].cpu().tolist())) for t, n in zip(gathered, sizes, strict=True)]

    def check_same(self) -> None:
        """Every rank holds byte-identical LoRA weights (a digest of them gathered from each rank); raises
        ``RanksDivergedError`` naming the ranks that differ from rank 0. A single process: nothing to check."""
        if not self.group.active:
            return
        import torch
        import torch.distributed as dist

        digest = hashlib.sha256()
        for name in sorted(self.params):
            digest.update(name.encode())
            digest.update(self.params[name].detach().cpu().contiguous().numpy().tobytes())
        mine = torch.tensor(list(digest.digest()), dtype=torch.int32)
        if self.group.backend == "nccl":  # NCCL sums and gathers CUDA tensors only
            mine = mine.cuda()
        gathered = [torch.zeros_like(mine) for _ in range(self.group.world_size)]
        dist.all_gather(gathered, mine)
        differ = [rank for rank, other in enumerate(gathered) if not torch.equal(other, gathered[0])]
        if differ:
            raise RanksDivergedError(f"ranks {differ} hold other LoRA weights than rank 0")
