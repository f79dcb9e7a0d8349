"""A subset of Go's ``text/template``, in pure Python, enough for Ollama's prompt templates.

Supported: text and ``{{ }}`` actions with ``{{-``/``-}}`` trimming, comments, fields (``.X.Y``), variables (``$``,
``$x``, ``$.X``, ``:=`` and ``=``), ``if``/``else if``/``else``, ``range`` (lists, maps in sorted key order, ints;
``$i, $e :=``; ``else``; ``break``/``continue``), ``with``/``else with``, pipelines, parentheses, literals, and the
functions ``eq ne lt le gt ge and or not len index slice print printf println json currentDate yesterdayDate
toTypeScriptType``. ``define``/``template``/``block`` are not supported.

Data are plain Python values (a ``dict`` is a Go map, a ``list`` a slice) plus :class:`Struct`. A value with a
``go_string()`` method prints through it (Go's ``fmt.Stringer``); one with ``go_json()`` marshals through it.
Like Ollama's ``missingkey=zero`` a missing field is nil and prints ``<no value>``; it never raises.

A hostile template cannot hang or exhaust the daemon: the source is at most :data:`MAX_SOURCE` characters, and
an execution (see :class:`Budget`) is bounded in steps, in output characters, in the bytes of the values its
functions build (strings from ``print``/``printf``/``json``/``slice``..., estimated before they are built so no
single call can allocate past the bound) and in wall-clock time, checked at every step. Each bound raises a
:class:`TemplateError` that names it.
"""

from __future__ import annotations

import base64
import datetime as _dt
import re
import sys
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from errors import InvalidRequest

__all__ = ["TemplateError", "Template", "Struct", "Budget", "parse", "go_json", "go_print"]

MAX_SOURCE = 128 * 1024  # characters of template text (Ollama's own templates are a few KiB)
MAX_STEPS = 1_000_000
MAX_OUTPUT = 16 * 1024 * 1024  # characters of output
MAX_ALLOC = 64 * 1024 * 1024  # bytes of values built by functions during one execution
MAX_SECONDS = 2.0
MAX_DEPTH = 100
_MiB = 1024 * 1024
_SPACE = " \t\r\n"
_KEYWORDS = {"if", "else", "end", "range", "with", "break", "continue", "nil", "define", "template", "block"}


class TemplateError(InvalidRequest):
    """A template failed to parse or to execute; the message says where (``template: line:col: ...``)."""


class Struct:
    """A Go struct value: ``fields`` for templates; ``json`` (if given) is what ``json`` marshals, and with
    ``stringer`` it is also what printing shows, like a Go type with a ``String()`` method."""

    __slots__ = ("fields", "json", "stringer")

    def __init__(self, fields: dict[str, Any], json: Any = None, stringer: bool = False) -> None:
        self.fields, self.json, self.stringer = fields, json, stringer

    def go_json(self) -> Any:
        return self.fields if self.json is None else self.json

    def __repr__(self) -> str:
        return f"Struct({self.fields!r})"


# ---------------------------------------------------------------------------------------------------------- lexer


class _Tok:
    __slots__ = ("kind", "val", "pos", "end", "sp")

    def __init__(self, kind: str, val: Any, pos: int, end: int, sp: bool = False) -> None:
        self.kind, self.val, self.pos, self.end, self.sp = kind, val, pos, end, sp  # sp: whitespace before it


_ESC = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\", "'": "'", '"': '"'}
_ESC_RE = re.compile(r"\\(?:([abfnrtv\\'\"])|x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|([0-7]{3})|.)")
_ACTION_RE = re.compile(
    r"""
    (?P<close>[ \t\r\n]-\}\}|\}\})
  | (?P<space>[ \t\r\n]+?(?=[ \t\r\n]-\}\}|[^ \t\r\n]|\Z))
  | (?P<string>"(?:[^"\\\n]|\\.)*")
  | (?P<char>'(?:[^'\\\n]|\\.)*')
  | (?P<raw>`[^`]*`)
  | (?P<number>[+-]?\.?\d(?:[\w.]|(?<=[eEpP])[+-])*)
  | (?P<var>\$\w*)
  | (?P<field>\.\w+)
  | (?P<dot>\.)
  | (?P<ident>\w+)
  | (?P<op>:=|[|(),=])
""",
    re.X,
)
_UNTERMINATED = {
    '"': "unterminated quoted string",
    "'": "unterminated character constant",
    "`": "unterminated raw quoted string",
}


def _position(src: str, pos: int) -> str:
    return f"{src.count(chr(10), 0, pos) + 1}:{pos - src.rfind(chr(10), 0, pos)}"


def _unquote(body: str) -> str:
    def one(m: re.Match[str]) -> str:
        if m.group(1):
            return _ESC[m.group(1)]
        if not any(m.groups()):
            raise ValueError("invalid escape")
        return chr(int(m.group(2) or m.group(3) or m.group(4), 16) if not m.group(5) else int(m.group(5), 8))

    return _ESC_RE.sub(one, body)


def _number(text: str) -> int | float:
    t = text.replace("_", "")
    body = t.lstrip("+-")
    if body[:2].lower() == "0x":
        return float.fromhex(t) if any(ch in body for ch in ".pP") else int(t, 16)
    if any(ch in t for ch in ".eE"):
        return float(t)
    return int(t, 8) if len(body) > 1 and body[0] == "0" and body[1].isdigit() else int(t, 0)


