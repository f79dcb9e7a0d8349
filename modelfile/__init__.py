"""Modelfile parsing and rendering: pure, text in and values out.

``parse(text) -> Modelfile`` and ``render(Modelfile) -> str`` with ``parse(render(m)) == m``. Resolving FROM
paths and hashing files belong to the caller.
"""

from __future__ import annotations

from modelfile.ast import (
    ROLES,
    Adapter,
    Draft,
    From,
    Instruction,
    License,
    Message,
    Modelfile,
    Parameter,
    Parser,
    Renderer,
    Requires,
    System,
    Template,
)
from modelfile.errors import ModelfileError, ParameterError
from modelfile.params import (
    DEFAULT_OPTIONS,
    DEPRECATED_OPTIONS,
    OPTION_TYPES,
    OptionValue,
    coerce_parameter,
    validate_options,
)
from modelfile.parser import parse
from modelfile.render import render

__all__ = [
    "DEFAULT_OPTIONS",
    "DEPRECATED_OPTIONS",
    "OPTION_TYPES",
    "ROLES",
    "Adapter",
    "Draft",
    "From",
    "Instruction",
    "License",
    "Message",
    "Modelfile",
    "ModelfileError",
    "OptionValue",
    "Parameter",
    "ParameterError",
    "Parser",
    "Renderer",
    "Requires",
    "System",
    "Template",
    "coerce_parameter",
    "parse",
    "render",
    "validate_options",
]
