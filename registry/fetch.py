"""Ranged blob GETs: the data path of a pull.

Blob bytes go through the standard library's ``http.client``, reading straight into one reusable buffer per part
(``readinto``): on this project's 2-core machines that is about twice as fast per connection as httpx's chunked
iteration, which matters for the ≥0.9× curl target (see ``bench/pull.py``). Everything else (manifests, tokens,
uploads) goes through httpx in ``registry/remote.py``; both use the same TLS context, proxy variables, auth
rules and redirect policy:

* redirects are followed by hand and each target is checked by :class:`registry.remote.URLPolicy`, and the
  connection goes to the addresses that check judged (no second lookup a rebinding DNS server could answer);
* ``Authorization`` is sent only to the registry's own origin, so a CDN behind a redirect never sees it;
* a 401 from the registry is answered once (token or Basic), then the request is repeated.

Failures are sorted for the download loop: :class:`Transient` (retry with backoff), :class:`Stalled` (no bytes
for the read timeout: restart the part), :class:`RangeIgnored` (the server sent the whole blob for a range: the
download starts again from byte 0) and :class:`Rejected` (an error status from a redirect target, e.g. an expired
signed URL: start again from the registry). Anything else is a :class:`CorralError` and ends the download; an
answer that is not the bytes it claims to be (a ``Content-Range`` or ``Content-Length`` other than the range
asked, a 200 whose length is not the blob's, a chunked body shorter or longer than its range) is a
:class:`RegistryProtocolError`. A body cut off by the network is :class:`Transient`.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import http.client
import os
import re
import select
import socket
import ssl
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any, cast

import httpx

from errors import InsecureRegistry, RegistryNotFound, RegistryProtocolError, RegistryUnreachable
from registry.digest import Digest
from registry.remote import MAX_ERROR_BYTES, MAX_REDIRECTS, Origin, RegistryClient, URLPolicy, error_text

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class Transient(Exception):
    """A failure worth retrying after a pause: connection errors, 5xx, 429, short bodies."""


class Stalled(Exception):
    """No bytes arrived within the read timeout."""


class RangeIgnored(Exception):
    """The server answered a range request with the whole blob (200)."""


class Rejected(Exception):
    """A redirect target (not the registry) refused the request; the registry may hand out a fresh URL."""


class WriteFailed(Exception):
    """Writing received bytes into the file failed (the disk, not the network)."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


SPLICE = hasattr(os, "splice")  # Linux
F_SETPIPE_SZ = 1031
PIPE_SIZE = 1024 * 1024


