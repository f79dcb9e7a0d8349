"""The service definitions corral installs: a systemd system unit, a systemd user unit, a launchd LaunchAgent.

Pure text rendering; ``cli/commands/service.py`` writes them and runs systemctl/launchctl. The copies in
``packaging/`` are these renderings (``python -m cli.service_units`` rewrites them; a test compares them), and
``packaging/README.md`` says why each non-obvious sandboxing choice is what it is.
"""

from __future__ import annotations

import plistlib
import sys
from pathlib import Path

SYSTEM_MODELS = "/var/lib/corral/models"
SYSTEM_ENV_FILE = "/etc/corral/corral.env"
SYSTEM_API_KEY_FILE = "/etc/corral/api_key"  # handed to the service with LoadCredential= when it exists
LAUNCHD_LABEL = "ai.corral.daemon"

MEMORY_HEADROOM = 2 << 30  # MemoryMax = CORRAL_RAM_BUDGET + this, for the daemon itself and the runners' overhead
TASKS_MAX = 4096
NOFILE = 65536  # open files: HTTP clients, model files, runner pipes
LAUNCHD_NOFILE = 10240  # macOS's usual kern.maxfilesperproc; launchd cannot raise a limit above it

# GPU device nodes, by their group in /proc/devices (a glob; "current and future devices of the group"): NVIDIA
# (nvidia = /dev/nvidia0.., /dev/nvidiactl, /dev/nvidia-modeset; nvidia-uvm = /dev/nvidia-uvm, -uvm-tools;
# nvidia-caps = MIG capabilities), AMD ROCm (kfd = /dev/kfd) and DRM (drm = /dev/dri/card*, renderD*: ROCm,
# Vulkan, SYCL/Level Zero). Anything else in /dev stays closed apart from what DevicePolicy=closed always admits
# (/dev/null, zero, full, random, urandom, tty, ptmx).
GPU_DEVICES = ("char-nvidia*", "char-kfd", "char-drm")

# seccomp, namespaces and the rest that a network daemon running llama.cpp on CPU or GPU does not need. Shared by
# the system and the user unit (a user manager applies these unprivileged thanks to NoNewPrivileges=true).
_COMMON_HARDENING = f"""\
NoNewPrivileges=true
LockPersonality=true
RestrictRealtime=true
RestrictSUIDSGID=true
RestrictNamespaces=true
KeyringMode=private
UMask=0077
LimitNOFILE={NOFILE}
TasksMax={TASKS_MAX}
# AF_NETLINK: psutil.net_if_addrs (which interfaces are loopback) asks the kernel over netlink
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
SystemCallArchitectures=native
# @system-service keeps @resources (sched_setaffinity, mbind, setpriority: llama.cpp threads, NUMA) and what
# the CUDA/ROCm user-space drivers use (ioctl, mmap, mremap, madvise); ~@privileged drops chown, setuid and the
# like, which corral never calls. A refused call fails with EPERM instead of killing the process.
SystemCallFilter=@system-service
SystemCallFilter=~@privileged
SystemCallErrorNumber=EPERM
# No MemoryDenyWriteExecute=: the GPU drivers (CUDA's PTX JIT, ROCm's comgr, Vulkan shader compilers) map
# memory writable and executable, so it would break GPU inference.
# OOMPolicy=continue: when the kernel OOM-kills one runner, the daemon reports that model's failure and keeps
# serving the others, instead of systemd stopping (and restarting) the whole service.
OOMPolicy=continue
"""


def _memory_max(memory_max: int | None) -> str:
    if memory_max is None:
        return (
            '# MemoryMax= is set by "corral service install" to CORRAL_RAM_BUDGET + 2 GiB when a budget is '
            "set;\n# without one, corral's own budget (free RAM less a reserve) is the limit.\n"
        )
    return f"MemoryMax={memory_max}\n"


