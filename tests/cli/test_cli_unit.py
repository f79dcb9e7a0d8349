"""CLI unit tests: import boundary, the error table, the HTTP client, formatting, Modelfile path resolution."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest

from cli import output
from cli.client import DaemonClient
from cli.commands.listing import rows
from cli.commands.show import summary
from cli.errors import DaemonConnectionError, DaemonUnreachable, LocalFileError, render_error
from cli.main import main
from cli.modelfile_files import (
    IMPLICIT_MODELFILE,
    adapter_files,
    files_map,
    hash_file,
    model_files,
    read_modelfile,
    resolve_from,
)
from daemon.settings import env_help
from errors import CorralError, InvalidModelName, InvalidRequest, ModelNotFound, NotFound
from registry.digest import Digest

REPO = Path(__file__).resolve().parents[2]


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("CORRAL_", "OLLAMA_"))}
    base.update({"PYTHONPATH": str(REPO), "NO_COLOR": "1", "COLUMNS": "120"})
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], env=base, cwd=REPO, capture_output=True, text=True, timeout=60
    )


@pytest.fixture
def no_daemon(monkeypatch: pytest.MonkeyPatch) -> str:
    """CORRAL_HOST pointing at a closed loopback port; returns ``host:port``."""
    host = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("CORRAL_HOST", host)
    monkeypatch.delenv("CORRAL_DEBUG", raising=False)
    return host


# -- import boundary -------------------------------------------------------------------------------------------
def test_cli_imports_no_server_stack() -> None:
    code = (
        "import cli.main, sys; assert 'fastapi' not in sys.modules and 'llama_cpp' not in sys.modules "
        "and 'uvicorn' not in sys.modules"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


# -- the error boundary ----------------------------------------------------------------------------------------
def test_unreachable_daemon_prints_error_and_hint(no_daemon: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f'Error: could not connect to corral at {no_daemon}\nis "corral serve" running?\n'


def test_unreachable_daemon_subprocess_no_traceback_unless_debug() -> None:
    host = f"127.0.0.1:{closed_port()}"
    quiet = run_cli("list", env={"CORRAL_HOST": host})
    assert quiet.returncode == 1
    assert quiet.stderr.splitlines() == [f"Error: could not connect to corral at {host}", 'is "corral serve" running?']
    loud = run_cli("list", env={"CORRAL_HOST": host, "CORRAL_DEBUG": "1"})
    assert loud.returncode == 1
    assert "Traceback (most recent call last)" in loud.stderr
    assert loud.stderr.splitlines()[-2:] == quiet.stderr.splitlines()


def test_client_reports_the_address_it_tried() -> None:
    port = closed_port()
    with DaemonClient(f"http://127.0.0.1:{port}", timeout=5) as client, pytest.raises(DaemonUnreachable) as info:
        client.tags()
    assert str(info.value) == f"could not connect to corral at 127.0.0.1:{port}"
    assert render_error(info.value) == (str(info.value), 'is "corral serve" running?')


@pytest.mark.parametrize(
    ("exc", "hint"),
    [
        (ModelNotFound("x"), 'run "corral list" to see the models you have'),
        (InvalidModelName("a b", "invalid model name: a b"), "a model name looks like"),
        (DaemonConnectionError("lost"), "see the daemon's log"),
        (LocalFileError('Modelfile "x" not found'), None),
        (InvalidRequest("bad"), None),
        (CorralError("boom"), None),
    ],
)
def test_render_error_table(exc: CorralError, hint: str | None) -> None:
    message, got = render_error(exc)
    assert message == str(exc)
    if hint is None:
        assert got is None
    else:
        assert got is not None and got.startswith(hint)


def test_render_error_uses_http_status() -> None:
    exc = CorralError("internal error: x")
    exc.status = 500  # type: ignore[attr-defined]
    assert render_error(exc)[1] == "see the daemon's log for details"


def test_errors_that_need_no_daemon(no_daemon: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "x", "--system", "--license"]) == 1
    assert capsys.readouterr().err == (
        "Error: only one of '--license', '--modelfile', '--parameters', '--system', or '--template' can be specified\n"
    )
    assert main(["create", "bad name!"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "Error: invalid model name: bad name!"
    assert err[1].startswith("a model name looks like")


def test_create_with_missing_file_option(no_daemon: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "nope")
    assert main(["create", "m", "-f", missing]) == 1
    assert capsys.readouterr().err == f'Error: Modelfile "{missing}" not found\n'


def test_serve_reports_bad_settings(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CORRAL_MAX_QUEUE", "lots")
    assert main(["serve"]) == 1
    assert capsys.readouterr().err.splitlines()[0] == 'Error: CORRAL_MAX_QUEUE="lots" is not a whole number'


def test_serve_help_lists_environment() -> None:
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    for line in env_help().splitlines():
        assert line.strip() in result.stdout


def test_version_without_daemon() -> None:
    result = run_cli("--version", env={"CORRAL_HOST": f"127.0.0.1:{closed_port()}"})
    assert result.returncode == 0
    assert result.stdout.startswith("corral version is ")
    assert result.stderr.startswith("Warning: could not connect")


# -- DaemonClient against a scripted transport -----------------------------------------------------------------
def scripted(handler: object) -> DaemonClient:
    return DaemonClient("http://127.0.0.1:9", timeout=5, transport=httpx.MockTransport(handler))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("status", "body", "kind", "message"),
    [
        (400, {"error": "invalid model name"}, InvalidRequest, "invalid model name"),
        (404, {"error": "model 'x' not found"}, ModelNotFound, "model 'x' not found"),
        (404, "404 page not found", NotFound, "404 page not found"),
        (500, {"error": "disk full"}, CorralError, "disk full"),
        (503, "", CorralError, "503 Service Unavailable"),
    ],
)
def test_error_bodies_become_exceptions(status: int, body: object, kind: type, message: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if isinstance(body, dict):
            return httpx.Response(status, json=body)
        return httpx.Response(status, text=str(body))

    with scripted(handler) as client, pytest.raises(kind) as info:
        client.show("x")
    assert str(info.value) == message
    assert info.value.status == status


def test_stream_yields_objects_and_raises_on_error_line() -> None:
    lines = [{"status": "writing manifest"}, {"error": "out of space"}]

    def handler(request: httpx.Request) -> httpx.Response:
        assert json.loads(request.content)["stream"] is True
        return httpx.Response(200, content="\n".join(json.dumps(x) for x in lines).encode())

    seen = []
    with scripted(handler) as client, pytest.raises(CorralError, match="out of space"):
        for event in client.create({"model": "m"}):
            seen.append(event)
    assert seen == [{"status": "writing manifest"}]


def test_blob_head_then_streamed_upload(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    path = tmp_path / "b.gguf"
    path.write_bytes(data)
    digest = Digest.of_bytes(data)
    received: dict[str, object] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == f"/api/blobs/{digest}"
        if request.method == "HEAD":
            return httpx.Response(404)
        received["length"] = request.headers["content-length"]
        received["body"] = b"".join(request.stream)  # type: ignore[arg-type]
        return httpx.Response(201)

    progress: list[int] = []
    with scripted(handler) as client:
        assert client.blob_exists(digest) is False
        client.upload_blob(digest, path, progress.append)
    assert received == {"length": str(len(data)), "body": data}
    assert sum(progress) == len(data) and len(progress) == 4


# -- formatting ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (999, "999 B"),
        (1000, "1 KB"),
        (1500, "1.5 KB"),
        (980_000_000, "980 MB"),
        (4_661_224_676, "4.7 GB"),
        (4_000_000_000, "4 GB"),
        (12_345_678_901, "12 GB"),
        (2_500_000_000_000, "2.5 TB"),
    ],
)
def test_format_size(n: int, text: str) -> None:
    assert output.format_size(n) == text


NOW = datetime(2025, 6, 1, 12, 0, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("delta", "text"),
    [
        (timedelta(milliseconds=500), "Less than a second ago"),
        (timedelta(seconds=1), "1 second ago"),
        (timedelta(seconds=45), "45 seconds ago"),
        (timedelta(seconds=90), "About a minute ago"),
        (timedelta(minutes=2), "2 minutes ago"),
        (timedelta(minutes=59), "59 minutes ago"),
        (timedelta(minutes=60), "About an hour ago"),
        (timedelta(minutes=89), "About an hour ago"),
        (timedelta(minutes=90), "2 hours ago"),
        (timedelta(hours=47), "47 hours ago"),
        (timedelta(hours=48), "2 days ago"),
        (timedelta(days=13), "13 days ago"),
        (timedelta(days=14), "2 weeks ago"),
        (timedelta(days=60), "2 months ago"),
        (timedelta(days=800), "2 years ago"),
        (timedelta(minutes=-5), "5 minutes from now"),
        (timedelta(days=-365 * 30), "Forever"),
    ],
)
def test_format_ago(delta: timedelta, text: str) -> None:
    assert output.format_ago(NOW - delta, now=NOW) == text


def test_format_ago_reads_rfc3339_with_nanoseconds() -> None:
    stamp = (NOW - timedelta(minutes=3)).astimezone(timezone(timedelta(hours=-8)))
    text = stamp.strftime("%Y-%m-%dT%H:%M:%S") + ".123456789-08:00"
    assert output.format_ago(text, now=NOW) == "2 minutes ago"
    assert output.format_ago("2025-06-01T11:00:00Z", now=NOW) == "About an hour ago"
    assert output.format_ago("not a time", now=NOW) == "Unknown"


def test_table_pads_columns_with_four_spaces() -> None:
    assert output.table([("NAME", "ID"), ("a:latest", "0123")]) == ["NAME        ID", "a:latest    0123"]


def test_list_rows_filter_by_prefix() -> None:
    models = [
        {"name": "Mario:latest", "digest": "ab" * 32, "size": 980_000_000, "modified_at": "2020-01-01T00:00:00Z"},
        {"name": "luigi:latest", "digest": "cd" * 32, "size": 4_700_000_000, "modified_at": "2020-01-01T00:00:00Z"},
    ]
    got = rows(models, "mar")
    assert [r[:3] for r in got] == [("Mario:latest", "abababababab", "980 MB")]
    assert len(rows(models)) == 2


def test_show_summary_sections() -> None:
    info = {
        "model_info": {
            "general.architecture": "llama",
            "general.parameter_count": 134_515_008,
            "llama.context_length": 8192,
            "llama.embedding_length": 576,
        },
        "details": {"quantization_level": "Q8_0", "parameter_size": ""},
        "capabilities": ["completion"],
        "parameters": 'num_ctx                        256\nstop                           "<|user|>"',
        "system": "You are terse.",
        "license": "Apache-2.0\n\nline two\nline three",
    }
    text = "\n".join(summary(info))
    assert "  Model\n    architecture        llama\n    parameters          134.52M\n" in text
    assert "    context length      8192\n    embedding length    576\n    quantization        Q8_0\n" in text
    assert "  Capabilities\n    completion\n" in text
    assert '  Parameters\n    num_ctx    256\n    stop       "<|user|>"\n' in text
    assert "  System\n    You are terse.\n" in text
    assert "  License\n    Apache-2.0\n    line two\n    ...\n" in text


# -- Modelfile files -------------------------------------------------------------------------------------------
def test_missing_default_modelfile_means_from_dot(tmp_path: Path) -> None:
    src = read_modelfile(None, cwd=tmp_path)
    assert (src.data, src.filename, src.base_dir) == (IMPLICIT_MODELFILE, "Modelfile", tmp_path)


def test_missing_named_modelfile_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LocalFileError, match='Modelfile "other" not found'):
        read_modelfile("other", cwd=tmp_path)


def test_from_resolves_relative_to_the_modelfile_directory(tmp_path: Path) -> None:
    mdir, cwd = tmp_path / "models", tmp_path / "elsewhere"
    mdir.mkdir()
    cwd.mkdir()
    (mdir / "Modelfile").write_text("FROM ./w.gguf\n")
    (mdir / "w.gguf").write_bytes(b"GGUF....")
    (cwd / "w.gguf").write_bytes(b"GGUFother")
    src = read_modelfile(str(mdir / "Modelfile"), cwd=cwd)
    assert src.base_dir == mdir.resolve()
    assert resolve_from("./w.gguf", src.base_dir) == mdir.resolve() / "w.gguf"
    assert resolve_from(str(cwd / "w.gguf"), src.base_dir) == cwd / "w.gguf"  # absolute kept
    rel = read_modelfile("../models/Modelfile", cwd=cwd)
    assert rel.filename == "../models/Modelfile" and rel.base_dir == mdir.resolve()


def test_from_expands_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "w.gguf").write_bytes(b"GGUF")
    assert resolve_from("~/w.gguf", Path("/nonexistent")) == tmp_path / "w.gguf"


def test_from_that_is_not_a_path_is_a_model_name(tmp_path: Path) -> None:
    assert resolve_from("llama3.2", tmp_path) is None
    assert resolve_from("me/mario:v2", tmp_path) is None
    (tmp_path / "llama3.2").mkdir()  # a directory named like the model wins, as in Ollama
    assert resolve_from("llama3.2", tmp_path) == tmp_path / "llama3.2"


def test_directory_scan_and_errors(tmp_path: Path) -> None:
    (tmp_path / "b.gguf").write_bytes(b"GGUFb")
    (tmp_path / "a.gguf").write_bytes(b"GGUFa")
    (tmp_path / "notes.txt").write_text("x")
    assert [p.name for p in model_files(tmp_path)] == ["a.gguf", "b.gguf"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"x")
    with pytest.raises(LocalFileError, match="no GGUF files found.*convert"):
        model_files(empty)
    with pytest.raises(LocalFileError, match='ADAPTER "./lora.gguf" not found'):
        adapter_files("./lora.gguf", tmp_path)


def test_hash_and_files_map(tmp_path: Path) -> None:
    p = tmp_path / "w.gguf"
    data = os.urandom(2 * 1024 * 1024 + 3)
    p.write_bytes(data)
    d = hash_file(p)
    assert d.hex == hashlib.sha256(data).hexdigest()
    assert files_map([p], {p: d}) == {"w.gguf": f"sha256:{d.hex}"}
