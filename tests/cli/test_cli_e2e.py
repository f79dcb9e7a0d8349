"""The CLI end to end: ``python -m cli ...`` against a real ``corral serve`` with a temporary store."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cli.output import format_size
from tests.conftest import REPO, Daemon

MODELFILE = '''FROM ./tiny.gguf
SYSTEM """You are a terse assistant."""
TEMPLATE """{{ if .System }}<|system|>{{ .System }}{{ end }}<|user|>{{ .Prompt }}<|assistant|>"""
PARAMETER temperature 0.2
PARAMETER num_ctx 256
PARAMETER stop <|user|>
PARAMETER stop "<|end|>"
MESSAGE user Hello
MESSAGE assistant Hi there
LICENSE """Apache-2.0
test license"""
'''


def cli_in(daemon: Daemon, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI against ``daemon`` from another working directory."""
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], env=daemon.env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"rc={result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result


def snapshot(models: Path) -> dict[str, str]:
    return {
        str(p.relative_to(models)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(models.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def list_names(daemon: Daemon) -> list[str]:
    lines = ok(daemon.cli("list")).stdout.splitlines()
    assert lines[0].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    return [line.split()[0] for line in lines[1:]]


@pytest.fixture
def modelfile(tiny_gguf: Path) -> Path:
    path = tiny_gguf.parent / "Modelfile"
    path.write_text(MODELFILE)
    return path


def test_create_list_show_copy_remove(daemon: Daemon, modelfile: Path, tiny_gguf: Path) -> None:
    digest = hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    created = ok(daemon.cli("create", "mario", "-f", str(modelfile)))  # FROM ./tiny.gguf: relative to the Modelfile
    assert f"copying file sha256:{digest}" in created.stderr
    assert created.stderr.splitlines()[-1] == "success"

    listing = ok(daemon.cli("list")).stdout.splitlines()
    with daemon.client() as http:
        tags = http.get("/api/tags").json()["models"]
    row = listing[1].split()
    assert row[0] == "mario:latest"
    assert row[1] == tags[0]["digest"].removeprefix("sha256:")[:12]
    assert row[2:4] == format_size(tags[0]["size"]).split()
    assert listing[1].endswith("ago")

    assert ok(daemon.cli("show", "mario", "--system")).stdout == "You are a terse assistant.\n"
    assert ok(daemon.cli("show", "mario", "--template")).stdout == (
        "{{ if .System }}<|system|>{{ .System }}{{ end }}<|user|>{{ .Prompt }}<|assistant|>\n"
    )
    assert ok(daemon.cli("show", "mario", "--license")).stdout == "Apache-2.0\ntest license\n"
    params = [line.split(None, 1) for line in ok(daemon.cli("show", "mario", "--parameters")).stdout.splitlines()]
    assert sorted(params) == sorted(
        [["num_ctx", "256"], ["stop", '"<|user|>"'], ["stop", '"<|end|>"'], ["temperature", "0.2"]]
    )
    mf = ok(daemon.cli("show", "mario", "--modelfile")).stdout
    for needle in (
        "FROM ",
        "You are a terse assistant.",
        "PARAMETER num_ctx 256",
        "PARAMETER temperature 0.2",
        "MESSAGE user Hello",
        "MESSAGE assistant Hi there",
        "Apache-2.0",
    ):
        assert needle in mf

    summary = ok(daemon.cli("show", "mario")).stdout
    assert re.search(r"^  Model\n    architecture +llama\n", summary, re.M)
    assert "  Capabilities\n    completion\n" in summary
    assert re.search(r"^    num_ctx +256$", summary, re.M)
    assert "  System\n    You are a terse assistant.\n" in summary
    assert "  License\n    Apache-2.0\n    test license\n" in summary

    assert ok(daemon.cli("cp", "mario", "luigi")).stdout == "copied 'mario' to 'luigi'\n"
    assert sorted(list_names(daemon)) == ["luigi:latest", "mario:latest"]
    assert len(ok(daemon.cli("ls", "LUI")).stdout.splitlines()) == 2  # prefix filter, case-insensitive

    removed = ok(daemon.cli("rm", "mario", "luigi"))
    assert removed.stdout == "deleted 'mario'\ndeleted 'luigi'\n"
    assert "Warning" not in removed.stderr
    assert list_names(daemon) == []


def test_second_create_does_not_upload_again(daemon: Daemon, modelfile: Path) -> None:
    first = ok(daemon.cli("create", "mario", "-f", str(modelfile)))
    assert "copying file" in first.stderr
    before = snapshot(daemon.models / "blobs")
    second = ok(daemon.cli("create", "mario2", "-f", str(modelfile)))
    assert "copying file" not in second.stderr
    assert second.stderr.splitlines()[-1] == "success"
    assert snapshot(daemon.models / "blobs") == before  # same layers, nothing new
    assert sorted(list_names(daemon)) == ["mario2:latest", "mario:latest"]


def test_default_modelfile_and_from_a_model_name(daemon: Daemon, modelfile: Path) -> None:
    ok(cli_in(daemon, modelfile.parent, "create", "base"))  # ./Modelfile by default
    child = modelfile.parent / "child"
    child.mkdir()
    (child / "Modelfile").write_text('FROM base\nSYSTEM """Be brief."""\n')
    ok(cli_in(daemon, child, "create", "me/child:v1"))
    assert ok(daemon.cli("show", "me/child:v1", "--system")).stdout == "Be brief.\n"
    assert ok(daemon.cli("show", "me/child:v1", "--template")).stdout.startswith("{{ if .System }}")


def test_malformed_modelfile_changes_nothing(daemon: Daemon, tiny_gguf: Path) -> None:
    (tiny_gguf.parent / "Modelfile").write_text("FROM ./tiny.gguf\nFORM ./tiny.gguf\n")
    before = snapshot(daemon.models)
    result = cli_in(daemon, tiny_gguf.parent, "create", "broken")
    assert result.returncode == 1
    assert re.fullmatch(r"Error: Modelfile:2:1: .*\n", result.stderr), result.stderr
    assert "Traceback" not in result.stderr
    assert snapshot(daemon.models) == before


def test_missing_model_errors(daemon: Daemon) -> None:
    shown = daemon.cli("show", "nope")
    assert shown.returncode == 1
    assert shown.stderr.splitlines() == [
        "Error: model 'nope' not found",
        'run "corral list" to see the models you have',
    ]
    removed = daemon.cli("rm", "nope")
    assert removed.returncode == 1
    assert removed.stderr.splitlines()[0] == "Error: model 'nope' not found"
    assert "Warning" not in removed.stderr


def test_list_without_a_daemon() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        host = f"127.0.0.1:{s.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORRAL_")}
    env.update({"CORRAL_HOST": host, "PYTHONPATH": str(REPO)})
    result = subprocess.run(
        [sys.executable, "-m", "cli", "list"], env=env, cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert result.stderr == f'Error: could not connect to corral at {host}\nis "corral serve" running?\n'
