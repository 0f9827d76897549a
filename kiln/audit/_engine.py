"""Re-execute a run between its published checkpoints and compare what it computes with what was published.

A run's boundaries are its published checkpoints on the ``checkpoint_interval`` grid; its segments run from one
boundary to the next (the first from step 0, the last -- for an adapter -- to the end). A segment is re-executed in
a temporary registry: the published checkpoint it starts from is copied there (and read strictly by the resume
admission, which refuses a checkpoint outside this process's envelope), the run's own request is admitted again
from the recorded configuration and sources, and the trainer runs until it publishes the checkpoint of the
segment's end (then it is cancelled, cooperatively) or publishes its adapter. What it wrote is compared with what
was published (``kiln.audit._compare``).

Before anything trains, the re-admitted job must stand where the run stood: the same execution envelope (device and
thread count, build, kernels, precision, model files), the same base weights, the same data. Anything else is
``cannot_audit``, naming the field -- never a mismatch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln import contracts
from kiln.adapters import CONFIG_FILE, MANIFEST_FILE, RECEIPT_FILE, WEIGHTS_FILE
from kiln.artifacts.replay_log import REPLAY_LOG, pending_log
from kiln.audit._compare import Difference, compare_adapters, compare_checkpoints, first_field_difference
from kiln.checkpoints import PublishedCheckpoint, list_checkpoints, load_checkpoint, parse_checkpoint_name
from kiln.documents.digests import file_sha256, prefixed
from kiln.documents.jsonio import JsonObject, read_json_file
from kiln.errors import KilnError, RequestError
from kiln.host.progress import stage

if TYPE_CHECKING:
    from kiln.trainers import Admitted

__all__ = ["AUDIT_SCHEMA", "ENVELOPE", "AuditSources", "audit", "draw_segments"]

AUDIT_SCHEMA = "kiln.training-audit.v1"
# the parts of the execution provenance a re-execution must share to be comparable at all
ENVELOPE = ("backend", "build", "kernels", "precision", "model")
_INLINE = {"sft": "examples", "grpo": "groups", "opd": "prompts"}


@dataclass(frozen=True)
class AuditSources:
    """What an audit reads beyond the target: ``data_file``, the run's data where the recorded path no longer holds
    it or the run sent it inline (a ``.jsonl`` file is read as ``dataset_path``; a ``.json`` file holds the array of
    examples, groups or prompts, or a request object carrying them), the base model directory, the OPD teacher's
    alias and registry. None: what the run recorded. ``rescore``: an online GRPO run's scorer scores its recorded
    completions again and must give the recorded rewards (else it is not run: the recorded rewards train)."""

    data_file: Path | None = None
    model: str | None = None
    teacher: str | None = None
    teachers_root: Path | None = None
    rescore: bool = False


class _CannotAuditError(Exception):
    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field_name, message


@dataclass
class _Published:
    """The run as published: where, which kind, its configuration, receipt, checkpoints and recorded sources."""

    target: Path
    is_checkpoint: bool
    adapter: str
    registry: Path
    kind: str
    config: JsonObject
    receipt: JsonObject | None
    provenance: JsonObject
    base_weights: str | None
    data_sha256: str | None
    boundaries: dict[int, Path] = field(default_factory=dict)  # step -> published checkpoint on the grid
    end_step: int | None = None  # a checkpoint target's step (None: the adapter, at the end of the run)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def _recorded_data(registry: Path, adapter: str, target: Path, is_checkpoint: bool) -> str | None:
    """The data digest of the run's first request record (the published log, or the pending one beside it)."""
    log = pending_log(registry, adapter) if is_checkpoint else target / REPLAY_LOG
    if not log.is_file():
        return None
    for line in log.read_text(encoding="utf-8").splitlines():
        record = contracts.load("ReplayRequestRecord", line.encode("utf-8")) if '"request"' in line else None
        if record is not None:
            data = record.model_dump(mode="json")["request"].get("data_sha256")
            return str(data) if data else None
    return None


