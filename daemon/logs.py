"""Logging configuration for ``corral serve`` only (libraries just use ``logging.getLogger(__name__)``).

Two guarantees hold for everything the daemon logs, whoever logs it (our code, uvicorn, asyncio):

* **One record, one line.** :class:`Formatter` escapes control characters (C0, DEL, C1, Unicode line and paragraph
  separators, bidi overrides, lone surrogates) in every message, so text taken from a request (a path with ``%0a``,
  a model name, a header) can never start a line of its own or drive the terminal. A traceback keeps its line
  breaks, but every one of its lines is indented, so none can pass for a record.
* **A flood cannot fill the disk.** :class:`RateLimit`, a filter on the root handler, writes the same message at
  most ``burst`` times per ``interval`` and then one "suppressed K similar messages" line; all records together
  are held to ``max_bytes`` per interval, and only ``max_tracebacks`` of them keep their traceback. Warnings and
  errors count as "the same" when they come from the same logger and format string (``accept() out of system
  resource`` thousands of times a second is one message); quieter records only when their text is identical, so
  request lines, one per request, are only held to the byte budget (4 MiB a minute: some 20,000 lines).
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TRACE = 5

#: The facts of the request being served, for its one log line and its metrics: the HTTP edge's middleware
#: (daemon.api.observe) sets a fresh dict per request; code below it adds what it learns through :func:`note`.
request_facts: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("corral_request", default=None)


def note(**fields: Any) -> None:
    """Attach facts (model, prompt_tokens, eval_tokens...) to the current request's log line and metrics; outside
    a request, nothing."""
    info = request_facts.get()
    if info is not None:
        info.update(fields)


def note_sum(**counts: int) -> None:
    """Add counts to the current request's facts: a request that runs several generations (``n`` choices, a
    thinking pass then a format pass) logs and counts the tokens of all of them."""
    info = request_facts.get()
    if info is not None:
        for k, v in counts.items():
            info[k] = info.get(k, 0) + v


MAX_MESSAGE = 8 * 1024  # characters of a message (escaped) written; a request path can be 16 KiB
MAX_TRACEBACK = 32 * 1024

# C0 controls, DEL, C1 controls, line and paragraph separators, bidi embeddings/overrides/isolates (which let text
# display in another order than it is stored), byte-order mark, lone surrogates (from undecodable file names).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff]")
_UNSAFE_KEEP_NEWLINES = re.compile(
    "[\x00-\x09\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff]"
)
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(m: re.Match[str]) -> str:
    ch = m.group()
    named = _NAMED.get(ch)
    if named:
        return named
    code = ord(ch)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters written as ``\\n``, ``\\r``, ``\\t``, ``\\xNN`` or ``\\uNNNN``."""
    return (_UNSAFE_KEEP_NEWLINES if keep_newlines else _UNSAFE).sub(_escape_char, text)


def quote(value: object) -> str:
    """A value for a ``key=value`` log line: as is, or double-quoted with escapes where it has a space, ``=``,
    ``"``, a control character or nothing at all (Go's slog text format does the same)."""
    text = str(value)
    if text and not re.search(r'[\s="\\]', text) and not _UNSAFE.search(text):
        return text
    return '"' + escape(text.replace("\\", "\\\\").replace('"', '\\"')) + '"'


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


