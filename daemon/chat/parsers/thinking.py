"""A streaming splitter of generated text into thinking and content, for families that wrap their reasoning in an
opening and a closing tag (``<think>``/``</think>``), with the behaviour of Ollama's thinking parser.

The states: looking for the opening tag (leading whitespace is eaten; if the first non-whitespace text cannot
start the opening tag, thinking was skipped and everything is content), eating whitespace after the opening tag,
thinking, eating whitespace after the closing tag, and done (all content). Only text that could still be the start
of the tag being looked for is held back."""

from __future__ import annotations

from enum import Enum

from daemon.chat.parsers.text import Lead, leading, split_at

# Whitespace is Python's (str.lstrip), which differs from Go's unicode.IsSpace only on the ASCII separators
# U+001C..U+001F, which models do not emit.


class State(Enum):
    LOOKING = 0  # before the opening tag; nothing but whitespace so far
    STARTED = 1  # after the opening tag, eating whitespace
    THINKING = 2
    ENDED = 3  # after the closing tag, eating whitespace
    DONE = 4


class ThinkingParser:
    """Split a stream into (thinking, content). ``prefilled``: the prompt already ended with the opening tag, so the
    model starts inside its thinking."""

    def __init__(self, opening: str, closing: str, prefilled: bool = False) -> None:
        if not opening or not closing:
            raise ValueError("thinking tags must not be empty")
        self.opening, self.closing = opening, closing
        self.state = State.LOOKING
        self._acc = ""
        if prefilled:
            self.prefill()

    def prefill(self) -> None:
        """The opening tag was already emitted by the prompt: start inside thinking."""
        if self.state is State.LOOKING and not self._acc.strip():
            self._acc = ""
            self.state = State.STARTED

    def add(self, text: str) -> tuple[str, str]:
        """Take the next piece; return the (thinking, content) that is now certain."""
        self._acc += text
        thinking: list[str] = []
        content: list[str] = []
        # Several states may be passed through in one piece; loop until the held text is ambiguous or gone.
        while self._step(thinking, content):
            pass
        return "".join(thinking), "".join(content)

    def flush(self) -> tuple[str, str]:
        """The end of output: what was held back (a partial tag that never completed) is returned as it was."""
        held, self._acc = self._acc, ""
        if self.state is State.THINKING:
            return held, ""
        if self.state in (State.LOOKING, State.DONE):
            if self.state is State.LOOKING and held:
                self.state = State.DONE
            return "", held
        return "", ""  # only whitespace was held after a tag

    def _step(self, thinking: list[str], content: list[str]) -> bool:
        """One move of the state machine; True when it should run again at once."""
        acc = self._acc
        if self.state is State.LOOKING:
            lead, rest = leading(acc, self.opening)
            if lead is Lead.FOUND:
                self._acc = rest.lstrip()
                self.state = State.THINKING if self._acc else State.STARTED
                return True
            if lead is Lead.WAIT:
                return False  # whitespace, or a partial opening tag: wait
            # The answer began with something else: no thinking. The untrimmed text is kept, as it is content.
            self.state = State.DONE
            self._acc = ""
            content.append(acc)
            return False
        if self.state is State.STARTED:
            trimmed = acc.lstrip()
            self._acc = trimmed
            if not trimmed:
                return False
            self.state = State.THINKING
            return True
        if self.state is State.THINKING:
            # the thinking is kept as written: only the whitespace after the closing tag is eaten
            cut = split_at(acc, (self.closing,), trim=False)
            thinking.append(cut.text)
            if not cut.tag:
                self._acc = cut.rest
                return False
            rest = cut.rest.lstrip()
            self._acc = ""
            self.state = State.DONE if rest else State.ENDED
            content.append(rest)
            return False
        if self.state is State.ENDED:
            trimmed = acc.lstrip()
            self._acc = ""
            if trimmed:
                self.state = State.DONE
            content.append(trimmed)
            return False
        self._acc = ""
        content.append(acc)
        return False
