"""Property tests: parse never fails with anything but ModelfileError, and parse(render(m)) == m."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from modelfile import (
    Adapter,
    From,
    Instruction,
    License,
    Message,
    Modelfile,
    ModelfileError,
    Parameter,
    Requires,
    System,
    Template,
    parse,
    render,
)

FAST = settings(max_examples=200, deadline=None)

# Characters a Modelfile can hold, weighted towards the ones that matter to the grammar.
_tricky = st.sampled_from(list('"""##  \t\t\n\n\r\r\n') + ["\r\n", '"""', "FROM ", "a", "é", "日", "😀"])
_printable = st.characters(codec="utf-8").filter(str.isprintable)
values = st.lists(st.one_of(_tricky, _printable), max_size=30).map("".join)
names = values.filter(lambda v: v.strip() != "")
_keywordish = st.sampled_from(
    [
        "FROM",
        "from",
        "PARAMETER",
        "TEMPLATE",
        "SYSTEM",
        "MESSAGE",
        "LICENSE",
        "#",
        '"""',
        '"',
        "ADAPTER",
        "REQUIRES",
        "stop",
        "user",
        " ",
        "\t",
        "\n",
        "\r\n",
        "temperature",
        "1",
    ]
)
modelfile_text = st.lists(st.one_of(_keywordish, st.text(max_size=5)), max_size=40).map("".join)

parameters = st.one_of(
    st.builds(Parameter, st.just("stop"), values),
    st.builds(Parameter, st.sampled_from(["num_ctx", "seed", "top_k"]), st.integers(-(2**63), 2**63 - 1)),
    st.builds(
        Parameter, st.sampled_from(["temperature", "top_p", "min_p"]), st.floats(allow_nan=False, allow_infinity=False)
    ),
    st.builds(Parameter, st.just("use_mmap"), st.booleans()),
    st.builds(Parameter, st.just("mirostat"), st.sampled_from(["0", "1", "2"])),
    st.builds(Parameter, st.just("use_mlock"), values),
)
versions = st.from_regex(r"\Av?[0-9]{1,3}(\.[0-9]{1,3}){0,2}(-[a-z0-9.]{1,5})?\Z")
instructions: st.SearchStrategy[Instruction] = st.one_of(
    st.builds(From, names),
    st.builds(Adapter, names),
    st.builds(Template, values),
    st.builds(System, values),
    st.builds(License, values),
    st.builds(Message, st.sampled_from(["system", "user", "assistant"]), values),
    st.builds(Requires, versions),
    parameters,
)
modelfiles = st.builds(
    lambda first, rest, at: Modelfile(tuple(rest[:at] + [first] + rest[at:])),
    st.builds(From, names),
    st.lists(instructions, max_size=8),
    st.integers(0, 8),
)


@FAST
@given(modelfile_text)
def test_parse_text_raises_only_modelfile_error(text: str) -> None:
    try:
        m = parse(text)
    except ModelfileError as exc:
        assert exc.line >= 1 and exc.column >= 1
    else:
        assert parse(render(m)) == m


@FAST
@given(st.text())
def test_parse_any_text(text: str) -> None:
    try:
        parse(text)
    except ModelfileError:
        pass


@FAST
@given(st.one_of(st.binary(), modelfile_text.map(lambda t: t.encode("utf-16"))))
def test_parse_any_bytes(data: bytes) -> None:
    try:
        parse(data)
    except ModelfileError:
        pass


@FAST
@given(modelfiles)
def test_render_round_trips(m: Modelfile) -> None:
    try:
        text = render(m)
    except ModelfileError as exc:
        assert "cannot be written" in exc.detail
        bad = [getattr(i, "value", None) or getattr(i, "content", "") for i in m.instructions]
        assert any('"""' in str(v) and ("\n" in str(v) or "\r" in str(v)) for v in bad)
        return
    assert parse(text) == m
    assert parse(text.encode("utf-16")) == m


@FAST
@given(values)
def test_single_values_round_trip_unless_unrepresentable(value: str) -> None:
    m = Modelfile((From("x"), System(value)))
    try:
        text = render(m)
    except ModelfileError:
        assert '"""' in value
    else:
        assert parse(text).system == value


def test_unrepresentable_is_rare() -> None:
    assert parse(render(Modelfile((From("x"), System('a """ b\nc'))))).system == 'a """ b\nc'
    assert parse(render(Modelfile((From("x"), System('a\nb """'))))).system == 'a\nb """'
