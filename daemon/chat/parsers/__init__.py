"""The output parsers, one module per family, registered under the names a Modelfile's ``PARSER`` gives.

``parser_for(name)`` makes a fresh parser (or None for an unknown name); ``names()`` lists them. A family module
registers its classes with ``@register("name", ...)`` from :mod:`daemon.chat.parsers.base`, and is imported below,
so adding a family is one file plus one import line."""

from __future__ import annotations

from daemon.chat.parsers import (  # noqa: F401 - imported to register their parsers
    cogito,
    deepseek,
    gemma,
    glm,
    harmony,
    ministral,
    passthrough,
    qwen3,
    qwen3_coder,
    tools,
)
from daemon.chat.parsers.base import PARSERS, Parser


def parser_for(name: str) -> Parser | None:
    """A fresh parser for ``name`` (a Modelfile's PARSER), or None when corral has none of that name."""
    return PARSERS.make(name)


def names() -> list[str]:
    return PARSERS.names()
