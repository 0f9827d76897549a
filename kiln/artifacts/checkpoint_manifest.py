"""Training checkpoint manifest (``kiln.training-checkpoint.v1``, ``checkpoint_manifest.json``):
the manifest of an exact-resume checkpoint directory. It binds progress and data order,
the named random streams, optimizer and scheduler state, precision, the resolved trainer
configuration and the objective-specific ``auxiliary_state`` (model, tokenizer and
template digests, the full base-weight shard manifest and execution provenance, the
planning identity, and the cursors of the objective), and lists every other file of the
directory with its role, size and SHA-256.

Longer than 600 lines: one module per artifact -- each of the manifest's rules sits beside its loader and writer.

``auxiliary_state`` is a plain object in the manifest schema; for ``sft``, ``grpo`` and
``opd`` the ``manifest.auxiliary-state`` rule validates it against the typed view of the
kind (``SftCheckpointAuxiliaryState``, ``GrpoCheckpointAuxiliaryState``,
``OpdCheckpointAuxiliaryState``) with that view's schema and rules, and reports what it
finds under ``/auxiliary_state``; ``manifest.effective-config`` does the same for
``effective_config`` against ``SftConfig``/``GrpoConfig``/``OpdConfig``. The manifest is
schema-valid at that point, so such problems carry ``inconsistent_fields`` (the
sub-object's own code is named in the message); a stale digest inside still fails fast as
``digest_mismatch``. A ``capability-distillation`` checkpoint's auxiliary state is not
interpreted (Kiln never resumes one).

Rules of the typed views that need only the auxiliary state are registered on the view;
those that compare it with the enclosing manifest are registered on the manifest under
the view's constraint id: ``*-aux.precision-binding``, the ``refresh_every`` bound of
``grpo-aux.ema-fields`` and ``opd-aux.candidate-cursor``. ``*-aux.provenance-digest`` and
the recomputation half of ``*-aux.base-weights-binding`` are enforced by the rules of the
embedded records themselves (``ExecutionProvenanceV1``: self-digest and kernel-contract
digest; ``BaseWeightShardManifest``: aggregate and total size), which run wherever those
records sit; a recomputed digest that does not match fails the whole load at once.
``*-aux.planning-identity`` is also pinned by the views' schemas (the planning record's
``schema`` tag is a constant there).

Not here: the ``files``-scope constraints (directory name, manifest file, file set, loop-state
file), which need the checkpoint directory and belong to the directory loader.

``load_checkpoint_manifest`` (strict), ``write_checkpoint_manifest`` (canonical, atomic).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kiln.documents import pipeline
from kiln.documents.batch_plan import group_window, rows_per_step, steps_per_epoch
from kiln.documents.epoch_order import ALGORITHM_ID as EPOCH_ORDER_ALGORITHM
from kiln.documents.epoch_order import epoch_order
from kiln.documents.rules import ptr, semantic_rule
from kiln.errors import IntegrityError, Problem
from kiln.host.fs import name_problem

DOC = "TrainingCheckpointManifest"
SFT_AUX = "SftCheckpointAuxiliaryState"
GRPO_AUX = "GrpoCheckpointAuxiliaryState"
OPD_AUX = "OpdCheckpointAuxiliaryState"
AUXILIARY_STATE_TYPES = {"sft": SFT_AUX, "grpo": GRPO_AUX, "opd": OPD_AUX}
CONFIG_TYPES = {"sft": "SftConfig", "grpo": "GrpoConfig", "opd": "OpdConfig"}
PLANNING_V3 = "kiln.training-checkpoint-planning.v3"
PLANNING_V4 = "kiln.training-checkpoint-planning.v4"

MANIFEST_FILE = "checkpoint_manifest.json"
INCOMPLETE_SENTINEL = ".incomplete"
RESERVED_PATHS = (MANIFEST_FILE, INCOMPLETE_SENTINEL)
MAX_RELATIVE_PATH_BYTES = 1024
_RELATIVE_PATH = re.compile(r"[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*")
U64_MAX = 2**64 - 1
SEMANTIC_CODES = ("inconsistent_fields", "unsafe_path", "digest_mismatch")

STATE_FILE_ROLES = {
    "adapter_parameters": "adapter-parameters",
    "optimizer_state": "optimizer-state",
    "reference_state": "reference-state",
    "ema_state": "ema-state",
    "reward_normalization_state": "reward-normalization-state",
    "loss_history": "loss-history",
    "rollout_log": "rollout-log",
}
OPTIMIZER_HYPERPARAMETERS = {
    "sgd": ("learning_rate",),
    "adam_w": ("learning_rate", "beta1", "beta2", "eps", "weight_decay"),
    "muon": ("learning_rate", "momentum", "nesterov", "ns_iters", "weight_decay"),
}
BOOLEAN_HYPERPARAMETERS = frozenset({"nesterov"})
REQUIRED_RNG_STREAMS = {
    "sft": ("epoch-order", "lora-init"),
    "grpo": ("lora-init",),
    "opd": ("epoch-order", "lora-init", "rollout-sampling"),
    "capability-distillation": ("lora-init",),
}
SFT_SOURCE_KIND = "sft-valid-example-order-v1"
GRPO_SOURCE_KINDS = {
    "inline": "inline-grpo-trainable-order-v1",
    "jsonl": "jsonl-grpo-trainable-order-v1",
    "online": "online-grpo-task-visit-order-v1",
}
CURSOR_ROUTES = ("jsonl", "online")  # the GRPO routes whose auxiliary state carries a source cursor
OPD_SOURCE_KINDS = {"prompts": "opd-prompt-candidate-order-v1", "teacher_jsonl": "opd-teacher-jsonl-candidate-order-v1"}
MODEL_IDENTITY_FIELDS = (
    "model_config_sha256",
    "tokenizer_config_sha256",
    "chat_template_sha256",
    "training_chat_template_sha256",
)

__all__ = ["load_checkpoint_manifest", "relative_path_problem", "write_checkpoint_manifest"]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same_setting(a: Any, b: Any) -> bool:
    """JSON equality that keeps booleans and numbers apart (``True != 1`` here)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b


