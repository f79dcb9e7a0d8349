"""Model names: Ollama's grammar, defaults and limits, as a validated value type.

    [scheme "://"] host "/" namespace "/" model [":" tag]

Missing parts take the defaults ``registry.ollama.ai`` / ``library`` / ``latest``. A name that parses is safe to
turn into a path: every part is drawn from a small alphabet that cannot contain a separator or ``..``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from errors import InvalidModelName

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
DEFAULT_SCHEME = "https"

_PARTS = {
    # part: (pattern, max length)
    "host": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*"), 350),
    "namespace": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*"), 80),
    "model": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), 80),
    "tag": (re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*"), 80),
}


def _check(part: str, value: str, raw: str) -> None:
    pattern, limit = _PARTS[part]
    if not value:
        raise InvalidModelName(raw)
    if len(value) > limit or not pattern.fullmatch(value):
        raise InvalidModelName(raw)
    if part == "host" and (".." in value):
        raise InvalidModelName(raw)
    if value in (".", ".."):
        raise InvalidModelName(raw)


@dataclass(frozen=True)
class ModelName:
    host: str
    namespace: str
    model: str
    tag: str
    scheme: str = DEFAULT_SCHEME

    @classmethod
    def parse(cls, raw: str) -> ModelName:
        """Parse and validate ``raw``; raises :class:`InvalidModelName` (``invalid model name``)."""
        if not isinstance(raw, str) or not raw or len(raw) > 600:
            raise InvalidModelName(str(raw))
        scheme = DEFAULT_SCHEME
        rest = raw
        if "://" in rest:
            scheme, rest = rest.split("://", 1)
            if scheme not in ("http", "https"):
                raise InvalidModelName(raw)
        tag = DEFAULT_TAG
        colon, slash = rest.rfind(":"), rest.rfind("/")
        if colon > slash:
            rest, tag = rest[:colon], rest[colon + 1 :]
            if not tag:
                raise InvalidModelName(raw)
        parts = rest.split("/")
        if len(parts) == 1:
            host, namespace, model = DEFAULT_HOST, DEFAULT_NAMESPACE, parts[0]
        elif len(parts) == 2:
            host, (namespace, model) = DEFAULT_HOST, parts
        elif len(parts) == 3:
            host, namespace, model = parts
        else:
            raise InvalidModelName(raw)
        for part, value in (("host", host), ("namespace", namespace), ("model", model), ("tag", tag)):
            _check(part, value, raw)
        return cls(host=host, namespace=namespace, model=model, tag=tag, scheme=scheme)

    @classmethod
    def is_valid(cls, raw: str) -> bool:
        try:
            cls.parse(raw)
        except InvalidModelName:
            return False
        return True

    def parts(self) -> tuple[str, str, str, str]:
        return (self.host, self.namespace, self.model, self.tag)

    def key(self) -> tuple[str, str, str, str]:
        """Case-insensitive identity: two names with equal keys are the same model."""
        return tuple(p.lower() for p in self.parts())  # type: ignore[return-value]

    def same_model(self, other: ModelName) -> bool:
        return self.key() == other.key()

    def __str__(self) -> str:
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    def full(self) -> str:
        return str(self)

    def short(self) -> str:
        """Ollama's DisplayShortest: defaults left out (case-insensitively), the tag always shown."""
        if self.host.lower() != DEFAULT_HOST:
            return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"
        if self.namespace.lower() != DEFAULT_NAMESPACE:
            return f"{self.namespace}/{self.model}:{self.tag}"
        return f"{self.model}:{self.tag}"

    def repository(self) -> str:
        return f"{self.namespace}/{self.model}"

    def with_parts(self, parts: tuple[str, str, str, str]) -> ModelName:
        host, namespace, model, tag = parts
        return ModelName(host=host, namespace=namespace, model=model, tag=tag, scheme=self.scheme)
