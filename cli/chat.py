"""Streaming an answer to the terminal: word wrap, thinking, stats, and Ctrl-C that stops only the answer.

Shared by ``corral run PROMPT`` (``/api/generate``) and the interactive REPL (``/api/chat``). The daemon sees
the connection close when the user presses Ctrl-C and stops generating within a token. Both attach the images whose
paths a prompt names (:func:`extract_images`) when the model has vision.

Ctrl-C is a ``KeyboardInterrupt`` raised wherever the main thread happens to be, which is only safe in code written
for it. So the answer is read from the daemon in a worker thread (with SIGINT blocked there, so the kernel always
hands the signal to the main thread) and the main thread only waits on a queue and prints: an interrupt can never
land inside httpx or httpcore, where one arriving just after a lock is taken leaves that lock held and the next
close or request waiting for ever, or inside a finalizer, where Python drops it. Stopping aborts the stream (its
socket is shut down), which ends the worker's read at once, and the daemon sees the connection close.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, TextIO

from cli.client import DaemonClient

IMAGE_EXTENSIONS = ("png", "jpg", "jpeg", "gif", "bmp", "webp")
MAX_IMAGE_FILE = 20 * 1024 * 1024  # the daemon's bound on an encoded image (docs/vision.md)
_EXT = "|".join(IMAGE_EXTENSIONS)
# An image path in a prompt, as Ollama's CLI finds them: quoted ('...' or "..."), or bare from /, ./, ../, ~/ (or a
# drive letter) with backslash-escaped spaces and shell characters, ending in an image extension. Candidates only:
# a path that is not an existing file stays in the prompt as text.
_IMAGE_PATH = re.compile(
    r"'(?P<single>[^'\n]+?\.(?:" + _EXT + r"))'"
    r'|"(?P<double>[^"\n]+?\.(?:' + _EXT + r'))"'
    r"|(?P<bare>(?:[A-Za-z]:)?(?:~|\.{1,2})?[/\\](?:\\.|[^\s'\"])*?\.(?:" + _EXT + r"))"
    r"(?=$|[\s,;:!?)\]]|\.(?:\s|$))",  # a path may end a sentence: "describe ./photo.png."
    re.IGNORECASE,
)
_ESCAPED = re.compile(r"\\(.)")


def extract_images(prompt: str, *, say: Any = None) -> tuple[str, list[str]]:
    """The prompt without the paths of the image files it names, and those images (base64, in order), as
    ``ollama run`` attaches them: each existing file whose path ends in .png, .jpg, .jpeg, .gif, .bmp or .webp, quoted
    or with escaped spaces. ``say`` (default: stderr) is told "Added image '<path>'" for each. A file that cannot be
    read, or is over the daemon's 20 MiB bound, is an error (InvalidRequest); the daemon checks the contents."""
    from errors import InvalidRequest

    tell = say or (lambda line: print(line, file=sys.stderr))
    images: list[str] = []
    out: list[str] = []
    last = 0
    for m in _IMAGE_PATH.finditer(prompt):
        raw = m.group("single") or m.group("double")
        path = raw if raw is not None else _ESCAPED.sub(r"\1", m.group("bare"))
        path = os.path.expanduser(path)
        if not os.path.isfile(path):
            continue
        try:
            if os.path.getsize(path) > MAX_IMAGE_FILE:
                limit = MAX_IMAGE_FILE // (1 << 20)
                raise InvalidRequest(f"couldn't attach '{path}': over the {limit} MiB image limit")
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise InvalidRequest(f"couldn't attach '{path}': {exc.strerror or exc}") from None
        tell(f"Added image '{path}'")
        images.append(base64.b64encode(data).decode())
        out.append(prompt[last : m.start()])
        last = m.end()
    if not images:
        return prompt, []
    out.append(prompt[last:])
    return re.sub(r"[ \t]{2,}", " ", "".join(out)).strip(), images


GREY = "\x1b[90m"
RESET = "\x1b[0m"


def go_duration(ns: int) -> str:
    """A duration the way Go prints ``time.Duration`` (``1.234567891s``, ``12.5ms``, ``1m2.5s``), as Ollama's
    ``--verbose`` stats do."""
    if ns == 0:
        return "0s"
    sign = "-" if ns < 0 else ""
    ns = abs(ns)
    if ns < 1_000:
        return f"{sign}{ns}ns"
    if ns < 1_000_000:
        return f"{sign}{_fixed(ns, 1_000, 3)}µs"
    if ns < 1_000_000_000:
        return f"{sign}{_fixed(ns, 1_000_000, 6)}ms"
    hours, rem = divmod(ns, 3_600_000_000_000)
    minutes, rem = divmod(rem, 60_000_000_000)
    text = f"{_fixed(rem, 1_000_000_000, 9)}s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    if hours:
        text = f"{hours}h{text}"
    return sign + text