def relative_path_problem(path: str) -> str | None:
    """Why ``path`` is not a CheckpointRelativePath, or None when it is one: at most 1024 bytes, not reserved,
    '/'-separated portable components, each a plain file name (``kiln.host.fs.name_problem``, kind ``file``)."""
    if len(path.encode("utf-8")) > MAX_RELATIVE_PATH_BYTES:
        return f"is longer than {MAX_RELATIVE_PATH_BYTES} bytes"
    if path in RESERVED_PATHS:
        return "is reserved for the manifest or the publication sentinel"
    if not _RELATIVE_PATH.fullmatch(path):
        return "is not a relative '/'-separated path of non-empty [A-Za-z0-9._-] components"
    for part in path.split("/"):
        why = name_problem(part, kind="file")
        if why is not None:
            return f"has a {part!r} component ({why})"
    return None


def _embedded_problems(definition: str, value: Any, at: str, what: str) -> Iterator[Problem]:
    """Problems of ``value`` as a ``definition`` (schema and rules), re-rooted at ``at``.

    The manifest itself is schema-valid here, so a schema problem of the sub-object is a
    semantic inconsistency of the manifest: it is reported as ``inconsistent_fields`` with
    the sub-object's own code in the message. A recomputed digest that does not match
    raises ``IntegrityError`` at once, as it would anywhere else in a document.
    """
    found = [
        Problem(
            p.code if p.code in SEMANTIC_CODES else "inconsistent_fields",
            at + p.pointer,
            f"{what} does not fit {definition} ({p.code}): {p.message}",
        )
        for p in pipeline.problems_of(definition, value)
    ]
    digests = [p for p in found if p.code == "digest_mismatch"]
    if digests:
        raise IntegrityError(digests)
    yield from found


def _referenced_paths(doc: dict[str, Any], at: str) -> Iterator[tuple[str, str, str, str]]:
    """``(pointer, field name, path, expected role)`` of every field that names a checkpoint file."""
    for key, path in doc["state_files"].items():
        yield ptr(at, "state_files", key), f"state_files.{key}", path, STATE_FILE_ROLES[key]
    if "state_file" in doc["optimizer"]:
        yield (
            ptr(at, "optimizer", "state_file"),
            "optimizer.state_file",
            doc["optimizer"]["state_file"],
            "optimizer-state",
        )
    for name, stream in doc["rng_states"].items():
        if "state_file" in stream:
            yield (
                ptr(at, "rng_states", name, "state_file"),
                f"rng_states.{name}.state_file",
                stream["state_file"],
                "rng-state",
            )


# -- paths and names ----------------------------------------------------------------------