def _lex(src: str) -> list[_Tok]:
    """Text and action tokens; trim markers are applied to the text here."""
    toks: list[_Tok] = []
    i, n, trim_next = 0, len(src), False

    def error(pos: int, msg: str) -> TemplateError:
        return TemplateError(f"template: {_position(src, pos)}: {msg}")

    while True:
        j = src.find("{{", i)
        text = src[i:] if j < 0 else src[i:j]
        left_trim = j >= 0 and src.startswith("-", j + 2) and j + 3 < n and src[j + 3] in _SPACE
        text = text.lstrip(_SPACE) if trim_next else text
        text = text.rstrip(_SPACE) if left_trim else text
        if text:
            toks.append(_Tok("text", text, i, j if j >= 0 else n))
        if j < 0:
            toks.append(_Tok("eof", "", n, n))
            return toks
        i = j + (4 if left_trim else 2)
        if src.startswith("/*", i):  # a comment must run right up to the closing delimiter
            end = src.find("*/", i + 2)
            if end < 0:
                raise error(j, "unclosed comment")
            m = re.compile(r"\*/([ \t\r\n]-)?\}\}").match(src, end)
            if not m:
                raise error(j, "comment ends before closing delimiter")
            i, trim_next = m.end(), bool(m.group(1))
            continue
        toks.append(_Tok("{{", "{{", j, i))
        depth, sp = 0, False
        while True:
            m = _ACTION_RE.match(src, i)
            if m is None:
                if i >= n:
                    raise error(j, "unclosed action")
                c = src[i]
                raise error(i, _UNTERMINATED.get(c) or f"unrecognized character in action: U+{ord(c):04X} {c!r}")
            kind, start, i = m.lastgroup or "", m.start(), m.end()
            val: Any = m.group()
            if kind == "space":
                sp = True
                continue
            if kind == "close":
                if depth:
                    raise error(start, "unclosed left paren")
                toks.append(_Tok("}}", "}}", start, i))
                trim_next = val != "}}"
                break
            if kind in ("string", "char"):
                try:
                    val = _unquote(val[1:-1])
                except ValueError:
                    raise error(start, f"invalid syntax: {m.group()}") from None
                if kind == "char" and len(val) != 1:
                    raise error(start, f"malformed character constant: {m.group()}")
                kind, val = ("number", ord(val)) if kind == "char" else ("string", val)
            elif kind == "raw":
                kind, val = "string", val[1:-1]
            elif kind == "number":
                try:
                    val = _number(val)
                except ValueError:
                    raise error(start, f"bad number syntax: {val!r}") from None
            elif kind == "ident":
                kind = "kw" if val in _KEYWORDS else "bool" if val in ("true", "false") else "ident"
            elif kind == "op":
                kind = val
                depth += (val == "(") - (val == ")")
                if depth < 0:
                    raise error(start, "unexpected right paren")
            toks.append(_Tok(kind, val, start, i, sp))
            sp = False


# ---------------------------------------------------------------------------------------------------------- parser
# Nodes are tuples: ("text", s) ("action", pos, pipe) ("if"|"with"|"range", pos, pipe, body, else)
# ("break"|"continue", pos); pipe = ("pipe", pos, decl, is_assign, cmds); cmd = ("cmd", pos, end, args);
# args: ("field", pos, idents) ("var", pos, name, idents) ("chain", pos, node, idents) ("ident", pos, name)
# ("dot", pos) ("nil", pos) ("lit", pos, value) and pipes.


