"""The puller against a hostile (or merely broken) registry: the fake registry, in process, with a temporary store.

Every case must end in a clear error, with nothing written outside the store, no blob that does not hash to its
digest, and no manifest (so nothing visible as a model).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from errors import (
    BlobDigestMismatch,
    CorralError,
    InsecureRegistry,
    InsufficientSpace,
    RegistryNotFound,
    RegistryProtocolError,
    RegistryUnauthorized,
    RegistryUnreachable,
)
from registry.digest import Digest
from registry.download import Downloads, Tuning
from registry.pull import Puller
from registry.store import Store, partial_digest
from tests.registry_pull.fake_registry import (
    CONFIG_TYPE,
    MANIFEST_TYPE,
    MODEL_TYPE,
    BlobHost,
    FakeRegistry,
    ServerThread,
    digest_of,
)

FAST = Tuning(streams=4, part_size=64 * 1024, backoff=0.01, read_timeout=2.0, save_interval=0.05, buffer=16 * 1024)
CONFIG = b'{"model_format":"gguf"}'


def make_puller(store: Store, downloads: Downloads | None = None, **kw: Any) -> Puller:
    return Puller(
        store,
        downloads or Downloads(),
        threading.RLock(),
        prune=True,
        tuning=kw.pop("tuning", FAST),
        interval=0.01,
        **kw,
    )


def pull(store: Store, name: str, **kw: Any) -> list[dict[str, Any]]:
    insecure = kw.pop("insecure", True)
    return list(make_puller(store, **kw).run(name, insecure=insecure))


def assert_nothing_visible(store: Store, *, allow_blobs: frozenset[str] = frozenset(), partials: bool = False) -> None:
    """No model, and no blob but ``allow_blobs`` (each hashing to its name); partial downloads only if allowed
    (a pull that failed on the network keeps them for resuming)."""
    assert store.list_models() == []
    names = {p.name for p in store.blobs_dir.iterdir()}
    for name in names:
        if partials and partial_digest(name) is not None:
            continue
        digest = Digest.from_filename(name)
        assert digest is not None, f"unexpected file in blobs/: {name}"
        assert str(digest) in allow_blobs
        assert Digest.of_bytes((store.blobs_dir / name).read_bytes()) == digest


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "models")


def raw_manifest(config: dict[str, Any] | None, layers: list[dict[str, Any]] | None) -> bytes:
    doc: dict[str, Any] = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE}
    if config is not None:
        doc["config"] = config
    if layers is not None:
        doc["layers"] = layers
    return json.dumps(doc).encode()


def good_config() -> dict[str, Any]:
    return {"mediaType": CONFIG_TYPE, "digest": digest_of(CONFIG), "size": len(CONFIG)}


# -- the happy path, as a baseline ------------------------------------------------------------------------------
def test_pull_from_fake_registry(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(300_000)
    registry.add_model("ns/m", "v1", [(MODEL_TYPE, data)])
    lines = pull(store, f"{server.host}/ns/m:v1")
    statuses = [line["status"] for line in lines]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    blob_lines = [line for line in lines if line.get("digest") == digest_of(data)]
    assert blob_lines[0]["status"] == f"pulling {digest_of(data)[7:19]}"
    assert blob_lines[-1]["completed"] == blob_lines[-1]["total"] == len(data)
    assert all("completed" not in line or line["completed"] > 0 for line in blob_lines)
    (model,) = store.list_models()
    assert str(model.name) == f"{server.host}/ns/m:v1"
    assert store.blob_path(Digest.parse(digest_of(data))).read_bytes() == data
    assert not list(store.blobs_dir.glob("*partial*"))
    # parts in parallel: several ranged GETs for one blob
    assert len(registry.requests("GET", digest_of(data))) >= 4


def test_pull_without_splice(
    fake: tuple[FakeRegistry, ServerThread], store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The readinto + pwrite path (TLS, chunked bodies, other systems) on its own."""
    import registry.fetch

    monkeypatch.setattr(registry.fetch, "SPLICE", False)
    registry_, server = fake
    data = os.urandom(300_000)
    registry_.add_model("ns/m", "v1", [(MODEL_TYPE, data)])
    assert pull(store, f"{server.host}/ns/m:v1")[-1] == {"status": "success"}
    assert store.blob_path(Digest.parse(digest_of(data))).read_bytes() == data


