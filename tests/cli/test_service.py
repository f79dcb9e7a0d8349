"""Service units, the LaunchAgent plist, and `corral service install --dry-run` (systemd-analyze verify and
security: test_service_hardening.py)."""

from __future__ import annotations

import plistlib
import subprocess
import sys
from pathlib import Path

import pytest

from cli import service_units as units
from tests.conftest import REPO

PACKAGING = REPO / "packaging"


def test_unit_hardening_and_restart() -> None:
    text = units.system_unit("/opt/corral/venv/bin/corral")
    for line in [
        "User=corral",
        "Restart=always",
        "NoNewPrivileges=true",
        "ProtectSystem=strict",
        "ReadWritePaths=/var/lib/corral",
        "PrivateTmp=true",
        f"EnvironmentFile=-{units.SYSTEM_ENV_FILE}",
        "ExecStart=/opt/corral/venv/bin/corral serve",
        "Environment=CORRAL_MODELS=/var/lib/corral/models",
    ]:
        assert line in text.splitlines()


def test_packaging_files_are_the_rendered_ones() -> None:
    assert (PACKAGING / "systemd/corral.service").read_text() == units.system_unit(units.PACKAGED_SYSTEM_EXEC)
    assert (PACKAGING / "systemd/corral-user.service").read_text() == units.user_unit(units.PACKAGED_USER_EXEC)
    assert (PACKAGING / "corral.env").read_text() == units.env_file()


def test_plist() -> None:
    data = plistlib.loads(units.launchd_plist("/u/bin/corral", Path("/Users/me")))
    assert data["Label"] == "ai.corral.daemon" and data["KeepAlive"] is True and data["RunAtLoad"] is True
    assert data["ProgramArguments"] == ["/u/bin/corral", "serve"]
    assert data["StandardOutPath"].startswith("/Users/me/Library/Logs/corral/")
    committed = plistlib.loads((PACKAGING / "launchd/ai.corral.daemon.plist").read_bytes())
    assert set(committed) == set(data)


def test_install_user_dry_run(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", "cli", "service", "install", "--user", "--dry-run"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert f"# would write {tmp_path}/.config/systemd/user/corral.service" in r.stdout
    assert "ExecStart=" in r.stdout and " serve" in r.stdout
    assert "$ systemctl --user enable --now corral.service" in r.stdout
    assert not (tmp_path / ".config").exists()  # nothing touched


def test_install_without_systemd_says_what_to_do(tmp_path: Path) -> None:
    if Path("/run/systemd/system").is_dir():
        pytest.skip("systemd is running here")
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", "cli", "service", "install", "--user"], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 1 and "corral serve" in r.stderr and "--dry-run" in r.stderr
    assert not (tmp_path / ".config").exists()
