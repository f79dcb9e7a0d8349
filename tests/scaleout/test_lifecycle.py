"""A replica's life behind a balancer (issue 30), on one real daemon: readiness (``/health/ready``) while preloads are
missing, pulled and loaded, the replica's name (``CORRAL_INSTANCE``) in answers, ``/api/info``, ``/metrics`` and
log lines, and SIGTERM's drain: readiness 503 at once, new requests served during the grace and refused with 503 +
Retry-After after it, requests in flight (a stream, a request whose body is still coming) finished, exit 0."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.daemon.test_ollama_details import create
from tests.models import write_tiny_gguf
from tests.registry_pull.conftest import DOCKER_REGISTRY, start_registry, stop_registry
from tests.registry_pull.test_real_registry import put_model
from tests.scaleout.cluster import wait_for


def test_readiness_instance_metrics_and_logs(tmp_path: Path) -> None:
    d = start_daemon(
        tmp_path / "models", tmp_path / "d.log", {"CORRAL_INSTANCE": "replica-7", "CORRAL_API_KEY": "sekrit"}
    )
    try:
        r = httpx.get(d.url + "/health/ready")  # open without the key, as /health
        assert r.status_code == 200, r.text
        assert r.json() == {"instance": "replica-7", "status": "ready"}
        assert r.headers["x-corral-instance"] == "replica-7"
        refused = httpx.get(d.url + "/api/info")
        assert refused.status_code == 401 and refused.headers["x-corral-instance"] == "replica-7"
        key = {"Authorization": "Bearer sekrit"}
        assert httpx.get(d.url + "/api/info", headers=key).json()["instance"] == "replica-7"
        metrics = httpx.get(d.url + "/metrics", headers=key).text
        assert 'corral_info{corral_instance="replica-7",version="' in metrics
        shown = d.cli("info")
        assert shown.returncode == 0 and shown.stdout.splitlines()[0].split() == ["Instance", "replica-7"], shown
    finally:
        stop_daemon(d)
    lines = d.log.read_text().splitlines()
    assert lines and all(" instance=replica-7 " in ln for ln in lines if ln.startswith("time="))


def test_bad_instance_name_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="CORRAL_INSTANCE"):
        start_daemon(tmp_path / "models", tmp_path / "d.log", {"CORRAL_INSTANCE": "two words"})


def test_missing_preload_without_pull_is_not_ready(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "d.log", {"CORRAL_PRELOAD": "absent"})
    try:
        r: httpx.Response | None = None

        def failed() -> bool:
            nonlocal r
            r = httpx.get(d.url + "/health/ready")
            return r.json()["status"] != "preloading"

        wait_for("the preload to fail", failed, timeout=30)
        assert r is not None and r.status_code == 503 and r.headers["retry-after"] == "1"
        body = r.json()
        assert body["status"] == "preload failed"
        assert body["preload"]["absent"]["state"] == "failed"
        assert "CORRAL_PRELOAD_PULL" in body["reason"]
        assert httpx.get(d.url + "/health").status_code == 200  # alive all the same
    finally:
        stop_daemon(d)


def test_preload_pull_waits_for_the_registry_then_loads(tmp_path: Path) -> None:
    """One model is not in the registry when the replica starts (a compose file starts both at once): readiness says
    so and its pull is tried again until the model is there, then it is loaded and the replica is ready; meanwhile
    the other preload, which the registry has, is pulled and loaded (a failing pull holds up no other)."""
    if not Path(DOCKER_REGISTRY).is_file():
        pytest.skip("docker-registry is not installed (apt-get install docker-registry)")
    registry = start_registry(tmp_path / "registry")
    late = f"http://{registry.host}/test/tiny:v1"
    there = f"http://{registry.host}/test/tiny:v0"
    put_model(registry.url, "test/tiny", "v0", write_tiny_gguf(tmp_path / "v0.gguf", seed=1).read_bytes())
    d: Daemon | None = None
    try:
        env = {"CORRAL_PRELOAD": f"{late},{there}", "CORRAL_PRELOAD_PULL": "true"}
        d = start_daemon(tmp_path / "models", tmp_path / "d.log", env)
        url = d.url

        def state() -> dict[str, Any]:
            r = httpx.get(url + "/health/ready")
            body: dict[str, Any] = r.json()
            assert (r.status_code == 200) == (body["status"] == "ready")
            return body

        wait_for("a failed pull", lambda: "pull failed" in state()["preload"][late].get("error", ""), timeout=30)
        wait_for("the other preload", lambda: state()["preload"][there] == {"state": "ready"}, timeout=60)
        body = state()
        assert body["status"] == "preloading" and body["preload"][late]["state"] == "pulling"
        assert late in body["reason"]
        put_model(registry.url, "test/tiny", "v1", write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes())
        wait_for("the replica to be ready", lambda: state()["status"] == "ready", timeout=60, every=0.25)
        assert state()["preload"] == {late: {"state": "ready"}, there: {"state": "ready"}}
        ps = httpx.get(url + "/api/ps").json()["models"]
        assert sorted(m["name"] for m in ps) == [f"{registry.host}/test/tiny:v0", f"{registry.host}/test/tiny:v1"]
        log = d.log.read_text()
        assert f"CORRAL_PRELOAD: cannot pull model={late}" in log and "trying again" in log
        assert f"CORRAL_PRELOAD: pulled model={late}" in log
    finally:
        if d is not None:
            stop_daemon(d)
        stop_registry(registry)


# -- SIGTERM ---------------------------------------------------------------------------------------------------------
@pytest.fixture
def drainable(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path / "models", tmp_path / "d.log", {"CORRAL_DRAIN_TIMEOUT": "120s"})
    try:
        with d.client() as h:
            gguf = write_tiny_gguf(tmp_path / "endless.gguf", never_ends=True, context_length=4096)
            # one thread: llama.cpp's spinning threads slow down many times over on a machine busier than its cores
            assert create(h, "endless", gguf, parameters={"num_thread": 1}).status_code == 200
            warm = h.post("/api/generate", json=generate_body(2, stream=False), timeout=120)
            assert warm.status_code == 200, warm.text
        yield d
    finally:
        stop_daemon(d)


def generate_body(n: int, *, stream: bool) -> dict[str, Any]:
    return {"model": "endless", "prompt": "go", "stream": stream, "options": {"num_predict": n, "num_ctx": 4096}}


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones_after_the_grace(drainable: Daemon) -> None:
    d = drainable
    url = d.url
    assert httpx.get(url + "/health/ready").status_code == 200  # a balancer watches: the drain will have a grace

    # in flight at SIGTERM: a stream that has begun, and a request whose body is still coming
    stream_lines: list[dict[str, Any]] = []
    started = threading.Event()

    stream_error: list[BaseException] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", url + "/api/generate", json=generate_body(1500, stream=True), timeout=120) as r:
                assert r.status_code == 200
                pending = b""
                for chunk in r.iter_bytes():  # split on newlines only (iter_lines splits on U+2028 too)
                    *lines, pending = (pending + chunk).split(b"\n")
                    stream_lines.extend(json.loads(line) for line in lines if line.strip())
                    if stream_lines:
                        started.set()
        except BaseException as exc:  # noqa: BLE001 - said by the assertion below
            stream_error.append(exc)
            started.set()

    rest = threading.Event()
    slow_answer: list[httpx.Response] = []
    body = json.dumps(generate_body(3, stream=False)).encode()

    def slow_body() -> Iterator[bytes]:
        yield body[:10]
        rest.wait(60)
        yield body[10:]

    def slow() -> None:
        headers = {"content-length": str(len(body)), "content-type": "application/json"}
        slow_answer.append(httpx.post(url + "/api/generate", content=slow_body(), headers=headers, timeout=120))

    threads = [threading.Thread(target=stream), threading.Thread(target=slow)]
    for t in threads:
        t.start()
    assert started.wait(60)
    time.sleep(0.5)  # the slow request's head has reached the app
    d.proc.send_signal(signal.SIGTERM)

    wait_for("readiness to say draining", lambda: httpx.get(url + "/health/ready").status_code == 503, timeout=10)
    probe = httpx.get(url + "/health/ready")  # the balancer's second failed check
    assert probe.json()["status"] == "draining" and probe.headers["retry-after"] == "1"
    assert httpx.get(url + "/health").status_code == 200  # still alive

    def refused() -> bool:
        r = httpx.post(url + "/api/generate", json=generate_body(1, stream=False), timeout=60)
        assert r.status_code in (200, 503), r.text  # 200: still in the grace
        return r.status_code == 503

    wait_for("new requests to be refused", refused, timeout=10)
    r = httpx.post(url + "/api/generate", json=generate_body(1, stream=False), timeout=60)
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.headers["connection"] == "close"
    assert "shutting down" in r.json()["error"]
    r = httpx.post(url + "/v1/chat/completions", json={"model": "endless", "messages": []}, timeout=60)
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]  # the OpenAI shape
    assert d.proc.poll() is None  # two requests are still in flight

    rest.set()
    for t in threads:
        t.join(120)
    assert slow_answer[0].status_code == 200 and slow_answer[0].json()["done"] is True
    assert not stream_error, f"{stream_error} after {len(stream_lines)} lines; the log:\n{d.log.read_text()[-3000:]}"
    assert stream_lines[-1]["done"] is True and stream_lines[-1]["eval_count"] == 1500
    assert d.proc.wait(60) == 0
    log = d.log.read_text()
    assert "SIGTERM: draining instance=" in log and " in_flight=2 " in log  # both were in flight
    assert "drained: no request in flight" in log


def test_sigterm_with_nothing_to_wait_for_stops_at_once_and_the_drain_is_bounded(
    drainable: Daemon, tmp_path: Path
) -> None:
    d = drainable
    began = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)  # no balancer has probed it, nothing in flight: no grace
    assert d.proc.wait(30) == 0
    assert time.monotonic() - began < 10

    # a request that never ends (its body stalls) holds the drain for CORRAL_DRAIN_TIMEOUT, no longer
    again = start_daemon(d.models, tmp_path / "again.log", {"CORRAL_DRAIN_TIMEOUT": "2s"})
    try:
        sock_body = json.dumps(generate_body(1, stream=False)).encode()
        release = threading.Event()

        def stalled() -> Iterator[bytes]:
            yield sock_body[:5]
            release.wait(60)
            yield sock_body[5:]

        outcome: list[Any] = []

        def send() -> None:
            headers = {"content-length": str(len(sock_body))}
            try:
                outcome.append(httpx.post(again.url + "/api/generate", content=stalled(), headers=headers, timeout=60))
            except httpx.HTTPError as exc:
                outcome.append(exc)

        t = threading.Thread(target=send)
        t.start()
        time.sleep(0.5)
        began = time.monotonic()
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(30) == 0
        assert time.monotonic() - began < 15  # 2 s of drain and uvicorn's short grace, with room for a busy machine
        release.set()
        t.join(60)
        assert "drain timeout (CORRAL_DRAIN_TIMEOUT=2s) reached with 1 requests in flight" in again.log.read_text()
    finally:
        if again.proc.poll() is None:
            again.proc.kill()
            again.proc.wait(5)
        stop_daemon(again)


def test_drain_timeout_zero_keeps_the_old_sigterm(tmp_path: Path) -> None:
    d = start_daemon(tmp_path / "models", tmp_path / "d.log", {"CORRAL_DRAIN_TIMEOUT": "0"})
    try:
        assert httpx.get(d.url + "/health/ready").status_code == 200
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0
        assert "SIGTERM: draining" not in d.log.read_text()
    finally:
        stop_daemon(d)
