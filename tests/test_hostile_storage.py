"""A file system that refuses Kiln's writes (issue "Nothing lost", item 6): the truth, not ``internal_error``.

* A checkpoint or an adapter whose publication the file system refuses (read-only, no space left, a name too long)
  ends the run ``failed`` with a receipt ``storage_error`` whose message names the path and the condition, and
  leaves nothing half-published visible;
* when not even that failed receipt can be written, the run raises ``RegistryError`` (``registry_unwritable``)
  saying why it failed and why its receipt is missing;
* admission refuses a registry ``writable_problem`` reports unwritable; ``writable_problem(probe=True)`` sees a full
  or read-only file system even as root;
* the server: ``/health`` is ``degraded`` with ``registry_writable`` failing and naming the registry, and a job
  whose publication is refused fails ``storage_error:`` (or ``registry_unwritable:``), never ``internal_error:``.

We run as root, where ``chmod`` makes nothing unwritable, and CI cannot mount a read-only or full file system: the
refusal is simulated at the narrowest point -- ``os.open``/``os.mkdir``/``os.rename`` for paths in the refused
place, safetensors' ``serialize_file`` (which writes the weights from Rust and reports I/O errors as
``SafetensorError`` text, exactly as shown below), ``tempfile.mkstemp``/``os.write`` for the probe -- raising the
``OSError`` the kernel would.
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln import contracts
from kiln.adapters import list_adapters
from kiln.artifacts.replay_log import pending_log
from kiln.checkpoints import list_checkpoints
from kiln.errors import RegistryError
from kiln.host.fs import writable_problem
from kiln.trainers import TRAINERS, TrainingContext

ADAPTER = "bot"
ROWS = [
    {"messages": [{"role": "user", "content": f"How do I open panel {i}?"},
                  {"role": "assistant", "content": f"Press F{i}, then choose Open."}]}
    for i in range(2)
]  # fmt: skip
CHECKPOINT_EVERY_STEP = {"epochs": 1, "seed": 11, "checkpoint_interval": 1}
NO_CHECKPOINT = {"epochs": 1, "seed": 11, "checkpoint_interval": len(ROWS)}  # none: the last step publishes the adapter
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
CONDITION = {
    errno.EROFS: "Read-only file system (EROFS)",
    errno.ENOSPC: "No space left on device (ENOSPC)",
    errno.ENAMETOOLONG: "File name too long (ENAMETOOLONG)",
}
# what safetensors 0.x raises when the disk fills while it writes the weights (seen on a full tmpfs)
SAFETENSORS_ENOSPC = "Error while serializing: I/O error: No space left on device (os error 28)"


# ----------------------------------------------------------------------------- the refusing file system


class Refusal:
    """The file system refusing, with ``err``, every write Kiln makes to a path ``where(path)`` accepts: creating or
    opening a file for writing, creating a directory, renaming or linking into it. ``refused`` lists the paths."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, err: int, where: Callable[[Path], bool], *, mkdir: bool = True
    ) -> None:
        self.err, self.where, self.refused = err, where, []
        real_open, real_mkdir, real_rename, real_replace, real_link = os.open, os.mkdir, os.rename, os.replace, os.link

        def refuse(path: object) -> None:
            if isinstance(path, int):
                return
            target = Path(os.fsdecode(path))  # a dir_fd-relative name (rmtree) is not absolute: never refused
            if target.is_absolute() and self.where(target):
                self.refused.append(target)
                raise OSError(err, os.strerror(err), str(target))

        def fake_open(path, flags, *args, **kwargs):
            if flags & WRITE_FLAGS and kwargs.get("dir_fd") is None:
                refuse(path)
            return real_open(path, flags, *args, **kwargs)

        def fake_mkdir(path, *args, **kwargs):
            if kwargs.get("dir_fd") is None and not os.path.lexists(path):  # an existing one: EEXIST, as the kernel
                refuse(path)
            return real_mkdir(path, *args, **kwargs)

        def fake_rename(real):
            def rename(src, dst, *args, **kwargs):
                refuse(dst)
                return real(src, dst, *args, **kwargs)

            return rename

        monkeypatch.setattr(os, "open", fake_open)
        if mkdir:  # a full file system may still make a directory (tmpfs does): ``mkdir=False``
            monkeypatch.setattr(os, "mkdir", fake_mkdir)
        monkeypatch.setattr(os, "rename", fake_rename(real_rename))
        monkeypatch.setattr(os, "replace", fake_rename(real_replace))
        monkeypatch.setattr(os, "link", fake_rename(real_link))


