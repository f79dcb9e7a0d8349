"""Drawing a pull's or push's NDJSON progress: a rich bar per blob (size, speed, time left), a line per step.

:func:`render_progress` takes the progress objects as the daemon streams them (``{"status", "digest",
"total", "completed"}``) and draws them on a rich console: on a terminal, one bar per blob and a spinner line
per step; elsewhere (a pipe, a log), one plain line per step and one line per blob when it completes. It works
for ``/api/pull``, ``/api/push`` and ``/api/create`` streams alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text


class _BlobOnly(ProgressColumn):
    """Show ``column`` for blob bars only; step lines have no size, speed or time left."""

    def __init__(self, column: ProgressColumn) -> None:
        super().__init__()
        self.column = column

    def render(self, task: Task) -> Any:
        return self.column.render(task) if task.fields.get("blob") else Text("")


def _blob(event: dict[str, Any]) -> tuple[str, int, int] | None:
    """(digest, total, completed) for a blob's progress object, else None."""
    digest, total = event.get("digest"), event.get("total")
    if not isinstance(digest, str) or not digest or not isinstance(total, int) or isinstance(total, bool):
        return None
    completed = event.get("completed") or 0
    return digest, max(total, 0), completed if isinstance(completed, int) else 0


class _Live:
    """The terminal renderer: a rich Progress with a task per step and per blob."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("{task.description}"),
            _BlobOnly(BarColumn()),
            _BlobOnly(TextColumn("{task.percentage:>3.0f}%")),
            _BlobOnly(DownloadColumn(binary_units=False)),
            _BlobOnly(TransferSpeedColumn()),
            _BlobOnly(TimeRemainingColumn()),
            console=console,
            transient=False,
        )
        self.blobs: dict[str, TaskID] = {}
        self.step: TaskID | None = None
        self.step_text: str | None = None

    def __enter__(self) -> _Live:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish_step()
        self.progress.stop()

    def finish_step(self) -> None:
        if self.step is not None:
            self.progress.update(self.step, total=1, completed=1)
            self.step, self.step_text = None, None

    def show(self, event: dict[str, Any]) -> None:
        blob = _blob(event)
        status = str(event.get("status") or "")
        if blob is not None:
            digest, total, completed = blob
            task = self.blobs.get(digest)
            if task is None:
                if completed == 0 and total > 0:
                    return  # a bar appears once bytes move (or at once for a blob already there)
                self.finish_step()
                task = self.progress.add_task(status or digest, total=total or 1, blob=True)
                self.blobs[digest] = task
            self.progress.update(task, completed=completed if total else 1)
        elif status and status != self.step_text:
            self.finish_step()
            self.step_text = status
            self.step = self.progress.add_task(status, total=None)


class _Plain:
    """The non-terminal renderer: a line per step, a line per blob once it is complete."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.done: set[str] = set()
        self.last: str | None = None

    def __enter__(self) -> _Plain:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def show(self, event: dict[str, Any]) -> None:
        blob = _blob(event)
        status = str(event.get("status") or "")
        if blob is not None:
            digest, total, completed = blob
            if completed >= total and digest not in self.done:
                self.done.add(digest)
                self.console.print(f"{status or digest} 100% {_size(total)}", markup=False, highlight=False)
        elif status and status != self.last:
            self.last = status
            self.console.print(status, markup=False, highlight=False)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1000**3), ("MB", 1000**2), ("KB", 1000)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def render_progress(events: Iterable[dict[str, Any]], console: Console | None = None) -> dict[str, Any] | None:
    """Draw every progress object from ``events`` on ``console`` (default: stderr) and return the last one.

    Errors raised by the iterator (the client raises a ``{"error": …}`` line as a CorralError) propagate after
    the display is closed, so the error prints below the bars.
    """
    console = console or Console(stderr=True, highlight=False)
    renderer: _Live | _Plain = _Live(console) if console.is_terminal else _Plain(console)
    last: dict[str, Any] | None = None
    with renderer:
        for event in events:
            renderer.show(event)
            last = event
    return last
