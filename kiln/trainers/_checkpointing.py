"""The checkpoint manifest and files every trainer writes, and the state it restores from them.

A trainer describes only what is its own: its data block, random streams, extra state files and auxiliary
members (``manifest_head``), the progress of a checkpoint (``Progress``) and the loop-state document. The rest --
envelope, effective config, precision, optimizer and scheduler blocks, the identity members of
``auxiliary_state``, checkpoint id and time, the adapter/optimizer/loop-state files -- is written here once, and
``restore_policy`` puts adapter tensors and optimizer slots back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from kiln import contracts
from kiln.adapters import AdapterDirectory, base_adapter_dir
from kiln.artifacts.loop_state import loop_state_file_name
from kiln.checkpoints import LoadedCheckpoint, PublishedCheckpoint, checkpoint_id, publish_checkpoint
from kiln.documents.digests import file_sha256, prefixed
from kiln.documents.jsonio import JsonObject
from kiln.errors import RequestError
from kiln.model import device_memory_bytes, execution_envelope, runtime_device
from kiln.trainers._admission import AdmittedJob
from kiln.training import (
    ADAPTER_FILE,
    CUDA_RNG_FILE,
    CUDA_RNG_STREAM,
    OPTIMIZER_FILE,
    EffectiveConfig,
    adapter_tensors,
    auxiliary_identity,
    cuda_rng_capture,
    cuda_rng_position,
    cuda_rng_restore,
    cuda_rng_stream,
    encode_tensors,
    optimizer_tensors,
    planning_identity,
    restore_adapter,
    restore_optimizer,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "CheckpointProgress",
    "base_adapter_block",
    "manifest_head",
    "optimizer_identity",
    "phase_timings",
    "publish_state",
    "restore_policy",
]

LOOP_STATE_TYPES = {"sft": "SftLoopState", "grpo": "GrpoLoopState", "opd": "OpdLoopState"}
TIMED_PHASES = ("reference_forward_ms", "policy_forward_ms", "backward_ms", "optimizer_ms")


def phase_timings(tokenize_ms: float, timings: dict[str, float]) -> dict[str, float]:
    """A loop state's ``phase_timings``: tokenisation, and the time of each phase of this process so far."""
    return {"tokenize_ms": tokenize_ms, "mask_build_ms": 0.0, **{k: timings.get(k, 0.0) for k in TIMED_PHASES}}


Job = AdmittedJob[EffectiveConfig]


def optimizer_identity(cfg: EffectiveConfig, total_steps: int) -> tuple[JsonObject, JsonObject]:
    """The manifest's ``optimizer`` and ``scheduler`` objects at step 0 (the schedule over ``total_steps``)."""
    optimizer = cfg.optimizer.to_json()
    return (
        {
            "kind": cfg.optimizer.kind,
            "step": 0,
            "hyperparameters": {
                "learning_rate": cfg.learning_rate,
                **{k: v for k, v in optimizer.items() if k != "kind"},
            },
            **({"state_file": OPTIMIZER_FILE} if cfg.optimizer.stateful else {}),
        },
        {
            "kind": cfg.lr_scheduler.kind,
            "step": 0,
            "state": cfg.lr_scheduler.state(cfg.learning_rate, total_steps),
        },
    )


def _with_cuda_stream(rng_states: JsonObject, device: str) -> JsonObject:
    """A trainer's streams, with the CUDA device generator's on a CUDA run (sorted, as the manifest writes them)."""
    stream = cuda_rng_stream(device)
    if stream is None:
        return rng_states
    return dict(sorted({**rng_states, CUDA_RNG_STREAM: stream}.items()))


def manifest_head(
    job: Job,
    kind: str,
    *,
    total_steps: int,
    data: JsonObject,
    rng_states: JsonObject,
    auxiliary: JsonObject,
    extra_state_files: dict[str, str] | None = None,
    planning: JsonObject | None = None,
    planning_key: str = "training_runtime_planning_identity",
) -> JsonObject:
    """The manifest of a run without progress, files and time: what a resume must match.

    ``job`` has ``adapter_name``, ``config``, ``precision`` and ``identity``; ``auxiliary`` holds the trainer's
    own ``auxiliary_state`` members, placed after the shared identity members."""
    cfg = job.config
    optimizer_block, scheduler_block = optimizer_identity(cfg, total_steps)
    state_files = {"adapter_parameters": ADAPTER_FILE, "loss_history": loop_state_file_name(kind)}
    if cfg.optimizer.stateful:
        state_files["optimizer_state"] = OPTIMIZER_FILE
    state_files.update(extra_state_files or {})
    if planning is None:
        planning = planning_identity(
            device=runtime_device(job.device),
            data_parallel=job.data_parallel_plan,
            segments=job.checkpoint_segments,
            device_bytes=device_memory_bytes(job.device),
        )
    return {
        "schema_version": 1,
        "manifest_type": "kiln.training-checkpoint.v1",
        "checkpoint_kind": "resumable",
        "training_kind": kind,
        "adapter_name": job.adapter_name,
        "effective_config": cfg.to_json(),
        "precision_policy": job.precision,
        "progress": {"total_steps": total_steps},
        "data": data,
        "rng_states": _with_cuda_stream(rng_states, job.device),
        "optimizer": optimizer_block,
        "scheduler": scheduler_block,
        "state_files": state_files,
        "auxiliary_state": {
            "loop_state_type": f"kiln.{kind}-loop-state.v1",
            **auxiliary_identity(
                job.identity,
                job.precision,
                planning,
                threads=job.data_parallel.threads,
                envelope=execution_envelope(job.device),
            ),
            planning_key: planning,
            **auxiliary,
        },
    }


