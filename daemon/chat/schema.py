"""Check a tool call's arguments against the tool's declared parameters: the JSON-Schema subset tool definitions use
(type, properties, required, enum, items, additionalProperties, nullable, anyOf/oneOf/allOf), coercing the small
slips models make (``"5"`` for an integer, ``"true"`` for a boolean, an object or array written as a JSON string).
Unknown keywords are ignored: a schema this does not understand never rejects a call."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from daemon.chat.types import JSONObject, Tool

_MAX_DEPTH = 64


class _Invalid(Exception):
    """A value does not match; the message names where."""


def _where(path: str) -> str:
    return path or "arguments"


def _is_type(value: Any, kind: str) -> bool:
    if kind == "null":
        return value is None
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        if isinstance(value, bool):
            return False
        return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    return True  # an unknown type name constrains nothing


def _coerce(value: Any, kind: str) -> tuple[bool, Any]:
    """Turn ``value`` into ``kind`` when it is an obvious slip; (True, new value) or (False, None)."""
    if isinstance(value, str):
        text = value.strip()
        if "_" in text and kind in ("integer", "number"):
            return False, None  # Python reads "1_000" as a number; JSON does not
        if kind == "integer":
            try:
                return True, int(text)
            except ValueError:
                try:
                    f = float(text)
                except ValueError:
                    return False, None
                return (True, int(f)) if math.isfinite(f) and f.is_integer() else (False, None)
        if kind == "number":
            try:
                f = float(text)
            except ValueError:
                return False, None
            if not math.isfinite(f):
                return False, None
            return True, int(f) if f.is_integer() and "." not in text and "e" not in text.lower() else f
        if kind == "boolean" and text.lower() in ("true", "false"):
            return True, text.lower() == "true"
        if kind == "null" and text.lower() in ("null", "none"):
            return True, None
        if kind in ("object", "array") and text[:1] in "{[":
            try:
                decoded = json.loads(text)
            except (ValueError, RecursionError):
                return False, None
            return (True, decoded) if _is_type(decoded, kind) else (False, None)
        return False, None
    if kind == "string" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return True, json.dumps(value)
    if kind == "integer" and isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return True, int(value)
    return False, None


def _types(schema: Mapping[str, Any]) -> list[str]:
    kind = schema.get("type")
    kinds = (
        [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)] if isinstance(kind, list) else []
    )
    if kinds and schema.get("nullable") is True and "null" not in kinds:
        kinds.append("null")
    return kinds


def _check(value: Any, schema: Any, path: str, depth: int) -> Any:
    """``value`` (possibly coerced) when it matches ``schema``; raises :class:`_Invalid`."""
    if not isinstance(schema, Mapping) or depth > _MAX_DEPTH:
        return value  # `true`, `{}`, or something this does not understand: anything goes
    if value is None and schema.get("nullable") is True:
        return value

    for key in ("anyOf", "oneOf"):  # best effort: oneOf's exclusivity is not checked
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            value = _first_match(value, branches, path, depth)
    branches = schema.get("allOf")
    if isinstance(branches, list):
        for branch in branches:
            value = _check(value, branch, path, depth + 1)

    kinds = _types(schema)
    if kinds and not any(_is_type(value, k) for k in kinds):
        for k in kinds:
            ok, new = _coerce(value, k)
            if ok:
                value = new
                break
        else:
            raise _Invalid(f"{_where(path)}: expected {' or '.join(kinds)}, got {_type_name(value)}")
    elif "integer" in kinds and "number" not in kinds and isinstance(value, float):
        value = int(value)  # 5.0 is an integer in JSON Schema; the tool expects one

    enum = schema.get("enum")
    if isinstance(enum, list) and enum and not any(_same(value, e) for e in enum):
        coerced = next((e for e in enum if not isinstance(value, (dict, list)) and str(e) == str(value)), _MISSING)
        if coerced is _MISSING:
            raise _Invalid(f"{_where(path)}: {json.dumps(value)} is not one of {json.dumps(enum)}")
        value = coerced
    if "const" in schema and not _same(value, schema["const"]):
        raise _Invalid(f"{_where(path)}: must be {json.dumps(schema['const'])}")

    if isinstance(value, dict):
        value = _check_object(value, schema, path, depth)
    elif isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, Mapping):
            value = [_check(v, items, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]
    return value


_MISSING = object()


def _first_match(value: Any, branches: list[Any], path: str, depth: int) -> Any:
    """The value as the first branch that takes it unchanged accepts it, else as the first that accepts it after
    coercion (so "5" stays a string when a string is allowed)."""
    errors: list[str] = []
    coerced: Any = _MISSING
    for branch in branches:
        try:
            result = _check(value, branch, path, depth + 1)
        except _Invalid as e:
            errors.append(str(e))
            continue
        if type(result) is type(value) and result == value:
            return result
        if coerced is _MISSING:
            coerced = result
    if coerced is not _MISSING:
        return coerced
    raise _Invalid(errors[0] if len(errors) == 1 else f"{_where(path)}: matches none of the allowed schemas")


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return bool(a == b)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _check_object(value: dict[str, Any], schema: Mapping[str, Any], path: str, depth: int) -> dict[str, Any]:
    props = schema.get("properties")
    props = props if isinstance(props, Mapping) else {}
    required = schema.get("required")
    for name in required if isinstance(required, list) else ():
        if isinstance(name, str) and name not in value:
            raise _Invalid(f"{_join(path, name)}: missing required argument")
    extra = schema.get("additionalProperties")
    out: dict[str, Any] = {}
    for name, v in value.items():
        if name in props:
            out[name] = _check(v, props[name], _join(path, name), depth + 1)
        elif extra is False:
            raise _Invalid(f"{_join(path, name)}: unexpected argument")
        elif isinstance(extra, Mapping):
            out[name] = _check(v, extra, _join(path, name), depth + 1)
        else:
            out[name] = v
    return out


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def check_arguments(arguments: JSONObject, schema: JSONObject | None) -> tuple[JSONObject, str | None]:
    """Validate a call's ``arguments`` against its tool's ``parameters`` schema. Returns (the arguments, coerced
    where a slip was obvious, None), or (the original arguments, a message naming the bad field)."""
    if not isinstance(schema, Mapping) or not schema:
        return arguments, None
    # The top level is an object whatever the schema says (a missing "type" is common in tool definitions).
    top = dict(schema)
    if "type" not in top and "anyOf" not in top and "oneOf" not in top:
        top["type"] = "object"
    try:
        checked = _check(arguments, top, "", 0)
    except _Invalid as e:
        return arguments, str(e)
    except RecursionError:
        return arguments, None
    if not isinstance(checked, dict):
        return arguments, "arguments: expected object"
    out: JSONObject = checked
    return out, None


def declared_function(tools: Iterable[Tool] | None, name: str) -> JSONObject | None:
    """The ``function`` object of the request's tool called ``name`` (Ollama/OpenAI shape), or None when no such
    tool was declared."""
    for tool in tools or ():
        fn = tool.function
        if fn is not None and fn.get("name") == name:
            return fn
    return None


def declared_properties(function: JSONObject | None) -> JSONObject:
    """The parameter schemas of a declared function, by argument name (empty when it declares none)."""
    params = (function or {}).get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    return props if isinstance(props, dict) else {}