class RangeReader:
    """An open ranged GET whose headers checked out; :meth:`transfer` moves its body into a file.

    On Linux, a plain-HTTP body moves with ``splice`` (socket -> pipe -> file, no copy through Python), which
    halves the CPU a local-registry pull needs; TLS and chunked bodies go through ``readinto`` and ``pwrite``.
    """

    def __init__(
        self,
        conn: http.client.HTTPConnection,
        response: http.client.HTTPResponse,
        length: int,
        url: httpx.URL,
        timeout: float,
    ) -> None:
        self.conn = conn
        self.response = response
        self.length = length
        self.remaining = length
        self.url = url
        self.timeout = timeout
        self.opened = time.monotonic()
        self.received = 0
        self.laggard = False  # aborted for being far slower than the other parts
        sock = conn.sock
        self._splice = (
            SPLICE
            and sock is not None
            and not isinstance(sock, ssl.SSLSocket)
            and not response.chunked
            and response.length == length
        )
        self._drained = False  # http.client's buffer is empty: the rest may come straight off the socket
        self._pipe: tuple[int, int] | None = None

    def transfer(self, fd: int, offset: int, view: memoryview) -> int:
        """Move up to ``len(view)`` bytes of the range into ``fd`` at ``offset``; returns how many.

        Raises :class:`Transient` if the body ends early, :class:`Stalled` if nothing arrives within the
        timeout (or the reader was dropped as a laggard), :class:`WriteFailed` if the file cannot be written.
        """
        if self.remaining <= 0:
            return 0
        if self._splice and self._drained:
            return self._splice_into(fd, offset, min(len(view), self.remaining))
        if self._splice:
            data = self._read(lambda: self.response.read1(min(self.remaining, max(len(view), 65536))))
            self._drained = True  # read1 with more than http.client buffers returns all it held
            n = len(data)
            _pwrite_all(fd, memoryview(data), offset)
        else:
            if len(view) > self.remaining:
                view = view[: self.remaining]
            n = self._read(lambda: self.response.readinto(view))
            _pwrite_all(fd, view[:n], offset)
        self._count(n)
        return n

    def _read(self, read: Any) -> Any:
        try:
            data = read()
        except TimeoutError as exc:
            raise Stalled(str(exc)) from exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if self.laggard:
                raise Stalled("far slower than the other parts") from exc
            raise Transient(f"connection lost: {exc or type(exc).__name__}") from exc
        if not data:
            self._ended()
        return data

    def _ended(self) -> None:
        if self.laggard:
            raise Stalled("far slower than the other parts")
        if self.response.chunked:
            # http.client raises IncompleteRead when a chunked body is cut off; an end here is the final chunk,
            # so the server itself says the body is over: it does not match the range it promised
            raise RegistryProtocolError(
                f"{self.url.host} ended its answer {self.remaining} bytes early: the body "
                f"is shorter than the {self.length} bytes its headers promised"
            )
        raise Transient(f"the body ended {self.remaining} bytes early")

    def finish(self) -> None:
        """After the last byte of the range: a body without a Content-Length must end there.

        A body with a Content-Length was checked against the range before it was read (and http.client reads no
        further); a chunked one could carry more, which means the server and we disagree about the bytes.
        """
        if self.remaining or self.response.length is not None:
            return
        try:
            extra = self.response.read(1)
        except (OSError, http.client.HTTPException, ValueError):
            return  # the range is complete; whatever follows, the connection is closed
        if extra:
            raise RegistryProtocolError(
                f"{self.url.host} sent a body longer than the {self.length} bytes its headers promised"
            )

    def _count(self, n: int) -> None:
        self.remaining -= n
        self.received += n

    def _splice_into(self, fd: int, offset: int, want: int) -> int:
        if self._pipe is None:
            self._pipe = os.pipe()
            with contextlib.suppress(OSError):
                fcntl.fcntl(self._pipe[1], F_SETPIPE_SZ, PIPE_SIZE)
        read_end, write_end = self._pipe
        sock = self.conn.sock
        if sock is None:
            self._ended()
        source = sock.fileno()
        while True:
            try:
                n = os.splice(source, write_end, want)
                break
            except BlockingIOError:  # the socket is non-blocking (it has a timeout): wait for bytes
                poller = select.poll()
                poller.register(source, select.POLLIN)
                if not poller.poll(self.timeout * 1000):
                    raise Stalled(f"no bytes for {self.timeout:.0f} s") from None
            except OSError as exc:
                if self.laggard:
                    raise Stalled("far slower than the other parts") from exc
                raise Transient(f"connection lost: {exc.strerror or exc}") from exc
        if n == 0:
            self._ended()
        moved = 0
        while moved < n:
            try:
                moved += os.splice(read_end, fd, n - moved, offset_dst=offset + moved)
            except OSError as exc:
                raise WriteFailed(exc) from exc
        self._count(n)
        return n

    def rate(self, now: float) -> float:
        """Bytes per second since the response began."""
        return self.received / max(now - self.opened, 1e-3)

    def drop_as_laggard(self) -> None:
        """From another thread: end this response so that its part starts again on a fresh connection."""
        self.laggard = True
        self.abort()

    def abort(self) -> None:
        """From another thread: make a blocked read return now."""
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.response.close()
        with contextlib.suppress(Exception):
            self.conn.close()
        if self._pipe is not None:
            for end in self._pipe:
                with contextlib.suppress(OSError):
                    os.close(end)
            self._pipe = None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        try:
            n = os.pwrite(fd, data, offset)
        except OSError as exc:
            raise WriteFailed(exc) from exc
        data, offset = data[n:], offset + n


