'''Modelfile text to :class:`Modelfile` (Ollama's grammar, with exact line and column in every error).

Lines end at CR, LF or CRLF. A line is blank, a comment (``#`` first), or ``KEYWORD<space>argument``. An argument
starting with ``"`` or ``"""`` runs, verbatim, to the end of the first line whose text (trailing blanks ignored)
ends with the same quote; the quotes are removed. Non-printable characters other than tab are dropped.
'''

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from typing import Any

from modelfile.ast import INSTRUCTIONS, ROLES, From, Instruction, Message, Modelfile, Parameter
from modelfile.errors import ModelfileError, ParameterError
from modelfile.params import DEPRECATED_OPTIONS, OPTION_TYPES, coerce_parameter, did_you_mean

_NEWLINE = re.compile(r"(\r\n|\r|\n)")
_REQUIRES = re.compile(r"v?[0-9]+(?:\.[0-9]+){0,2}(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?\Z")
_HINTS = {
    "FROM": "a model name or a path to a GGUF file",
    "PARAMETER": "a parameter name and a value",
    "TEMPLATE": "a prompt template",
    "SYSTEM": "a system prompt",
    "ADAPTER": "a path to a LoRA adapter",
    "LICENSE": "the license text",
    "MESSAGE": "a role (system, user or assistant) and the message text",
    "REQUIRES": "a version such as 0.6.2",
    "RENDERER": "a renderer name",
    "PARSER": "a parser name",
    "DRAFT": "a path to a draft model",
}
#: Keywords whose value may not be blank.
_NAMED = frozenset({"FROM", "ADAPTER", "REQUIRES", "RENDERER", "PARSER", "DRAFT"})


@dataclass(frozen=True)
class Line:
    """One line with non-printables removed; ``cols`` maps text positions to 1-based source columns."""

    number: int
    text: str
    end: str
    width: int
    cols: tuple[int, ...] | None = None

    def col(self, i: int) -> int:
        if i >= len(self.text):
            return self.width + 1
        return self.cols[i] if self.cols is not None else i + 1


