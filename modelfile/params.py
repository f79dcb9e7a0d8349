"""Ollama's option table and the two ways values reach it: Modelfile text and API JSON."""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Mapping
from typing import TypeAlias

from modelfile.errors import ParameterError

OptionValue: TypeAlias = int | float | bool | str | list[str] | list[float] | list[dict[str, float]]
ParameterValue: TypeAlias = int | float | bool | str  # one PARAMETER line's value (stop lines are one string each)


class Scales:
    """The kind of ``lora_scale``: the default scale of each LoRA adapter of the model, in ADAPTER order (a
    Modelfile gives one ``PARAMETER lora_scale`` line per adapter; the API a number or an array of numbers)."""


class LoraList:
    """The kind of ``lora``: llama-server's per-request adapter scales, ``[{"id": N, "scale": S}, ...]`` (ids in the
    model's ADAPTER order). A request option only: a Modelfile sets default scales with ``lora_scale``."""


#: The largest scale magnitude an adapter takes: llama.cpp keeps scales as 32-bit floats (llama-server accepts any
#: JSON number; a larger one would become infinite there), so anything finite up to float32's largest is accepted.
MAX_LORA_SCALE = 3.4028234663852886e38

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
    # speculative decoding (issue 28): the draft model's name, and llama-server's --draft-max, --draft-min,
    # --draft-p-min; draft_ngram: prompt lookup with n-grams of this length (0: off)
    "draft_model": str,
    "draft_max": int,
    "draft_min": int,
    "draft_p_min": float,
    "draft_ngram": int,
    # LoRA adapters (issue 29): the model's default scale per ADAPTER (llama-cpp-python's lora_scale, one per
    # adapter) and llama-server's per-request ``lora`` override
    "lora_scale": Scales,
    "lora": LoraList,
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

#: Ollama's built-in defaults, as in the newest Ollama's api/types.go DefaultOptions (options that are unset by
#: default are absent). repeat_penalty is 1.0 (off) since Ollama v0.32.x; it was 1.1 before.
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
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}

#: Speculative decoding's defaults (llama-server's --draft-max/--draft-min/--draft-p-min; prompt lookup off): not
#: Ollama options, so not in DEFAULT_OPTIONS (whose table is Ollama's), and applied where a generation reads them.
SPECULATIVE_DEFAULTS: dict[str, OptionValue] = {
    "draft_max": 16,
    "draft_min": 0,
    "draft_p_min": 0.75,
    "draft_ngram": 0,
}

TRUE_WORDS = frozenset({"1", "t", "T", "TRUE", "true", "True"})
FALSE_WORDS = frozenset({"0", "f", "F", "FALSE", "false", "False"})
_INT = re.compile(r"[+-]?[0-9]+\Z")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\Z")
_INT64 = (-(2**63), 2**63 - 1)
_TYPE_WORDS = {
    int: "an integer",
    float: "a float",
    bool: "a boolean (true or false)",
    str: "a string",
    list: "a string",
    Scales: "a number (the scale of one ADAPTER, in ADAPTER order)",
    LoraList: "a per-request value",
}


#: num_thread above this many threads per logical CPU only oversubscribes the machine (llama.cpp spins a thread per
#: count), so a larger one (a model made on a bigger machine, or a request's) is lowered to it when the model loads,
#: as the log says; 0 means automatic
THREADS_PER_CPU = 4

#: (lowest, highest, why) of each numeric option; None: no bound on that side. Checked on every value that enters
#: (API options, /api/create parameters, a model's stored parameters); num_thread has no top bound here (see
#: :func:`clamp_num_thread`).
RANGES: dict[str, tuple[float | None, float | None, str]] = {
    "num_ctx": (1, 1 << 24, "must be between 1 and 16777216"),
    "num_batch": (1, 1 << 20, "must be between 1 and 1048576"),
    "num_gpu": (-1, None, "must be -1 (automatic) or a layer count"),
    "main_gpu": (0, None, "must not be negative"),
    "num_keep": (-1, None, "must be -1 or more"),
    "num_predict": (-2, None, "must be -1 (no limit) or more"),
    "top_k": (0, None, "must not be negative"),
    "top_p": (0, 1, "must be between 0 and 1"),
    "min_p": (0, 1, "must be between 0 and 1"),
    "typical_p": (0, 1, "must be between 0 and 1"),
    "repeat_last_n": (-1, None, "must be -1 (the whole context), 0 (off) or more"),
    "temperature": (0, None, "must not be negative"),
    "draft_max": (0, 256, "must be between 0 (no drafting) and 256"),
    "draft_min": (0, 256, "must be between 0 and 256"),
    "draft_p_min": (0, 1, "must be between 0 and 1"),
    "draft_ngram": (0, 64, "must be between 0 (off) and 64"),
}