class Formatter(logging.Formatter):
    """``time=... level=... source=... msg=...``, one line per record whatever the message holds."""

    def __init__(self, instance: str | None = None) -> None:
        # instance: CORRAL_INSTANCE, so that the lines of several replicas can be told apart once collected
        named = f"instance={quote(instance).replace('%', '%%')} " if instance else ""
        super().__init__(f"time=%(asctime)s level=%(levelname)s {named}source=%(name)s msg=%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        try:
            message = record.getMessage()
        except Exception as exc:  # noqa: BLE001 - a bad format string or args: still one line, and say so
            message = f"{record.msg!r} (unformattable args: {exc})"
        record.message = _truncate(escape(message), MAX_MESSAGE)
        if self.usesTime():
            record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        extra = ""
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            extra = record.exc_text
        if record.stack_info:
            extra = (extra + "\n" if extra else "") + self.formatStack(record.stack_info)
        if extra:
            extra = _truncate(escape(extra.rstrip("\n"), keep_newlines=True), MAX_TRACEBACK)
            line += "\n" + "\n".join("    " + ln for ln in extra.split("\n"))
        return line


@dataclass
class _Window:
    name: str
    level: int
    sample: str
    start: float
    passed: int = 0
    suppressed: int = 0


@dataclass
class _Budget:
    start: float
    bytes: int = 0
    tracebacks: int = 0
    suppressed: int = 0
    stripped: int = 0
    level: int = logging.INFO
    names: set[str] = field(default_factory=set)


# numbers, addresses and hashes: what varies between messages from one place that renders its own text
_NUMBERS = re.compile(r"0x[0-9a-fA-F]+|[0-9a-fA-F]{8,}|\d+")


class RateLimit(logging.Filter):
    """Bound what a flood of log records can write.

    * The same message passes at most ``burst`` times per ``interval`` seconds; what is held back is then written as
      one "suppressed K similar messages" line. Warnings and errors are "the same" when they come from the same
      logger, level and format string (numbers and addresses in it aside: asyncio writes timestamps into its
      messages) with the same kind of exception; quieter records only when their text is identical.
    * All records together pass up to ``max_bytes`` of text per interval (request lines are distinct, one per
      request: this is what holds them), and at most ``max_tracebacks`` keep their traceback; later ones are
      written without it.
    * A summary line is written when a window has ended and any record comes by, and by :meth:`flush` (at
      shutdown); at most ``max_summaries`` at a time, the rest folded into one line.

    ``emit`` writes a summary record (the handler's ``handle``; summaries bypass this filter)."""

    def __init__(
        self,
        emit: Callable[[logging.LogRecord], object],
        *,
        burst: int = 10,
        interval: float = 60.0,
        max_bytes: int = 4 * 1024 * 1024,
        max_tracebacks: int = 20,
        max_summaries: int = 50,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.emit = emit
        self.burst = burst
        self.interval = interval
        self.max_bytes = max_bytes
        self.max_tracebacks = max_tracebacks
        self.max_summaries = max_summaries
        self.clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[object, ...], _Window] = {}
        self._budget = _Budget(start=clock())
        self._last_sweep = clock()

    @staticmethod
    def _key(record: logging.LogRecord, text: str) -> tuple[object, ...]:
        """What makes records "the same". Texts are kept as hashes: a request line can be 16 KiB long, and there
        can be thousands of them a minute."""
        if record.levelno >= logging.WARNING:
            # the same call site however its arguments vary (and the same kind of exception, if any)
            exc = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
            return record.name, record.levelno, hash(_NUMBERS.sub("#", str(record.msg)[:2000])), exc
        return record.name, record.levelno, hash(text)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "corral_summary", False):
            return True
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string or args: key on the raw message
            text = str(record.msg)
        key = self._key(record, text)
        summaries: list[logging.LogRecord] = []
        with self._lock:
            now = self.clock()
            if now - self._last_sweep >= 1.0:
                self._sweep(now, summaries)
            allowed = self._admit(key, text, record, now, summaries)
        for summary in summaries:
            self.emit(summary)
        return allowed

    def _admit(
        self,
        key: tuple[object, ...],
        text: str,
        record: logging.LogRecord,
        now: float,
        summaries: list[logging.LogRecord],
    ) -> bool:
        window = self._windows.get(key)
        if window is not None and now - window.start >= self.interval:
            self._close([(key, window)], now, summaries)
            window = None
        if window is not None and window.passed >= self.burst:
            window.suppressed += 1
            return False
        budget = self._budget
        if now - budget.start >= self.interval:
            self._close_budget(now, summaries)
            budget = self._budget
        size = min(len(text), MAX_MESSAGE) + 100
        if budget.bytes + size > self.max_bytes:
            budget.suppressed += 1
            budget.level = max(budget.level, record.levelno)
            if len(budget.names) < 5:
                budget.names.add(record.name)
            return False
        budget.bytes += size
        if record.exc_info or record.exc_text or record.stack_info:
            if budget.tracebacks >= self.max_tracebacks:
                budget.stripped += 1
                record.msg, record.args = f"{text} (traceback left out: too many this minute)", None
                record.exc_info = record.exc_text = record.stack_info = None
            else:
                budget.tracebacks += 1
        if window is None:
            window = self._windows[key] = _Window(record.name, record.levelno, text[:300], now)
        window.passed += 1
        return True

    def _close(
        self, windows: list[tuple[tuple[object, ...], _Window]], now: float, summaries: list[logging.LogRecord]
    ) -> None:
        folded = kinds = 0
        for key, window in windows:
            del self._windows[key]
            if not window.suppressed:
                continue
            if len(summaries) < self.max_summaries:
                summaries.append(
                    self._summary(
                        window.name,
                        window.level,
                        "suppressed %d similar messages in the last %ds: %s",
                        (window.suppressed, round(now - window.start), window.sample),
                    )
                )
            else:
                folded += window.suppressed
                kinds += 1
        if folded:
            summaries.append(
                self._summary(__name__, logging.WARNING, "suppressed %d more messages of %d kinds", (folded, kinds))
            )

    def _close_budget(self, now: float, summaries: list[logging.LogRecord]) -> None:
        b = self._budget
        if b.suppressed:
            summaries.append(
                self._summary(
                    __name__,
                    b.level,
                    "suppressed %d messages in the last %ds: more than %d bytes of log (from %s)",
                    (b.suppressed, round(now - b.start), self.max_bytes, ",".join(sorted(b.names))),
                )
            )
        if b.stripped:
            summaries.append(
                self._summary(
                    __name__,
                    logging.WARNING,
                    "left out the tracebacks of %d messages in the last %ds",
                    (b.stripped, round(now - b.start)),
                )
            )
        self._budget = _Budget(start=now)

    def _sweep(self, now: float, summaries: list[logging.LogRecord]) -> None:
        self._last_sweep = now
        self._close([(k, w) for k, w in self._windows.items() if now - w.start >= self.interval], now, summaries)
        if now - self._budget.start >= self.interval:
            self._close_budget(now, summaries)

    @staticmethod
    def _summary(name: str, level: int, msg: str, args: tuple[object, ...]) -> logging.LogRecord:
        record = logging.LogRecord(name, level, __file__, 0, msg, args, None)
        record.corral_summary = True
        return record

    def flush(self) -> None:
        """Write the summaries of everything held back so far (the windows end now)."""
        summaries: list[logging.LogRecord] = []
        with self._lock:
            now = self.clock()
            self._close(list(self._windows.items()), now, summaries)
            self._close_budget(now, summaries)
        for summary in summaries:
            self.emit(summary)


_limiter: RateLimit | None = None


def configure(debug: int, instance: str | None = None) -> None:
    global _limiter
    logging.addLevelName(TRACE, "TRACE")
    level = logging.INFO if debug <= 0 else (logging.DEBUG if debug == 1 else TRACE)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Formatter(instance))
    _limiter = RateLimit(handler.handle)
    handler.addFilter(_limiter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("uvicorn.access",):
        logging.getLogger(noisy).setLevel(logging.WARNING if debug <= 0 else logging.DEBUG)


def flush() -> None:
    """Write what the rate limit held back (at shutdown)."""
    if _limiter is not None:
        _limiter.flush()
