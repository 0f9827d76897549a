"""What a training request may read -- its dataset file and its warm-start adapter -- checked before anything is
opened, for every kind and at every admission (the server's, the worker's re-admission at dequeue, ``--local``).

* ``dataset_path``: absolute and without ``..``. When the caller restricts reads (``TrainingContext.data_roots``:
  the server passes its ``training.data_roots``; ``--local`` passes None and reads the user's own files), its real
  path -- every symlink resolved -- must lie inside one of the roots. That is decided before the file is opened
  or even looked at, so a refusal says nothing about the file: not whether it exists, nor its size, rows, digests
  or where a symlink points. Only then must it be a regular file.
* ``online.tasks_path``: as ``dataset_path``. ``online.scorer``: when reads are restricted (a server), only a
  builtin scorer -- a request never names a path, command, module or URL the server would run.
* ``config.base_adapter``: when reads are restricted, an adapter of the registry -- a registry name, or an
  absolute path whose real path is a direct child of the registry. Always, it must hold
  ``adapter_model.safetensors`` when the job is admitted (a run that finds it gone later still fails
  ``base_adapter_missing``).

Refusals of a path outside what the caller allows raise ``AccessError`` (``path_not_allowed``, HTTP 403).
"""

from __future__ import annotations

import os
from pathlib import Path

from kiln.adapters import WEIGHTS_FILE, AdapterDirectory, base_adapter_dir
from kiln.errors import AccessError, ContractError, Problem, RequestError
from kiln.host.fs import name_problem, unsafe_path_problem, within_roots
from kiln.trainers._admission import TrainingContext

__all__ = ["check_sources"]


def check_sources(
    context: TrainingContext,
    *,
    dataset_path: str | None,
    base_adapter: str | None,
    tasks_path: str | None = None,
    scorer: str | None = None,
) -> None:
    """Refuse a ``dataset_path``, ``base_adapter``, online ``tasks_path`` or ``scorer`` the caller does not allow,
    or that is not there."""
    roots = context.data_roots
    if dataset_path is not None:
        _check_dataset_path(dataset_path, roots)
    if tasks_path is not None:
        _check_dataset_path(tasks_path, roots, field="online.tasks_path", pointer="/online/tasks_path")
    if scorer is not None and roots is not None and not scorer.startswith(BUILTIN_PREFIX):
        # a server runs no scorer a request names: no path, command, module or URL comes from a request
        raise AccessError(
            f"scorer {scorer!r} is not one this server runs: a request may name only a builtin scorer "
            "(builtin:exact, builtin:regex, builtin:json)",
            pointer="/online/scorer",
            hint="use a builtin scorer, or run the job with `kiln train grpo --local`, which runs any scorer",
        )
    if base_adapter:
        _check_base_adapter(base_adapter, context.registry, restricted=roots is not None)


BUILTIN_PREFIX = "builtin:"


def _check_dataset_path(
    path: str, roots: tuple[Path, ...] | None, *, field: str = "dataset_path", pointer: str = "/dataset_path"
) -> None:
    unsafe = unsafe_path_problem(path)
    if unsafe is not None:
        raise ContractError([Problem("unsafe_path", pointer, f"{field} {unsafe}")])
    if roots is not None and not within_roots(path, roots):
        listed = ", ".join(str(r) for r in roots) or "none are configured"
        raise AccessError(
            f"{field} {path!r} is not inside the server's data roots: the server reads training files only "
            f"inside training.data_roots ({listed}), every symlink resolved",
            pointer=pointer,
            hint="upload the file (POST /v1/datasets; `kiln train … -f FILE` does it for you) and send the "
            f"{field} it answers, or ask the operator to add its directory to training.data_roots",
        )
    if not os.path.isfile(path):
        raise RequestError(
            f"{field} {path} is not a readable regular file on the server",
            code="training_invalid_request",
            pointer=pointer,
        )


def _check_base_adapter(base: str, registry: Path, *, restricted: bool) -> None:
    if restricted and name_problem(base, kind="adapter") is not None:
        inside = os.path.isabs(base) and os.path.dirname(os.path.realpath(base)) == os.path.realpath(registry)
        if not inside:
            raise AccessError(
                f"base_adapter {base!r} is not an adapter of this server's registry: a warm start reads only "
                f"adapters in {registry}, named by their registry name",
                pointer="/config/base_adapter",
                hint="name an adapter that `GET /v1/adapters` lists",
            )
    weights = AdapterDirectory(base_adapter_dir(registry, base)).weights_path
    if not weights.is_file():
        raise RequestError(
            f"base_adapter {base!r} has no {WEIGHTS_FILE}" + ("" if restricted else f" ({weights} does not exist)"),
            code="training_invalid_request",
            pointer="/config/base_adapter",
            hint="name an existing adapter (`kiln adapters list`), or omit base_adapter to start from fresh LoRA "
            "weights",
        )