@semantic_rule(DOC, "manifest.file-paths")
def _file_paths(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    for path in doc["files"]:
        why = relative_path_problem(path)
        if why:
            yield Problem("unsafe_path", ptr(at, "files", path), f"file path {path!r} {why}")
    for pointer, field, path, _ in _referenced_paths(doc, at):
        why = relative_path_problem(path)
        if why:
            yield Problem("unsafe_path", pointer, f"{field} {path!r} {why}")


@semantic_rule(DOC, "manifest.checkpoint-id")
def _checkpoint_id(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    expected = f"{doc['training_kind']}-step-{doc['progress']['global_step']:08d}"
    if doc["checkpoint_id"] != expected:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "checkpoint_id"),
            f"checkpoint_id is {doc['checkpoint_id']!r} but training_kind and progress.global_step make it {expected!r}",
        )


# -- progress and data order --------------------------------------------------------------


@semantic_rule(DOC, "manifest.step-bounds")
def _step_bounds(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    progress = doc["progress"]
    if progress["global_step"] > progress["total_steps"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "progress", "global_step"),
            f"progress.global_step ({progress['global_step']}) exceeds progress.total_steps ({progress['total_steps']})",
        )


@semantic_rule(DOC, "manifest.cursor-bounds")
def _cursor_bounds(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    progress = doc["progress"]
    if progress["cursor_in_epoch"] > len(progress["data_order"]):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "progress", "cursor_in_epoch"),
            f"progress.cursor_in_epoch ({progress['cursor_in_epoch']}) is past the end of progress.data_order "
            f"({len(progress['data_order'])} items)",
        )


@semantic_rule(DOC, "manifest.in-progress-order")
def _in_progress_order(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    progress = doc["progress"]
    if progress["global_step"] < progress["total_steps"] and not progress["data_order"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "progress", "data_order"),
            f"progress.data_order is empty but the run is in progress "
            f"(global_step {progress['global_step']} < total_steps {progress['total_steps']})",
        )


@semantic_rule(DOC, "manifest.data-order-permutation")
def _data_order_permutation(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    order = doc["progress"]["data_order"]
    count = doc["data"]["item_count"]
    if not order:
        return
    if len(order) != count:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "progress", "data_order"),
            f"progress.data_order has {len(order)} entries but data.item_count is {count}",
        )
    elif sorted(order) != list(range(count)):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "progress", "data_order"),
            f"progress.data_order is not a permutation of 0..{count - 1} (repeated or out-of-range indices)",
        )


@semantic_rule(DOC, "manifest.step-agreement")
def _step_agreement(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    step = doc["progress"]["global_step"]
    for section in ("optimizer", "scheduler"):
        if doc[section]["step"] != step:
            yield Problem(
                "inconsistent_fields",
                ptr(at, section, "step"),
                f"{section}.step is {doc[section]['step']} but progress.global_step is {step}",
            )


@semantic_rule(DOC, "manifest.sft-step-accounting")
def _sft_step_accounting(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if doc["training_kind"] != "sft":
        return
    progress, count, config = doc["progress"], doc["data"]["item_count"], doc["effective_config"]
    epochs = config.get("epochs")
    if not _is_int(epochs):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "effective_config", "epochs"),
            f"effective_config.epochs is {epochs!r}; a resolved SFT config names its number of epochs as an integer",
        )
        return
    rows = _step_rows(doc)
    if rows is None:  # manifest.effective-config names the member
        return
    per_epoch = steps_per_epoch(count, rows) if count else 0
    batch = f" at {rows} rows per step" if rows > 1 else ""
    if progress["total_steps"] != epochs * per_epoch:
        what = "ceil(data.item_count / rows per step)" if rows > 1 else "data.item_count"
        yield Problem(
            "inconsistent_fields",
            ptr(at, "progress", "total_steps"),
            f"progress.total_steps is {progress['total_steps']} but effective_config.epochs x {what} "
            f"is {epochs} x {per_epoch} = {epochs * per_epoch}{batch}",
        )
    cursor = progress["cursor_in_epoch"]
    if cursor % rows:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "progress", "cursor_in_epoch"),
            f"progress.cursor_in_epoch ({cursor}) is not a multiple of the {rows} rows per optimizer step: "
            "a checkpoint lies between optimizer steps, never inside a gradient accumulation",
        )
        return
    done = progress["epoch_index"] * per_epoch + cursor // rows
    if progress["global_step"] != done:
        rule = (
            f"epoch_index x steps per epoch + cursor_in_epoch / rows per step is {progress['epoch_index']} x "
            f"{per_epoch} + {cursor} / {rows}"
            if rows > 1
            else f"epoch_index x data.item_count + cursor_in_epoch is {progress['epoch_index']} x {count} + {cursor}"
        )
        yield Problem(
            "inconsistent_fields",
            ptr(at, "progress", "global_step"),
            f"progress.global_step is {progress['global_step']} but {rule} = {done}",
        )