def _inside(root: Path) -> Callable[[Path], bool]:
    return lambda path: path.is_relative_to(root) and path != root


def _in_staging_of(prefix: str) -> Callable[[Path], bool]:
    """Files inside a hidden staging directory whose name starts with ``prefix`` (the directory itself is made)."""
    return lambda path: path.parent.name.startswith(prefix)


def _full_disk_for_weights(monkeypatch: pytest.MonkeyPatch, root: Path) -> list[str]:
    """safetensors' own writer failing as it does on a full disk, for weights written below ``root``."""
    import safetensors.torch
    from safetensors import SafetensorError

    real, refused = safetensors.torch.serialize_file, []

    def serialize_file(tensors, filename, *args, **kwargs):
        if Path(os.fsdecode(filename)).is_relative_to(root):
            refused.append(str(filename))
            raise SafetensorError(SAFETENSORS_ENOSPC)
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "serialize_file", serialize_file)
    return refused


def _read_only_for_probe(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """``tempfile.mkstemp`` in ``directory`` refused as on a read-only mount (the probe's first call)."""
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, **kwargs):
        where = kwargs.get("dir")
        if where is not None and Path(where) == directory:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(Path(where) / ".kiln-write-probe.x"))
        return real_mkstemp(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)


# ----------------------------------------------------------------------------- runs


def _admit(registry: Path, model: Path, config: dict):
    context = TrainingContext(registry=registry, model_path=str(model))
    return TRAINERS["sft"].admit({"examples": ROWS, "config": dict(config)}, adapter_name=ADAPTER, context=context)


def _visible(registry: Path) -> list[str]:
    """What is in a directory, but the request log a run keeps beside its adapter for a resume (by design)."""
    kept = pending_log(registry, ADAPTER).name
    return sorted(n for n in os.listdir(registry) if n != kept) if registry.exists() else []


def _check_failed_receipt(result, registry: Path) -> dict:
    """The run's failed receipt: valid, on disk alone at the adapter's name, ``storage_error``."""
    assert result.status == "failed"
    receipt = result.receipt
    assert receipt["status"] == "failed"
    assert receipt["failure_reason"] == "storage_error", receipt["failure_message"]
    assert contracts.problems("TrainReceipt", receipt) == []
    assert result.receipt_path == registry / ADAPTER / "train_receipt.json"
    contracts.load("TrainReceipt", result.receipt_path)  # the strict loader accepts it
    assert json.loads(result.receipt_path.read_text(encoding="utf-8")) == receipt
    assert _visible(registry / ADAPTER) == ["train_receipt.json"], "no serving file is visible"
    [entry] = list_adapters(registry)["available"]
    assert entry["name"] == ADAPTER
    assert entry["status"] == "invalid"  # a failed attempt: only its receipt is kept
    return receipt


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC, errno.ENAMETOOLONG], ids=errno.errorcode.get)
def test_a_checkpoint_the_file_system_refuses_fails_the_run_storage_error_naming_the_path(
    tmp_path, tiny_model_dir, monkeypatch, err
):
    registry = tmp_path / "adapters"
    job = _admit(registry, tiny_model_dir, CHECKPOINT_EVERY_STEP)
    refusal = Refusal(monkeypatch, err, _in_staging_of(f".{ADAPTER}-checkpoint-step-"))

    result = TRAINERS["sft"].run(job)

    receipt = _check_failed_receipt(result, registry)
    message = receipt["failure_message"]
    assert message.startswith(f"publishing checkpoint {ADAPTER}-checkpoint-step-00000001.kiln-checkpoint in {registry}")
    assert CONDITION[err] in message
    named = re.search(r" at (\S+)$", message)
    assert named is not None, message
    assert Path(named[1]) in refusal.refused, f"the message names the refused path: {message}"
    assert len(result.losses) == 1  # it stopped at the first checkpoint
    # no half checkpoint: neither a visible one nor its hidden staging directory
    assert list_checkpoints(registry, ADAPTER) == []
    assert _visible(registry) == [ADAPTER]
    assert result.checkpoints == []


