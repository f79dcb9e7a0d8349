"""The Jinja sandbox: a GGUF's ``tokenizer.chat_template`` (or a request's Jinja template) compiled and rendered so
that it can neither hang nor inflate the daemon, whatever it holds (issue 26: this was the middle of
``daemon/templates/prompt.py``). What a template sees (the messages and tools as JSON) is built by
:func:`daemon.templates.prompt.render_jinja`; this module only runs it.

Bounds: 2 s of work (:data:`JINJA_TIMEOUT`), 8M characters out, 32 MiB per value, 64 MiB of values built by one
render, 128 KiB of source. Compiled templates are kept in :data:`JINJA_CACHE`, bounded by bytes. Blocking: the daemon
calls it through :func:`daemon.templates.offload.offload`.
"""

from __future__ import annotations

import collections.abc
import concurrent.futures
import functools
import json
import re
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg

from daemon.templates.cache import ByteBoundedCache
from daemon.templates.gotemplate import TemplateError

JINJA_TIMEOUT = 2.0
JINJA_MAX_OUTPUT = 8 * 1024 * 1024  # characters a chat template may write
JINJA_MAX_VALUE = 32 * 1024 * 1024  # bytes (estimated) of any one value a chat template builds
JINJA_MAX_ALLOC = 64 * 1024 * 1024  # bytes of all the values one render builds
JINJA_MAX_SOURCE = 128 * 1024  # characters of chat template
MAX_INT_BITS = 1 << 16  # the largest integer a chat template may build


class _RenderTimeout(BaseException):
    pass


class _Raised(Exception):
    pass


class _TooBig(Exception):
    """A bound of the sandbox was passed; the message says which."""


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
        materialized: list[Any] = _materialize(v)
        return materialized
    if not isinstance(v, collections.abc.Iterable):
        return None
    if isinstance(v, collections.abc.Sized):  # a transient list of references, to be measured (not charged)
        if len(v) > _MAX_ITEMS:
            raise _TooBig(f"a sequence in the template has more than {_MAX_ITEMS} items")
        return list(v)
    rest: list[Any] = _materialize(iter(v))
    return rest


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


# ------------------------------------------------------------------------------------------- the environment, by part


class _Generation(jinja2.ext.Extension):
    """Accept Hugging Face's ``{% generation %}`` markers and render their body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _CheckedCode(CodeGenerator):
    """Route ``~`` and list, tuple and dict literals through the environment's checks (:meth:`_Sandbox.checked_join`,
    :meth:`_Sandbox.checked_literal`)."""

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


def _concat(parts: Iterable[str]) -> str:
    """The environment's ``concat``: {% set %} blocks, macros, filter blocks."""
    parts = list(parts)
    _expect(sum(map(len, parts)) * max(map(_kind, parts), default=1), "a block of template output")
    return str(_checked("".join(parts), "a block of template output"))