@dataclass(frozen=True)
class CheckpointProgress:
    """Where a checkpoint stands: the optimizer step, the epoch and cursor, the order of that epoch."""

    global_step: int
    total_steps: int
    epoch_index: int
    cursor_in_epoch: int
    data_order: list[int]

    def as_manifest(self) -> JsonObject:
        return {
            "global_step": self.global_step,
            "total_steps": self.total_steps,
            "epoch_index": self.epoch_index,
            "cursor_in_epoch": self.cursor_in_epoch,
            "data_order": list(self.data_order),
        }


Tensors = dict[str, "torch.Tensor"]


def publish_state(
    job: Job,
    kind: str,
    params: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    *,
    loop_document: Callable[[], JsonObject],
    stamp: Callable[[JsonObject, JsonObject], CheckpointProgress],
    extra_tensors: Callable[[], dict[str, tuple[str, Tensors]]] | None = None,
    extra_files: Callable[[], dict[str, tuple[str, bytes]]] | None = None,
) -> PublishedCheckpoint:
    """Publish one exact-resume checkpoint of ``job`` (``kiln.checkpoints.publish_checkpoint``).

    Under the device lock (``capture``): host copies of the adapter tensors and optimizer slots, the loop-state
    document and any ``extra_tensors`` (``{file name: (role, tensors)}``). Then, off the lock:
    ``stamp(manifest, loop_document)`` fills the trainer's progress-dependent members of the identity manifest
    and returns the ``CheckpointProgress``; the files are encoded here. ``extra_files``: other state files as bytes
    (``{file name: (role, bytes)}``), captured with the rest."""
    cfg = job.config

    snapshot_type = tuple[
        Tensors, Tensors | None, JsonObject, dict[str, tuple[str, Tensors]], dict[str, tuple[str, bytes]]
    ]

    def capture() -> snapshot_type:
        return (
            adapter_tensors(params),
            optimizer_tensors(optimizer, params) if cfg.optimizer.stateful else None,
            loop_document(),
            {**(extra_tensors() if extra_tensors is not None else {}), **cuda_rng_capture(job.device)},
            extra_files() if extra_files is not None else {},
        )

    def encode(snapshot: snapshot_type) -> tuple[JsonObject, dict[str, tuple[str, bytes]]]:
        adapter, slots, loop_doc, extra, raw = snapshot
        manifest = job.identity_manifest()
        progress = stamp(manifest, loop_doc)
        manifest["checkpoint_id"] = checkpoint_id(kind, progress.global_step)
        manifest["created_at"] = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        manifest["progress"] = progress.as_manifest()
        manifest["optimizer"]["step"] = progress.global_step
        manifest["scheduler"]["step"] = progress.global_step
        if CUDA_RNG_STREAM in manifest["rng_states"]:
            state = extra[CUDA_RNG_FILE][1]["state"]
            manifest["rng_states"][CUDA_RNG_STREAM]["position"] = cuda_rng_position(state)
        files = {
            ADAPTER_FILE: ("adapter-parameters", encode_tensors(adapter)),
            loop_state_file_name(kind): ("loss-history", contracts.render(LOOP_STATE_TYPES[kind], loop_doc)),
        }
        if slots is not None:
            files[OPTIMIZER_FILE] = ("optimizer-state", encode_tensors(slots))
        for file_name, (role, tensors) in extra.items():
            files[file_name] = (role, encode_tensors(tensors))
        files.update(raw)
        return manifest, files

    return publish_checkpoint(job.registry, capture, encode)


def base_adapter_block(job: Job) -> JsonObject | None:
    """The warm-start adapter a run starts from, by name and weights digest (an OPD checkpoint binds it)."""
    name = job.config.base_adapter
    if not name:
        return None
    path = AdapterDirectory(base_adapter_dir(job.registry, name)).weights_path
    if not path.is_file():
        raise RequestError(
            f"base_adapter {name!r}: {path} does not exist",
            code="training_invalid_request",
            pointer="/config/base_adapter",
        )
    return {"name": name, "adapter_model_sha256": prefixed(file_sha256(path)[0])}


def restore_policy(
    resume: LoadedCheckpoint, params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer
) -> None:
    """Adapter tensors and optimizer slots from an exact-resume checkpoint, and on CUDA the device generator's state
    (a checkpoint's ``cuda-global`` stream; the device is the parameters')."""
    manifest = resume.manifest
    restore_adapter(params, resume.blobs[manifest["state_files"]["adapter_parameters"]])
    state_file = manifest["optimizer"].get("state_file")
    restore_optimizer(optimizer, params, resume.blobs[state_file] if state_file else None)
    device = str(next(iter(params.values())).device) if params else "cpu"
    cuda_rng_restore(device, manifest["rng_states"], resume.blobs)