def _step_rows(doc: dict[str, Any]) -> int | None:
    """Rows (OPD: candidates) per optimizer step of a manifest: its effective config's micro-batch and accumulation
    times, for SFT, the data-parallel world size of its planning identity; None when a member is not a positive
    integer."""
    config = doc["effective_config"]
    members = [config.get(name, 1) for name in ("micro_batch_size", "gradient_accumulation_steps")]
    if not all(_is_int(m) and m >= 1 for m in members):
        return None
    return rows_per_step(config, _world_size(doc))


def _world_size(doc: dict[str, Any]) -> int:
    """The data-parallel world size an SFT manifest's planning identity records (1 when it records none)."""
    if doc["training_kind"] != "sft":
        return 1
    aux = doc.get("auxiliary_state")
    planning = aux.get("training_runtime_planning_identity") if isinstance(aux, dict) else None
    plan = planning.get("data_parallel") if isinstance(planning, dict) else None
    world = plan.get("world_size") if isinstance(plan, dict) else None
    return world if isinstance(world, int) and not isinstance(world, bool) and world >= 2 else 1


@semantic_rule(DOC, "manifest.epoch-order")
def _epoch_order(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    if doc["training_kind"] not in ("sft", "opd"):
        return
    stream = doc["rng_states"].get("epoch-order")
    if stream is None or stream["algorithm"] != EPOCH_ORDER_ALGORITHM:
        return
    progress, count = doc["progress"], doc["data"]["item_count"]
    if stream["position"] != progress["epoch_index"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "rng_states", "epoch-order", "position"),
            f"rng_states.epoch-order.position is {stream['position']} but progress.epoch_index is {progress['epoch_index']}",
        )
    order = progress["data_order"]
    if not order or len(order) != count:  # empty: finished; other lengths: manifest.data-order-permutation
        return
    expected = epoch_order(stream["seed"], stream["position"], count)
    rows = _step_rows(doc) if doc["training_kind"] == "sft" else 1
    if rows is not None and doc["training_kind"] == "sft" and doc["effective_config"].get("group_by_length") is True:
        yield from _grouped_order(order, expected, rows, stream, at)
        return
    if order != expected:
        first = next(i for i, (a, b) in enumerate(zip(order, expected, strict=True)) if a != b)
        yield Problem(
            "inconsistent_fields",
            ptr(at, "progress", "data_order"),
            f"progress.data_order is not the {EPOCH_ORDER_ALGORITHM} order of epoch {stream['position']} for seed "
            f"{stream['seed']} and {count} items: index {first} is {order[first]}, the recomputed order has {expected[first]}",
        )


def _grouped_order(
    order: list[int], seeded: list[int], rows: int, stream: dict[str, Any], at: str
) -> Iterator[Problem]:
    """A length-grouped order holds, in each window, exactly the items of the same window of the seeded order."""
    window = group_window(rows)
    for start in range(0, len(order), window):
        if sorted(order[start : start + window]) != sorted(seeded[start : start + window]):
            yield Problem(
                "inconsistent_fields",
                ptr(at, "progress", "data_order"),
                f"progress.data_order positions {start}..{min(start + window, len(order)) - 1} do not hold the items "
                f"of the same positions of the {EPOCH_ORDER_ALGORITHM} order of epoch {stream['position']} for seed "
                f"{stream['seed']} (group_by_length rearranges items only inside windows of {window} positions)",
            )
            return


# -- random streams, configuration, optimizer ----------------------------------------------


@semantic_rule(DOC, "manifest.rng-streams")
def _rng_streams(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    kind, streams = doc["training_kind"], doc["rng_states"]
    for name in REQUIRED_RNG_STREAMS[kind]:
        if name not in streams:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "rng_states", name),
                f"a {kind} checkpoint needs the {name!r} random stream",
            )
    seed = doc["effective_config"].get("seed")
    if "lora-init" in streams and _is_int(seed) and streams["lora-init"]["seed"] != seed:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "rng_states", "lora-init", "seed"),
            f"rng_states.lora-init.seed is {streams['lora-init']['seed']} but the effective seed effective_config.seed is {seed}",
        )


