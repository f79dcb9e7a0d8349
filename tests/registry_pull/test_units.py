"""Units of the registry client: challenges, credentials files, URL rules, part plans, the progress renderer,
cancelling and resuming in process, pushing to the fake registry, and ``corral prune`` through a daemon."""

from __future__ import annotations

import base64
import io
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from rich.console import Console

from cli.progress import render_progress
from errors import CredentialsError, InsecureRegistry, RegistryProtocolError
from registry.credentials import Credentials, auth_files, lookup, registry_key, remove, save
from registry.digest import Digest
from registry.download import Downloads, Tuning, plan_parts
from registry.manifest import Layer, Manifest
from registry.names import ModelName
from registry.pull import Puller
from registry.push import Pusher
from registry.remote import Origin, RegistryClient, URLPolicy, parse_challenge
from registry.store import Store
from tests.conftest import Daemon
from tests.registry_pull.fake_registry import MODEL_TYPE, FakeRegistry, ServerThread, digest_of

MiB = 1024 * 1024


# -- challenges --------------------------------------------------------------------------------------------------
def test_parse_challenge() -> None:
    assert parse_challenge(
        'Bearer realm="https://r.example/token",service="r.example",scope="repository:a/b:pull"'
    ) == ("bearer", {"realm": "https://r.example/token", "service": "r.example", "scope": "repository:a/b:pull"})
    assert parse_challenge('Basic realm="Registry Realm"') == ("basic", {"realm": "Registry Realm"})
    assert parse_challenge('bearer realm="a\\"b", error=invalid_token') == (
        "bearer",
        {"realm": 'a"b', "error": "invalid_token"},
    )
    assert parse_challenge("Bearer") == ("bearer", {})


# -- credentials -------------------------------------------------------------------------------------------------
def test_credentials_files(tmp_path: Path) -> None:
    docker = tmp_path / "config.json"
    docker.write_text(
        json.dumps(
            {
                "auths": {
                    "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:pw").decode()},
                    "http://127.0.0.1:5000": {"username": "u", "password": "p:with:colons"},
                    "other.example": {"identitytoken": "x"},
                },
                "credsStore": "desktop",
            }
        )
    )
    assert lookup("index.docker.io", [docker]) == Credentials("hub", "pw")
    assert lookup("127.0.0.1:5000", [docker]) == Credentials("u", "p:with:colons")
    assert lookup("other.example", [docker]) is None
    assert lookup("missing.example", [tmp_path / "absent.json", docker]) is None
    assert "pw" not in repr(Credentials("hub", "pw"))

    mine = tmp_path / "corral" / "auth.json"
    save("Registry.Example:443", Credentials("alice", "s3cret"), mine)
    save("127.0.0.1:5000", Credentials("bob", "x"), mine)
    assert oct(mine.stat().st_mode & 0o777) == "0o600"
    assert lookup("registry.example:443", [mine, docker]) == Credentials("alice", "s3cret")
    assert lookup("127.0.0.1:5000", [mine, docker]) == Credentials("bob", "x")  # the first file wins
    assert remove("registry.example:443", mine) is True
    assert remove("registry.example:443", mine) is False
    assert lookup("registry.example:443", [mine]) is None
    assert registry_key("https://Reg.Example/v1/") == "reg.example"


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[]",
        '{"auths": []}',
        '{"auths": {"h": {"auth": "%%%"}}}',
        '{"auths": {"h": {"auth": "bm9jb2xvbg=="}}}',
    ],
)
def test_bad_credentials_files(tmp_path: Path, content: str) -> None:
    path = tmp_path / "auth.json"
    path.write_text(content)
    with pytest.raises(CredentialsError, match=str(path)):
        lookup("h", [path])


def test_auth_file_search_order(tmp_path: Path) -> None:
    assert auth_files(str(tmp_path / "x.json")) == [tmp_path / "x.json"]
    files = auth_files(None, {"DOCKER_CONFIG": str(tmp_path)})
    assert files[0].name == "auth.json" and files[0].parent.name == "corral"
    assert files[1] == tmp_path / "config.json"


