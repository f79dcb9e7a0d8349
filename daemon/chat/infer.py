"""What a model's chat template says about its output: the tags around its thinking, and the text that precedes
its tool-call JSON. For Go templates this follows Ollama's heuristics (``thinking/template.go``,
``tools/template.go``) on corral's own template syntax tree; for GGUF Jinja templates it is a conservative guess
from the tags the template mentions."""

from __future__ import annotations

from typing import Any

from daemon.templates.gotemplate import TemplateError
from daemon.templates.prompt import parse_template

# Node shapes (daemon/templates/gotemplate.py): ("text", s), ("action", pos, pipe),
# ("if"|"with"|"range", pos, pipe, body,
# else), ("break"|"continue", pos); pipe = ("pipe", pos, decl, is_assign, cmds); cmd = ("cmd", pos, end, args);
# an arg is ("field", pos, names), ("var", ...), ("chain", ...), ("lit", ...), ("ident", ...), ("dot", pos),
# ("nil", pos) or a parenthesised pipe.
Node = tuple[Any, ...]
_CONTROL = ("if", "with", "range")


def _root(source: str) -> list[Node] | None:
    """The template's top-level nodes, or None when it does not parse (parsed through the prompt builder's cache,
    with Ollama's ``{{ .Response }}`` appended where it would be)."""
    try:
        return parse_template(source).root
    except (TemplateError, RecursionError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------------ thinking


def _pipe_has_field(pipe: Node, name: str) -> bool:
    """Whether a field whose first name is ``name`` appears anywhere in ``pipe`` (nested pipes included)."""
    for cmd in pipe[4]:
        for arg in cmd[3]:
            if arg[0] == "field" and arg[2][0] == name:
                return True
            if arg[0] == "pipe" and _pipe_has_field(arg, name):
                return True
    return False


class _ThinkTags:
    """Walk the tree as Ollama does: each ``.Thinking`` field under a ``range`` over ``.Messages`` takes the tags
    from the first and last text of the nearest enclosing list (the body holding it). Later matches overwrite
    earlier ones, and a list that does not begin (end) with text leaves the opening (closing) tag as it was."""

    def __init__(self) -> None:
        self.opening = ""
        self.closing = ""

    def nodes(self, nodes: list[Node], rng: Node | None) -> None:
        for node in nodes:
            self.node(node, rng, nodes)

    def node(self, node: Node, rng: Node | None, holder: list[Node]) -> None:
        kind = node[0]
        if kind == "action":
            self.pipe(node[2], rng, holder)
        elif kind in _CONTROL:
            inner = node if kind == "range" else rng  # a range's own pipe is already "inside" it
            self.pipe(node[2], inner, holder)
            self.nodes(node[3], inner)
            if node[4] is not None:
                self.nodes(node[4], inner)

    def pipe(self, pipe: Node, rng: Node | None, holder: list[Node]) -> None:
        for cmd in pipe[4]:
            for arg in cmd[3]:
                if arg[0] == "pipe":
                    self.pipe(arg, rng, holder)
                elif arg[0] == "field" and arg[2][0] == "Thinking":
                    if rng is None or not _pipe_has_field(rng[2], "Messages"):
                        continue
                    if holder and holder[0][0] == "text":
                        self.opening = holder[0][1].strip()
                    if holder and holder[-1][0] == "text":
                        self.closing = holder[-1][1].strip()


def infer_think_tags(go_template_source: str) -> tuple[str, str]:
    """The (opening, closing) thinking tags a Go chat template writes around ``.Thinking`` in its messages, or
    ("", "") when it has none (or does not parse)."""
    root = _root(go_template_source)
    if root is None:
        return "", ""
    walk = _ThinkTags()
    walk.nodes(root, None)
    return walk.opening, walk.closing


_JINJA_THINK = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))


def infer_think_tags_jinja(src: str) -> tuple[str, str]:
    """A guess at a Jinja chat template's thinking tags: a known pair that the template writes both halves of (a
    template only mentions them to render or strip a model's reasoning), else ("", "")."""
    for opening, closing in _JINJA_THINK:
        if opening in src and closing in src:
            return opening, closing
    return "", ""


# ------------------------------------------------------------------------------------------------------ tool calls


def _is_tool_calls_if(node: Node) -> bool:
    """An ``if`` whose own commands name a ``ToolCalls`` field (at any position of the field's chain)."""
    return any(arg[0] == "field" and "ToolCalls" in arg[2] for cmd in node[2][4] for arg in cmd[3])


def _find_tool_calls_if(nodes: list[Node]) -> Node | None:
    """The first ``{{ if ...ToolCalls }}``, depth first through if/range/with bodies and their else branches."""
    for node in nodes:
        if node[0] not in _CONTROL:
            continue
        if node[0] == "if" and _is_tool_calls_if(node):
            return node
        for branch in (node[3], node[4]):
            if branch is not None and (found := _find_tool_calls_if(branch)) is not None:
                return found
    return None


def _first_text(nodes: list[Node]) -> str | None:
    """The first non-blank text in ``nodes``, looking into the first control block met but not past it, and not
    past any action (text after the tool calls is not their prefix)."""
    for node in nodes:
        kind = node[0]
        if kind == "text":
            if node[1].strip():
                return str(node[1])
        elif kind in _CONTROL:
            for branch in (node[3], node[4]):
                if branch is not None and (found := _first_text(branch)) is not None:
                    return found
            return None
        elif kind == "action":
            return None
    return None


def infer_tool_tag(go_template_source: str) -> str:
    """The text a model writes before its tool-call JSON, from the first text inside the template's
    ``{{ if .ToolCalls }}`` (up to any ``{``); ``"{"`` when there is none, meaning bare JSON objects are calls."""
    root = _root(go_template_source)
    if root is None:
        return "{"
    node = _find_tool_calls_if(root)
    text = _first_text(node[3]) if node is not None else None
    if text is None:
        return "{"
    tag = text.replace("\r\n", "\n").split("{", 1)[0].strip()
    return tag or "{"


_JINJA_TOOL_TAGS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


def infer_tool_tag_jinja(src: str) -> str:
    """A guess at the tag before a Jinja template's tool calls: the first known tag it mentions, else ``"{"``."""
    for tag in _JINJA_TOOL_TAGS:
        if tag in src:
            return tag
    return "{"