@semantic_rule(DOC, "manifest.effective-config")
def _effective_config(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    config = doc["effective_config"]
    if "resume_checkpoint" in config:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "effective_config", "resume_checkpoint"),
            "the effective config of a checkpoint never carries resume_checkpoint (it is removed when resolving)",
        )
    if not _is_number(config.get("learning_rate")):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "effective_config", "learning_rate"),
            f"effective_config.learning_rate is {config.get('learning_rate')!r}; the resolved learning rate is a finite number",
        )
    seed = config.get("seed")
    if not (_is_int(seed) and 0 <= seed <= U64_MAX):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "effective_config", "seed"),
            f"effective_config.seed is {seed!r}; the effective seed is a JSON integer in 0..2^64-1",
        )
    definition = CONFIG_TYPES.get(doc["training_kind"])
    if definition is not None:
        yield from _embedded_problems(definition, config, ptr(at, "effective_config"), "effective_config")


@semantic_rule(DOC, "manifest.optimizer-agreement")
def _optimizer_agreement(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    optimizer, config = doc["optimizer"], doc["effective_config"]
    kind, settings = optimizer["kind"], optimizer["hyperparameters"]
    configured = config.get("optimizer")
    configured_kind = configured.get("kind") if isinstance(configured, dict) else None
    if configured_kind != kind:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "optimizer", "kind"),
            f"optimizer.kind is {kind!r} but effective_config.optimizer.kind is {configured_kind!r}",
        )
    names = OPTIMIZER_HYPERPARAMETERS[kind]
    for name in names:
        if name not in settings:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "optimizer", "hyperparameters", name),
                f"{kind} hyperparameter {name!r} is missing",
            )
        elif name in BOOLEAN_HYPERPARAMETERS and not isinstance(settings[name], bool):
            yield Problem(
                "inconsistent_fields",
                ptr(at, "optimizer", "hyperparameters", name),
                f"{name} is {settings[name]!r}, not a boolean",
            )
        elif name not in BOOLEAN_HYPERPARAMETERS and not _is_number(settings[name]):
            yield Problem(
                "inconsistent_fields",
                ptr(at, "optimizer", "hyperparameters", name),
                f"{name} is {settings[name]!r}, not a number",
            )
    for name in sorted(set(settings) - set(names)):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "optimizer", "hyperparameters", name),
            f"{name!r} is not a {kind} hyperparameter (expected exactly {', '.join(names)})",
        )
    if configured_kind == kind:
        for name, value in configured.items():
            if name == "kind":
                continue
            if name not in settings:
                yield Problem(
                    "inconsistent_fields",
                    ptr(at, "effective_config", "optimizer", name),
                    f"effective_config.optimizer.{name} is set but optimizer.hyperparameters has no {name}",
                )
            elif not _same_setting(settings[name], value):
                yield Problem(
                    "inconsistent_fields",
                    ptr(at, "optimizer", "hyperparameters", name),
                    f"optimizer.hyperparameters.{name} is {settings[name]!r} but effective_config.optimizer.{name} is {value!r}",
                )
    if _is_number(config.get("learning_rate")):
        rate, source = config["learning_rate"], "effective_config.learning_rate"
        if _is_number(settings.get("learning_rate")) and not _same_setting(settings["learning_rate"], rate):
            yield Problem(
                "inconsistent_fields",
                ptr(at, "optimizer", "hyperparameters", "learning_rate"),
                f"optimizer.hyperparameters.learning_rate is {settings['learning_rate']!r} but {source} is {rate!r}",
            )
    else:  # manifest.effective-config reports the missing rate; still tie the scheduler to the optimizer
        rate, source = settings.get("learning_rate"), "optimizer.hyperparameters.learning_rate"
    schedule = doc["scheduler"]["state"]
    if "learning_rate" not in schedule:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "scheduler", "state", "learning_rate"),
            "scheduler.state.learning_rate is missing",
        )
    elif _is_number(rate) and not _same_setting(schedule["learning_rate"], rate):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "scheduler", "state", "learning_rate"),
            f"scheduler.state.learning_rate is {schedule['learning_rate']!r} but {source} is {rate!r}",
        )


