"""Building a model's prompt text from messages: pure, no I/O.

Order of preference (see the Ollama reference, section 2.9): the model's Go ``TEMPLATE`` (our own
engine, :mod:`daemon.templates.gotemplate`), else the GGUF's Jinja ``tokenizer.chat_template`` (sandboxed jinja2, with a
time limit), else a plain ``role: content`` transcript.

Go templates run in one of two ways, as Ollama's do:

* **modern**, when the template uses ``.Messages``: one execution with ``System``, ``Messages`` (consecutive
  same-role messages merged, except tool messages), ``Tools``, ``Response`` (``""``), ``Think``, ``ThinkLevel`` and
  ``IsThinkSet``;
* **legacy** (``.System``/``.Prompt``/``.Response``): one execution per completed turn, then the last turn with
  everything after the first ``.Response`` cut away so generation continues from there.

Images become ``[img-N]`` tags in the message text (replacing an ``[img]`` the user wrote, otherwise in front), N
counting across the messages given; the runner swaps them for the real media.

Every step is bounded in time and memory, whatever the template (a request's ``template`` or a model's), so a
hostile one gets a :class:`TemplateError` (a 400) rather than a hung or swollen daemon: Go templates
by :class:`daemon.templates.gotemplate.Budget` (2 s, 1M steps, 16M characters out, 64 MiB of built values), Jinja
templates by the hardened sandbox below (2 s, 8M characters out, 32 MiB per value, 64 MiB of built values); both at
most 128 KiB of source. Parsed templates are kept in caches bounded by bytes. The functions here are blocking: the
daemon runs them through :func:`offload`, in a worker thread, so its event loop stays free.
"""

from __future__ import annotations

import collections
import collections.abc
import functools
import json
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any, Generic, TypeVar

from daemon.templates import gotemplate
from daemon.templates.gotemplate import Struct, TemplateError, go_json

__all__ = [
    "DEFAULT_TEMPLATE",
    "TemplateError",
    "parse_template",
    "render_messages",
    "render_generate",
    "render_jinja",
    "collate",
    "tag_images",
    "think_values",
    "ByteBoundedCache",
    "offload",
]

DEFAULT_TEMPLATE = "{{ .Prompt }}"
JINJA_TIMEOUT = 2.0
JINJA_MAX_OUTPUT = 8 * 1024 * 1024  # characters a chat template may write
JINJA_MAX_VALUE = 32 * 1024 * 1024  # bytes (estimated) of any one value a chat template builds
JINJA_MAX_ALLOC = 64 * 1024 * 1024  # bytes of all the values one render builds
JINJA_MAX_SOURCE = 128 * 1024  # characters of chat template
MAX_INT_BITS = 1 << 16  # the largest integer a chat template may build
RENDER_CONCURRENCY = 2  # prompts rendered at once, in worker threads
THINK_LEVELS = ("high", "medium", "low", "max")

K = TypeVar("K")
V = TypeVar("V")


class ByteBoundedCache(Generic[K, V]):
    """A least-recently-used cache bounded by the total size of its entries in bytes (``size_of(key, value)``,
    an estimate), not by their count: an entry larger than the whole bound is built and returned but not kept.
    Thread-safe; values are built one at a time, so concurrent misses cannot multiply the memory building takes."""

    def __init__(self, max_bytes: int, size_of: Callable[[K, V], int]) -> None:
        self.max_bytes, self.size_of = max_bytes, size_of
        self.size = 0
        self._entries: collections.OrderedDict[K, tuple[V, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._make_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _lookup(self, key: K) -> tuple[bool, V | None]:
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return False, None
            self._entries.move_to_end(key)
            return True, hit[0]

    def get(self, key: K, make: Callable[[K], V]) -> V:
        """The cached value for ``key``, made with ``make(key)`` on a miss (exceptions pass through, uncached)."""
        found, value = self._lookup(key)
        if found:
            return value  # type: ignore[return-value]
        with self._make_lock:
            found, value = self._lookup(key)
            if found:
                return value  # type: ignore[return-value]
            made = make(key)
        size = self.size_of(key, made)
        if size > self.max_bytes:
            return made
        with self._lock:
            if key not in self._entries:
                self._entries[key] = (made, size)
                self.size += size
            while self.size > self.max_bytes:
                _, (_, old) = self._entries.popitem(last=False)
                self.size -= old
        return made

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.size = 0


_LIMITERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_SHARED_LIMITER: Any = None


async def offload(fn: Callable[..., V], *args: Any, **kwargs: Any) -> V:
    """``fn(*args, **kwargs)`` in a worker thread, at most :data:`RENDER_CONCURRENCY` at once (the rest wait
    without holding a thread), so a slow or heavy prompt never blocks the event loop and a crowd of them cannot
    multiply their memory."""
    import asyncio

    import anyio
    import anyio.to_thread

    global _SHARED_LIMITER
    loop = asyncio.get_running_loop()
    try:  # one limiter per event loop (tests run several loops one after another)
        limiter = _LIMITERS.get(loop)
        if limiter is None:
            limiter = _LIMITERS[loop] = anyio.CapacityLimiter(RENDER_CONCURRENCY)
    except TypeError:  # a loop that cannot be weakly referenced: one limiter for all
        if _SHARED_LIMITER is None:
            _SHARED_LIMITER = anyio.CapacityLimiter(RENDER_CONCURRENCY)
        limiter = _SHARED_LIMITER
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), limiter=limiter)


# ---------------------------------------------------------------------------------------------------------- Go side


def _parse(text: str) -> gotemplate.Template:
    tmpl = gotemplate.parse(text)
    if not tmpl.uses("Messages") and not tmpl.uses("Response"):
        tmpl = tmpl.with_field("Response")
    return tmpl