def _fixed(value: int, unit: int, digits: int) -> str:
    whole, frac = divmod(value, unit)
    tail = f"{frac:0{digits}d}".rstrip("0")
    return f"{whole}.{tail}" if tail else str(whole)


def stats_lines(final: dict[str, Any]) -> list[str]:
    """Ollama's ``--verbose`` block from a final (``done``) response object, with a line of drafted and accepted
    tokens when the request asked for speculative decoding (the object has ``draft_n``)."""

    def rate(count: int, ns: int) -> str:
        return f"{count / (ns / 1e9):.2f} tokens/s" if ns > 0 else "0.00 tokens/s"

    lines = [
        f"total duration:       {go_duration(int(final.get('total_duration') or 0))}",
        f"load duration:        {go_duration(int(final.get('load_duration') or 0))}",
    ]
    pc, pd = int(final.get("prompt_eval_count") or 0), int(final.get("prompt_eval_duration") or 0)
    ec, ed = int(final.get("eval_count") or 0), int(final.get("eval_duration") or 0)
    if pc:
        lines.append(f"prompt eval count:    {pc} token(s)")
    if pd:
        lines.append(f"prompt eval duration: {go_duration(pd)}")
        lines.append(f"prompt eval rate:     {rate(pc, pd)}")
    lines.append(f"eval count:           {ec} token(s)")
    if ed:
        lines.append(f"eval duration:        {go_duration(ed)}")
        lines.append(f"eval rate:            {rate(ec, ed)}")
    if final.get("draft_n") is not None:  # speculative decoding was asked for: drafted, and of them accepted
        drafted, accepted = int(final.get("draft_n") or 0), int(final.get("draft_n_accepted") or 0)
        share = f", {accepted / drafted:.0%}" if drafted else ""
        lines.append(f"draft tokens:         {drafted} token(s) ({accepted} accepted{share})")
    return lines


class Wrapper:
    """Writes streamed text, wrapping at word boundaries to ``width`` columns (no wrapping when width is 0)."""

    def __init__(self, stream: TextIO, width: int) -> None:
        self.stream, self.width = stream, width
        self.column = 0
        self.word = ""

    def write(self, text: str) -> None:
        if self.width <= 0:
            self.stream.write(text)
            self.stream.flush()
            return
        for ch in text:
            if ch == "\n":
                self._flush_word()
                self.stream.write("\n")
                self.column = 0
            elif ch in " \t":
                self._flush_word()
                if self.column < self.width:
                    self.stream.write(ch)
                    self.column += 1
            else:
                self.word += ch
                if len(self.word) >= self.width:  # a word longer than a line: hard break
                    self._flush_word()
        self.stream.flush()

    def _flush_word(self) -> None:
        if not self.word:
            return
        if self.column + len(self.word) > self.width and self.column > 0:
            self.stream.write("\n")
            self.column = 0
        self.stream.write(self.word)
        self.column += len(self.word)
        self.word = ""

    def finish(self) -> None:
        self._flush_word()
        self.stream.flush()


def wrap_width(stream: TextIO, wordwrap: bool) -> int:
    if not wordwrap or not stream.isatty():
        return 0
    return max(shutil.get_terminal_size((80, 24)).columns - 5, 20)


@dataclass
class Answer:
    """What one streamed reply produced."""

    content: str = ""
    thinking: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    interrupted: bool = False