def system_unit(exec_path: str, *, memory_max: int | None = None, api_key_file: str | None = None) -> str:
    """The system unit. ``memory_max``: bytes for MemoryMax= (unset: none). ``api_key_file``: a key file that
    exists (systemd refuses to start a unit whose LoadCredential= source is missing), handed over as a credential
    so it can stay root-only."""
    if api_key_file:
        credential = f"LoadCredential=api_key:{api_key_file}\nEnvironment=CORRAL_API_KEY_FILE=%d/api_key\n"
    else:
        credential = (
            f'# With {SYSTEM_API_KEY_FILE} present, "corral service install --system" adds:\n'
            f"#LoadCredential=api_key:{SYSTEM_API_KEY_FILE}\n"
            "#Environment=CORRAL_API_KEY_FILE=%d/api_key\n"
        )
    devices = "".join(f"DeviceAllow={d} rw\n" for d in GPU_DEVICES)
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
{credential}ExecStart={exec_path} serve
Restart=always
RestartSec=3
KillSignal=SIGTERM
TimeoutStopSec=30
{_memory_max(memory_max)}# Sandboxing: packaging/README.md says why each non-obvious setting is what it is.
{_COMMON_HARDENING}CapabilityBoundingSet=
AmbientCapabilities=
ProtectSystem=strict
ProtectHome=true
ReadWritePaths=/var/lib/corral
StateDirectory=corral
StateDirectoryMode=0700
PrivateTmp=true
PrivateMounts=true
PrivateIPC=true
RemoveIPC=true
ProtectKernelTunables=true
ProtectKernelModules=true
ProtectKernelLogs=true
ProtectControlGroups=true
ProtectClock=true
ProtectHostname=true
# No ProcSubset=pid: it hides /proc/meminfo, /proc/cpuinfo, /proc/stat and /proc/driver/nvidia, which psutil
# (RAM budget, CPU count, boot time), corral's CPU detection and the CUDA driver read.
ProtectProc=invisible
# PrivateDevices=true would hide the GPUs; DevicePolicy=closed denies every device node but the pseudo devices
# and the GPU groups below instead.
PrivateDevices=false
DevicePolicy=closed
{devices}
[Install]
WantedBy=multi-user.target
"""


def user_unit(exec_path: str, *, memory_max: int | None = None) -> str:
    """The user unit: the seccomp, namespace and resource settings a user manager can apply. Not ProtectSystem=,
    ProtectHome= or DevicePolicy=: the models live wherever the user keeps them (by default in the home
    directory), and a user manager cannot attach the device filter."""
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
{_memory_max(memory_max)}# Sandboxing: packaging/README.md says why each non-obvious setting is what it is.
{_COMMON_HARDENING}PrivateTmp=true
ProtectKernelTunables=true
ProtectKernelModules=true
ProtectKernelLogs=true
ProtectControlGroups=true
ProtectClock=true
ProtectHostname=true

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
    limits = {"NumberOfFiles": LAUNCHD_NOFILE}
    return plistlib.dumps(
        {
            "Label": LAUNCHD_LABEL,
            "ProgramArguments": [exec_path, "serve"],
            "RunAtLoad": True,
            "KeepAlive": True,
            # Standard, not Background: launchd throttles a Background job's CPU and I/O, which would slow inference
            # that a user is waiting for
            "ProcessType": "Standard",
            "Umask": 0o077,
            "SoftResourceLimits": limits,
            "HardResourceLimits": limits,
            "ExitTimeOut": 30,
            "StandardOutPath": str(logs / "corral.log"),
            "StandardErrorPath": str(logs / "corral.err.log"),
            "EnvironmentVariables": {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"},
        }
    )


# What packaging/ holds: the renderings for the usual install locations.
PACKAGED_SYSTEM_EXEC = "/opt/corral/venv/bin/corral"
PACKAGED_USER_EXEC = "%h/.local/share/corral/venv/bin/corral"


def packaging_files() -> dict[str, bytes]:
    """packaging/'s files (paths relative to it) as this module renders them."""
    return {
        "systemd/corral.service": system_unit(PACKAGED_SYSTEM_EXEC).encode(),
        "systemd/corral-user.service": user_unit(PACKAGED_USER_EXEC).encode(),
        f"launchd/{LAUNCHD_LABEL}.plist": launchd_plist(
            "/Users/me/.local/share/corral/venv/bin/corral", Path("/Users/me")
        ),
        "corral.env": env_file().encode(),
    }


def main() -> None:
    """``python -m cli.service_units``: rewrite packaging/ from these renderings."""
    root = Path(__file__).resolve().parent.parent / "packaging"
    for rel, content in packaging_files().items():
        path = root / rel
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)
            print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
