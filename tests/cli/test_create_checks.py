"""``corral create`` checks every local file it would upload (FROM and ADAPTER) before uploading any of them:
a regular file that starts with the GGUF magic and a version corral reads. ``FROM /etc/passwd`` must never send
``/etc/passwd`` to the daemon."""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from pathlib import Path
from typing import Any

import pytest

import cli.modelfile_files as files
from cli.commands.create import build_request
from cli.errors import LocalFileError
from cli.modelfile_files import ModelfileSource
from registry.digest import Digest
from tests.conftest import Daemon

GOOD = b"GGUF" + struct.pack("<I", 3) + b"\x00" * 24
NOT_GGUF_HINT = "FROM takes a .gguf file, a directory of them, or a model name"


class RecordingClient:
    """Stands in for the daemon: records every blob the CLI checks or uploads."""

    def __init__(self) -> None:
        self.checked: list[str] = []
        self.uploaded: list[Path] = []

    def blob_exists(self, digest: Digest | str) -> bool:
        self.checked.append(str(digest))
        return False

    def upload_blob(self, digest: Digest | str, path: Path, progress_callback: Any = None) -> None:
        self.uploaded.append(path)


def request_for(modelfile: str, base: Path) -> tuple[RecordingClient, dict[str, Any] | LocalFileError]:
    client = RecordingClient()
    source = ModelfileSource(modelfile.encode(), "Modelfile", base)
    try:
        return client, build_request("m", source, client)  # type: ignore[arg-type]
    except LocalFileError as exc:
        return client, exc


def test_from_etc_passwd_is_refused_before_any_upload(tmp_path: Path) -> None:
    passwd = Path("/etc/passwd")
    if not passwd.is_file():
        pytest.skip("no /etc/passwd here")
    client, result = request_for("FROM /etc/passwd\n", tmp_path)
    assert isinstance(result, LocalFileError)
    assert str(result) == (
        f"/etc/passwd is not a GGUF model file (it does not start with the GGUF magic); {NOT_GGUF_HINT}"
    )
    assert client.checked == [] and client.uploaded == []


def test_a_good_file_is_still_uploaded(tmp_path: Path) -> None:
    (tmp_path / "w.gguf").write_bytes(GOOD)
    target = tmp_path / "blobs" / "sha256-abc"  # a Hugging Face cache links its files like this
    target.parent.mkdir()
    target.write_bytes(GOOD + b"x")
    (tmp_path / "linked.gguf").symlink_to(target)
    client, result = request_for("FROM ./w.gguf\nADAPTER ./linked.gguf\n", tmp_path)
    assert not isinstance(result, LocalFileError), result
    assert result["files"] == {"w.gguf": "sha256:" + hashlib.sha256(GOOD).hexdigest()}
    assert list(result["adapters"]) == ["linked.gguf"]
    assert client.uploaded == [tmp_path / "w.gguf", tmp_path / "linked.gguf"]


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", "it does not start with the GGUF magic"),
        (b"GGU", "it does not start with the GGUF magic"),
        (b"PK\x03\x04 a zip file" + b"\x00" * 32, "it does not start with the GGUF magic"),
        (b"GGUF\x03", "it ends before the GGUF version"),
        (b"GGUF" + struct.pack("<I", 99) + b"\x00" * 16, "GGUF version 99; corral reads versions 2 and 3"),
        (b"GGUF" + struct.pack(">I", 3) + b"\x00" * 16, "big-endian"),
    ],
)
def test_files_that_are_not_gguf(tmp_path: Path, content: bytes, words: str) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(content)
    with pytest.raises(LocalFileError, match=f"^{bad} is not a GGUF model file \\(.*{words}"):
        files.check_model_file(bad, "FROM")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            files.check_model_file(fifo, "FROM")
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(5)
    assert outcome, "the check blocked on a FIFO"
    assert isinstance(outcome[0], LocalFileError)
    assert str(outcome[0]).startswith(f"{fifo} is not a regular file (it is a FIFO)")
    # and through create: nothing is hashed or uploaded (hashing a FIFO would block for ever)
    client, result = request_for("FROM ./model.gguf\n", tmp_path)
    assert isinstance(result, LocalFileError) and client.uploaded == []


@pytest.mark.skipif(not Path("/dev/random").exists(), reason="no /dev/random")
def test_a_device_is_refused() -> None:
    with pytest.raises(LocalFileError, match="^/dev/random is not a regular file \\(it is a character device\\)"):
        files.check_model_file(Path("/dev/random"), "FROM")
    client, result = request_for("FROM /dev/random\n", Path("/"))
    assert isinstance(result, LocalFileError) and client.uploaded == []


def test_every_file_is_checked_before_the_first_upload(tmp_path: Path) -> None:
    """A directory of GGUFs with one bad file, and a bad ADAPTER after a good FROM: nothing is uploaded."""
    d = tmp_path / "weights"
    d.mkdir()
    (d / "a.gguf").write_bytes(GOOD)
    (d / "b.gguf").write_bytes(b"not a model")
    client, result = request_for("FROM ./weights\n", tmp_path)
    assert isinstance(result, LocalFileError)
    assert str(result).startswith(f"{d / 'b.gguf'} is not a GGUF model file (it does not start with the GGUF magic)")
    assert client.checked == [] and client.uploaded == []

    (tmp_path / "ok.gguf").write_bytes(GOOD)
    (tmp_path / "lora.txt").write_text("hello")
    client, result = request_for("FROM ./ok.gguf\nADAPTER ./lora.txt\n", tmp_path)
    assert isinstance(result, LocalFileError)
    assert str(result) == (
        f"{tmp_path / 'lora.txt'} is not a GGUF model file (it does not start with the GGUF "
        "magic); ADAPTER takes a .gguf file or a directory of them"
    )
    assert client.checked == [] and client.uploaded == []


def test_the_daemon_refuses_a_blob_that_is_not_gguf(daemon: Daemon) -> None:
    """The daemon's own check, for clients that skip the CLI: a non-GGUF blob is a 400, and no model appears."""
    data = b"root:x:0:0:root:/root:/bin/bash\n"
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with daemon.client() as c:
        assert c.post(f"/api/blobs/{digest}", content=data).status_code in (200, 201)
        r = c.post("/api/create", json={"model": "evil", "files": {"passwd.gguf": digest}, "stream": False})
        assert r.status_code == 400, r.text
        assert "not a usable GGUF file" in r.json()["error"]
        assert c.get("/api/tags").json()["models"] == []
