"""Table-driven parser tests: Ollama's cases (reference §3), errors with line and column, and render round-trips."""

from __future__ import annotations

import pickle

import pytest

from errors import InvalidRequest
from modelfile import (
    Adapter,
    Draft,
    From,
    License,
    Message,
    Modelfile,
    ModelfileError,
    Parameter,
    Parser,
    Renderer,
    Requires,
    System,
    Template,
    parse,
    render,
)

F = From("x")

VALID: list[tuple[str, str | bytes, tuple[object, ...]]] = [
    ("inner spaces kept, ends trimmed", "FROM     FOOO BAR    ", (From("FOOO BAR"),)),
    ("tab separator", "FROM\tllama3\t", (From("llama3"),)),
    ("leading blanks before keyword", "   \t FROM llama3", (From("llama3"),)),
    ("case-insensitive keywords", "from a\nFrOm b\nsystem hi", (From("a"), From("b"), System("hi"))),
    ("comments and blank lines", "# top\n\n   # indented comment\nFROM x\n\n# end", (F,)),
    ("hash inside argument is text", "FROM x\nSYSTEM you are #1 # really", (F, System("you are #1 # really"))),
    ("hash-first argument is text", "FROM x\nSYSTEM #1", (F, System("#1"))),
    (
        "all instructions",
        "FROM llama3\nADAPTER ./lora.gguf\nLICENSE MIT\nREQUIRES 0.6.2\nRENDERER qwen3\nPARSER qwen3\nDRAFT ./d.gguf",
        (
            From("llama3"),
            Adapter("./lora.gguf"),
            License("MIT"),
            Requires("0.6.2"),
            Renderer("qwen3"),
            Parser("qwen3"),
            Draft("./d.gguf"),
        ),
    ),
    ("requires with v", "FROM x\nREQUIRES v0.12.1-rc1", (F, Requires("v0.12.1-rc1"))),
    ("parameter before FROM", "PARAMETER seed 42\nFROM x", (Parameter("seed", 42), F)),
    ("quoted single line", 'FROM x\nSYSTEM "You are Mario."', (F, System("You are Mario."))),
    ("quoted multi-line", 'FROM x\nSYSTEM "line one\nline two"', (F, System("line one\nline two"))),
    (
        "triple quoted multi-line template",
        'FROM x\nTEMPLATE """{{ if .System }}<|system|>\n{{ .System }}\n{{ end }}<|user|>{{ .Prompt }}"""',
        (F, Template("{{ if .System }}<|system|>\n{{ .System }}\n{{ end }}<|user|>{{ .Prompt }}")),
    ),
    ("triple quotes on their own lines", 'FROM x\nTEMPLATE """\n  indented\n"""\n', (F, Template("\n  indented\n"))),
    ("inner quotes in triple", 'FROM x\nSYSTEM """a "b" c"""', (F, System('a "b" c'))),
    ("whitespace inside quotes kept", 'FROM x\nLICENSE "MIT       "', (F, License("MIT       "))),
    ("blanks after closing quote", 'FROM x\nSYSTEM "  hi  "   \t', (F, System("  hi  "))),
    ("empty quoted", 'FROM x\nSYSTEM ""\nTEMPLATE """"""', (F, System(""), Template(""))),
    ("single quotes are text", "FROM x\nSYSTEM 'hi'", (F, System("'hi'"))),
    ("triple quote needs six characters", 'FROM x\nSYSTEM """"\n"""', (F, System('"\n'))),
    ("closing quote ends at line end only", 'FROM x\nSYSTEM "a" b"', (F, System('a" b'))),
    ("crlf file", 'FROM x\r\nSYSTEM """a\r\nb"""\r\nLICENSE MIT\r\n', (F, System("a\r\nb"), License("MIT"))),
    ("lone cr newlines", "FROM x\rSYSTEM hi\r", (F, System("hi"))),
    ("non-printables dropped", "FROM x\x00y\nSYSTEM a\x07b\u200b", (From("xy"), System("ab"))),
    ("utf-8 multibyte", "FROM x\nSYSTEM 日本語 😀 ünïcödé", (F, System("日本語 😀 ünïcödé"))),
    ("utf-8 bom str", "\ufeffFROM x", (F,)),
    ("utf-8 bom bytes", "\ufeffFROM x\nSYSTEM é".encode(), (F, System("é"))),
    ("utf-8 bytes", "FROM x\nSYSTEM 日本".encode(), (F, System("日本"))),
    ("utf-16 le bom", "\ufeffFROM x\nSYSTEM 日本 😀".encode("utf-16-le"), (F, System("日本 😀"))),
    ("utf-16 be bom", "\ufeffFROM x\nSYSTEM 日本 😀".encode("utf-16-be"), (F, System("日本 😀"))),
    ("parameter int", "FROM x\nPARAMETER num_ctx 4096", (F, Parameter("num_ctx", 4096))),
    ("parameter negative int", "FROM x\nPARAMETER seed -1", (F, Parameter("seed", -1))),
    ("parameter float", "FROM x\nPARAMETER temperature 0.7", (F, Parameter("temperature", 0.7))),
    ("parameter float from int text", "FROM x\nPARAMETER top_p 1", (F, Parameter("top_p", 1.0))),
    ("parameter float exponent", "FROM x\nPARAMETER min_p 5e-2", (F, Parameter("min_p", 0.05))),
    (
        "parameter bool",
        "FROM x\nPARAMETER use_mmap false\nPARAMETER use_mmap T",
        (F, Parameter("use_mmap", False), Parameter("use_mmap", True)),
    ),
    ("parameter quoted value", 'FROM x\nPARAMETER temperature "0.5"', (F, Parameter("temperature", 0.5))),
    (
        "parameter stop",
        'FROM x\nPARAMETER stop <|eot_id|>\nPARAMETER stop "<|end|>"\nPARAMETER stop "\n"',
        (F, Parameter("stop", "<|eot_id|>"), Parameter("stop", "<|end|>"), Parameter("stop", "\n")),
    ),
    ("parameter stop with spaces", "FROM x\nPARAMETER stop  User:  x ", (F, Parameter("stop", "User:  x"))),
    ("deprecated parameter kept as text", "FROM x\nPARAMETER mirostat 2", (F, Parameter("mirostat", "2"))),
    (
        "message roles",
        "FROM x\nMESSAGE system be brief\nMESSAGE user hi there\nMESSAGE assistant hello",
        (F, Message("system", "be brief"), Message("user", "hi there"), Message("assistant", "hello")),
    ),
    ("message quoted multi-line", 'FROM x\nMESSAGE user """a\nb"""', (F, Message("user", "a\nb"))),
    ("message empty quoted", 'FROM x\nMESSAGE assistant ""', (F, Message("assistant", ""))),
]