# -- URL rules ---------------------------------------------------------------------------------------------------
def public_policy(insecure: bool = False) -> URLPolicy:
    table = {
        "registry.example": ["93.184.215.14"],
        "cdn.example": ["104.16.0.1"],
        "sneaky.example": ["10.1.2.3"],
        "meta.example": ["169.254.169.254"],
    }
    return URLPolicy(Origin.of("https://registry.example"), insecure, resolve=lambda host: table.get(host, []))


def test_url_policy_for_a_public_registry() -> None:
    policy = public_policy()
    assert policy.check("https://cdn.example/blob?sig=1").host == "cdn.example"
    assert policy.check("https://registry.example/v2/x").host == "registry.example"
    for url, message in [
        ("https://127.0.0.1/x", "internal address"),
        ("https://localhost:8080/x", "internal address"),
        ("https://10.0.0.1/x", "internal address"),
        ("https://sneaky.example/x", "internal address"),
        ("https://[::1]/x", "internal address"),
        ("https://meta.example/x", "link-local"),
        ("https://169.254.169.254/x", "link-local"),
        ("ftp://cdn.example/x", "only http"),
        ("file:///etc/passwd", "only http"),
    ]:
        with pytest.raises(RegistryProtocolError, match=message):
            policy.check(url)
    with pytest.raises(InsecureRegistry, match="plain HTTP"):
        policy.check("http://cdn.example/x")
    assert public_policy(insecure=True).check("http://cdn.example/x").scheme == "http"


def test_url_policy_for_a_local_registry() -> None:
    policy = URLPolicy(Origin.of("http://127.0.0.1:5000"), True, resolve=lambda host: [])
    assert policy.check("http://127.0.0.1:9000/x").port == 9000  # a local registry may use local storage
    with pytest.raises(RegistryProtocolError, match="link-local"):
        policy.check("http://169.254.169.254/latest/meta-data/")


def test_url_policy_refuses_every_non_global_address() -> None:
    """Carrier-grade NAT (100.64.0.0/10, where Tailscale lives), ULA, IPv4 inside IPv6, reserved ranges: all
    internal; a name is trusted only if every address it resolves to is allowed."""
    table = {
        "registry.example": ["93.184.215.14"],
        "cgnat.example": ["100.64.1.2"],
        "ula.example": ["fd12::1"],
        "mixed.example": ["104.16.0.2", "10.0.0.5"],
        "mapped.example": ["::ffff:127.0.0.1"],
        "cdn.example": ["104.16.0.1", "2606:4700::1"],
    }
    policy = URLPolicy(Origin.of("https://registry.example"), False, resolve=lambda host: table.get(host, []))
    for url in [
        "https://100.64.0.1/x",
        "https://100.127.255.254/x",
        "https://cgnat.example/x",
        "https://[fd12::1]/x",
        "https://ula.example/x",
        "https://mixed.example/x",
        "https://mapped.example/x",
        "https://[::ffff:10.0.0.1]/x",
        "https://[64:ff9b::a00:1]/x",
        "https://[2002:a00:1::1]/x",
        "https://0.0.0.0/x",
        "https://240.0.0.1/x",
        "https://198.18.0.1/x",
        "https://224.0.0.1/x",
    ]:
        with pytest.raises(RegistryProtocolError, match="internal address"):
            policy.check(url)
    with pytest.raises(RegistryProtocolError, match="link-local"):
        policy.check("https://[::ffff:169.254.169.254]/x")
    assert policy.check("https://cdn.example/x").host == "cdn.example"


def test_url_policy_refuses_names_that_do_not_resolve() -> None:
    policy = public_policy()
    with pytest.raises(RegistryProtocolError, match=r"nowhere\.example.*does not resolve"):
        policy.check("https://nowhere.example/blob")
    # the registry's own origin needs no lookup; the same host on another port is another origin, looked up
    registry_only = URLPolicy(Origin.of("https://registry.example"), False, resolve=lambda host: [])
    assert registry_only.check("https://registry.example/v2/x").host == "registry.example"
    assert registry_only.check("https://registry.example:443/v2/x").host == "registry.example"
    with pytest.raises(RegistryProtocolError, match="does not resolve"):
        registry_only.check("https://registry.example:8443/v2/x")