@semantic_rule(DOC, "manifest.optimizer-state-file")
def _optimizer_state_file(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    optimizer, state_files = doc["optimizer"], doc["state_files"]
    if optimizer["kind"] == "sgd":
        if "state_file" in optimizer:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "optimizer", "state_file"),
                "sgd is stateless: optimizer.state_file must be absent",
            )
        if "optimizer_state" in state_files:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "state_files", "optimizer_state"),
                "sgd is stateless: state_files.optimizer_state must be absent",
            )
        for path, entry in doc["files"].items():
            if entry["role"] == "optimizer-state":
                yield Problem(
                    "inconsistent_fields",
                    ptr(at, "files", path, "role"),
                    f"sgd is stateless but {path!r} has role optimizer-state",
                )
        dtype = doc["precision_policy"]["optimizer_state_dtype"]
        if dtype != "none":
            yield Problem(
                "inconsistent_fields",
                ptr(at, "precision_policy", "optimizer_state_dtype"),
                f"sgd is stateless but precision_policy.optimizer_state_dtype is {dtype!r}, not 'none'",
            )
        return
    kind = optimizer["kind"]
    if "state_file" not in optimizer:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "optimizer", "state_file"),
            f"{kind} keeps state: optimizer.state_file is required",
        )
    if "optimizer_state" not in state_files:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "state_files", "optimizer_state"),
            f"{kind} keeps state: state_files.optimizer_state is required",
        )
    if (
        "state_file" in optimizer
        and "optimizer_state" in state_files
        and optimizer["state_file"] != state_files["optimizer_state"]
    ):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "optimizer", "state_file"),
            f"optimizer.state_file is {optimizer['state_file']!r} but state_files.optimizer_state is {state_files['optimizer_state']!r}",
        )


# -- state files ---------------------------------------------------------------------------


@semantic_rule(DOC, "manifest.state-file-roles")
def _state_file_roles(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    files = doc["files"]
    for pointer, field, path, role in _referenced_paths(doc, at):
        if path not in files:
            yield Problem("inconsistent_fields", pointer, f"{field} names {path!r}, which is not listed in files")
        elif files[path]["role"] != role:
            yield Problem(
                "inconsistent_fields",
                ptr(at, "files", path, "role"),
                f"{path!r} has role {files[path]['role']!r} but {field} points at it, which needs role {role!r}",
            )


@semantic_rule(DOC, "manifest.reference-state")
def _reference_state(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    kind, state_files = doc["training_kind"], doc["state_files"]
    if kind == "capability-distillation":
        return
    if kind == "grpo":
        policy = doc["auxiliary_state"].get("reference_policy")
        if (policy == "ema") != ("reference_state" in state_files):
            have = "present" if "reference_state" in state_files else "absent"
            yield Problem(
                "inconsistent_fields",
                ptr(at, "state_files", "reference_state"),
                f"state_files.reference_state is {have} but auxiliary_state.reference_policy is {policy!r} "
                "(an EMA reference, and only it, keeps reference tensors)",
            )
    elif "reference_state" in state_files:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "state_files", "reference_state"),
            f"a {kind} checkpoint has no reference_state",
        )
    for key in ("ema_state", "reward_normalization_state"):
        if key in state_files:
            yield Problem("inconsistent_fields", ptr(at, "state_files", key), f"Kiln's {kind} trainer keeps no {key}")


@semantic_rule(DOC, "grpo-aux.rollout-log")
def _rollout_log(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    """The manifest half of ``grpo-aux.rollout-log``: an online GRPO checkpoint, and only it, holds its rollout log
    (its bytes are checked against the cursor when a run resumes from it: ``kiln.trainers.grpo``)."""
    online = doc["training_kind"] == "grpo" and doc["auxiliary_state"].get("route") == "online"
    if ("rollout_log" in doc["state_files"]) != online:
        have = "present" if "rollout_log" in doc["state_files"] else "absent"
        yield Problem(
            "inconsistent_fields",
            ptr(at, "state_files", "rollout_log"),
            f"state_files.rollout_log is {have} but the checkpoint is "
            + ("an online GRPO run's" if online else "not an online GRPO run's")
            + " (an online run, and only it, keeps its rollout log)",
        )


# -- auxiliary state -----------------------------------------------------------------------


@semantic_rule(DOC, "manifest.auxiliary-state")
def _auxiliary_state(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    definition = AUXILIARY_STATE_TYPES.get(doc["training_kind"])
    if definition is None:  # capability-distillation: not interpreted, resume is refused
        return
    yield from _embedded_problems(definition, doc["auxiliary_state"], ptr(at, "auxiliary_state"), "auxiliary_state")


@semantic_rule(DOC, "manifest.data-source-kind")
def _data_source_kind(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    kind, source_kind, aux = doc["training_kind"], doc["data"]["source_kind"], doc["auxiliary_state"]
    if kind == "sft":
        expected, why = {SFT_SOURCE_KIND}, "sft"
    elif kind == "grpo":
        route = aux.get("route")
        known = isinstance(route, str) and route in GRPO_SOURCE_KINDS  # a schema-valid reader may hold any JSON
        expected = {GRPO_SOURCE_KINDS[route]} if known else set(GRPO_SOURCE_KINDS.values())
        why = f"grpo with auxiliary_state.route {route!r}"
    elif kind == "opd":
        source = aux.get("prompt_source")
        known = isinstance(source, str) and source in OPD_SOURCE_KINDS
        expected = {OPD_SOURCE_KINDS[source]} if known else set(OPD_SOURCE_KINDS.values())
        why = f"opd with auxiliary_state.prompt_source {source!r}"
    else:
        return
    if source_kind not in expected:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "data", "source_kind"),
            f"data.source_kind is {source_kind!r} but {why} needs {' or '.join(sorted(expected))}",
        )


def _precision_binding(doc: dict[str, Any], at: str, kind: str) -> Iterator[Problem]:
    if doc["training_kind"] != kind:
        return
    aux = doc["auxiliary_state"]
    if "training_precision_policy" in aux and aux["training_precision_policy"] != doc["precision_policy"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "auxiliary_state", "training_precision_policy"),
            f"auxiliary_state.training_precision_policy {aux['training_precision_policy']!r} differs from "
            f"precision_policy {doc['precision_policy']!r}",
        )


