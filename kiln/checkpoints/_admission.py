"""Resume admission: does this checkpoint continue *this* run?

The trainer builds the identity of the new request with the same code that writes
manifests (everything but progress, file digests and the time), and
``incompatibilities`` compares the two field by field. Every difference is reported by
its path (``effective_config.learning_rate differs: 0.0001 (checkpoint) != 0.0002 (this
run)``); any difference refuses the resume with ``checkpoint_incompatible``.

What is compared: training kind and adapter, the effective configuration (exact JSON
equality, so booleans are not numbers), data route, digest and size, optimizer kind and
hyperparameters, scheduler, precision, every random stream's algorithm and seed, total
steps, and the whole auxiliary state (model config, tokenizer, templates, execution
provenance, planning identity, ingestion bindings). Base weights are compared by content:
the checkpoint's shards must each have a byte-identical shard (same SHA-256 and size) in
the model now, and no other shard may appear, so a relocated or renamed shard is fine
and a changed byte is not.

One deliberate exception: the execution provenance is compared member by member except
``configuration.effective_environment_sha256`` (and the self-digest that covers it). The
``KILN_*`` variables it digests name locations (``KILN_HOME``, ``KILN_MODEL_PATH``,
``KILN_MODEL_ADAPTER_DIR``), and the spec lets a resume relocate the model; every
setting that changes the numbers is bound elsewhere (effective configuration, model
bytes, runtime digest, source tree).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from kiln.errors import CheckpointError, Problem

__all__ = ["incompatibilities", "require_compatible"]

_SHARDS = ("auxiliary_state", "base_weight_shard_manifest")


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= 120 else text[:117] + "..."


class _Absent:
    pass


_ABSENT = _Absent()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, float) or isinstance(b, float):
        return type(a) is type(b) and a == b
    return a == b


def _diff(a: Any, b: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            yield from _diff(a.get(key, _ABSENT), b.get(key, _ABSENT), (*path, str(key)))
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and any(isinstance(x, dict) for x in a):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            yield from _diff(x, y, (*path, str(i)))
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b) or not all(_same(x, y) for x, y in zip(a, b, strict=True)):
            yield path, a, b
    elif not _same(a, b):
        yield path, a, b


def _shard_problems(old: dict[str, Any], new: dict[str, Any]) -> Iterator[Problem]:
    before = {(s["sha256"], s["size_bytes"]): s["filename"] for s in old["shards"]}
    after = {(s["sha256"], s["size_bytes"]): s["filename"] for s in new["shards"]}
    for key, name in sorted(before.items(), key=lambda kv: kv[1]):
        if key not in after:
            yield Problem(
                "auxiliary_state.base_weight_shard_manifest",
                "/auxiliary_state/base_weight_shard_manifest",
                f"auxiliary_state.base_weight_shard_manifest differs: shard {name} ({key[0]}, {key[1]} bytes) "
                "has no byte-identical shard in the model now",
            )
    for key, name in sorted(after.items(), key=lambda kv: kv[1]):
        if key not in before:
            yield Problem(
                "auxiliary_state.base_weight_shard_manifest",
                "/auxiliary_state/base_weight_shard_manifest",
                f"auxiliary_state.base_weight_shard_manifest differs: the model now has shard {name} ({key[0]}, "
                f"{key[1]} bytes), which the checkpoint was not trained with",
            )


def _without_environment(aux: dict[str, Any]) -> dict[str, Any]:
    provenance = aux.get("execution_provenance")
    if not isinstance(provenance, dict):
        return aux
    provenance = {k: v for k, v in provenance.items() if k != "provenance_sha256"}
    configuration = provenance.get("configuration")
    if isinstance(configuration, dict):
        provenance["configuration"] = {k: v for k, v in configuration.items() if k != "effective_environment_sha256"}
    return {**aux, "execution_provenance": provenance}


_PLANNING_KEYS = ("training_runtime_planning_identity", "checkpoint_planning")  # SFT and GRPO | OPD
_PLAN = "data_parallel"


def _planning_key(aux: dict[str, Any]) -> str | None:
    """Where a checkpoint's ``auxiliary_state`` keeps its planning identity (None: it has none)."""
    return next((key for key in _PLANNING_KEYS if isinstance(aux.get(key), dict)), None)


def _plan(aux: dict[str, Any]) -> Any:
    """A checkpoint's data-parallel plan; a single process (no plan recorded) is world size 1."""
    key = _planning_key(aux)
    if key is None:
        return _ABSENT
    return aux[key].get(_PLAN, {"world_size": 1})


