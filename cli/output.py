"""User-facing output: data to stdout, messages and progress to stderr; size, number and time formatting.

Tables are plain text (left-aligned, 4 spaces between columns, no borders), like Ollama's. Progress uses rich
when stderr is a terminal and falls back to one plain line per step otherwise, so logs and tests stay readable.
rich is imported lazily: most commands never draw a bar.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

PAD = "    "


# -- plain lines ---------------------------------------------------------------------------------------------
def out(text: str = "") -> None:
    """A line of data on stdout."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def err(text: str = "") -> None:
    """A line of message on stderr."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def warn(text: str) -> None:
    err(f"Warning: {text}")


def error(message: str, hint: str | None = None) -> None:
    err(f"Error: {message}")
    if hint:
        err(hint)


def table(rows: Sequence[Sequence[str]], *, indent: str = "") -> list[str]:
    """Lines of a borderless table: each column as wide as its widest cell, then 4 spaces."""
    if not rows:
        return []
    widths = [max(len(r[i]) if i < len(r) else 0 for r in rows) for i in range(max(len(r) for r in rows))]
    return [indent + PAD.join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows]


# -- formatting ----------------------------------------------------------------------------------------------
def format_size(n: int | float) -> str:
    """Decimal units like Ollama: ``980 MB``, ``4.7 GB``, ``12 GB``, ``512 B``."""
    n = int(n)
    for unit, scale in (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if abs(n) >= scale:
            value = n / scale
            if value >= 10 or value == math.trunc(value):
                return f"{math.trunc(value)} {unit}"
            return f"{value:.1f} {unit}"
    return f"{n} B"


def format_count(n: int) -> str:
    """Parameter counts: ``8B``, ``8.0B``-style with one decimal, ``134.52M``, ``12K``."""
    for suffix, scale, places in (("B", 10**9, 1), ("M", 10**6, 2), ("K", 10**3, 0)):
        if n >= scale:
            value = n / scale
            return f"{int(value)}{suffix}" if value == int(value) else f"{value:.{places}f}{suffix}"
    return str(n)


def _round(x: float) -> int:
    return int(math.floor(x + 0.5))


def format_duration(seconds: float) -> str:
    """``Less than a second``, ``N seconds``, ``About a minute``, ``N minutes``, ``About an hour``, ``N hours``,
    ``N days``, ``N weeks``, ``N months``, ``N years``."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = int(seconds // 60)
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = _round(seconds / 3600)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 14:
        return f"{hours // 24} days"
    if hours < 24 * 60:
        return f"{hours // (24 * 7)} weeks"
    if hours < 24 * 730:
        return f"{hours // (24 * 30)} months"
    return f"{int(seconds // 3600) // (24 * 365)} years"


_FRACTION = re.compile(r"(\.\d{6})\d+")


def parse_time(text: str) -> datetime | None:
    """An RFC 3339 timestamp (any number of fraction digits, ``Z`` or an offset); None if unreadable."""
    try:
        dt = datetime.fromisoformat(_FRACTION.sub(r"\1", text.strip()).replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def format_ago(when: datetime | str | None, now: datetime | None = None) -> str:
    """Relative time: ``2 minutes ago``, ``About an hour ago``, ``3 days from now``, ``Forever``."""
    if isinstance(when, str):
        when = parse_time(when)
    if when is None:
        return "Unknown"
    now = now or datetime.now(UTC)
    delta = (now - when).total_seconds()
    if delta < -20 * 365 * 86400:
        return "Forever"
    if delta < 0:
        return format_duration(-delta) + " from now"
    return format_duration(delta) + " ago"


# -- progress ------------------------------------------------------------------------------------------------
def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


class Bar:
    """One byte-progress bar; ``advance(n)`` adds bytes."""

    def __init__(self, reporter: Reporter, key: Any, description: str, total: int) -> None:
        self.reporter, self.key, self.description, self.total = reporter, key, description, total
        self.completed = 0

    def advance(self, n: int) -> None:
        self.set(self.completed + n)

    def set(self, completed: int) -> None:
        self.completed = completed
        self.reporter._update(self)


class Reporter:
    """Status lines and progress bars for one long operation; plain lines when stderr is not a terminal."""

    def __init__(self, live: bool | None = None) -> None:
        self.live = stderr_is_terminal() if live is None else live
        self._progress: Any = None
        self._status_task: Any = None
        self._status: str | None = None
        self._bars: dict[Any, Bar] = {}
        self._task_ids: dict[Any, Any] = {}

    def __enter__(self) -> Reporter:
        if self.live:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TransferSpeedColumn,
            )

            self._progress = Progress(
                SpinnerColumn(finished_text=" "),
                TextColumn("{task.description}"),
                _only_with_total(BarColumn()),
                _only_with_total(DownloadColumn(binary_units=False)),
                _only_with_total(TransferSpeedColumn()),
                console=Console(stderr=True, highlight=False),
            )
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish_status()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def _finish_status(self) -> None:
        if self._status is None:
            return
        if self._progress is not None and self._status_task is not None:
            self._progress.update(self._status_task, total=1, completed=1)
        self._status, self._status_task = None, None

    def status(self, text: str) -> None:
        """Show a new step; the previous one is marked done."""
        if text == self._status:
            return
        self._finish_status()
        self._status = text
        if self._progress is not None:
            self._status_task = self._progress.add_task(text, total=None)
        else:
            err(text)

    def bar(self, key: Any, description: str, total: int) -> Bar:
        """A byte bar (the same ``key`` gets the same bar)."""
        if key in self._bars:
            return self._bars[key]
        self._finish_status()
        b = Bar(self, key, description, total)
        self._bars[key] = b
        if self._progress is not None:
            self._task_ids[key] = self._progress.add_task(description, total=total, bytes=True)
        return b

    def _update(self, bar: Bar) -> None:
        if self._progress is not None:
            self._progress.update(self._task_ids[bar.key], completed=bar.completed)
        elif bar.total and bar.completed >= bar.total and not getattr(bar, "_printed", False):
            bar._printed = True  # type: ignore[attr-defined]
            err(f"{bar.description} 100%")

    def message(self, text: str) -> None:
        """A line that stays (a warning, a note) above the live display."""
        self._finish_status()
        if self._progress is not None:
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            err(text)


def _only_with_total(column: Any) -> Any:
    """Wrap a rich progress column so it renders only for byte bars, not for status lines."""
    from rich.progress import ProgressColumn
    from rich.text import Text

    class OnlyWithTotal(ProgressColumn):
        def render(self, task: Any) -> Any:
            return column.render(task) if task.fields.get("bytes") else Text("")

    return OnlyWithTotal()


@contextmanager
def reporter(live: bool | None = None) -> Iterator[Reporter]:
    with Reporter(live) as r:
        yield r
