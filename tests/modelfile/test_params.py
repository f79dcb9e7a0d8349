"""coerce_parameter (Modelfile text) and validate_options (API JSON)."""

from __future__ import annotations

import pytest

from errors import InvalidRequest
from modelfile import DEFAULT_OPTIONS, OPTION_TYPES, ParameterError, coerce_parameter, validate_options


@pytest.mark.parametrize(
    ("name", "raw", "value"),
    [
        ("num_ctx", "4096", 4096),
        ("seed", "-1", -1),
        ("num_gpu", "+3", 3),
        ("main_gpu", "0", 0),
        ("num_predict", "9223372036854775807", 2**63 - 1),
        ("temperature", "0.7", 0.7),
        ("top_p", "1", 1.0),
        ("min_p", ".05", 0.05),
        ("repeat_penalty", "1.", 1.0),
        ("typical_p", "-2.5e-1", -0.25),
        ("stop", "<|im_end|>", "<|im_end|>"),
        ("stop", "", ""),
        ("mirostat", "2", "2"),  # deprecated: checked, kept as its text, dropped from the model's parameters
        ("mirostat_tau", "5.0", "5.0"),
        ("mirostat_eta", ".1", ".1"),
        ("use_mlock", "anything", "anything"),
        *[("use_mmap", w, True) for w in ("1", "t", "T", "TRUE", "true", "True")],
        *[("use_mmap", w, False) for w in ("0", "f", "F", "FALSE", "false", "False")],
    ],
)
def test_coerce(name: str, raw: str, value: object) -> None:
    got = coerce_parameter(name, raw)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize(
    ("name", "raw", "message"),
    [
        ("temperature", "hot", 'parameter "temperature" needs a float, got "hot"'),
        ("temperature", "nan", "needs a float"),
        ("temperature", "inf", "needs a float"),
        ("temperature", "1e999", "needs a float"),
        ("temperature", "1_0", "needs a float"),
        ("temperature", "true", "needs a float"),
        ("num_ctx", "1.5", 'parameter "num_ctx" needs an integer, got "1.5"'),
        ("num_ctx", "", "needs an integer"),
        ("num_ctx", " 1", "needs an integer"),
        ("num_ctx", "٣", "needs an integer"),
        ("num_ctx", "9223372036854775808", "needs an integer"),
        ("use_mmap", "yes", 'parameter "use_mmap" needs a boolean (true or false), got "yes"'),
        ("use_mmap", "tRUE", "needs a boolean"),
        ("numa", "1", 'unknown parameter "numa"'),
        ("tfs_z", "1", 'unknown parameter "tfs_z"'),
        ("temprature", "1", 'unknown parameter "temprature" (did you mean "temperature"?)'),
        ("NUM_CTX", "1", 'unknown parameter "NUM_CTX" (did you mean "num_ctx"?)'),
        ("mirostat", "two", 'parameter "mirostat" must be 0 (off), 1 or 2, got "two"'),
        ("mirostat", "7", 'parameter "mirostat" must be 0 (off), 1 or 2, got 7'),
        ("mirostat", "-1", "must be 0 (off), 1 or 2"),
        ("mirostat_tau", "NaN", 'parameter "mirostat_tau" must be a finite number above 0, got "NaN"'),
        ("mirostat_tau", "inf", "finite number above 0"),
        ("mirostat_tau", "0", "finite number above 0"),
        ("mirostat_eta", "-0.1", 'parameter "mirostat_eta" must be a finite number above 0, got -0.1'),
    ],
)
def test_coerce_errors(name: str, raw: str, message: str) -> None:
    with pytest.raises(ParameterError) as info:
        coerce_parameter(name, raw)
    assert message in str(info.value)
    assert isinstance(info.value, InvalidRequest)
    assert info.value.name == name
    assert info.value.unknown == ("unknown" in message)


