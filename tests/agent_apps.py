"""The agent apps users point at corral (Codex CLI, Claude Code), installed from npm by scripts/fetch_apps.sh
into the test cache, and a clean environment to run them in: a temporary HOME, loopback only, no telemetry."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.models import cache_dir


def app_binary(name: str) -> Path | None:
    """``codex`` or ``claude`` from scripts/fetch_apps.sh's folder, if it has run (scripts/setup runs it)."""
    p = cache_dir() / "apps" / "node_modules" / ".bin" / name
    return p if p.is_file() and os.access(p, os.X_OK) and shutil.which("node") else None


def app_env(home: Path, **extra: str) -> dict[str, str]:
    """The environment for an app run: a fresh HOME, the PATH (for node), nothing of the caller's API keys or
    proxies, and the apps' switches that keep them off the network and out of interactive first-run prompts."""
    home.mkdir(parents=True, exist_ok=True)
    env = {
        "HOME": str(home),
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "LANG": "C.UTF-8",
        "NO_PROXY": "127.0.0.1,localhost",
        "CODEX_HOME": str(home / ".codex"),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CI": "1",
    }
    env.update(extra)
    return env
