"""A request's LoRA adapters (issue 29): the model's ADAPTERs with their default scales, and llama-server's
per-request override, turned into ``GenerateRequest.adapters`` ((adapter blob path, scale) pairs). Pure: no I/O.

Where the values come from:

- the model's adapters: its ADAPTER layers, in ADAPTER order (``ModelContext.adapters``, blob paths); an adapter's
  index in that order is its ``id``, as llama-server numbers its ``--lora`` adapters;
- their default scales: ``PARAMETER lora_scale`` (one line per ADAPTER, in ADAPTER order; adapters past the last
  line take 1.0, as ``--lora`` does; 0 loads the adapter switched off, as ``--lora-init-without-apply``). It is an
  option like any other, so a request's ``options.lora_scale`` replaces the model's list for that request;
- the override: llama-server's ``lora`` field, ``[{"id": N, "scale": S}, ...]``: top-level in the /v1 bodies
  (the routes copy it into the options as ``lora``), ``options.lora`` in /api/generate and /api/chat. As in
  llama-server, a non-empty list gives the scale of EVERY adapter: an adapter it does not list is off (scale 0) for
  that request, so a client picks one adapter of several with ``[{"id": 1, "scale": 1}]``. An empty list, or
  none, keeps the defaults. The shape (objects, integer ids from 0, finite scales, no id twice) is checked where
  options are validated (``modelfile.params.lora_entries``); an id the model does not have is checked here.

How the generation service uses it (daemon/generation/inference.py, service.py), once the options are merged
(``Inference.options``, which has checked their shape)::

    adapters = lora.request_adapters(ctx.adapters, opts)  # -> GenerateRequest(adapters=adapters, ...)

which is ``resolve(default_scales(ctx.adapters, opts), parse_lora(opts.get("lora"), len(ctx.adapters)))``. It
raises ``modelfile.errors.ParameterError`` (400; its ``name`` is ``"lora"``, or ``"lora_scale"``, which the
OpenAI error shape reports as ``param``) when the request names an adapter the model does not have or gives
more default scales than the model has adapters. Adapters at scale 0 are left out of the result; the base model
alone is ``()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from modelfile.errors import ParameterError
from modelfile.params import lora_entries

#: The scale of an adapter no ``lora_scale`` value covers (llama-server's ``--lora``, Ollama's ADAPTER)
DEFAULT_SCALE = 1.0

Adapters = tuple[tuple[str, float], ...]


def parse_lora(value: Any, n_adapters: int, where: str = "lora", *, model: str = "") -> dict[int, float] | None:
    """A request's ``lora`` checked against a model with ``n_adapters`` adapters: ``{id: scale}`` in the order
    given, or None when the request has none. An item that is not ``{"id": <0..n-1>, "scale": <finite number>}``,
    an id given twice, or any id for a model without adapters, is a ``ParameterError`` naming the item (``where``
    is how the client spelt the field: ``lora`` or ``options.lora``); ``model`` names the model in the message."""
    if value is None:
        return None
    try:
        entries = lora_entries(value, where)
    except ValueError as exc:
        raise ParameterError("lora", str(exc)) from None
    of = f"model '{model}'" if model else "the model"
    for i, (ident, _) in enumerate(entries):
        if ident >= n_adapters:
            if n_adapters == 0:
                raise ParameterError(
                    "lora",
                    f"{where}[{i}].id is {ident}, but {of} has no LoRA adapters (no ADAPTER line in its Modelfile); "
                    f"leave {where} out, or use a model made with ADAPTER",
                )
            raise ParameterError(
                "lora",
                f"{where}[{i}].id is {ident}, but {of} has {n_adapters} LoRA adapter"
                f"{'' if n_adapters == 1 else 's'}: ids 0 to {n_adapters - 1}, in its ADAPTER order "
                "(`corral show --modelfile` lists them)",
            )
    return dict(entries)


def default_scales(paths: Sequence[str], opts: Mapping[str, Any], *, model: str = "") -> Adapters:
    """The model's adapters (blob paths in ADAPTER order) each with its default scale: the merged options'
    ``lora_scale`` list by position, 1.0 past its end. More values than adapters is a ``ParameterError``."""
    raw = opts.get("lora_scale")
    scales = [float(s) for s in raw] if isinstance(raw, (list, tuple)) else [] if raw is None else [float(raw)]
    if len(scales) > len(paths):
        of = f"model '{model}'" if model else "the model"
        raise ParameterError(
            "lora_scale",
            f"lora_scale gives {len(scales)} scales, but {of} has {len(paths)} LoRA adapter"
            f"{'' if len(paths) == 1 else 's'}; give one scale per ADAPTER, in ADAPTER order",
        )
    return tuple((path, scales[i] if i < len(scales) else DEFAULT_SCALE) for i, path in enumerate(paths))


def resolve(adapters: Sequence[tuple[str, float]], override: Mapping[int, float] | None) -> Adapters:
    """What ``GenerateRequest.adapters`` gets: ``adapters`` (the model's, with default scales, in ADAPTER order)
    with a non-empty ``override`` ({id: scale}, from :func:`parse_lora`) setting every scale (ids it does not name
    go to 0, as in llama-server), then the adapters at scale 0 left out. An empty or absent override keeps the
    defaults. The ids must have been checked (:func:`parse_lora`); one out of range is a ValueError."""
    if override:
        bad = [i for i in override if not 0 <= i < len(adapters)]
        if bad:
            raise ValueError(f"adapter ids {bad} out of range for {len(adapters)} adapters")
        chosen = [(path, float(override.get(i, 0.0))) for i, (path, _) in enumerate(adapters)]
    else:
        chosen = [(path, float(scale)) for path, scale in adapters]
    return tuple((path, scale) for path, scale in chosen if scale != 0.0)


def request_adapters(paths: Sequence[str], opts: Mapping[str, Any], *, model: str = "") -> Adapters:
    """The (adapter path, scale) pairs of one request to a model whose adapters are ``paths`` (ADAPTER order),
    from the merged options ``opts`` (``lora_scale`` defaults, ``lora`` override): see the module's docstring."""
    defaults = default_scales(paths, opts, model=model)
    return resolve(defaults, parse_lora(opts.get("lora"), len(paths), model=model))
