""":class:`Modelfile` back to text, such that ``parse(render(m)) == m``."""

from __future__ import annotations

from modelfile.ast import From, Instruction, Message, Modelfile, Parameter
from modelfile.errors import ModelfileError, ParameterError
from modelfile.params import OPTION_TYPES, coerce_parameter, format_parameter, is_deprecated
from modelfile.parser import check_role, check_value, read_value, split_lines


def render(m: Modelfile, filename: str = "Modelfile") -> str:
    """The Modelfile text for ``m``; raises :class:`ModelfileError` for values no Modelfile can hold."""
    out: list[str] = []
    line = 1
    for ins in m.instructions:
        try:
            text = _instruction(ins)
        except ValueError as exc:
            raise ModelfileError(filename, line, 1, str(exc)) from None
        out.append(text)
        line += len(split_lines(text))
    if not any(isinstance(ins, From) for ins in m.instructions):
        raise ModelfileError(
            filename, 1, 1, "no FROM line: a Modelfile needs a FROM line naming a model or a GGUF file"
        )
    return "".join(t + "\n" for t in out)


def quote(value: str) -> str | None:
    """``value`` as a Modelfile argument: bare when it reads back as itself, else ``"…"`` or ``\"\"\"…\"\"\"``."""
    candidates = ['"""' + value + '"""', '"' + value + '"']
    if '"' not in value:
        candidates.reverse()
    if value and value[0] not in ' \t"':
        candidates.insert(0, value)
    for text in candidates:
        lines = split_lines(text)
        try:
            back, nxt = read_value(lines, 0, 0, "")
        except ModelfileError:
            continue
        if back == value and nxt == len(lines):
            return text
    return None


def _instruction(ins: Instruction) -> str:
    if isinstance(ins, Parameter):
        head, value = f"PARAMETER {ins.name}", _parameter_text(ins)
    elif isinstance(ins, Message):
        problem = check_role(ins.role)
        if problem:
            raise ValueError(problem)
        head, value = f"MESSAGE {ins.role}", ins.content
    else:
        raw = getattr(ins, "value", None)
        if not ins.keyword or not isinstance(raw, str):
            raise ValueError(f"cannot render {ins!r}")
        value = raw
        problem = check_value(ins.keyword, value)
        if problem:
            raise ValueError(problem)
        head = ins.keyword
    text = quote(value)
    if text is None:
        raise ValueError(f"{head} value cannot be written in a Modelfile: {_why(value)}")
    return f"{head} {text}"


def _parameter_text(ins: Parameter) -> str:
    value = ins.value
    if OPTION_TYPES.get(ins.name) is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    raw = format_parameter(value)
    if is_deprecated(ins.name):
        return raw
    try:
        back = coerce_parameter(ins.name, raw)
    except ParameterError as exc:
        raise ValueError(exc.message) from None
    if back != value or isinstance(back, bool) != isinstance(value, bool):
        raise ValueError(f'parameter "{ins.name}" cannot hold {value!r}')
    return raw


def _why(value: str) -> str:
    if '"""' in value:
        return 'it spans lines, contains """ and has a line ending in a quote, so no quoting reads it back'
    return "it contains characters a Modelfile drops (control or format characters)"
