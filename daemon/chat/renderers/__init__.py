"""The renderers, one module per family, registered under the names a Modelfile's ``RENDERER`` gives.

``renderer_for(name)`` returns one (or None for an unknown name); ``names()`` lists them. A family module registers
its classes with ``@register("name", ...)`` from :mod:`daemon.chat.renderers.base`, and is imported below, so adding
a family is one file plus one import line."""

from __future__ import annotations

from daemon.chat.renderers import (  # noqa: F401 - imported to register their renderers
    deepseek,
    gemma,
    glm,
    harmony,
    qwen3,
    qwen3_coder,
)
from daemon.chat.renderers.base import RENDERERS, Renderer


def renderer_for(name: str) -> Renderer | None:
    return RENDERERS.make(name)


def names() -> list[str]:
    return RENDERERS.names()
