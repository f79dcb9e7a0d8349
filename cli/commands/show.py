"""``corral show NAME``: one field raw (with a flag), or the model's summary as indented tables."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from cli import output
from cli.commands.common import client_from_env
from errors import InvalidRequest

# flag -> (response field, what to print when the model has none)
FIELDS: dict[str, tuple[str, str]] = {
    "license": ("license", "No license was specified for this model."),
    "modelfile": ("modelfile", ""),
    "parameters": ("parameters", "No parameters were specified for this model."),
    "system": ("system", "No system message was specified for this model."),
    "template": ("template", "No prompt template was specified for this model."),
}
ARRAY_KEEP = 3


def show(
    name: Annotated[str, typer.Argument(metavar="NAME", help="Model to describe.")],
    license: Annotated[bool, typer.Option("--license", help="Print the license.")] = False,
    modelfile: Annotated[bool, typer.Option("--modelfile", help="Print a Modelfile that recreates it.")] = False,
    parameters: Annotated[bool, typer.Option("--parameters", help="Print its parameters.")] = False,
    system: Annotated[bool, typer.Option("--system", help="Print its system message.")] = False,
    template: Annotated[bool, typer.Option("--template", help="Print its prompt template.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also show metadata and tensors.")] = False,
) -> None:
    """Show information about a model."""
    chosen = [
        flag
        for flag, on in (
            ("license", license),
            ("modelfile", modelfile),
            ("parameters", parameters),
            ("system", system),
            ("template", template),
        )
        if on
    ]
    if len(chosen) > 1:
        raise InvalidRequest(
            "only one of '--license', '--modelfile', '--parameters', '--system', or '--template' can be specified"
        )
    with client_from_env() as client:
        info = client.show(name, verbose=verbose)
    if chosen:
        field, missing = FIELDS[chosen[0]]
        value = info.get(field)
        output.out(str(value) if value else missing)
        return
    for line in summary(info, verbose):
        output.out(line)


def _two_lines(text: str) -> list[list[str]]:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return [[ln] for ln in lines[:2]] + ([["..."]] if len(lines) > 2 else [])


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        head = " ".join(_value(x) for x in v[:ARRAY_KEEP])
        return f"[{head} ...+{len(v) - ARRAY_KEEP} more]" if len(v) > ARRAY_KEEP else f"[{head}]"
    return str(v)


def model_rows(info: dict[str, Any]) -> list[list[str]]:
    mi = info.get("model_info") or {}
    details = info.get("details") or {}
    arch = str(mi.get("general.architecture") or details.get("family") or "")
    params = details.get("parameter_size") or ""
    if not params and isinstance(mi.get("general.parameter_count"), int):
        params = output.format_count(mi["general.parameter_count"])
    candidates = [
        ("architecture", arch),
        ("parameters", params),
        ("context length", mi.get(f"{arch}.context_length", "")),
        ("embedding length", mi.get(f"{arch}.embedding_length", "")),
        ("quantization", details.get("quantization_level") or ""),
        ("requires", info.get("requires") or ""),
    ]
    return [[k, _value(v)] for k, v in candidates if v not in ("", None)]


def projector_rows(projector: dict[str, Any]) -> list[list[str]]:
    """The Projector section, as Ollama's CLI prints it: architecture, parameters, and the encoder's embedding
    length and projection size (``<arch>.vision.*``, else ``<arch>.audio.*`` for an audio projector)."""
    arch = str(projector.get("general.architecture") or "")

    def encoder(suffix: str) -> Any:
        for modality in ("vision", "audio"):
            value = projector.get(f"{arch}.{modality}.{suffix}")
            if isinstance(value, int | float) and not isinstance(value, bool):
                return value
        return None

    count = projector.get("general.parameter_count")
    candidates = [
        ("architecture", arch),
        ("parameters", output.format_count(count) if isinstance(count, int) and not isinstance(count, bool) else ""),
        ("embedding length", encoder("embedding_length")),
        ("dimensions", encoder("projection_dim")),
    ]
    return [[k, _value(v)] for k, v in candidates if v not in ("", None)]


def summary(info: dict[str, Any], verbose: bool = False) -> list[str]:
    """The sections of ``corral show`` without flags."""
    sections: list[tuple[str, list[list[str]]]] = [("Model", model_rows(info))]
    sections.append(("Capabilities", [[str(c)] for c in info.get("capabilities") or []]))
    projector = info.get("projector_info") or {}
    if projector:
        sections.append(("Projector", projector_rows(projector)))
    params = str(info.get("parameters") or "")
    sections.append(("Parameters", [[f[0], " ".join(f[1:])] for f in (ln.split() for ln in params.splitlines()) if f]))
    if info.get("system"):
        sections.append(("System", _two_lines(str(info["system"]))))
    if info.get("license"):
        sections.append(("License", _two_lines(str(info["license"]))))
    if verbose:
        mi = info.get("model_info") or {}
        sections.append(("Metadata", [[k, _value(mi[k])] for k in sorted(mi)]))
        sections.append(
            (
                "Tensors",
                [
                    [
                        str(t.get("name", "")),
                        str(t.get("type", "")),
                        "[" + " ".join(map(str, t.get("shape") or [])) + "]",
                    ]
                    for t in info.get("tensors") or []
                ],
            )
        )
    lines: list[str] = []
    for title, rows in sections:
        if not rows:
            continue
        lines.append(f"  {title}")
        lines += output.table(rows, indent="    ")
        lines.append("")
    return lines