def test_origins_normalise_default_ports() -> None:
    assert Origin.of("https://Registry.Example/x") == Origin.of("https://registry.example:443/y")
    assert Origin.of("http://registry.example") == Origin.of("http://registry.example:80")
    assert Origin.of("https://registry.example") != Origin.of("https://registry.example:8443")
    assert Origin.of("https://registry.example:80") != Origin.of("http://registry.example:80")


@pytest.mark.parametrize(
    "realm",
    [
        "https://registry.example:8443/token",
        "https://registry.example:80/token",
        "http://registry.example/token",
        "https://auth.registry.example/token",
        "https://registry.example.evil.example/token",
    ],
)
def test_token_realm_must_be_the_registry_origin(realm: str) -> None:
    """A realm on the registry's host but another port (or scheme) is another server: no credentials go there."""
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if request.url.path == "/token":
            return httpx.Response(200, json={"token": "t"})
        return httpx.Response(401, headers={"www-authenticate": f'Bearer realm="{realm}",service="r"'})

    client = RegistryClient(
        ModelName.parse("registry.example/ns/m"),
        credentials=Credentials("alice", "pw"),
        transport=httpx.MockTransport(handler),
    )
    try:
        with pytest.raises((RegistryProtocolError, InsecureRegistry), match="token|plain-HTTP"):
            client.get_manifest()
    finally:
        client.release()
    assert [str(r.url) for r in sent] == ["https://registry.example/v2/ns/m/manifests/latest"]


def test_token_realm_on_the_registry_origin_is_used() -> None:
    sent: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append(request)
        if request.url.path == "/token":
            return httpx.Response(200, json={"token": "t"})
        if request.headers.get("authorization") != "Bearer t":
            return httpx.Response(
                401, headers={"www-authenticate": 'Bearer realm="https://registry.example:443/token",service="r"'}
            )
        return httpx.Response(200, content=b"{}")

    client = RegistryClient(
        ModelName.parse("registry.example/ns/m"),
        credentials=Credentials("alice", "pw"),
        transport=httpx.MockTransport(handler),
    )
    try:
        assert client.get_manifest() == b"{}"
    finally:
        client.release()
    assert [r.url.path for r in sent] == ["/v2/ns/m/manifests/latest", "/token", "/v2/ns/m/manifests/latest"]
    assert sent[1].headers["authorization"].startswith("Basic ")


def test_part_plans() -> None:
    t = Tuning()
    assert plan_parts(0, t) == []
    assert [(p.offset, p.size) for p in plan_parts(10, t)] == [(0, 10)]
    parts = plan_parts(1024 * MiB, t)
    assert len(parts) == 64 and all(p.size == 16 * MiB for p in parts)
    parts = plan_parts(40 * 1024 * MiB + 5, t)
    assert parts[0].size == 256 * MiB and parts[-1].size == 5 and sum(p.size for p in parts) == 40 * 1024 * MiB + 5
    assert parts[1].end == 2 * 256 * MiB - 1


# -- the progress renderer ---------------------------------------------------------------------------------------
EVENTS: list[dict[str, Any]] = [
    {"status": "pulling manifest"},
    {"status": "pulling aaaaaaaaaaaa", "digest": "sha256:" + "a" * 64, "total": 2_000_000},
    {"status": "pulling bbbbbbbbbbbb", "digest": "sha256:" + "b" * 64, "total": 500, "completed": 500},
    {"status": "pulling aaaaaaaaaaaa", "digest": "sha256:" + "a" * 64, "total": 2_000_000, "completed": 1_000_000},
    {"status": "pulling aaaaaaaaaaaa", "digest": "sha256:" + "a" * 64, "total": 2_000_000, "completed": 2_000_000},
    {"status": "verifying sha256 digest"},
    {"status": "writing manifest"},
    {"status": "success"},
]


def test_render_progress_plain() -> None:
    buf = io.StringIO()
    last = render_progress(iter(EVENTS), Console(file=buf, force_terminal=False, width=100))
    assert last == {"status": "success"}
    assert buf.getvalue().splitlines() == [
        "pulling manifest",
        "pulling bbbbbbbbbbbb 100% 500 B",
        "pulling aaaaaaaaaaaa 100% 2.0 MB",
        "verifying sha256 digest",
        "writing manifest",
        "success",
    ]