def _without_plan(aux: dict[str, Any]) -> dict[str, Any]:
    key = _planning_key(aux)
    if key is None:
        return aux
    return {**aux, key: {k: v for k, v in aux[key].items() if k != _PLAN}}


def _data_parallel_problems(old: dict[str, Any], new: dict[str, Any]) -> Iterator[Problem]:
    """The world size first (the one a user changes), then the rest of the data-parallel plan by member."""
    a, b = _plan(old), _plan(new)
    if not isinstance(a, dict) or not isinstance(b, dict):
        return
    planning = ("auxiliary_state", _planning_key(old) or _PLANNING_KEYS[0], _PLAN)
    world_a, world_b = a.get("world_size"), b.get("world_size")
    if world_a != world_b:
        world = (*planning, "world_size")
        yield Problem(
            ".".join(world),
            "/" + "/".join(world),
            f"{'.'.join(world)} differs: {_show(world_a)} (checkpoint) != {_show(world_b)} (this run): the checkpoint "
            f"was trained by {world_a} rank(s) and resumes only at that world size (nodes x nproc_per_node)",
        )
        return
    for path, x, y in _diff(a, b, planning):
        dotted = ".".join(path)
        yield Problem(
            dotted, "/" + "/".join(path), f"{dotted} differs: {_show(x)} (checkpoint) != {_show(y)} (this run)"
        )


SECTIONS = (
    ("training_kind",),
    ("adapter_name",),
    ("effective_config",),
    ("data",),
    ("optimizer", "kind"),
    ("optimizer", "hyperparameters"),
    ("scheduler", "kind"),
    ("scheduler", "state"),
    ("precision_policy",),
    ("rng_states",),
    ("progress", "total_steps"),
    ("auxiliary_state",),
)


def _get(doc: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(doc, dict) or key not in doc:
            return _ABSENT
        doc = doc[key]
    return doc


def incompatibilities(checkpoint: dict[str, Any], current: dict[str, Any]) -> list[Problem]:
    """Every difference between a checkpoint manifest and the identity of the run to resume.

    ``current`` is shaped like a manifest; ``rng_states`` positions are progress, not
    identity, and are ignored. Each problem's ``code`` is the dotted field path.
    """
    found: list[Problem] = []
    old_aux, new_aux = _get(checkpoint, ("auxiliary_state",)), _get(current, ("auxiliary_state",))
    if isinstance(old_aux, dict) and isinstance(new_aux, dict):  # first: a world size changes the step counts too
        found.extend(_data_parallel_problems(old_aux, new_aux))
    for section in SECTIONS:
        old, new = _get(checkpoint, section), _get(current, section)
        if section == ("rng_states",) and isinstance(old, dict) and isinstance(new, dict):
            old = {k: {f: v for f, v in s.items() if f != "position"} for k, s in old.items()}
            new = {k: {f: v for f, v in s.items() if f != "position"} for k, s in new.items()}
        if section == ("auxiliary_state",) and isinstance(old, dict) and isinstance(new, dict):
            shards_old, shards_new = old.get(_SHARDS[1]), new.get(_SHARDS[1])
            if isinstance(shards_old, dict) and isinstance(shards_new, dict):
                found.extend(_shard_problems(shards_old, shards_new))
                old = {k: v for k, v in old.items() if k != _SHARDS[1]}
                new = {k: v for k, v in new.items() if k != _SHARDS[1]}
        if section == ("auxiliary_state",) and isinstance(old, dict) and isinstance(new, dict):
            old, new = _without_environment(old), _without_environment(new)
            old, new = _without_plan(old), _without_plan(new)
        for path, a, b in _diff(old, new, section):
            dotted = ".".join(path)
            found.append(
                Problem(
                    dotted,
                    "/" + "/".join(p.replace("~", "~0").replace("/", "~1") for p in path),
                    f"{dotted} differs: {_show(a)} (checkpoint) != {_show(b)} (this run)",
                )
            )
    return found


def require_compatible(name: str, checkpoint: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise ``checkpoint_incompatible`` naming every difference, or return."""
    found = incompatibilities(checkpoint, current)
    if not found:
        return
    more = f" (and {len(found) - 1} more: {', '.join(p.code for p in found[1:6])}{', ...' if len(found) > 6 else ''})"
    raise CheckpointError(
        f"{name} cannot resume this run: {found[0].message}" + (more if len(found) > 1 else ""),
        code="checkpoint_incompatible",
        reason=found[0].code,
        pointer=found[0].pointer,
        problems=found,
        hint="resume with exactly the inputs and settings the checkpoint was written with, or start a fresh run "
        "without --resume-checkpoint; treat this as drift, never edit the checkpoint",
    )
