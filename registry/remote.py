"""A client for one repository on an OCI distribution (v2) registry: manifests, blob checks, uploads, auth.

Used by pull and push (``registry/pull.py``, ``registry/push.py``); blob *downloads* go through
``registry/fetch.py``, which shares this module's auth and URL rules. Everything a registry says is treated as
hostile:

* Answers are read with size caps (manifests 4 MiB, tokens 1 MiB, error bodies 64 KiB) and ``Accept-Encoding:
  identity``, so neither a huge body nor a compression bomb can exhaust memory.
* Redirects are followed by hand, only to ``http``/``https`` (``http`` only with ``insecure``). A target other
  than the registry's own origin is looked up first: a name that does not resolve is refused, and every address
  it resolves to must be allowed: never from a registry on a global address to a non-global one (loopback,
  private, 100.64.0.0/10, unique-local...), and never to link-local addresses at all.
* A name is looked up once for its check, and the connection goes to the addresses that were checked (TLS still
  verifies the certificate for the name, and ``Host`` stays the name): a DNS server that answers a public address
  to the check and 127.0.0.1 to the connection (DNS rebinding) cannot steer us inside. The registry's own name is
  looked up once per client, so the address its redirects are judged by is the address we talk to. (Through a
  proxy named by ``HTTPS_PROXY``/``HTTP_PROXY`` the proxy resolves names; that is the proxy's policy.)
* Credentials (Basic, or a Bearer token) are sent only to the registry's own origin (scheme, host and port, with
  default ports normalised): never after a redirect to another host or port.
* A Bearer challenge's token realm must be the registry's own origin (scheme, host and port); otherwise no request
  is sent to it.
"""

from __future__ import annotations

import importlib.metadata
import ipaddress
import json
import logging
import platform
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpcore
import httpx

from errors import (
    CorralError,
    InsecureRegistry,
    RegistryError,
    RegistryNotFound,
    RegistryProtocolError,
    RegistryUnauthorized,
    RegistryUnreachable,
)
from registry.credentials import Credentials, lookup
from registry.digest import Digest
from registry.manifest import MANIFEST_MEDIA_TYPE, MAX_MANIFEST_BYTES
from registry.names import ModelName

log = logging.getLogger(__name__)

OCI_MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_MEDIA_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
MAX_TOKEN_BYTES = 1024 * 1024
MAX_ERROR_BYTES = 64 * 1024
MAX_REDIRECTS = 5
MAX_TOKEN_CHARS = 64 * 1024
CONNECT_TIMEOUT = 15.0
READ_TIMEOUT = 60.0

Resolver = Callable[[str], list[str]]


def user_agent() -> str:
    try:
        version = importlib.metadata.version("corral")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was not installed
        version = "0.0.0"
    return f"corral/{version} ({platform.machine()} {platform.system().lower()}) Python/{platform.python_version()}"


def ssl_context() -> ssl.SSLContext:
    """The TLS context for every registry connection (httpx's CA bundle, so both clients trust the same CAs)."""
    return httpx.create_ssl_context()


# -- URL rules ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Origin:
    scheme: str
    host: str  # lower-case hostname, no port
    port: int

    @classmethod
    def of(cls, url: str | httpx.URL) -> Origin:
        u = httpx.URL(str(url))
        port = u.port or (443 if u.scheme == "https" else 80)
        return cls(u.scheme, (u.host or "").lower(), port)


def _resolve(host: str) -> list[str]:
    try:
        found = [str(info[4][0]) for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(found))  # in order, each once


Address = ipaddress.IPv4Address | ipaddress.IPv6Address
#: IPv6 prefixes that carry an IPv4 address in their last 32 bits (NAT64, RFC 6052 and RFC 8215).
_NAT64 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"))


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _lookup(host: str, resolve: Resolver) -> list[tuple[str, Address]]:
    """What ``host`` (a name, not an IP literal) resolves to: each address as the resolver gave it (an IPv6
    scope kept, for connecting) and parsed (for judging); anything that is not an address is dropped."""
    out = []
    for addr in resolve(host):
        try:
            out.append((addr, ipaddress.ip_address(addr.split("%")[0])))
        except ValueError:
            continue
    return out


