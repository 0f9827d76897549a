"""Shared fixtures. Tests never touch the user's KILN_HOME: every test gets its own."""

from __future__ import annotations

import json

import pytest

ADAPTER_CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "How do I reset my password?"},
                  {"role": "assistant", "content": "Open Settings, choose Security, then Reset password."}]},
    {"messages": [{"role": "user", "content": "Can I change my email?"},
                  {"role": "assistant", "content": "Yes: Settings, Account, Email."}]},
]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """The tests marked ``slow`` run first (a stable sort: the order is the same on every run). pytest-xdist hands
    out tests in this order and an idle worker takes half of the other's queue (``--dist worksteal``), so both
    workers share the long ones and end together, instead of one of them running a long test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _isolated_kiln_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln-home"))
    monkeypatch.delenv("KILN_PATHS_HOME", raising=False)
    monkeypatch.delenv("KILN_MODEL_PATH", raising=False)
    monkeypatch.delenv("KILN_MODEL_ADAPTER_DIR", raising=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The default tiny model (seed 0), written once per test session."""
    from kiln.model import create_tiny

    return create_tiny(tmp_path_factory.mktemp("models") / "kiln-tiny", seed=0)


@pytest.fixture(scope="session")
def trained_adapter(tmp_path_factory, tiny_model_dir):
    """A real Kiln adapter (weights, config, receipt, manifest) named ``bot``, trained once per session.

    Read-only: tests copy it before tampering.
    """
    from kiln.trainers.sft import admit_sft, run_sft

    root = tmp_path_factory.mktemp("trained-adapter")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ADAPTER_CONVERSATIONS), encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_HOME", str(root / "kiln-home"))
        job = admit_sft(
            adapter_name="bot",
            registry=root / "adapters",
            config={"epochs": 1, "seed": 7},
            dataset_path=data,
            model_path=str(tiny_model_dir),
        )
        result = run_sft(job)
    assert result.status == "success"
    return result.adapter_dir


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny teacher for OPD: the student's tokenizer, other weights."""
    from kiln.model import create_tiny

    return create_tiny(tmp_path_factory.mktemp("teacher") / "teacher", seed=2)


@pytest.fixture
def teachers(tmp_path, teacher_dir):
    """A teacher registry holding ``tutor``, the local tiny teacher."""
    from kiln.teachers import TeacherRegistry

    root = tmp_path / "teachers"
    TeacherRegistry(root).add({"alias": "tutor", "kind": "local", "model_id": str(teacher_dir)})
    return root
