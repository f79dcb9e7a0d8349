"""``harmony``: gpt-oss's message format. Each message is ``<|start|>HEADER<|message|>BODY`` ended by ``<|end|>``
(or ``<|call|>`` after a call, ``<|return|>`` at the very end); the header holds the role, ``<|channel|>NAME`` and
perhaps a recipient ``to=functions.NAME`` (before or after the channel) and ``<|constrain|>json``.

Channels map to Ollama's fields: ``analysis`` is thinking, ``final`` and plain ``commentary`` are content, and a
message with a recipient is a tool call whose body is the JSON arguments, returned when the message ends. The
prompt ends with ``<|start|>assistant``, so the output usually begins at ``<|channel|>``; an assistant prefill
continues the final (or analysis) message instead.

Tool names must be identifiers in harmony's TypeScript-like tool declarations, so ``init`` renames tools whose names
are not (``get-weather`` → ``get_weather``, duplicates numbered) and calls are mapped back to the user's names."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from daemon.chat.parsers.base import register
from daemon.chat.parsers.text import StreamParser, earliest
from daemon.chat.types import Message, Parsed, ThinkValue, Tool, ToolCall

START = "<|start|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
END = "<|end|>"
CALL = "<|call|>"
RETURN = "<|return|>"

_BODY_TAGS = (END, CALL, RETURN, START)  # what may end a message body (a new <|start|> ends it implicitly)
_OUTSIDE_TAGS = (START, CHANNEL)  # what may begin a message when outside one

# Ollama's built-in tools keep their names (the model knows them as they are)
_BUILTINS = frozenset({"browser.open", "browser.search", "browser.find", "python"})

# parser states
_OUTSIDE = "outside"
_HEADER = "header"
_BODY = "body"

# what a message body is
_CONTENT = "content"
_THINKING = "thinking"
_TOOL = "tool"


def parse_header(raw: str) -> tuple[str, str, str]:
    """A header's (role, channel, recipient); missing parts are empty."""
    # a constraint glued to the channel or recipient ("commentary<|constrain|>json") must stay a separate word
    raw = raw.replace(CONSTRAIN, " " + CONSTRAIN, 1).strip()
    channel = ""
    at = raw.find(CHANNEL)
    if at != -1:
        after = raw[at + len(CHANNEL) :]
        words = after.split(maxsplit=1)
        channel = words[0] if words else ""
        rest = after[after.find(channel) + len(channel) :] if channel else after
        raw = (raw[:at] + " " + rest).strip()
    tokens = raw.split()
    if not tokens:
        return "", channel, ""
    role, recipient = tokens[0], ""
    if role.startswith("to="):
        role, recipient = "tool", role[3:]
    elif len(tokens) > 1 and tokens[1].startswith("to="):
        recipient = tokens[1][3:]
    return role, channel, recipient


class FunctionNames:
    """A two-way map between the user's tool names and the harmony identifiers shown to the model."""

    def __init__(self) -> None:
        self.to_harmony: dict[str, str] = {}
        self.to_user: dict[str, str] = {}

    def add(self, user: str) -> str:
        """The harmony name for ``user`` (recorded so calls map back)."""
        name = user if user in _BUILTINS else self._unique(self._identifier(user))
        self.to_harmony[user] = name
        self.to_user[name] = user
        return name

    def user(self, harmony: str) -> str:
        """The user's name for a harmony name the model called; an unknown name is kept as it is."""
        return self.to_user.get(harmony, harmony)

    @staticmethod
    def _identifier(user: str) -> str:
        # separators become underscores; other characters that an identifier cannot hold are dropped
        chars = []
        for c in user:
            if c in " -.":
                chars.append("_")
            elif c.isalpha() or c.isdecimal() or c in "_$":
                chars.append(c)
        name = "".join(chars) or "unnamed"
        return "_" + name if "0" <= name[0] <= "9" else name

    def _unique(self, name: str) -> str:
        candidate, n = name, 2
        while candidate in self.to_user:
            candidate = f"{name}_{n}"
            n += 1
        return candidate