def _addresses(host: str, resolve: Resolver) -> list[Address]:
    """The addresses ``host`` stands for: itself if it is an IP literal, else what it resolves to ([] if nothing)."""
    h = host.strip("[]").lower()
    ip = _literal(h)
    if ip is not None:
        return [ip]
    return [a for _raw, a in _lookup(h, resolve)]


def _embedded(ip: Address) -> list[Address]:
    """``ip`` and any IPv4 address it carries (IPv4-mapped, 6to4, Teredo, NAT64), so none can smuggle one in."""
    out: list[Address] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            out.append(ip.ipv4_mapped)
        if ip.sixtofour is not None:
            out.append(ip.sixtofour)
        if ip.teredo is not None:
            out.append(ip.teredo[1])
        if any(ip in net for net in _NAT64):
            out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def _internal(ip: Address) -> bool:
    """Anything but a global unicast address: loopback, RFC 1918, carrier-grade NAT (100.64.0.0/10), link-local,
    unique-local (fc00::/7), documentation, benchmarking and reserved ranges, multicast, unspecified."""
    return any(not a.is_global or a.is_multicast for a in _embedded(ip))


def _link_local(ip: Address) -> bool:
    return any(a.is_link_local for a in _embedded(ip))


def _local_name(host: str) -> bool:
    return host == "localhost" or host.endswith(".localhost")


@dataclass
class URLPolicy:
    """Where a registry may send us: the checks applied to every redirect target and upload location, and the
    addresses connections may go to (:meth:`connect_addresses`: the ones a check saw, never a second lookup)."""

    registry: Origin
    insecure: bool
    resolve: Resolver = field(default=_resolve)
    _registry_internal: bool | None = None
    _registry_link_local: bool | None = None
    _pins: dict[str, list[str]] = field(default_factory=dict)
    _pins_lock: threading.Lock = field(default_factory=threading.Lock)

    def _pin(self, host: str, found: list[tuple[str, Address]]) -> None:
        with self._pins_lock:
            self._pins[host] = [raw for raw, _ip in found]

    def _pinned(self, host: str) -> list[tuple[str, Address]]:
        """A name's pinned addresses, looked up (and pinned) the first time: used for the registry's own name."""
        with self._pins_lock:
            pinned = self._pins.get(host)
        if pinned is not None:
            return [(raw, ipaddress.ip_address(raw.split("%")[0])) for raw in pinned]
        found = _lookup(host, self.resolve)
        if found:
            self._pin(host, found)
        return found

    def _classify_registry(self) -> None:
        if self._registry_internal is None:
            host = self.registry.host
            ip = _literal(host)
            addrs = [ip] if ip is not None else [a for _raw, a in self._pinned(host)]
            self._registry_internal = _local_name(host) or any(_internal(a) for a in addrs)
            self._registry_link_local = any(_link_local(a) for a in addrs)

    def connect_addresses(self, host: str) -> list[str]:
        """Where a connection to ``host`` may go: the IP itself for a literal, else the addresses the last check of
        that name found (the registry's name: its one lookup). [] when the name does not resolve."""
        if _literal(host) is not None:
            return [host.strip("[]")]
        return [raw for raw, _ip in self._pinned(host.lower())]

    def check(self, url: str) -> httpx.URL:
        """The parsed URL, or RegistryProtocolError saying why the registry may not send us there.

        Only the registry's own origin (scheme, host and port) is trusted as it is. Any other target is looked up
        first: a name that does not resolve is refused, and every address it resolves to must be allowed. A
        registry on a global address may not send us to any non-global one (loopback, RFC 1918, 100.64.0.0/10,
        unique-local...); a registry the user named on such an address (``127.0.0.1:5000``, a LAN host) may use
        its neighbours, but no registry may send us to a link-local address (cloud metadata) unless it is on one.
        """
        try:
            u = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as exc:
            raise RegistryProtocolError(f"registry {self.registry.host} sent an invalid URL: {url[:200]!r}") from exc
        if u.scheme not in ("http", "https") or not u.host:
            raise RegistryProtocolError(
                f"registry {self.registry.host} redirected to {u.scheme or 'a relative'} URL; only http(s) is allowed"
            )
        if u.scheme == "http" and not self.insecure:
            raise InsecureRegistry(
                f"registry {self.registry.host} redirected to plain HTTP ({u.host}); use --insecure only if you "
                "trust this registry"
            )
        target = Origin.of(u)
        if target == self.registry:
            return u
        self._classify_registry()
        ip = _literal(target.host)
        found: list[tuple[str, Address]] = []
        if ip is not None:
            addrs = [ip]
        elif target.host == self.registry.host:  # the registry's name on another port: judged by its one lookup
            addrs = [a for _raw, a in self._pinned(target.host)]
        else:  # looked up now; once allowed, connections to it go where this answer says, and nowhere else
            found = _lookup(target.host, self.resolve)
            addrs = [a for _raw, a in found]
        if any(_link_local(a) for a in addrs) and not self._registry_link_local:
            raise RegistryProtocolError(
                f"registry {self.registry.host} redirected to a link-local address ({target.host}); refused"
            )
        if (_local_name(target.host) or any(_internal(a) for a in addrs)) and not self._registry_internal:
            raise RegistryProtocolError(
                f"registry {self.registry.host} redirected to an internal address ({target.host}); refused"
            )
        if not addrs and not _local_name(target.host):
            raise RegistryProtocolError(
                f"registry {self.registry.host} redirected to {target.host}, a name that does not resolve; refused"
            )
        if found:
            self._pin(target.host, found)
        return u