def _published(target: Path) -> _Published:
    target = target.resolve()
    parsed = parse_checkpoint_name(target.name)
    if parsed is None and not (target / RECEIPT_FILE).is_file():
        raise RequestError(
            f"{target} is neither an adapter directory (no {RECEIPT_FILE}) nor a checkpoint "
            "(<adapter>-checkpoint-step-<8 digits>.kiln-checkpoint)",
            code="training_invalid_request",
            hint="pass a published adapter's directory or one of its checkpoints",
        )
    registry = target.parent
    adapter = parsed[0] if parsed is not None else target.name
    receipt_path = registry / adapter / RECEIPT_FILE
    receipt = read_json_file(receipt_path) if receipt_path.is_file() else None
    if receipt is not None:
        contracts.load("TrainReceipt", receipt)
    if parsed is None and (receipt is None or receipt["status"] != "success"):
        raise _CannotAuditError("train_receipt.status", f"{target} holds no successful run's receipt: nothing to audit")
    checkpoints = list_checkpoints(registry, adapter)
    if parsed is not None:
        manifest = load_checkpoint(target).manifest
        config, kind = manifest["effective_config"], manifest["training_kind"]
        provenance = manifest["auxiliary_state"]["execution_provenance"]
        base = manifest["auxiliary_state"].get("base_model_weights_sha256")
    else:
        assert receipt is not None
        config, kind = receipt["config"], receipt["hyperparameters"]["mode"]
        provenance = receipt["runtime"]["execution_provenance"]
        base = receipt["model"]["base_weight_shard_manifest"]["aggregate_sha256"]
    if parsed is not None:
        ranks = manifest["auxiliary_state"].get("training_runtime_planning_identity", {}).get("data_parallel")
    else:
        ranks = receipt["runtime"].get("data_parallel") if receipt is not None else None
    if ranks:
        raise _CannotAuditError(
            "runtime.data_parallel",
            f"the run trained over {ranks['world_size']} ranks; an audit re-executes in one process, and a "
            "data-parallel step is bit-identical only at its own world size",
        )
    interval = config.get("checkpoint_interval")
    run = _Published(
        target=target,
        is_checkpoint=parsed is not None,
        adapter=adapter,
        registry=registry,
        kind=kind,
        config=_settings(config),
        receipt=receipt,
        provenance=provenance,
        base_weights=base,
        data_sha256=_recorded_data(registry, adapter, target, parsed is not None),
        end_step=parsed[1] if parsed is not None else None,
    )
    for listing in checkpoints:
        step = listing.global_step
        on_grid = bool(interval) and step % int(interval) == 0
        if listing.info is not None and _settings(listing.info.manifest["effective_config"]) != _settings(run.config):
            continue  # left beside it by another run of the same adapter name (another seed or configuration)
        if on_grid and (run.end_step is None or step <= run.end_step):
            run.boundaries[step] = listing.path
    return run


def _settings(config: JsonObject) -> JsonObject:
    """A run's configuration, without what may differ between the attempts of one run."""
    return {k: v for k, v in config.items() if k not in ("resume_checkpoint", "auto_load")}


def _data_of(kind: str, path: Path) -> JsonObject:
    """The data members of a request, from ``path`` as ``kiln train`` reads its file."""
    if path.suffix == ".jsonl":
        return {"dataset_path": str(path.resolve())}
    value = read_json_file(path)
    key = _INLINE[kind]
    if isinstance(value, list):
        return {key: value}
    if isinstance(value, dict):
        members = ("dataset_path", "groups", "agentic_groups") if kind == "grpo" else ("dataset_path", key)
        found = {k: value[k] for k in members if k in value}
        if found:
            return found
    raise _CannotAuditError("data_file", f"{path} holds no {key}: give the file the run was trained from")


def _online_data(run: _Published, sources: AuditSources) -> JsonObject | None:
    """An online GRPO run's ``online`` member: its recorded definition, with the tasks of ``--file`` (a ``.jsonl``
    tasks file, or a ``.json`` array of tasks or request holding ``online.tasks``) when it sent them inline."""
    online = (((run.receipt or {}).get("grpo") or {}).get("online") or {}).get("definition")
    if online is None:
        return None
    online = dict(online)
    if sources.data_file is not None:
        path = sources.data_file
        tasks: Any
        if path.suffix == ".jsonl":
            tasks = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            value = read_json_file(path)
            tasks = value if isinstance(value, list) else ((value or {}).get("online") or {}).get("tasks")
        if not isinstance(tasks, list):
            raise _CannotAuditError("data_file", f"{path} holds no tasks: give the tasks the run was trained on")
        online.pop("tasks_path", None)
        online["tasks"] = tasks
    elif "tasks_path" not in online:
        raise _CannotAuditError(
            "online.tasks", "the run's tasks were sent inline and are not stored with it; pass --file with the tasks"
        )
    return {"online": online}


