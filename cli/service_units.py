"""The service definitions corral installs: a systemd system unit, a systemd user unit, a launchd LaunchAgent.

Pure text rendering; ``cli/commands/service.py`` writes them and runs systemctl/launchctl.
"""

from __future__ import annotations

import plistlib
from pathlib import Path

SYSTEM_MODELS = "/var/lib/corral/models"
SYSTEM_ENV_FILE = "/etc/corral/corral.env"
LAUNCHD_LABEL = "ai.corral.daemon"


def system_unit(exec_path: str) -> str:
    return f"""[Unit]
Description=corral local model server
Documentation=https://github.com/corral/corral
After=network-online.target
Wants=network-online.target

[Service]
Type=exec
User=corral
Group=corral
Environment=CORRAL_MODELS={SYSTEM_MODELS}
Environment=HOME=/var/lib/corral
EnvironmentFile=-{SYSTEM_ENV_FILE}
ExecStart={exec_path} serve
Restart=always
RestartSec=3
KillSignal=SIGTERM
TimeoutStopSec=30
NoNewPrivileges=true
ProtectSystem=strict
ProtectHome=true
ReadWritePaths=/var/lib/corral
StateDirectory=corral
PrivateTmp=true
PrivateDevices=false
ProtectKernelTunables=true
ProtectKernelModules=true
ProtectControlGroups=true
RestrictSUIDSGID=true
LockPersonality=true
RestrictRealtime=true
SystemCallArchitectures=native

[Install]
WantedBy=multi-user.target
"""


def user_unit(exec_path: str) -> str:
    return f"""[Unit]
Description=corral local model server (user)
After=default.target

[Service]
Type=exec
EnvironmentFile=-%h/.config/corral/corral.env
ExecStart={exec_path} serve
Restart=always
RestartSec=3
KillSignal=SIGTERM
TimeoutStopSec=30
NoNewPrivileges=true
PrivateTmp=true

[Install]
WantedBy=default.target
"""


def env_file() -> str:
    from daemon.settings import ENV_DOCS

    lines = ["# corral settings, read by the service at start (restart it after a change).", ""]
    for key, (meaning, default) in ENV_DOCS.items():
        lines += [f"# {meaning} (default: {default})", f"#{key}=", ""]
    return "\n".join(lines)


def launchd_plist(exec_path: str, home: Path) -> bytes:
    logs = home / "Library" / "Logs" / "corral"
    return plistlib.dumps({
        "Label": LAUNCHD_LABEL,
        "ProgramArguments": [exec_path, "serve"],
        "RunAtLoad": True,
        "KeepAlive": True,
        "ProcessType": "Background",
        "StandardOutPath": str(logs / "corral.log"),
        "StandardErrorPath": str(logs / "corral.err.log"),
        "EnvironmentVariables": {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"},
    })
