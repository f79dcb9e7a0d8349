"""The output parsers, one module per family, registered under the names a Modelfile's ``PARSER`` gives.

``parser_for(name)`` makes a fresh parser (or None for an unknown name); ``names()`` lists them. A module registers
its classes with ``@register("name", ...)``; the modules are imported here, so adding a family is one file plus
one entry in ``_MODULES``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from daemon.chat.parsers.base import Parser

P = TypeVar("P")
_REGISTRY: dict[str, Callable[[], Parser]] = {}


def register(*names: str, **kwargs: object) -> Callable[[P], P]:
    """Register a parser class under ``names``; ``kwargs`` are passed to its constructor."""

    def deco(cls: P) -> P:
        for name in names:
            if name in _REGISTRY:
                raise ValueError(f"parser {name!r} registered twice")
            _REGISTRY[name] = lambda cls=cls: cls(**kwargs)  # type: ignore[misc]
        return cls

    return deco


def parser_for(name: str) -> Parser | None:
    """A fresh parser for ``name`` (a Modelfile's PARSER), or None when corral has none of that name."""
    make = _REGISTRY.get(name)
    return make() if make else None


def names() -> list[str]:
    return sorted(_REGISTRY)


_MODULES = (
    "passthrough",
    "deepseek",
    "cogito",
    "tools",
    "qwen3",
    "qwen3_coder",
    "harmony",
    "ministral",
    "glm",
    "gemma",
)
for _m in _MODULES:
    importlib.import_module(f"daemon.chat.parsers.{_m}")
