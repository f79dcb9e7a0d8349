"""``deepseek3`` and ``deepseek-r1``: DeepSeek's output, thinking closed by ``</think>`` and tool calls between the
full-width-bar tokens ``<｜tool▁calls▁begin｜>``/``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>``.

V3.1/V3.2 write ``NAME<｜tool▁sep｜>{json}``; V3 and R1 write ``function<｜tool▁sep｜>NAME`` followed by a fenced
```` ```json ```` block. Both are read everywhere, so one parser serves every DeepSeek-shaped family (cogito too)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import Enum, auto

from daemon.chat.parsers import register
from daemon.chat.parsers.base import Message, Tool
from daemon.chat.types import Parsed, ThinkValue, ToolCall, think_enabled

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"


class _State(Enum):
    START = auto()  # before the first visible text: an optional <think> may open thinking (R1)
    THINKING = auto()
    CONTENT = auto()
    CALLS = auto()  # inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>
    OUTPUT = auto()  # inside <｜tool▁output▁begin｜> ... <｜tool▁output▁end｜>: echoed tool output, kept as content
    OUTPUTS = auto()  # inside <｜tool▁outputs▁begin｜> ... <｜tool▁outputs▁end｜>: dropped (cogito)


def partial_suffix(buf: str, tags: Sequence[str]) -> int:
    """Length of the longest end of ``buf`` that is the start of one of ``tags``: text that must wait for the next
    piece, since it may yet become a tag."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


def earliest(buf: str, tags: Sequence[str]) -> tuple[int, str]:
    """The first complete tag in ``buf`` (index and tag), or ``(-1, "")``."""
    found = (-1, "")
    for tag in tags:
        i = buf.find(tag)
        if i != -1 and (found[0] == -1 or i < found[0]):
            found = (i, tag)
    return found


def parse_call(inner: str) -> ToolCall | None:
    """One call's text between ``<｜tool▁call▁begin｜>`` and ``<｜tool▁call▁end｜>``, in either DeepSeek shape; None
    when it is not a call (the caller keeps it as content)."""
    head, sep, rest = inner.partition(SEP)
    if not sep:
        return None
    name, body = head.strip(), rest.strip()
    if not body.startswith("{"):
        # V3/R1: "function<sep>NAME\n```json\n{...}\n```" (head is the call type, not the name)
        name, _, body = body.partition("\n")
        name, body = name.strip(), body.strip()
        if body.startswith("```"):
            body = body.removeprefix("```json").removeprefix("```")
            body = body.removesuffix("```").strip()
    if not name:
        return None
    try:
        args = json.loads(body)
    except ValueError:
        return None
    return ToolCall(name=name, arguments=args) if isinstance(args, dict) else None


