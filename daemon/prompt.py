"""Building a model's prompt text from messages: pure, no I/O.

Order of preference (see the Ollama reference, section 2.9): the model's Go ``TEMPLATE`` (our own engine,
:mod:`daemon.gotemplate`), else the GGUF's Jinja ``tokenizer.chat_template`` (sandboxed jinja2, with a time limit),
else a plain ``role: content`` transcript.

Go templates run in one of two ways, as Ollama's do:

* **modern**, when the template uses ``.Messages``: one execution with ``System``, ``Messages`` (consecutive
  same-role messages merged, except tool messages), ``Tools``, ``Response`` (``""``), ``Think``, ``ThinkLevel`` and
  ``IsThinkSet``;
* **legacy** (``.System``/``.Prompt``/``.Response``): one execution per completed turn, then the last turn with
  everything after the first ``.Response`` cut away so generation continues from there.

Images become ``[img-N]`` tags in the message text (replacing an ``[img]`` the user wrote, otherwise in front), N
counting across the messages given; the runner swaps them for the real media.
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from daemon import gotemplate
from daemon.gotemplate import Struct, TemplateError, go_json

__all__ = [
    "DEFAULT_TEMPLATE", "TemplateError", "parse_template", "render_messages", "render_generate", "render_jinja",
    "collate", "tag_images", "think_values",
]

DEFAULT_TEMPLATE = "{{ .Prompt }}"
JINJA_TIMEOUT = 2.0
JINJA_MAX_OUTPUT = 8 * 1024 * 1024
THINK_LEVELS = ("high", "medium", "low", "max")


# ---------------------------------------------------------------------------------------------------------- Go side


@functools.lru_cache(maxsize=64)
def parse_template(text: str) -> gotemplate.Template:
    """Parse a Go prompt template as Ollama does: append ``{{ .Response }}`` when the template uses neither
    ``.Messages`` nor ``.Response``. Raises :class:`TemplateError`."""
    tmpl = gotemplate.parse(text)
    if not tmpl.uses("Messages") and not tmpl.uses("Response"):
        tmpl = tmpl.with_field("Response")
    return tmpl


def think_values(think: bool | str | None) -> dict[str, Any]:
    """The ``Think``/``ThinkLevel``/``IsThinkSet`` template fields (``true`` shows as level ``medium``)."""
    if isinstance(think, str):
        return {"Think": think in THINK_LEVELS, "ThinkLevel": think, "IsThinkSet": True}
    return {"Think": bool(think), "ThinkLevel": "medium" if think else "", "IsThinkSet": think is not None}


def collate(messages: Iterable[Mapping[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """All system messages joined with blank lines, and the messages with consecutive same-role ones merged
    (``"\\n\\n"`` between contents; tool messages are never merged). The input is not modified."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        role = str(m.get("role") or "").lower()
        content = str(m.get("content") or "")
        if role == "system":
            system.append(content)
        if out and out[-1]["role"] == role and role != "tool":
            out[-1]["content"] += "\n\n" + content
        else:
            out.append({**m, "role": role, "content": content})
    return "\n\n".join(system), out