def max_num_thread() -> int:
    """The most threads a model runs with on this machine: ``THREADS_PER_CPU`` per logical CPU."""
    return THREADS_PER_CPU * (os.cpu_count() or 1)


def clamp_num_thread(value: int) -> int:
    """``value`` (a num_thread already checked: 0 or more) lowered to this machine's :func:`max_num_thread`. A model
    made on a machine with more CPUs runs here, as it does with Ollama (which passes any count on); the runner says
    so in the log when it lowers one."""
    return min(int(value), max_num_thread())


def check_value(name: str, value: object) -> None:
    """Refuse a typed option value outside its range (a ParameterError naming the option and the value)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ParameterError(name, f'option "{name}" must be a finite number, got {_show(value)}')
    if name == "repeat_penalty" and not value > 0:
        raise ParameterError(name, f'option "repeat_penalty" must be above 0 (1 is off), got {_show(value)}')
    if name == "num_thread":
        if value < 0:
            raise ParameterError(
                name,
                f'option "num_thread" must be 0 (automatic) or a number of threads (this machine has '
                f"{os.cpu_count() or 1} logical CPUs; more than {max_num_thread()} are lowered to that), "
                f"got {_show(value)}",
            )
        return
    bounds = RANGES.get(name)
    if bounds is None:
        return
    low, high, why = bounds
    if (low is not None and value < low) or (high is not None and value > high):
        raise ParameterError(name, f'option "{name}" {why}, got {_show(value)}')


def check_deprecated(name: str, value: object) -> None:
    """The deprecated mirostat options are ignored (as Ollama does) but must still be sane: mirostat 0, 1 or 2;
    mirostat_tau and mirostat_eta finite and above 0."""
    if name == "mirostat":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value not in (0, 1, 2):
            raise ParameterError(name, f'option "mirostat" must be 0 (off), 1 or 2, got {_show(value)}')
    elif name in ("mirostat_tau", "mirostat_eta"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
            raise ParameterError(name, f'option "{name}" must be a finite number above 0, got {_show(value)}')


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean "x"?)`` for the closest choice, or ``""``."""
    if word.lower() in choices:
        return f' (did you mean "{word.lower()}"?)'
    match = difflib.get_close_matches(word.lower(), choices, n=1, cutoff=0.7)
    return f' (did you mean "{match[0]}"?)' if match else ""


def is_deprecated(name: str) -> bool:
    return name in DEPRECATED_OPTIONS


def coerce_parameter(name: str, raw: str) -> ParameterValue:
    """Type the text of ``PARAMETER <name> <raw>``; deprecated names keep their raw text."""
    kind = OPTION_TYPES.get(name)
    if kind is None:
        if name in DEPRECATED_OPTIONS:
            _check_deprecated_text(name, raw)
            return raw
        raise ParameterError(name, f'unknown parameter "{name}"' + did_you_mean(name, list(OPTION_TYPES)), unknown=True)
    if kind is LoraList:
        raise ParameterError(
            name,
            'parameter "lora" is a per-request option (llama-server\'s [{"id": N, "scale": S}]); a model sets the '
            "default scale of each adapter with one PARAMETER lora_scale line per ADAPTER, in ADAPTER order",
        )
    value: ParameterValue | None = None
    if kind is bool:
        value = True if raw in TRUE_WORDS else False if raw in FALSE_WORDS else None
    elif kind is int:
        if _INT.match(raw) and _INT64[0] <= int(raw) <= _INT64[1]:
            value = int(raw)
    elif kind is float:
        if _FLOAT.match(raw) and math.isfinite(float(raw)):
            value = float(raw)
    elif kind is Scales:
        if _FLOAT.match(raw) and abs(float(raw)) <= MAX_LORA_SCALE:
            value = float(raw)
    else:
        value = raw
    if value is None:
        raise ParameterError(name, f'parameter "{name}" needs {_TYPE_WORDS[kind]}, got "{raw}"')
    return value


