"""The process boundary of a runner, checked on the source (read with ``ast``; nothing is imported, so a
function-level import counts as much as a module-level one): only the child side, ``daemon/llama/``, imports numpy
or llama_cpp; the child side takes nothing from the daemon but the runner protocol module (``daemon.runners.protocol``,
which both sides share), the option defaults and the prompt cache's store (``daemon.runners.kvstore``, shared too);
and the daemon's side names a child module only as the command it runs (``python -m daemon.llama.runner``), never by
importing it. tests/test_layers.py checks the layers above."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGES = ("errors", "modelfile", "registry", "daemon", "cli")
CHILD = "daemon.llama"
NATIVE = {"numpy", "llama_cpp"}
# what the child side may take from the project: the protocol module and, through it, the option defaults; and the
# prompt cache's store on disk (issue 27), which the daemon reads too (its stats, `corral prune`)
CHILD_MAY_IMPORT = {"daemon.runners.protocol", "modelfile.params", "daemon.runners.kvstore"}


def modules() -> list[tuple[str, Path]]:
    out = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            out.append((".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts), path))
    return out


def imported(path: Path) -> set[str]:
    """Every module an import statement in ``path`` names (absolute imports: the project uses no relative ones),
    ``from a import b`` counted as ``a``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: a relative import"
            found.add(node.module or "")
    return found


MODULES = modules()


def test_the_tree_is_read() -> None:
    names = {name for name, _ in MODULES}
    assert {"daemon.llama.runner", "daemon.llama.engine", "daemon.runners.process", "daemon.runners.protocol"} <= names


@pytest.mark.parametrize(("name", "path"), MODULES, ids=[name for name, _ in MODULES])
def test_only_the_child_side_imports_numpy_or_llama_cpp(name: str, path: Path) -> None:
    if name == CHILD or name.startswith(CHILD + "."):
        return
    native = {m for m in imported(path) if m.split(".")[0] in NATIVE}
    assert not native, f"{name} imports {sorted(native)}: only the runner child ({CHILD}) may"


@pytest.mark.parametrize(
    ("name", "path"), [(n, p) for n, p in MODULES if n.startswith(CHILD + ".")], ids=lambda x: str(x)
)
def test_the_child_side_takes_only_the_protocol_from_the_project(name: str, path: Path) -> None:
    ours = {m for m in imported(path) if m.split(".")[0] in PACKAGES and not m.startswith(CHILD)}
    assert ours <= CHILD_MAY_IMPORT, f"{name} imports {sorted(ours - CHILD_MAY_IMPORT)} from the daemon's side"


@pytest.mark.parametrize(
    ("name", "path"), [(n, p) for n, p in MODULES if not n.startswith(CHILD)], ids=lambda x: str(x)
)
def test_the_daemon_side_never_imports_the_child_side(name: str, path: Path) -> None:
    child = {m for m in imported(path) if m == CHILD or m.startswith(CHILD + ".")}
    assert not child, f"{name} imports {sorted(child)}: the daemon runs the child side as a process"


def test_the_protocol_module_is_pure() -> None:
    """Both sides import it: the standard library and the option defaults only."""
    path = ROOT / "daemon" / "runners" / "protocol.py"
    ours = {m for m in imported(path) if m.split(".")[0] in PACKAGES}
    assert ours <= {"modelfile.params"}, ours
    assert not {m for m in imported(path) if m.split(".")[0] in NATIVE}


def test_the_store_module_is_pure() -> None:
    """The runner child and the daemon both import the prompt cache's store: the standard library only."""
    path = ROOT / "daemon" / "runners" / "kvstore.py"
    found = imported(path)
    assert not {m for m in found if m.split(".")[0] in PACKAGES}, found
    assert not {m for m in found if m.split(".")[0] in NATIVE}, found
