"""Checking (and gently coercing) tool-call arguments against a tool's parameter schema."""

from __future__ import annotations

from typing import Any

import pytest

from daemon.chat.schema import check_arguments

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "scale": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
        "note": {"type": ["string", "null"]},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "string", "enum": ["all"]}]},
        "id": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "opt": {"type": "string", "nullable": True},
    },
    "required": ["city"],
}


@pytest.mark.parametrize(
    ("args", "want"),
    [
        ({"city": "Oslo"}, {"city": "Oslo"}),
        ({"city": "Oslo", "days": "5"}, {"city": "Oslo", "days": 5}),
        ({"city": "Oslo", "days": 5.0}, {"city": "Oslo", "days": 5}),
        ({"city": "Oslo", "days": "5.0"}, {"city": "Oslo", "days": 5}),
        ({"city": "Oslo", "metric": "true"}, {"city": "Oslo", "metric": True}),
        ({"city": "Oslo", "metric": "False"}, {"city": "Oslo", "metric": False}),
        ({"city": "Oslo", "scale": "1.5"}, {"city": "Oslo", "scale": 1.5}),
        ({"city": "Oslo", "scale": 2}, {"city": "Oslo", "scale": 2}),
        ({"city": "Oslo", "tags": '["a", "b"]'}, {"city": "Oslo", "tags": ["a", "b"]}),
        ({"city": "Oslo", "where": '{"lat": 1, "lon": "2.5"}'}, {"city": "Oslo", "where": {"lat": 1, "lon": 2.5}}),
        ({"city": "Oslo", "note": None}, {"city": "Oslo", "note": None}),
        ({"city": "Oslo", "limit": "all"}, {"city": "Oslo", "limit": "all"}),
        ({"city": "Oslo", "limit": "7"}, {"city": "Oslo", "limit": 7}),
        ({"city": "Oslo", "id": "7"}, {"city": "Oslo", "id": "7"}),  # a string is allowed: left as it is
        ({"city": "Oslo", "opt": None}, {"city": "Oslo", "opt": None}),
        ({"city": "Oslo", "extra": 1}, {"city": "Oslo", "extra": 1}),  # extra top-level arguments are allowed
        ({"city": 12}, {"city": "12"}),
    ],
)
def test_valid_and_coerced(args: dict[str, Any], want: dict[str, Any]) -> None:
    original = dict(args)
    out, err = check_arguments(args, WEATHER)
    assert err is None
    assert out == want
    assert [type(v) for v in out.values()] == [type(v) for v in want.values()]
    assert args == original  # not modified in place


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({}, "city"),
        ({"city": "Oslo", "days": "five"}, "days"),
        ({"city": "Oslo", "days": 2.5}, "days"),
        ({"city": "Oslo", "days": True}, "days"),
        ({"city": "Oslo", "metric": "yes"}, "metric"),
        ({"city": "Oslo", "unit": "kelvin"}, "unit"),
        ({"city": "Oslo", "tags": ["a", {"b": 1}]}, "tags[1]"),
        ({"city": "Oslo", "where": {"lat": 1}}, "where.lon"),
        ({"city": "Oslo", "where": {"lat": 1, "lon": 2, "alt": 3}}, "where.alt"),
        ({"city": "Oslo", "limit": "some"}, "limit"),
        ({"city": None}, "city"),
        ({"city": "Oslo", "scale": "nan"}, "scale"),
        ({"city": "Oslo", "days": "1_000"}, "days"),
    ],
)
def test_invalid_names_the_field(args: dict[str, Any], field: str) -> None:
    out, err = check_arguments(args, WEATHER)
    assert out is args
    assert err is not None and err.startswith(field + ":"), err


def test_no_or_odd_schema_accepts_anything() -> None:
    args = {"a": 1}
    assert check_arguments(args, None) == (args, None)
    assert check_arguments(args, {}) == (args, None)
    assert check_arguments(args, {"properties": {"a": {"type": "weird"}}}) == (args, None)
    assert check_arguments(args, {"properties": {"a": True}}) == (args, None)
    assert check_arguments(args, {"type": "object", "properties": "nonsense", "required": "a"}) == (args, None)


def test_top_level_additional_properties_false() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}
    assert check_arguments({"a": "x", "b": 1}, schema)[1] == "b: unexpected argument"


def test_enum_coercion_and_bool_vs_int() -> None:
    schema = {"properties": {"n": {"enum": [1, 2, 3]}, "b": {"enum": [True]}}}
    assert check_arguments({"n": "2"}, schema) == ({"n": 2}, None)
    assert check_arguments({"b": 1}, schema)[1] is not None


def test_all_of_and_deep_nesting() -> None:
    schema = {"properties": {"x": {"allOf": [{"type": "integer"}, {"enum": [3]}]}}}
    assert check_arguments({"x": "3"}, schema) == ({"x": 3}, None)
    deep: dict[str, Any] = {"type": "object", "properties": {}}
    node = deep
    for _ in range(200):
        child: dict[str, Any] = {"type": "object", "properties": {}}
        node["properties"]["k"] = child
        node = child
    value: dict[str, Any] = {}
    cur = value
    for _ in range(200):
        cur["k"] = {}
        cur = cur["k"]
    assert check_arguments(value, deep)[1] is None
