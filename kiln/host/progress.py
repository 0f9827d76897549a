"""What a person sees while they wait: stage lines ("loading the model weights…") and step counters.

The engine announces its long steps here -- building the tiny model, loading a tokenizer and weights, hashing weight
shards, server start-up -- and says nothing unless a command turned reporting on (``show_stages``): the ``kiln``
command and ``kiln serve`` do, on stderr; a library caller or a test that does not sees nothing. Reporting resolves
``sys.stderr`` when it writes, so a replaced stderr (pytest's capture) is honoured.

``counter`` is the step counter a long loop shows: a live bar on a terminal, and anywhere else (a log file, CI) a
line at most every ``LINE_PERCENT`` per cent of the total or every ``LINE_SECONDS`` seconds, whichever comes first,
so a redirected run's log grows by a bounded number of lines however fast the steps are.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["LINE_PERCENT", "LINE_SECONDS", "LineCounter", "counter", "human_bytes", "note", "show_stages", "stage"]

LINE_PERCENT = 10  # a non-terminal counter prints when the total advances by this many per cent ...
LINE_SECONDS = 30.0  # ... or when this long has passed since its last line

_enabled = False


def show_stages(enabled: bool = True) -> None:
    """Turn stage lines on (the ``kiln`` command, ``kiln serve``) or off."""
    global _enabled
    _enabled = enabled


def stage(text: str) -> None:
    """Announce a step a person will wait for (``text`` without the ellipsis), when reporting is on."""
    if _enabled:
        print(f"{text}…", file=sys.stderr, flush=True)


def note(text: str) -> None:
    """Report what a step did (``text`` as it is: say how long it took), when reporting is on."""
    if _enabled:
        print(text, file=sys.stderr, flush=True)


def human_bytes(size: int) -> str:
    """``size`` for a person: ``812 KB``, ``1.3 GB`` (decimal units, as file managers and Hugging Face show them)."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit in ("B", "KB") or value >= 100 else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


class LineCounter:
    """A step counter for a non-terminal: the attributes and methods of the ``tqdm`` bars Kiln drives (``total``,
    ``n``, ``set_postfix``, ``update``, ``close``), printing whole lines at a bounded rate."""

    def __init__(
        self,
        *,
        unit: str = "it",
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        total: int | None = None,
        desc: str | None = None,
        counts: bool = True,
    ) -> None:
        self.unit, self.total, self.n, self.desc, self._counts = unit, total, 0, desc, counts
        self._stream, self._clock = stream, clock
        self._postfix = ""
        self._last_time = clock()
        self._last_tenth: int | None = None
        self._last_printed_n: int | None = None

    def set_postfix(self, postfix: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self._postfix = ", ".join(f"{key} {value}" for key, value in {**(postfix or {}), **kwargs}.items())

    def set_postfix_str(self, text: str) -> None:
        self._postfix = text

    def update(self, k: int = 1) -> None:
        self.n += k
        self.refresh()

    def refresh(self) -> None:
        """Print a line if the total advanced a tenth since the last one, or ``LINE_SECONDS`` passed."""
        now = self._clock()
        tenth = self._bucket()
        if (tenth is not None and tenth != self._last_tenth) or now - self._last_time >= LINE_SECONDS:
            self._line(now, tenth)

    def close(self) -> None:
        if self.n and self._last_printed_n != self.n:
            self._line(self._clock(), self._bucket())

    def _bucket(self) -> int | None:
        if not self.total:
            return None
        return min(self.n * 100 // self.total, 100) // LINE_PERCENT

    def _line(self, now: float, tenth: int | None) -> None:
        self._last_time, self._last_tenth, self._last_printed_n = now, tenth, self.n
        parts = [f"{self.desc}:"] if self.desc else []
        if self._counts:
            parts.append(f"{self.unit} {self.n}" + (f"/{self.total}" if self.total else ""))
        if self.total:
            parts.append(f"{self.n * 100 // self.total}%" if not self._counts else f"({self.n * 100 // self.total}%)")
        print(
            " ".join(parts) + (f", {self._postfix}" if self._postfix else ""),
            file=self._stream or sys.stderr,
            flush=True,
        )


def counter(*, unit: str = "it", stream: TextIO | None = None, **options: Any) -> Any:
    """A step counter on ``stream`` (stderr): ``tqdm`` on a terminal (``options`` are its own: ``total``, ``desc``,
    ``bar_format``), a ``LineCounter`` anywhere else (which reads ``total`` and ``desc``, and ``counts=False`` for a
    counter whose steps mean nothing to a person)."""
    out = stream or sys.stderr
    isatty = getattr(out, "isatty", None)
    if isatty is not None and isatty():
        from tqdm import tqdm

        options.pop("counts", None)
        return tqdm(unit=unit, dynamic_ncols=True, file=out, **options)
    options.pop("bar_format", None)
    return LineCounter(unit=unit, stream=out, **options)
