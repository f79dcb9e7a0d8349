"""``corral service install|uninstall|status``: run corral as a systemd (Linux) or launchd (macOS) service."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import typer

from cli import service_units as units
from registry.errors import CorralError

app = typer.Typer(help="Run corral as a background service (systemd or launchd).", no_args_is_help=True)


class ServiceError(CorralError):
    """Installing or controlling the service failed; the message says what to run instead."""


@dataclass
class Plan:
    files: list[tuple[Path, bytes, int]] = field(default_factory=list)  # path, content, mode
    commands: list[list[str]] = field(default_factory=list)
    remove: list[Path] = field(default_factory=list)

    def show(self) -> str:
        out = []
        for path, content, _mode in self.files:
            out.append(f"# would write {path}")
            out.append(content.decode())
        for path in self.remove:
            out.append(f"# would remove {path}")
        for cmd in self.commands:
            out.append("$ " + " ".join(cmd))
        return "\n".join(out)


def corral_executable() -> str:
    """The ``corral`` of this environment (next to its Python), else the CLI run as a module."""
    candidate = Path(sys.executable).parent / "corral"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("corral")
    return found or f"{sys.executable} -m cli"


def _kind() -> str:
    system = platform.system()
    if system == "Darwin":
        return "launchd"
    if system == "Linux":
        return "systemd"
    raise ServiceError(f"corral service supports Linux (systemd) and macOS (launchd), not {system}; "
                       "run \"corral serve\" under your own supervisor instead")


def install_plan(scope: str, exe: str, home: Path) -> Plan:
    plan = Plan()
    if _kind() == "launchd":
        plist = home / "Library" / "LaunchAgents" / f"{units.LAUNCHD_LABEL}.plist"
        plan.files.append((plist, units.launchd_plist(exe, home), 0o644))
        plan.commands += [["mkdir", "-p", str(home / "Library" / "Logs" / "corral")],
                          ["launchctl", "load", "-w", str(plist)]]
        return plan
    if scope == "system":
        unit = Path("/etc/systemd/system/corral.service")
        plan.files += [(unit, units.system_unit(exe).encode(), 0o644),
                       (Path(units.SYSTEM_ENV_FILE), units.env_file().encode(), 0o640)]
        plan.commands += [
            ["useradd", "--system", "--user-group", "--home-dir", "/var/lib/corral", "--shell", "/usr/sbin/nologin",
             "corral"],
            ["install", "-d", "-o", "corral", "-g", "corral", "-m", "0750", units.SYSTEM_MODELS],
            ["systemctl", "daemon-reload"],
            ["systemctl", "enable", "--now", "corral.service"],
        ]
    else:
        unit = home / ".config" / "systemd" / "user" / "corral.service"
        plan.files += [(unit, units.user_unit(exe).encode(), 0o644),
                       (home / ".config" / "corral" / "corral.env", units.env_file().encode(), 0o600)]
        plan.commands += [["systemctl", "--user", "daemon-reload"],
                          ["systemctl", "--user", "enable", "--now", "corral.service"]]
    return plan


def uninstall_plan(scope: str, home: Path) -> Plan:
    plan = Plan()
    if _kind() == "launchd":
        plist = home / "Library" / "LaunchAgents" / f"{units.LAUNCHD_LABEL}.plist"
        plan.commands.append(["launchctl", "unload", "-w", str(plist)])
        plan.remove.append(plist)
    elif scope == "system":
        plan.commands += [["systemctl", "disable", "--now", "corral.service"]]
        plan.remove.append(Path("/etc/systemd/system/corral.service"))
        plan.commands.append(["systemctl", "daemon-reload"])
    else:
        plan.commands += [["systemctl", "--user", "disable", "--now", "corral.service"]]
        plan.remove.append(home / ".config" / "systemd" / "user" / "corral.service")
        plan.commands.append(["systemctl", "--user", "daemon-reload"])
    return plan


def _check_tools(plan: Plan, scope: str) -> None:
    for cmd in plan.commands:
        if cmd[0] in ("systemctl", "launchctl") and shutil.which(cmd[0]) is None:
            raise ServiceError(f"{cmd[0]} was not found, so corral cannot be installed as a service here; run "
                               "\"corral serve\" under your own supervisor (or use --dry-run to see the files)")
    if _kind() == "systemd" and not Path("/run/systemd/system").is_dir():
        raise ServiceError("systemd is not running on this machine (it is not PID 1, as in most containers), so "
                           "corral cannot be installed as a service here; run \"corral serve\" under your own "
                           "supervisor (or use --dry-run to see the files)")
    if scope == "system" and _kind() == "systemd" and os.geteuid() != 0:
        raise ServiceError("installing the system service needs root: run \"sudo corral service install --system\" "
                           "(or \"corral service install --user\" for your user only)")


def execute(plan: Plan, scope: str) -> None:
    _check_tools(plan, scope)
    for path, content, mode in plan.files:
        if path.name.endswith(".env") and path.exists():
            typer.echo(f"kept {path} (already there)")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(content)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
        typer.echo(f"wrote {path}")
    for cmd in plan.commands:
        if cmd[0] == "useradd" and subprocess.run(["id", "corral"], capture_output=True).returncode == 0:
            continue
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise ServiceError(f"\"{' '.join(cmd)}\" failed: {(r.stderr or r.stdout).strip()}")
        typer.echo("ran " + " ".join(cmd))
    for path in plan.remove:
        if path.exists():
            path.unlink()
            typer.echo(f"removed {path}")


Scope = Annotated[bool, typer.Option("--system", help="Install for the whole machine (root; Linux).")]
User = Annotated[bool, typer.Option("--user", help="Install for this user only (the default).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the files and commands; change nothing.")]


def _scope(system: bool, user: bool) -> str:
    if system and user:
        raise ServiceError("choose one of --user and --system")
    return "system" if system else "user"


@app.command("install")
def install(user: User = False, system: Scope = False, dry_run: DryRun = False) -> None:
    """Write the service definition for this platform, then enable and start it."""
    scope = _scope(system, user)
    plan = install_plan(scope, corral_executable(), Path.home())
    if dry_run:
        typer.echo(plan.show())
        return
    execute(plan, scope)
    typer.echo(f"corral is installed as a {scope} service; \"corral service status\" shows it")


@app.command("uninstall")
def uninstall(user: User = False, system: Scope = False, dry_run: DryRun = False) -> None:
    """Stop and disable the service and remove its definition (models are kept)."""
    scope = _scope(system, user)
    plan = uninstall_plan(scope, Path.home())
    if dry_run:
        typer.echo(plan.show())
        return
    execute(plan, scope)


@app.command("status")
def status(user: User = False, system: Scope = False) -> None:
    """Show whether the service is installed and running."""
    scope = _scope(system, user)
    if _kind() == "launchd":
        cmd = ["launchctl", "list", units.LAUNCHD_LABEL]
    else:
        cmd = ["systemctl"] + ([] if scope == "system" else ["--user"]) + ["status", "--no-pager", "corral.service"]
    if shutil.which(cmd[0]) is None:
        raise ServiceError(f"{cmd[0]} was not found: corral is not running as a service here")
    r = subprocess.run(cmd, capture_output=True, text=True)
    typer.echo((r.stdout or r.stderr).rstrip())