ERRORS: list[tuple[str, str | bytes, int, int, str]] = [
    ("unknown instruction", "FROM x\n\nFORM y", 3, 1, 'unknown instruction "FORM" (did you mean FROM?)'),
    (
        "unknown instruction no suggestion",
        "FROM x\n  XYZZY y",
        2,
        3,
        'unknown instruction "XYZZY": expected one of FROM',
    ),
    ("not a keyword", "FROM x\n{{ .Prompt }}", 2, 1, 'unknown instruction "{{"'),
    ("keyword glued to text", "FROM x\nSYSTEM:hi", 2, 7, 'expected a space after SYSTEM, got ":"'),
    ("non-ascii keyword", "FROM x\nſYSTEM hi", 2, 1, "unknown instruction"),
    ("missing argument", "FROM x\nSYSTEM\nLICENSE MIT", 2, 1, "SYSTEM needs an argument"),
    ("missing argument blanks", "FROM   \t", 1, 1, "FROM needs an argument: a model name or a path"),
    ("missing argument at eof", "FROM x\n  ADAPTER", 2, 3, "ADAPTER needs an argument"),
    ("blank FROM", 'FROM "  "', 1, 6, "FROM needs a model name or a path to a GGUF file"),
    (
        "unterminated triple",
        'FROM x\nTEMPLATE   """abc\ndef\n',
        2,
        12,
        'unterminated """ string starting at line 2, column 12',
    ),
    (
        "unterminated single",
        'FROM x\nSYSTEM "hello" world\n\nLICENSE MIT',
        2,
        8,
        'unterminated " string starting at line 2, column 8',
    ),
    ("unterminated short triple", 'FROM x\nSYSTEM """"', 2, 8, 'unterminated """ string'),
    ("unterminated lone quote", 'FROM x\nSYSTEM "', 2, 8, 'unterminated " string'),
    ("missing FROM", "SYSTEM hi\nPARAMETER seed 1\n", 1, 1, "no FROM line: a Modelfile needs a FROM line"),
    ("empty file", "", 1, 1, "no FROM line"),
    ("only comments", "# FROM x\n", 1, 1, "no FROM line"),
    (
        "bad role",
        "FROM x\nMESSAGE bot hi",
        2,
        9,
        'message role must be one of "system", "user", or "assistant", got "bot"',
    ),
    ("role is case-sensitive", "FROM x\nMESSAGE User hi", 2, 9, 'got "User"'),
    ("empty message text", "FROM x\nMESSAGE user   ", 2, 9, "MESSAGE user needs the message text"),
    ("unknown parameter", "FROM x\nPARAMETER numa true", 2, 11, 'unknown parameter "numa"'),
    (
        "unknown parameter suggestion",
        "FROM x\nPARAMETER temprature 1",
        2,
        11,
        'unknown parameter "temprature" (did you mean "temperature"?)',
    ),
    ("parameter name is case-sensitive", "FROM x\nPARAMETER Temperature 1", 2, 11, '(did you mean "temperature"?)'),
    ("parameter without value", "FROM x\nPARAMETER top_k   ", 2, 11, 'parameter "top_k" needs a value'),
    ("float value", "FROM x\nPARAMETER temperature hot", 2, 23, 'parameter "temperature" needs a float, got "hot"'),
    ("int value", "FROM x\n\tPARAMETER num_ctx 4k", 2, 20, 'parameter "num_ctx" needs an integer, got "4k"'),
    ("int value rejects float", "FROM x\nPARAMETER top_k 1.5", 2, 17, "needs an integer"),
    ("bool value", "FROM x\nPARAMETER use_mmap yes", 2, 20, 'parameter "use_mmap" needs a boolean'),
    (
        "deprecated mirostat checked",
        "FROM x\nPARAMETER mirostat 7",
        2,
        20,
        'parameter "mirostat" must be 0 (off), 1 or 2',
    ),
    (
        "deprecated mirostat_tau NaN",
        "FROM x\nPARAMETER mirostat_tau NaN",
        2,
        24,
        'parameter "mirostat_tau" must be a finite number above 0, got "NaN"',
    ),
    ("error line in crlf file", "FROM x\r\n\r\nFORM y\r\n", 3, 1, "unknown instruction"),
    ("column counts dropped characters", "FROM x\n\x00\x00FORM y", 2, 3, "unknown instruction"),
    ("bad requires", "FROM x\nREQUIRES latest", 2, 10, "REQUIRES needs a version"),
    ("invalid utf-8", b"FROM x\nSYSTEM ab\xff", 2, 10, "not valid UTF-8"),
    ("truncated utf-16", b"\xff\xfeF\x00R\x00O", 1, 3, "not valid UTF-16"),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in VALID], ids=[c[0] for c in VALID])
