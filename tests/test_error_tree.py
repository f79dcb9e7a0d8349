"""The exception tree (issue 26): every :class:`CorralError` subclass in the project is drawn in ``errors``'s
docstring, where it lives, under its parent, with the HTTP status the daemon answers it with; that status comes from
one place (``daemon/api/errors.py``), and the CLI's message from one place (``cli/errors.py``).

The classes are found by importing every module of the five packages, so a new error class anywhere fails here until
it is drawn, and a drawn class that no longer exists fails too."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path
from types import ModuleType

import pytest

import errors
from cli.errors import HINTS, render_error
from daemon.api.errors import SHAPE_STATUS, STATUS_TABLE, status_for, status_of
from errors import CorralError

PACKAGES = ("errors", "daemon", "cli", "modelfile", "registry")
ROOT = Path(__file__).resolve().parent.parent
HTTP_MAPPING = ROOT / "daemon" / "api" / "errors.py"
CLI_MAPPING = ROOT / "cli" / "errors.py"

# `    │   ├── Name   400 meaning [where.it.lives]`: the tree's characters give the depth (4 per level)
_DRAWN = re.compile(r"^    (?P<tree>(?:[│ ]   )*(?:[├└]── )?)(?P<name>[A-Z]\w+)\s+(?P<status>\d{3})\b(?P<rest>.*)$")
_WHERE = re.compile(r"\[(?P<module>[a-z_][\w.]*)\]\s*$")


def _modules() -> list[ModuleType]:
    """Every module of the project, imported (``__main__`` modules run the CLI when imported, so not those)."""
    out = []
    for name in PACKAGES:
        package = importlib.import_module(name)
        out.append(package)
        for info in pkgutil.walk_packages(package.__path__, f"{name}."):
            if not info.name.endswith(".__main__"):
                out.append(importlib.import_module(info.name))
    return out


MODULES = _modules()


def _project_errors() -> dict[str, type[CorralError]]:
    found: dict[str, type[CorralError]] = {}
    todo: list[type[CorralError]] = [CorralError]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] not in PACKAGES:
            continue  # a test's own subclass
        assert found.setdefault(cls.__name__, cls) is cls, f"two error classes named {cls.__name__}"
        todo.extend(cls.__subclasses__())
    return found


ERRORS = _project_errors()


class Drawn:
    def __init__(self, name: str, status: int, module: str, parent: str | None) -> None:
        self.name, self.status, self.module, self.parent = name, status, module, parent


def _drawing() -> dict[str, Drawn]:
    drawn: dict[str, Drawn] = {}
    parents: list[str] = []  # the names on the path to the current line, by depth
    for line in (errors.__doc__ or "").splitlines():
        m = _DRAWN.match(line)
        if m is None:
            continue
        depth = len(m["tree"]) // 4
        del parents[depth:]
        where = _WHERE.search(m["rest"])
        assert m["name"] not in drawn, f"{m['name']} is drawn twice"
        drawn[m["name"]] = Drawn(
            m["name"], int(m["status"]), where["module"] if where else "errors", parents[-1] if parents else None
        )
        parents.append(m["name"])
    return drawn


DRAWING = _drawing()


def test_the_walk_finds_the_errors_of_every_package() -> None:
    assert len(MODULES) > 100
    homes = {cls.__module__.split(".")[0] for cls in ERRORS.values()}
    assert homes == {"errors", "daemon", "cli", "modelfile", "registry"}


def test_every_error_class_is_drawn_and_every_drawn_class_exists() -> None:
    assert sorted(set(ERRORS) - set(DRAWING)) == [], "error classes missing from the drawing in errors/__init__.py"
    assert sorted(set(DRAWING) - set(ERRORS)) == [], "the drawing in errors/__init__.py names classes that are gone"


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_the_drawing_says_where_each_class_lives_and_under_which_parent(name: str) -> None:
    cls, drawn = ERRORS[name], DRAWING[name]
    assert drawn.module == cls.__module__
    parent = cls.__base__ if cls is not CorralError else None
    assert drawn.parent == (parent.__name__ if parent is not None else None)


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_the_drawing_gives_the_status_the_daemon_answers(name: str) -> None:
    cls = ERRORS[name]
    assert DRAWING[name].status == status_of(cls)
    # an instance its type's status: made without its constructor, which takes different arguments per class
    assert status_for(cls.__new__(cls)) == status_of(cls)


def test_a_status_given_over_the_wire_wins_over_the_type() -> None:
    from errors import InvalidRequest, NotFound

    assert status_for(NotFound("gone")) == 404
    assert status_for(CorralError("refused", status=401)) == 401
    assert status_for(InvalidRequest("too big", status=413)) == 413


def test_anthropic_s_shape_answers_an_overfull_body_413() -> None:
    from daemon.api.bodies import BodyTooLarge

    assert status_of(BodyTooLarge) == 400
    assert status_of(BodyTooLarge, shape="anthropic") == 413
    assert status_for(BodyTooLarge("big", status=400), shape="anthropic") == 413
    assert status_for(ValueError("not ours"), shape="anthropic") == 500


def test_every_row_of_the_status_table_can_match() -> None:
    """Most specific first: a row under a row for one of its bases would never be reached."""
    for i, (kind, _code) in enumerate(STATUS_TABLE):
        earlier = [k.__name__ for k, _ in STATUS_TABLE[:i] if issubclass(kind, k)]
        assert earlier == [], f"{kind.__name__} is shadowed by {earlier}"
    for rows in SHAPE_STATUS.values():
        assert all(issubclass(kind, CorralError) for kind, _ in rows)


def _error_names(tree: ast.AST) -> set[str]:
    return {
        n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(tree) if isinstance(n, ast.Name | ast.Attribute)
    }


def _sets_a_status(function: ast.AST) -> bool:
    """A status literal (4xx/5xx) assigned to ``status``/``status_code`` or passed as one."""
    for node in ast.walk(function):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id if isinstance(t, ast.Name) else getattr(t, "attr", "") for t in targets}
            value = node.value
        elif isinstance(node, ast.keyword):
            names, value = {node.arg or ""}, node.value
        else:
            continue
        if names & {"status", "status_code"} and isinstance(value, ast.Constant) and value.value in range(400, 600):
            return True
    return False


def _type_checks(function: ast.AST) -> set[str]:
    """The project's error classes this function tests an exception against with ``isinstance``."""
    out: set[str] = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            if len(node.args) == 2:
                out |= _error_names(node.args[1]) & (set(ERRORS) - {"CorralError"})
    return out


def _sources() -> list[Path]:
    return sorted({Path(m.__file__) for m in MODULES if m.__file__})


def test_no_second_place_picks_an_http_status_by_error_type() -> None:
    """Outside ``daemon/api/errors.py`` no function both tests an error's type and sets a status: an API's own
    status for a type goes in ``SHAPE_STATUS``, a type's own in its class body or ``STATUS_TABLE``."""
    found = []
    for path in _sources():
        if path == HTTP_MAPPING:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                checked = _type_checks(node)
                if checked and _sets_a_status(node):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({', '.join(sorted(checked))})")
    assert found == []


def test_the_cli_s_one_table_answers_every_error() -> None:
    """Every error reaches a row of ``cli.errors.HINTS`` through its MRO (``CorralError``'s at the least), and the
    message is ``str(exc)``; no other CLI module picks words by an error's type."""
    assert all(issubclass(kind, CorralError) for kind in HINTS)
    for cls in ERRORS.values():
        assert any(kind in HINTS for kind in cls.__mro__), cls
    message, _hint = render_error(CorralError("the words", status=500))
    assert message == "the words"
    found = []
    for path in _sources():
        if path.is_relative_to(ROOT / "cli") and path != CLI_MAPPING:
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _type_checks(node):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert found == []