@semantic_rule(DOC, "sft-aux.precision-binding")
def _sft_precision_binding(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    return _precision_binding(doc, at, "sft")


@semantic_rule(DOC, "grpo-aux.precision-binding")
def _grpo_precision_binding(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    return _precision_binding(doc, at, "grpo")


@semantic_rule(DOC, "opd-aux.precision-binding")
def _opd_precision_binding(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    return _precision_binding(doc, at, "opd")


@semantic_rule(DOC, "grpo-aux.ema-fields")
def _grpo_ema_refresh_bound(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    """The manifest half of ``grpo-aux.ema-fields``: the EMA cursor stays below ``refresh_every``."""
    aux = doc["auxiliary_state"]
    if doc["training_kind"] != "grpo" or aux.get("reference_policy") != "ema":
        return
    cursor = aux.get("ema_groups_since_refresh")
    if not _is_int(cursor):
        return  # absent: reported by the view's half of the rule
    reference = doc["effective_config"].get("kl_reference_policy")
    refresh = reference.get("refresh_every") if isinstance(reference, dict) and reference.get("kind") == "ema" else None
    if not _is_int(refresh):
        yield Problem(
            "inconsistent_fields",
            ptr(at, "effective_config", "kl_reference_policy"),
            f"auxiliary_state.reference_policy is 'ema' but effective_config.kl_reference_policy is {reference!r}, "
            "not an EMA reference with refresh_every",
        )
    elif cursor >= refresh:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "auxiliary_state", "ema_groups_since_refresh"),
            f"auxiliary_state.ema_groups_since_refresh is {cursor} but the EMA reference refreshes every {refresh} groups",
        )


@semantic_rule(DOC, "opd-aux.candidate-cursor")
def _opd_candidate_cursor(doc: dict[str, Any], at: str) -> Iterable[Problem]:
    aux = doc["auxiliary_state"]
    consumed = aux.get("candidates_consumed")
    if doc["training_kind"] != "opd" or not _is_int(consumed):
        return
    progress, count = doc["progress"], doc["data"]["item_count"]
    expected = progress["epoch_index"] * count + progress["cursor_in_epoch"]
    if consumed != expected:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "auxiliary_state", "candidates_consumed"),
            f"auxiliary_state.candidates_consumed is {consumed} but progress.epoch_index x data.item_count + "
            f"progress.cursor_in_epoch is {progress['epoch_index']} x {count} + {progress['cursor_in_epoch']} = {expected}",
        )
    if consumed < progress["global_step"]:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "auxiliary_state", "candidates_consumed"),
            f"auxiliary_state.candidates_consumed ({consumed}) is below progress.global_step ({progress['global_step']}): "
            "every optimizer step consumes a candidate",
        )
    per_step = _step_rows(doc)  # the same product of the same two members
    if per_step is not None and progress["cursor_in_epoch"] % per_step:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "progress", "cursor_in_epoch"),
            f"progress.cursor_in_epoch ({progress['cursor_in_epoch']}) is not a multiple of the {per_step} candidates "
            "per optimizer step: a checkpoint lies between optimizer steps, never inside a gradient accumulation",
        )


# -- rules of the typed auxiliary-state views ------------------------------------------------


