"""The command line a person meets: no prefix abbreviations, a suggestion for a mistyped option or command in the
usage of the command it was typed for, a command group alone printing its own help, and every option described
with its default in ``--help``."""

from __future__ import annotations

import argparse

import pytest

from kiln.cli import build_parser, main


def _error(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_a_prefix_is_not_taken_for_the_option_it_abbreviates(capsys):
    err = _error(["train", "sft", "-f", "x.jsonl", "--adapter", "a", "--epoch", "2"], capsys)
    assert "unrecognized arguments: --epoch 2" in err
    assert "did you mean --epochs?" in err
    assert err.startswith("usage: kiln train sft")  # the command's usage, not the top level's


def test_a_mistyped_option_and_command_get_a_suggestion(capsys):
    err = _error(["train", "sft", "-f", "x.jsonl", "--adapter", "a", "--epohcs", "2"], capsys)
    assert "did you mean --epochs?" in err
    err = _error(["trian"], capsys)
    assert "did you mean 'train'?" in err
    err = _error(["adapters", "verfiy", "bot"], capsys)
    assert "did you mean 'verify'?" in err
    assert err.startswith("usage: kiln adapters")


@pytest.mark.parametrize("group", ["train", "adapters", "checkpoints", "eval", "teachers", "replay"])
def test_a_command_group_alone_prints_its_own_help(group, capsys):
    assert main([group]) == 2
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kiln {group} ")


def _parsers(parser, path):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_option_is_described_with_its_default():
    missing, no_default = [], []
    for path, parser in _parsers(build_parser(), "kiln"):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.help is argparse.SUPPRESS:
                continue
            if not action.help:
                missing.append(f"{path} {action.option_strings[-1]}")
                continue
            rendered = formatter._expand_help(action) if action.help else ""
            meaningful = action.default not in (None, False, [], argparse.SUPPRESS) and action.nargs != 0
            if meaningful and "default" not in rendered.lower():
                no_default.append(f"{path} {action.option_strings[-1]}")
    assert missing == []
    assert no_default == []
    assert not any(p.allow_abbrev for _, p in _parsers(build_parser(), "kiln"))