@register("harmony")
class HarmonyParser(StreamParser):
    """Splits gpt-oss output into thinking, content and tool calls."""

    #: after the thinking (analysis channel), into the answer: what thinking-then-format appends to the prompt
    answer_after_thinking = "<|end|><|start|>assistant<|channel|>final<|message|>"
    has_tools = True
    has_thinking = True

    def __init__(self) -> None:
        self._names = FunctionNames()
        self._buf = ""
        self._state = _HEADER
        self._header_prefix = ""  # the part of the header the prompt already holds ("assistant")
        self._kind = _CONTENT
        self._recipient = ""

    def init(self, tools: Sequence[Tool] | None, last: Message | None, think: ThinkValue) -> Sequence[Tool] | None:
        self._names = FunctionNames()
        self._buf = ""
        self._recipient = ""
        if last is not None and last.role == "assistant" and (last.content or last.thinking):
            # a prefill continues its message: the answer if it has content, else the reasoning
            self._state = _BODY
            self._kind = _CONTENT if last.content else _THINKING
        else:
            self._state = _HEADER
            self._header_prefix = "assistant"
            self._kind = _CONTENT
        if not tools:
            return tools
        renamed: list[Tool] = []
        for tool in tools:
            fn = tool.function
            name = fn.get("name") if fn is not None else None
            if fn is not None and isinstance(name, str) and name:
                new = self._names.add(name)
                if new != name:
                    tool = Tool(name=new, spec={**tool.spec, "function": {**fn, "name": new}})
            renamed.append(tool)
        return renamed

    # -- the state machine ---------------------------------------------------------------------------------------

    def _step(self, out: Parsed) -> bool:
        if self._state == _OUTSIDE:
            return self._step_outside(out)
        if self._state == _HEADER:
            return self._step_header()
        return self._step_body(out)

    def _step_outside(self, out: Parsed) -> bool:
        # between messages only a new message is expected; stray text is kept as content (nothing is lost), the
        # whitespace around messages is not
        text, tag = self._cut(_OUTSIDE_TAGS)
        out.content += text
        if not tag:
            return False
        # a model that skips "<|start|>assistant" goes straight to the channel: keep it as part of the header
        if tag == CHANNEL:
            self._buf = tag + self._buf
        self._state = _HEADER
        self._header_prefix = ""
        return True

    def _step_header(self) -> bool:
        at = self._buf.find(MESSAGE)
        if at == -1:
            return False
        _role, channel, recipient = parse_header(self._header_prefix + self._buf[:at])
        self._buf = self._buf[at + len(MESSAGE) :]
        self._header_prefix = ""
        self._state = _BODY
        self._recipient = ""
        if recipient and channel in ("analysis", "commentary"):
            self._kind, self._recipient = _TOOL, recipient
        elif channel == "analysis":
            self._kind = _THINKING
        else:
            self._kind = _CONTENT
        return True

    def _step_body(self, out: Parsed) -> bool:
        if self._kind == _TOOL and earliest(self._buf, _BODY_TAGS)[0] == -1:
            return False  # the arguments are returned whole, when the message ends
        # a body is kept as written: no whitespace is trimmed inside a message
        text, tag = self._cut(_BODY_TAGS, trim=False)
        self._emit(out, text, ended=bool(tag))
        if tag:
            self._state = _HEADER if tag == START else _OUTSIDE
            self._header_prefix = ""
        return bool(tag)

    def _emit(self, out: Parsed, text: str, ended: bool) -> None:
        if self._kind == _THINKING:
            out.thinking += text
        elif self._kind == _CONTENT:
            out.content += text
        elif ended:
            self._call(out, text)

    def _call(self, out: Parsed, body: str) -> None:
        """A tool message's body is its JSON arguments; when they do not parse, the body is content."""
        args: Any
        try:
            args = json.loads(body) if body.strip() else {}
        except (ValueError, RecursionError):
            args = None
        if not isinstance(args, dict):
            out.content += body
            return
        name = self._recipient.removeprefix("functions.")
        out.calls.append(ToolCall(name=self._names.user(name), arguments=args))

    def _flush(self, out: Parsed) -> None:
        """End of generation (``<|call|>`` and ``<|return|>`` are usually stop tokens, so this is where a call or
        the answer ends): return everything still held."""
        buf, self._buf = self._buf, ""
        if self._state == _BODY:
            self._emit(out, buf, ended=True)
        elif self._state == _OUTSIDE:
            out.content += buf.rstrip()  # stray text after the last message; the whitespace around messages goes
        elif CHANNEL not in buf:
            # output that never took harmony's shape (no <|message|>) is the model's words, kept; a header cut off
            # by the length limit is not words, and is dropped
            out.content += buf
        self._state = _OUTSIDE