class _PinnedBackend(httpcore.SyncBackend):
    """httpcore's socket backend, connecting to the addresses :class:`URLPolicy` judged instead of looking the name
    up again. httpcore then starts TLS with the URL's host as SNI and verifies the certificate for that name, and
    the request's ``Host`` is the name, so only the address is pinned."""

    def __init__(self, policy: URLPolicy) -> None:
        self.policy = policy

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        addresses = self.policy.connect_addresses(host)
        if not addresses:
            raise httpcore.ConnectError(f"{host} does not resolve")
        error: Exception | None = None
        for address in addresses:  # in the resolver's order, as socket.create_connection tries them
            try:
                return super().connect_tcp(
                    address, port, timeout=timeout, local_address=local_address, socket_options=socket_options
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        assert error is not None
        raise error


def pin_connections(client: httpx.Client, policy: URLPolicy, context: ssl.SSLContext, limits: httpx.Limits) -> None:
    """Make ``client``'s direct connections (those no proxy takes) go only to the addresses ``policy`` judged.

    httpx has no public hook for the connecting side of its transport, so the default transport's connection pool
    is replaced by an identical one whose network backend is :class:`_PinnedBackend`; proxied requests (httpx's
    environment proxy mounts) are left as they are: a proxy resolves names itself."""
    direct = getattr(client, "_transport", None)
    if not isinstance(getattr(direct, "_pool", None), httpcore.ConnectionPool):
        raise RuntimeError(
            f"httpx {httpx.__version__} has no connection pool where corral expects one; cannot pin registry "
            "connections to checked addresses (install an httpx version from pyproject.toml)"
        )
    direct._pool = httpcore.ConnectionPool(  # type: ignore[union-attr]
        ssl_context=context,
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=_PinnedBackend(policy),
    )


# -- challenges and tokens ---------------------------------------------------------------------------------------
def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``Bearer realm="…",service="…",scope="…"`` -> ("bearer", {realm, service, scope}).

    Values may be quoted (with backslash escapes) or bare tokens; unknown parameters are kept.
    """
    header = header.strip()
    scheme, _, rest = header.partition(" ")
    params: dict[str, str] = {}
    i, n = 0, len(rest)
    while i < n:
        while i < n and rest[i] in " ,":
            i += 1
        eq = rest.find("=", i)
        if eq < 0:
            break
        key = rest[i:eq].strip().lower()
        i = eq + 1
        if i < n and rest[i] == '"':
            i += 1
            value = []
            while i < n and rest[i] != '"':
                if rest[i] == "\\" and i + 1 < n:
                    i += 1
                value.append(rest[i])
                i += 1
            i += 1
            params[key] = "".join(value)
        else:
            end = rest.find(",", i)
            end = n if end < 0 else end
            params[key] = rest[i:end].strip()
            i = end
    return scheme.lower(), params


def read_capped(response: httpx.Response, cap: int, what: str, host: str) -> bytes:
    """The body of a streamed response, refusing more than ``cap`` bytes (decoded)."""
    declared = response.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > cap:
        raise RegistryProtocolError(f"registry {host} sent a {what} of {declared} bytes, more than the {cap} allowed")
    out = bytearray()
    for chunk in response.iter_bytes():
        out += chunk
        if len(out) > cap:
            raise RegistryProtocolError(f"registry {host} sent a {what} larger than the {cap} bytes allowed")
    return bytes(out)


def error_text(body: bytes) -> str:
    """The registry's error in a line: OCI ``{"errors":[{"code","message"}]}`` or the start of the body."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("errors"), list):
        parts = []
        for e in doc["errors"][:3]:
            if isinstance(e, dict):
                code, message = str(e.get("code", ""))[:100], str(e.get("message", ""))[:300]
                parts.append(f"{code}: {message}" if code and message else code or message)
        if parts:
            return "; ".join(parts)
    text = body.decode("utf-8", errors="replace").strip()
    return " ".join(text.split())[:300]


@dataclass
class Reply:
    status: int
    headers: httpx.Headers
    body: bytes
    url: httpx.URL


# -- the client --------------------------------------------------------------------------------------------------
class RegistryClient:
    """One repository (``name``'s host, namespace and model) on one registry, with its credentials.

    Thread-safe: pull's part downloads share it. ``retain``/``release`` count users (a shared download may
    outlive the pull that started it); the HTTP client closes when the last user releases it.
    """

    def __init__(
        self,
        name: ModelName,
        *,
        insecure: bool = False,
        auth_files: Iterable[Path] = (),
        push: bool = False,
        credentials: Credentials | None = None,
        resolve: Resolver | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if name.scheme == "http" and not insecure:
            raise InsecureRegistry("insecure protocol http")
        self.name = name
        self.insecure = insecure
        self.scheme = "http" if insecure or name.scheme == "http" else "https"
        self.base = f"{self.scheme}://{name.host}"
        self.origin = Origin.of(self.base)
        self.repository = name.repository()
        self.policy = URLPolicy(self.origin, insecure, resolve or _resolve)
        self.actions = "pull,push" if push else "pull"
        self.auth_files = list(auth_files)
        self._credentials: Credentials | None = credentials
        self._credentials_loaded = credentials is not None
        self.scopes: list[str] | None = None  # None: the repository's; [] for a login check (no scope)
        self._token: str | None = None
        self._basic = False
        self._auth_lock = threading.Lock()
        self._users = 1
        self._users_lock = threading.Lock()
        self.ssl = ssl_context()
        self.user_agent = user_agent()
        limits = httpx.Limits(max_connections=16, max_keepalive_connections=8)
        self.http = httpx.Client(
            verify=self.ssl,
            follow_redirects=False,
            timeout=httpx.Timeout(READ_TIMEOUT, connect=CONNECT_TIMEOUT),
            headers={"User-Agent": self.user_agent, "Accept-Encoding": "identity"},
            limits=limits,
            transport=transport,
        )
        if transport is None:  # a test's own transport makes no connections
            pin_connections(self.http, self.policy, self.ssl, limits)

    # -- lifetime ------------------------------------------------------------------------------------------------
    def retain(self) -> RegistryClient:
        with self._users_lock:
            self._users += 1
        return self

    def release(self) -> None:
        with self._users_lock:
            self._users -= 1
            last = self._users == 0
        if last:
            self.http.close()

    # -- URLs ----------------------------------------------------------------------------------------------------
    def url(self, path: str) -> str:
        return f"{self.base}/v2/{self.repository}/{path}"

    def blob_url(self, digest: Digest) -> str:
        return self.url(f"blobs/{digest}")

    def describe(self) -> str:
        return f"{self.name.host}/{self.repository}"

    # -- auth ----------------------------------------------------------------------------------------------------
    @property
    def credentials(self) -> Credentials | None:
        if not self._credentials_loaded:
            self._credentials = lookup(self.name.host, self.auth_files)
            self._credentials_loaded = True
        return self._credentials

    def auth_headers(self, url: str | httpx.URL) -> dict[str, str]:
        """``Authorization`` for ``url`` if (and only if) it is on the registry's own origin."""
        if Origin.of(url) != self.origin:
            return {}
        with self._auth_lock:
            if self._token:
                return {"Authorization": f"Bearer {self._token}"}
            if self._basic and self.credentials:
                return {"Authorization": self.credentials.basic()}
        return {}

    def answer_challenge(self, headers: Mapping[str, str], sent: Mapping[str, str]) -> None:
        """Handle a 401's ``WWW-Authenticate``: fetch a Bearer token or switch to Basic, or raise unauthorized.

        ``sent`` is what the failed request carried. A token that was sent may simply have expired, so a new one
        is fetched (callers answer one challenge per request: a second 401 means the registry refused us).
        """
        header = headers.get("www-authenticate", "")
        scheme, params = parse_challenge(header) if header else ("", {})
        with self._auth_lock:
            tried = sent.get("Authorization", "")
            if scheme == "bearer":
                if self._token and tried != f"Bearer {self._token}":
                    return  # another request fetched a fresh token meanwhile
                self._token = self._fetch_token(params)
            elif scheme == "basic":
                if self.credentials is None or tried.startswith("Basic "):
                    raise self.unauthorized()
                self._basic = True
            else:
                raise self.unauthorized(
                    f"registry {self.name.host} asked for an unsupported authentication scheme {scheme or '(none)'!r}"
                )

    def unauthorized(self, detail: str | None = None) -> RegistryUnauthorized:
        if detail:
            return RegistryUnauthorized(f"unauthorized: {detail}")
        if self.credentials is None:
            return RegistryUnauthorized(
                f"unauthorized: access denied to {self.describe()}; if it needs a login, run "
                f'"corral login {self.name.host}"'
            )
        return RegistryUnauthorized(
            f"unauthorized: access denied to {self.describe()} for user {self.credentials.username!r}"
        )

    def _fetch_token(self, params: dict[str, str]) -> str:
        realm = params.get("realm", "")
        try:
            realm_url = httpx.URL(realm)
        except (httpx.InvalidURL, ValueError):
            raise RegistryProtocolError(
                f"registry {self.name.host} sent an invalid token realm {realm[:200]!r}"
            ) from None
        if realm_url.scheme == "http" and not self.insecure and (realm_url.host or "").lower() == self.origin.host:
            raise InsecureRegistry(
                f"registry {self.name.host} has a plain-HTTP token realm; use --insecure only if "
                "you trust this registry"
            )
        if realm_url.scheme not in ("http", "https") or Origin.of(realm_url) != self.origin:
            # another port is another server (any local user may run one on 127.0.0.1), so the origin must match
            where = f"{realm_url.host}:{Origin.of(realm_url).port}" if realm_url.host else repr(realm[:100])
            raise RegistryProtocolError(
                f"registry {self.name.host} asked for a token from another host or port ({where}); refused: "
                f"credentials are only sent to the registry's own origin ({self.base})"
            )
        query: list[tuple[str, str]] = []
        if params.get("service"):
            query.append(("service", params["service"]))
        default = [f"repository:{self.repository}:{self.actions}"] if self.scopes is None else self.scopes
        scopes = params.get("scope", "").split() or default
        query += [("scope", s) for s in scopes]
        url = realm_url.copy_merge_params(tuple(query))
        headers = {"Accept": "application/json"}
        if self.credentials is not None:
            headers["Authorization"] = self.credentials.basic()
        try:
            with self.http.stream("GET", url, headers=headers) as r:
                body = read_capped(r, MAX_TOKEN_BYTES, "token response", self.name.host)
                status = r.status_code
        except httpx.HTTPError as exc:
            raise self._transport_error(exc) from exc
        if status in (401, 403):
            raise self.unauthorized()
        if status != 200:
            raise RegistryError(f"registry {self.name.host} token request failed: {status} {error_text(body)}")
        try:
            doc = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            doc = None
        token = (doc.get("token") or doc.get("access_token")) if isinstance(doc, dict) else None
        if (
            not isinstance(token, str)
            or not token
            or len(token) > MAX_TOKEN_CHARS
            or any(c < "!" or c > "~" for c in token)
        ):
            raise RegistryProtocolError(f"registry {self.name.host} sent a token response without a usable token")
        return token

    # -- requests ------------------------------------------------------------------------------------------------
    def _transport_error(self, exc: Exception) -> CorralError:
        text = str(exc)
        if self.scheme == "https" and "WRONG_VERSION_NUMBER" in text.upper().replace(" ", "_"):
            return InsecureRegistry(
                f"registry {self.name.host} does not speak HTTPS (it looks like a plain-HTTP registry); if you "
                'trust it, use --insecure (API: "insecure": true)'
            )
        if isinstance(exc, httpx.TimeoutException):
            return RegistryUnreachable(f"registry {self.name.host} did not answer in time")
        return RegistryUnreachable(f"cannot reach registry {self.name.host}: {text or type(exc).__name__}")

    def request(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str] | None = None,
        content: bytes | Callable[[], Any] | None = None,
        cap: int = MAX_ERROR_BYTES,
        what: str = "response",
        follow: bool = True,
    ) -> Reply:
        """One request with auth, hand-checked redirects (GET/HEAD) and a capped body.

        ``content`` may be a callable returning a fresh body (a retry after a 401 must resend it).
        """
        current = self.policy.check(url)
        answered = False
        for _hop in range(MAX_REDIRECTS + 1):
            sent = {**(headers or {}), **self.auth_headers(current)}
            body = content() if callable(content) else content
            try:
                with self.http.stream(method, current, headers=sent, content=body) as r:
                    if r.status_code == 401 and Origin.of(current) == self.origin and not answered:
                        r.close()
                        self.answer_challenge(r.headers, sent)
                        answered = True
                        continue
                    if follow and r.status_code in (301, 302, 303, 307, 308) and method in ("GET", "HEAD"):
                        location = r.headers.get("location")
                        if not location:
                            raise RegistryProtocolError(f"registry {self.name.host} sent a redirect without Location")
                        current = self.policy.check(str(current.join(location)))
                        continue
                    limit = cap if r.status_code < 400 else MAX_ERROR_BYTES
                    data = b"" if method == "HEAD" else read_capped(r, limit, what, self.name.host)
                    return Reply(r.status_code, r.headers, data, current)
            except httpx.HTTPError as exc:
                raise self._transport_error(exc) from exc
        raise RegistryProtocolError(f"registry {self.name.host} redirected more than {MAX_REDIRECTS} times")

    def fail(self, reply: Reply, doing: str) -> CorralError:
        """The error for an unexpected answer while ``doing`` something."""
        if reply.status == 401:
            return self.unauthorized()
        if reply.status == 403:
            return RegistryUnauthorized(f"denied: {doing} on {self.describe()}: {error_text(reply.body)}")
        if reply.status == 404:
            return RegistryNotFound(f"{doing}: file does not exist")
        detail = error_text(reply.body)
        return RegistryError(
            f"{doing}: registry {self.name.host} answered {reply.status}" + (f": {detail}" if detail else "")
        )

    # -- manifests -----------------------------------------------------------------------------------------------
    def get_manifest(self) -> bytes:
        """The manifest for the name's tag, byte for byte (checked against ``Docker-Content-Digest``)."""
        accept = f"{MANIFEST_MEDIA_TYPE}, {OCI_MANIFEST_MEDIA_TYPE}"
        reply = self.request(
            "GET",
            self.url(f"manifests/{self.name.tag}"),
            headers={"Accept": accept},
            cap=MAX_MANIFEST_BYTES,
            what="manifest",
        )
        if reply.status != 200:
            raise self.fail(reply, "pull model manifest")
        ctype = reply.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype in INDEX_MEDIA_TYPES:
            raise RegistryProtocolError(
                f"{self.name.short()} is an image index (several platforms), not a model manifest"
            )
        claimed = reply.headers.get("docker-content-digest", "")
        if claimed.startswith("sha256:") and claimed != str(Digest.of_bytes(reply.body)):
            raise RegistryProtocolError(
                f"registry {self.name.host} sent a manifest whose bytes do not match its Docker-Content-Digest"
            )
        return reply.body

    def put_manifest(self, raw: bytes, media_type: str) -> None:
        reply = self.request(
            "PUT",
            self.url(f"manifests/{self.name.tag}"),
            content=raw,
            headers={"Content-Type": media_type},
            follow=False,
        )
        if reply.status not in (200, 201, 202):
            raise self.fail(reply, "push manifest")

    # -- blobs (push side) ---------------------------------------------------------------------------------------
    def has_blob(self, digest: Digest) -> bool:
        reply = self.request("HEAD", self.blob_url(digest))
        if reply.status == 200:
            return True
        if reply.status == 404:
            return False
        raise self.fail(reply, f"check blob {digest.short}")

    def start_upload(self) -> httpx.URL:
        reply = self.request("POST", self.url("blobs/uploads/"), content=b"", follow=False)
        if reply.status not in (201, 202):
            raise self.fail(reply, "start blob upload")
        return self.upload_location(reply)

    def upload_location(self, reply: Reply) -> httpx.URL:
        location = reply.headers.get("docker-upload-location") or reply.headers.get("location")
        if not location:
            raise RegistryProtocolError(f"registry {self.name.host} gave no upload location")
        return self.policy.check(str(reply.url.join(location)))

    def upload_offset(self, location: httpx.URL) -> int:
        """How many bytes of an upload the registry holds (``GET`` on the upload URL, ``Range: 0-N``)."""
        reply = self.request("GET", str(location), follow=False)
        if reply.status not in (200, 204):
            raise self.fail(reply, "check upload")
        rng = reply.headers.get("range", "")
        if not rng:
            return 0
        try:
            return int(rng.split("-", 1)[1]) + 1
        except (IndexError, ValueError):
            raise RegistryProtocolError(
                f"registry {self.name.host} sent an invalid upload Range {rng[:50]!r}"
            ) from None


def verify_login(
    host: str, credentials: Credentials, *, insecure: bool = False, transport: httpx.BaseTransport | None = None
) -> None:
    """Check ``credentials`` against the registry at ``host`` (``GET /v2/`` through its auth challenge), as
    ``docker login`` does; raises :class:`RegistryUnauthorized` if the registry refuses them."""
    name = ModelName.parse(f"{host}/corral/login")
    client = RegistryClient(name, insecure=insecure, credentials=credentials, transport=transport)
    client.scopes = []
    try:
        reply = client.request("GET", f"{client.base}/v2/")
        if reply.status in (401, 403):
            raise client.unauthorized()
        if reply.status != 200:
            raise client.fail(reply, "log in")
    finally:
        client.release()


def backoff(attempt: int, base: float, cap: float = 30.0) -> float:
    """Seconds to wait before retry number ``attempt`` (1, 2, 4 … times ``base``, at most ``cap``)."""
    return float(min(cap, base * (2 ** max(0, attempt - 1))))
