"""The shape the conventions ask of the engine's code, checked rather than hoped for.

* each trainer is one file read top to bottom: its run is an object (``<Kind>Run``) whose ``train`` goes setup ->
  loop -> publication, run under the kit's failure contract, with its state in typed attributes -- no closures over
  a shared dict (``nonlocal``);
* what the trainers share are components, not per-kind helper modules: every private module of ``kiln.trainers`` is
  used by more than one trainer, or by the kit itself;
* a module above 600 lines says at its top, in one line starting ``Longer than 600 lines:``, why it stays whole;
* ``TRAINERS`` covers exactly the schema's ``TrainingJobType`` values.
"""

from __future__ import annotations

import ast
from pathlib import Path

import kiln_contracts
import pytest

KILN = Path(__file__).resolve().parent.parent / "kiln"
TRAINER_FILES = {"sft": "SftRun", "grpo": "GrpoRun", "opd": "OpdRun"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _imported(path: Path) -> set[str]:
    """The modules ``path`` imports (``from kiln.x import y`` counts ``kiln.x``)."""
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


@pytest.mark.parametrize("kind", sorted(TRAINER_FILES))
def test_each_trainer_runs_as_an_object_with_typed_state_under_the_kit(kind):
    tree = _tree(KILN / "trainers" / f"{kind}.py")
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    run = classes.get(TRAINER_FILES[kind])
    assert run is not None, f"{kind}.py has no {TRAINER_FILES[kind]}"
    methods = {node.name for node in run.body if isinstance(node, ast.FunctionDef)}
    assert {"train", "failed_receipt"} <= methods
    entry = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == f"run_{kind}")
    called = {n.func.id for n in ast.walk(entry) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert "guarded" in called, f"run_{kind} does not run under the kit's failure contract"
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Nonlocal | ast.Global)], "state shared by closures"


def test_the_trainers_share_components_not_per_kind_helper_modules():
    trainers = {kind: _imported(KILN / "trainers" / f"{kind}.py") for kind in TRAINER_FILES}
    private = sorted(p.stem for p in (KILN / "trainers").glob("_*.py") if p.stem != "__init__")
    kit = {module for path in (KILN / "trainers").glob("_*.py") for module in _imported(path)}
    kit |= _imported(KILN / "trainers" / "__init__.py")
    for name in private:
        module = f"kiln.trainers.{name}"
        users = [kind for kind, imports in trainers.items() if module in imports]
        assert len(users) > 1 or module in kit, f"{module} is a helper of {users or 'no trainer'} alone"


def test_a_module_above_600_lines_says_why_at_its_top():
    unexplained = []
    for path in sorted(KILN.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if len(text.splitlines()) > 600 and "Longer than 600 lines:" not in "\n".join(text.splitlines()[:40]):
            unexplained.append(f"{path.relative_to(KILN.parent)} ({len(text.splitlines())} lines)")
    assert unexplained == []


def test_the_trainer_registry_covers_every_training_job_type():
    from kiln.trainers import TRAINERS

    kinds = kiln_contracts.load_bundle()["$defs"]["TrainingJobType"]["enum"]
    assert sorted(TRAINERS) == sorted(kinds)
    for kind, trainer in TRAINERS.items():
        assert trainer.kind == kind
        assert trainer.request_type in kiln_contracts.load_bundle()["$defs"], trainer.request_type