def _request(run: _Published, sources: AuditSources, resume: str | None) -> JsonObject:
    data = _online_data(run, sources)
    if data is None:
        data = None if sources.data_file is None else _data_of(run.kind, sources.data_file)
    if data is None:
        recorded = (run.receipt or {}).get("training_data") or {}
        if not recorded.get("path"):
            raise _CannotAuditError(
                "training_data",
                "the run's data was sent inline and is not stored with it; pass --file with the same data",
            )
        data = {"dataset_path": recorded["path"]}
    request: JsonObject = {**data, "config": dict(run.config)}
    if run.kind == "opd":
        teacher = sources.teacher or _teacher_of(run)
        if teacher is None:
            raise _CannotAuditError("teacher", "the run's teacher alias is not recorded here; pass --teacher")
        request["teacher"] = teacher
    if resume is not None:
        request["config"]["resume_checkpoint"] = resume
    request["config"].pop("auto_load", None)
    # where the run trained (its provenance's backend), not this machine's default: a CPU run re-executes on the CPU
    # of a machine with a GPU, and a CUDA run's envelope is checked at the resume admission
    request["config"]["device"] = "cuda" if run.provenance["backend"]["name"] == "torch-cuda" else "cpu"
    return request


def _teacher_of(run: _Published) -> str | None:
    for path in run.boundaries.values():
        alias = read_json_file(path / "checkpoint_manifest.json")["auxiliary_state"].get("teacher_id")
        if alias:
            return str(alias)
    opd = (run.receipt or {}).get("opd") or {}
    teacher = opd.get("teacher") if isinstance(opd, dict) else None
    return str(teacher["alias"]) if isinstance(teacher, dict) and teacher.get("alias") else None


def _model_path(run: _Published, sources: AuditSources) -> str:
    if sources.model is not None:
        return sources.model
    recorded = ((run.receipt or {}).get("model") or {}).get("path")
    if not recorded:
        raise _CannotAuditError("model.path", "the run's base model path is not recorded; pass --model")
    return str(recorded)


ROLLOUT_LOG = "rollouts.jsonl"  # an online GRPO run's rollout log (kiln.trainers.grpo), beside its adapter


def _rollout_log(run: _Published) -> tuple[JsonObject, ...]:
    """An online GRPO run's recorded groups: the rollout log published beside its adapter, checked against the
    receipt's digest; for a run that published only checkpoints, the newest checkpoint's log (read strictly)."""
    adapter = run.target.parent / run.adapter if run.is_checkpoint else run.target
    receipt_path = adapter / RECEIPT_FILE
    receipt = read_json_file(receipt_path) if receipt_path.is_file() else None
    online = (receipt or {}).get("grpo", {}).get("online") if receipt and receipt.get("status") == "success" else None
    if online is not None:
        path = adapter / ROLLOUT_LOG
        if not path.is_file():
            raise _CannotAuditError("rollouts.jsonl", f"{path} is missing: the online run's rollouts are its data")
        data = path.read_bytes()
        digest = prefixed(hashlib.sha256(data).hexdigest())
        if digest != online["rollout_log_sha256"]:
            raise _CannotAuditError(
                "grpo.online.rollout_log_sha256",
                f"{path} has digest {digest}; the receipt records {online['rollout_log_sha256']}",
            )
    elif run.boundaries:
        newest = load_checkpoint(run.boundaries[max(run.boundaries)])
        data = newest.blobs[newest.manifest["state_files"]["rollout_log"]]
    else:
        raise _CannotAuditError("rollouts.jsonl", "the online run published neither its rollout log nor a checkpoint")
    return tuple(json.loads(line) for line in data.splitlines())