class DeepSeekParser:
    """A streaming state machine over the DeepSeek tokens. Whitespace at the edges of thinking and around tool
    calls is trimmed (as Ollama does), so trailing whitespace is held back until the next visible character
    shows whether a tag follows; that keeps the result the same however the text is split."""

    has_tools = True

    def __init__(
        self, thinking: bool = True, think_tag: bool = False, drop_outputs: bool = False, think_with_tools: bool = True
    ) -> None:
        self.has_thinking = thinking
        self._think_tag = think_tag  # the model itself may write <think> (R1), not only the prompt
        self._drop_outputs = drop_outputs
        self._think_with_tools = think_with_tools
        self._state = _State.CONTENT
        self._after_start = _State.CONTENT
        self._buf = ""
        self._skip_ws = False

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        thinking = self.has_thinking and think_enabled(think)
        if tools and not self._think_with_tools:
            thinking = False
        # an assistant prefill with text has left thinking already
        if last is not None and last.get("role") == "assistant" and last.get("content"):
            thinking = False
        self._buf, self._skip_ws = "", False
        if self._think_tag:
            # R1 writes <think> itself even when not asked; its thinking is separated, never shown as content
            self._state, self._after_start = _State.START, (_State.THINKING if thinking else _State.CONTENT)
        else:
            self._state = _State.THINKING if thinking else _State.CONTENT
            self._skip_ws = thinking
        return tools

    def add(self, text: str, done: bool) -> Parsed:
        self._buf += text
        out = Parsed()
        while self._step(out):
            pass
        if done:
            self._flush(out)
        return out

    def _content_tags(self) -> tuple[str, ...]:
        return (CALLS_BEGIN, CALL_BEGIN, OUTPUT_BEGIN, OUTPUTS_BEGIN)

    def _step(self, out: Parsed) -> bool:
        """Consume what is certain; True when the state changed and the buffer should be looked at again."""
        if self._skip_ws:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._skip_ws = False
        buf = self._buf
        if not buf:
            return False
        st = self._state
        if st is _State.START:
            head = buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf, self._state, self._skip_ws = head[len(THINK_OPEN) :], _State.THINKING, True
                return True
            if not head or THINK_OPEN.startswith(head):
                return False
            self._state = self._after_start
            self._skip_ws = self._state is _State.THINKING
            return True
        if st is _State.THINKING:
            i = buf.find(THINK_CLOSE)
            if i != -1:
                out.thinking += buf[:i].rstrip()
                self._buf, self._state, self._skip_ws = buf[i + len(THINK_CLOSE) :], _State.CONTENT, True
                return True
            sure = buf[: len(buf) - partial_suffix(buf, (THINK_CLOSE,))].rstrip()
            out.thinking += sure
            self._buf = buf[len(sure) :]
            return False
        if st is _State.CONTENT:
            i, tag = earliest(buf, self._content_tags())
            if i == -1:
                sure = buf[: len(buf) - partial_suffix(buf, self._content_tags())].rstrip()
                out.content += sure
                self._buf = buf[len(sure) :]
                return False
            if tag == OUTPUT_BEGIN:
                out.content += buf[:i]  # echoed output keeps the text around it as written
                self._buf, self._state = buf[i + len(tag) :], _State.OUTPUT
                return True
            out.content += buf[:i].rstrip()
            if tag == CALL_BEGIN:  # a call without the outer calls token: read it all the same
                self._buf, self._state = buf[i:], _State.CALLS
            elif tag == CALLS_BEGIN:
                self._buf, self._state, self._skip_ws = buf[i + len(tag) :], _State.CALLS, True
            elif self._drop_outputs:
                self._buf, self._state = buf[i + len(tag) :], _State.OUTPUTS
            else:  # the outputs wrapper says nothing; its outputs are read as content
                self._buf, self._skip_ws = buf[i + len(tag) :], True
            return True
        if st is _State.CALLS:
            return self._step_calls(buf, out)
        if st is _State.OUTPUT:
            i = buf.find(OUTPUT_END)
            if i != -1:
                out.content += buf[:i]
                self._buf, self._state = buf[i + len(OUTPUT_END) :], _State.CONTENT
                return True
            sure = buf[: len(buf) - partial_suffix(buf, (OUTPUT_END,))]
            out.content += sure
            self._buf = buf[len(sure) :]
            return False
        # OUTPUTS: the model's echo of tool results is not part of its answer
        i = buf.find(OUTPUTS_END)
        if i != -1:
            self._buf, self._state, self._skip_ws = buf[i + len(OUTPUTS_END) :], _State.CONTENT, True
            return True
        self._buf = buf[len(buf) - partial_suffix(buf, (OUTPUTS_END,)) :]
        return False

    def _step_calls(self, buf: str, out: Parsed) -> bool:
        if buf.startswith(CALL_BEGIN):
            end = buf.find(CALL_END, len(CALL_BEGIN))
            if end == -1:
                return False  # calls are not streamed: wait for the whole call
            call = parse_call(buf[len(CALL_BEGIN) : end])
            if call is not None:
                out.calls.append(call)
            else:
                out.content += buf[: end + len(CALL_END)]  # not a call: nothing is lost
            self._buf, self._skip_ws = buf[end + len(CALL_END) :], True
            return True
        if buf.startswith(CALLS_END):
            self._buf, self._state, self._skip_ws = buf[len(CALLS_END) :], _State.CONTENT, True
            return True
        if CALL_BEGIN.startswith(buf) or CALLS_END.startswith(buf):
            return False
        # stray text between calls: content, up to the next call token
        i, _ = earliest(buf, (CALL_BEGIN, CALLS_END))
        if i == -1:
            i = len(buf) - partial_suffix(buf, (CALL_BEGIN, CALLS_END))
        out.content += buf[:i]
        self._buf = buf[i:]
        return i < len(buf)

    def _flush(self, out: Parsed) -> None:
        """The end of the output: what was held back is given out as what it was."""
        buf, st = self._buf, self._state
        self._buf = ""
        if not buf:
            return
        if st is _State.START:
            st = self._after_start
        if st is _State.THINKING:
            out.thinking += buf
        elif st is _State.CALLS and buf.startswith(CALL_BEGIN):
            # the end token may be cut off by a stop: a call whose JSON is whole still counts
            body = buf[len(CALL_BEGIN) :]
            call = parse_call(body[: len(body) - partial_suffix(body, (CALL_END,))])
            if call is not None:
                out.calls.append(call)
            else:
                out.content += buf
        elif st is not _State.OUTPUTS:
            out.content += buf


@register("deepseek3")
class DeepSeek3Parser(DeepSeekParser):
    """DeepSeek V3.1/V3.2: the prompt opens thinking when asked, so output starts inside it."""

    def __init__(self) -> None:
        super().__init__(thinking=True)


@register("deepseek-r1")
class DeepSeekR1Parser(DeepSeekParser):
    """DeepSeek R1 and its distills: ``<think>`` ... ``</think>`` written by the model (or opened by the prompt)."""

    def __init__(self) -> None:
        super().__init__(thinking=True, think_tag=True)
