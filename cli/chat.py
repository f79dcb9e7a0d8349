"""Streaming an answer to the terminal: word wrap, thinking, stats, and Ctrl-C that stops only the answer.

Shared by ``corral run PROMPT`` (``/api/generate``) and the interactive REPL (``/api/chat``). The daemon sees
the connection close when the user presses Ctrl-C and stops generating within a token. Both attach the images whose
paths a prompt names (:func:`extract_images`) when the model has vision.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import sys
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
    from registry.errors import InvalidRequest

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
    """Ollama's ``--verbose`` block from a final (``done``) response object."""

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

        Ctrl-C stops the answer (closing the stream closes the connection, and the daemon stops), prints a
        newline and returns with ``interrupted`` set, so a REPL can go on.
        """
        answer = Answer()
        wrapper = Wrapper(self.out, wrap_width(self.out, self.wordwrap))
        colour = self.out.isatty()
        thinking_open = False
        try:
            for chunk in chunks:
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
        except KeyboardInterrupt:
            answer.interrupted = True
        finally:
            close = getattr(chunks, "close", None)
            if callable(close):
                close()
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
        return answer


def generate_stream(client: DaemonClient, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    return client.stream("POST", "/api/generate", {**body, "stream": True})


def chat_stream(client: DaemonClient, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    return client.stream("POST", "/api/chat", {**body, "stream": True})