def test_validate_options_types() -> None:
    got = validate_options(
        {
            "num_ctx": 2048.9,
            "seed": -1,
            "temperature": 1,
            "top_p": 0.5,
            "use_mmap": False,
            "stop": "x",
            "num_predict": None,
            "mirostat": 2,
            "penalize_newline": True,
        }
    )
    assert got == {"num_ctx": 2048, "seed": -1, "temperature": 1.0, "top_p": 0.5, "use_mmap": False, "stop": ["x"]}
    assert type(got["num_ctx"]) is int and type(got["temperature"]) is float
    assert validate_options({"stop": ["a", "b"]}) == {"stop": ["a", "b"]}
    assert validate_options({}) == {}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_ctx": "4096"}, 'option "num_ctx" must be of type integer'),
        ({"num_ctx": True}, 'option "num_ctx" must be of type integer'),
        ({"num_ctx": 1e30}, 'option "num_ctx" is out of range'),
        ({"temperature": "hot"}, 'option "temperature" must be of type float32, got "hot"'),
        ({"temperature": False}, "must be of type float32"),
        ({"temperature": float("nan")}, "must be a finite number"),
        ({"use_mmap": 1}, 'option "use_mmap" must be of type boolean, got 1'),
        ({"stop": 3}, 'option "stop" must be a string or an array of strings'),
        ({"stop": ["a", 1]}, "array of strings"),
        ({"numa": True}, 'unknown option "numa"'),
        ({"temprature": 0.1}, 'unknown option "temprature" (did you mean "temperature"?)'),
    ],
)
def test_validate_options_errors(options: dict[str, object], message: str) -> None:
    with pytest.raises(ParameterError) as info:
        validate_options(options)
    assert message in str(info.value)
    assert info.value.name == next(iter(options))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"mirostat": 7}, 'option "mirostat" must be 0 (off), 1 or 2, got 7'),
        ({"mirostat": True}, "must be 0 (off), 1 or 2"),
        ({"mirostat": "2"}, "must be 0 (off), 1 or 2"),
        ({"mirostat_tau": float("nan")}, 'option "mirostat_tau" must be a finite number above 0, got nan'),
        ({"mirostat_tau": float("inf")}, "finite number above 0"),
        ({"mirostat_eta": 0}, 'option "mirostat_eta" must be a finite number above 0, got 0'),
        ({"repeat_penalty": 0}, 'option "repeat_penalty" must be above 0 (1 is off), got 0.0'),
        ({"repeat_penalty": -1}, "must be above 0"),
        ({"temperature": float("inf")}, 'option "temperature" must be a finite number'),
        ({"temperature": -0.1}, 'option "temperature" must not be negative, got -0.1'),
        ({"top_p": 1.5}, 'option "top_p" must be between 0 and 1, got 1.5'),
        ({"num_thread": -1}, 'option "num_thread" must be 0 (automatic) or a number of threads'),
        ({"num_thread": -1}, "logical CPU"),
        ({"num_ctx": 0}, 'option "num_ctx" must be between 1 and 16777216, got 0'),
        ({"main_gpu": -1}, 'option "main_gpu" must not be negative'),
    ],
)
def test_validate_options_ranges(options: dict[str, object], message: str) -> None:
    for ignore_unknown in (False, True):  # a model's stored parameters are checked the same way
        with pytest.raises(ParameterError) as info:
            validate_options(options, ignore_unknown=ignore_unknown)
        assert message in str(info.value)
        assert info.value.name == next(iter(options))


def test_num_thread_above_the_machines_bound_is_accepted_and_clamped() -> None:
    """A model made on a machine with more CPUs (or a request asking for more threads) is not refused: the count
    is lowered to this machine's bound when the model loads (issue 25), as Ollama runs it; negative is refused."""
    import os

    from modelfile.params import clamp_num_thread, max_num_thread

    top = max_num_thread()
    assert top == 4 * (os.cpu_count() or 1)
    for big in (top + 1, 1024, 1 << 40):
        assert validate_options({"num_thread": big}) == {"num_thread": big}
        assert validate_options({"num_thread": big}, ignore_unknown=True) == {"num_thread": big}
        assert clamp_num_thread(big) == top
    assert clamp_num_thread(0) == 0 and clamp_num_thread(1) == 1 and clamp_num_thread(top) == top
    with pytest.raises(ParameterError, match="got -3"):
        validate_options({"num_thread": -3})
    with pytest.raises(ParameterError, match="integer"):
        validate_options({"num_thread": "8"})


def test_deprecated_options_are_checked_then_dropped() -> None:
    assert validate_options({"mirostat": 1, "mirostat_tau": 5, "mirostat_eta": 0.1, "seed": 1}) == {"seed": 1}
    assert validate_options({"mirostat": 0.0, "penalize_newline": "whatever"}, ignore_unknown=True) == {}


def test_validate_options_can_ignore_unknown() -> None:
    assert validate_options({"numa": True, "seed": 3}, ignore_unknown=True) == {"seed": 3}


def test_tables() -> None:
    assert set(DEFAULT_OPTIONS) <= set(OPTION_TYPES)
    assert DEFAULT_OPTIONS["num_ctx"] == 4096 and DEFAULT_OPTIONS["temperature"] == 0.8
    assert OPTION_TYPES["stop"] is list and OPTION_TYPES["use_mmap"] is bool
    for name, value in DEFAULT_OPTIONS.items():
        assert isinstance(value, OPTION_TYPES[name]) and not isinstance(value, bool)
    assert validate_options(DEFAULT_OPTIONS) == DEFAULT_OPTIONS
