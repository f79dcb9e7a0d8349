"""The Go text/template subset (daemon/templates/gotemplate.py): language, functions, errors, limits."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.templates.gotemplate import Struct, TemplateError, go_json, parse
from errors import InvalidRequest


def render(text: str, data: Any = None) -> str:
    return parse(text).execute({} if data is None else data)


DATA = {
    "Name": "corral",
    "Empty": "",
    "Zero": 0,
    "One": 1,
    "Pi": 3.5,
    "T": True,
    "F": False,
    "Nil": None,
    "L": ["a", "b", "c"],
    "N": [1, 2, 3, 4, 5],
    "EmptyL": [],
    "M": {"b": 2, "a": 1},
    "EmptyM": {},
    "Msgs": [
        {"Role": "system", "Content": "sys"},
        {"Role": "user", "Content": "hi"},
        {"Role": "assistant", "Content": "yo"},
    ],
    "S": Struct({"X": "x", "Inner": Struct({"Y": 7})}),
}

CASES = [
    # text, trimming, comments
    ("plain text", "plain text"),
    ("a {{ .Name }} b", "a corral b"),
    ("a \n\t {{- .Name -}} \n b", "acorralb"),
    ("a  {{- .Name }}  b", "acorral  b"),
    ("a  {{ .Name -}}  b", "a  corralb"),
    ("a {{/* a comment */}} b", "a  b"),
    ("a \n{{- /* trimmed comment */ -}}\n b", "ab"),
    ("{{-3}}", "-3"),  # "{{-" not followed by a space is a number
    ("{{ .Name\n}}", "corral"),  # newlines inside actions
    # fields, variables, missing values
    ("{{ .Msgs }}", "[map[Content:sys Role:system] map[Content:hi Role:user] map[Content:yo Role:assistant]]"),
    ("{{ .S.Inner.Y }} {{ $.S.X }}", "7 x"),
    ("{{ .Missing }}|{{ .Missing.Deeper }}|{{ .Nil }}", "<no value>|<no value>|<no value>"),
    ("{{ .S.Nope }}", "<no value>"),
    ("{{ $x := .Name }}{{ $x }}", "corral"),
    ("{{ $x := 1 }}{{ if .T }}{{ $x = 2 }}{{ end }}{{ $x }}", "2"),
    ("{{ $x := 1 }}{{ if .T }}{{ $x := 2 }}{{ $x }}{{ end }}{{ $x }}", "21"),
    ("{{ with $y := .Name }}{{ $y }}{{ end }}", "corral"),
    ("{{ range .L }}{{ $.Name }}{{ end }}", "corralcorralcorral"),
    # if / else if / else, truthiness
    ("{{ if .T }}y{{ else }}n{{ end }}", "y"),
    ("{{ if .F }}a{{ else if .Zero }}b{{ else if .Empty }}c{{ else if .EmptyL }}d{{ else }}e{{ end }}", "e"),
    ("{{ if .EmptyM }}a{{ else if .Nil }}b{{ else if .Pi }}c{{ end }}", "c"),
    ("{{ if .S }}struct is true{{ end }}", "struct is true"),
    ("{{ if .Missing }}a{{ else }}b{{ end }}", "b"),
    # range
    ("{{ range .L }}[{{ . }}]{{ end }}", "[a][b][c]"),
    ("{{ range $i, $e := .L }}{{ $i }}={{ $e }} {{ end }}", "0=a 1=b 2=c "),
    ("{{ range $e := .L }}{{ $e }}{{ end }}", "abc"),
    ("{{ range .EmptyL }}x{{ else }}empty{{ end }}", "empty"),
    ("{{ range .Missing }}x{{ else }}none{{ end }}", "none"),
    ("{{ range $k, $v := .M }}{{ $k }}{{ $v }}{{ end }}", "a1b2"),  # maps range in key order
    ("{{ range 3 }}{{ . }}{{ end }}", "012"),
    ("{{ range .N }}{{ if eq . 2 }}{{ continue }}{{ end }}{{ if eq . 4 }}{{ break }}{{ end }}{{ . }}{{ end }}", "13"),
    (
        "{{ range $i, $m := .Msgs }}{{ if eq $i 0 }}first:{{ end }}{{ $m.Role }} {{ end }}",
        "first:system user assistant ",
    ),
    ("{{ range .Msgs }}{{ $r := .Role }}{{ $r }}{{ end }}", "systemuserassistant"),
    # with
    ("{{ with .Name }}<{{ . }}>{{ end }}", "<corral>"),
    ("{{ with .Empty }}x{{ else }}empty{{ end }}", "empty"),
    ("{{ with .Empty }}x{{ else with .One }}one={{ . }}{{ end }}", "one=1"),
    # pipelines and parentheses
    ('{{ .Name | printf "%s!" }}', "corral!"),
    ('{{ .Name | printf "%s-%s" "x" }}', "x-corral"),
    ("{{ (len .L) }} {{ len (slice .L 1) }}", "3 2"),
    ('{{ printf "%d" (len .N) | printf "<%s>" }}', "<5>"),
    # literals
    (
        "{{ \"a\\tb\\u00e9\" }}|{{ `raw\\n` }}|{{ 'x' }}|{{ 0x1F }}|{{ 1_000 }}|{{ true }}|{{ 2.50 }}",
        "a\tbé|raw\\n|120|31|1000|true|2.5",
    ),
    ("{{ 1e6 }} {{ 1.5e-7 }} {{ 123456.0 }} {{ 0.0001 }}", "1e+06 1.5e-07 123456 0.0001"),
    # comparison
    ('{{ eq .Name "corral" }} {{ eq .Name "a" "b" "corral" }} {{ eq .Name "a" "b" }}', "true true false"),
    ('{{ eq .One 1 }} {{ eq .Pi 3.5 }} {{ eq .Missing "x" }} {{ eq .Nil nil }}', "true true false true"),
    ('{{ ne .Name "x" }} {{ lt 1 2 }} {{ le 2 2 }} {{ gt "b" "a" }} {{ ge 1.5 2 }}', "true true true true false"),
    # and / or / not
    ('{{ and 1 0 2 }} {{ and 1 2 }} {{ or 0 "" "x" }} {{ or 0 "" }} {{ not .Empty }}', "0 2 x  true"),
    ("{{ and .F (index .L 99) }}", "false"),  # short-circuit: the failing index never runs
    ("{{ or .T (index .L 99) }}", "true"),
    ('{{ if and .T (eq .Name "corral") }}ok{{ end }}', "ok"),
    # len / index / slice
    ('{{ len .L }} {{ len .M }} {{ len .Name }} {{ len "é" }} {{ len .Missing }}', "3 2 6 2 0"),
    ('{{ index .L 1 }} {{ index .M "a" }} {{ index .M "zz" }} {{ index .Msgs 1 "Role" }}', "b 1 <no value> user"),
    ("{{ slice .L 1 }} {{ slice .L 0 2 }} {{ slice .Name 1 3 }} {{ slice .L }}", "[b c] [a b] or [a b c]"),
    ("{{ $last := eq (len (slice .Msgs 2)) 1 }}{{ $last }}", "true"),
    # print / printf
    ('{{ print 1 2 "a" "b" 3 }}', "1 2ab3"),
    ('{{ println "a" 1 }}', "a 1\n"),
    (
        '{{ printf "%s|%d|%v|%q|%t|%5s|%-3d|%03d|%.2f|%x|%%" "s" 7 .L "q\\"" true "r" 1 7 3.14159 255 }}',
        's|7|[a b c]|"q\\""|true|    r|1  |007|3.14|ff|%',
    ),
    (
        '{{ printf "%s %d" "a" }}|{{ printf "%d" "a" }}|{{ printf "x" 1 }}',
        "a %!d(MISSING)|%!d(string=a)|x%!(EXTRA int=1)",
    ),
    ('{{ printf "%s\\n\\n%s" "a" "b" }}', "a\n\nb"),
    # json
    (
        "{{ json .L }} {{ json .M }} {{ json .Nil }} {{ json 1.0 }} {{ json 1e21 }} {{ json 1e-7 }}",
        '["a","b","c"] {"b":2,"a":1} null 1 1e+21 1e-7',
    ),
    ('{{ json "<a & b>\\n\\u2028" }}', '"\\u003ca \\u0026 b\\u003e\\n\\u2028"'),
    ("{{ json .S }}", '{"X":"x","Inner":{"Y":7}}'),
    # toTypeScriptType
    ("{{ toTypeScriptType .P }} {{ toTypeScriptType .Q }} {{ toTypeScriptType 1 }}", "string | number any[] any"),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_language(text: str, expected: str) -> None:
    data = {**DATA, "P": {"type": ["string", "integer"]}, "Q": Struct({"Type": ["array"]})}
    assert render(text, data) == expected


def test_dates() -> None:
    today = dt.date.today()
    assert render("{{ currentDate }}") == today.isoformat()
    assert render("{{ yesterdayDate }}") == (today - dt.timedelta(days=1)).isoformat()


def test_stringer_values_print_through_go_string() -> None:
    class Args(dict):  # type: ignore[type-arg]
        def go_string(self) -> str:
            return go_json(self)

    assert (
        render("{{ .A }} {{ range $k, $v := .A }}{{ $k }}={{ $v }};{{ end }}", {"A": Args(city="Tokyo")})
        == '{"city":"Tokyo"} city=Tokyo;'
    )
    tool = Struct({"Name": "f"}, json={"name": "f"}, stringer=True)
    assert render("{{ . }}|{{ .Name }}|{{ json . }}", tool) == '{"name":"f"}|f|{"name":"f"}'
    assert render("{{ . }}", Struct({"A": 1, "B": "x"})) == "{1 x}"


def test_variable_scope_ends_with_block() -> None:
    with pytest.raises(TemplateError, match="undefined variable"):
        parse("{{ if .T }}{{ $x := 1 }}{{ end }}{{ $x }}")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{{ .Prompt ", "template: 1:1: unclosed action"),
        ("a\n{{ .Prompt\n\n", "template: 2:1: unclosed action"),
        ("line one\n  {{ if .X }}", "template: 2:14: unexpected EOF"),
        ("{{ end }}", "template: 1:4: unexpected {{end}}"),
        ("{{ else }}", "template: 1:4: unexpected {{else}}"),
        ("{{ if .X }}a{{ else }}b{{ else }}c{{ end }}", "expected end; found {{else}}"),
        ("{{ foo .X }}", 'template: 1:4: function "foo" not defined'),
        ("{{ $x }}", 'template: 1:4: undefined variable "$x"'),
        ('a\nb\n{{ .X "y"( 1 ) }}', 'template: 3:10: unexpected "(" in operand'),
        ("{{ .X } }}", "unrecognized character in action"),
        ("{{ (.X }}", "unclosed left paren"),
        ("{{ .X) }}", "unexpected right paren"),
        ('{{ "abc }}', "unterminated quoted string"),
        ("{{ `abc }}", "unterminated raw quoted string"),
        ("{{/* abc }}", "unclosed comment"),
        ("{{/* abc */ }}", "comment ends before closing delimiter"),
        ("{{ }}", "missing value for command"),
        ("{{ if }}x{{ end }}", "missing value for if"),
        ("{{ .X | }}", "missing command"),
        ('{{ .X | "b" }}', "non executable command in pipeline stage 2"),
        ("{{ break }}", "{{break}} outside {{range}}"),
        ("{{ 3x }}", "bad number syntax"),
        ('{{ define "x" }}{{ end }}', "{{define}} is not supported"),
        ('{{ template "x" }}', "{{template}} is not supported"),
        ("{{ range $a, $b, $c := .L }}{{ end }}", "range can only initialize variables"),
        ("{{" + "(" * 500 + "1" + ")" * 500 + "}}", "max expression depth exceeded"),
        ("{{ if 1 }}" * 300, "max nesting depth exceeded"),
    ],
)
def test_parse_errors(text: str, message: str) -> None:
    with pytest.raises(TemplateError) as info:
        parse(text)
    assert message in str(info.value)
    assert isinstance(info.value, InvalidRequest)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{{ index .L 5 }}", "template: 1:4: executing at <index .L 5>: error calling index: index out of range: 5"),
        ('{{ index .L "x" }}', "cannot index slice/array with type string"),
        ("{{ slice .L 2 1 }}", "invalid slice index: 2 > 1"),
        ("{{ slice .L 0 9 }}", "index out of range: 9"),
        ("{{ eq }}", "wrong number of args for eq: want at least 1 got 0"),
        ("{{ not 1 2 }}", "wrong number of args for not: want 1 got 2"),
        ("{{ eq .Name 1 }}", "error calling eq: incompatible types for comparison"),
        ("{{ eq .L .L }}", "non-comparable type"),
        ("{{ lt .T .F }}", "invalid type for comparison"),
        ("{{ len 3 }}", "len of type int"),
        ("{{ .Name.Foo }}", "can't evaluate field Foo in type string"),
        ("{{ .Name 1 }}", "Name is not a method but has arguments"),
        ("{{ $x := 1 }}{{ $x 2 }}", "can't give argument to non-function $x"),
        ("{{ .M 1 }}", "M is not a method but has arguments"),
        ("{{ 1 2 }}", "can't give argument to non-function 1"),
        ("{{ nil }}", "nil is not a command"),
        ("{{ range .Name }}{{ end }}", "range can't iterate over corral"),
        ("{{ range $i, $e := 3 }}{{ end }}", "can't use 3 to iterate over more than one variable"),
        ('x\n\n  {{ printf "%s" (index .N 10) }}', "template: 3:19: executing at <index .N 10>"),
    ],
)
def test_exec_errors(text: str, message: str) -> None:
    tmpl = parse(text)
    with pytest.raises(TemplateError) as info:
        tmpl.execute(DATA)
    assert message in str(info.value)


def test_step_limit_stops_runaway_templates() -> None:
    with pytest.raises(TemplateError, match="exceeded 1000000 steps"):
        render("{{ range 1000000000000 }}{{ end }}")
    with pytest.raises(TemplateError, match="exceeded 100 steps"):
        parse("{{ range .N }}{{ range $.N }}{{ range $.N }}x{{ end }}{{ end }}{{ end }}").execute(DATA, max_steps=100)
    assert len(parse("{{ range 1000 }}x{{ end }}").execute({})) == 1000


def test_output_limit_stops_exponential_growth() -> None:
    text = '{{ $x := "ab" }}{{ range 200 }}{{ $x = printf "%s%s" $x $x }}{{ end }}{{ $x }}'
    with pytest.raises(TemplateError, match="too large|exceeded"):
        render(text)
    with pytest.raises(TemplateError, match="exceeded 10 characters"):
        parse("{{ range 20 }}x{{ end }}").execute({}, max_output=10)


def test_uses_and_identifiers() -> None:
    tmpl = parse(
        "{{ if .System }}{{ .System }}{{ end }}{{ range $i, $m := $.Messages }}{{ $m.Content }}{{ end }}"
        "{{ with (json .Tools) }}{{ . }}{{ end }}"
    )
    for name in ("System", "Messages", "messages", "Content", "Tools"):
        assert tmpl.uses(name), name
    for name in ("Response", "Prompt", "Suffix"):
        assert not tmpl.uses(name), name
    assert not parse('{{/* .Messages */}}{{ ".Messages" }}').uses("Messages")


def test_with_field_appends_an_action() -> None:
    assert parse("{{ .Prompt }} -").with_field("Response").execute({"Prompt": "p", "Response": "r"}) == "p -r"


def test_cut_after_drops_everything_after_the_first_reference() -> None:
    tmpl = parse("{{ if .System }}S:{{ .System }} {{ end }}U:{{ .Prompt }} A:{{ .Response }}<eos>{{ if .X }}x{{ end }}")
    data = {"System": "s", "Prompt": "p", "Response": "", "X": True}
    assert tmpl.execute(data) == "S:s U:p A:<eos>x"
    assert tmpl.cut_after("Response").execute(data) == "S:s U:p A:"
    assert tmpl.cut_after("Response").execute({**data, "Response": "partial"}) == "S:s U:p A:partial"
    # inside a block the rest of the block and everything after it go too; conditions are not searched
    nested = parse(
        "{{ if not .Response }}open{{ end }}[{{ if .Prompt }}{{ .Prompt }}{{ .Response }}x{{ else }}y{{ end }}]tail"
    )
    assert nested.cut_after("Response").execute({"Prompt": "p", "Response": ""}) == "open[p"
    assert parse("no reference").cut_after("Response").execute({}) == "no reference"


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                *"{}-/*. $()|\"`'x:=,01\n\t",
                "{{",
                "}}",
                "{{- ",
                " -}}",
                "if",
                "end",
                "range",
                "with",
                "else",
                ".X",
                "$x",
                "eq",
                "len",
                "index",
                "slice",
                "printf",
            ]
        )
    ).map("".join)
)
def test_parse_raises_only_template_error(text: str) -> None:
    try:
        tmpl = parse(text)
    except TemplateError:
        return
    try:
        tmpl.execute({"x": [1, 2], "e": ""}, max_steps=10_000)
    except TemplateError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_arbitrary_text_parses_or_raises_template_error(text: str) -> None:
    try:
        parse(text)
    except TemplateError:
        pass
