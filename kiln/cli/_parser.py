"""The command line's parser: no surprises for a person typing it.

* no prefix abbreviations: ``--epoch 2`` is an unknown option, never silently ``--epochs`` (``allow_abbrev``
  off on every parser, the subcommands' included: they are made from this class);
* a mistyped option or command gets a suggestion (``--epohcs``: did you mean ``--epochs``?), and the error shows
  the usage of the command it was typed for, not the top level's;
* a command group alone (``kiln train``, ``kiln adapters``) prints its own help;
* every option's help says its default when it has one (``KilnHelpFormatter``).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, ClassVar, NoReturn

__all__ = ["KilnHelpFormatter", "KilnParser", "leaf_parser"]

_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")
_UNRECOGNIZED = "unrecognized arguments: "


class KilnHelpFormatter(argparse.HelpFormatter):
    """``(default: X)`` after an option's help when it has a default its help does not already state."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        trivial = default is None or default is False or default == [] or default is argparse.SUPPRESS
        if not trivial and "default" not in text.lower() and action.option_strings and action.nargs != 0:
            text += " (default: %(default)s)"
        return text


class KilnParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` without abbreviations, with suggestions, that remembers which (sub)command parsed."""

    _last: ClassVar[list[KilnParser]] = []  # the innermost parser that parsed the current command line

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", KilnHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        KilnParser._last.append(self)
        return super().parse_known_args(args, namespace)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        KilnParser._last.clear()
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            leaf_parser(self).error(_UNRECOGNIZED + " ".join(extras))
        return parsed

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}{self._suggestion(message)}\n")

    def _suggestion(self, message: str) -> str:
        choice = _INVALID_CHOICE.search(message)
        if choice:
            options = [c.strip().strip("'") for c in choice.group(2).split(",")]
            return _did_you_mean(choice.group(1), options, quote="'")
        if message.startswith(_UNRECOGNIZED):
            typed = [word.split("=", 1)[0] for word in message[len(_UNRECOGNIZED) :].split() if word.startswith("-")]
            known = [s for action in self._actions for s in action.option_strings]
            for word in typed:
                found = _did_you_mean(word, known)
                if found:
                    return found
        return ""


def _did_you_mean(word: str, options: list[str], quote: str = "") -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.6)
    if not close:
        prefixed = [o for o in options if o.startswith(word) and len(word) > 2]
        close = prefixed[:1]
    return f"; did you mean {quote}{close[0]}{quote}?" if close else ""


def leaf_parser(root: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The innermost (sub)command parser that parsed the last command line (``root`` when none ran)."""
    return KilnParser._last[-1] if KilnParser._last else root