def _check_standing(run: _Published, job: Admitted) -> JsonObject:
    """Refuse (``_CannotAuditError``) a re-admitted job that does not stand where the run stood; returns its envelope."""
    mine = job.identity.execution_provenance
    for part in ENVELOPE:
        found = first_field_difference(run.provenance.get(part), mine.get(part), f"execution_provenance.{part}")
        if found is not None:
            where, theirs, ours = found
            hint = (
                "; re-execute with the run's thread count (kiln audit --threads N)" if "threads" in str(theirs) else ""
            )
            raise _CannotAuditError(where, f"{where} is {theirs!r} for the run and {ours!r} here{hint}")
    weights = job.identity.base_weight_shard_manifest["aggregate_sha256"]
    if run.base_weights is not None and weights != run.base_weights:
        raise _CannotAuditError(
            "base_model", f"the base model's weights are {weights}; the run trained on {run.base_weights}"
        )
    data = getattr(job, "data_sha256", None)
    if run.data_sha256 is not None and data is not None and prefixed(_hex(data)) != prefixed(_hex(run.data_sha256)):
        raise _CannotAuditError(
            "training_data", f"the training data digests to {prefixed(_hex(data))}; the run's was {run.data_sha256}"
        )
    return {part: mine.get(part) for part in ENVELOPE}


def _hex(value: str) -> str:
    return value.removeprefix("sha256:")


@dataclass
class _Segment:
    index: int
    start: int
    end: int | None  # None: the end of the run
    outcome: str = "not_replayed"
    difference: Difference | None = None
    step: int | None = None  # where the difference is
    seconds: float = 0.0

    def to_json(self) -> JsonObject:
        return {
            "index": self.index,
            "from_step": self.start,
            "to_step": self.end,
            "outcome": self.outcome,
            "seconds": round(self.seconds, 3),
            "difference": None
            if self.difference is None
            else {**self.difference.to_json(), "step": self.step, "description": self.difference.describe()},
        }


def _replay(
    run: _Published, sources: AuditSources, segment: _Segment, *, stop_at_first: bool, full: bool
) -> JsonObject:
    """Re-execute ``segment`` (``full``: every boundary after its start, to the end) and compare; fills the
    segment's outcome and returns the envelope of this process."""
    from kiln.host.config import resolve_settings
    from kiln.teachers import teachers_root
    from kiln.trainers import TRAINERS, TrainingContext

    started = time.perf_counter()
    start_path = run.boundaries.get(segment.start) if segment.start else None
    with tempfile.TemporaryDirectory(prefix="kiln-audit-") as tmp:
        registry = Path(tmp) / "registry"
        registry.mkdir()
        if start_path is not None:
            shutil.copytree(start_path, registry / start_path.name)
        settings = resolve_settings()
        context = TrainingContext(
            registry=registry,
            model_path=_model_path(run, sources),
            teachers_root=sources.teachers_root or teachers_root(settings.home),
            checkpoint_interval=run.config.get("checkpoint_interval"),
        )
        request = _request(run, sources, None if start_path is None else start_path.name)
        trainer = TRAINERS[run.kind]
        try:
            job = trainer.admit(request, adapter_name=run.adapter, context=context)
        except KilnError as exc:  # the resume admission refuses a checkpoint outside this envelope, naming it
            raise _CannotAuditError(str(exc.pointer or exc.code), exc.message) from None
        online = getattr(job, "online", None)
        if online is not None:  # an online GRPO run: its recorded rollouts, not new samples
            setattr(job, "online", dataclasses.replace(online, replay=_rollout_log(run), rescore=sources.rescore))  # noqa: B010
        envelope = _check_standing(run, job)
        cancel = threading.Event()
        boundaries = sorted(s for s in run.boundaries if s > segment.start)
        expected = boundaries if full else boundaries[:1] if segment.end is not None else []
        failure: list[tuple[int, Difference | _CannotAuditError]] = []

        def landed(published: PublishedCheckpoint) -> None:
            parsed = parse_checkpoint_name(published.path.name)
            assert parsed is not None
            step = parsed[1]
            if step not in run.boundaries or (step != segment.end and not full):
                missing = f"the run's checkpoint of step {step} is not published beside it"
                failure.append((step, _CannotAuditError(f"checkpoints.{step}", missing)))
                cancel.set()
                return
            found = compare_checkpoints(run.boundaries[step], published.path)
            if found is not None:
                failure.append((step, found))
                if stop_at_first:
                    cancel.set()
            if step == run.end_step or (segment.end is not None and step >= segment.end):
                cancel.set()

        stage(f"audit: re-executing steps {segment.start} to {segment.end if segment.end is not None else 'the end'}")
        result = trainer.run(job, cancel=cancel, on_checkpoint=landed)
        job.release_model()
        segment.seconds = time.perf_counter() - started
        if failure:
            step, what = failure[0]
            if isinstance(what, _CannotAuditError):
                raise what
            segment.outcome, segment.difference, segment.step = "not_reproduced", what, step
            return envelope
        if result.status != "success" and not result.cancelled:
            message = f"the re-execution failed: {result.receipt.get('failure_reason')}"
            raise _CannotAuditError("re_execution", f"{message}: {result.receipt.get('failure_message')}")
        reached = {s for s in expected if s in run.boundaries}
        if segment.end is None and not run.is_checkpoint:
            if result.status != "success":
                raise _CannotAuditError("re_execution", "the re-execution ended before the run's end")
            found = compare_adapters(run.target, result.adapter_dir, (WEIGHTS_FILE, CONFIG_FILE), RECEIPT_FILE)
            if found is not None:
                segment.outcome, segment.difference = "not_reproduced", found
                return envelope
        elif not reached and expected:
            raise _CannotAuditError("re_execution", "the re-execution published no checkpoint at the segment's end")
        segment.outcome = "reproduced"
    return envelope


