"""The renderers, one module per family, registered under the names a Modelfile's ``RENDERER`` gives.

``renderer_for(name)`` returns one (or None for an unknown name); ``names()`` lists them. Adding a family is one
file plus one entry in ``_MODULES``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TypeVar

from daemon.chat.renderers.base import Renderer

R = TypeVar("R")
_REGISTRY: dict[str, Callable[[], Renderer]] = {}


def register(*names: str, **kwargs: object) -> Callable[[R], R]:
    """Register a renderer class under ``names``; ``kwargs`` are passed to its constructor."""

    def deco(cls: R) -> R:
        for name in names:
            if name in _REGISTRY:
                raise ValueError(f"renderer {name!r} registered twice")
            _REGISTRY[name] = lambda cls=cls: cls(**kwargs)  # type: ignore[misc]
        return cls

    return deco


def renderer_for(name: str) -> Renderer | None:
    make = _REGISTRY.get(name)
    return make() if make else None


def names() -> list[str]:
    return sorted(_REGISTRY)


_MODULES: tuple[str, ...] = ("qwen3_coder", "qwen3", "deepseek", "glm", "gemma", "harmony")
for _m in _MODULES:
    importlib.import_module(f"daemon.chat.renderers.{_m}")