@pytest.mark.parametrize("refused", ["weights", "receipt"])
def test_no_space_while_publishing_the_adapter_fails_the_run_storage_error_with_no_visible_adapter(
    tmp_path, tiny_model_dir, monkeypatch, refused
):
    registry = tmp_path / "adapters"
    job = _admit(registry, tiny_model_dir, NO_CHECKPOINT)
    if refused == "weights":
        paths = _full_disk_for_weights(monkeypatch, registry)
    else:  # the staged receipt's temp file
        refusal = Refusal(
            monkeypatch,
            errno.ENOSPC,
            lambda p: _in_staging_of(f".{ADAPTER}.incomplete-")(p) and p.name.startswith(".train_receipt.json."),
        )
        paths = refusal.refused

    result = TRAINERS["sft"].run(job)

    receipt = _check_failed_receipt(result, registry)
    message = receipt["failure_message"]
    assert message.startswith(f"publishing adapter {ADAPTER!r} to {registry / ADAPTER}: "), message
    assert CONDITION[errno.ENOSPC] in message, message
    [path] = paths
    assert f"at {path}" in message, message
    assert Path(path).parent.parent == registry
    assert Path(path).parent.name.startswith(f".{ADAPTER}.incomplete-")
    assert len(result.losses) == len(ROWS)  # training completed; only the publication was refused
    assert _visible(registry) == [ADAPTER], "the staging directory is removed"
    assert result.manifest_path is None


@pytest.mark.parametrize("err", [errno.EROFS, errno.ENOSPC], ids=["read-only", "full"])
def test_a_run_whose_failed_receipt_cannot_be_written_raises_registry_unwritable_saying_both_whys(
    tmp_path, tiny_model_dir, monkeypatch, err
):
    registry = tmp_path / "adapters"
    registry.mkdir()
    job = _admit(registry, tiny_model_dir, CHECKPOINT_EVERY_STEP)
    # after admission the registry turns read-only, or fills up (directories can still be made, files cannot)
    Refusal(monkeypatch, err, _inside(registry), mkdir=err == errno.EROFS)

    with pytest.raises(RegistryError) as raised:
        TRAINERS["sft"].run(job)

    error = raised.value
    assert error.code == "registry_unwritable"
    # why the run failed (its request record, written before the first step, is the first write refused) ...
    assert f"the run of adapter {ADAPTER!r} failed (storage_error: writing the request log of adapter " in error.message
    # ... and why its receipt is missing
    assert f"its failed receipt could not be written to {registry / ADAPTER}: " in error.message
    assert error.message.count(CONDITION[err]) == 2, error.message
    assert str(registry) in (error.hint or "")
    assert _visible(registry) == []  # nothing at all was published, not even an empty directory at the name


@pytest.mark.parametrize("read_only", [True, False], ids=["read-only", "permission-denied"])
def test_admission_refuses_a_registry_that_cannot_be_written(tmp_path, tiny_model_dir, monkeypatch, read_only):
    registry = tmp_path / "adapters"
    registry.mkdir()
    real_access, real_statvfs = os.access, os.statvfs

    def access(path, mode, *args, **kwargs):
        return False if Path(path) == registry and mode & os.W_OK else real_access(path, mode, *args, **kwargs)

    class ReadOnly:
        f_flag = os.ST_RDONLY

    monkeypatch.setattr(os, "access", access)
    if read_only:
        monkeypatch.setattr(os, "statvfs", lambda path: ReadOnly() if Path(path) == registry else real_statvfs(path))

    with pytest.raises(RegistryError) as raised:
        _admit(registry, tiny_model_dir, NO_CHECKPOINT)

    assert raised.value.code == "registry_unwritable"
    condition = CONDITION[errno.EROFS] if read_only else "Permission denied (EACCES)"
    assert raised.value.message == (
        f"adapter {ADAPTER!r} cannot be published: cannot create a file in {registry}: {condition}"
    )
    assert _visible(registry) == []


# ----------------------------------------------------------------------------- writable_problem


def test_writable_problem_is_none_for_a_writable_directory_and_one_not_made_yet(tmp_path):
    assert writable_problem(tmp_path) is None
    assert writable_problem(tmp_path, probe=True) is None
    assert writable_problem(tmp_path / "not" / "made", probe=True) is None
    assert _visible(tmp_path) == [], "the probe removes its file"


def test_writable_problem_probe_reports_a_full_file_system_naming_the_directory(tmp_path, monkeypatch):
    real_mkstemp, real_write, probes = tempfile.mkstemp, os.write, []

    def mkstemp(*args, **kwargs):
        fd, path = real_mkstemp(*args, **kwargs)
        probes.append(fd)
        return fd, path

    def write(fd, data):
        if fd in probes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(os, "write", write)
    assert writable_problem(tmp_path) is None  # os.access cannot see a full disk ...
    assert writable_problem(tmp_path, probe=True) == f"cannot create a file in {tmp_path}: {CONDITION[errno.ENOSPC]}"
    assert probes, "the probe wrote"
    assert _visible(tmp_path) == [], "the probe removes its file"