def draw_segments(seed: int, count: int, k: int) -> list[int]:
    """The ``k`` segments (of ``count``) a spot check with ``seed`` replays: the indexes in the order of
    ``sha256("kiln.audit-segments.v1:<seed>:<index>")``, the first ``k``, sorted. Anyone can recompute the choice
    from the recorded seed; nobody can know it before the seed is drawn."""
    ranked = sorted(range(count), key=lambda i: hashlib.sha256(f"kiln.audit-segments.v1:{seed}:{i}".encode()).digest())
    return sorted(ranked[: min(k, count)])


def _segments(run: _Published, start: int) -> list[_Segment]:
    steps = [s for s in sorted(run.boundaries) if s > start]
    ends: list[int | None] = list(steps)
    if not run.is_checkpoint:
        ends.append(None)
    out, begin = [], start
    for index, end in enumerate(ends):
        out.append(_Segment(index, begin, end))
        begin = end if end is not None else begin
    return out


def audit(
    target: str | Path,
    *,
    segments: int | None = None,
    seed: int | None = None,
    start: str | None = None,
    sources: AuditSources | None = None,
    threads: int | None = None,
    say: Callable[[str], None] = stage,
) -> JsonObject:
    """Audit the run that published ``target`` (an adapter directory or a checkpoint): re-execute it in full (from
    step 0, or from the published checkpoint ``start``), or ``segments`` randomly chosen segments (the choice seeded
    with ``seed``, drawn now when None), with ``threads`` intra-op threads (None: this process's setting); return the
    ``kiln.training-audit.v1`` record."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _audit(Path(target), segments, seed, start, sources or AuditSources(), say)
    finally:
        torch.set_num_threads(before)


def _audit(
    path: Path,
    segments: int | None,
    seed: int | None,
    start: str | None,
    sources: AuditSources,
    say: Callable[[str], None],
) -> JsonObject:
    began, started_at = time.perf_counter(), _now()
    record: JsonObject = {
        "schema": AUDIT_SCHEMA,
        "target": {"path": str(path.resolve()), "kind": None, "adapter_name": None, "manifest_sha256": None},
        "training_kind": None,
        "mode": "full" if segments is None else "spot_check",
        "seed": None,
        "verdict": "cannot_audit",
        "first_difference": None,
        "cannot_audit": None,
        "checkpoints": [],
        "sources": None,
        "segments": [],
        "envelope": None,
        "started_at": started_at,
        "seconds": 0.0,
        "original_training_seconds": None,
    }
    try:
        run = _published(path)
        manifest = run.target / ("checkpoint_manifest.json" if run.is_checkpoint else MANIFEST_FILE)
        record["target"] = {
            "path": str(run.target),
            "kind": "checkpoint" if run.is_checkpoint else "adapter",
            "adapter_name": run.adapter,
            "manifest_sha256": prefixed(file_sha256(manifest)[0]),
        }
        record["training_kind"] = run.kind
        record["checkpoints"] = [
            {
                "name": p.name,
                "global_step": s,
                "manifest_sha256": prefixed(file_sha256(p / "checkpoint_manifest.json")[0]),
            }
            for s, p in sorted(run.boundaries.items())
        ]
        wall = ((run.receipt or {}).get("runtime") or {}).get("wall_clock_ms")
        record["original_training_seconds"] = None if run.is_checkpoint or wall is None else wall / 1000
        begin = 0
        if start is not None:
            parsed = parse_checkpoint_name(Path(start).name)
            if parsed is None or parsed[1] not in run.boundaries or parsed[0] != run.adapter:
                raise _CannotAuditError("from", f"{start} is not one of the run's published checkpoints")
            begin = parsed[1]
        plan = _segments(run, begin)
        record["sources"] = {
            "data": _data_source(run, sources),
            "data_sha256": run.data_sha256,
            "base_model": {"path": _model_path(run, sources), "weights_sha256": run.base_weights},
            "teacher": (sources.teacher or _teacher_of(run)) if run.kind == "opd" else None,
        }
        if segments is None:
            whole = _Segment(0, begin, None if not run.is_checkpoint else run.end_step)
            say(f"audit: re-executing the whole run ({len(plan)} segment(s))")
            record["envelope"] = _replay(run, sources, whole, stop_at_first=True, full=True)
            for segment in plan:
                segment.seconds = whole.seconds / max(len(plan), 1)
                if whole.outcome != "not_reproduced":
                    segment.outcome = "reproduced"
                elif whole.step is None:  # the difference is in the published adapter, at the end
                    segment.outcome = "not_reproduced" if segment.end is None else "reproduced"
                    segment.difference = whole.difference if segment.end is None else None
                elif segment.end is not None and segment.end < whole.step:
                    segment.outcome = "reproduced"
                elif segment.end == whole.step:
                    segment.outcome, segment.difference, segment.step = "not_reproduced", whole.difference, whole.step
                else:  # after the first difference the re-execution stopped
                    segment.outcome = "not_replayed"
        else:
            if segments < 1:
                raise RequestError("--segments must be at least 1", code="training_invalid_request")
            drawn = seed if seed is not None else secrets.randbits(63)
            record["seed"] = drawn
            chosen = draw_segments(drawn, len(plan), segments)
            for number, index in enumerate(chosen, start=1):
                segment = plan[index]
                say(f"audit: spot check {number} of {len(chosen)} (segment {index + 1} of {len(plan)})")
                record["envelope"] = _replay(run, sources, segment, stop_at_first=True, full=False)
                if segment.outcome == "not_reproduced":
                    break
        record["segments"] = [s.to_json() for s in plan]
        failed = [s for s in plan if s.outcome == "not_reproduced"]
        if failed:
            first = failed[0]
            assert first.difference is not None
            record["verdict"] = "not_reproduced"
            record["first_difference"] = {**first.difference.to_json(), "step": first.step,
                                          "description": first.difference.describe()}  # fmt: skip
        else:
            record["verdict"] = "reproduced"
    except _CannotAuditError as why:
        record["verdict"] = "cannot_audit"
        record["cannot_audit"] = {"field": why.field, "message": why.message}
    record["seconds"] = round(time.perf_counter() - began, 3)
    return record


def _data_source(run: _Published, sources: AuditSources) -> JsonObject | None:
    if sources.data_file is not None:
        data = _data_of(run.kind, sources.data_file)
        return {"dataset_path": data["dataset_path"]} if "dataset_path" in data else None
    recorded = (run.receipt or {}).get("training_data") or {}
    return {"dataset_path": recorded["path"]} if recorded.get("path") else None