def tag_images(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Copies of the messages with each image written into the text as ``[img-N]`` (see module doc)."""
    out, n = [], 0
    for m in messages:
        m = dict(m)
        images = m.get("images") or []
        if images:
            text, prefix = str(m.get("content") or ""), ""
            for _ in images:
                tag = f"[img-{n}]"
                n += 1
                if "[img]" in text:
                    text = text.replace("[img]", tag, 1)
                else:
                    prefix += tag
            m["content"] = prefix + text
        out.append(m)
    return out


class _JSONMap(dict):  # type: ignore[type-arg]
    """A Go map that prints as JSON (Ollama's ``templateArgs``/``templateProperties``)."""

    def go_string(self) -> str:
        try:
            return go_json(self)
        except ValueError:
            return "{}"


class _JSONList(list):  # type: ignore[type-arg]
    """A slice that prints as JSON (Ollama's ``templateTools``)."""

    def go_string(self) -> str:
        try:
            return go_json(self)
        except ValueError:
            return "[]"


class _PropertyType(list):  # type: ignore[type-arg]
    """A JSON-schema ``type``: one name or several; prints as the name, marshals as a string when single."""

    def go_string(self) -> str:
        return "" if not self else self[0] if len(self) == 1 else "[" + " ".join(self) + "]"

    def go_json(self) -> Any:
        return self[0] if len(self) == 1 else list(self)


def _sorted_deep(v: Any) -> Any:
    """Go marshals ``map[string]any`` with sorted keys; tool-call arguments reach templates as such maps."""
    if isinstance(v, Mapping):
        return {str(k): _sorted_deep(v[k]) for k in sorted(v, key=str)}
    if isinstance(v, (list, tuple)):
        return [_sorted_deep(x) for x in v]
    return v


def _arguments(raw: Any) -> _JSONMap:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            raw = {}
    return _JSONMap(_sorted_deep(raw) if isinstance(raw, Mapping) else {})


def _template_message(m: Mapping[str, Any]) -> Struct:
    calls = []
    for tc in m.get("tool_calls") or []:
        fn = tc.get("function") or {}
        calls.append(Struct({"ID": tc.get("id") or "", "Function": Struct({
            "Index": fn["index"] if isinstance(fn.get("index"), int) else 0,
            "Name": fn.get("name") or "", "Arguments": _arguments(fn.get("arguments"))})}))
    return Struct({
        "Role": m.get("role") or "", "Content": m.get("content") or "", "Thinking": m.get("thinking") or "",
        "Images": list(m.get("images") or []), "ToolCalls": calls, "ToolName": m.get("tool_name") or "",
        "ToolCallID": m.get("tool_call_id") or ""})


def _property(p: Any) -> Struct:
    """A tool parameter property as Ollama's ``api.ToolProperty`` (unknown JSON-schema keys are dropped, as Go's
    decoder does)."""
    p = p if isinstance(p, Mapping) else {}
    t = p.get("type")
    ptype = _PropertyType([t] if isinstance(t, str) else [x for x in t or [] if isinstance(x, str)])
    any_of = [_property(x) for x in p.get("anyOf") or []]
    props = p.get("properties")
    nested = _JSONMap({k: _property(v) for k, v in props.items()}) if isinstance(props, Mapping) else None
    fields = {"AnyOf": any_of, "Type": ptype, "Items": p.get("items"), "Description": p.get("description") or "",
              "Enum": list(p.get("enum") or []), "Properties": nested, "Required": list(p.get("required") or [])}
    js: dict[str, Any] = {}
    for key, field in (("anyOf", "AnyOf"), ("type", "Type"), ("items", "Items"), ("description", "Description"),
                       ("enum", "Enum"), ("properties", "Properties"), ("required", "Required")):
        if fields[field]:  # omitempty
            js[key] = fields[field]
    return Struct(fields, json=js)


def _template_tool(t: Mapping[str, Any]) -> Struct:
    fn = t.get("function") or {}
    params = fn.get("parameters") or {}
    props = params.get("properties")
    # Ollama hands templates a plain Go map here, which ranges and marshals in sorted key order.
    properties = _JSONMap({k: _property(props[k]) for k in sorted(props)}) if isinstance(props, Mapping) else None
    p_fields = {"Type": params.get("type") or "", "Defs": params.get("$defs"), "Items": params.get("items"),
                "Required": list(params.get("required") or []), "Properties": properties}
    p_json: dict[str, Any] = {"type": p_fields["Type"]}
    for key, field in (("$defs", "Defs"), ("items", "Items"), ("required", "Required")):
        if p_fields[field]:
            p_json[key] = p_fields[field]
    p_json["properties"] = properties
    parameters = Struct(p_fields, json=p_json, stringer=True)
    f_fields = {"Name": fn.get("name") or "", "Description": fn.get("description") or "", "Parameters": parameters}
    function = Struct(f_fields, json={"name": f_fields["Name"], "description": f_fields["Description"],
                                      "parameters": parameters}, stringer=True)
    t_json: dict[str, Any] = {"type": t.get("type") or ""}
    if t.get("items"):
        t_json["items"] = t.get("items")
    t_json["function"] = function
    return Struct({"Type": t.get("type") or "", "Items": t.get("items"), "Function": function},
                  json=t_json, stringer=True)


def _execute_go(tmpl: gotemplate.Template, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None, think: bool | str | None) -> str:
    system, collated = collate(messages)
    tv = think_values(think)
    if tmpl.uses("Messages"):
        return tmpl.execute({
            "System": system, "Messages": [_template_message(m) for m in collated],
            "Tools": _JSONList(_template_tool(t) for t in tools or []), "Response": "", **tv})

    # Legacy: one run per completed turn, all sharing one step and output budget.
    out: list[str] = []
    steps, size = gotemplate.MAX_STEPS, gotemplate.MAX_OUTPUT

    def run(t: gotemplate.Template, values: dict[str, str]) -> None:
        nonlocal steps, size
        text, used = t.run({**values, **tv}, max_steps=steps, max_output=size)
        out.append(text)
        steps, size = steps - used, size - len(text)

    turn = {"System": "", "Prompt": "", "Response": ""}
    for m in collated:
        role = m["role"]
        if (role == "system" and (turn["Prompt"] or turn["Response"])) or (role == "user" and turn["Response"]):
            run(tmpl, turn)
            turn = {"System": "", "Prompt": "", "Response": ""}
        key = {"system": "System", "user": "Prompt", "assistant": "Response"}.get(role)
        if key:
            turn[key] = m["content"]
    run(tmpl.cut_after("Response"), turn)
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------- Jinja side


class _RenderTimeout(BaseException):
    pass


class _Raised(Exception):
    pass


@functools.lru_cache(maxsize=16)
def _jinja_template(text: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Generation(jinja2.ext.Extension):
        """Accept Hugging Face's ``{% generation %}`` markers and render their body as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Env(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            # A sandbox still lets ``"x" * 10**10`` or ``10**10**10`` eat the machine in one C call.
            if operator == "**" and isinstance(right, int) and abs(right) > 256 and not -1 <= left <= 1:
                raise SecurityError("exponent too large")
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > 1_000_000:
                        raise SecurityError("repetition too large")
            return super().call_binop(context, operator, left, right)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message: str) -> None:
        raise _Raised(message)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template: line {e.lineno}: {e.message}") from None
    except Exception as e:  # noqa: BLE001 - any compile failure is the template's fault
        raise TemplateError(f"chat template: {e}") from None


def _jinja_message(m: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.get("role") or "", "content": m.get("content") or ""}
    if m.get("thinking"):
        out["reasoning_content"] = m["thinking"]
    if m.get("tool_calls"):
        calls = []
        for tc in m["tool_calls"]:
            fn = tc.get("function") or {}
            call: dict[str, Any] = {"type": "function", "function": {
                "name": fn.get("name") or "", "arguments": dict(_arguments(fn.get("arguments")))}}
            if tc.get("id"):
                call["id"] = tc["id"]
            calls.append(call)
        out["tool_calls"] = calls
    if m.get("tool_name"):
        out["name"] = m["tool_name"]
    if m.get("tool_call_id"):
        out["tool_call_id"] = m["tool_call_id"]
    return out


def render_jinja(template: str, messages: Sequence[Mapping[str, Any]], *,
                 tools: Sequence[Mapping[str, Any]] | None = None, think: bool | str | None = None,
                 bos_token: str = "", eos_token: str = "", add_generation_prompt: bool = True,
                 timeout: float = JINJA_TIMEOUT) -> str:
    """Render a Hugging Face/GGUF Jinja chat template in a sandbox, within ``timeout`` seconds of work."""
    compiled = _jinja_template(template)
    variables: dict[str, Any] = {
        "messages": [_jinja_message(m) for m in messages], "add_generation_prompt": add_generation_prompt,
        "bos_token": bos_token, "eos_token": eos_token, "tools": [dict(t) for t in tools] if tools else None}
    if think is not None:
        variables["enable_thinking"] = think_values(think)["Think"]
    result: dict[str, Any] = {}

    def work() -> None:
        deadline = time.monotonic() + timeout

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            if time.monotonic() > deadline:
                raise _RenderTimeout()
            return tracer if frame.f_code.co_filename == "<template>" else None

        sys.settrace(tracer)
        try:
            parts, size = [], 0
            for chunk in compiled.generate(**variables):
                size += len(chunk)
                if size > JINJA_MAX_OUTPUT:
                    raise TemplateError("chat template: output too large")
                parts.append(chunk)
            result["text"] = "".join(parts)
        except BaseException as e:  # noqa: BLE001 - reported to the caller's thread
            result["error"] = e
        finally:
            sys.settrace(None)

    worker = threading.Thread(target=work, name="corral-chat-template", daemon=True)
    worker.start()
    worker.join(timeout + 1.0)  # the tracer stops Python-level work; this bounds anything it cannot see
    if worker.is_alive() or isinstance(result.get("error"), _RenderTimeout):
        raise TemplateError(f"chat template: rendering took longer than {timeout:g}s")
    err = result.get("error")
    if err is None:
        return str(result["text"])
    if isinstance(err, TemplateError):
        raise err
    if isinstance(err, _Raised):
        raise TemplateError(f"chat template: {err}")
    raise TemplateError(f"chat template: {type(err).__name__}: {err}")


# ---------------------------------------------------------------------------------------------------------- API


def _plain(messages: Sequence[Mapping[str, Any]]) -> str:
    return "".join(f"{m.get('role') or 'user'}: {m.get('content') or ''}\n" for m in messages) + "assistant: "


def render_messages(go_template: str | None, jinja_template: str | None, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None, think: bool | str | None = None,
                    bos_token: str = "", eos_token: str = "") -> str:
    """The prompt for a chat: ``messages`` are Ollama-shaped dicts (role, content, images, thinking,
    tool_calls ``[{"function": {"name", "arguments"}}]``, tool_name, tool_call_id). Raises :class:`TemplateError`."""
    msgs = tag_images(messages)
    if go_template:
        return _execute_go(parse_template(go_template), msgs, tools, think)
    if jinja_template:
        return render_jinja(jinja_template, msgs, tools=tools, think=think, bos_token=bos_token, eos_token=eos_token)
    return _plain(msgs)


def render_generate(go_template: str | None, jinja_template: str | None, *, prompt: str, system: str | None = None,
                    suffix: str | None = None, messages_history: Iterable[Mapping[str, Any]] = (),
                    images: Sequence[Any] | None = None, think: bool | str | None = None,
                    bos_token: str = "", eos_token: str = "") -> str:
    """The prompt for ``/api/generate``: ``system`` (already resolved: the request's, else the model's), then
    the Modelfile MESSAGE history, then the user ``prompt``. With a ``suffix`` (fill-in-the-middle) the template
    runs once with ``Prompt`` and ``Suffix``. With no template at all this is Ollama's ``{{ .Prompt }}``."""
    if suffix and prompt:
        tmpl = parse_template(go_template or DEFAULT_TEMPLATE)
        return tmpl.execute({"Prompt": prompt, "Suffix": suffix, "Response": "", **think_values(think)})
    msgs: list[Mapping[str, Any]] = [{"role": "system", "content": system}] if system else []
    msgs.extend(messages_history)
    user: dict[str, Any] = {"role": "user", "content": prompt}
    if images:
        user["images"] = list(images)
    msgs.append(user)
    if not go_template and not jinja_template:
        go_template = DEFAULT_TEMPLATE
    return render_messages(go_template, jinja_template, msgs, think=think, bos_token=bos_token, eos_token=eos_token)