class _Parser:
    def __init__(self, src: str, toks: list[_Tok]) -> None:
        self.src, self.toks, self.i = src, toks, 0
        self.vars, self.depth, self.in_range = ["$"], 0, 0

    def error(self, tok: _Tok, msg: str) -> TemplateError:
        return TemplateError(f"template: {_position(self.src, tok.pos)}: {msg}")

    def desc(self, t: _Tok) -> str:
        if t.kind == "eof":
            return "EOF"
        if t.kind == "kw":
            return f"<{t.val}>"
        raw = "}}" if t.kind == "}}" else self.src[t.pos : t.end]
        raw = raw if len(raw) <= 20 else raw[:20] + "..."
        return '"' + raw.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    def next(self) -> _Tok:
        self.i += 1
        return self.toks[self.i - 1]

    def peek(self, ahead: int = 0) -> _Tok:
        return self.toks[min(self.i + ahead, len(self.toks) - 1)]

    def expect_close(self, context: str) -> None:
        t = self.next()
        if t.kind != "}}":
            raise self.error(t, f"unexpected {self.desc(t)} in {context}")

    def items(self, top: bool = False) -> tuple[list[tuple[Any, ...]], str]:
        nodes: list[tuple[Any, ...]] = []
        while True:
            t = self.next()
            if t.kind == "eof":
                if top:
                    return nodes, "eof"
                raise self.error(t, "unexpected EOF")
            if t.kind == "text":
                nodes.append(("text", t.val))
                continue
            a = self.peek()
            if a.kind == "kw" and a.val in ("end", "else"):
                if top:
                    raise self.error(a, f"unexpected {{{{{a.val}}}}}")
                self.next()
                return nodes, a.val
            nodes.append(self.action())

    def action(self) -> tuple[Any, ...]:
        t = self.peek()
        if t.kind == "kw":
            if t.val in ("if", "range", "with"):
                self.next()
                return self.control(t)
            if t.val in ("break", "continue"):
                self.next()
                if not self.in_range:
                    raise self.error(t, f"{{{{{t.val}}}}} outside {{{{range}}}}")
                self.expect_close(t.val)
                return (t.val, t.pos)
            if t.val in ("define", "template", "block"):
                raise self.error(t, f"{{{{{t.val}}}}} is not supported")
        pipe = self.pipeline("command", "}}")
        return ("action", t.pos, pipe)

    def control(self, kw: _Tok) -> tuple[Any, ...]:
        mark = len(self.vars)
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.error(kw, "max nesting depth exceeded")
        pipe = self.pipeline(kw.val, "}}")
        self.in_range += kw.val == "range"
        body, term = self.items()
        self.in_range -= kw.val == "range"
        other: list[tuple[Any, ...]] | None = None
        if term == "else":
            nxt = self.peek()
            if nxt.kind == "kw" and nxt.val == kw.val and kw.val in ("if", "with"):
                self.next()
                other = [self.control(nxt)]  # consumes the shared {{end}}
            else:
                self.expect_close("else")
                other, term = self.items()
                if term != "end":
                    raise self.error(self.toks[self.i - 1], "expected end; found {{else}}")
                self.expect_close("end")
        else:
            self.expect_close("end")
        del self.vars[mark:]
        self.depth -= 1
        return (kw.val, kw.pos, pipe, body, other)

    def pipeline(self, context: str, end: str) -> tuple[Any, ...]:
        start = self.peek()
        decl: list[str] = []
        is_assign = False
        if start.kind == "var":  # declarations: $x := ... / $x = ... / range $i, $e := ...
            names, ahead = [start.val], 1
            if self.peek(1).kind == ",":
                if context != "range" or self.peek(2).kind != "var" or self.peek(3).kind not in (":=", "="):
                    raise self.error(
                        self.peek(1),
                        "range can only initialize variables"
                        if context == "range"
                        else f"too many declarations in {context}",
                    )
                names, ahead = [start.val, self.peek(2).val], 3
            if self.peek(ahead).kind in (":=", "="):
                decl, is_assign = names, self.peek(ahead).kind == "="
                self.i += ahead + 1
                if not is_assign:
                    self.vars.extend(decl)
        cmds: list[tuple[Any, ...]] = []
        while (t := self.peek()).kind != end:
            if t.kind not in ("field", "var", "ident", "dot", "string", "number", "bool", "(") and (t.kind, t.val) != (
                "kw",
                "nil",
            ):
                raise self.error(t, f"unexpected {self.desc(t)} in {context}")
            cmds.append(self.command(end))
            if self.peek().kind == "|":
                self.next()
                if self.peek().kind == end:
                    raise self.error(self.peek(), "missing command after |")
        self.next()
        if not cmds:
            raise self.error(start, f"missing value for {context}")
        for n, c in enumerate(cmds[1:], 2):
            if c[3][0][0] in ("lit", "dot", "nil"):
                raise self.error(start, f"non executable command in pipeline stage {n}")
        return ("pipe", start.pos, decl, is_assign, cmds)

    def command(self, end: str) -> tuple[Any, ...]:
        first, args = self.peek(), []
        while True:
            op = self.operand()
            t = self.peek()
            if op is None or not (t.kind in (end, "|") or t.sp):
                raise self.error(t, f"unexpected {self.desc(t)} in operand")
            args.append(op)
            if t.kind in (end, "|"):
                return ("cmd", first.pos, self.toks[self.i - 1].end, args)

    def operand(self) -> tuple[Any, ...] | None:
        node = self.term()
        fields: list[str] = []
        while node is not None and self.peek().kind == "field" and not self.peek().sp:
            fields.append(self.next().val[1:])
        if not fields:
            return node
        assert node is not None
        if node[0] == "field":
            return ("field", node[1], node[2] + tuple(fields))
        if node[0] == "var":
            return ("var", node[1], node[2], node[3] + tuple(fields))
        if node[0] in ("lit", "nil", "dot"):
            raise self.error(self.toks[self.i - 1], "unexpected . after term")
        return ("chain", node[1], node, tuple(fields))

    def term(self) -> tuple[Any, ...] | None:
        t = self.peek()
        k = t.kind
        if k == "ident":
            if t.val not in _FUNCS:
                raise self.error(t, f'function "{t.val}" not defined')
            node: tuple[Any, ...] = ("ident", t.pos, t.val)
        elif k == "dot":
            node = ("dot", t.pos)
        elif k == "kw" and t.val == "nil":
            node = ("nil", t.pos)
        elif k == "var":
            if t.val not in self.vars:
                raise self.error(t, f'undefined variable "{t.val}"')
            node = ("var", t.pos, t.val, ())
        elif k == "field":
            node = ("field", t.pos, (t.val[1:],))
        elif k in ("bool", "number", "string"):
            node = ("lit", t.pos, t.val == "true" if k == "bool" else t.val)
        elif k == "(":
            self.next()
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise self.error(t, "max expression depth exceeded")
            node = self.pipeline("parenthesized pipeline", ")")
            self.depth -= 1
            return node
        else:
            return None
        self.next()
        return node


# ---------------------------------------------------------------------------------------------------------- values


def _fmt_float(f: float, json: bool = False) -> str:
    if f != f or f in (float("inf"), float("-inf")):
        if json:
            raise ValueError(f"unsupported value: {f}")
        return "NaN" if f != f else ("+Inf" if f > 0 else "-Inf")
    if f == 0:
        return "-0" if str(f).startswith("-") else "0"
    sign, digits, exp = Decimal(repr(f)).as_tuple()
    d = "".join(map(str, digits)).rstrip("0") or "0"
    dp = len(digits) + int(exp)  # position of the decimal point
    x = dp - 1
    e_form = (abs(f) < 1e-6 or abs(f) >= 1e21) if json else (x < -4 or x >= 6)  # Go's %v: shortest %g
    if e_form:
        mant = d[0] + ("." + d[1:] if len(d) > 1 else "")
        ex = f"{'-' if x < 0 else '+'}{abs(x):0{1 if json else 2}d}"
        s = f"{mant}e{ex}"
    elif dp <= 0:
        s = "0." + "0" * -dp + d
    elif dp >= len(d):
        s = d + "0" * (dp - len(d))
    else:
        s = d[:dp] + "." + d[dp:]
    return ("-" if sign else "") + s


