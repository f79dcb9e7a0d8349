"""The values a Modelfile parses to: one frozen dataclass per instruction, and the file itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from modelfile.params import OptionValue, is_deprecated

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Instruction:
    """One instruction; ``line`` and ``column`` (1-based, 0 when built by hand) do not take part in equality."""

    keyword: ClassVar[str] = ""
    line: int = field(default=0, compare=False, repr=False, kw_only=True)
    column: int = field(default=0, compare=False, repr=False, kw_only=True)


@dataclass(frozen=True)
class From(Instruction):
    keyword: ClassVar[str] = "FROM"
    value: str


@dataclass(frozen=True)
class Parameter(Instruction):
    """``PARAMETER name value``; ``value`` is typed (int, float, bool or str; deprecated names keep text)."""

    keyword: ClassVar[str] = "PARAMETER"
    name: str
    value: int | float | bool | str


@dataclass(frozen=True)
class Template(Instruction):
    keyword: ClassVar[str] = "TEMPLATE"
    value: str


@dataclass(frozen=True)
class System(Instruction):
    keyword: ClassVar[str] = "SYSTEM"
    value: str


@dataclass(frozen=True)
class Adapter(Instruction):
    keyword: ClassVar[str] = "ADAPTER"
    value: str


@dataclass(frozen=True)
class License(Instruction):
    keyword: ClassVar[str] = "LICENSE"
    value: str


@dataclass(frozen=True)
class Message(Instruction):
    keyword: ClassVar[str] = "MESSAGE"
    role: str
    content: str


@dataclass(frozen=True)
class Requires(Instruction):
    keyword: ClassVar[str] = "REQUIRES"
    value: str


@dataclass(frozen=True)
class Renderer(Instruction):
    keyword: ClassVar[str] = "RENDERER"
    value: str


@dataclass(frozen=True)
class Parser(Instruction):
    keyword: ClassVar[str] = "PARSER"
    value: str


@dataclass(frozen=True)
class Draft(Instruction):
    keyword: ClassVar[str] = "DRAFT"
    value: str


#: Instruction classes by keyword, in the order error messages list them.
INSTRUCTIONS: dict[str, type[Instruction]] = {
    cls.keyword: cls
    for cls in (From, Parameter, Template, System, Adapter, License, Message, Requires, Renderer, Parser, Draft)
}


@dataclass(frozen=True)
class Modelfile:
    """A parsed Modelfile: its instructions in file order, plus views over them."""

    instructions: tuple[Instruction, ...] = ()

    def _values(self, cls: type[Instruction]) -> tuple[str, ...]:
        return tuple(i.value for i in self.instructions if isinstance(i, cls))  # type: ignore[attr-defined]

    def _last(self, cls: type[Instruction]) -> str | None:
        values = self._values(cls)
        return values[-1] if values else None

    @property
    def froms(self) -> tuple[str, ...]:
        return self._values(From)

    @property
    def adapters(self) -> tuple[str, ...]:
        return self._values(Adapter)

    @property
    def licenses(self) -> tuple[str, ...]:
        return self._values(License)

    @property
    def drafts(self) -> tuple[str, ...]:
        return self._values(Draft)

    @property
    def template(self) -> str | None:
        return self._last(Template)

    @property
    def system(self) -> str | None:
        return self._last(System)

    @property
    def requires(self) -> str | None:
        return self._last(Requires)

    @property
    def renderer(self) -> str | None:
        return self._last(Renderer)

    @property
    def parser(self) -> str | None:
        return self._last(Parser)

    @property
    def messages(self) -> tuple[Message, ...]:
        return tuple(i for i in self.instructions if isinstance(i, Message))

    def create_fields(self) -> dict[str, Any]:
        """What this Modelfile gives an ``/api/create`` body besides its files: template, system, parameters,
        messages, license, requires, renderer and parser, each only when given."""
        body: dict[str, Any] = {}
        if self.template is not None:
            body["template"] = self.template
        if self.system is not None:
            body["system"] = self.system
        if self.parameters:
            body["parameters"] = dict(self.parameters)
        if self.messages:
            body["messages"] = [{"role": m.role, "content": m.content} for m in self.messages]
        if self.licenses:
            body["license"] = list(self.licenses)
        for key, given in (("requires", self.requires), ("renderer", self.renderer), ("parser", self.parser)):
            if given:
                body[key] = given
        return body

    @property
    def parameters(self) -> dict[str, OptionValue]:
        """Typed parameter values: ``stop`` and ``lora_scale`` (one per ADAPTER) collect a list, other names keep
        the last; deprecated ones are left out."""
        out: dict[str, OptionValue] = {}
        stops: list[str] = []
        scales: list[float] = []
        for i in self.instructions:
            if not isinstance(i, Parameter) or is_deprecated(i.name):
                continue
            if i.name == "stop":
                stops.append(str(i.value))
                out["stop"] = stops
            elif i.name == "lora_scale" and isinstance(i.value, (int, float)) and not isinstance(i.value, bool):
                scales.append(float(i.value))
                out["lora_scale"] = scales
            else:
                out[i.name] = i.value
        return out

    @property
    def deprecated_parameters(self) -> tuple[str, ...]:
        """Names of deprecated parameters the file sets (once each, in order), so callers can warn."""
        names = (i.name for i in self.instructions if isinstance(i, Parameter) and is_deprecated(i.name))
        return tuple(dict.fromkeys(names))
