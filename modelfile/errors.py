"""The two errors of the modelfile package."""

from __future__ import annotations

from errors import InvalidRequest


class ModelfileError(InvalidRequest):
    """A Modelfile cannot be parsed or rendered; ``str()`` is ``file:line:column: detail``."""

    def __init__(self, filename: str, line: int, column: int, detail: str) -> None:
        super().__init__(f"{filename}:{line}:{column}: {detail}")
        self.filename = filename
        self.line = line
        self.column = column
        self.detail = detail

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.filename, self.line, self.column, self.detail))


class ParameterError(InvalidRequest):
    """A parameter or option has an unknown name or a value of the wrong type."""

    def __init__(self, name: str, message: str, *, unknown: bool = False) -> None:
        super().__init__(message)
        self.name = name
        self.unknown = unknown

    def __reduce__(self) -> tuple[object, ...]:
        return (_make_parameter_error, (self.name, self.message, self.unknown))


def _make_parameter_error(name: str, message: str, unknown: bool) -> ParameterError:
    return ParameterError(name, message, unknown=unknown)