def _fmt(v: Any) -> str:
    """Go's ``%v``."""
    if hasattr(v, "go_string"):
        return str(v.go_string())
    if isinstance(v, str):
        return v
    if isinstance(v, bool) or v is None:
        return "<nil>" if v is None else "true" if v else "false"
    if isinstance(v, (int, float)):
        return _fmt_float(v) if isinstance(v, float) else str(v)
    if isinstance(v, (list, tuple, bytes, bytearray)):
        return "[" + " ".join(map(_fmt, v)) + "]"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{_fmt(k)}:{_fmt(v[k])}" for k in _sorted_keys(v)) + "]"
    if isinstance(v, Struct):
        if v.stringer and v.json is not None:
            try:
                return go_json(v)
            except ValueError:
                return ""
        return "{" + " ".join(map(_fmt, v.fields.values())) + "}"
    return str(v)


def go_print(v: Any) -> str:
    """How ``{{ v }}`` prints a value (nil and missing values print ``<no value>``)."""
    return "<no value>" if v is None else _fmt(v)


def _sorted_keys(d: dict[Any, Any]) -> list[Any]:
    """Go ranges over and prints maps in key order."""
    return sorted(d, key=lambda k: (not isinstance(k, (int, float)), k if isinstance(k, (int, float)) else str(k)))


_JSON_ESC = re.compile('[\x00-\x1f"\\\\<>&\u2028\u2029\ud800-\udfff]')
_JSON_SHORT = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


def _json_str(s: str) -> str:
    def esc(m: re.Match[str]) -> str:
        c = m.group()
        if c in _JSON_SHORT:
            return _JSON_SHORT[c]
        return "\\ufffd" if "\ud800" <= c <= "\udfff" else f"\\u{ord(c):04x}"

    return '"' + _JSON_ESC.sub(esc, s) + '"'


def _json(v: Any, out: list[str], depth: int) -> None:
    if depth > 200:
        raise ValueError("value too deeply nested")
    v = v.go_json() if hasattr(v, "go_json") else v
    if v is None or isinstance(v, (bool, int)):
        out.append("null" if v is None else ("true" if v else "false") if isinstance(v, bool) else str(v))
    elif isinstance(v, (float, str)):
        out.append(_fmt_float(v, json=True) if isinstance(v, float) else _json_str(v))
    elif isinstance(v, (bytes, bytearray)):
        out.append('"' + base64.b64encode(v).decode() + '"')
    elif isinstance(v, dict):
        out.append("{")
        for n, (key, item) in enumerate(v.items()):
            out.append(("," if n else "") + _json_str(str(key)) + ":")
            _json(item, out, depth + 1)
        out.append("}")
    elif isinstance(v, (list, tuple)):
        out.append("[")
        for n, item in enumerate(v):
            out.append("," if n else "")
            _json(item, out, depth + 1)
        out.append("]")
    else:
        raise ValueError(f"unsupported type: {type(v).__name__}")


def go_json(v: Any) -> str:
    """Compact JSON as Go's ``json.Marshal`` writes it (HTML-safe escapes; dicts in insertion order)."""
    out: list[str] = []
    _json(v, out, 0)
    return "".join(out)


def _truth(v: Any) -> bool:
    """Go's truth: false, 0, nil and empty strings, slices and maps are false; structs are true."""
    return bool(v) if v is None or isinstance(v, (bool, int, float, str, list, tuple, dict, bytes)) else True


def _gotype(v: Any) -> str:
    if v is None:
        return "<nil>"
    return {bool: "bool", int: "int", float: "float64", str: "string"}.get(type(v)) or (
        "[]interface {}"
        if isinstance(v, (list, tuple))
        else "map[string]interface {}"
        if isinstance(v, dict)
        else "struct"
        if isinstance(v, Struct)
        else type(v).__name__
    )


def _size(v: Any, cap: int, json: bool = False) -> int:
    """About how many characters printing (or with ``json``, marshalling) ``v`` writes, counted only until it
    passes ``cap`` (shared values are walked once). For JSON a string with anything to escape counts six characters
    per character, the most an escape takes."""
    seen: dict[int, int] = {}

    def walk(x: Any) -> int:
        if isinstance(x, str):
            return len(x) * (6 if json and _JSON_ESC.search(x) else 1) + 2
        if x is None or isinstance(x, (bool, int, float)):
            return 24
        if isinstance(x, (bytes, bytearray)):
            return 2 * len(x) + 2
        key = id(x)
        if key in seen:
            return seen[key]
        seen[key] = 0  # a cycle counts nothing more
        n = 2
        if isinstance(x, Struct):
            items: Any = list(x.fields.values()) + ([x.json] if x.json is not None else [])
        elif isinstance(x, dict):
            items = [*x.keys(), *x.values()]
        elif isinstance(x, (list, tuple)):
            items = x
        else:
            items = [str(x)] if not hasattr(x, "go_json") else [x.go_json()]
        for item in items:
            n += walk(item) + 1
            if n > cap:
                break
        seen[key] = n
        return n

    return walk(v)


# ---------------------------------------------------------------------------------------------------------- functions


class _FuncError(Exception):
    pass


def _kind(v: Any) -> str:
    if v is None or isinstance(v, (bool, str)):
        return "nil" if v is None else "bool" if isinstance(v, bool) else "string"
    return "number" if isinstance(v, (int, float)) else "other"


def _eq(a: Any, *bs: Any) -> bool:
    if not bs:
        raise _FuncError("missing argument for comparison")
    for b in bs:
        ka, kb = _kind(a), _kind(b)
        if ka != kb:
            if ka != "nil" and kb != "nil":
                raise _FuncError("incompatible types for comparison")
        elif ka == "other" and isinstance(a, (list, tuple, dict)):
            raise _FuncError(f"non-comparable type {_fmt(a)}: {_gotype(a)}")
        elif a is b or a == b:
            return True
    return False


def _ordered(op: Callable[[Any, Any], bool]) -> Callable[[Any, Any], bool]:
    def cmp(a: Any, b: Any) -> bool:
        ka, kb = _kind(a), _kind(b)
        if ka not in ("number", "string") or kb not in ("number", "string"):
            raise _FuncError("invalid type for comparison")
        if ka != kb:
            raise _FuncError("incompatible types for comparison")
        return op(a, b)

    return cmp


