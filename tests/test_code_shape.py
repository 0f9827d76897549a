"""The shape the conventions ask of the engine's code, checked rather than hoped for.

* each trainer file reads top to bottom in at most 450 lines (what they share lives in the trainer kit);
* a module above 600 lines says at its top, in one line starting ``Longer than 600 lines:``, why it stays whole;
* ``TRAINERS`` covers exactly the schema's ``TrainingJobType`` values.
"""

from __future__ import annotations

from pathlib import Path

import kiln_contracts

KILN = Path(__file__).resolve().parent.parent / "kiln"


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_each_trainer_file_is_at_most_450_lines():
    sizes = {name: _lines(KILN / "trainers" / f"{name}.py") for name in ("sft", "grpo", "opd")}
    assert all(size <= 450 for size in sizes.values()), sizes


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
