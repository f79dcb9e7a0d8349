"""Ollama's option table and the two ways values reach it: Modelfile text and API JSON."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from typing import TypeAlias

from modelfile.errors import ParameterError

OptionValue: TypeAlias = int | float | bool | str | list[str]

#: Current option names and their types; ``list`` means a list of strings (only ``stop``).
OPTION_TYPES: dict[str, type] = {
    "num_ctx": int,
    "num_batch": int,
    "num_gpu": int,
    "main_gpu": int,
    "use_mmap": bool,
    "num_thread": int,
    "num_keep": int,
    "seed": int,
    "num_predict": int,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "typical_p": float,
    "repeat_last_n": int,
    "temperature": float,
    "repeat_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "stop": list,
}

#: Options Ollama no longer honours: a Modelfile warns and drops them, the API ignores them.
DEPRECATED_OPTIONS: dict[str, type] = {
    "penalize_newline": bool,
    "low_vram": bool,
    "f16_kv": bool,
    "logits_all": bool,
    "vocab_only": bool,
    "use_mlock": bool,
    "mirostat": int,
    "mirostat_tau": float,
    "mirostat_eta": float,
}

#: Ollama's built-in defaults (options that are unset by default are absent).
DEFAULT_OPTIONS: dict[str, OptionValue] = {
    "num_ctx": 4096,
    "num_batch": 512,
    "num_gpu": -1,
    "num_thread": 0,
    "num_keep": 4,
    "seed": -1,
    "num_predict": -1,
    "top_k": 40,
    "top_p": 0.9,
    "min_p": 0.0,
    "typical_p": 1.0,
    "repeat_last_n": 64,
    "temperature": 0.8,
    "repeat_penalty": 1.1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}

TRUE_WORDS = frozenset({"1", "t", "T", "TRUE", "true", "True"})
FALSE_WORDS = frozenset({"0", "f", "F", "FALSE", "false", "False"})
_INT = re.compile(r"[+-]?[0-9]+\Z")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z")
_INT64 = (-(2**63), 2**63 - 1)
_TYPE_WORDS = {int: "an integer", float: "a float", bool: "a boolean (true or false)", str: "a string", list: "a string"}


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean "x"?)`` for the closest choice, or ``""``."""
    if word.lower() in choices:
        return f' (did you mean "{word.lower()}"?)'
    match = difflib.get_close_matches(word.lower(), choices, n=1, cutoff=0.7)
    return f' (did you mean "{match[0]}"?)' if match else ""


def is_deprecated(name: str) -> bool:
    return name in DEPRECATED_OPTIONS


def coerce_parameter(name: str, raw: str) -> OptionValue:
    """Type the text of ``PARAMETER <name> <raw>``; deprecated names keep their raw text."""
    kind = OPTION_TYPES.get(name)
    if kind is None:
        if name in DEPRECATED_OPTIONS:
            return raw
        raise ParameterError(name, f'unknown parameter "{name}"' + did_you_mean(name, list(OPTION_TYPES)), unknown=True)
    value: OptionValue | None = None
    if kind is bool:
        value = True if raw in TRUE_WORDS else False if raw in FALSE_WORDS else None
    elif kind is int:
        if _INT.match(raw) and _INT64[0] <= int(raw) <= _INT64[1]:
            value = int(raw)
    elif kind is float:
        if _FLOAT.match(raw) and math.isfinite(float(raw)):
            value = float(raw)
    else:
        value = raw
    if value is None:
        raise ParameterError(name, f'parameter "{name}" needs {_TYPE_WORDS[kind]}, got "{raw}"')
    return value


def format_parameter(value: object) -> str:
    """The Modelfile text for a typed parameter value (bools as true/false, floats via repr)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def validate_options(options: Mapping[str, object], *, ignore_unknown: bool = False) -> dict[str, OptionValue]:
    """Check and type an API ``options`` object; ``None`` values and deprecated names are dropped."""
    out: dict[str, OptionValue] = {}
    for key, value in options.items():
        if value is None:
            continue
        kind = OPTION_TYPES.get(key) if isinstance(key, str) else None
        if kind is None:
            if ignore_unknown or key in DEPRECATED_OPTIONS:
                continue
            name = str(key)
            raise ParameterError(name, f'unknown option "{name}"' + did_you_mean(name, list(OPTION_TYPES)), unknown=True)
        out[key] = _json_value(key, kind, value)
    return out


def _json_value(key: str, kind: type, value: object) -> OptionValue:
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ParameterError(key, f'option "{key}" must be of type boolean, got {_show(value)}')
    if kind in (int, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ParameterError(key, f'option "{key}" must be a finite number, got {_show(value)}')
        if kind is float:
            return float(value)
        if _INT64[0] <= int(value) <= _INT64[1]:
            return int(value)
        raise ParameterError(key, f'option "{key}" is out of range, got {_show(value)}')
    if kind is int:
        raise ParameterError(key, f'option "{key}" must be of type integer, got {_show(value)}')
    if kind is float:
        raise ParameterError(key, f'option "{key}" must be of type float32, got {_show(value)}')
    if kind is list:
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ParameterError(key, f'option "{key}" must be a string or an array of strings, got {_show(value)}')
    if isinstance(value, str):
        return value
    raise ParameterError(key, f'option "{key}" must be of type string, got {_show(value)}')


def _show(value: object) -> str:
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return text if len(text) <= 60 else text[:57] + "..."