def _len(v: Any) -> int:
    if v is None:
        return 0
    if isinstance(v, str):
        return len(v) if v.isascii() else len(v.encode("utf-8", "surrogatepass"))
    if isinstance(v, (list, tuple, dict, bytes)):
        return len(v)
    raise _FuncError(f"len of type {_gotype(v)}")


def _int_index(i: Any, n: int, limit: int) -> int:
    if not isinstance(i, int) or isinstance(i, bool):
        raise _FuncError(f"cannot index slice/array with type {_gotype(i)}")
    if i < 0 or i > limit:
        raise _FuncError(f"index out of range: {i}")
    return i


def _index(v: Any, *idx: Any) -> Any:
    for i in idx:
        if v is None:
            return None
        if isinstance(v, dict):
            v = v.get(i)
        elif isinstance(v, str) and v.isascii():
            v = ord(v[_int_index(i, len(v), len(v) - 1)])
        elif isinstance(v, (list, tuple, str, bytes)):
            seq = v.encode() if isinstance(v, str) else v
            v = seq[_int_index(i, len(seq), len(seq) - 1)]
        else:
            raise _FuncError(f"can't index item of type {_gotype(v)}")
    return v


def _slice(v: Any, *idx: Any) -> Any:
    if isinstance(v, str):
        if len(idx) > 2:
            raise _FuncError("cannot 3-index slice a string")
        seq: Any = v if v.isascii() else v.encode("utf-8", "surrogatepass")
    elif isinstance(v, (list, tuple)):
        seq = v
    else:
        raise _FuncError(f"can't slice item of type {_gotype(v)}")
    if len(idx) > 3:
        raise _FuncError(f"too many slice indexes: {len(idx)}")
    ix = [_int_index(i, len(seq), len(seq)) for i in idx]
    for a, b in zip(ix, ix[1:], strict=False):
        if a > b:
            raise _FuncError(f"invalid slice index: {a} > {b}")
    out = seq[ix[0] if ix else 0 : ix[1] if len(ix) > 1 else len(seq)]
    if isinstance(out, str):
        return out
    return out.decode("utf-8", "replace") if isinstance(v, str) else list(out)


def _sprint(*args: Any) -> str:
    out = []
    for n, a in enumerate(args):
        if n and not isinstance(a, str) and not isinstance(args[n - 1], str):
            out.append(" ")
        out.append(_fmt(a))
    return "".join(out)


_VERB_RE = re.compile(r"%([-+# 0]*)(\d+)?(?:\.(\d*))?(.)", re.S)


def _go_quote(s: str) -> str:
    out = ['"']
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif c in "\a\b\f\n\r\t\v":
            out.append("\\" + "abfnrtv"["\a\b\f\n\r\t\v".index(c)])
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\x{ord(c):02x}")
        elif not c.isprintable():
            out.append(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}")
        else:
            out.append(c)
    return "".join(out) + '"'


def _printf(fmt: str, *args: Any, limit: int = MAX_OUTPUT) -> str:
    if not isinstance(fmt, str):
        raise _FuncError(f"printf: format must be a string, not {_gotype(fmt)}")
    out: list[str] = []
    pos = argi = total = counted = 0

    def room(more: int) -> None:  # raise before building what would take the result past ``limit``
        nonlocal total, counted
        while counted < len(out):
            total += len(out[counted])
            counted += 1
        if total + more > limit:
            raise _FuncError(f"result larger than {limit} characters")

    for m in _VERB_RE.finditer(fmt):
        room(m.start() - pos)
        out.append(fmt[pos : m.start()])
        pos = m.end()
        flags, width, prec, verb = m.group(1), m.group(2), m.group(3), m.group(4)
        if verb == "%":
            out.append("%")
            continue
        if argi >= len(args):
            out.append(f"%!{verb}(MISSING)")
            continue
        a = args[argi]
        argi += 1
        if int(width or 0) > 1 << 16 or int(prec or 0) > 1 << 16:
            raise _FuncError("printf: width or precision too large")
        # the most this verb can write: quoting can take 10 characters per character, hex 8
        factor = 10 if verb == "q" else 8 if verb in "xX" else 1
        room(int(width or 0) + factor * _size(a, limit - total + 1) + 32)
        num = isinstance(a, (int, float)) and not isinstance(a, bool)
        p = f".{prec or 0}" if prec is not None else ""
        s: str | None = None
        if verb == "v" or (verb == "s" and (isinstance(a, (str, list, tuple, dict)) or hasattr(a, "go_string"))):
            s = _fmt(a)
            s = s[: int(prec or 0)] if prec is not None and verb == "s" else s
        elif verb == "d" and isinstance(a, int) and not isinstance(a, bool):
            s = format(a, "+d" if "+" in flags else "d")
        elif verb in "feEgG" and num:
            s = format(float(a), ("+" if "+" in flags else "") + (p or (".6" if verb in "feE" else "")) + verb)
        elif verb == "q" and (isinstance(a, str) or (isinstance(a, int) and not isinstance(a, bool))):
            s = _go_quote(a) if isinstance(a, str) else "'" + _go_quote(chr(a))[1:-1].replace('\\"', '"') + "'"
        elif verb == "t" and isinstance(a, bool):
            s = _fmt(a)
        elif verb in "xX" and (isinstance(a, str) or (isinstance(a, int) and not isinstance(a, bool))):
            s = a.encode().hex() if isinstance(a, str) else format(a, "x")
            s = s.upper() if verb == "X" else s
        elif verb == "c" and isinstance(a, int) and not isinstance(a, bool) and 0 <= a <= 0x10FFFF:
            s = chr(a)
        if s is None:
            out.append(f"%!{verb}({_gotype(a)}={_fmt(a)})" if a is not None else f"%!{verb}(<nil>)")
            continue
        w = int(width or 0)
        if len(s) < w:
            if "-" in flags:
                s = s.ljust(w)
            elif "0" in flags and num:
                sign = s[0] if s[:1] in "+-" else ""
                s = sign + s[len(sign) :].rjust(w - len(sign), "0")
            else:
                s = s.rjust(w)
        out.append(s)
    room(len(fmt) - pos + sum(_size(a, limit) + 32 for a in args[argi:]))
    out.append(fmt[pos:])
    if argi < len(args):
        out.append("%!(EXTRA " + ", ".join(f"{_gotype(a)}={_fmt(a)}" for a in args[argi:]) + ")")
    return "".join(out)


