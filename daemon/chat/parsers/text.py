"""The text handling every family parser shares: finding tags in a buffer that grows piece by piece, holding back
what may be the start of a tag still arriving (and, where whitespace around tags is trimmed, the whitespace before
it), and the ``add()`` loop of a streaming state machine. Registers no parser."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto

from daemon.chat.types import Message, Parsed, ToolCall


def overlap(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (what may be a partial tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def partial_suffix(text: str, tags: Sequence[str]) -> int:
    """The longest end of ``text`` that may be the start of one of ``tags``: it must wait for the next piece."""
    return max((overlap(text, tag) for tag in tags), default=0)


def earliest(text: str, tags: Sequence[str]) -> tuple[int, str]:
    """The first complete tag in ``text``, as (index, tag), or ``(-1, "")``; at equal indexes the first in ``tags``."""
    found = (-1, "")
    for tag in tags:
        i = text.find(tag)
        if i != -1 and (found[0] == -1 or i < found[0]):
            found = (i, tag)
    return found


def hold_back(text: str, tags: Sequence[str], trim: bool = True) -> tuple[str, str]:
    """Split ``text`` (which holds none of ``tags`` whole) into (what is certain, what must wait): the wait is a
    possible partial tag at the end, and with ``trim`` also the whitespace before it, since whitespace before a tag
    is dropped and so is only certain once something other than a tag follows it."""
    sure = text[: len(text) - partial_suffix(text, tags)]
    if trim:
        sure = sure.rstrip()
    return sure, text[len(sure) :]


@dataclass(frozen=True)
class Cut:
    """``text`` up to the first tag and ``rest`` after it; with no whole tag yet, ``tag`` is empty, ``text`` is what
    is certain and ``rest`` what is held back (see :func:`hold_back`)."""

    text: str
    tag: str
    rest: str


def split_at(text: str, tags: Sequence[str], trim: bool = True) -> Cut:
    """Cut ``text`` at the first of ``tags``. ``trim``: the whitespace just before a tag is dropped (and so held
    back while a tag may follow it)."""
    i, tag = earliest(text, tags)
    if i == -1:
        sure, held = hold_back(text, tags, trim)
        return Cut(sure, "", held)
    before = text[:i]
    return Cut(before.rstrip() if trim else before, tag, text[i + len(tag) :])


class Lead(Enum):
    """Whether a text begins with a tag (whitespace before it allowed): found, maybe (wait), or not."""

    FOUND = auto()
    WAIT = auto()
    ABSENT = auto()


def leading(text: str, tag: str) -> tuple[Lead, str]:
    """Whether ``text`` begins with ``tag`` after optional whitespace; when FOUND, also what follows the tag. Only
    whitespace, or the start of the tag, is WAIT."""
    head = text.lstrip()
    if head.startswith(tag):
        return Lead.FOUND, head[len(tag) :]
    return (Lead.WAIT if tag.startswith(head) else Lead.ABSENT), ""


def assistant_prefill(last: Message | None) -> bool:
    """True when the prompt ends with an assistant message that already has content: the generation continues the
    answer, so whatever thinking there was is over."""
    return last is not None and last.role == "assistant" and bool(last.content)


def give_call(out: Parsed, call: ToolCall | None, text: str) -> None:
    """Add ``call`` to ``out``; when it did not parse (None), the ``text`` it was read from is content instead, so
    nothing the model wrote is lost."""
    if call is not None:
        out.calls.append(call)
    else:
        out.content += text


class JsonEnd:
    """Finds where a JSON object or array that starts at ``start`` closes, scanning each character once however
    the text grows (calls can be long, and arrive a token at a time). Brackets inside strings do not count."""

    def __init__(self, start: int = 0) -> None:
        self.pos = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int:
        """The index of the closing bracket in ``text`` (the same text, grown), or -1 while it is still open."""
        while self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return self.pos - 1
        return -1


class StreamParser:
    """The skeleton of a family's streaming state machine: ``add`` appends the piece to ``_buf``, runs ``_step``
    until it says nothing more can be done, and on the last piece ``_flush``es what was held back. ``_skip_ws``
    drops the whitespace that follows a tag, however the pieces split it (see :meth:`_skip_space`)."""

    #: see ``Parser.answer_after_thinking``: "" unless the family's prompt needs a switch into the answer
    answer_after_thinking: str = ""
    _buf: str = ""
    _skip_ws: bool = False

    def add(self, text: str, done: bool) -> Parsed:
        self._buf += text
        out = Parsed()
        while self._step(out):
            pass
        if done:
            self._flush(out)
        return out

    def _step(self, out: Parsed) -> bool:
        """Consume what the buffer makes certain; True when the state changed and another step may do more."""
        raise NotImplementedError

    def _flush(self, out: Parsed) -> None:
        """The end of the output: give out what was held back, as what it was."""
        raise NotImplementedError

    def _skip_space(self) -> bool:
        """Drop the whitespace owed after a tag; False when the buffer is empty (wait for more), else True."""
        if self._skip_ws:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._skip_ws = False
        return bool(self._buf)

    def _cut(self, tags: Sequence[str], trim: bool = True) -> tuple[str, str]:
        """Cut the buffer at the first of ``tags`` (:func:`split_at`): returns (the certain text, the tag or "");
        the buffer keeps what follows the tag, or what is held back when no tag is whole yet."""
        cut = split_at(self._buf, tags, trim)
        self._buf = cut.rest
        return cut.text, cut.tag


class Prelude(Enum):
    """Where a :class:`ThinkingFirst` stream is: before any visible text, thinking, or in the answer."""

    START = auto()  # before the first visible text: the opening tag may still start thinking
    THINKING = auto()
    OVER = auto()  # the answer, read by the family's own states


class ThinkingFirst(StreamParser):
    """A stream that may begin with thinking up to ``think_close``, opened by the prompt or by the model writing
    ``think_open`` first, and then an answer the family reads itself (``_step_answer``/``_flush_answer``); once the
    answer started the thinking never comes back (DeepSeek, GLM). The whitespace at the edges of the thinking is
    trimmed, as Ollama does."""

    think_open = "<think>"
    think_close = "</think>"
    _prelude = Prelude.OVER
    _think_after_start = False  # what START becomes when the output does not open with the tag

    def _begin(self, tag_may_open: bool, thinking: bool) -> None:
        """Start a generation. ``tag_may_open``: the model may write the opening tag itself (watch the first visible
        text for it); ``thinking``: the prompt opened the thinking, so output starts inside it."""
        self._buf, self._skip_ws = "", False
        if tag_may_open:
            self._prelude, self._think_after_start = Prelude.START, thinking
        else:
            self._prelude = Prelude.THINKING if thinking else Prelude.OVER
            self._skip_ws = thinking

    def _step(self, out: Parsed) -> bool:
        if not self._skip_space():
            return False
        if self._prelude is Prelude.START:
            lead, rest = leading(self._buf, self.think_open)
            if lead is Lead.WAIT:
                return False
            if lead is Lead.FOUND:
                self._buf = rest
            thinking = lead is Lead.FOUND or self._think_after_start
            self._prelude, self._skip_ws = (Prelude.THINKING if thinking else Prelude.OVER), thinking
            return True
        if self._prelude is Prelude.THINKING:
            text, tag = self._cut((self.think_close,))
            out.thinking += text
            if tag:
                self._prelude, self._skip_ws = Prelude.OVER, True
            return bool(tag)
        return self._step_answer(out)

    def _flush(self, out: Parsed) -> None:
        if self._prelude is Prelude.START:
            self._prelude = Prelude.THINKING if self._think_after_start else Prelude.OVER
        if self._prelude is Prelude.THINKING:
            out.thinking += self._buf
            self._buf = ""
        else:
            self._flush_answer(out)

    def _step_answer(self, out: Parsed) -> bool:
        """One step of the family's own states, after the thinking (the buffer is not empty)."""
        raise NotImplementedError

    def _flush_answer(self, out: Parsed) -> None:
        """The end of the output in the answer: give out what was held back, as what it was."""
        raise NotImplementedError


