"""The server's serving copy of the base model, and its release while a training job uses its device.

``kiln serve`` holds one copy of the base weights for generation (the served copy, on ``model.device``) and every
training job loads its own, so one GPU serving and training holds two. ``training.serving_copy`` makes that a stated
choice, decided per job as it starts (``kiln.training.serving_copy_released``: ``keep`` never releases, ``release``
always, ``auto`` exactly when the job trains on the serving copy's CUDA device); the memory planner counts the copy by
the same rule (``kiln.training.ServingCopy``: ``docs/server.md``, "One device for serving and training").

1. **Release** (the job's queue thread, before its worker starts). With ``while_released = "cpu"`` a copy of the
   base model is loaded into host memory first and swapped in; with ``"unavailable"`` new requests are refused at
   once with 503 ``serving_unavailable`` (``Retry-After``). Requests in flight finish -- for at most ``DRAIN_S``; one
   still decoding then ends with the same error -- and ``Generator.swap`` retires their scheduler, keeps the active
   adapter's weights in host memory and frees the device copy (its tensors to the meta device, CUDA's cache
   emptied).
2. **Reload** (when the job ends: completed, failed or cancelled). The copy is loaded from disk again, onto its
   device in its precision, and swapped in; the active adapter is bound to it again, and the CPU copy, if any, is
   dropped. Only then does the job's usual activation run (the gate, ``auto_load``). A reload that fails leaves the
   copy released: the job's outcome stands, ``/health``'s ``model_loaded`` check fails naming why, and the next job's
   end tries again.

Both steps are announced on stderr and logged with their durations; ``/health`` reports ``serving``: ``resident``,
``released`` or ``reloading``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import CapacityError
from kiln.host.progress import note, stage
from kiln.training import ServingCopy

log = logging.getLogger("kiln.server.serving")

__all__ = ["DRAIN_S", "Serving", "served_bytes"]

DRAIN_S = 60.0  # how long a release or a reload waits for the requests decoding on the copy it replaces


def served_bytes(model: Any) -> int:
    """What a model's parameters and buffers hold (on whatever device they are)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(int(t.numel()) * int(t.element_size()) for t in tensors)


@dataclass
class Serving:
    """The serving copy: where it lives, how it is loaded again, the policy, and its state."""

    generator: Any  # kiln.server._generation.Generator: serves whichever copy it is given
    path: Path  # the base model directory the copy is loaded from
    is_default: bool
    device: str  # model.device resolved: cpu | cuda:N
    precision: str  # what the copy is held in (fp32)
    bytes: int  # what it holds on its device
    policy: str  # training.serving_copy: keep | release | auto
    while_released: str  # training.while_released: unavailable | cpu
    state: str = "resident"  # resident | released | reloading
    failure: str | None = None  # why the last reload failed (the copy stays released)

    def planned(self) -> ServingCopy:
        """The copy as the memory planner of a job beside it counts it."""
        return ServingCopy(device=self.device, bytes=self.bytes, policy=self.policy, resident=self.state == "resident")

    @contextmanager
    def beside(self, job_device: str) -> Iterator[None]:
        """Around a job training on ``job_device``: the copy released first when the policy says so, and back on its
        device when the job ends, however it ends."""
        if self.state == "resident" and self.planned().released_for(job_device):
            self.release(job_device)
        try:
            yield
        finally:
            if self.state != "resident":
                self.reload()

    def release(self, job_device: str) -> None:
        """Take the copy off its device for a job on ``job_device`` (step 1 of the module docstring)."""
        started = time.perf_counter()
        where = "generation answers 503 meanwhile" if self.while_released == "unavailable" else "a CPU copy serves"
        stage(f"releasing the serving copy ({self.device}) for a job on {job_device}: {where}")
        fallback = None
        if self.while_released == "cpu":
            from kiln.model import load_base_model

            fallback = load_base_model(self.path, is_default=self.is_default, precision=self.precision).model
        cut = self.generator.swap(fallback, refusal=unavailable(job_device), drain_s=DRAIN_S)
        self.state = "released"
        took = time.perf_counter() - started
        ended = f"; {cut} request(s) still decoding after {DRAIN_S:g} s were ended" if cut else ""
        note(f"serving copy released in {took:.2f} s{ended}")
        log.info(
            "serving copy on %s released for a job on %s in %.2f s (%d cut off)", self.device, job_device, took, cut
        )

    def reload(self) -> None:
        """Load the copy onto its device again and serve it (step 2 of the module docstring)."""
        from kiln.model import load_base_model

        started = time.perf_counter()
        self.state = "reloading"
        stage(f"reloading the serving copy onto {self.device}")
        try:
            loaded = load_base_model(
                self.path, is_default=self.is_default, precision=self.precision, device=self.device
            )
        except Exception as exc:  # the job's outcome stands; the copy stays released and /health says why
            self.state = "released"
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("the serving copy could not be loaded onto %s again", self.device)
            note(f"the serving copy could not be loaded again: {self.failure}")
            return
        cut = self.generator.swap(loaded.model, refusal=reloaded(), drain_s=DRAIN_S)
        self.state, self.failure = "resident", None
        took = time.perf_counter() - started
        ended = f"; {cut} request(s) on the CPU copy still decoding after {DRAIN_S:g} s were ended" if cut else ""
        note(f"serving copy back on {self.device} in {took:.2f} s{ended}")
        log.info("serving copy reloaded onto %s in %.2f s (%d cut off)", self.device, took, cut)


def unavailable(job_device: str) -> CapacityError:
    """What generation answers while the copy is released (503 with ``Retry-After``)."""
    return CapacityError(
        f"the serving copy of the base model is released while a training job runs on {job_device} "
        "(training.serving_copy); it is loaded again when the job ends",
        code="serving_unavailable",
        hint='retry after the Retry-After interval, or set training.while_released = "cpu" to serve from a CPU copy '
        'meanwhile (training.serving_copy = "keep" never releases it)',
    )


def reloaded() -> CapacityError:
    """What a request still decoding on the CPU copy after the drain gets when the device copy replaces it."""
    return CapacityError(
        "the serving copy of the base model was loaded again while this request was decoding on the CPU copy",
        code="serving_unavailable",
        hint="send the request again",
    )
