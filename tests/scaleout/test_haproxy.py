"""Three corral replicas behind Debian's HAProxy, with the models in Debian's docker-registry (issue 30).

Every replica pulls its model from the registry at start (CORRAL_PRELOAD + CORRAL_PRELOAD_PULL); 200 chat requests
in 20 conversations through the balancer land, turn after turn, on one replica each (X-Corral-Session, consistent
hashing), which reports the earlier turns' prompt as cached; a replica killed with SIGKILL in the middle of a load
costs no request (HAProxy retries on another replica) and is taken back by the health check when it returns; a
rolling SIGTERM restart of all three under load fails no request (readiness goes 503, requests in flight finish).
The reference configuration is what the generator writes, and HAProxy accepts it."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.models import write_tiny_gguf
from tests.registry_pull.conftest import DOCKER_REGISTRY, RealRegistry, start_registry, stop_registry
from tests.registry_pull.test_real_registry import MODEL_TYPE, put_blob
from tests.scaleout.cluster import (
    HAPROXY,
    TERSE_TEMPLATE,
    Balancer,
    Replica,
    haproxy_cfg,
    need_haproxy,
    start_balancer,
    stop_all,
    wait_for,
)

NAMES = ("r1", "r2", "r3")
pytestmark = pytest.mark.slow  # about a minute: seven daemon starts, 300 requests


@dataclass
class Cluster:
    registry: RealRegistry
    model: str  # the name requests use
    replicas: dict[str, Replica]
    balancer: Balancer

    def ready_everywhere(self) -> None:
        for r in self.replicas.values():
            wait_for(f"{r.name} to be ready", r.ready, timeout=90, every=0.2)
            self.balancer.wait_state(r.name, "UP")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    need_haproxy()
    if not Path(DOCKER_REGISTRY).is_file():
        pytest.skip("docker-registry is not installed (apt-get install docker-registry)")
    tmp = tmp_path_factory.mktemp("scaleout")
    registry = start_registry(tmp / "registry")
    replicas: dict[str, Replica] = {}
    balancer: Balancer | None = None
    try:
        gguf = write_tiny_gguf(tmp / "tiny.gguf", chat_template=TERSE_TEMPLATE, context_length=2048)
        push_tiny(registry.url, gguf)
        env = {
            "CORRAL_PRELOAD": f"http://{registry.host}/test/tiny:v1",
            "CORRAL_PRELOAD_PULL": "1",
            "CORRAL_KEEP_ALIVE": "-1",
            "CORRAL_DRAIN_TIMEOUT": "30s",
            "CORRAL_NUM_PARALLEL": "8",  # a slot for each of the ~7 conversations a replica gets: their KV stays
        }
        for name in NAMES:
            replicas[name] = Replica(name, free_port(), tmp / f"models-{name}", tmp / f"{name}.log", env)
            replicas[name].start(wait=False)
        for r in replicas.values():
            r.wait_up()
        balancer = start_balancer(tmp, list(replicas.values()), check_inter="500ms")
        c = Cluster(registry, f"{registry.host}/test/tiny:v1", replicas, balancer)
        c.ready_everywhere()
        yield c
    finally:
        stop_all(list(replicas.values()))  # while HAProxy still checks them: their drains' grace ends sooner
        if balancer is not None:
            balancer.stop()
        stop_registry(registry)


def push_tiny(registry_url: str, gguf: Path) -> None:
    """The model as ``corral push`` would send it: its GGUF and a parameters layer. ``num_thread 1``: three
    replicas share this machine's two cores, and llama.cpp's threads, which spin while they wait for each other,
    slow each other down many times over when there are more of them than cores."""
    config = b'{"model_format":"gguf","model_family":"llama"}'
    params = json.dumps({"num_thread": 1}).encode()
    layers = [(MODEL_TYPE, gguf.read_bytes()), ("application/vnd.ollama.image.params", params)]
    doc = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {
            "mediaType": "application/vnd.docker.container.image.v1+json",
            "digest": put_blob(registry_url, "test/tiny", config),
            "size": len(config),
        },
        "layers": [
            {"mediaType": kind, "digest": put_blob(registry_url, "test/tiny", data), "size": len(data)}
            for kind, data in layers
        ],
    }
    r = httpx.put(
        f"{registry_url}/v2/test/tiny/manifests/v1",
        content=json.dumps(doc).encode(),
        headers={"Content-Type": "application/vnd.docker.distribution.manifest.v2+json"},
    )
    assert r.status_code == 201, r.text


# -- a client ----------------------------------------------------------------------------------------------------
@dataclass
class Turn:
    instance: str
    cached: int
    status: int


class Conversation:
    def __init__(self, url: str, model: str, session: str | None) -> None:
        self.url = url
        self.model = model
        self.session = session
        self.messages: list[dict[str, str]] = []

    def turn(self, client: httpx.Client, text: str, *, stream: bool = False) -> Turn:
        self.messages.append({"role": "user", "content": text})
        headers = {"X-Corral-Session": self.session} if self.session else {}
        if stream:
            return self._stream(client, headers)
        body = {"model": self.model, "messages": self.messages, "max_tokens": 3, "temperature": 0}
        r = client.post(self.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        if r.status_code != 200:
            return Turn(r.headers.get("x-corral-instance", ""), 0, r.status_code)
        answer = r.json()
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        cached = answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        return Turn(r.headers["x-corral-instance"], cached, 200)

    def _stream(self, client: httpx.Client, headers: dict[str, str]) -> Turn:
        body = {"model": self.model, "messages": self.messages, "stream": True, "options": {"num_predict": 16}}
        with client.stream("POST", self.url + "/api/chat", json=body, headers=headers, timeout=120) as r:
            if r.status_code != 200:
                r.read()
                return Turn(r.headers.get("x-corral-instance", ""), 0, r.status_code)
            data = b"".join(r.iter_bytes())
        lines = [json.loads(line) for line in data.split(b"\n") if line.strip()]
        if not lines or not lines[-1].get("done"):
            return Turn(r.headers["x-corral-instance"], 0, 599)  # cut short: a failure
        text = "".join(line.get("message", {}).get("content", "") for line in lines)
        self.messages.append({"role": "assistant", "content": text})
        return Turn(r.headers["x-corral-instance"], 0, 200)


def where(c: Cluster, sessions: list[str]) -> dict[str, str]:
    """The replica each session is sent to now (one request each)."""
    with httpx.Client() as client:
        return {s: Conversation(c.balancer.url, c.model, s).turn(client, "where am I").instance for s in sessions}


# -- the tests ---------------------------------------------------------------------------------------------------
def test_reference_config_is_the_generators_and_haproxy_accepts_it(tmp_path: Path) -> None:
    need_haproxy()
    cfg = haproxy_cfg()
    reference = Path(cfg.REFERENCE)
    assert reference.read_text() == cfg.reference(), "run: python3 packaging/haproxy/haproxy_cfg.py --reference"
    assert "balance hash var(txn.session)" in reference.read_text()
    check = subprocess.run([HAPROXY, "-c", "-f", str(reference)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr  # the compose names do not resolve here: a warning
    with pytest.raises(ValueError, match="host:port"):
        cfg.render([("a", "nowhere")])


def test_every_replica_pulls_and_conversations_stick_to_their_replica(cluster: Cluster) -> None:
    for r in cluster.replicas.values():
        tags = httpx.get(r.url + "/api/tags").json()["models"]
        assert [m["name"] for m in tags] == [cluster.model]
        assert f"CORRAL_PRELOAD: pulled model=http://{cluster.registry.host}/test/tiny:v1" in r.text()

    conversations = [Conversation(cluster.balancer.url, cluster.model, f"conversation-{i}") for i in range(20)]

    def talk(conv: Conversation) -> list[Turn]:
        # each conversation its own words, as users' are: twenty copies of one conversation would share every
        # prefix, and a copy may rightly take another's slot (its cache is as good), leaving that one to start over
        with httpx.Client() as client:
            return [conv.turn(client, f"{conv.session} says {n}") for n in range(10)]

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(talk, conversations))
    assert sum(len(turns) for turns in results) == 200
    assert all(t.status == 200 for turns in results for t in turns)
    placement = {}
    events = [ln for ln in cluster.balancer.log.read_text().splitlines() if " is DOWN" in ln or " is UP" in ln]
    for conv, turns in zip(conversations, results, strict=True):
        instances = {t.instance for t in turns}
        assert len(instances) == 1, f"{conv.session} moved: {[t.instance for t in turns]}; HAProxy saw: {events}"
        placement[conv.session] = instances.pop()
        uncached = [n for n, t in enumerate(turns[1:], 1) if t.cached <= 0]
        assert not uncached, f"{conv.session}: turns {uncached} reused no cached prompt tokens: {turns}"
    spread = Counter(placement.values())
    assert len(spread) == 3, spread  # 20 sessions hashed over 3 replicas reach all of them

    # without the header, the balancer hashes on the conversation's first message
    with httpx.Client() as client:
        for i in range(3):
            conv = Conversation(cluster.balancer.url, cluster.model, None)
            turns = [conv.turn(client, f"no header {i}" if n == 0 else f"{n}") for n in range(3)]
            assert len({t.instance for t in turns}) == 1 and all(t.cached > 0 for t in turns[1:])


def load(c: Cluster, stop: threading.Event, failures: list[str], count: list[int], *, streams: bool) -> None:
    """One client thread: conversations of a few turns through the balancer until ``stop``; every answer that is not
    a complete 200 is a failure."""
    with httpx.Client() as client:
        n = 0
        while not stop.is_set():
            conv = Conversation(c.balancer.url, c.model, f"load-{threading.get_ident()}-{n}")
            n += 1
            for k in range(3):
                try:
                    turn = conv.turn(client, f"{k}", stream=streams and k == 1)
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                count[0] += 1
                if turn.status != 200:
                    failures.append(f"status {turn.status} from {turn.instance or 'the balancer'}")


def test_kill_9_mid_load_loses_no_request_and_the_replica_is_taken_back(cluster: Cluster) -> None:
    victim = cluster.replicas["r2"]
    sessions = [f"conversation-{i}" for i in range(20)]
    before = where(cluster, sessions)
    own = [s for s, name in before.items() if name == victim.name]
    assert own  # test_every_replica... showed all three get conversations

    stop, count = threading.Event(), [0]
    failures: list[str] = []
    threads = [threading.Thread(target=load, args=(cluster, stop, failures, count), kwargs={"streams": False})]
    threads += [threading.Thread(target=load, args=(cluster, stop, failures, count), kwargs={"streams": False})]
    threads += [threading.Thread(target=load, args=(cluster, stop, failures, count), kwargs={"streams": False})]
    for t in threads:
        t.start()
    try:
        wait_for("some load", lambda: count[0] >= 6, timeout=60)
        assert victim.proc is not None
        victim.proc.kill()  # SIGKILL: no drain, connections reset mid-request
        victim.proc.wait(10)
        cluster.balancer.wait_state(victim.name, "DOWN", timeout=30)
        done = count[0]
        wait_for("load while it is down", lambda: count[0] >= done + 6, timeout=60)
        victim.start()  # same port, same store: the model is there, the preload loads it
        wait_for(f"{victim.name} to be ready again", victim.ready, timeout=90, every=0.2)
        cluster.balancer.wait_state(victim.name, "UP", timeout=30)
        done = count[0]
        wait_for("load after its return", lambda: count[0] >= done + 6, timeout=60)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not failures, failures[:10]
    after = where(cluster, own)
    assert after == {s: victim.name for s in own}  # its conversations came back to it


def test_a_full_replica_sends_requests_elsewhere(cluster: Cluster) -> None:
    """A replica whose queue is full answers 503 with Retry-After; HAProxy retries those requests on the others."""
    full = cluster.replicas["r3"]
    sessions = [f"conversation-{i}" for i in range(20)]
    session = next(s for s, name in where(cluster, sessions).items() if name == full.name)
    full.stop()
    saved = dict(full.env)
    full.env.update({"CORRAL_NUM_PARALLEL": "1", "CORRAL_MAX_QUEUE": "1"})  # one served, one waiting, then 503
    try:
        full.start()
        wait_for(f"{full.name} to be ready", full.ready, timeout=90, every=0.2)
        cluster.balancer.wait_state(full.name, "UP", timeout=30)
        start = threading.Barrier(12)

        def ask(i: int) -> tuple[int, str]:
            body = {
                "model": cluster.model,
                "messages": [{"role": "user", "content": f"burst {i}"}],
                "stream": False,
                "options": {"num_predict": 64},
            }
            with httpx.Client() as client:
                start.wait(30)
                r = client.post(
                    cluster.balancer.url + "/api/chat", json=body, headers={"X-Corral-Session": session}, timeout=120
                )
            return r.status_code, r.headers.get("x-corral-instance", "")

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(12)))
        assert all(status == 200 for status, _ in answers), answers
        by = Counter(name for _, name in answers)
        assert by[full.name] >= 1 and sum(by.values()) > by[full.name], by  # some served there, some elsewhere
        assert "path=/api/chat status=503" in full.text()
    finally:
        full.stop()
        full.env.clear()
        full.env.update(saved)
        full.start()
        cluster.ready_everywhere()


def test_rolling_sigterm_restart_under_load_fails_no_request(cluster: Cluster) -> None:
    cluster.ready_everywhere()
    stop, count = threading.Event(), [0]
    failures: list[str] = []
    threads = [
        threading.Thread(target=load, args=(cluster, stop, failures, count), kwargs={"streams": i == 0})
        for i in range(3)
    ]
    for t in threads:
        t.start()
    try:
        wait_for("some load", lambda: count[0] >= 6, timeout=60)
        for r in cluster.replicas.values():
            r.signal(signal.SIGTERM)
            assert r.wait(60) == 0
            assert "drained: no request in flight" in r.text() or "SIGTERM: draining" in r.text()
            gone_at = count[0]
            wait_for("load while it is gone", lambda: count[0] >= gone_at + 3, timeout=60)  # noqa: B023
            r.start()
            wait_for(f"{r.name} to be ready again", r.ready, timeout=90, every=0.2)
            cluster.balancer.wait_state(r.name, "UP", timeout=30)
        done = count[0]
        wait_for("load after the restart", lambda: count[0] >= done + 6, timeout=60)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert not failures, failures[:10]
    assert count[0] > 20