THINKING = "thinking"
CONTENT = "content"


class ThinkContentCalls(StreamParser):
    """A stream that moves between thinking, content and the family's tool-call state (any other ``_state``), and
    may go back to thinking (Qwen3, Mistral). At the end, held thinking or content is given out as it is, with the
    whitespace owed after a tag dropped; what a call state held is the family's to decide (``_flush_call``)."""

    _state = CONTENT

    def _step(self, out: Parsed) -> bool:
        if not self._skip_space():
            return False
        if self._state == THINKING:
            return self._step_thinking(out)
        if self._state == CONTENT:
            return self._step_content(out)
        return self._step_call(out)

    def _flush(self, out: Parsed) -> None:
        buf, self._buf = self._buf, ""
        if self._skip_ws:
            buf = buf.lstrip()
        if self._state == THINKING:
            out.thinking += buf
        elif self._state == CONTENT:
            out.content += buf
        else:
            self._flush_call(out, buf)
        self._state = CONTENT

    def _step_thinking(self, out: Parsed) -> bool:
        raise NotImplementedError

    def _step_content(self, out: Parsed) -> bool:
        raise NotImplementedError

    def _step_call(self, out: Parsed) -> bool:
        raise NotImplementedError

    def _flush_call(self, out: Parsed, held: str) -> None:
        """The end of the output inside a call: ``held`` is what followed the call's opening tag."""
        raise NotImplementedError