def _finalize(value: Any) -> Any:
    """What {{ }} prints: its text may not pass the bound either."""
    if not isinstance(value, str):
        _expect(_text(value, JINJA_MAX_VALUE + 1), "printing a value")
    return value


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``*``, ``**``, ``+`` and ``%`` that would build a value past the bounds, before they run."""
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


def _check_call(obj: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[tuple[Any, ...], Any, str]:
    """Before a call: refuse the str methods that would build past the bounds. Returns the arguments to call with
    (a generator given to ``str.join`` as the list it is measured as), the method's owner, and what to call it in
    an error."""
    # str.format reaches here as the sandbox's wrapper of it (wrap_str_format), the method __wrapped__
    owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)
    name = getattr(obj, "__name__", "")
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
    return args, owner, what


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox with every value a template builds bounded and charged (see the notes above)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _CheckedCode

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept short
            if (len(left) + len(right)) * (1 if left.isascii() and right.isascii() else 4) > JINJA_MAX_VALUE:
                raise _refuse("+")
            return _checked(left + right, "+", left, right)
        _check_binop(operator, left, right)
        result = super().call_binop(context, operator, left, right)
        return result if isinstance(left, int) and isinstance(right, int) else _checked(result, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        args, owner, what = _check_call(__obj, args, kwargs)
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


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
        raise _TooBig("tojson's indent is larger than 64")
    text = _json_str(x) if isinstance(x, str) else _text(x, JINJA_MAX_VALUE + 1)
    _expect(text * (1 + (indent if isinstance(indent, int) else len(indent) if indent else 0)), "the tojson filter")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise _Raised(message)


def _strftime_now(fmt: str) -> str:
    if len(str(fmt)) > 1000:
        raise _TooBig("strftime_now's format is longer than 1000 characters")
    return datetime.now().strftime(fmt)


def _environment() -> _Sandbox:
    """The one environment every chat template compiles in: the checked sandbox, Hugging Face's extensions and
    globals (``raise_exception``, ``strftime_now``), every filter guarded, the quadratic ones and lipsum gone."""
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols], finalize=_finalize
    )
    env.concat = _concat  # type: ignore[method-assign]
    env.filters["tojson"] = _tojson
    env.filters = {name: _guard_filter(name, fn) for name, fn in env.filters.items()}
    for name in ("striptags", "urlize"):  # quadratic regular expressions, run in one C call
        env.filters[name] = _refused_filter(name)
    env.globals.pop("lipsum", None)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    return env


# ---------------------------------------------------------------------------------------------- compiling, rendering

_ENV: _Sandbox | None = None
_ENV_LOCK = threading.Lock()


def _compile(text: str) -> jinja2.Template:
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            _ENV = _environment()
    try:
        return _ENV.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template: line {e.lineno}: {e.message}") from None
    except Exception as e:  # noqa: BLE001 - any compile failure is the template's fault
        raise TemplateError(f"chat template: {e}") from None


# a compiled template takes ~15-25 bytes per character of source (measured), and the code jinja generates
JINJA_CACHE: ByteBoundedCache[str, jinja2.Template] = ByteBoundedCache(32 << 20, lambda text, _: 64 * len(text) + 16384)


def compiled(text: str) -> jinja2.Template:
    """The chat template ``text`` compiled in the sandbox (cached). Raises :class:`TemplateError`."""
    if len(text) > JINJA_MAX_SOURCE:
        raise TemplateError(
            f"chat template: the template is larger than {JINJA_MAX_SOURCE} characters "
            f"({JINJA_MAX_SOURCE >> 10} KiB); give the model a shorter TEMPLATE"
        )
    return JINJA_CACHE.get(text, _compile)


def value_bytes(value: Any) -> int:
    """About the bytes ``value`` takes with everything it refers to (counting stops just past
    :data:`JINJA_MAX_VALUE`): what a template given it may touch."""
    return _flat(value, JINJA_MAX_VALUE + 1)


# Renders run on threads kept for them (starting a thread per render cost ~0.3 ms of every chat request's time to
# its first token on 2 cores). A pool whose render outlives its deadline is retired, its stuck thread left to finish.
_POOL_LOCK = threading.Lock()
_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _render_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="corral-chat-template")
        return _POOL


def _retire(pool: concurrent.futures.ThreadPoolExecutor) -> None:
    global _POOL
    with _POOL_LOCK:
        if _POOL is pool:
            _POOL = None
    pool.shutdown(wait=False)


def render(template: jinja2.Template, variables: Mapping[str, Any], timeout: float = JINJA_TIMEOUT) -> str:
    """Render a compiled chat template with ``variables``, within ``timeout`` seconds of work and the memory bounds
    above, in a thread of its own (a tracer stops Python-level work at the deadline). Raises :class:`TemplateError`
    for anything that goes wrong, the template's ``raise_exception`` included."""
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
            for chunk in template.generate(**variables):
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

    pool = _render_pool()
    done = pool.submit(work)
    try:
        done.result(timeout + 1.0)  # the tracer stops Python-level work; this bounds anything it cannot see
    except concurrent.futures.TimeoutError:
        _retire(pool)  # its thread is stuck in work the tracer cannot see: later renders get fresh threads
        raise TemplateError(f"chat template: rendering took longer than {timeout:g}s") from None
    if isinstance(result.get("error"), _RenderTimeout):
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
