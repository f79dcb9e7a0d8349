"""The service units' sandboxing: systemd-analyze verify and security judge the generated units.

systemd-analyze is installed by .ci/run where it is missing; these tests skip without it only outside CI
(CI=true turns the skip into a failure, so CI cannot pass without having checked the units).
"""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from cli import service_units as units
from cli.commands import service
from tests.conftest import REPO

MAX_EXPOSURE = 4.5  # systemd-analyze calls 0-4.5 "OK"
PACKAGING = REPO / "packaging"


def systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
            pytest.fail("systemd-analyze is missing in CI: .ci/run installs the systemd package for it")
        pytest.skip("systemd-analyze not installed (apt-get install systemd)")
    return path


def _executable() -> str:
    """An executable that exists, for ExecStart= (verify checks it)."""
    return shutil.which("true") or "/bin/true"


def _analyze(
    tmp_path: Path, args: list[str], unit: str, name: str = "corral.service", user: bool = False
) -> subprocess.CompletedProcess[str]:
    path = tmp_path / name
    path.write_text(unit)
    env = dict(os.environ)
    if user:  # the --user manager's paths need a runtime directory; keep them away from this user's own units
        runtime = tmp_path / "runtime"
        runtime.mkdir(mode=0o700, exist_ok=True)
        env.update(XDG_RUNTIME_DIR=str(runtime), HOME=str(tmp_path))
        for key in ("XDG_CONFIG_HOME", "XDG_DATA_HOME"):
            env.pop(key, None)
    cmd = [systemd_analyze(), *(["--user"] if user else []), *args, str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def _exposure(r: subprocess.CompletedProcess[str]) -> float:
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", r.stdout + r.stderr)
    assert m, f"no overall exposure in systemd-analyze security's output:\n{r.stdout}\n{r.stderr}"
    return float(m.group(1))


SYSTEM_VARIANTS: dict[str, Callable[[str], str]] = {
    "plain": lambda exe: units.system_unit(exe),
    "budget+key": lambda exe: units.system_unit(exe, memory_max=10 << 30, api_key_file="/etc/corral/api_key"),
}


@pytest.mark.parametrize("variant", list(SYSTEM_VARIANTS))
def test_system_unit_exposure_is_ok(tmp_path: Path, variant: str) -> None:
    r = _analyze(tmp_path, ["security", "--offline=true"], SYSTEM_VARIANTS[variant](_executable()))
    exposure = _exposure(r)
    print(f"systemd-analyze security: {variant} system unit exposure {exposure}")
    assert exposure <= MAX_EXPOSURE, r.stdout


def test_user_unit_exposure(tmp_path: Path) -> None:
    # systemd-analyze scores a user unit as if it ran as root; 9.4 before the sandboxing, 4.8 with it
    r = _analyze(tmp_path, ["security", "--offline=true"], units.user_unit(_executable()), user=True)
    exposure = _exposure(r)
    print(f"systemd-analyze security --user: user unit exposure {exposure}")
    assert exposure <= 6.0, r.stdout


@pytest.mark.parametrize(
    "render,user",
    [
        (SYSTEM_VARIANTS["plain"], False),
        (SYSTEM_VARIANTS["budget+key"], False),
        (units.user_unit, True),
        (lambda exe: units.user_unit(exe, memory_max=3 << 30), True),
    ],
)
def test_units_verify(tmp_path: Path, render: Callable[[str], str], user: bool) -> None:
    """verify passes, and says nothing about the unit (an unknown or misspelt key is only a warning there)."""
    r = _analyze(tmp_path, ["verify"], render(_executable()), user=user)
    assert r.returncode == 0, r.stderr
    complaints = [line for line in (r.stdout + r.stderr).splitlines() if "corral.service" in line]
    assert not complaints, "\n".join(complaints)


def test_verify_check_has_teeth(tmp_path: Path) -> None:
    r = _analyze(tmp_path, ["verify"], units.system_unit(_executable()) + "MemoryDenyWriteExecut=true\n")
    assert "corral.service" in r.stdout + r.stderr and "MemoryDenyWriteExecut" in r.stdout + r.stderr


def _settings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            out.setdefault(key, []).append(value)
    return out


def test_system_unit_settings() -> None:
    s = _settings(units.system_unit("/opt/corral/venv/bin/corral"))
    for key, value in {
        "CapabilityBoundingSet": "",
        "AmbientCapabilities": "",
        "RestrictNamespaces": "true",
        "ProtectClock": "true",
        "ProtectKernelLogs": "true",
        "ProtectHostname": "true",
        "ProtectProc": "invisible",
        "PrivateIPC": "true",
        "UMask": "0077",
        "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "SystemCallErrorNumber": "EPERM",
        "PrivateDevices": "false",
        "DevicePolicy": "closed",
        "TasksMax": "4096",
        "LimitNOFILE": "65536",
        "ProtectSystem": "strict",
        "ReadWritePaths": "/var/lib/corral",
        "StateDirectory": "corral",
        "PrivateTmp": "true",
        "NoNewPrivileges": "true",
        "RemoveIPC": "true",
        "RestrictSUIDSGID": "true",
        "LockPersonality": "true",
        "RestrictRealtime": "true",
        "SystemCallArchitectures": "native",
        "KeyringMode": "private",
        "ProtectKernelTunables": "true",
        "ProtectKernelModules": "true",
        "ProtectControlGroups": "true",
    }.items():
        assert s.get(key) == [value], key
    assert "@system-service" in s["SystemCallFilter"]
    assert not any("@resources" in f for f in s["SystemCallFilter"])  # llama.cpp's threads pin CPUs
    assert s["DeviceAllow"] == ["char-nvidia* rw", "char-kfd rw", "char-drm rw"]
    for absent in ("MemoryDenyWriteExecute", "ProcSubset", "MemoryMax", "LoadCredential"):
        assert absent not in s, absent
    assert "CORRAL_API_KEY_FILE=%d/api_key" not in s["Environment"]


def test_system_unit_budget_and_credential() -> None:
    s = _settings(units.system_unit("/x/corral", memory_max=12 << 30, api_key_file="/etc/corral/api_key"))
    assert s["MemoryMax"] == [str(12 << 30)]
    assert s["LoadCredential"] == ["api_key:/etc/corral/api_key"]
    assert "CORRAL_API_KEY_FILE=%d/api_key" in s["Environment"]


def test_user_unit_settings() -> None:
    s = _settings(units.user_unit("%h/bin/corral"))
    for key in ("NoNewPrivileges", "RestrictNamespaces", "LockPersonality", "RestrictSUIDSGID", "PrivateTmp"):
        assert s[key] == ["true"], key
    assert s["UMask"] == ["0077"] and s["SystemCallErrorNumber"] == ["EPERM"]
    # nothing that would hide the user's models or GPUs, or that a user manager cannot apply
    for absent in (
        "ProtectSystem",
        "ProtectHome",
        "DevicePolicy",
        "PrivateDevices",
        "CapabilityBoundingSet",
        "ProtectProc",
        "MemoryDenyWriteExecute",
        "User",
    ):
        assert absent not in s, absent


def test_plist_limits() -> None:
    data = plistlib.loads(units.launchd_plist("/u/bin/corral", Path("/Users/me")))
    assert data["Umask"] == 0o077 and data["ProcessType"] == "Standard"
    assert data["SoftResourceLimits"] == data["HardResourceLimits"] == {"NumberOfFiles": units.LAUNCHD_NOFILE}
    assert "LowPriorityIO" not in data and data["ExitTimeOut"] == 30


def test_packaging_is_regenerated() -> None:
    for rel, content in units.packaging_files().items():
        assert (PACKAGING / rel).read_bytes() == content, f"packaging/{rel}: run python -m cli.service_units"
    readme = (PACKAGING / "README.md").read_text()
    for why in (
        "MemoryDenyWriteExecute",
        "PrivateDevices=false",
        "DevicePolicy=closed",
        "ProcSubset=pid",
        "LoadCredential",
    ):
        assert why in readme, why


# ---- corral service install: MemoryMax from the budget, the key as a credential ----

linux_only = pytest.mark.skipif(
    not Path("/proc").is_dir() or os.uname().sysname != "Linux", reason="the systemd plan is made on Linux"
)


def _unit_text(plan: service.Plan) -> str:
    return next(content.decode() for path, content, _ in plan.files if path.name == "corral.service")


@linux_only
def test_install_memory_max_from_budget(tmp_path: Path) -> None:
    plan = service.install_plan("user", "/x/corral", tmp_path, environ={"CORRAL_RAM_BUDGET": "8GiB"})
    assert f"MemoryMax={(8 << 30) + (2 << 30)}" in _unit_text(plan).splitlines()
    plan = service.install_plan("user", "/x/corral", tmp_path, environ={})
    assert not any(line.startswith("MemoryMax=") for line in _unit_text(plan).splitlines())
    env = tmp_path / ".config" / "corral" / "corral.env"  # the service's env file counts too
    env.parent.mkdir(parents=True)
    env.write_text("#CORRAL_RAM_BUDGET=\nCORRAL_RAM_BUDGET=4GiB\n")
    plan = service.install_plan("user", "/x/corral", tmp_path, environ={})
    assert f"MemoryMax={6 << 30}" in _unit_text(plan).splitlines()


@linux_only
def test_install_bad_budget_is_refused(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="CORRAL_RAM_BUDGET"):
        service.install_plan("user", "/x/corral", tmp_path, environ={"CORRAL_RAM_BUDGET": "lots"})


@linux_only
def test_install_system_credential_only_for_an_existing_key_file(tmp_path: Path) -> None:
    key = tmp_path / "api_key"
    key.write_text("secret\n")
    plan = service.install_plan("system", "/x/corral", tmp_path, environ={}, api_key_file=str(key))
    lines = _unit_text(plan).splitlines()
    assert f"LoadCredential=api_key:{key}" in lines and "Environment=CORRAL_API_KEY_FILE=%d/api_key" in lines
    plan = service.install_plan("system", "/x/corral", tmp_path, environ={"CORRAL_API_KEY_FILE": str(key)})
    assert f"LoadCredential=api_key:{key}" in _unit_text(plan).splitlines()
    with pytest.raises(service.ServiceError, match="does not exist"):
        service.install_plan("system", "/x/corral", tmp_path, environ={}, api_key_file=str(tmp_path / "nope"))
    if not Path(units.SYSTEM_API_KEY_FILE).exists() and not Path(units.SYSTEM_ENV_FILE).exists():
        plan = service.install_plan("system", "/x/corral", tmp_path, environ={})
        assert not any(line.startswith("LoadCredential=") for line in _unit_text(plan).splitlines())
    with pytest.raises(service.ServiceError, match="--system"):
        service.install_plan("user", "/x/corral", tmp_path, environ={}, api_key_file=str(key))


@linux_only
def test_install_system_store_is_private() -> None:
    plan = service.install_plan("system", "/x/corral", Path("/nonexistent"), environ={})
    assert ["install", "-d", "-o", "corral", "-g", "corral", "-m", "0700", units.SYSTEM_MODELS] in plan.commands
    assert "StateDirectoryMode=0700" in _unit_text(plan).splitlines()