def _json_func(v: Any) -> str:
    try:
        return go_json(v)
    except ValueError:
        return ""  # Ollama's json helper ignores marshal errors


_TS = {
    "string": "string",
    "number": "number",
    "integer": "number",
    "boolean": "boolean",
    "array": "any[]",
    "object": "Record<string, any>",
    "null": "null",
}


def _ts_type(v: Any) -> str:
    def get(name: str) -> Any:
        if isinstance(v, Struct):
            return v.fields.get(name)
        return v.get(name.lower() if name != "AnyOf" else "anyOf") if isinstance(v, dict) else None

    if not isinstance(v, (Struct, dict)):
        return "any"
    any_of = get("AnyOf")
    if any_of:
        return " | ".join(_ts_type(x) for x in any_of)
    t = get("Type")
    types = [t] if isinstance(t, str) else list(t or [])
    return " | ".join(_TS.get(x, "any") for x in types) if types else "any"


def _date(days: int) -> Callable[..., str]:
    return lambda *_: (_dt.date.today() - _dt.timedelta(days=days)).isoformat()


# name -> (function, min args, max args or None)
_FUNCS: dict[str, tuple[Callable[..., Any] | None, int, int | None]] = {
    "and": (None, 1, None),
    "or": (None, 1, None),
    "not": (lambda a: not _truth(a), 1, 1),
    "eq": (_eq, 1, None),
    "ne": (lambda a, b: not _eq(a, b), 2, 2),
    "lt": (_ordered(lambda a, b: a < b), 2, 2),
    "le": (_ordered(lambda a, b: a <= b), 2, 2),
    "gt": (_ordered(lambda a, b: a > b), 2, 2),
    "ge": (_ordered(lambda a, b: a >= b), 2, 2),
    "len": (_len, 1, 1),
    "index": (_index, 1, None),
    "slice": (_slice, 1, None),
    "print": (_sprint, 0, None),
    "printf": (_printf, 1, None),
    "println": (lambda *a: " ".join(map(_fmt, a)) + "\n", 0, None),
    "json": (_json_func, 1, 1),
    "currentDate": (_date(0), 0, None),
    "yesterdayDate": (_date(1), 0, None),
    "toTypeScriptType": (_ts_type, 1, 1),
}

# functions whose result can be much larger than their template text: estimated before they run
_BUILDERS = frozenset({"print", "printf", "println", "json"})

# ---------------------------------------------------------------------------------------------------------- exec

_NOFINAL: Any = object()


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


class Budget:
    """What one execution, or several in turn (Ollama's legacy templates run once per turn), may use: steps,
    output characters, bytes of values built by functions, and wall-clock seconds from when the budget was made.
    The ``*_used`` counters say what has been used so far."""

    __slots__ = (
        "max_steps",
        "max_output",
        "max_alloc",
        "timeout",
        "deadline",
        "steps_used",
        "output_used",
        "alloc_used",
    )

    def __init__(
        self,
        *,
        max_steps: int = MAX_STEPS,
        max_output: int = MAX_OUTPUT,
        max_alloc: int = MAX_ALLOC,
        timeout: float = MAX_SECONDS,
    ) -> None:
        self.max_steps, self.max_output, self.max_alloc, self.timeout = max_steps, max_output, max_alloc, timeout
        self.deadline = time.monotonic() + timeout
        self.steps_used = self.output_used = self.alloc_used = 0