def test_render_progress_live() -> None:
    buf = io.StringIO()
    render_progress(iter(EVENTS), Console(file=buf, force_terminal=True, width=120, color_system=None))
    text = buf.getvalue()
    for expected in ("pulling manifest", "pulling aaaaaaaaaaaa", "100%", "2.0/2.0 MB", "success"):
        assert expected in text


def test_render_progress_error_propagates() -> None:
    def events() -> Any:
        yield {"status": "pulling manifest"}
        raise RegistryProtocolError("boom")

    with pytest.raises(RegistryProtocolError, match="boom"):
        render_progress(events(), Console(file=io.StringIO(), force_terminal=True))


# -- cancelling and resuming in process --------------------------------------------------------------------------
def test_a_pull_whose_client_leaves_is_cancelled_and_resumes(
    fake: tuple[FakeRegistry, ServerThread], tmp_path: Path
) -> None:
    registry, server = fake
    data = os.urandom(2 * MiB)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    registry.throttle = 2 * MiB  # a second per stream for its 1 MiB... slow enough to leave mid-way
    store = Store(tmp_path / "models")
    downloads = Downloads()
    tuning = Tuning(streams=2, part_size=256 * 1024, save_interval=0.05, buffer=16 * 1024, backoff=0.01)
    puller = Puller(store, downloads, threading.RLock(), prune=True, tuning=tuning, interval=0.02)
    it = puller.run(f"{server.host}/ns/m", insecure=True)
    for line in it:
        if line.get("digest") == digest_of(data) and line.get("completed", 0) >= 256 * 1024:
            break
    it.close()  # the client went away
    digest = Digest.parse(digest_of(data))
    deadline = time.monotonic() + 10
    while digest in downloads.busy() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert digest not in downloads.busy()
    state = json.loads(store.partial_state_path(digest).read_bytes())
    saved = sum(p[2] for p in state["parts"])
    assert 256 * 1024 <= saved < len(data)
    assert store.list_models() == []

    registry.throttle = None
    registry.seen.clear()
    lines = list(
        Puller(store, downloads, threading.RLock(), prune=True, tuning=tuning).run(f"{server.host}/ns/m", insecure=True)
    )
    assert lines[-1] == {"status": "success"}
    assert sum(s.sent for s in registry.requests("GET", digest_of(data))) == len(data) - saved
    assert store.blob_path(digest).read_bytes() == data


def test_damaged_partial_state_starts_afresh(fake: tuple[FakeRegistry, ServerThread], tmp_path: Path) -> None:
    registry, server = fake
    data = os.urandom(300_000)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    store = Store(tmp_path / "models")
    digest = Digest.parse(digest_of(data))
    store.partial_path(digest).write_bytes(b"\0" * 10)
    store.partial_state_path(digest).write_text('{"digest": "x", "total": -1, "parts": [[0, 1, 5]]}')
    lines = list(Puller(store, Downloads(), threading.RLock(), prune=True).run(f"{server.host}/ns/m", insecure=True))
    assert lines[-1] == {"status": "success"}
    assert store.blob_path(digest).read_bytes() == data


def test_a_blob_of_the_wrong_size_is_fetched_again(fake: tuple[FakeRegistry, ServerThread], tmp_path: Path) -> None:
    registry, server = fake
    data = os.urandom(100_000)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    store = Store(tmp_path / "models")
    digest = Digest.parse(digest_of(data))
    store.blob_path(digest).write_bytes(data[:5000])  # as a crash before writeback could leave it
    lines = list(Puller(store, Downloads(), threading.RLock(), prune=True).run(f"{server.host}/ns/m", insecure=True))
    assert lines[-1] == {"status": "success"}
    assert store.blob_path(digest).read_bytes() == data


def test_pull_replaces_a_tag_and_removes_unused_layers(fake: tuple[FakeRegistry, ServerThread], tmp_path: Path) -> None:
    registry, server = fake
    old, new = os.urandom(1000), os.urandom(1000)
    store = Store(tmp_path / "models")
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, old)])
    list(Puller(store, Downloads(), threading.RLock(), prune=True).run(f"{server.host}/ns/m", insecure=True))
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, new)])
    lines = list(Puller(store, Downloads(), threading.RLock(), prune=True).run(f"{server.host}/ns/m", insecure=True))
    assert [line["status"] for line in lines][-2:] == ["removing unused layers", "success"]
    assert not store.has_blob(Digest.parse(digest_of(old))) and store.has_blob(Digest.parse(digest_of(new)))


