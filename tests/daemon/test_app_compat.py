"""Apps that check the server: /api/version's Ollama version, /api/tags' capabilities and details, RENDERER/PARSER.

Against a real daemon with the tiny GGUF, through raw HTTP, the official ``ollama`` client and the corral CLI.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import ollama
import pytest

from cli import __version__
from cli.client import DaemonClient
from daemon.version import OLLAMA_COMPAT_VERSION
from modelfile import parse
from tests.conftest import Daemon
from tests.models import write_tiny_gguf

#: VS Code's Copilot refuses an Ollama older than this.
COPILOT_MINIMUM = (0, 6, 4)
TOOLS_TEMPLATE = "{{ if .Tools }}[tools]{{ end }}{{ .Prompt }}{{ if .Suffix }}<fim>{{ .Suffix }}{{ end }}"


def version_tuple(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:[-+].*)?", text)
    assert m is not None, text
    major, minor, patch = m.groups()
    return int(major), int(minor), int(patch)


def create(d: Daemon, name: str, modelfile: str, tmp: Path) -> None:
    folder = tmp / name
    folder.mkdir()
    write_tiny_gguf(folder / "tiny.gguf")
    (folder / "Modelfile").write_text(modelfile)
    done = d.cli("create", name, "-f", str(folder / "Modelfile"))
    assert done.returncode == 0, done.stderr


def test_version_is_an_ollama_version_apps_accept(daemon: Daemon) -> None:
    with daemon.client() as h:
        r = h.get("/api/version")
        assert r.status_code == 200
        body = r.json()
        assert body["version"] == OLLAMA_COMPAT_VERSION
        assert version_tuple(body["version"]) >= COPILOT_MINIMUM
        assert body["corral_version"] == __version__
        head = h.head("/api/version")
        assert head.status_code == 200 and head.content == b""


def test_cli_version_prints_both(daemon: Daemon) -> None:
    result = daemon.cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"corral version is {__version__} (Ollama API {OLLAMA_COMPAT_VERSION})"
    assert "daemon version" not in result.stderr  # the daemon's corral_version, not its Ollama version, is compared


@pytest.mark.parametrize(
    ("body", "expected"),
    [({"version": OLLAMA_COMPAT_VERSION, "corral_version": "9.9.9"}, "9.9.9"), ({"version": "0.1.0"}, "0.1.0")],
)
def test_client_reads_corral_version(body: dict[str, str], expected: str) -> None:
    """The CLI compares corral versions: ``corral_version``, or ``version`` from an older corral."""
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json=body))
    with DaemonClient("http://127.0.0.1:9", timeout=5, transport=transport) as client:
        assert client.version() == expected


def test_tags_capabilities_and_details_match_show(daemon: Daemon, tmp_path: Path) -> None:
    create(daemon, "plain", "FROM ./tiny.gguf\n", tmp_path)
    create(daemon, "tooly", f'FROM ./tiny.gguf\nTEMPLATE """{TOOLS_TEMPLATE}"""\n', tmp_path)

    client = ollama.Client(host=daemon.url)
    listed = client.list().models  # the typed list parses the richer entries
    assert sorted(str(m.model) for m in listed) == ["plain:latest", "tooly:latest"]
    for m in listed:
        assert m.details is not None and m.details.family == "llama" and m.details.format == "gguf"
        assert m.details.quantization_level == "F32" and m.details.parameter_size

    # ollama-python's ListResponse.Model has no capabilities field (yet): read the client's own /api/tags answer
    raw = client._request_raw("GET", "/api/tags").json()["models"]
    by_name = {m["model"]: m for m in raw}
    assert by_name["plain:latest"]["capabilities"] == ["completion"]
    assert by_name["tooly:latest"]["capabilities"] == ["completion", "tools", "insert"]

    with daemon.client() as h:
        for name, entry in by_name.items():
            details = entry["details"]
            for key in ("parent_model", "format", "family", "families", "parameter_size", "quantization_level"):
                assert key in details, key
            assert details["context_length"] == 512 and details["embedding_length"] == 64
            shown = h.post("/api/show", json={"model": name}).json()
            assert details == shown["details"]
            assert entry["capabilities"] == shown["capabilities"]
            assert client.show(name).capabilities == entry["capabilities"]


def test_tags_summaries_follow_the_store(daemon: Daemon, tmp_path: Path) -> None:
    """The per-manifest cache never serves a stale summary: a model re-created with a new template is re-read."""
    create(daemon, "m", "FROM ./tiny.gguf\n", tmp_path)
    with daemon.client() as h:
        assert h.get("/api/tags").json()["models"][0]["capabilities"] == ["completion"]
        r = h.post("/api/create", json={"model": "m", "from": "m", "template": TOOLS_TEMPLATE, "stream": False})
        assert r.status_code == 200, r.text
        (entry,) = h.get("/api/tags").json()["models"]
        assert entry["capabilities"] == ["completion", "tools", "insert"]
        assert entry["details"] == h.post("/api/show", json={"model": "m"}).json()["details"]
        assert entry["details"]["parent_model"] == "m:latest"


def test_renderer_and_parser_round_trip(daemon: Daemon, tmp_path: Path) -> None:
    create(daemon, "rp", "FROM ./tiny.gguf\nRENDERER qwen3-coder\nPARSER qwen3-coder\nREQUIRES 0.6.2\n", tmp_path)
    with daemon.client() as h:
        shown = h.post("/api/show", json={"model": "rp"}).json()
        assert shown["renderer"] == "qwen3-coder" and shown["parser"] == "qwen3-coder"
        assert shown["requires"] == "0.6.2"
        # FROM an existing model inherits them, as in Ollama; a new value replaces them
        r = h.post("/api/create", json={"model": "rp2", "from": "rp", "parser": "harmony", "stream": False})
        assert r.status_code == 200, r.text
        second = h.post("/api/show", json={"model": "rp2"}).json()
        assert second["renderer"] == "qwen3-coder" and second["parser"] == "harmony"
        plain = h.post("/api/create", json={"model": "none", "from": "rp", "stream": False})
        assert plain.status_code == 200
    shown_mf = parse(shown["modelfile"])
    assert (shown_mf.renderer, shown_mf.parser, shown_mf.requires) == ("qwen3-coder", "qwen3-coder", "0.6.2")

    result = daemon.cli("show", "rp", "--modelfile")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "RENDERER qwen3-coder" in lines and "PARSER qwen3-coder" in lines
    # Ollama's order: SYSTEM/TEMPLATE, then RENDERER and PARSER, then parameters
    assert lines.index("RENDERER qwen3-coder") < lines.index("PARSER qwen3-coder")
    mf = parse(result.stdout)
    assert (mf.renderer, mf.parser) == ("qwen3-coder", "qwen3-coder")


def test_show_leaves_renderer_and_parser_out_when_unset(daemon: Daemon, tmp_path: Path) -> None:
    create(daemon, "bare", "FROM ./tiny.gguf\n", tmp_path)
    shown = httpx.post(daemon.url + "/api/show", json={"model": "bare"}).json()
    assert "renderer" not in shown and "parser" not in shown
    assert "RENDERER" not in shown["modelfile"] and "PARSER" not in shown["modelfile"]


@pytest.mark.parametrize("bad", [{"renderer": 1}, {"parser": ["x"]}])
def test_create_refuses_non_string_renderer_or_parser(daemon: Daemon, tmp_path: Path, bad: dict[str, object]) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    client = ollama.Client(host=daemon.url)
    digest = client.create_blob(gguf)
    r = httpx.post(daemon.url + "/api/create", json={"model": "x", "files": {"tiny.gguf": digest}, **bad})
    assert r.status_code == 400