def test_parse(text: str | bytes, expected: tuple[object, ...]) -> None:
    assert parse(text).instructions == expected


@pytest.mark.parametrize("text", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_round_trip(text: str | bytes) -> None:
    m = parse(text)
    assert parse(render(m)) == m


@pytest.mark.parametrize(("text", "line", "column", "detail"), [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_errors(text: str | bytes, line: int, column: int, detail: str) -> None:
    with pytest.raises(ModelfileError) as info:
        parse(text, filename="My.modelfile")
    err = info.value
    assert (err.line, err.column) == (line, column), str(err)
    assert detail in err.detail
    assert str(err) == f"My.modelfile:{line}:{column}: {err.detail}"
    assert isinstance(err, InvalidRequest)


def test_error_message_format() -> None:
    with pytest.raises(ModelfileError) as info:
        parse("FROM x\n\nFORM y\n")
    assert str(info.value) == 'Modelfile:3:1: unknown instruction "FORM" (did you mean FROM?)'
    assert info.value.filename == "Modelfile"
    again = pickle.loads(pickle.dumps(info.value))
    assert str(again) == str(info.value) and again.line == 3


def test_positions_are_recorded_but_not_compared() -> None:
    m = parse('FROM x\n\n  SYSTEM """a\nb"""\nPARAMETER seed 3\n')
    assert [(i.line, i.column) for i in m.instructions] == [(1, 1), (3, 3), (5, 1)]
    assert m.instructions[1] == System("a\nb")
    assert hash(m.instructions[1]) == hash(System("a\nb", line=9, column=9))


def test_convenience_views() -> None:
    m = parse(
        "FROM a\nFROM b\nADAPTER l1\nTEMPLATE t1\nTEMPLATE t2\nSYSTEM s1\nSYSTEM s2\nLICENSE one\nLICENSE two\n"
        "PARAMETER stop x\nPARAMETER temperature 0.1\nPARAMETER stop y\nPARAMETER temperature 0.2\n"
        "PARAMETER mirostat 1\nPARAMETER use_mlock true\nPARAMETER mirostat 2\n"
        "MESSAGE user hi\nMESSAGE assistant yo\nREQUIRES 0.7\nRENDERER r\nPARSER p\nDRAFT d\n"
    )
    assert m.froms == ("a", "b")
    assert m.adapters == ("l1",)
    assert (m.template, m.system) == ("t2", "s2")
    assert m.licenses == ("one", "two")
    assert m.parameters == {"stop": ["x", "y"], "temperature": 0.2}
    assert m.deprecated_parameters == ("mirostat", "use_mlock")
    assert m.messages == (Message("user", "hi"), Message("assistant", "yo"))
    assert (m.requires, m.renderer, m.parser, m.drafts) == ("0.7", "r", "p", ("d",))
    empty = Modelfile((From("x"),))
    assert (empty.template, empty.system, empty.requires, empty.parameters) == (None, None, None, {})


RENDERED = [
    (
        "bare values",
        (From("llama3"), System("hi there"), Parameter("temperature", 0.7), Parameter("use_mmap", True)),
        "FROM llama3\nSYSTEM hi there\nPARAMETER temperature 0.7\nPARAMETER use_mmap true\n",
    ),
    ("multi-line without quotes uses single quotes", (F, Template("a\nb")), 'FROM x\nTEMPLATE "a\nb"\n'),
    ("multi-line with quotes uses triple", (F, Template('a "b"\nc')), 'FROM x\nTEMPLATE """a "b"\nc"""\n'),
    ("surrounding blanks are quoted", (F, License(" MIT\t")), 'FROM x\nLICENSE " MIT\t"\n'),
    ("empty", (F, System("")), 'FROM x\nSYSTEM ""\n'),
    ("leading quote", (F, System('"hi" she said')), 'FROM x\nSYSTEM """"hi" she said"""\n'),
    ("message", (F, Message("user", "hi")), "FROM x\nMESSAGE user hi\n"),
    (
        "stop list, one line each",
        (F, Parameter("stop", "<a>"), Parameter("stop", " ")),
        'FROM x\nPARAMETER stop <a>\nPARAMETER stop " "\n',
    ),
    ("hash", (F, System("# not a comment")), "FROM x\nSYSTEM # not a comment\n"),
]


@pytest.mark.parametrize(("instructions", "text"), [c[1:] for c in RENDERED], ids=[c[0] for c in RENDERED])
def test_render(instructions: tuple[object, ...], text: str) -> None:
    m = Modelfile(instructions)  # type: ignore[arg-type]
    assert render(m) == text
    assert parse(text) == m


def test_render_triple_quotes_inside_single_line() -> None:
    m = Modelfile((F, System('say """hi"""')))
    assert parse(render(m)) == m


def test_render_normalises_json_numbers() -> None:
    m = Modelfile((F, Parameter("num_ctx", 4096.0), Parameter("temperature", 1)))
    assert render(m) == "FROM x\nPARAMETER num_ctx 4096\nPARAMETER temperature 1\n"
    assert parse(render(m)) == m


@pytest.mark.parametrize(
    ("instructions", "line", "detail"),
    [
        ((System("x"),), 1, "no FROM line"),
        ((F, System('a"""\nb')), 2, 'SYSTEM value cannot be written in a Modelfile: it spans lines, contains """'),
        ((F, System("a\x00b")), 2, "characters a Modelfile drops"),
        ((F, Parameter("temperature", "hot")), 2, 'parameter "temperature" needs a float'),
        ((F, Parameter("num_ctx", True)), 2, 'parameter "num_ctx" needs an integer'),
        ((F, Parameter("use_mmap", 1)), 2, 'parameter "use_mmap" cannot hold 1'),
        ((F, Parameter("numa", 1)), 2, 'unknown parameter "numa"'),
        ((F, Message("bot", "x")), 2, "message role must be one of"),
        ((From(" "),), 1, "FROM needs a model name"),
        ((F, Template("a\nb"), Requires("x")), 4, "REQUIRES needs a version"),
    ],
)
def test_render_errors(instructions: tuple[object, ...], line: int, detail: str) -> None:
    with pytest.raises(ModelfileError) as info:
        render(Modelfile(instructions))  # type: ignore[arg-type]
    assert info.value.line == line
    assert detail in info.value.detail
