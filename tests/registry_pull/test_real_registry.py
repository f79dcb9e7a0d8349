"""Pull and push through real daemons against Debian's ``docker-registry`` (CNCF distribution) on 127.0.0.1.

Create a model, push it, delete it, pull it back (same digests, and it runs); push again (nothing re-sent); kill
the daemon with SIGKILL in the middle of a pull of a 128 MiB blob and pull again (it resumes, fetching no more
than the missing parts plus one); log in with Basic credentials (htpasswd) through the CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry.download import Tuning, plan_parts
from tests.conftest import Daemon, stop_daemon
from tests.models import write_tiny_gguf
from tests.registry_pull.conftest import RealRegistry, TCPProxy, registry_daemon, start_registry, stop_registry

MODEL_TYPE = "application/vnd.ollama.image.model"


def ndjson(d: Daemon, path: str, body: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
    with d.client() as c, c.stream("POST", path, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            return [{"http_status": r.status_code, **r.json()}]
        return [json.loads(line) for line in r.iter_lines() if line.strip()]


def create_tiny(d: Daemon, gguf: Path, name: str) -> None:
    digest = "sha256:" + hashlib.sha256(gguf.read_bytes()).hexdigest()
    with d.client() as c:
        assert c.post(f"/api/blobs/{digest}", content=gguf.read_bytes()).status_code == 201
        r = c.post(
            "/api/create",
            json={
                "model": name,
                "files": {gguf.name: digest},
                "system": "be brief",
                "parameters": {"temperature": 0.5},
                "stream": False,
            },
        )
        assert r.status_code == 200, r.text


def tag_of(d: Daemon, name: str) -> dict[str, Any]:
    with d.client() as c:
        models = c.get("/api/tags").json()["models"]
    (model,) = [m for m in models if m["name"] == name]
    return model


def manifest_blobs(d: Daemon, name: str) -> list[str]:
    host, rest = name.split("/", 1)
    ns, model_tag = rest.split("/")
    model, tag = model_tag.split(":")
    doc = json.loads((d.models / "manifests" / host / ns / model / tag).read_bytes())
    return [doc["config"]["digest"], *(layer["digest"] for layer in doc["layers"])]


def put_blob(registry_url: str, repo: str, data: bytes) -> str:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with httpx.Client(base_url=registry_url, timeout=60) as c:
        loc = httpx.URL(c.post(f"/v2/{repo}/blobs/uploads/").headers["location"])
        r = c.put(
            loc.copy_merge_params({"digest": digest}),
            content=data,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 201, r.text
    return digest


def put_model(registry_url: str, repo: str, tag: str, layer: bytes) -> bytes:
    config = b'{"model_format":"gguf","architecture":"amd64","os":"linux"}'
    doc = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "digest": put_blob(registry_url, repo, config),
            "size": len(config),
        },
        "layers": [{"mediaType": MODEL_TYPE, "digest": put_blob(registry_url, repo, layer), "size": len(layer)}],
    }
    raw = json.dumps(doc).encode()
    r = httpx.put(
        f"{registry_url}/v2/{repo}/manifests/{tag}",
        content=raw,
        headers={"Content-Type": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    assert r.status_code == 201, r.text
    return raw


@pytest.fixture(scope="module")
def proxy(docker_registry: RealRegistry) -> Any:
    p = TCPProxy(int(docker_registry.host.split(":")[1]))
    yield p
    p.close()


def test_push_delete_pull_back_and_run(
    docker_registry: RealRegistry, proxy: TCPProxy, rdaemon: Daemon, tmp_path: Path
) -> None:
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    name = f"{docker_registry.host}/test/tiny:v1"
    create_tiny(rdaemon, gguf, "tiny")
    with rdaemon.client() as c:
        assert c.post("/api/copy", json={"source": "tiny", "destination": name}).status_code == 200
    before = tag_of(rdaemon, name)
    blobs = manifest_blobs(rdaemon, name)

    lines = ndjson(rdaemon, "/api/push", {"model": name, "insecure": True})
    statuses = [line.get("status") for line in lines]
    assert statuses[0] == "retrieving manifest" and statuses[-2:] == ["pushing manifest", "success"], lines
    pushed = {line["digest"] for line in lines if line.get("status", "").startswith("pushing ") and "digest" in line}
    assert pushed == set(blobs)
    r = httpx.get(
        f"{docker_registry.url}/v2/test/tiny/manifests/v1",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    assert r.status_code == 200
    assert hashlib.sha256(r.content).hexdigest() == before["digest"]  # the registry holds our bytes

    with rdaemon.client() as c:
        for model in ("tiny", name):
            assert c.request("DELETE", "/api/delete", json={"model": model}).status_code == 200
    assert not any(Path(rdaemon.models, "blobs").iterdir())

    lines = ndjson(rdaemon, "/api/pull", {"model": name, "insecure": True})
    statuses = [line.get("status") for line in lines]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"], lines
    after = tag_of(rdaemon, name)
    assert after["digest"] == before["digest"] and after["size"] == before["size"]
    assert manifest_blobs(rdaemon, name) == blobs
    for digest in blobs:
        path = rdaemon.models / "blobs" / digest.replace(":", "-")
        assert "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() == digest
    with rdaemon.client() as c:
        r = c.post(
            "/api/generate",
            timeout=120,
            json={"model": name, "prompt": "hello", "stream": False, "options": {"num_predict": 4, "num_ctx": 256}},
        )
        assert r.status_code == 200, r.text
        assert r.json()["done"] is True and r.json()["eval_count"] >= 1
        show = c.post("/api/show", json={"model": name}).json()
    assert show["system"] == "be brief" and "temperature" in show["parameters"]

    # a second push of the same blobs through the counting proxy: HEAD finds them, no blob bytes are sent
    proxy.reset()
    again = name.replace(docker_registry.host, proxy.host).replace(":v1", ":v2")
    with rdaemon.client() as c:
        assert c.post("/api/copy", json={"source": name, "destination": again}).status_code == 200
    lines = ndjson(rdaemon, "/api/push", {"model": again, "insecure": True})
    assert lines[-1] == {"status": "success"}
    assert proxy.up < 20_000 < gguf.stat().st_size
    r = httpx.get(
        f"{docker_registry.url}/v2/test/tiny/manifests/v2",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == before["digest"]


def test_plain_http_registry_needs_insecure(docker_registry: RealRegistry, rdaemon: Daemon) -> None:
    (line,) = ndjson(rdaemon, "/api/pull", {"model": f"{docker_registry.host}/test/tiny:v1"})
    assert line["http_status"] == 400
    assert "does not speak HTTPS" in line["error"] and "--insecure" in line["error"]
    (line,) = ndjson(rdaemon, "/api/pull", {"model": f"{docker_registry.host}/test/absent:v1", "insecure": True})
    assert line == {"http_status": 404, "error": "pull model manifest: file does not exist"}


def test_killed_pull_resumes_fetching_only_what_is_missing(
    docker_registry: RealRegistry, proxy: TCPProxy, tmp_path: Path
) -> None:
    size = 128 * 1024 * 1024
    layer = os.urandom(size)
    put_model(docker_registry.url, "test/big", "latest", layer)
    digest = "sha256:" + hashlib.sha256(layer).hexdigest()
    del layer
    name = f"{proxy.host}/test/big:latest"
    state = tmp_path / "models-d" / "blobs" / (digest.replace(":", "-") + "-partial.json")
    part_size = plan_parts(size, Tuning())[0].size

    proxy.reset()
    proxy.rate = 3_000_000  # bytes/s per connection: a pull takes several seconds
    first = registry_daemon(tmp_path)
    outcome: list[Any] = []

    def pull_until_killed() -> None:
        try:
            outcome.append(ndjson(first, "/api/pull", {"model": name, "insecure": True}))
        except httpx.HTTPError as exc:
            outcome.append(exc)

    t = threading.Thread(target=pull_until_killed)
    t.start()
    try:
        deadline = time.monotonic() + 60
        done = 0
        while time.monotonic() < deadline:
            if state.is_file():
                try:
                    done = sum(p[2] for p in json.loads(state.read_bytes())["parts"])
                except (ValueError, KeyError):
                    done = 0
                if done >= size // 4:
                    break
            time.sleep(0.05)
        assert size // 4 <= done < size, "the pull did not get a quarter of the way (or finished) in time"
        first.proc.kill()
        first.proc.wait(10)
    finally:
        t.join(30)
        stop_daemon(first)
    assert outcome and not (isinstance(outcome[0], list) and outcome[0][-1] == {"status": "success"})
    saved = sum(p[2] for p in json.loads(state.read_bytes())["parts"])
    fetched_first = proxy.down

    proxy.reset()
    proxy.rate = None
    second = registry_daemon(tmp_path)
    try:
        lines = ndjson(second, "/api/pull", {"model": name, "insecure": True})
        assert lines[-1] == {"status": "success"}, lines
        blob = second.models / "blobs" / digest.replace(":", "-")
        assert "sha256:" + hashlib.sha256(blob.read_bytes()).hexdigest() == digest
        assert not state.exists()
        first_line = next(line for line in lines if line.get("digest") == digest)
        assert first_line.get("completed") == saved  # progress starts where the first daemon stopped
        assert "resuming download" in second.log.read_text()
    finally:
        stop_daemon(second)
    missing = size - saved
    # what the second pull fetched: the missing bytes, plus at most one part, plus HTTP headers
    assert proxy.down <= missing + part_size + 256 * 1024, (proxy.down, missing, part_size)
    assert proxy.down < size - size // 4 + part_size
    assert fetched_first + proxy.down < size + 2 * part_size


@pytest.fixture(scope="module")
def htpasswd_registry(tmp_path_factory: pytest.TempPathFactory) -> Any:
    crypt = pytest.importorskip("crypt", reason="the crypt module makes the bcrypt htpasswd entry")
    root = tmp_path_factory.mktemp("authreg")
    entry = crypt.crypt("s3cret", crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
    if not entry or not entry.startswith("$2"):
        pytest.skip("this libc's crypt cannot make bcrypt hashes")
    (root / "htpasswd").write_text(f"alice:{entry}\n")
    r = start_registry(root, htpasswd=root / "htpasswd")
    yield r
    stop_registry(r)


def test_login_push_pull_with_basic_auth(htpasswd_registry: RealRegistry, rdaemon: Daemon, tmp_path: Path) -> None:
    host = htpasswd_registry.host
    name = f"{host}/alice/tiny:latest"
    create_tiny(rdaemon, write_tiny_gguf(tmp_path / "tiny.gguf"), name)

    result = rdaemon.cli("push", name, "--insecure")
    assert result.returncode == 1
    assert (
        f'unauthorized: access denied to {host}/alice/tiny; if it needs a login, run "corral login {host}"'
        in result.stderr
    )

    result = rdaemon.cli("login", host, "--insecure", "-u", "alice", "--password-stdin", input="wrong\n")
    assert result.returncode == 1 and "unauthorized" in result.stderr
    result = rdaemon.cli("login", host, "--insecure", "-u", "alice", "--password-stdin", input="s3cret\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Login Succeeded: {host}")
    auth = tmp_path / "auth.json"
    assert stat.S_IMODE(auth.stat().st_mode) == 0o600
    assert host in json.loads(auth.read_text())["auths"]

    result = rdaemon.cli("push", name, "--insecure")
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[0] == "retrieving manifest" and result.stderr.splitlines()[-1] == "success"
    assert rdaemon.cli("rm", name).returncode == 0
    result = rdaemon.cli("pull", name, "--insecure")
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0] == "pulling manifest" and lines[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    assert any(line.startswith("pulling ") and " 100% " in line for line in lines)
    assert rdaemon.cli("list").stdout.count(name) == 1

    assert rdaemon.cli("logout", host).stdout.strip() == f"Removed login credentials for {host}"
    assert rdaemon.cli("rm", name).returncode == 0
    result = rdaemon.cli("pull", name, "--insecure")
    assert result.returncode == 1 and f'run "corral login {host}"' in result.stderr
