"""DNS rebinding: a name is looked up once, judged, and the connection goes to the address judged.

A rebinding DNS server answers a public address to the redirect check and 127.0.0.1 to the connection's own
lookup a moment later. The system resolver is replaced (``socket.getaddrinfo``, which both the check and the
standard library's connecting code call) by one that gives each listed name its answers in turn; a real HTTP server
on 127.0.0.1 plays the internal service the attacker is after, and must never see a request.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import registry.remote
from errors import CorralError
from registry.digest import Digest
from registry.fetch import Rejected, Stalled, Transient, open_range
from registry.names import ModelName
from registry.remote import RegistryClient
from tests.registry_pull.fake_registry import MODEL_TYPE, BlobHost, FakeRegistry, ServerThread, digest_of

PUBLIC = "93.184.215.14"  # a global address: a registry or CDN on the internet, as far as the check can tell


class RebindingResolver:
    """``socket.getaddrinfo`` where each listed name answers its addresses one lookup at a time (the last one
    for ever after); every other host (IP literals included) goes to the real resolver."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.lookups: Counter[str] = Counter()
        self.real = socket.getaddrinfo

    def __call__(self, host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name not in self.answers:
            return self.real(host, port, family, type, proto, flags)
        seq = self.answers[name]
        ip = seq[min(self.lookups[name], len(seq) - 1)]
        self.lookups[name] += 1
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        addr: tuple[Any, ...] = (ip, int(port or 0)) if fam == socket.AF_INET else (ip, int(port or 0), 0, 0)
        return [(fam, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", addr)]


@pytest.fixture
def internal_service() -> Iterator[tuple[BlobHost, ServerThread]]:
    """What the attacker wants to reach: a real server on 127.0.0.1 that answers anything it is asked."""
    host = BlobHost()
    host.blobs["blob"] = b"internal secret"
    with ServerThread(host) as server:
        yield host, server


def rebinding_client(monkeypatch: pytest.MonkeyPatch) -> tuple[RegistryClient, RebindingResolver]:
    # the registry and the CDN look public to the check; the CDN's name then answers 127.0.0.1
    resolver = RebindingResolver({"registry.test": [PUBLIC], "cdn.test": [PUBLIC, "127.0.0.1"]})
    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    monkeypatch.setattr(registry.remote, "CONNECT_TIMEOUT", 2.0)  # PUBLIC is not reachable from a test machine
    return RegistryClient(ModelName.parse("registry.test/ns/m"), insecure=True), resolver


def test_blob_download_goes_to_the_checked_address(
    monkeypatch: pytest.MonkeyPatch, internal_service: tuple[BlobHost, ServerThread]
) -> None:
    """The data path (``registry/fetch.py``): a blob URL on the CDN is checked and fetched."""
    service, server = internal_service
    client, resolver = rebinding_client(monkeypatch)
    try:
        url = f"http://cdn.test:{server.port}/blob"
        with pytest.raises((Transient, Stalled, Rejected, CorralError)):
            reader = open_range(client, url, Digest.of_bytes(b"x"), 0, 14, 15, timeout=2.0)
            reader.close()  # only reached if the connection went to the internal service
    finally:
        client.release()
    assert service.seen == [], "the connection went to the rebound address"
    assert resolver.lookups["cdn.test"] == 1  # judged once, and never looked up again


def test_redirect_through_httpx_goes_to_the_checked_address(
    monkeypatch: pytest.MonkeyPatch, internal_service: tuple[BlobHost, ServerThread]
) -> None:
    """The httpx path (``registry/remote.py``: manifests, uploads and their redirects)."""
    service, server = internal_service
    client, resolver = rebinding_client(monkeypatch)
    try:
        with pytest.raises(CorralError):
            reply = client.request("GET", f"http://cdn.test:{server.port}/blob")
            raise AssertionError(f"got an answer: {reply.status} {reply.body!r}")
    finally:
        client.release()
    assert service.seen == [], "the connection went to the rebound address"
    assert resolver.lookups["cdn.test"] == 1


@pytest.fixture
def named_tls_cert(tmp_path: Path) -> tuple[Path, Path]:
    """A throwaway certificate for the name registry.test only (no IP in it), so verifying it against the IP the
    connection really goes to would fail: the check must be against the name."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=registry.test"]
        + ["-addext", "subjectAltName=DNS:registry.test", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_registry_name_is_looked_up_once_and_keeps_host_and_tls_name(
    monkeypatch: pytest.MonkeyPatch, named_tls_cert: tuple[Path, Path]
) -> None:
    """The registry's own name: every connection (manifest through httpx, blob parts through http.client) goes
    to the address of its one lookup, even when the name answers elsewhere later (127.0.0.2: nothing listens),
    with ``Host`` and the TLS server name still the name, and the certificate verified for it."""
    cert, key = named_tls_cert
    monkeypatch.setattr(registry.remote, "ssl_context", lambda: ssl.create_default_context(cafile=str(cert)))
    reg = FakeRegistry()
    data = os.urandom(50_000)
    reg.add_model("ns/m", "latest", [(MODEL_TYPE, data)])
    with ServerThread(reg, certfile=str(cert), keyfile=str(key)) as server:
        resolver = RebindingResolver({"registry.test": ["127.0.0.1", "127.0.0.2"]})
        monkeypatch.setattr(socket, "getaddrinfo", resolver)
        client = RegistryClient(ModelName.parse(f"registry.test:{server.port}/ns/m"))
        try:
            assert client.get_manifest() == reg.manifests[("ns/m", "latest")][0]
            digest = Digest.parse(digest_of(data))
            assert client.has_blob(digest)
            for start in (0, 25_000):  # two fresh connections on the data path
                reader = open_range(client, client.blob_url(digest), digest, start, start + 9, len(data), timeout=5)
                reader.close()
        finally:
            client.release()
    assert resolver.lookups["registry.test"] == 1
    hosts = {s.headers.get("host") for s in reg.seen}
    assert hosts == {f"registry.test:{server.port}"}
    assert len(reg.requests("GET", "/blobs/")) == 2