# -- push --------------------------------------------------------------------------------------------------------
CONFIG = b'{"model_format":"gguf"}'


def stored_model(store: Store, name: str, blobs: list[bytes]) -> Manifest:
    from registry.names import ModelName

    config = CONFIG
    layers = [Layer(MODEL_TYPE, store.put_bytes(b), len(b)) for b in blobs]
    manifest = Manifest.build(
        Layer("application/vnd.docker.container.image.v1+json", store.put_bytes(config), len(config)), layers
    )
    store.write_manifest(ModelName.parse(name), manifest)
    return manifest


def test_push_uploads_only_missing_blobs_in_chunks(fake: tuple[FakeRegistry, ServerThread], tmp_path: Path) -> None:
    registry, server = fake
    store = Store(tmp_path / "models")
    big, small = os.urandom(300_000), b"already there"
    name = f"{server.host}/ns/m:v1"
    manifest = stored_model(store, name, [big, small])
    registry.blobs[digest_of(small)] = small
    registry.fail_patches = 1
    lines = list(Pusher(store, chunk=100_000, retry_wait=0.01).run(name, insecure=True))
    assert lines[0] == {"status": "retrieving manifest"} and lines[-2:] == [
        {"status": "pushing manifest"},
        {"status": "success"},
    ]
    assert registry.blobs[digest_of(big)] == big
    assert registry.manifests[("ns/m", "v1")][0] == manifest.raw
    # the big blob in three chunks (one sent twice: the registry failed it), the config in one, not the small one
    patches = [(s.status, s.headers["content-range"]) for s in registry.requests("PATCH")]
    assert patches == [
        (503, "0-99999"),
        (202, "0-99999"),
        (202, "100000-199999"),
        (202, "200000-299999"),
        (202, f"0-{len(CONFIG) - 1}"),
    ]
    assert not any(digest_of(small) in s.path for s in registry.requests("PUT"))
    big_lines = [line for line in lines if line.get("digest") == digest_of(big)]
    assert big_lines[-1]["completed"] == len(big)


def test_push_of_a_missing_model(tmp_path: Path) -> None:
    from errors import ModelNotFound

    with pytest.raises(ModelNotFound, match="model 'registry.example/ns/none:v1' not found"):
        Pusher(Store(tmp_path / "models")).run("registry.example/ns/none:v1")


# -- corral prune through the daemon and the CLI -----------------------------------------------------------------
def test_prune_dry_run_then_prune(rdaemon: Daemon, tmp_path: Path) -> None:
    blobs = rdaemon.models / "blobs"
    old = time.time() - 3600
    unused = blobs / ("sha256-" + "1" * 64)
    unused.write_bytes(b"u" * 5000)
    fresh = blobs / ("sha256-" + "2" * 64)
    fresh.write_bytes(b"f" * 10)
    partial = blobs / ("sha256-" + "3" * 64 + "-partial")
    partial.write_bytes(b"p" * 3000)
    state = blobs / ("sha256-" + "3" * 64 + "-partial.json")
    state.write_text('{"digest": "sha256:' + "3" * 64 + '", "total": 3000, "parts": [[0, 3000, 3000]]}')
    for path in (unused, partial, state):
        os.utime(path, (old, old))

    dry = rdaemon.cli("prune", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert f"would remove {unused.name} (blob, 5 KB)" in dry.stdout
    assert f"would remove {partial.name} (partial, " in dry.stdout
    assert dry.stdout.splitlines()[-1].startswith("3 files, 8.") and dry.stdout.endswith(" KB would be freed\n")
    assert unused.exists() and partial.exists() and fresh.exists()

    done = rdaemon.cli("prune")
    assert done.returncode == 0, done.stderr
    assert "3 files removed" in done.stdout
    assert not unused.exists() and not partial.exists() and not state.exists()
    assert fresh.exists()  # younger than the grace period
    assert rdaemon.cli("prune").stdout.strip() == "0 files removed, 0 B freed"
