"""``deepseek3`` and ``deepseek-r1``: DeepSeek's output, thinking closed by ``</think>`` and tool calls between the
full-width-bar tokens ``<｜tool▁calls▁begin｜>``/``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>``.

V3.1/V3.2 write ``NAME<｜tool▁sep｜>{json}``; V3 and R1 write ``function<｜tool▁sep｜>NAME`` followed by a fenced
```` ```json ```` block. Both are read everywhere, so one parser serves every DeepSeek-shaped family (cogito too)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from enum import Enum, auto

from daemon.chat.parsers.base import register
from daemon.chat.parsers.text import ThinkingFirst, assistant_prefill, earliest, give_call, hold_back
from daemon.chat.types import Message, Parsed, ThinkValue, Tool, ToolCall, think_enabled

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"
_CONTENT_TAGS = (CALLS_BEGIN, CALL_BEGIN, OUTPUT_BEGIN, OUTPUTS_BEGIN)


class _State(Enum):
    """The answer's states; the thinking before it is :class:`ThinkingFirst`'s."""

    CONTENT = auto()
    CALLS = auto()  # inside <｜tool▁calls▁begin｜> ... <｜tool▁calls▁end｜>
    OUTPUT = auto()  # inside <｜tool▁output▁begin｜> ... <｜tool▁output▁end｜>: echoed tool output, kept as content
    OUTPUTS = auto()  # inside <｜tool▁outputs▁begin｜> ... <｜tool▁outputs▁end｜>: dropped (cogito)


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


class DeepSeekParser(ThinkingFirst):
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

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        thinking = self.has_thinking and think_enabled(think)
        if tools and not self._think_with_tools:
            thinking = False
        # an assistant prefill with text has left thinking already
        if assistant_prefill(last):
            thinking = False
        # R1 writes <think> itself even when not asked; its thinking is separated, never shown as content
        self._begin(self._think_tag, thinking)
        self._state = _State.CONTENT
        return tools

    def _step_answer(self, out: Parsed) -> bool:
        buf, st = self._buf, self._state
        if st is _State.CONTENT:
            i, tag = earliest(buf, _CONTENT_TAGS)
            if i == -1:
                sure, self._buf = hold_back(buf, _CONTENT_TAGS)
                out.content += sure
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
            text, tag = self._cut((OUTPUT_END,), trim=False)
            out.content += text
            if tag:
                self._state = _State.CONTENT
            return bool(tag)
        # OUTPUTS: the model's echo of tool results is not part of its answer
        _, tag = self._cut((OUTPUTS_END,), trim=False)
        if tag:
            self._state, self._skip_ws = _State.CONTENT, True
        return bool(tag)

    def _step_calls(self, buf: str, out: Parsed) -> bool:
        if buf.startswith(CALL_BEGIN):
            end = buf.find(CALL_END, len(CALL_BEGIN))
            if end == -1:
                return False  # calls are not streamed: wait for the whole call
            call = parse_call(buf[len(CALL_BEGIN) : end])
            give_call(out, call, buf[: end + len(CALL_END)])  # not a call: nothing is lost
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
            i = len(hold_back(buf, (CALL_BEGIN, CALLS_END), trim=False)[0])
        out.content += buf[:i]
        self._buf = buf[i:]
        return i < len(buf)

    def _flush_answer(self, out: Parsed) -> None:
        buf, st = self._buf, self._state
        self._buf = ""
        if st is _State.CALLS and buf.startswith(CALL_BEGIN):
            # the end token may be cut off by a stop: a call whose JSON is whole still counts
            body = buf[len(CALL_BEGIN) :]
            call = parse_call(hold_back(body, (CALL_END,), trim=False)[0])
            give_call(out, call, buf)
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