def test_pull_over_tls(store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registry on HTTPS (a throwaway self-signed certificate): no --insecure needed, token and blobs over TLS."""
    import shutil
    import ssl
    import subprocess

    import registry.remote

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    monkeypatch.setattr(registry.remote, "ssl_context", lambda: ssl.create_default_context(cafile=str(cert)))
    reg = FakeRegistry()
    data = os.urandom(300_000)
    reg.add_model("ns/m", "v1", [(MODEL_TYPE, data)])
    reg.bearer_token = "tls-token"
    with ServerThread(reg, certfile=str(cert), keyfile=str(key)) as server:
        reg.realm = f"{server.url}/token"
        assert pull(store, f"{server.host}/ns/m:v1", insecure=False)[-1] == {"status": "success"}
    assert store.blob_path(Digest.parse(digest_of(data))).read_bytes() == data
    assert len(reg.requests("GET", digest_of(data))) >= 4


def test_blobs_already_present_are_not_fetched_again(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(100_000)
    registry.add_model("ns/m", "a", [(MODEL_TYPE, data)])
    pull(store, f"{server.host}/ns/m:a")
    registry.seen.clear()
    lines = pull(store, f"{server.host}/ns/m:a")
    assert registry.requests("GET", "/blobs/") == []
    done = [line for line in lines if line.get("digest") == digest_of(data)]
    assert done == [
        {
            "status": f"pulling {digest_of(data)[7:19]}",
            "digest": digest_of(data),
            "total": len(data),
            "completed": len(data),
        }
    ]


def test_two_pulls_of_one_blob_share_a_download(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(400_000)
    registry.add_model("ns/one", "latest", [(MODEL_TYPE, data)])
    registry.add_model("ns/two", "latest", [(MODEL_TYPE, data)])
    registry.throttle = 1_000_000  # slow enough that the two pulls overlap
    downloads = Downloads()
    results: dict[str, list[dict[str, Any]]] = {}

    def run(repo: str) -> None:
        results[repo] = list(make_puller(store, downloads).run(f"{server.host}/{repo}", insecure=True))

    threads = [threading.Thread(target=run, args=(repo,)) for repo in ("ns/one", "ns/two")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results["ns/one"][-1] == results["ns/two"][-1] == {"status": "success"}
    assert len(store.list_models()) == 2
    assert sum(s.sent for s in registry.requests("GET", digest_of(data))) == len(data)  # fetched once


# -- manifests ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad",
    [
        "sha256:../../../../tmp/evil",
        "sha256:" + "a" * 63,
        "sha256:" + "a" * 65,
        "sha256:" + "A" * 64,
        "sha512:" + "a" * 128,
        "",
        "sha256-" + "a" * 64,
        "sha256:..%2f..%2f" + "a" * 58,
        None,
    ],
)
@pytest.mark.parametrize("where", ["layer", "config"])
def test_invalid_digests_are_refused_before_any_path(
    fake: tuple[FakeRegistry, ServerThread], store: Store, tmp_path: Path, bad: str | None, where: str
) -> None:
    registry, server = fake
    entry = {"mediaType": MODEL_TYPE, "digest": bad, "size": 5}
    good_layer = {"mediaType": MODEL_TYPE, "digest": digest_of(b"hello"), "size": 5}
    raw = raw_manifest(
        {**good_config(), "digest": bad} if where == "config" else good_config(),
        [entry] if where == "layer" else [good_layer],
    )
    registry.add_model("ns/evil", "latest", [(MODEL_TYPE, b"hello")], raw=raw)
    with pytest.raises(RegistryProtocolError, match="invalid manifest.*invalid digest"):
        pull(store, f"{server.host}/ns/evil")
    assert registry.requests("GET", "/blobs/") == []
    assert not (tmp_path / "evil").exists()
    assert_nothing_visible(store)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (raw_manifest(good_config(), []), "has no layers"),
        (raw_manifest(good_config(), None), "no layers list"),
        (raw_manifest(None, [{"mediaType": MODEL_TYPE, "digest": digest_of(b"x"), "size": 1}]), "config must be"),
        (
            raw_manifest(good_config(), [{"mediaType": MODEL_TYPE, "digest": digest_of(b"x"), "size": -1}]),
            "invalid size -1",
        ),
        (
            raw_manifest(good_config(), [{"mediaType": MODEL_TYPE, "digest": digest_of(b"x"), "size": 1 << 60}]),
            "invalid size",
        ),
        (
            raw_manifest(good_config(), [{"mediaType": MODEL_TYPE, "digest": digest_of(b"x"), "size": "1"}]),
            "invalid size",
        ),
        (
            raw_manifest(good_config(), [{"mediaType": MODEL_TYPE, "digest": digest_of(b"x"), "size": 1}] * 2),
            "more than once",
        ),
        (
            raw_manifest(good_config(), [{"mediaType": MODEL_TYPE, "digest": digest_of(CONFIG), "size": len(CONFIG)}]),
            "more than once",
        ),
        (b"not json", "not valid JSON"),
        (b"[]", "must be a JSON object"),
        (json.dumps({"schemaVersion": 1}).encode(), "schemaVersion"),
    ],
)
def test_malformed_manifests_give_clear_errors(
    fake: tuple[FakeRegistry, ServerThread], store: Store, raw: bytes, message: str
) -> None:
    registry, server = fake
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, b"x")], raw=raw)
    with pytest.raises(RegistryProtocolError, match=message):
        pull(store, f"{server.host}/ns/m")
    assert_nothing_visible(store)


def test_oversized_manifest_is_not_read(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, b"x")], raw=b" " * (5 * 1024 * 1024))
    with pytest.raises(RegistryProtocolError, match="manifest of 5242880 bytes, more than"):
        pull(store, f"{server.host}/ns/m")


def test_gzip_bomb_manifest_is_capped(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    bomb = gzip.compress(b" " * (64 * 1024 * 1024))
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, b"x")], raw=bomb, headers={"content-encoding": "gzip"})
    with pytest.raises(RegistryProtocolError, match="manifest larger than"):
        pull(store, f"{server.host}/ns/m")


def test_manifest_digest_header_must_match(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, b"x")], headers={"docker-content-digest": digest_of(b"y")})
    with pytest.raises(RegistryProtocolError, match="do not match its Docker-Content-Digest"):
        pull(store, f"{server.host}/ns/m")


def test_image_index_is_refused(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    registry.add_model(
        "ns/m", "latest", [(MODEL_TYPE, b"x")], headers={"content-type": "application/vnd.oci.image.index.v1+json"}
    )
    with pytest.raises(RegistryProtocolError, match="image index"):
        pull(store, f"{server.host}/ns/m")


def test_missing_model_is_not_found(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    _registry, server = fake
    with pytest.raises(RegistryNotFound, match="^pull model manifest: file does not exist$"):
        pull(store, f"{server.host}/ns/nothing")


def test_oversized_error_body_is_capped(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(1000)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    registry.fail_blob_gets = 100
    registry.error_body = b"E" * (10 * 1024 * 1024)
    with pytest.raises(RegistryUnreachable, match="failed after 2 retries") as info:
        pull(store, f"{server.host}/ns/m", tuning=Tuning(max_retries=2, backoff=0.01))
    assert len(str(info.value)) < 1000
    assert_nothing_visible(store, allow_blobs=frozenset({digest_of(CONFIG)}), partials=True)


# -- blob bytes --------------------------------------------------------------------------------------------------
def test_digest_mismatch_discards_the_bytes(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(200_000)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    registry.corrupt.add(digest_of(data))
    with pytest.raises(
        BlobDigestMismatch,
        match=r"^digest mismatch, file must be downloaded again: want "
        + digest_of(data)
        + ", got sha256:[0-9a-f]{64}$",
    ):
        pull(store, f"{server.host}/ns/m")
    assert_nothing_visible(store, allow_blobs=frozenset({digest_of(CONFIG)}))


def test_wrong_content_range_is_refused(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(1000)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    registry.blobs[digest_of(data)] = data + b"extra bytes"  # the registry's idea of the blob is longer
    with pytest.raises(RegistryProtocolError, match="Content-Range"):
        pull(store, f"{server.host}/ns/m")
    assert_nothing_visible(store, allow_blobs=frozenset({digest_of(CONFIG)}))


def test_server_that_ignores_ranges_still_works(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(300_000)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    registry.ignore_range = True
    assert pull(store, f"{server.host}/ns/m")[-1] == {"status": "success"}
    assert store.blob_path(Digest.parse(digest_of(data))).read_bytes() == data


def test_failed_parts_are_retried(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(300_000)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    registry.fail_blob_gets = 3
    assert pull(store, f"{server.host}/ns/m")[-1] == {"status": "success"}
    parts = -(-300_000 // (64 * 1024))
    assert len(registry.requests("GET", "/blobs/")) == 3 + parts + 1  # failures, parts, the config


def test_stalled_part_is_restarted(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(200_000)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    registry.stall_blob_gets = 1
    registry.stall_seconds = 3
    tuning = Tuning(streams=2, part_size=64 * 1024, read_timeout=0.5, backoff=0.01, buffer=16 * 1024)
    assert pull(store, f"{server.host}/ns/m", tuning=tuning)[-1] == {"status": "success"}
    assert store.blob_path(Digest.parse(digest_of(data))).read_bytes() == data


def test_a_crawling_part_is_restarted(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(2 * 1024 * 1024)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    registry.slow_blob_gets = 1  # the first part would take 13 s at 20 kB/s
    registry.slow_digest = digest_of(data)
    tuning = Tuning(streams=4, part_size=256 * 1024, laggard_after=0.5, backoff=0.01, buffer=16 * 1024)
    assert pull(store, f"{server.host}/ns/m", tuning=tuning)[-1] == {"status": "success"}
    # the pull was over before the crawling answer was (it has 13 s to go): an order, not a time (issue 26: < 8 s)
    first_part = [
        s for s in registry.requests("GET", digest_of(data)) if s.headers["range"].endswith(f"-{256 * 1024 - 1}")
    ]
    assert first_part[0].sent < 256 * 1024, first_part[0].sent
    assert store.blob_path(Digest.parse(digest_of(data))).read_bytes() == data
    ranges = [s.headers["range"] for s in first_part]
    assert ranges[0] == f"bytes=0-{256 * 1024 - 1}" and len(ranges) == 2  # cut off, then asked again


def test_not_enough_disk_space(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, os.urandom(1000))])
    huge = raw_manifest(good_config(), [{"mediaType": MODEL_TYPE, "digest": digest_of(b"z"), "size": 1 << 49}])
    registry.add_model("ns/huge", "latest", [(MODEL_TYPE, b"z")], raw=huge)
    with pytest.raises(InsufficientSpace, match=r"not enough disk space to pull .*ns/huge:latest: it needs 562\.9 TB"):
        pull(store, f"{server.host}/ns/huge")
    with pytest.raises(InsufficientSpace, match="is free in"):
        pull(store, f"{server.host}/ns/m", free_space=lambda path: 10_000)
    assert registry.requests("GET", "/blobs/") == []
    assert_nothing_visible(store)


# -- redirects and credentials -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("location", "error", "message"),
    [
        ("file:///etc/passwd", RegistryProtocolError, "only http"),
        ("gopher://127.0.0.1:70/x", RegistryProtocolError, "only http"),
        ("http://169.254.169.254/latest/meta-data/", RegistryProtocolError, "link-local"),
        ("//[fe80::1]/x", RegistryProtocolError, "link-local"),
        ("http://corral-test-nowhere.invalid/blob", RegistryProtocolError, "does not resolve"),
    ],
)
def test_bad_blob_redirects_are_refused(
    fake: tuple[FakeRegistry, ServerThread], store: Store, location: str, error: type[CorralError], message: str
) -> None:
    registry, server = fake
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, os.urandom(1000))])
    registry.redirect_location = location
    with pytest.raises(error, match=message):
        pull(store, f"{server.host}/ns/m")
    assert_nothing_visible(store)


def test_blob_redirect_to_another_host_gets_no_credentials(
    fake: tuple[FakeRegistry, ServerThread], store: Store, tmp_path: Path
) -> None:
    registry, server = fake
    data = os.urandom(300_000)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    registry.bearer_token = "s3cret-token"
    cdn = BlobHost(blobs={digest_of(data): data, digest_of(CONFIG): CONFIG})
    with ServerThread(cdn) as cdn_server:
        registry.redirect_blobs = cdn_server.url
        assert pull(store, f"{server.host}/ns/m")[-1] == {"status": "success"}
    assert store.blob_path(Digest.parse(digest_of(data))).read_bytes() == data
    assert cdn.seen and all("authorization" not in s.headers for s in cdn.seen)
    # the registry itself got the token; the CDN was asked directly after the first redirect
    assert any(s.headers.get("authorization") == "Bearer s3cret-token" for s in registry.requests("GET", "/blobs/"))
    assert len(registry.requests("GET", digest_of(data))) < len([s for s in cdn.seen if digest_of(data) in s.path])


def test_bearer_token_flow(fake: tuple[FakeRegistry, ServerThread], store: Store, tmp_path: Path) -> None:
    registry, server = fake
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, os.urandom(1000))])
    registry.bearer_token = "tok-123"
    registry.basic = ("alice", "pw")
    auth = tmp_path / "auth.json"
    with pytest.raises(RegistryUnauthorized, match=f"corral login {server.host}"):
        pull(store, f"{server.host}/ns/m")
    from registry.credentials import Credentials, save

    save(server.host, Credentials("alice", "wrong"), auth)
    with pytest.raises(RegistryUnauthorized, match="for user 'alice'"):
        pull(store, f"{server.host}/ns/m", auth_files=[auth])
    save(server.host, Credentials("alice", "pw"), auth)
    assert pull(store, f"{server.host}/ns/m", auth_files=[auth])[-1] == {"status": "success"}
    (token_request,) = [s for s in registry.requests("GET", "/token") if s.status == 200]
    assert "scope=repository%3Ax%3Apull" in token_request.path and "service=fake" in token_request.path


def test_an_expired_token_is_renewed(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    data = os.urandom(300_000)
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    registry.bearer_token = "first"
    registry.throttle = 500_000
    puller = make_puller(store)
    it = puller.run(f"{server.host}/ns/m", insecure=True)
    lines = [next(it), next(it)]
    registry.bearer_token = "second"  # the registry rotates its tokens mid-pull
    registry.throttle = None
    lines += list(it)
    assert lines[-1] == {"status": "success"}
    assert len([s for s in registry.requests("GET", "/token") if s.status == 200]) == 2
    assert store.blob_path(Digest.parse(digest_of(data))).read_bytes() == data


def test_token_realm_on_another_host_is_refused(
    fake: tuple[FakeRegistry, ServerThread], store: Store, tmp_path: Path
) -> None:
    registry, server = fake
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, b"x")])
    registry.bearer_token = "tok"
    evil = BlobHost()
    with ServerThread(evil) as evil_server:
        registry.realm = f"http://localhost:{evil_server.port}/token"
        from registry.credentials import Credentials, save

        save(server.host, Credentials("alice", "pw"), tmp_path / "auth.json")
        with pytest.raises(RegistryProtocolError, match="token from another host"):
            pull(store, f"{server.host}/ns/m", auth_files=[tmp_path / "auth.json"])
    assert evil.seen == []


def test_token_realm_on_another_port_of_the_same_host_is_refused(
    fake: tuple[FakeRegistry, ServerThread], store: Store, tmp_path: Path
) -> None:
    """127.0.0.1:<other port> is another server (any local user may run one): it must not get the password."""
    registry, server = fake
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, b"x")])
    registry.bearer_token = "tok"
    evil = BlobHost()
    with ServerThread(evil) as evil_server:
        registry.realm = f"http://127.0.0.1:{evil_server.port}/token"
        from registry.credentials import Credentials, save

        save(server.host, Credentials("alice", "pw"), tmp_path / "auth.json")
        with pytest.raises(RegistryProtocolError, match="token from another host or port"):
            pull(store, f"{server.host}/ns/m", auth_files=[tmp_path / "auth.json"])
    assert evil.seen == []
    assert_nothing_visible(store)


def test_oversized_token_response(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, b"x")])
    registry.bearer_token = "tok"
    registry.token_body = b'{"token":"' + b"a" * (2 * 1024 * 1024) + b'"}'
    with pytest.raises(RegistryProtocolError, match="token response of .* bytes, more than"):
        pull(store, f"{server.host}/ns/m")
    registry.token_body = b'{"token": "bad token\\r\\nX-Injected: 1"}'
    with pytest.raises(RegistryProtocolError, match="without a usable token"):
        pull(store, f"{server.host}/ns/m")


def test_plain_http_needs_insecure(fake: tuple[FakeRegistry, ServerThread], store: Store) -> None:
    registry, server = fake
    registry.add_model("ns/m", "latest", [(MODEL_TYPE, b"x")])
    with pytest.raises(InsecureRegistry, match="does not speak HTTPS.*--insecure"):
        pull(store, f"{server.host}/ns/m", insecure=False)
    with pytest.raises(InsecureRegistry, match="^insecure protocol http$"):
        pull(store, f"http://{server.host}/ns/m", insecure=False)
    assert pull(store, f"http://{server.host}/ns/m", insecure=True)[-1] == {"status": "success"}