class _Exec:
    def __init__(self, src: str, data: Any, budget: Budget) -> None:
        self.src, self.vars = src, [("$", data)]
        self.b = budget
        self.max_output = budget.max_output
        self.out: list[str] = []

    def error(self, pos: int, msg: str, at: str = "") -> TemplateError:
        where = f"executing at <{at}>: " if at else ""
        return TemplateError(f"template: {_position(self.src, pos)}: {where}{msg}")

    def tick(self, pos: int) -> None:
        b = self.b
        b.steps_used += 1
        if b.steps_used > b.max_steps:
            raise self.error(pos, f"template execution exceeded {b.max_steps} steps")
        if time.monotonic() > b.deadline:
            raise self.error(
                pos, f"template execution took longer than {b.timeout:g}s; use a simpler template or a shorter prompt"
            )

    def charge(self, nbytes: int, pos: int, at: str) -> None:
        b = self.b
        b.alloc_used += nbytes
        if b.alloc_used > b.max_alloc:
            raise self.error(
                pos,
                f"template execution used more than {b.max_alloc // _MiB} MiB of memory for the "
                "values its functions built; use a simpler template or a shorter prompt",
                at,
            )

    def write(self, s: str, pos: int) -> None:
        b = self.b
        b.output_used += len(s)
        if b.output_used > b.max_output:
            raise self.error(pos, f"template output exceeded {b.max_output} characters")
        self.out.append(s)

    def walk(self, dot: Any, nodes: list[tuple[Any, ...]]) -> None:
        for n in nodes:
            kind = n[0]
            if kind == "text":
                self.b.steps_used += 1
                self.write(n[1], 0)
                continue
            self.tick(n[1])
            if kind == "action":
                val = self.pipeline(dot, n[2])
                if not n[2][2]:
                    self.write(go_print(val), n[1])
            elif kind in ("if", "with"):
                mark = len(self.vars)
                val = self.pipeline(dot, n[2])
                if _truth(val):
                    self.walk(dot if kind == "if" else val, n[3])
                elif n[4] is not None:
                    self.walk(dot, n[4])
                del self.vars[mark:]
            elif kind == "range":
                self.range(dot, n)
            else:
                raise _Break() if kind == "break" else _Continue()

    def range(self, dot: Any, n: tuple[Any, ...]) -> None:
        _, pos, pipe, body, other = n
        mark = len(self.vars)
        val = self.commands(dot, pipe)
        if isinstance(val, dict):
            items: Any = [(k, val[k]) for k in _sorted_keys(val)]
        elif isinstance(val, (list, tuple)):
            items = enumerate(val)
        elif isinstance(val, int) and not isinstance(val, bool):
            if len(pipe[2]) > 1:
                raise self.error(pos, f"can't use {val} to iterate over more than one variable")
            items = ((i, i) for i in range(val))
        elif val is None:
            items = ()
        else:
            raise self.error(pos, f"range can't iterate over {_fmt(val)}")
        decl = pipe[2]
        if decl and not pipe[3]:
            self.vars.extend((name, None) for name in decl)
        empty = True
        for key, elem in items:
            empty = False
            self.tick(pos)
            if len(decl) == 1:
                self.set_var(decl[0], elem, pos)
            elif len(decl) == 2:
                self.set_var(decl[0], key, pos)
                self.set_var(decl[1], elem, pos)
            inner = len(self.vars)
            try:
                self.walk(elem, body)
            except _Continue:
                pass
            except _Break:
                break
            finally:
                del self.vars[inner:]
        if empty and other is not None:
            self.walk(dot, other)
        del self.vars[mark:]

    def set_var(self, name: str, val: Any, pos: int) -> None:
        for i in range(len(self.vars) - 1, -1, -1):
            if self.vars[i][0] == name:
                self.vars[i] = (name, val)
                return
        raise self.error(pos, f"undefined variable: {name}")

    def var(self, name: str, pos: int) -> Any:
        for vname, val in reversed(self.vars):
            if vname == name:
                return val
        raise self.error(pos, f"undefined variable: {name}")

    def commands(self, dot: Any, pipe: tuple[Any, ...]) -> Any:
        val = _NOFINAL
        for cmd in pipe[4]:
            val = self.command(dot, cmd, val)
        return val

    def pipeline(self, dot: Any, pipe: tuple[Any, ...]) -> Any:
        val = self.commands(dot, pipe)
        for name in pipe[2]:
            if pipe[3]:
                self.set_var(name, val, pipe[1])
            else:
                self.vars.append((name, val))
        return val

    def command(self, dot: Any, cmd: tuple[Any, ...], final: Any) -> Any:
        self.tick(cmd[1])
        first, args = cmd[3][0], cmd[3][1:]
        at = self.src[cmd[1] : cmd[2]]
        kind = first[0]
        if kind == "ident":
            return self.call(dot, first[2], args, final, cmd[1], at)
        has_args = bool(args) or final is not _NOFINAL
        if kind in ("field", "var", "chain") and first[-1]:
            recv = (
                dot if kind == "field" else self.var(first[2], first[1]) if kind == "var" else self.arg(dot, first[2])
            )
            return self.fields(recv, first[-1], has_args, first[1], at)
        if kind == "nil":
            raise self.error(cmd[1], "nil is not a command", at)
        if has_args:
            raise self.error(
                cmd[1], f"can't give argument to non-function {self.src[first[1] : cmd[2]].split()[0]}", at
            )
        return self.arg(dot, first)

    def fields(self, recv: Any, idents: tuple[Any, ...], has_args: bool, pos: int, at: str) -> Any:
        for n, name in enumerate(idents):
            if recv is None:
                return None
            if isinstance(recv, (dict, Struct)):
                if has_args and n == len(idents) - 1:
                    raise self.error(pos, f"{name} is not a method but has arguments", at)
                recv = (recv.fields if isinstance(recv, Struct) else recv).get(name)
            else:
                raise self.error(pos, f"can't evaluate field {name} in type {_gotype(recv)}", at)
        return recv

    def arg(self, dot: Any, node: tuple[Any, ...]) -> Any:
        kind = node[0]
        if kind == "lit":
            return node[2]
        if kind == "dot":
            return dot
        if kind == "nil":
            return None
        if kind == "field":
            return self.fields(dot, node[2], False, node[1], "." + ".".join(node[2]))
        if kind == "var":
            return self.fields(self.var(node[2], node[1]), node[3], False, node[1], node[2])
        if kind == "chain":
            return self.fields(self.arg(dot, node[2]), node[3], False, node[1], "")
        if kind == "ident":
            return self.call(dot, node[2], [], _NOFINAL, node[1], node[2])
        return self.pipeline(dot, node)

    def call(self, dot: Any, name: str, args: list[tuple[Any, ...]], final: Any, pos: int, at: str) -> Any:
        fn, lo, hi = _FUNCS[name]
        count = len(args) + (final is not _NOFINAL)
        if count < lo or (hi is not None and count > hi):
            want = f"at least {lo}" if hi is None else str(lo)
            raise self.error(pos, f"wrong number of args for {name}: want {want} got {count}", at)
        if fn is None:  # and / or: evaluate lazily, stop at the first deciding value
            val = None
            for a in args:
                val = self.arg(dot, a)
                if _truth(val) != (name == "and"):
                    return val
            return final if final is not _NOFINAL else val
        vals = [self.arg(dot, a) for a in args]
        if final is not _NOFINAL:
            vals.append(final)
        limit = self.max_output
        if name in _BUILDERS:  # what it would build, estimated before it is built
            room = min(limit, self.b.max_alloc - self.b.alloc_used)
            vs = vals[1:] if name == "printf" else vals
            if sum(_size(v, room + 1, json=name == "json") for v in vs) > room:
                if room < limit:
                    self.charge(room + 1, pos, at)
                raise self.error(pos, f"error calling {name}: result too large", at)
        try:
            result = fn(*vals, limit=limit) if name == "printf" else fn(*vals)
        except _FuncError as e:
            raise self.error(pos, f"error calling {name}: {e}", at) from None
        except (ValueError, TypeError, OverflowError, MemoryError) as e:
            raise self.error(pos, f"error calling {name}: {e}", at) from None
        if isinstance(result, (str, bytes, list)) and not any(result is v for v in vals):
            if isinstance(result, str) and len(result) > limit:
                raise self.error(pos, f"error calling {name}: result too large", at)
            self.charge(sys.getsizeof(result), pos, at)
        return result