def split_lines(text: str) -> list[Line]:
    parts = _NEWLINE.split(text)
    lines = []
    for k in range(0, len(parts), 2):
        raw, end = parts[k], (parts[k + 1] if k + 1 < len(parts) else "")
        if raw.isprintable():
            lines.append(Line(k // 2 + 1, raw, end, len(raw)))
            continue
        kept = [(n + 1, c) for n, c in enumerate(raw) if c == "\t" or c.isprintable()]
        cleaned = "".join(c for _, c in kept)
        lines.append(Line(k // 2 + 1, cleaned, end, len(raw), tuple(n for n, _ in kept)))
    return lines


def read_value(lines: list[Line], i: int, p: int, filename: str) -> tuple[str, int]:
    """Read the argument at ``lines[i].text[p:]``; return it and the index of the line after it."""
    rest = lines[i].text[p:]
    if not rest.startswith('"'):
        return rest.rstrip(" \t"), i + 1
    quote = '"""' if rest.startswith('"""') else '"'
    body = rest.rstrip(" \t")
    j = i
    if not (len(body) >= 2 * len(quote) and body.endswith(quote)):
        while True:
            j += 1
            if j == len(lines):
                line, col = lines[i].number, lines[i].col(p)
                raise ModelfileError(
                    filename,
                    line,
                    col,
                    f"unterminated {quote} string starting at line {line}, "
                    f"column {col}: no closing {quote} before the end of the file",
                )
            if lines[j].text.rstrip(" \t").endswith(quote):
                break
        pieces = [rest] + [lines[k - 1].end + lines[k].text for k in range(i + 1, j + 1)]
        body = "".join(pieces).rstrip(" \t")
    return body[len(quote) : -len(quote)], j + 1


def check_value(keyword: str, value: str) -> str | None:
    """Why ``value`` is not acceptable for a plain one-value keyword, or None."""
    if keyword in _NAMED and not value.strip():
        return f"{keyword} needs {_HINTS[keyword]}"
    if keyword == "REQUIRES" and not _REQUIRES.match(value):
        return f'REQUIRES needs a version such as 0.6.2, got "{_clip(value)}"'
    return None


def check_role(role: str) -> str | None:
    if role in ROLES:
        return None
    return f'message role must be one of "system", "user", or "assistant", got "{_clip(role)}"'


def parse(text: str | bytes, filename: str = "Modelfile") -> Modelfile:
    """Parse Modelfile text (str, or bytes in UTF-8 or BOM-marked UTF-16)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        text = _decode(bytes(text), filename)
    elif text.startswith("\ufeff"):
        text = text[1:]
    lines = split_lines(text)
    out: list[Instruction] = []
    i = 0
    while i < len(lines):
        s = lines[i].text
        p = _skip(s, 0)
        if p == len(s) or s[p] == "#":
            i += 1
            continue
        ins, i = _instruction(lines, i, p, filename)
        out.append(ins)
    if not any(isinstance(ins, From) for ins in out):
        raise ModelfileError(
            filename, 1, 1, "no FROM line: a Modelfile needs a FROM line naming a model or a GGUF file"
        )
    return Modelfile(tuple(out))


def _instruction(lines: list[Line], i: int, p: int, filename: str) -> tuple[Instruction, int]:
    line = lines[i]
    s = line.text

    def fail(pos: int, detail: str) -> ModelfileError:
        return ModelfileError(filename, line.number, line.col(pos), detail)

    q = _token_end(s, p)
    word = s[p:q]
    kw = word.upper() if word.isascii() and word.isalpha() else ""
    if kw not in INSTRUCTIONS:
        head = re.match(r"[A-Za-z]+", word)
        if head and head.group().upper() in INSTRUCTIONS:
            raise fail(p + head.end(), f'expected a space after {head.group().upper()}, got "{word[head.end()]}"')
        raise fail(p, _unknown(word))
    r = _skip(s, q)
    if r == len(s):
        raise fail(p, f"{kw} needs an argument: {_HINTS[kw]}")
    where = {"line": line.number, "column": line.col(p)}
    if kw not in ("PARAMETER", "MESSAGE"):
        value, nxt = read_value(lines, i, r, filename)
        problem = check_value(kw, value)
        if problem:
            raise fail(r, problem)
        make: Any = INSTRUCTIONS[kw]  # every instruction but PARAMETER and MESSAGE is (value, line, column)
        return make(value, **where), nxt
    q = _token_end(s, r)
    name = s[r:q]
    v = _skip(s, q)
    if kw == "MESSAGE":
        problem = check_role(name)
        if problem:
            raise fail(r, problem)
        if v == len(s):
            raise fail(r, f"MESSAGE {name} needs the message text after the role")
        content, nxt = read_value(lines, i, v, filename)
        return Message(name, content, **where), nxt
    if name not in OPTION_TYPES and name not in DEPRECATED_OPTIONS:
        raise fail(r, f'unknown parameter "{_clip(name)}"' + did_you_mean(name, list(OPTION_TYPES)))
    if v == len(s):
        raise fail(r, f'parameter "{name}" needs a value after its name')
    raw, nxt = read_value(lines, i, v, filename)
    try:
        typed = coerce_parameter(name, raw)
    except ParameterError as exc:
        raise fail(v, exc.message) from None
    return Parameter(name, typed, **where), nxt


def _unknown(word: str) -> str:
    match = difflib.get_close_matches(word.upper(), list(INSTRUCTIONS), n=1)
    if match:
        return f'unknown instruction "{_clip(word)}" (did you mean {match[0]}?)'
    return f'unknown instruction "{_clip(word)}": expected one of {", ".join(INSTRUCTIONS)}'


def _decode(data: bytes, filename: str) -> str:
    encoding, body = "utf-8", data
    if data.startswith(b"\xef\xbb\xbf"):
        body = data[3:]
    elif data.startswith(b"\xff\xfe"):
        encoding, body = "utf-16-le", data[2:]
    elif data.startswith(b"\xfe\xff"):
        encoding, body = "utf-16-be", data[2:]
    try:
        return body.decode(encoding)
    except UnicodeDecodeError as exc:
        before = split_lines(body[: exc.start].decode(encoding, errors="replace"))
        label = "UTF-8" if encoding == "utf-8" else "UTF-16"
        raise ModelfileError(
            filename,
            before[-1].number,
            before[-1].width + 1,
            f"the file is not valid {label} (bad bytes {body[exc.start : exc.end].hex(' ')}); save it as UTF-8",
        ) from None


def _skip(s: str, p: int) -> int:
    while p < len(s) and s[p] in " \t":
        p += 1
    return p


def _token_end(s: str, p: int) -> int:
    while p < len(s) and s[p] not in " \t":
        p += 1
    return p


def _clip(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
