"""The house rules of docs/architecture.md, checked on the source: imports only run down the table of packages, no
route imports another route, and the CLI stays a thin client. Read with ``ast`` (nothing is imported), so a
function-level import counts as much as a module-level one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("errors", "modelfile", "registry", "daemon", "cli")

# layer -> the layers it may import (besides itself). "daemon" is the daemon's top-level modules (settings, logs,
# version, hardware). Keep in step with the table in docs/architecture.md.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "modelfile": {"errors"},
    "registry": {"errors", "modelfile"},
    "daemon": {"errors", "modelfile", "registry"},
    "daemon.templates": {"errors", "daemon"},
    "daemon.chat": {"errors", "daemon", "daemon.templates"},
    "daemon.runners": {"errors", "modelfile", "registry", "daemon"},
    "daemon.llama": {"errors", "modelfile", "daemon.runners"},
    "daemon.scheduling": {"errors", "modelfile", "registry", "daemon", "daemon.runners"},
    "daemon.models": {"errors", "modelfile", "registry", "daemon", "daemon.chat", "daemon.templates", "daemon.runners"},
    "daemon.generation": {
        "errors",
        "modelfile",
        "registry",
        "daemon",
        "daemon.chat",
        "daemon.templates",
        "daemon.runners",
        "daemon.scheduling",
        "daemon.models",
    },
    "daemon.api": {
        "errors",
        "modelfile",
        "registry",
        "daemon",
        "daemon.chat",
        "daemon.templates",
        "daemon.runners",
        "daemon.scheduling",
        "daemon.models",
        "daemon.generation",
    },
    "cli": {"errors", "modelfile", "registry", "daemon", "daemon.api"},
}
# modules of a higher layer that a lower one may import: the chat core's typed values (stdlib only, like Ollama's
# api package), which the template layer renders
VALUES = {"daemon.chat.types"}
# what the CLI may take from the daemon: its settings and version, and the server for `corral serve`
CLI_FROM_DAEMON = {"daemon.settings", "daemon.version", "daemon.api.server", "daemon.logs"}


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] not in PACKAGES:
        return None
    if parts[0] == "daemon" and len(parts) > 1 and (ROOT / "daemon" / parts[1]).is_dir():  # a subpackage
        return "daemon." + parts[1]
    return parts[0]


def modules() -> list[tuple[str, Path]]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            out.append((name, path))
    return out


def imports_of(name: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = name.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


MODULES = modules()


def test_the_tree_is_read() -> None:
    names = {name for name, _ in MODULES}
    assert {"errors", "daemon.api.app", "daemon.llama.engine", "daemon.chat.pipeline", "cli.main"} <= names


@pytest.mark.parametrize(("name", "path"), MODULES, ids=[name for name, _ in MODULES])
def test_imports_run_down_the_layers(name: str, path: Path) -> None:
    here = layer_of(name)
    assert here in ALLOWED, f"{name}: a package docs/architecture.md does not place"
    wrong = set()
    for imported in imports_of(name, path):
        there = layer_of(imported)
        if there is None or there == here:
            continue
        if imported in {"daemon", "daemon.api", "daemon.api.routes"}:  # a bare package name imports nothing
            continue
        if there not in ALLOWED[here] and not any(imported == v or imported.startswith(v + ".") for v in VALUES):
            wrong.add(imported)
    assert not wrong, f"{name} ({here}) imports {sorted(wrong)}, above its layer"


@pytest.mark.parametrize(
    ("name", "path"), [(n, p) for n, p in MODULES if n.startswith("daemon.api.routes.")], ids=lambda x: str(x)
)
def test_no_route_imports_another_route(name: str, path: Path) -> None:
    others = {m for m in imports_of(name, path) if m.startswith("daemon.api.routes.") and m != name}
    assert not others, f"{name} imports the routes {sorted(others)}; shared code belongs below the routes"


def test_the_cli_takes_only_settings_version_and_the_server_from_the_daemon() -> None:
    for name, path in MODULES:
        if not name.startswith("cli"):
            continue
        taken = {m for m in imports_of(name, path) if m.startswith("daemon.")}
        extra = {m for m in taken if not any(m == ok or m.startswith(ok + ".") for ok in CLI_FROM_DAEMON)}
        assert not extra, f"{name} imports {sorted(extra)} from the daemon"
        third = {m.split(".")[0] for m in imports_of(name, path)} & {"fastapi", "llama_cpp", "numpy", "starlette"}
        assert not third, f"{name} imports {sorted(third)}: the CLI is a thin HTTP client"
