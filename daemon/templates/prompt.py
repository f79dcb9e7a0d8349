"""Building a model's prompt text from a chat's typed messages and tools: pure, no I/O.

Order of preference (see the Ollama reference, section 2.9): the model's Go ``TEMPLATE`` (our own
engine, :mod:`daemon.templates.gotemplate`), else the GGUF's Jinja ``tokenizer.chat_template`` (run in the sandbox
of :mod:`daemon.templates.jinja`), else a plain ``role: content`` transcript. This module turns the chat core's
values (:class:`daemon.chat.types.Message`, :class:`daemon.chat.types.Tool`) into what each kind of template sees:
Go structs and maps marshalled as Ollama marshals them, or the JSON a Hugging Face template expects.

Go templates run in one of two ways, as Ollama's do:

* **modern**, when the template uses ``.Messages``: one execution with ``System``, ``Messages`` (consecutive
  same-role messages merged, except tool messages), ``Tools``, ``Response`` (``""``), ``Think``, ``ThinkLevel`` and
  ``IsThinkSet``;
* **legacy** (``.System``/``.Prompt``/``.Response``): one execution per completed turn, then the last turn with
  everything after the first ``.Response`` cut away so generation continues from there.

Images become ``[img-N]`` tags in the message text (replacing an ``[img]`` the user wrote, otherwise in front), N
counting across the messages given; the runner swaps them for the real media.

Every step is bounded in time and memory, whatever the template (a request's ``template`` or a model's), so a
hostile one gets a :class:`TemplateError` (a 400) rather than a hung or swollen daemon: Go templates
by :class:`daemon.templates.gotemplate.Budget` (2 s, 1M steps, 16M characters out, 64 MiB of built values), Jinja
templates by the hardened sandbox (2 s, 8M characters out, 32 MiB per value, 64 MiB of built values); both at
most 128 KiB of source. Parsed templates are kept in caches bounded by bytes (:mod:`daemon.templates.cache`). The
functions here are blocking: the daemon runs them through :func:`daemon.templates.offload.offload`, in a worker
thread, so its event loop stays free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from daemon.chat.types import JSONObject, JSONValue, Message, ThinkValue, Tool, ToolCall
from daemon.templates import gotemplate, jinja
from daemon.templates.cache import ByteBoundedCache
from daemon.templates.gotemplate import Struct, TemplateError, go_json

__all__ = [
    "DEFAULT_TEMPLATE",
    "GO_CACHE",
    "TemplateError",
    "parse_template",
    "render_messages",
    "render_generate",
    "render_jinja",
    "collate",
    "tag_images",
    "think_values",
]

DEFAULT_TEMPLATE = "{{ .Prompt }}"
THINK_LEVELS = ("high", "medium", "low", "max")


# ------------------------------------------------------------------------------------------------- the messages


def collate(messages: Iterable[Message]) -> tuple[str, list[Message]]:
    """All system messages joined with blank lines, and the messages with consecutive same-role ones merged
    (``"\\n\\n"`` between contents; tool messages are never merged; a merged message keeps the first one's other
    fields). Roles are lowercased."""
    system: list[str] = []
    out: list[Message] = []
    for m in messages:
        role = m.role.lower()
        if role == "system":
            system.append(m.content)
        if out and out[-1].role == role and role != "tool":
            out[-1] = dataclasses.replace(out[-1], content=out[-1].content + "\n\n" + m.content)
        else:
            out.append(m if m.role == role else dataclasses.replace(m, role=role))
    return "\n\n".join(system), out


def tag_images(messages: Iterable[Message]) -> list[Message]:
    """The messages with each image written into the text as ``[img-N]`` (see module doc); the images stay."""
    out, n = [], 0
    for m in messages:
        if m.images:
            text, prefix = m.content, ""
            for _ in m.images:
                tag = f"[img-{n}]"
                n += 1
                if "[img]" in text:
                    text = text.replace("[img]", tag, 1)
                else:
                    prefix += tag
            m = dataclasses.replace(m, content=prefix + text)
        out.append(m)
    return out


def think_values(think: ThinkValue) -> dict[str, bool | str]:
    """The ``Think``/``ThinkLevel``/``IsThinkSet`` template fields (``true`` shows as level ``medium``)."""
    if isinstance(think, str):
        return {"Think": think in THINK_LEVELS, "ThinkLevel": think, "IsThinkSet": True}
    return {"Think": bool(think), "ThinkLevel": "medium" if think else "", "IsThinkSet": think is not None}


# ------------------------------------------------------------------------------------- Go templates: parsing


def _parse(text: str) -> gotemplate.Template:
    tmpl = gotemplate.parse(text)
    if not tmpl.uses("Messages") and not tmpl.uses("Response"):
        tmpl = tmpl.with_field("Response")
    return tmpl


# a parsed template takes up to ~200 bytes per character of source (measured: 40-180)
GO_CACHE: ByteBoundedCache[str, gotemplate.Template] = ByteBoundedCache(32 << 20, lambda t, _: 200 * len(t) + 2048)


def parse_template(text: str) -> gotemplate.Template:
    """Parse a Go prompt template as Ollama does: append ``{{ .Response }}`` when the template uses neither
    ``.Messages`` nor ``.Response``. Raises :class:`TemplateError`. Cached (see :data:`GO_CACHE`)."""
    if len(text) > gotemplate.MAX_SOURCE:  # refused before taking the cache's lock
        return gotemplate.parse(text)
    return GO_CACHE.get(text, _parse)


# ------------------------------------------------------------------------ Go templates: the data, as Ollama's


class _JSONMap(dict[str, Any]):
    """A Go map that prints as JSON (Ollama's ``templateArgs``/``templateProperties``)."""

    def go_string(self) -> str:
        try:
            return go_json(self)
        except ValueError:
            return "{}"


class _JSONList(list[Any]):
    """A slice that prints as JSON (Ollama's ``templateTools``)."""

    def go_string(self) -> str:
        try:
            return go_json(self)
        except ValueError:
            return "[]"


class _PropertyType(list[str]):
    """A JSON-schema ``type``: one name or several; prints as the name, marshals as a string when single."""

    def go_string(self) -> str:
        return "" if not self else self[0] if len(self) == 1 else "[" + " ".join(self) + "]"

    def go_json(self) -> str | list[str]:
        return self[0] if len(self) == 1 else list(self)


def _sorted_deep(v: JSONValue) -> JSONValue:
    """Go marshals ``map[string]any`` with sorted keys; tool-call arguments reach templates as such maps."""
    if isinstance(v, dict):
        return _sorted_object(v)
    if isinstance(v, list | tuple):
        return [_sorted_deep(x) for x in v]
    return v


def _sorted_object(obj: JSONObject) -> JSONObject:
    return {str(k): _sorted_deep(obj[k]) for k in sorted(obj, key=str)}


def _template_call(call: ToolCall) -> Struct:
    function = {
        "Index": call.index if call.index is not None else 0,
        "Name": call.name,
        "Arguments": _JSONMap(_sorted_object(call.arguments)),
    }
    return Struct({"ID": call.id, "Function": Struct(function)})


def _template_message(m: Message) -> Struct:
    return Struct(
        {
            "Role": m.role,
            "Content": m.content,
            "Thinking": m.thinking,
            "Images": list(m.images),
            "ToolCalls": [_template_call(c) for c in m.tool_calls],
            "ToolName": m.tool_name,
            "ToolCallID": m.tool_call_id,
        }
    )


def _listed(value: JSONValue | None) -> list[Any]:
    """A JSON list as a Go slice (a string or an object iterated as Python does; anything else: empty)."""
    return list(value) if isinstance(value, list | str | dict) else []


def _property(p: JSONValue) -> Struct:
    """A tool parameter property as Ollama's ``api.ToolProperty`` (unknown JSON-schema keys are dropped, as Go's
    decoder does)."""
    p = p if isinstance(p, dict) else {}
    t = p.get("type")
    ptype = _PropertyType([t] if isinstance(t, str) else [x for x in _listed(t) if isinstance(x, str)])
    any_of = [_property(x) for x in _listed(p.get("anyOf"))]
    props = p.get("properties")
    nested = _JSONMap({k: _property(v) for k, v in props.items()}) if isinstance(props, dict) else None
    fields = {
        "AnyOf": any_of,
        "Type": ptype,
        "Items": p.get("items"),
        "Description": p.get("description") or "",
        "Enum": _listed(p.get("enum")),
        "Properties": nested,
        "Required": _listed(p.get("required")),
    }
    js: dict[str, Any] = {}
    for key, field in (
        ("anyOf", "AnyOf"),
        ("type", "Type"),
        ("items", "Items"),
        ("description", "Description"),
        ("enum", "Enum"),
        ("properties", "Properties"),
        ("required", "Required"),
    ):
        if fields[field]:  # omitempty
            js[key] = fields[field]
    return Struct(fields, json=js)


def _template_tool(t: Tool) -> Struct:
    spec = t.spec
    fn = t.function or {}
    params = fn.get("parameters")
    params = params if isinstance(params, dict) else {}
    props = params.get("properties")
    # Ollama hands templates a plain Go map here, which ranges and marshals in sorted key order.
    properties = _JSONMap({k: _property(props[k]) for k in sorted(props)}) if isinstance(props, dict) else None
    p_fields = {
        "Type": params.get("type") or "",
        "Defs": params.get("$defs"),
        "Items": params.get("items"),
        "Required": _listed(params.get("required")),
        "Properties": properties,
    }
    p_json: dict[str, Any] = {"type": p_fields["Type"]}
    for key, field in (("$defs", "Defs"), ("items", "Items"), ("required", "Required")):
        if p_fields[field]:
            p_json[key] = p_fields[field]
    p_json["properties"] = properties
    parameters = Struct(p_fields, json=p_json, stringer=True)
    f_fields = {"Name": fn.get("name") or "", "Description": fn.get("description") or "", "Parameters": parameters}
    function = Struct(
        f_fields,
        json={"name": f_fields["Name"], "description": f_fields["Description"], "parameters": parameters},
        stringer=True,
    )
    t_json: dict[str, Any] = {"type": spec.get("type") or ""}
    if spec.get("items"):
        t_json["items"] = spec.get("items")
    t_json["function"] = function
    return Struct(
        {"Type": spec.get("type") or "", "Items": spec.get("items"), "Function": function}, json=t_json, stringer=True
    )


def _execute_go(
    tmpl: gotemplate.Template, messages: Sequence[Message], tools: Sequence[Tool] | None, think: ThinkValue
) -> str:
    system, collated = collate(messages)
    tv = think_values(think)
    if tmpl.uses("Messages"):
        return tmpl.execute(
            {
                "System": system,
                "Messages": [_template_message(m) for m in collated],
                "Tools": _JSONList(_template_tool(t) for t in tools or []),
                "Response": "",
                **tv,
            }
        )

    # Legacy: one run per completed turn, all sharing one budget.
    out: list[str] = []
    budget = gotemplate.Budget()

    def run(t: gotemplate.Template, values: dict[str, str]) -> None:
        out.append(t.run({**values, **tv}, budget))

    turn = {"System": "", "Prompt": "", "Response": ""}
    for m in collated:
        role = m.role
        if (role == "system" and (turn["Prompt"] or turn["Response"])) or (role == "user" and turn["Response"]):
            run(tmpl, turn)
            turn = {"System": "", "Prompt": "", "Response": ""}
        key = {"system": "System", "user": "Prompt", "assistant": "Response"}.get(role)
        if key:
            turn[key] = m.content
    run(tmpl.cut_after("Response"), turn)
    return "".join(out)


# ------------------------------------------------------------------------------- Jinja templates: the JSON data


def _jinja_call(call: ToolCall) -> JSONObject:
    out: JSONObject = {"type": "function", "function": {"name": call.name, "arguments": _sorted_object(call.arguments)}}
    if call.id:
        out["id"] = call.id
    return out


def _jinja_message(m: Message) -> JSONObject:
    """A message as Hugging Face chat templates read it (OpenAI's names: ``reasoning_content``, ``name``)."""
    out: JSONObject = {"role": m.role, "content": m.content}
    if m.thinking:
        out["reasoning_content"] = m.thinking
    if m.tool_calls:
        out["tool_calls"] = [_jinja_call(c) for c in m.tool_calls]
    if m.tool_name:
        out["name"] = m.tool_name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    return out


def render_jinja(
    template: str,
    messages: Sequence[Message],
    *,
    tools: Sequence[Tool] | None = None,
    think: ThinkValue = None,
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    timeout: float = jinja.JINJA_TIMEOUT,
) -> str:
    """Render a Hugging Face/GGUF Jinja chat template in the sandbox, within ``timeout`` seconds of work and the
    sandbox's memory bounds. The template sees the messages and tools as JSON, as ``transformers`` gives them."""
    compiled = jinja.compiled(template)
    given = sum(len(m.content) for m in messages)
    variables: dict[str, Any] = {
        "messages": [_jinja_message(m) for m in messages],
        "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "tools": [dict(t.spec) for t in tools] if tools else None,
    }
    if think is not None:
        variables["enable_thinking"] = think_values(think)["Think"]
    if given > jinja.JINJA_MAX_OUTPUT:
        raise TemplateError(
            f"chat template: the messages are longer than {jinja.JINJA_MAX_OUTPUT} characters, more than "
            "a prompt may be; send a shorter chat"
        )
    if jinja.value_bytes(variables["tools"]) > jinja.JINJA_MAX_VALUE:
        raise TemplateError(f"chat template: the tools take more than {jinja.JINJA_MAX_VALUE >> 20} MiB; send fewer")
    return jinja.render(compiled, variables, timeout)


# ---------------------------------------------------------------------------------------------------------- API


def _plain(messages: Sequence[Message]) -> str:
    return "".join(f"{m.role or 'user'}: {m.content}\n" for m in messages) + "assistant: "


def render_messages(
    go_template: str | None,
    jinja_template: str | None,
    messages: Sequence[Message],
    *,
    tools: Sequence[Tool] | None = None,
    think: ThinkValue = None,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt for a chat, by the Go template, else the Jinja template, else as a plain transcript (images are
    tagged into the text first). Raises :class:`TemplateError`."""
    msgs = tag_images(messages)
    if go_template:
        return _execute_go(parse_template(go_template), msgs, tools, think)
    if jinja_template:
        return render_jinja(jinja_template, msgs, tools=tools, think=think, bos_token=bos_token, eos_token=eos_token)
    return _plain(msgs)


def render_generate(
    go_template: str | None,
    jinja_template: str | None,
    *,
    prompt: str,
    system: str | None = None,
    suffix: str | None = None,
    messages_history: Iterable[Message] = (),
    images: Sequence[str] | None = None,
    think: ThinkValue = None,
    bos_token: str = "",
    eos_token: str = "",
) -> str:
    """The prompt for ``/api/generate``: ``system`` (already resolved: the request's, else the model's), then
    the Modelfile MESSAGE history, then the user ``prompt`` (with its ``images``, base64). With a ``suffix``
    (fill-in-the-middle) the template runs once with ``Prompt`` and ``Suffix``. With no template at all this is
    Ollama's ``{{ .Prompt }}``."""
    if suffix and prompt:
        tmpl = parse_template(go_template or DEFAULT_TEMPLATE)
        return tmpl.execute({"Prompt": prompt, "Suffix": suffix, "Response": "", **think_values(think)})
    msgs = [Message(role="system", content=system)] if system else []
    msgs.extend(messages_history)
    msgs.append(Message(role="user", content=prompt, images=tuple(images or ())))
    if not go_template and not jinja_template:
        go_template = DEFAULT_TEMPLATE
    return render_messages(go_template, jinja_template, msgs, think=think, bos_token=bos_token, eos_token=eos_token)
