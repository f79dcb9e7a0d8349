"""A table of named families, one for the output parsers and one for the renderers: a family module registers its
classes under the names a Modelfile's ``PARSER``/``RENDERER`` gives, and the package's ``__init__`` imports the
family modules by plain imports. The family modules import only their package's ``base`` (where the table lives),
never the package itself, so the registration is no import cycle (issue 26: it was one, hidden by ``importlib``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar, cast

T = TypeVar("T")
C = TypeVar("C", bound=Callable[..., object])


class Registry(Generic[T]):
    """Names → factories of ``T`` (a fresh value per lookup: parsers keep per-generation state)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[[], T]] = {}

    def register(self, *names: str, **kwargs: object) -> Callable[[C], C]:
        """A class decorator: register the class under ``names``; ``kwargs`` are passed to its constructor."""

        def deco(cls: C) -> C:
            for name in names:
                if name in self._factories:
                    raise ValueError(f"{self.kind} {name!r} registered twice")
                self._factories[name] = cast(Callable[[], T], lambda: cls(**kwargs))
            return cls

        return deco

    def make(self, name: str) -> T | None:
        """A fresh value for ``name``, or None when none is registered under it."""
        factory = self._factories.get(name)
        return factory() if factory is not None else None

    def names(self) -> list[str]:
        return sorted(self._factories)