# ---------------------------------------------------------------------------------------------------------- API


class Template:
    """A parsed template. Immutable: :meth:`with_field` and :meth:`cut_after` return new templates."""

    def __init__(self, src: str, root: list[tuple[Any, ...]]) -> None:
        self.src, self.root = src, root
        self._identifiers: set[str] | None = None

    def execute(
        self,
        data: Any,
        *,
        max_steps: int = MAX_STEPS,
        max_output: int = MAX_OUTPUT,
        max_alloc: int = MAX_ALLOC,
        timeout: float = MAX_SECONDS,
    ) -> str:
        """Render with ``data`` as dot and ``$`` within the given bounds; raises :class:`TemplateError`."""
        return self.run(data, Budget(max_steps=max_steps, max_output=max_output, max_alloc=max_alloc, timeout=timeout))

    def run(self, data: Any, budget: Budget) -> str:
        """Like :meth:`execute`, drawing on ``budget`` (which several runs may share)."""
        ex = _Exec(self.src, data, budget)
        try:
            ex.walk(data, self.root)
        except RecursionError:
            raise TemplateError("template: execution nested too deeply") from None
        return "".join(ex.out)

    def identifiers(self) -> set[str]:
        """Lower-cased names of every field and variable path part used (as Ollama's ``Template.Vars``)."""
        if self._identifiers is not None:
            return self._identifiers
        found: set[str] = set()

        def arg(a: tuple[Any, ...]) -> None:
            if a[0] == "field":
                found.update(x.lower() for x in a[2])
            elif a[0] == "var":
                found.update(x.lower() for x in (a[2], *a[3]))
            elif a[0] == "pipe":
                pipe(a)

        def pipe(p: tuple[Any, ...]) -> None:
            for cmd in p[4]:
                for a in cmd[3]:
                    arg(a)

        def walk(nodes: list[tuple[Any, ...]]) -> None:
            for n in nodes:
                if n[0] == "action":
                    pipe(n[2])
                elif n[0] in ("if", "with", "range"):
                    pipe(n[2])
                    walk(n[3])
                    walk(n[4] or [])

        walk(self.root)
        self._identifiers = found
        return found

    def uses(self, name: str) -> bool:
        """Whether a field (or variable path) named ``name`` appears, case-insensitively as Ollama checks."""
        return name.lower() in self.identifiers()

    def with_field(self, name: str) -> Template:
        """A copy with ``{{ .name }}`` appended (Ollama's parse-time ``{{ .Response }}`` fix-up)."""
        pos = len(self.src)
        cmd = ("cmd", pos, pos, [("field", pos, (name,))])
        return Template(self.src, [*self.root, ("action", pos, ("pipe", pos, [], False, [cmd]))])

    def cut_after(self, name: str) -> Template:
        """A copy with everything after the first ``.name`` field reference removed, walking the tree the way
        Ollama's legacy prompt code does (control-structure conditions are not searched)."""
        cut = False

        def walk_list(nodes: list[tuple[Any, ...]] | None) -> list[tuple[Any, ...]] | None:
            if nodes is None:
                return None
            out = []
            for n in nodes:
                m = walk_node(n)
                if m is not None:
                    out.append(m)
            return out

        def walk_node(n: tuple[Any, ...]) -> tuple[Any, ...] | None:
            nonlocal cut
            if cut:
                return None
            if n[0] in ("if", "with", "range"):
                body = walk_list(n[3])
                return (*n[:3], body, walk_list(n[4]) if not cut else ([] if n[4] is not None else None))
            if n[0] == "action":
                p = walk_pipe(n[2])
                return None if p is None else (n[0], n[1], p)
            return n

        def walk_pipe(p: tuple[Any, ...]) -> tuple[Any, ...] | None:
            nonlocal cut
            cmds = []
            for cmd in p[4]:
                args = []
                for a in cmd[3]:
                    if cut:
                        continue
                    if a[0] == "field" and name in a[2]:
                        cut = True
                        args.append(a)
                    elif a[0] == "pipe":
                        sub = walk_pipe(a)
                        if sub is not None:
                            args.append(sub)
                    else:
                        args.append(a)
                if not args:
                    return None
                cmds.append((*cmd[:3], args))
            return (*p[:4], cmds) if cmds else None

        return Template(self.src, walk_list(self.root) or [])


def parse(text: str) -> Template:
    """Parse Go template text; raises :class:`TemplateError` (``template: line:col: what``)."""
    if not isinstance(text, str):
        raise TemplateError("template: text must be a string")
    if len(text) > MAX_SOURCE:
        raise TemplateError(
            f"template: the template is larger than {MAX_SOURCE} characters "
            f"({MAX_SOURCE // 1024} KiB); use a shorter template"
        )
    try:
        toks = _lex(text)
        root, _ = _Parser(text, toks).items(top=True)
    except RecursionError:
        raise TemplateError("template: max nesting depth exceeded") from None
    return Template(text, root)