def _proxy_for(url: httpx.URL) -> httpx.URL | None:
    """The proxy the environment (``HTTPS_PROXY``, ``HTTP_PROXY``, ``NO_PROXY``) names for ``url``."""
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(url.scheme)
    if not proxy:
        return None
    netloc = url.host if url.port is None else f"{url.host}:{url.port}"
    bypass = getattr(urllib.request, "proxy_bypass_environment")  # noqa: B009 - in the stdlib, not in its stubs
    if bypass(netloc, proxies):
        return None
    return httpx.URL(proxy if "://" in proxy else f"http://{proxy}")


def _proxy_auth(proxy: httpx.URL) -> dict[str, str]:
    if not proxy.username:
        return {}
    raw = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}".encode()
    return {"Proxy-Authorization": "Basic " + base64.b64encode(raw).decode()}


def _pinned_connect(policy: URLPolicy, host: str) -> Any:
    """``socket.create_connection`` for ``host``, to the addresses ``policy`` judged (never a second lookup)."""

    def create_connection(
        address: tuple[str, int], timeout: float | None = None, source_address: Any = None
    ) -> socket.socket:
        addresses = policy.connect_addresses(host)
        if not addresses:
            raise OSError(f"{host} does not resolve")
        error: OSError | None = None
        for ip in addresses:  # in the resolver's order, as socket.create_connection tries them
            try:
                return socket.create_connection((ip, address[1]), timeout, source_address)
            except OSError as exc:
                error = exc
        assert error is not None
        raise error

    return create_connection


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to the addresses the URL policy judged for its host; ``Host`` is still the name."""

    def __init__(self, host: str, port: int, *, policy: URLPolicy, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._create_connection = _pinned_connect(policy, host)


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """The same over TLS: the socket goes to a checked address, SNI and the certificate check use the name."""

    def __init__(self, host: str, port: int, *, policy: URLPolicy, timeout: float, context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._create_connection = _pinned_connect(policy, host)


def connect(
    url: httpx.URL, timeout: float, context: ssl.SSLContext, policy: URLPolicy
) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    """A connection for ``url`` (through a proxy if the environment names one), the request target, and extra
    headers for the proxy. A direct connection goes to the addresses ``policy`` checked for the URL's host (DNS
    rebinding cannot move it); through a proxy, the proxy resolves the name."""
    port = url.port or (443 if url.scheme == "https" else 80)
    target = url.raw_path.decode("ascii")
    proxy = _proxy_for(url)
    if proxy is None:
        if url.scheme == "https":
            return _PinnedHTTPSConnection(url.host, port, policy=policy, timeout=timeout, context=context), target, {}
        return _PinnedHTTPConnection(url.host, port, policy=policy, timeout=timeout), target, {}
    proxy_port = proxy.port or (443 if proxy.scheme == "https" else 80)
    conn: http.client.HTTPConnection
    if url.scheme == "https":
        conn = http.client.HTTPSConnection(proxy.host, proxy_port, timeout=timeout, context=context)
        conn.set_tunnel(url.host, port, headers=_proxy_auth(proxy))
        return conn, target, {}
    conn = http.client.HTTPConnection(proxy.host, proxy_port, timeout=timeout)
    return conn, str(url), _proxy_auth(proxy)


def _tls_error(client: RegistryClient, url: httpx.URL, exc: ssl.SSLError) -> Exception:
    if "WRONG_VERSION_NUMBER" in str(exc).upper():
        return InsecureRegistry(
            f"{url.host} does not speak HTTPS (it looks like a plain-HTTP server); if you trust this registry, "
            'use --insecure (API: "insecure": true)'
        )
    return RegistryUnreachable(f"TLS failed with {url.host}: {exc}")


def _error_body(response: http.client.HTTPResponse) -> str:
    try:
        return error_text(response.read(MAX_ERROR_BYTES))
    except (OSError, http.client.HTTPException):
        return ""


def open_range(
    client: RegistryClient, url: str | httpx.URL, digest: Digest, start: int, end: int, total: int, *, timeout: float
) -> RangeReader:
    """``GET url`` for bytes ``start..end`` (inclusive) of a blob of ``total`` bytes, following redirects."""
    current = client.policy.check(str(url))
    answered = False
    for _hop in range(MAX_REDIRECTS + 1):
        conn, target, extra = connect(current, timeout, client.ssl, client.policy)
        headers = {
            "User-Agent": client.user_agent,
            "Accept-Encoding": "identity",
            "Range": f"bytes={start}-{end}",
            **extra,
            **client.auth_headers(current),
        }
        try:
            conn.request("GET", target, headers=headers)
            response = conn.getresponse()
        except TimeoutError as exc:
            conn.close()
            raise Stalled(f"{current.host} did not answer in {timeout:.0f} s") from exc
        except ssl.SSLError as exc:
            conn.close()
            raise _tls_error(client, current, exc) from exc
        except (OSError, http.client.HTTPException) as exc:
            conn.close()
            raise Transient(f"cannot reach {current.host}: {exc or type(exc).__name__}") from exc
        status = response.status
        on_registry = Origin.of(current) == client.origin
        if status == 401 and on_registry and not answered:
            response.read(MAX_ERROR_BYTES)
            conn.close()
            client.answer_challenge(cast(Mapping[str, str], response.headers), headers)
            answered = True
            continue
        if status in (301, 302, 303, 307, 308):
            location = response.headers.get("location")
            conn.close()
            if not location:
                raise RegistryProtocolError(f"{current.host} sent a redirect without Location")
            current = client.policy.check(str(current.join(location)))
            continue
        if status == 206:
            try:
                _check_content_range(response, current, start, end, total)
            except RegistryProtocolError:
                conn.close()
                raise
            return RangeReader(conn, response, end - start + 1, current, timeout)
        if status == 200:
            # the whole blob, whatever range was asked; a Content-Length must then be the blob's size
            length = response.headers.get("content-length")
            if length is not None and length.strip() != str(total):
                conn.close()
                raise RegistryProtocolError(
                    f"{current.host} answered bytes {start}-{end} of blob {digest.short} with a 200 and "
                    f"Content-Length {length[:30]!r} for a {total}-byte blob"
                )
            if start == 0 and end == total - 1:
                return RangeReader(conn, response, total, current, timeout)
            conn.close()
            raise RangeIgnored(f"{current.host} ignored the Range header")
        detail = _error_body(response)
        conn.close()
        what = f"{current.host} answered {status} for blob {digest.short}" + (f": {detail}" if detail else "")
        if status in (408, 425, 429) or status >= 500:
            raise Transient(what)
        if not on_registry:
            raise Rejected(what)
        if status == 401:
            raise client.unauthorized()
        if status == 404:
            raise RegistryNotFound(f"registry {client.name.host} has no blob {digest} (the manifest names it)")
        raise RegistryProtocolError(what)
    raise RegistryProtocolError(f"{client.name.host} redirected more than {MAX_REDIRECTS} times")


def _check_content_range(response: http.client.HTTPResponse, url: httpx.URL, start: int, end: int, total: int) -> None:
    header = response.headers.get("content-range", "")
    m = _CONTENT_RANGE.fullmatch(header.strip())
    ok = m is not None and int(m.group(1)) == start and int(m.group(2)) == end and m.group(3) in ("*", str(total))
    length = response.headers.get("content-length")
    if ok and length is not None:
        ok = length.strip() == str(end - start + 1)
    if not ok:
        raise RegistryProtocolError(
            f"{url.host} answered bytes {start}-{end} of a {total}-byte blob with "
            f"Content-Range {header[:80]!r} and Content-Length {length!r}"
        )