def _check_deprecated_text(name: str, raw: str) -> None:
    kind = DEPRECATED_OPTIONS[name]
    if name not in ("mirostat", "mirostat_tau", "mirostat_eta"):
        return
    value: float | int | None = None
    if kind is int and _INT.match(raw):
        value = int(raw)
    elif kind is float and _FLOAT.match(raw):
        value = float(raw)
    try:
        check_deprecated(name, raw if value is None else value)
    except ParameterError as exc:
        raise ParameterError(name, exc.message.replace(f'option "{name}"', f'parameter "{name}"', 1)) from None


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
            if key in DEPRECATED_OPTIONS:
                check_deprecated(key, value)  # ignored, but never nonsense
                continue
            if ignore_unknown:
                continue
            name = str(key)
            raise ParameterError(
                name, f'unknown option "{name}"' + did_you_mean(name, list(OPTION_TYPES)), unknown=True
            )
        out[key] = typed = _json_value(key, kind, value)
        check_value(key, typed)
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
    if kind is Scales:
        return _scales(key, value)
    if kind is LoraList:
        try:
            entries = lora_entries(value, key)
        except ValueError as exc:
            raise ParameterError(key, f'option "{key}": {exc}') from None
        return [{"id": i, "scale": scale} for i, scale in entries]
    if kind is list:
        if isinstance(value, str):
            return [value]
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return list(value)
        raise ParameterError(key, f'option "{key}" must be a string or an array of strings, got {_show(value)}')
    if isinstance(value, str):
        return value
    raise ParameterError(key, f'option "{key}" must be of type string, got {_show(value)}')


def _scales(key: str, value: object) -> list[float]:
    items = value if isinstance(value, (list, tuple)) else [value]
    out: list[float] = []
    for v in items:
        if not _is_scale(v):
            raise ParameterError(
                key,
                f'option "{key}" must be a number or an array of numbers (the default scale of each ADAPTER, in '
                f"ADAPTER order; finite, at most {MAX_LORA_SCALE:g} either way), got {_show(value)}",
            )
        out.append(float(v))  # type: ignore[arg-type]  # _is_scale: an int or a float
    return out


def _is_scale(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= MAX_LORA_SCALE


def lora_entries(value: object, where: str) -> list[tuple[int, float]]:
    """llama-server's ``lora`` value checked for shape: an array of objects, each with an integer ``id`` (0 or
    more; whether the model has that adapter is checked against it later) and a finite ``scale`` (negative allowed,
    as llama.cpp subtracts the adapter then); no id twice. Other keys of an item are ignored, as llama-server does.
    Returns (id, scale) pairs in the order given; a ValueError says what is wrong, naming ``where[i].field``."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(
            f'{where} must be an array of objects with "id" and "scale" (llama-server\'s [{{"id": 0, "scale": 0.5}}]), '
            f"got {_show(value)}"
        )
    out: list[tuple[int, float]] = []
    seen: dict[int, int] = {}
    for i, item in enumerate(value):
        here = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f'{here} must be an object with "id" and "scale", got {_show(item)}')
        ident = item.get("id")
        if isinstance(ident, float) and ident.is_integer():
            ident = int(ident)
        if not isinstance(ident, int) or isinstance(ident, bool) or ident < 0:
            raise ValueError(
                f"{here}.id must be an adapter's index (an integer from 0, in the model's ADAPTER order), "
                f"got {_show(ident) if 'id' in item else 'nothing'}"
            )
        scale = item.get("scale")
        if not _is_scale(scale):
            raise ValueError(
                f"{here}.scale must be a finite number (0 turns the adapter off; at most {MAX_LORA_SCALE:g} either "
                f"way), got {_show(scale) if 'scale' in item else 'nothing'}"
            )
        if ident in seen:
            raise ValueError(f"{here}.id {ident} was already given in {where}[{seen[ident]}]; give each adapter once")
        seen[ident] = i
        out.append((ident, float(scale)))  # type: ignore[arg-type]  # _is_scale: an int or a float
    return out


def _show(value: object) -> str:
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return text if len(text) <= 60 else text[:57] + "..."
