"""Progress wherever a person waits: stage lines before each long step, and counters that in a non-terminal print
whole lines at a bounded rate (``kiln.host.progress``)."""

from __future__ import annotations

import io

import pytest

from kiln.cli import main
from kiln.host import progress
from kiln.host.progress import LINE_SECONDS, LineCounter, counter, human_bytes, show_stages, stage


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_fast_counter_over_a_known_total_prints_a_line_per_tenth_and_the_last_step():
    out, clock = io.StringIO(), _Clock()
    bar = LineCounter(unit="step", stream=out, clock=clock)
    for step in range(1, 10_001):  # how the local trainer drives it: total and position, then one step
        bar.total, bar.n = 10_000, step - 1
        bar.set_postfix({"loss": f"{1 / step:.4f}"})
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11  # 0 %, 10 %, ..., 100 %: never a line per step
    assert lines[0] == "step 1/10000 (0%), loss 1.0000"
    assert lines[-1] == "step 10000/10000 (100%), loss 0.0001"


def test_a_slow_counter_prints_at_least_every_interval_and_a_closing_line():
    out, clock = io.StringIO(), _Clock()
    bar = LineCounter(unit="step", stream=out, clock=clock)  # no total: time alone paces it
    for _ in range(100):
        clock.now += 1.0
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 100 // int(LINE_SECONDS) + 1
    assert lines[0] == f"step {int(LINE_SECONDS)}"
    assert lines[-1] == "step 100"


def test_a_job_follower_prints_per_cent_without_its_internal_counts():
    out, clock = io.StringIO(), _Clock()
    bar = LineCounter(stream=out, clock=clock, total=1000, desc="job-1", counts=False)
    for n, state in ((0, "queued"), (0, "queued"), (0, "running"), (420, "running"), (1000, "running")):
        bar.n = n
        bar.set_postfix_str(state)
        bar.refresh()
    bar.close()
    assert out.getvalue().splitlines() == ["job-1: 0%, queued", "job-1: 42%, running", "job-1: 100%, running"]


def test_counter_is_a_live_bar_on_a_terminal_and_lines_elsewhere():
    from tqdm import tqdm

    assert isinstance(counter(unit="step", stream=io.StringIO()), LineCounter)
    live = counter(unit="step", stream=_Terminal())
    try:
        assert isinstance(live, tqdm)
    finally:
        live.close()


def test_stage_lines_are_silent_unless_a_command_turned_them_on(capsys):
    stage("loading")
    assert capsys.readouterr().err == ""
    show_stages(True)
    try:
        stage("loading")
    finally:
        show_stages(False)
    assert capsys.readouterr().err == "loading…\n"


@pytest.mark.parametrize(
    ("size", "text"), [(0, "0 B"), (812_000, "812 KB"), (1_300_000_000, "1.3 GB"), (456_000_000_000, "456 GB")]
)
def test_sizes_read_as_people_read_them(size, text):
    assert human_bytes(size) == text


def test_the_kiln_command_announces_model_creation_and_leaves_reporting_off(tmp_path, capsys):
    assert main(["models", "create-tiny", str(tmp_path / "tiny"), "--seed", "3"]) == 0
    err = capsys.readouterr().err
    steps = ["importing torch and transformers", "training the tiny model's tokenizer", "drawing its weights (seed 3)"]
    at = [err.find(step) for step in steps]
    assert -1 not in at, err
    assert at == sorted(at), err
    assert progress._enabled is False  # a library caller after the command hears nothing


def test_codegen_announces_its_steps(capsys):
    from codegen.__main__ import main as codegen_main

    assert codegen_main(["--check"]) == 0
    err = capsys.readouterr().err
    for step in ("reading the schemas", "bundling the definitions", "generating the typed models"):
        assert f"codegen: {step}" in err
