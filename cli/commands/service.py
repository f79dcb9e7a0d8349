"""``corral service install|uninstall|status``: run corral as a systemd (Linux) or launchd (macOS) service."""

from __future__ import annotations

import grp
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
from errors import CorralError

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
    raise ServiceError(
        f"corral service supports Linux (systemd) and macOS (launchd), not {system}; "
        'run "corral serve" under your own supervisor instead'
    )


def _env_file_value(path: Path, key: str) -> str:
    """``key``'s value in a systemd EnvironmentFile (the last assignment wins, as in systemd); "" if none."""
    try:
        text = path.read_text()
    except OSError:
        return ""
    value = ""
    for line in text.splitlines():
        name, sep, raw = line.strip().partition("=")
        if sep and name.strip() == key:
            value = raw.strip().strip("\"'").strip()
    return value


def _env_path(scope: str, home: Path) -> Path:
    return Path(units.SYSTEM_ENV_FILE) if scope == "system" else home / ".config" / "corral" / "corral.env"


def _memory_max(scope: str, home: Path, environ: dict[str, str]) -> int | None:
    """MemoryMax= for the unit: CORRAL_RAM_BUDGET (from this environment, else the service's env file) plus
    headroom for the daemon and the runners' own memory; None (no limit) without a budget."""
    from daemon.settings import parse_bytes

    raw = environ.get("CORRAL_RAM_BUDGET", "").strip() or _env_file_value(_env_path(scope, home), "CORRAL_RAM_BUDGET")
    return parse_bytes(raw, "CORRAL_RAM_BUDGET") + units.MEMORY_HEADROOM if raw else None


def _api_key_file(explicit: str | None, environ: dict[str, str]) -> str | None:
    """The key file the system unit hands over with LoadCredential=: --api-key-file, else CORRAL_API_KEY_FILE of
    this environment, else /etc/corral/api_key if it exists. Checked now because systemd refuses to start a unit
    whose credential source is missing. (Not CORRAL_API_KEY_FILE from corral.env: set there, it would override
    the credential's path at run time anyway.)"""
    chosen = explicit or environ.get("CORRAL_API_KEY_FILE", "").strip()
    if not chosen:
        return units.SYSTEM_API_KEY_FILE if Path(units.SYSTEM_API_KEY_FILE).is_file() else None
    path = Path(chosen).expanduser().absolute()
    if not path.is_file():
        raise ServiceError(
            f'the API key file "{path}" does not exist; create it (the key on its first line, '
            "mode 0600, owned by root) or leave it out"
        )
    return str(path)


def _gpu_groups() -> list[str]:
    """The groups that own GPU device nodes here (render: /dev/kfd, /dev/dri/renderD*; video: /dev/dri/card*)."""
    found = []
    for name in ("render", "video"):
        try:
            grp.getgrnam(name)
        except KeyError:
            continue
        found.append(name)
    return found


def install_plan(
    scope: str, exe: str, home: Path, *, environ: dict[str, str] | None = None, api_key_file: str | None = None
) -> Plan:
    environ = dict(os.environ if environ is None else environ)
    plan = Plan()
    if _kind() == "launchd":
        plist = home / "Library" / "LaunchAgents" / f"{units.LAUNCHD_LABEL}.plist"
        plan.files.append((plist, units.launchd_plist(exe, home), 0o644))
        plan.commands += [
            ["mkdir", "-p", str(home / "Library" / "Logs" / "corral")],
            ["launchctl", "load", "-w", str(plist)],
        ]
        return plan
    if scope == "system":
        unit = Path("/etc/systemd/system/corral.service")
        text = units.system_unit(
            exe, memory_max=_memory_max(scope, home, environ), api_key_file=_api_key_file(api_key_file, environ)
        )
        plan.files += [(unit, text.encode(), 0o644), (Path(units.SYSTEM_ENV_FILE), units.env_file().encode(), 0o640)]
        plan.commands.append(
            [
                "useradd",
                "--system",
                "--user-group",
                "--home-dir",
                "/var/lib/corral",
                "--shell",
                "/usr/sbin/nologin",
                "corral",
            ]
        )
        if groups := _gpu_groups():  # the GPU nodes' file permissions; DevicePolicy= admits only the GPU nodes
            plan.commands.append(["usermod", "--append", "--groups", ",".join(groups), "corral"])
        plan.commands += [
            ["install", "-d", "-o", "corral", "-g", "corral", "-m", "0700", units.SYSTEM_MODELS],
            ["systemctl", "daemon-reload"],
            ["systemctl", "enable", "--now", "corral.service"],
        ]
    else:
        unit = home / ".config" / "systemd" / "user" / "corral.service"
        if api_key_file:
            raise ServiceError(
                "--api-key-file is for --system; a user service reads CORRAL_API_KEY_FILE from "
                "~/.config/corral/corral.env"
            )
        text = units.user_unit(exe, memory_max=_memory_max(scope, home, environ))
        plan.files += [
            (unit, text.encode(), 0o644),
            (home / ".config" / "corral" / "corral.env", units.env_file().encode(), 0o600),
        ]
        plan.commands += [
            ["systemctl", "--user", "daemon-reload"],
            ["systemctl", "--user", "enable", "--now", "corral.service"],
        ]
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
            raise ServiceError(
                f"{cmd[0]} was not found, so corral cannot be installed as a service here; run "
                '"corral serve" under your own supervisor (or use --dry-run to see the files)'
            )
    if _kind() == "systemd" and not Path("/run/systemd/system").is_dir():
        raise ServiceError(
            "systemd is not running on this machine (it is not PID 1, as in most containers), so "
            'corral cannot be installed as a service here; run "corral serve" under your own '
            "supervisor (or use --dry-run to see the files)"
        )
    if scope == "system" and _kind() == "systemd" and os.geteuid() != 0:
        raise ServiceError(
            'installing the system service needs root: run "sudo corral service install --system" '
            '(or "corral service install --user" for your user only)'
        )


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
            raise ServiceError(f'"{" ".join(cmd)}" failed: {(r.stderr or r.stdout).strip()}')
        typer.echo("ran " + " ".join(cmd))
    for path in plan.remove:
        if path.exists():
            path.unlink()
            typer.echo(f"removed {path}")


Scope = Annotated[bool, typer.Option("--system", help="Install for the whole machine (root; Linux).")]
User = Annotated[bool, typer.Option("--user", help="Install for this user only (the default).")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the files and commands; change nothing.")]
KeyFile = Annotated[
    str | None,
    typer.Option(
        "--api-key-file",
        help="Hand this key file to the system service as a systemd credential (default: "
        f"CORRAL_API_KEY_FILE, else {units.SYSTEM_API_KEY_FILE} if it exists).",
    ),
]


def _scope(system: bool, user: bool) -> str:
    if system and user:
        raise ServiceError("choose one of --user and --system")
    return "system" if system else "user"


@app.command("install")
def install(user: User = False, system: Scope = False, dry_run: DryRun = False, api_key_file: KeyFile = None) -> None:
    """Write the service definition for this platform, then enable and start it.

    The systemd unit's MemoryMax= is CORRAL_RAM_BUDGET (from this environment or the service's env file) plus
    2 GiB; install again after changing the budget."""
    scope = _scope(system, user)
    plan = install_plan(scope, corral_executable(), Path.home(), api_key_file=api_key_file)
    if dry_run:
        typer.echo(plan.show())
        return
    execute(plan, scope)
    typer.echo(f'corral is installed as a {scope} service; "corral service status" shows it')


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