@dataclass
class Printer:
    """How to print a reply: word wrap, thinking shown or hidden, stats after it."""

    out: TextIO = field(default_factory=lambda: sys.stdout)
    err: TextIO = field(default_factory=lambda: sys.stderr)
    wordwrap: bool = True
    hide_thinking: bool = False
    verbose: bool = False

    def stream(self, chunks: Iterator[dict[str, Any]], *, key: str) -> Answer:
        """Print ``chunks`` (``/api/generate`` when key is ``response``, ``/api/chat`` when ``message``).

        Ctrl-C at any moment stops the answer (the stream is aborted, which closes the connection, and the daemon
        stops), prints a newline and returns with ``interrupted`` set, so a REPL can go on. An error from the stream
        is raised here.
        """
        answer = Answer()
        reader = _Reader(chunks)
        try:
            self._print(reader, answer, key)
        except KeyboardInterrupt:
            answer.interrupted = True
        finally:
            reader.stop()
        if answer.interrupted:
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: the newline can go too
                self.out.write("\n\n" if answer.content and not answer.content.endswith("\n") else "\n")
                self.out.flush()
        return answer

    def _print(self, reader: _Reader, answer: Answer, key: str) -> None:
        wrapper = Wrapper(self.out, wrap_width(self.out, self.wordwrap))
        colour = self.out.isatty()
        thinking_open = False
        try:
            for chunk in reader:
                holder = (chunk.get("message") or {}) if key == "message" else chunk
                thought = holder.get("thinking") or ""
                text = holder.get(key if key == "response" else "content") or ""
                if thought:
                    answer.thinking += thought
                    if not self.hide_thinking:
                        if not thinking_open:
                            self.out.write((GREY if colour else "") + "Thinking...\n")
                            thinking_open = True
                        wrapper.write(thought)
                if text:
                    if thinking_open:
                        wrapper.finish()
                        self.out.write("\n...done thinking.\n\n" + (RESET if colour else ""))
                        wrapper.column, thinking_open = 0, False
                    answer.content += text
                    wrapper.write(text)
                for call in holder.get("tool_calls") or []:
                    answer.tool_calls.append(call)
                if chunk.get("done"):
                    answer.final = chunk
        finally:
            wrapper.finish()
            if thinking_open and colour:
                self.out.write(RESET)
        for call in answer.tool_calls:
            fn = call.get("function") or {}
            self.out.write(
                f"Model called a non-existent function '{fn.get('name', '')}()' with arguments: "
                f"{json.dumps(fn.get('arguments') or {})}\n"
            )
        self.out.write("\n" if answer.content and not answer.content.endswith("\n") else "")
        self.out.write("\n")
        self.out.flush()
        if self.verbose and answer.final:
            for line in stats_lines(answer.final):
                self.err.write(line + "\n")
            self.err.flush()


_END = object()


class _Reader:
    """Reads a stream of chunks in a worker thread and hands them over through a queue.

    The worker starts with SIGINT blocked (it inherits the mask the main thread has while starting it), so a
    Ctrl-C always interrupts the main thread, which is waiting in ``SimpleQueue.get`` (C code that returns at
    once for a signal) or printing: never the library code reading the daemon's answer. :meth:`stop` (from the
    main thread, any number of times) makes the worker end: it aborts the stream when the stream can be aborted
    (:class:`cli.client.Stream`: its connection is shut down), else the worker stops at the next chunk; the worker
    closes the stream itself, since a generator may only be closed by the thread running it.
    """

    def __init__(self, chunks: Iterator[dict[str, Any]]) -> None:
        self.chunks = chunks
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.stopped = False
        self.thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self._start()
        while True:
            item = self.inbox.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _start(self) -> None:
        thread = threading.Thread(target=self._work, name="corral-answer", daemon=True)
        self.thread = thread  # before it starts: stop() must never close the stream under a running worker
        mask = getattr(signal, "pthread_sigmask", None)
        if mask is None or threading.current_thread() is not threading.main_thread():
            thread.start()
            return
        # SIGINT blocked here while the thread starts, so it starts blocked; a Ctrl-C meanwhile stays pending and
        # is raised here once unblocked. Unblocked by name (not by restoring a saved mask), so an interrupt between
        # the two calls cannot leave it blocked for the rest of the session.
        try:
            mask(signal.SIG_BLOCK, {signal.SIGINT})
            thread.start()
        finally:
            mask(signal.SIG_UNBLOCK, {signal.SIGINT})

    def _work(self) -> None:
        try:
            for chunk in self.chunks:
                if self.stopped:
                    break
                self.inbox.put(chunk)
            self.inbox.put(_END)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread (or dropped once it stopped)
            self.inbox.put(exc)
        finally:
            close = getattr(self.chunks, "close", None)
            if callable(close):
                with contextlib.suppress(Exception):
                    close()

    def stop(self) -> None:
        """Make the worker end (idempotent; a Ctrl-C arriving meanwhile does not stop the stopping)."""
        while True:
            try:
                self.stopped = True
                abort = getattr(self.chunks, "abort", None)
                if callable(abort):
                    abort()
                elif self.thread is None:  # never started: close it here
                    close = getattr(self.chunks, "close", None)
                    if callable(close):
                        close()
                return
            except KeyboardInterrupt:
                continue


def generate_stream(client: DaemonClient, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    return client.stream("POST", "/api/generate", {**body, "stream": True})


def chat_stream(client: DaemonClient, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    return client.stream("POST", "/api/chat", {**body, "stream": True})
