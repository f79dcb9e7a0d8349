"""The ``corral`` command: a typer app over the daemon's HTTP API, and ``main()``, the CLI's one error boundary.

``main()`` prints a :class:`CorralError` as ``Error: <message>`` (plus a hint line, see ``cli.errors``) on stderr
and returns 1; with ``CORRAL_DEBUG`` set it prints the traceback first. Other exceptions are bugs and propagate.
Only ``serve`` imports the daemon (lazily), so this module never pulls in FastAPI, uvicorn or llama_cpp.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Mapping, Sequence
from typing import Annotated

import typer

from cli import output
from cli.commands import create, listing, manage, ps, run, serve, service, show, transfer, version
from cli.commands import login as login_cmd
from cli.commands import registry as registry_cmd
from cli.errors import render_error
from errors import CorralError

app = typer.Typer(
    name="corral",
    help="corral: run and manage local language models (an Ollama-compatible daemon and its client).",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version_callback(value: bool) -> None:
    if value:
        version.print_version()
        raise typer.Exit()


@app.callback()
def root(
    show_version: Annotated[
        bool,
        typer.Option("--version", "-v", is_eager=True, callback=_version_callback, help="Show the version and exit."),
    ] = False,
) -> None:
    """corral: run and manage local language models (an Ollama-compatible daemon and its client)."""


app.command("serve", help=serve.help_text())(serve.serve)
app.command("start", help=serve.help_text(), hidden=True)(serve.serve)
app.command("create")(create.create)
app.command("show")(show.show)
app.command("run")(run.run)
app.command("ps")(ps.ps)
app.command("stop")(ps.stop)
app.command("info")(ps.info)
app.command("list")(listing.list_models)
app.command("ls", hidden=True)(listing.list_models)
app.command("cp")(manage.copy)
app.command("rm")(manage.remove)
app.command("pull")(registry_cmd.pull)
app.command("push")(registry_cmd.push)
app.command("prune")(registry_cmd.prune)
app.command("export")(transfer.export)
app.command("import")(transfer.import_)
app.command("login")(login_cmd.login)
app.command("logout")(login_cmd.logout)
app.add_typer(service.app, name="service")


def debug_enabled(environ: Mapping[str, str]) -> bool:
    return environ.get("CORRAL_DEBUG", "").strip().lower() not in ("", "0", "false", "f", "no", "off")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (1 for a reported error, 130 when interrupted)."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=list(argv) if argv is not None else None, prog_name="corral", standalone_mode=False)
    except typer.TyperException as exc:  # usage errors: typer prints them its own way
        show = getattr(exc, "show", None)
        if callable(show):
            show()
        else:
            output.error(str(exc))
        return int(getattr(exc, "exit_code", 2))
    except (typer.Abort, KeyboardInterrupt):
        output.err()
        return 130
    except CorralError as exc:
        if debug_enabled(os.environ):
            traceback.print_exc()
        message, hint = render_error(exc)
        output.error(message, hint)
        return 1
    return result if isinstance(result, int) else 0