@semantic_rule(SFT_AUX, "sft-aux.base-weights-binding")
@semantic_rule(GRPO_AUX, "grpo-aux.base-weights-binding")
@semantic_rule(OPD_AUX, "opd-aux.base-weights-binding")
def _base_weights_binding(aux: dict[str, Any], at: str) -> Iterable[Problem]:
    """The binding only; the embedded manifest's own rules recompute its aggregate and total."""
    aggregate = aux["base_weight_shard_manifest"]["aggregate_sha256"]
    if aux["base_model_weights_sha256"] != aggregate:
        yield Problem(
            "inconsistent_fields",
            ptr(at, "base_model_weights_sha256"),
            f"base_model_weights_sha256 is {aux['base_model_weights_sha256']} but base_weight_shard_manifest.aggregate_sha256 "
            f"is {aggregate}",
        )


@semantic_rule(SFT_AUX, "sft-aux.model-identity-binding")
@semantic_rule(GRPO_AUX, "grpo-aux.model-identity-binding")
@semantic_rule(OPD_AUX, "opd-aux.model-identity-binding")
def _model_identity_binding(aux: dict[str, Any], at: str) -> Iterable[Problem]:
    provenance = aux["execution_provenance"]
    model = provenance["model"]
    for name in MODEL_IDENTITY_FIELDS:
        there = model.get(name)
        if aux[name] != there:
            shown = "absent" if there is None else there
            yield Problem(
                "inconsistent_fields",
                ptr(at, name),
                f"{name} is {aux[name]} but execution_provenance.model.{name} is {shown}",
            )
    for field, section, key in (
        ("kiln_train_version", "build", "package_version"),
        ("backend_runtime.backend", "backend", "name"),
        ("backend_runtime.device", "backend", "device"),
    ):
        parts = field.split(".")
        here = aux[parts[0]] if len(parts) == 1 else aux[parts[0]][parts[1]]
        there = provenance[section][key]
        if here != there:
            yield Problem(
                "inconsistent_fields",
                ptr(at, *parts),
                f"{field} is {here!r} but execution_provenance.{section}.{key} is {there!r}",
            )


def _planning_identity(aux: dict[str, Any], at: str, field: str, schema: str) -> Iterator[Problem]:
    found = aux[field]["schema"]
    if found != schema:
        yield Problem(
            "inconsistent_fields",
            ptr(at, field, "schema"),
            f"{field} is a {found!r} record; this kind needs {schema!r}",
        )


@semantic_rule(SFT_AUX, "sft-aux.planning-identity")
def _sft_planning_identity(aux: dict[str, Any], at: str) -> Iterable[Problem]:
    return _planning_identity(aux, at, "training_runtime_planning_identity", PLANNING_V4)


@semantic_rule(GRPO_AUX, "grpo-aux.planning-identity")
def _grpo_planning_identity(aux: dict[str, Any], at: str) -> Iterable[Problem]:
    return _planning_identity(aux, at, "training_runtime_planning_identity", PLANNING_V3)


@semantic_rule(OPD_AUX, "opd-aux.planning-identity")
def _opd_planning_identity(aux: dict[str, Any], at: str) -> Iterable[Problem]:
    return _planning_identity(aux, at, "checkpoint_planning", PLANNING_V3)


@semantic_rule(GRPO_AUX, "grpo-aux.route-fields")
def _grpo_route_fields(aux: dict[str, Any], at: str) -> Iterable[Problem]:
    cursor = aux["route"] in CURSOR_ROUTES
    for name in ("source_byte_offset", "source_lines_consumed", "consumed_lines_sha256"):
        if (name in aux) != cursor:
            need = "required" if cursor else "not allowed"
            yield Problem("inconsistent_fields", ptr(at, name), f"{name} is {need} with route {aux['route']!r}")


@semantic_rule(GRPO_AUX, "grpo-aux.ema-fields")
def _grpo_ema_fields(aux: dict[str, Any], at: str) -> Iterable[Problem]:
    """The view's half of ``grpo-aux.ema-fields``: the EMA cursor is present exactly with an EMA reference."""
    ema = aux["reference_policy"] == "ema"
    if ("ema_groups_since_refresh" in aux) != ema:
        need = "required" if ema else "not allowed"
        yield Problem(
            "inconsistent_fields",
            ptr(at, "ema_groups_since_refresh"),
            f"ema_groups_since_refresh is {need} with reference_policy {aux['reference_policy']!r}",
        )


def load_checkpoint_manifest(source: pipeline.Source) -> Any:
    return pipeline.load(DOC, source)


def write_checkpoint_manifest(path: str | os.PathLike[str], manifest: Any) -> Path:
    return pipeline.write(DOC, path, manifest)
