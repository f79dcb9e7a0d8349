"""DaemonClient: the CLI's typed view of the daemon's Ollama-compatible HTTP API (httpx, JSON and NDJSON).

Every failure leaves this module as a :class:`CorralError`: ``{"error": msg}`` bodies by status (400
:class:`InvalidRequest`, 404 :class:`NotFound` / :class:`ModelNotFound`, else :class:`CorralError` constructed with
its ``status``), a refused connection as :class:`DaemonUnreachable`, other transport failures as
:class:`DaemonConnectionError`.
"""

from __future__ import annotations

import contextlib
import json
import platform
import re
import socket
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from cli import __version__
from cli.errors import DaemonConnectionError, DaemonUnreachable
from errors import CorralError, InvalidRequest, ModelNotFound, NotFound
from registry.digest import Digest

CHUNK = 1024 * 1024
_MODEL_NOT_FOUND = re.compile(r"model ['\"](.+)['\"] not found")


def _address(url: httpx.URL) -> str:
    host = url.host
    if ":" in host:
        host = f"[{host}]"
    port = url.port or (443 if url.scheme == "https" else 80)
    return f"{host}:{port}"


def error_for(status: int, message: str) -> CorralError:
    """The exception for an error reply, constructed with the reply's HTTP status as its ``.status``."""
    if status == 400:
        return InvalidRequest(message, status=status)
    if status == 404:
        m = _MODEL_NOT_FOUND.fullmatch(message)
        return ModelNotFound(m.group(1), message, status=status) if m else NotFound(message, status=status)
    return CorralError(message, status=status)


def _message(response: httpx.Response) -> str:
    """The ``error`` field of a JSON body, else the body text, else the status line."""
    text = response.text.strip()
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return str(body["error"])
    return text or f"{response.status_code} {response.reason_phrase}".strip()