# a parsed template takes up to ~200 bytes per character of source (measured: 40-180)
GO_CACHE: ByteBoundedCache[str, gotemplate.Template] = ByteBoundedCache(32 << 20, lambda t, _: 200 * len(t) + 2048)


def parse_template(text: str) -> gotemplate.Template:
    """Parse a Go prompt template as Ollama does: append ``{{ .Response }}`` when the template uses neither
    ``.Messages`` nor ``.Response``. Raises :class:`TemplateError`. Cached (see :data:`GO_CACHE`)."""
    if len(text) > gotemplate.MAX_SOURCE:  # refused before taking the cache's lock
        return gotemplate.parse(text)
    return GO_CACHE.get(text, _parse)


def think_values(think: bool | str | None) -> dict[str, Any]:
    """The ``Think``/``ThinkLevel``/``IsThinkSet`` template fields (``true`` shows as level ``medium``)."""
    if isinstance(think, str):
        return {"Think": think in THINK_LEVELS, "ThinkLevel": think, "IsThinkSet": True}
    return {"Think": bool(think), "ThinkLevel": "medium" if think else "", "IsThinkSet": think is not None}


def collate(messages: Iterable[Mapping[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """All system messages joined with blank lines, and the messages with consecutive same-role ones merged
    (``"\\n\\n"`` between contents; tool messages are never merged). The input is not modified."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        role = str(m.get("role") or "").lower()
        content = str(m.get("content") or "")
        if role == "system":
            system.append(content)
        if out and out[-1]["role"] == role and role != "tool":
            out[-1]["content"] += "\n\n" + content
        else:
            out.append({**m, "role": role, "content": content})
    return "\n\n".join(system), out


def tag_images(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages with each image written into the text as ``[img-N]`` (see module doc)."""
    out, n = [], 0
    for m in messages:
        m = dict(m)
        images = m.get("images") or []
        if images:
            text, prefix = str(m.get("content") or ""), ""
            for _ in images:
                tag = f"[img-{n}]"
                n += 1
                if "[img]" in text:
                    text = text.replace("[img]", tag, 1)
                else:
                    prefix += tag
            m["content"] = prefix + text
        out.append(m)
    return out


class _JSONMap(dict):
    """A Go map that prints as JSON (Ollama's ``templateArgs``/``templateProperties``)."""

    def go_string(self) -> str:
        try:
            return go_json(self)
        except ValueError:
            return "{}"


class _JSONList(list):
    """A slice that prints as JSON (Ollama's ``templateTools``)."""

    def go_string(self) -> str:
        try:
            return go_json(self)
        except ValueError:
            return "[]"


class _PropertyType(list):
    """A JSON-schema ``type``: one name or several; prints as the name, marshals as a string when single."""

    def go_string(self) -> str:
        return "" if not self else self[0] if len(self) == 1 else "[" + " ".join(self) + "]"

    def go_json(self) -> Any:
        return self[0] if len(self) == 1 else list(self)


def _sorted_deep(v: Any) -> Any:
    """Go marshals ``map[string]any`` with sorted keys; tool-call arguments reach templates as such maps."""
    if isinstance(v, Mapping):
        return {str(k): _sorted_deep(v[k]) for k in sorted(v, key=str)}
    if isinstance(v, (list, tuple)):
        return [_sorted_deep(x) for x in v]
    return v


def _arguments(raw: Any) -> _JSONMap:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raw = {}
    return _JSONMap(_sorted_deep(raw) if isinstance(raw, Mapping) else {})


def _template_message(m: Mapping[str, Any]) -> Struct:
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        calls.append(
            Struct(
                {
                    "ID": tc.get("id") or "",
                    "Function": Struct(
                        {
                            "Index": fn["index"] if isinstance(fn.get("index"), int) else 0,
                            "Name": fn.get("name") or "",
                            "Arguments": _arguments(fn.get("arguments")),
                        }
                    ),
                }
            )
        )
    return Struct(
        {
            "Role": m.get("role") or "",
            "Content": m.get("content") or "",
            "Thinking": m.get("thinking") or "",
            "Images": list(m.get("images") or []),
            "ToolCalls": calls,
            "ToolName": m.get("tool_name") or "",
            "ToolCallID": m.get("tool_call_id") or "",
        }
    )


def _property(p: Any) -> Struct:
    """A tool parameter property as Ollama's ``api.ToolProperty`` (unknown JSON-schema keys are dropped, as Go's
    decoder does)."""
    p = p if isinstance(p, Mapping) else {}
    t = p.get("type")
    ptype = _PropertyType([t] if isinstance(t, str) else [x for x in t or [] if isinstance(x, str)])
    any_of = [_property(x) for x in p.get("anyOf") or []]
    props = p.get("properties")
    nested = _JSONMap({k: _property(v) for k, v in props.items()}) if isinstance(props, Mapping) else None
    fields = {
        "AnyOf": any_of,
        "Type": ptype,
        "Items": p.get("items"),
        "Description": p.get("description") or "",
        "Enum": list(p.get("enum") or []),
        "Properties": nested,
        "Required": list(p.get("required") or []),
    }
    js: dict[str, Any] = {}
    for key, field in (
        ("anyOf", "AnyOf"),
        ("type", "Type"),
        ("items", "Items"),
        ("description", "Description"),
        ("enum", "Enum"),
        ("properties", "Properties"),
        ("required", "Required"),
    ):
        if fields[field]:  # omitempty
            js[key] = fields[field]
    return Struct(fields, json=js)


def _template_tool(t: Mapping[str, Any]) -> Struct:
    fn = t.get("function") or {}
    params = fn.get("parameters") or {}
    props = params.get("properties")
    # Ollama hands templates a plain Go map here, which ranges and marshals in sorted key order.
    properties = _JSONMap({k: _property(props[k]) for k in sorted(props)}) if isinstance(props, Mapping) else None
    p_fields = {
        "Type": params.get("type") or "",
        "Defs": params.get("$defs"),
        "Items": params.get("items"),
        "Required": list(params.get("required") or []),
        "Properties": properties,
    }
    p_json: dict[str, Any] = {"type": p_fields["Type"]}
    for key, field in (("$defs", "Defs"), ("items", "Items"), ("required", "Required")):
        if p_fields[field]:
            p_json[key] = p_fields[field]
    p_json["properties"] = properties
    parameters = Struct(p_fields, json=p_json, stringer=True)
    f_fields = {"Name": fn.get("name") or "", "Description": fn.get("description") or "", "Parameters": parameters}
    function = Struct(
        f_fields,
        json={"name": f_fields["Name"], "description": f_fields["Description"], "parameters": parameters},
        stringer=True,
    )
    t_json: dict[str, Any] = {"type": t.get("type") or ""}
    if t.get("items"):
        t_json["items"] = t.get("items")
    t_json["function"] = function
    return Struct(
        {"Type": t.get("type") or "", "Items": t.get("items"), "Function": function}, json=t_json, stringer=True
    )


def _execute_go(
    tmpl: gotemplate.Template,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    think: bool | str | None,
) -> str:
    system, collated = collate(messages)
    tv = think_values(think)
    if tmpl.uses("Messages"):
        return tmpl.execute(
            {
                "System": system,
                "Messages": [_template_message(m) for m in collated],
                "Tools": _JSONList(_template_tool(t) for t in tools or []),
                "Response": "",
                **tv,
            }
        )

    # Legacy: one run per completed turn, all sharing one budget.
    out: list[str] = []
    budget = gotemplate.Budget()

    def run(t: gotemplate.Template, values: dict[str, str]) -> None:
        out.append(t.run({**values, **tv}, budget))

    turn = {"System": "", "Prompt": "", "Response": ""}
    for m in collated:
        role = m["role"]
        if (role == "system" and (turn["Prompt"] or turn["Response"])) or (role == "user" and turn["Response"]):
            run(tmpl, turn)
            turn = {"System": "", "Prompt": "", "Response": ""}
        key = {"system": "System", "user": "Prompt", "assistant": "Response"}.get(role)
        if key:
            turn[key] = m["content"]
    run(tmpl.cut_after("Response"), turn)
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------- Jinja side


class _RenderTimeout(BaseException):
    pass


class _Raised(Exception):
    pass


class _TooBig(Exception):
    """A bound of :func:`render_jinja` was passed; the message says which."""


# The sandbox is hardened so that a chat template can neither hang nor inflate the daemon:
#
# * every value the template builds (by an operator, a call, a filter, ``~``, a slice, a list/tuple/dict literal,
#   a {% set %} block or a macro's output) is measured, as the bytes it takes with everything it refers to counted
#   each time it is referred to, and may not pass JINJA_MAX_VALUE; the calls that can build far more than they are
#   given (``*``, ``%``, ``str.format``, ``ljust``, ``replace``, ``join``, ``center``, ``indent``, ``batch``...)
#   are estimated *before* they run, so no single step allocates past that bound: whatever they iterate (a range,
#   a dict or its views, a set, a generator) is measured as the items they will take from it, and the text of a
#   value that is not a string (printing it, ``~``, ``string``, ``tojson``, ``%r``) with every string in it quoted
#   and escaped in the worst way, as wide as its widest character;
# * everything built during one render is charged against JINJA_MAX_ALLOC, so values kept alive stay under it too;
# * with every value bounded, no single C-level step can run long while holding the GIL, and the tracer stops
#   Python-level loops after ``timeout`` seconds; filters whose regular expressions are quadratic (striptags,
#   urlize) and lipsum are not offered.
_STATE = threading.local()  # .used: bytes charged by the render running on this thread (absent outside one)
_MAX_ITEMS = 1_000_000  # elements taken from a generator a filter is given
_MAX_SLICES = 100_000
_FOLD_MAX_VALUE = 64 * 1024  # the most a constant folded while compiling may be (it lands in the compiled code)


def _kind(s: str) -> int:
    return 1 if s.isascii() else 4


_SCALARS = (str, bytes, bytearray, int, float, type(None))
_SCALAR_TYPES = frozenset({str, bytes, bytearray, int, float, bool, type(None)})


def _scalars_only(x: Any) -> int | None:
    """The bytes of a long list (or tuple, set) holding only plain scalars, counted in C; None otherwise."""
    if isinstance(x, (list, tuple, set, frozenset)) and len(x) > 32 and set(map(type, x)) <= _SCALAR_TYPES:
        return sys.getsizeof(x) + sum(map(sys.getsizeof, x))
    return None


def _children(x: Any) -> Any:
    from jinja2.utils import Namespace

    if isinstance(x, dict):
        return (*x.keys(), *x.values())
    if isinstance(x, (list, tuple, set, frozenset)):
        return x
    if isinstance(x, Namespace):
        return tuple(getattr(x, "_Namespace__attrs", {}).values())
    return None


def _flat(v: Any, cap: int = JINJA_MAX_VALUE) -> int:
    """About the bytes ``v`` takes with everything it refers to, each reference counted (what printing or
    comparing it touches); shared parts are measured once, and counting stops once past ``cap``. A loop, not
    recursion: under the render's tracer a Python call per element would cost a microsecond."""
    getsizeof = sys.getsizeof
    if isinstance(v, _SCALARS):
        return getsizeof(v)
    fast = _scalars_only(v)
    if fast is not None:
        return fast
    kids = _children(v)
    if kids is None:
        return 64
    memo = {id(v): 0}  # 0 while being measured: a cycle adds nothing
    stack: list[tuple[Any, Any]] = [(v, iter(kids))]
    sizes = [getsizeof(v)]
    while stack:
        n, descended = sizes[-1], False
        for child in stack[-1][1]:
            if isinstance(child, _SCALARS):
                n += getsizeof(child)
            else:
                known = memo.get(id(child))
                if known is not None:
                    n += known
                elif (fast := _scalars_only(child)) is not None:
                    memo[id(child)] = fast
                    n += fast
                else:
                    grandchildren = _children(child)
                    if grandchildren is None:
                        n += 64
                    else:
                        memo[id(child)] = 0
                        sizes[-1] = n
                        stack.append((child, iter(grandchildren)))
                        sizes.append(getsizeof(child))
                        descended = True
                        break
            if n > cap:
                return n
        if descended:
            continue
        done, _ = stack.pop()
        sizes.pop()
        memo[id(done)] = n
        if not sizes:
            return n
        sizes[-1] += n
        if sizes[-1] > cap:
            return sizes[-1]
    return 0  # not reached


def _str_text(s: str) -> int:
    """Characters ``repr(s)`` or its JSON may take: escapes take up to 6 characters for an ASCII one (``\\u0001``)
    and 12 for any other (a surrogate pair); they are ASCII, so the text is no wider than ``s``."""
    if s.isascii():
        if s.isprintable():
            return len(s) + 2 + s.count("\\") + s.count('"') + s.count("'")
        return 6 * len(s) + 2
    return 12 * len(s) + 2


def _json_str(s: str) -> int:
    """Bytes ``repr(s)`` or ``tojson(s)`` may build."""
    return _str_text(s) * _kind(s)


def _text(v: Any, cap: int = JINJA_MAX_VALUE) -> int:
    """About the bytes of the text of ``v`` (``str()``, ``repr()``, ``tojson``: what printing it, ``~``, the string
    filter or ``%s`` builds): a string's own bytes; anything else written out with every string quoted and escaped
    in the worst way, and as wide as its widest character. Like :func:`_flat`, every reference counts (shared or
    cyclic ones too), and counting stops once past ``cap``."""
    if isinstance(v, str):
        return len(v) * _kind(v)
    if isinstance(v, (int, float, type(None))):
        return 3 * sys.getsizeof(v)  # an int's digits: at most ~2.5 bytes per byte of it
    chars, wide, visits = 0, 1, 0
    stack: list[Any] = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            chars += _str_text(x) + 2
            if not x.isascii():
                wide = 4
        elif isinstance(x, (bytes, bytearray)):
            chars += 4 * len(x) + 4
        elif isinstance(x, (int, float, type(None))):
            chars += 3 * sys.getsizeof(x) + 2
        else:
            view = isinstance(x, (collections.abc.KeysView, collections.abc.ValuesView, collections.abc.ItemsView))
            kids = tuple(x) if view else _children(x)  # a dict view prints its items
            if kids is None:
                chars += 64
                continue
            visits += 1
            if visits > _MAX_ITEMS:  # millions of references (or a cycle): far more than a prompt prints
                return cap + 1
            chars += 4 + 4 * len(kids)
            stack.extend(kids)
        if chars * wide > cap:
            break
    return chars * wide


def _elements(v: Any) -> list[Any] | tuple[Any, ...] | str | None:
    """What a filter or method will iterate, as a sequence that can be measured before anything is built from it:
    lists, tuples and strings as they are; any other iterable (a range, a dict or one of its views, a set, a
    generator) as a bounded list of its items; None for a value that is not iterable."""
    if isinstance(v, (list, tuple, str)):
        return v
    if isinstance(v, collections.abc.Iterator):
        return _materialize(v)
    if not isinstance(v, collections.abc.Iterable):
        return None
    if isinstance(v, collections.abc.Sized):  # a transient list of references, to be measured (not charged)
        if len(v) > _MAX_ITEMS:
            raise _TooBig(f"a sequence in the template has more than {_MAX_ITEMS} items")
        return list(v)
    return _materialize(iter(v))


def _joined(items: Sequence[Any], sep: str) -> int:
    """Bytes ``sep.join(map(str, items))`` builds, counted before it is built."""
    n = len(items)
    wide = _kind(sep)
    kinds = set(map(type, items))
    if isinstance(items, str) or kinds <= {str}:  # counted in C: the common case
        chars = sum(map(len, items))
        if not all(map(str.isascii, items)):
            wide = 4
    elif kinds <= {int, float, bool, type(None)}:  # a range's, counted in C too
        chars = 3 * sum(map(sys.getsizeof, items))
    else:
        chars, step = 0, len(sep)
        for x in items:  # stops as soon as the bound is passed
            if type(x) is str:
                chars += len(x) + step
                if not x.isascii():
                    wide = 4
            else:
                chars += _text(x, JINJA_MAX_VALUE + 1) + step
            if chars > JINJA_MAX_VALUE:
                return chars
        return chars * wide
    return (chars + n * len(sep)) * wide


def _refuse(what: str) -> _TooBig:
    return _TooBig(f"{what} would build a value larger than {JINJA_MAX_VALUE >> 20} MiB")


def _expect(estimate: int, what: str) -> None:
    if estimate > JINJA_MAX_VALUE or (estimate > _FOLD_MAX_VALUE and getattr(_STATE, "used", None) is None):
        raise _refuse(what)


def _checked(value: Any, what: str, *inputs: Any) -> Any:
    """Bound and charge a value the template just built (values it was given pass untouched). Hot: kept to a
    few operations for the common cases (no generator expressions: under the tracer every frame costs)."""
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is float:
        return value
    for x in inputs:
        if value is x:
            return value
    size = sys.getsizeof(value) if kind is str else _flat(value, JINJA_MAX_VALUE + 1)
    if size > JINJA_MAX_VALUE:
        raise _refuse(what)
    used = getattr(_STATE, "used", None)
    if used is None:  # not rendering: jinja folding constants while it compiles, into the compiled code
        if size > _FOLD_MAX_VALUE:
            raise _refuse(what)  # jinja then leaves it to the render, and its bounds
        return value
    used[0] += size
    if used[0] > JINJA_MAX_ALLOC:
        raise _TooBig(f"the template built more than {JINJA_MAX_ALLOC >> 20} MiB of values while rendering")
    return value


def _materialize(value: Any) -> Any:
    """A generator handed to a filter, as a (bounded, charged) list; anything else as it is."""
    if not isinstance(value, collections.abc.Iterator):
        return value
    out = []
    for item in value:
        out.append(item)
        if len(out) > _MAX_ITEMS:
            raise _TooBig(f"a sequence in the template has more than {_MAX_ITEMS} items")
    return _checked(out, "a sequence")


_REPR_CONVERSION = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(?:\*|\d+)?(?:\.(?:\*|\d+))?[ra]|![ra]")
_PCT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


def _number(digits: str) -> int:
    return int(digits) if len(digits) < 13 else 10**12


def _format_estimate(fmt: str, values: Sequence[Any], *, percent: bool) -> int:
    """An upper bound on the bytes ``fmt % values`` or ``fmt.format(*values)`` builds: the format, each field as
    large as the largest value, each width and precision in full (and the integers given, where a width is taken
    from the values)."""
    widest = max((_text(v, JINJA_MAX_VALUE + 1) for v in values), default=0)
    if _REPR_CONVERSION.search(fmt):  # %r, %a, {!r}, {!a}: a string quoted and escaped, up to 12 characters each
        widest = max((_json_str(v) if isinstance(v, str) else 0 for v in values), default=widest) + widest
    if percent:
        specs = list(_PCT.finditer(fmt))
        fields = len(specs)
        numbers = sum(_number(g) for m in specs for g in m.groups() if g and g != "*")
        star = any("*" in (m.group(1) or "") + (m.group(2) or "") for m in specs)
    else:
        import _string  # type: ignore[import-not-found]  # CPython's own, without stubs

        try:
            parsed = list(_string.formatter_parser(fmt))
        except ValueError:
            return 4 * len(fmt)  # it will not format at all
        specs_text = [spec or "" for _, field, spec, _ in parsed if field is not None]
        fields = len(specs_text) + sum(spec.count("{") for spec in specs_text)
        numbers = sum(_number(d) for spec in specs_text for d in _DIGITS.findall(spec))
        star = any("{" in spec for spec in specs_text)
    ints = sum(abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)) if star else 0
    return 4 * (len(fmt) + numbers + ints) + fields * widest


def _format_values(args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
    values = [*args, *kwargs.values()]
    if len(values) == 1 and isinstance(values[0], Mapping):
        return list(values[0].values())
    if len(values) == 1 and isinstance(values[0], tuple):
        return list(values[0])
    return values


def _int_arg(args: Sequence[Any], kwargs: Mapping[str, Any], i: int, name: str, default: Any) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _str_method_estimate(s: str, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
    """Bytes a str method may build, for the ones that can build far more than they are given."""
    k = _kind(s) if type(s) is str else 6 * _kind(s)  # Markup escapes what it adds
    n = len(s)
    if name in ("ljust", "rjust", "center", "zfill"):
        width = _int_arg(args, kwargs, 0, "width", 0)
        return (max(n, width) if isinstance(width, int) else n) * k
    if name == "expandtabs":
        tab = _int_arg(args, kwargs, 0, "tabsize", 8)
        return (n + s.count("\t") * max(tab, 0)) * k if isinstance(tab, int) else None
    if name == "replace":
        old, new = _int_arg(args, kwargs, 0, "old", ""), _int_arg(args, kwargs, 1, "new", "")
        if not isinstance(old, str) or not isinstance(new, str):
            return None
        count = s.count(old) if old else n + 1
        limit = _int_arg(args, kwargs, 2, "count", -1)
        if isinstance(limit, int) and limit >= 0:
            count = min(count, limit)
        return (n + count * max(0, len(new) - len(old))) * max(k, _kind(new))
    if name in ("split", "rsplit", "splitlines"):
        sep = _int_arg(args, kwargs, 0, "sep", None) if name != "splitlines" else None
        if isinstance(sep, str) and sep:
            parts = s.count(sep) + 1
        elif s.isascii():  # a part ends at each separator character at most
            seps = "\n\r\v\f\x1c\x1d\x1e" if name == "splitlines" else " \t\n\r\v\f\x1c\x1d\x1e\x1f"
            parts = 1 + sum(map(s.count, seps))
        else:
            parts = n + 1
        return n * k + 64 * parts
    if name == "encode":
        return 4 * n
    if name == "translate":
        table = args[0] if args else None
        widest = (
            max((len(v) for v in table.values() if isinstance(v, str)), default=1) if isinstance(table, Mapping) else 1
        )
        return 4 * n * max(1, widest)
    if name in ("upper", "lower", "title", "capitalize", "swapcase", "casefold"):
        return 3 * n * k  # at most three characters for one
    return None


_ESTIMATED_FILTERS = frozenset(
    {
        "center",
        "indent",
        "format",
        "replace",
        "wordwrap",
        "join",
        "batch",
        "slice",
        "list",
        "sort",
        "unique",
        "groupby",
        "sum",
        "string",
        "pprint",
        "tojson",
        "escape",
        "e",
        "forceescape",
        "urlencode",
        "upper",
        "lower",
        "title",
        "capitalize",
    }
)


def _filter_estimate(name: str, v: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> int | None:
    """Bytes a filter may build, for the ones that can build far more than they are given."""
    s = v if isinstance(v, str) else None
    if name == "center" and s is not None:
        width = _int_arg(args, kwargs, 0, "width", 80)
        return max(len(s), width if isinstance(width, int) else 0) * _kind(s)
    if name == "indent" and s is not None:
        width = _int_arg(args, kwargs, 0, "width", 4)
        w = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return (len(s) + (s.count("\n") + 1) * max(w, 0)) * _kind(s)
    if name == "format" and s is not None:
        return _format_estimate(s, _format_values(args, kwargs), percent=True)
    if name == "replace":
        old, new = str(_int_arg(args, kwargs, 0, "old", "")), str(_int_arg(args, kwargs, 1, "new", ""))
        count = _int_arg(args, kwargs, 2, "count", None)
        if s is None:  # replaced in the value's text
            return _text(v, JINJA_MAX_VALUE + 1) * (1 + len(new))
        return _str_method_estimate(s, "replace", [old, new, count if isinstance(count, int) else -1], {})
    if name == "wordwrap" and s is not None:
        wrap = _int_arg(args, kwargs, 2, "wrapstring", None) or "\n"
        return (len(s) + (len(s) + 1) * len(str(wrap))) * _kind(s)
    if name == "join":
        d = str(_int_arg(args, kwargs, 0, "d", ""))
        items = _elements(v)  # a range, a dict view, a set...: measured as the items join will take from it
        if items is None:
            return None
        attribute = _int_arg(args, kwargs, 1, "attribute", None)
        if attribute is not None and not isinstance(items, str):
            return _text(list(items), JINJA_MAX_VALUE + 1) + len(items) * len(d) * 4  # parts of the items
        return _joined(items, d)
    if name in ("batch", "slice"):
        count = args[0] if args else kwargs.get("linecount" if name == "batch" else "slices", 0)
        if not isinstance(count, int) or count > (_MAX_ITEMS if name == "batch" else _MAX_SLICES):
            raise _TooBig(
                f"the {name} filter was given {count} {'items per batch' if name == 'batch' else 'slices'}"
                f"; at most {_MAX_ITEMS if name == 'batch' else _MAX_SLICES} are allowed"
            )
        return None
    if name in ("list", "sort", "unique", "groupby", "batch") and s is not None:
        return 64 * len(s)
    if name == "sum":
        start = _int_arg(args, kwargs, 1, "start", 0)
        if not isinstance(start, (int, float)) or isinstance(start, bool):
            raise _TooBig("the sum filter adds numbers only")
        return None
    if name in ("string", "pprint", "tojson"):
        return _text(v, JINJA_MAX_VALUE + 1) if name != "tojson" or not isinstance(v, str) else _json_str(v)
    factor = {
        "escape": 6,
        "e": 6,
        "forceescape": 6,
        "urlencode": 9,
        "upper": 3,
        "lower": 3,
        "title": 3,
        "capitalize": 3,
    }.get(name)
    if s is not None and factor:  # at most this many characters for one
        return factor * len(s) * _kind(s)
    return None


def _guard_filter(name: str, fn: Any) -> Any:
    from jinja2.utils import _PassArg

    first = 1 if _PassArg.from_obj(fn) is not None else 0
    estimated = name in _ESTIMATED_FILTERS
    what = f"the {name} filter"
    iterator = collections.abc.Iterator

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if len(args) > first:
            if isinstance(args[first], iterator):
                args = (*args[:first], _materialize(args[first]), *args[first + 1 :])
            if estimated:
                estimate = _filter_estimate(name, args[first], args[first + 1 :], kwargs)
                if estimate is not None:
                    _expect(estimate, what)
        return _checked(fn(*args, **kwargs), what, *args, *kwargs.values())

    return guarded


def _refused_filter(name: str) -> Any:
    def refused(*_: Any, **__: Any) -> Any:
        raise _TooBig(f"the {name} filter is not available in chat templates")

    return refused


def _jinja_environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Generation(jinja2.ext.Extension):
        """Accept Hugging Face's ``{% generation %}`` markers and render their body as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Code(CodeGenerator):
        """Route ``~`` and list, tuple and dict literals through the environment's checks."""

        def visit_Concat(self, node: Any, frame: Any) -> None:
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            else:
                join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            self.write(f"environment.checked_join({join}, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

        def visit_List(self, node: Any, frame: Any) -> None:
            self.write("environment.checked_literal(")
            super().visit_List(node, frame)
            self.write(")")

        def visit_Dict(self, node: Any, frame: Any) -> None:
            self.write("environment.checked_literal(")
            super().visit_Dict(node, frame)
            self.write(")")

        def visit_Tuple(self, node: Any, frame: Any) -> None:
            if node.ctx != "load":
                return super().visit_Tuple(node, frame)
            self.write("environment.checked_literal(")
            super().visit_Tuple(node, frame)
            self.write(")")

    def concat(parts: Iterable[str]) -> str:  # {% set %} blocks, macros, filter blocks
        parts = list(parts)
        _expect(sum(map(len, parts)) * max(map(_kind, parts), default=1), "a block of template output")
        return _checked("".join(parts), "a block of template output")

    def finalize(value: Any) -> Any:  # what {{ }} prints: its text may not pass the bound either
        if not isinstance(value, str):
            _expect(_text(value, JINJA_MAX_VALUE + 1), "printing a value")
        return value

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = Code

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept short
                if (len(left) + len(right)) * (1 if left.isascii() and right.isascii() else 4) > JINJA_MAX_VALUE:
                    raise _refuse("+")
                return _checked(left + right, "+", left, right)
            ints = isinstance(left, int) and isinstance(right, int)
            if operator == "**":
                # A sandbox still lets ``"x" * 10**10`` or ``10**10**10`` eat the machine in one C call.
                if isinstance(right, int) and abs(right) > 256 and not -1 <= left <= 1:
                    raise SecurityError("exponent too large")
                if ints and right > 0 and abs(left).bit_length() * right > MAX_INT_BITS:
                    raise _TooBig(f"** would build a number of more than {MAX_INT_BITS} bits")
            elif operator == "*":
                if ints:
                    if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                        raise _TooBig(f"* would build a number of more than {MAX_INT_BITS} bits")
                else:
                    for seq, n in ((left, right), (right, left)):
                        if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                            if len(seq) * n > 1_000_000:
                                raise SecurityError("repetition too large")
                            each = len(seq) * _kind(seq) if isinstance(seq, str) else _flat(seq, JINJA_MAX_VALUE + 1)
                            _expect(each * n, "*")
            elif operator == "+":
                if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                    size = _flat(left, JINJA_MAX_VALUE + 1)
                    _expect(size + (size if right is left else _flat(right, JINJA_MAX_VALUE + 1)), "+")
            elif operator == "%" and isinstance(left, str):
                _expect(_format_estimate(left, _format_values([right], {}), percent=True), "%")
            result = super().call_binop(context, operator, left, right)
            return result if ints else _checked(result, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            # str.format reaches here as the sandbox's wrapper of it (wrap_str_format), the method __wrapped__
            owner = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
            name = getattr(__obj, "__name__", "")
            what = f"{name}()" if name else "a call"
            if name == "striptags" and owner is not None:  # Markup's: a quadratic regular expression
                raise _TooBig("striptags is not available in chat templates")
            if isinstance(owner, str) and name in ("format", "format_map"):
                _expect(_format_estimate(owner, _format_values(args, kwargs), percent=False), what)
            elif isinstance(owner, str):
                if name == "join" and args:
                    items = _elements(args[0])  # a range, a dict view, a generator...: as the items join takes
                    if items is not None:
                        args = (items, *args[1:])
                        _expect(_joined(items, owner), what)
                else:
                    estimate = _str_method_estimate(owner, name, args, kwargs)
                    if estimate is not None:
                        _expect(estimate, what)
            result = super().call(__context, __obj, *args, **kwargs)
            return _checked(result, what, owner, *args, *kwargs.values())

        def getitem(self, obj: Any, argument: Any) -> Any:
            result = super().getitem(obj, argument)
            return _checked(result, "a slice", obj) if isinstance(argument, slice) else result

        @staticmethod
        def checked_join(join: Any, parts: tuple[Any, ...]) -> str:
            size = 0
            wide = 1
            for part in parts:
                if isinstance(part, str):
                    size += len(part)
                    wide = max(wide, _kind(part))
                else:
                    size += _text(part, JINJA_MAX_VALUE + 1)
            _expect(size * wide, "~")
            return str(_checked(join(parts), "~"))

        @staticmethod
        def checked_literal(value: Any) -> Any:
            return _checked(value, "a literal")

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
    ) -> str:
        if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
            raise _TooBig("tojson's indent is larger than 64")
        text = _json_str(x) if isinstance(x, str) else _text(x, JINJA_MAX_VALUE + 1)
        _expect(text * (1 + (indent if isinstance(indent, int) else len(indent) if indent else 0)), "the tojson filter")
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message: str) -> None:
        raise _Raised(message)

    def strftime_now(fmt: str) -> str:
        if len(str(fmt)) > 1000:
            raise _TooBig("strftime_now's format is longer than 1000 characters")
        return datetime.now().strftime(fmt)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols], finalize=finalize)
    env.concat = concat  # type: ignore[method-assign]
    env.filters["tojson"] = tojson
    env.filters = {name: _guard_filter(name, fn) for name, fn in env.filters.items()}
    for name in ("striptags", "urlize"):  # quadratic regular expressions, run in one C call
        env.filters[name] = _refused_filter(name)
    env.globals.pop("lipsum", None)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env


_ENV: Any = None
_ENV_LOCK = threading.Lock()


def _compile_jinja(text: str) -> Any:
    global _ENV
    import jinja2

    with _ENV_LOCK:
        if _ENV is None:
            _ENV = _jinja_environment()
    try:
        return _ENV.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template: line {e.lineno}: {e.message}") from None
    except Exception as e:  # noqa: BLE001 - any compile failure is the template's fault
        raise TemplateError(f"chat template: {e}") from None


# a compiled template takes ~15-25 bytes per character of source (measured), and the code jinja generates
JINJA_CACHE: ByteBoundedCache[str, Any] = ByteBoundedCache(32 << 20, lambda text, _: 64 * len(text) + 16384)


def _jinja_template(text: str) -> Any:
    if len(text) > JINJA_MAX_SOURCE:
        raise TemplateError(
            f"chat template: the template is larger than {JINJA_MAX_SOURCE} characters "
            f"({JINJA_MAX_SOURCE >> 10} KiB); give the model a shorter TEMPLATE"
        )
    return JINJA_CACHE.get(text, _compile_jinja)


def _jinja_message(m: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.get("role") or "", "content": m.get("content") or ""}
    if m.get("thinking"):
        out["reasoning_content"] = m["thinking"]
    if m.get("tool_calls"):
        calls = []
        for tc in m["tool_calls"]:
            fn = tc.get("function") or {}
            call: dict[str, Any] = {
                "type": "function",
                "function": {"name": fn.get("name") or "", "arguments": dict(_arguments(fn.get("arguments")))},
            }
            if tc.get("id"):
                call["id"] = tc["id"]
            calls.append(call)
        out["tool_calls"] = calls
    if m.get("tool_name"):
        out["name"] = m["tool_name"]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def render_jinja(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    think: bool | str | None = None,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    timeout: float = JINJA_TIMEOUT,
) -> str:
    """Render a Hugging Face/GGUF Jinja chat template in a sandbox, within ``timeout`` seconds of work and the
    memory bounds above."""
    compiled = _jinja_template(template)
    variables: dict[str, Any] = {
        "messages": [_jinja_message(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "tools": [dict(t) for t in tools] if tools else None,
    }
    if think is not None:
        variables["enable_thinking"] = think_values(think)["Think"]
    given = sum(len(m["content"]) for m in variables["messages"] if isinstance(m["content"], str))
    if given > JINJA_MAX_OUTPUT:
        raise TemplateError(
            f"chat template: the messages are longer than {JINJA_MAX_OUTPUT} characters, more than "
            "a prompt may be; send a shorter chat"
        )
    if _flat(variables["tools"], JINJA_MAX_VALUE + 1) > JINJA_MAX_VALUE:
        raise TemplateError(f"chat template: the tools take more than {JINJA_MAX_VALUE >> 20} MiB; send fewer")
    result: dict[str, Any] = {}

    def work() -> None:
        deadline = time.monotonic() + timeout

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            if time.monotonic() > deadline:
                raise _RenderTimeout()
            return tracer if frame.f_code.co_filename == "<template>" else None

        _STATE.used = [0]
        sys.settrace(tracer)
        try:
            parts, size = [], 0
            for chunk in compiled.generate(**variables):
                size += len(chunk)
                if size > JINJA_MAX_OUTPUT:
                    raise TemplateError(
                        f"chat template: output too large: the prompt is longer than "
                        f"{JINJA_MAX_OUTPUT} characters; send a shorter chat"
                    )
                parts.append(chunk)
            result["text"] = "".join(parts)
        except BaseException as e:  # noqa: BLE001 - reported to the caller's thread
            result["error"] = e
        finally:
            sys.settrace(None)
            _STATE.used = None

    worker = threading.Thread(target=work, name="corral-chat-template", daemon=True)
    worker.start()
    worker.join(timeout + 1.0)  # the tracer stops Python-level work; this bounds anything it cannot see
    if worker.is_alive() or isinstance(result.get("error"), _RenderTimeout):
        raise TemplateError(f"chat template: rendering took longer than {timeout:g}s")
    err = result.get("error")
    if err is None:
        return str(result["text"])
    if isinstance(err, TemplateError):
        raise err
    if isinstance(err, _Raised):
        raise TemplateError(f"chat template: {err}")
    if isinstance(err, _TooBig):
        raise TemplateError(
            f"chat template: {err}; the model's chat template is too heavy for this chat (fix the "
            "template or send a shorter chat)"
        )
    if isinstance(err, MemoryError):
        raise TemplateError("chat template: ran out of memory; fix the model's chat template")
    raise TemplateError(f"chat template: {type(err).__name__}: {err}")


# ---------------------------------------------------------------------------------------------------------- API


def _plain(messages: Sequence[Mapping[str, Any]]) -> str:
    return "".join(f"{m.get('role') or 'user'}: {m.get('content') or ''}\n" for m in messages) + "assistant: "


def render_messages(
    go_template: str | None,
    jinja_template: str | None,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    think: bool | str | None = None,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt for a chat: ``messages`` are Ollama-shaped dicts (role, content, images, thinking,
    tool_calls ``[{"function": {"name", "arguments"}}]``, tool_name, tool_call_id). Raises :class:`TemplateError`."""
    msgs = tag_images(messages)
    if go_template:
        return _execute_go(parse_template(go_template), msgs, tools, think)
    if jinja_template:
        return render_jinja(jinja_template, msgs, tools=tools, think=think, bos_token=bos_token, eos_token=eos_token)
    return _plain(msgs)


def render_generate(
    go_template: str | None,
    jinja_template: str | None,
    *,
    prompt: str,
    system: str | None = None,
    suffix: str | None = None,
    messages_history: Iterable[Mapping[str, Any]] = (),
    images: Sequence[Any] | None = None,
    think: bool | str | None = None,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt for ``/api/generate``: ``system`` (already resolved: the request's, else the model's), then
    the Modelfile MESSAGE history, then the user ``prompt``. With a ``suffix`` (fill-in-the-middle) the template
    runs once with ``Prompt`` and ``Suffix``. With no template at all this is Ollama's ``{{ .Prompt }}``."""
    if suffix and prompt:
        tmpl = parse_template(go_template or DEFAULT_TEMPLATE)
        return tmpl.execute({"Prompt": prompt, "Suffix": suffix, "Response": "", **think_values(think)})
    msgs: list[Mapping[str, Any]] = [{"role": "system", "content": system}] if system else []
    msgs.extend(messages_history)
    user: dict[str, Any] = {"role": "user", "content": prompt}
    if images:
        user["images"] = list(images)
    msgs.append(user)
    if not go_template and not jinja_template:
        go_template = DEFAULT_TEMPLATE
    return render_messages(go_template, jinja_template, msgs, think=think, bos_token=bos_token, eos_token=eos_token)
