"""Training processes for tests/test_checkpoint_crash.py, forked from a preloaded parent.

``python tests/_crash_driver.py`` starts a *zygote*: it imports torch, transformers, peft
and the SFT trainer once (seconds), prints ``READY``, then reads one JSON run spec per
stdin line. For each it forks a child that runs one SFT job (admission, training,
publication) and waits for it; so every run is a separate process, killable with
SIGKILL, with exactly the zygote's environment (intra-op threads included) and build
identity, at the cost of a fork instead of a fresh interpreter. The parent only imports
(then computes the source identity once and freezes the garbage collector): no thread
exists when it forks.

Spec keys: ``model``, ``registry``, ``data``, ``adapter``, ``config``, ``resume`` (a
checkpoint basename or null), ``result`` (where the child writes its outcome),
``pause`` (null, or ``[publication, event]``) and, optionally, ``pause_in``
(``"checkpoint"``, the default, or ``"adapter"``: the pause counts the calls of the
adapter's publication -- ``publish_adapter``, always publication 1 -- instead) and
``cancel_after`` (a step: cooperative cancellation is requested once it is committed).

Stdout protocol, one flushed line (a single write) each:

``READY``                       the zygote is loaded
``PID <pid>``                   a child started (its first line)
``ADMITTED``                    admission passed (a resume was fully loaded and compared)
``STEP <global step>``          an optimizer step committed; the checkpoint due at that step
                                is published right after this line
``PUBLISHED <step> <n> <ops>`` a checkpoint is published; it made ``n`` file-system
                                calls, ``ops`` their names, comma-separated
``ADAPTER <n> <ops>``           the adapter is published (with ``pause_in: "adapter"``)
``PAUSE <publication> <event> <op>``  the child stopped itself inside a publication
                                and sleeps, so that a SIGKILL lands exactly there
``DONE``                        the child wrote its result
``EXIT <pid> <code>``           the zygote reaped the child (``-9``: killed by SIGKILL)

A pause point is *before* the ``event``-th file-system call (``os.mkdir``, ``open``,
``write``, ``fsync``, ``unlink``, ``rename`` or ``replace``, counted from 1, whichever
module or thread makes it) of the ``publication``-th checkpoint the child publishes
(counted from 1), or of the adapter's publication; a pause before a ``write`` writes
half of it first. The calls are
counted at the ``os`` level, not by the engine's helper functions, so the points follow
the protocol as implemented (staging directory, sentinel, state files, manifest, fsyncs,
sentinel removal, rename, registry fsync) without naming its internals. The wrappers only
count, print and sleep; the engine does all the work.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

_WRITE = os.write  # captured before the child wraps os.write
OPS = ("mkdir", "open", "write", "fsync", "unlink", "rename", "replace")


def _say(line: str) -> None:
    _WRITE(1, (line + "\n").encode())  # one write: a kill never leaves half a line


def _instrument(pause: list[int] | None, where: str = "checkpoint") -> None:
    """Count (and maybe stop at) every file-system call made while a checkpoint -- or, with
    ``where="adapter"``, the adapter -- is published.

    Only this child's ``os`` module is wrapped, and only inside ``publish_checkpoint`` (or the
    SFT trainer's ``publish_adapter``): the wrappers count, and at the pause point print, sleep
    and wait for the kill. A pause before a ``write`` first writes half the buffer, so the kill
    tears the file.
    """
    import kiln.trainers._checkpointing as checkpointing  # where every trainer publishes its checkpoints
    import kiln.trainers.sft as sft  # whose publish_adapter publishes the adapter

    state = {"publication": 0, "events": [], "active": False}
    lock = threading.Lock()  # the engine may fsync on worker threads

    def counted(real, report):
        def publish(*args, **kwargs):
            state["publication"] += 1
            state["events"] = []
            state["active"] = True
            try:
                published = real(*args, **kwargs)
            finally:
                state["active"] = False
            _say(report(published, state["events"]))
            return published

        return publish

    def hooked(op, real):
        def call(*args, **kwargs):
            if state["active"]:
                with lock:
                    state["events"].append(op)
                    event = len(state["events"])
                if pause is not None and [state["publication"], event] == list(pause):
                    if op == "write" and len(args) == 2:
                        real(args[0], bytes(args[1])[: len(args[1]) // 2])  # a torn write
                    _say(f"PAUSE {state['publication']} {event} {op}")
                    time.sleep(600)  # the test kills us here
            return real(*args, **kwargs)

        return call

    for op in OPS:
        setattr(os, op, hooked(op, getattr(os, op)))
    if where == "adapter":
        sft.publish_adapter = counted(sft.publish_adapter, lambda _, e: f"ADAPTER {len(e)} {','.join(e)}")
    else:
        checkpointing.publish_checkpoint = counted(
            checkpointing.publish_checkpoint,
            lambda p, e: f"PUBLISHED {p.manifest['progress']['global_step']} {len(e)} {','.join(e)}",
        )


def _run(spec: dict) -> int:
    from kiln.trainers.sft import admit_sft, run_sft

    _say(f"PID {os.getpid()}")
    _instrument(spec["pause"], spec.get("pause_in", "checkpoint"))
    config = dict(spec["config"])
    if spec["resume"] is not None:
        config["resume_checkpoint"] = spec["resume"]
    job = admit_sft(
        adapter_name=spec["adapter"],
        registry=Path(spec["registry"]),
        config=config,
        dataset_path=spec["data"],
        model_path=spec["model"],
    )
    _say("ADMITTED")
    cancel = threading.Event()

    def progress(p: dict) -> None:
        _say(f"STEP {p['step']}")
        if p["step"] == spec.get("cancel_after"):
            cancel.set()

    result = run_sft(job, progress=progress, cancel=cancel, keep_final_state=True)
    outcome = {
        "status": result.status,
        "failure_reason": result.receipt.get("failure_reason"),
        "failure": result.receipt.get("failure_message"),
        "resumed_from": result.resumed_from.name if result.resumed_from else None,
        "losses": result.losses,
        "checkpoints": [p.name for p in result.checkpoints],
    }
    final = result.final_state
    if final is not None:
        outcome |= {
            "adapter_sha256": hashlib.sha256(final.adapter).hexdigest(),
            "optimizer_sha256": hashlib.sha256(final.optimizer).hexdigest() if final.optimizer else None,
            "loop_state": final.loop_state,
            "published_adapter_sha256": hashlib.sha256(
                (result.adapter_dir / "adapter_model.safetensors").read_bytes()
            ).hexdigest(),
        }
    Path(spec["result"]).write_text(json.dumps(outcome), encoding="utf-8")
    _say("DONE")
    return 0 if result.status == "success" else 1


def serve() -> None:
    import peft  # noqa: F401  (preloaded: the children only fork)
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import kiln.data
    import kiln.kernels
    import kiln.model
    import kiln.trainers.sft  # noqa: F401
    from kiln.model._identity import _source_identity

    # One build for every child: the source identity (tree digest, git commit, dirty flag)
    # enters the execution provenance that resume compares; computed here once, a commit
    # landing in the checkout while the test runs cannot split the runs into two builds.
    _source_identity()
    # The children inherit a large object graph (torch, transformers); frozen, it is never
    # collected, so no child spends a quarter second in a full collection at a random point.
    gc.freeze()
    if os.path.isdir("/proc/self/task") and len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError("the zygote started a thread: forking it would not be safe")
    _say("READY")
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 2
            try:
                code = _run(spec)
            except BaseException:  # noqa: BLE001  (the child reports any failure, then exits)
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        _say(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}")


if __name__ == "__main__":
    serve()