def test_writable_problem_probe_reports_a_read_only_file_system_naming_the_nearest_directory(tmp_path, monkeypatch):
    _read_only_for_probe(monkeypatch, tmp_path)
    expected = f"cannot create a file in {tmp_path}: {CONDITION[errno.EROFS]}"
    assert writable_problem(tmp_path, probe=True) == expected
    assert writable_problem(tmp_path / "registry" / "not-made", probe=True) == expected  # where it would be made


# ----------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def http(tmp_path_factory, tiny_model_dir):
    """An in-process server on the tiny model, with its registry made; it trains in its own thread
    (``training.worker = "thread"``), so the storage faults these tests patch in reach the trainer."""
    from fastapi.testclient import TestClient

    from kiln.host.config import resolve_settings
    from kiln.server._app import build_server, create_app

    home = tmp_path_factory.mktemp("serve") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(home))
        settings = resolve_settings(
            {"paths.home": str(home), "model.path": str(tiny_model_dir), "training.worker": "thread"}
        )
        settings.registry.mkdir(parents=True)
        with TestClient(create_app(build_server(settings))) as client:
            client.registry = settings.registry
            yield client


def _health(http) -> tuple[int, dict]:
    answer = http.get("/health")
    body = answer.json()
    assert contracts.problems("HealthResponse", body) == []
    return answer.status_code, body


def _submit(http, name: str) -> str:
    answer = http.post("/v1/train/sft", json={"examples": ROWS, "config": {**NO_CHECKPOINT, "output_name": name}})
    assert answer.status_code == 200, answer.text
    return answer.json()["job_id"]


def _finished(http, job_id: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        detail = http.get(f"/v1/train/jobs/{job_id}").json()
        if detail["state"] in ("completed", "failed", "cancelled"):
            return detail
        time.sleep(0.05)  # polling the state, bounded by the deadline
    raise AssertionError(f"job {job_id} did not finish within {timeout} s: {detail}")


def test_health_reports_an_unwritable_registry_as_degraded_naming_it(http, monkeypatch):
    status, body = _health(http)
    assert (status, body["status"]) == (200, "ok"), body
    [check] = [c for c in body["checks"] if c["name"] == "registry_writable"]
    assert check == {"name": "registry_writable", "pass": True}

    _read_only_for_probe(monkeypatch, http.registry)
    status, body = _health(http)
    assert (status, body["status"]) == (503, "degraded"), body
    failing = [c for c in body["checks"] if not c["pass"]]
    assert [c["name"] for c in failing] == ["registry_writable"], failing
    assert failing[0]["detail"].startswith(f"cannot create a file in {http.registry}: {CONDITION[errno.EROFS]}")
    assert http.head("/health").status_code == 503

    monkeypatch.undo()
    assert _health(http)[0] == 200


def test_a_job_whose_publication_is_refused_fails_storage_error_over_http(http, monkeypatch):
    refused = _full_disk_for_weights(monkeypatch, http.registry)
    detail = _finished(http, _submit(http, "full-disk"))
    assert detail["state"] == "failed"
    assert detail["error"].startswith("storage_error: publishing adapter 'full-disk'"), detail["error"]
    assert CONDITION[errno.ENOSPC] in detail["error"]
    assert f"at {refused[0]}" in detail["error"]
    assert detail["train_receipt"]["failure_reason"] == "storage_error"
    assert _visible(http.registry / "full-disk") == ["train_receipt.json"]


def test_a_job_whose_receipt_cannot_be_written_fails_registry_unwritable_over_http(http, monkeypatch):
    Refusal(monkeypatch, errno.EROFS, _inside(http.registry))  # admission writes nothing there: os.access passes
    detail = _finished(http, _submit(http, "read-only"))
    assert detail["state"] == "failed"
    assert detail["error"].startswith("registry_unwritable: the run of adapter 'read-only' failed (storage_error:")
    assert not detail["error"].startswith("internal_error")
    assert not (http.registry / "read-only").exists()


def test_a_job_for_an_unwritable_registry_is_refused_at_admission_over_http(http, monkeypatch):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if Path(p) == http.registry else real_access(p, m))
    answer = http.post("/v1/train/sft", json={"examples": ROWS, "config": {**NO_CHECKPOINT, "output_name": "nope"}})
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "registry_unwritable"
    assert str(http.registry) in error["message"]