class DaemonClient:
    """A synchronous client for one daemon. ``timeout`` bounds non-streaming calls (None: no limit)."""

    def __init__(
        self,
        base_url: str,
        timeout: float | None = 60.0,
        *,
        api_key: str | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        headers = {
            "User-Agent": f"corral/{__version__} ({platform.machine()} {platform.system().lower()}) "
            f"Python/{platform.python_version()}",
            "Accept": "application/json",
        }
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers, transport=transport)
        # streams get a connection of their own each (none kept alive), so Stream.abort knows its socket from the
        # moment it connects
        self._streams = httpx.Client(
            base_url=self.base_url,
            timeout=timeout,
            headers=headers,
            transport=transport,
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self.address = _address(self._http.base_url)

    def close(self) -> None:
        self._http.close()
        self._streams.close()

    def __enter__(self) -> DaemonClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -----------------------------------------------------------------------------------------
    @contextmanager
    def _translate(self) -> Iterator[None]:
        try:
            yield
        except httpx.ConnectError as exc:
            raise DaemonUnreachable(self.address) from exc
        except httpx.TimeoutException as exc:
            raise DaemonConnectionError(f"corral at {self.address} did not answer in time") from exc
        except httpx.TransportError as exc:
            raise DaemonConnectionError(f"lost the connection to corral at {self.address}: {exc}") from exc

    def request(self, method: str, path: str, *, json_body: Any = None, **kw: Any) -> httpx.Response:
        """One request; an error status raises (see the module docstring)."""
        with self._translate():
            response = self._http.request(method, path, json=json_body, **kw)
        if response.status_code >= 400:
            raise error_for(response.status_code, _message(response))
        return response

    def _json(self, method: str, path: str, json_body: Any = None) -> Any:
        response = self.request(method, path, json_body=json_body)
        try:
            return response.json()
        except ValueError as exc:
            raise DaemonConnectionError(f"corral sent an invalid reply to {method} {path}") from exc

    def stream(self, method: str, path: str, json: Any = None) -> Stream:
        """NDJSON objects from a streaming call; a line with ``error`` raises :class:`CorralError`. The
        :class:`Stream` can be aborted from another thread."""
        return Stream(self, method, path, json)

    # -- API -----------------------------------------------------------------------------------------------
    def heartbeat(self) -> None:
        """``HEAD /``: raises unless the daemon answers."""
        self.request("HEAD", "/")

    def version(self) -> str:
        """The daemon's corral version (``corral_version``; ``version`` is the Ollama API version it implements,
        and the only field an older corral sends)."""
        body = self._json("GET", "/api/version")
        return str(body.get("corral_version") or body.get("version", ""))

    def tags(self) -> list[dict[str, Any]]:
        models = self._json("GET", "/api/tags").get("models") or []
        return [m for m in models if isinstance(m, dict)]

    def show(self, model: str, verbose: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model}
        if verbose:
            body["verbose"] = True
        result = self._json("POST", "/api/show", body)
        return result if isinstance(result, dict) else {}

    def copy(self, src: str, dst: str) -> None:
        self.request("POST", "/api/copy", json_body={"source": src, "destination": dst})

    def delete(self, model: str) -> None:
        self.request("DELETE", "/api/delete", json_body={"model": model})

    def unload(self, model: str) -> None:
        """``POST /api/generate {model, keep_alive: 0}``: ask the daemon to unload ``model`` now."""
        self.request("POST", "/api/generate", json_body={"model": model, "keep_alive": 0, "stream": False})

    def blob_exists(self, digest: Digest | str) -> bool:
        d = digest if isinstance(digest, Digest) else Digest.parse(digest)
        try:
            self.request("HEAD", f"/api/blobs/{d}")
        except NotFound:
            return False
        return True

    def upload_blob(
        self, digest: Digest | str, path: Path, progress_callback: Callable[[int], None] | None = None
    ) -> None:
        """Stream ``path`` to ``POST /api/blobs/<digest>``; the daemon verifies the digest before keeping it."""
        d = digest if isinstance(digest, Digest) else Digest.parse(digest)
        size = path.stat().st_size

        def body() -> Iterator[bytes]:
            with path.open("rb") as f:
                while chunk := f.read(CHUNK):
                    yield chunk
                    if progress_callback is not None:
                        progress_callback(len(chunk))

        timeout = httpx.Timeout(self.timeout, read=None)
        self.request(
            "POST",
            f"/api/blobs/{d}",
            content=body(),
            timeout=timeout,
            headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
        )

    def create(self, payload: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """``POST /api/create`` (streaming): the progress objects, ending with ``{"status": "success"}``."""
        return self.stream("POST", "/api/create", {**payload, "stream": True})

    def pull(self, model: str, *, insecure: bool = False) -> Iterator[dict[str, Any]]:
        """``POST /api/pull`` (streaming): Ollama's pull progress objects, ending with ``success``."""
        return self.stream("POST", "/api/pull", {"model": model, "insecure": insecure, "stream": True})

    def push(self, model: str, *, insecure: bool = False) -> Iterator[dict[str, Any]]:
        """``POST /api/push`` (streaming): Ollama's push progress objects, ending with ``success``."""
        return self.stream("POST", "/api/push", {"model": model, "insecure": insecure, "stream": True})

    def prune(self, *, dry_run: bool = False) -> dict[str, Any]:
        """``POST /api/prune`` (corral's own): the files removed (or that would be) and the bytes freed."""
        result = self._json("POST", "/api/prune", {"dry_run": dry_run})
        return result if isinstance(result, dict) else {}


def _loads(line: str) -> Any:
    return json.loads(line)


class Stream:
    """One streaming call's NDJSON objects, read as they come (iterate it in one thread).

    :meth:`abort` may be called from any other thread, at any time (before the call connects, while it waits for
    the daemon, between lines): it shuts the call's connection down, so a read blocked in the other thread returns
    at once and the daemon sees the client leave (and stops generating). The connection is its own (never kept
    alive, never shared), so its socket is known from the moment it connects: httpx's ``trace`` extension hands it
    over (``connection.connect_tcp.complete``).
    """

    def __init__(self, client: DaemonClient, method: str, path: str, body: Any) -> None:
        self._client = client
        self._method, self._path, self._body = method, path, body
        self._socket: socket.socket | None = None
        self._aborted = False
        self._objects = self._read()

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self._objects)

    def close(self) -> None:
        """Stop reading (in the reading thread): closes the response and its connection."""
        self._objects.close()

    def abort(self) -> None:
        """End the call from any thread. Only plain assignments and a shutdown: safe from a signal handler, and
        a second interrupt in the middle of it leaves nothing half done."""
        self._aborted = True
        self._shutdown(self._socket)

    @staticmethod
    def _shutdown(sock: socket.socket | None) -> None:
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _trace(self, event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            self._socket = sock
            if self._aborted:  # aborted while connecting: the socket was not known then
                self._shutdown(sock)

    def _read(self) -> Generator[dict[str, Any], None, None]:
        client = self._client
        headers = {"Accept": "application/x-ndjson"}
        timeout = httpx.Timeout(client.timeout, read=None)
        extensions = {"trace": self._trace}
        if self._aborted:
            return
        with (
            client._translate(),
            client._streams.stream(
                self._method, self._path, json=self._body, headers=headers, timeout=timeout, extensions=extensions
            ) as response,
        ):
            if response.status_code >= 400:
                response.read()
                raise error_for(response.status_code, _message(response))
            for line in response.iter_lines():
                if not line.strip():
                    continue
                try:
                    obj = _loads(line)
                except ValueError as exc:
                    raise DaemonConnectionError(f"corral sent an invalid line: {line[:200]!r}") from exc
                if isinstance(obj, dict) and obj.get("error"):
                    raise CorralError(str(obj["error"]))
                if isinstance(obj, dict):
                    yield obj
