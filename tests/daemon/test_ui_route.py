"""The web page's server side (issue 31): ``/ui`` and its assets under a strict CSP, the page's files and their size,
the key and the Host check still guarding the API the page calls, the Modelfile parse endpoint, and background
pulls (``/api/pulls``) that go on whoever watches them. The page itself is driven in a browser by tests/ui/."""

from __future__ import annotations

import gzip
import re
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO, Daemon, start_daemon, stop_daemon
from tests.registry_pull.fake_registry import MODEL_TYPE, FakeRegistry, Holder, ServerThread, digest_of

UI = REPO / "daemon" / "ui"
CSP_PARTS = (
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data: blob:",
    "connect-src 'self'",
    "frame-ancestors 'none'",
)


def page_files() -> list[Path]:
    return sorted(p for p in UI.iterdir() if p.suffix in (".html", ".js", ".css", ".svg"))


def referenced_assets() -> set[str]:
    """What index.html loads and what the JS modules import, as /ui/<name>."""
    html = (UI / "index.html").read_text()
    found = set(re.findall(r'(?:src|href)="/ui/([^"]+)"', html))
    for js in UI.glob("*.js"):
        found |= set(re.findall(r'from "\./([^"]+)"', js.read_text()))
    return found


def test_page_files_are_there_and_small() -> None:
    names = {p.name for p in page_files()}
    assert {"index.html", "ui.js", "ui.css", "markdown.js"} <= names
    assert referenced_assets() <= names, "index.html or a module refers to a file that is not in daemon/ui/"
    packed = sum(len(gzip.compress(p.read_bytes(), 9)) for p in page_files())
    assert packed < 300 * 1024, f"the page is {packed} bytes compressed; the bound is 300 KB"


def test_page_has_no_inline_code_no_html_sinks_and_no_remote_origin() -> None:
    html = (UI / "index.html").read_text()
    for tag in re.findall(r"<script\b[^>]*>", html):
        assert 'src="/ui/' in tag, f"inline or foreign script: {tag}"
    assert not re.search(r"\son[a-z]+\s*=", html), "inline event handler in index.html"
    assert "style=" not in html, "inline style in index.html (the CSP refuses it)"
    assert not re.search(r'(?:src|href)="(?:https?:)?//', html), "index.html loads something from another origin"
    for js in UI.glob("*.js"):
        text = js.read_text()
        for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
            assert sink not in text, f"{js.name} uses {sink}"
        assert not re.search(r'from\s+"(?:https?:)?//', text), f"{js.name} imports from another origin"
        assert 'setAttribute("style"' not in text


def test_page_ships_in_the_wheel() -> None:
    """hatchling puts every file under a listed package into the wheel unless .gitignore excludes it."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "daemon" in config["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    ignored = [line.strip() for line in (REPO / ".gitignore").read_text().splitlines() if line.strip()]
    for p in page_files():
        rel = p.relative_to(REPO).as_posix()
        assert not any(rel.startswith(i.rstrip("/") + "/") or p.match(i) for i in ignored), rel


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the tests that only read the page or add models of their own."""
    root = tmp_path_factory.mktemp("ui-route")
    d = start_daemon(root / "models", root / "daemon.log")
    try:
        yield d
    finally:
        stop_daemon(d)


def test_ui_route_serves_the_page_with_a_strict_policy(shared: Daemon) -> None:
    daemon = shared
    with daemon.client() as c:
        for path in ("/ui", "/ui/"):
            r = c.get(path)
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith("text/html")
            assert 'data-view="chat"' in r.text
        csp = r.headers["content-security-policy"]
        for part in CSP_PARTS:
            assert part in csp, (part, csp)
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert r.headers["x-content-type-options"] == "nosniff"
        for name in referenced_assets():
            a = c.get(f"/ui/{name}")
            assert a.status_code == 200, name
            assert a.content == (UI / name).read_bytes()
            assert "content-security-policy" in a.headers and a.headers["x-content-type-options"] == "nosniff"
            if name.endswith(".js"):
                assert a.headers["content-type"].startswith("text/javascript")
            if name.endswith(".css"):
                assert a.headers["content-type"].startswith("text/css")
        # compressed for a browser, revalidated by ETag
        g = c.get("/ui/ui.js", headers={"accept-encoding": "gzip"})
        assert g.headers.get("content-encoding") == "gzip" and g.content == (UI / "ui.js").read_bytes()
        again = c.get("/ui/ui.js", headers={"if-none-match": g.headers["etag"]})
        assert again.status_code == 304
        # nothing but the page's own files
        for bad in ("/ui/nothing.js", "/ui/__init__.py", "/ui/..%2F..%2Fpyproject.toml", "/ui/%2e%2e"):
            r = c.get(bad)
            assert r.status_code == 404, bad
        assert "the page is at /ui" in c.get("/ui/nothing.js").json()["error"]


@pytest.fixture
def keyed_daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = start_daemon(tmp_path / "models", tmp_path / "daemon.log", {"CORRAL_API_KEY": "s3cret"})
    try:
        yield d
    finally:
        stop_daemon(d)


def test_page_is_open_but_its_api_calls_need_the_key(keyed_daemon: Daemon) -> None:
    with keyed_daemon.client() as c:
        assert c.get("/ui").status_code == 200
        assert c.get("/ui/ui.js").status_code == 200
        for method, path in (("GET", "/api/tags"), ("GET", "/api/pulls"), ("POST", "/api/ui/modelfile")):
            assert c.request(method, path, json={"modelfile": "FROM x"}).status_code == 401, path
        assert c.get("/api/tags", headers={"authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/api/pulls", headers={"authorization": "Bearer s3cret"}).json() == {"pulls": []}
        # the Host and Origin checks still apply to the page
        assert c.get("/ui", headers={"host": "evil.example"}).status_code == 403
        assert c.get("/ui", headers={"origin": "https://evil.example"}).status_code == 403


def test_modelfile_parse_gives_the_create_body_or_line_and_column(shared: Daemon) -> None:
    daemon = shared
    text = (
        "FROM smollm2\nFROM ./mmproj.gguf\nPARAMETER temperature 0.5\nPARAMETER stop <end>\n"
        'SYSTEM """be brief"""\nLICENSE MIT\nMESSAGE user hi\n'
    )
    with daemon.client() as c:
        r = c.post("/api/ui/modelfile", json={"modelfile": text})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["froms"] == ["smollm2", "./mmproj.gguf"] and out["adapters"] == []
        body = out["body"]
        assert body["system"] == "be brief" and body["license"] == ["MIT"]
        assert body["parameters"]["temperature"] == 0.5 and body["parameters"]["stop"] == ["<end>"]
        assert body["messages"] == [{"role": "user", "content": "hi"}]
        bad = c.post("/api/ui/modelfile", json={"modelfile": "FROM x\nPARAMETER temperature hot\n"})
        assert bad.status_code == 400
        bad = c.post("/api/ui/modelfile", json={"modelfile": "FROM x\nBOGUS thing\n"})
        assert bad.status_code == 400 and re.match(r"Modelfile:2:\d+: ", bad.json()["error"]), bad.json()
        assert c.post("/api/ui/modelfile", json={}).status_code == 400


@pytest.fixture
def registry() -> Iterator[tuple[FakeRegistry, ServerThread]]:
    reg = FakeRegistry()
    with ServerThread(Holder(reg)) as server:
        yield reg, server


def wait_for(fn: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def jobs(c: httpx.Client) -> dict[str, dict[str, Any]]:
    return {j["model"]: j for j in c.get("/api/pulls").json()["pulls"]}


def test_background_pull_goes_on_without_its_client(
    shared: Daemon, registry: tuple[FakeRegistry, ServerThread]
) -> None:
    daemon = shared
    reg, server = registry
    layer = b"\x01" * 600_000
    reg.add_model("ns/m", "v1", [(MODEL_TYPE, layer)])
    reg.slow_digest, reg.slow_blob_gets, reg.slow_rate = digest_of(layer), 100, 200_000.0  # about 3 seconds
    name = f"{server.host}/ns/m:v1"
    with daemon.client() as c:
        assert c.post("/api/pulls", json={"model": "bad name!"}).status_code == 400
        assert c.post("/api/pulls", json={"model": name}).status_code == 400  # plain http needs insecure
        first = c.post("/api/pulls", json={"model": name, "insecure": True})
        assert first.status_code == 200, first.text
        assert first.json()["model"] == name and first.json()["done"] is False
    # a new client (a reloaded page) finds the pull in the table and follows its layers' progress
    with daemon.client() as c:
        again = c.post("/api/pulls", json={"model": name, "insecure": True}).json()
        assert again["started_at"] == first.json()["started_at"]  # the running job, not a second pull
        moving = wait_for(
            lambda: (j := jobs(c).get(name)) and 0 < j["completed"] < j["total"] and j["bytes_per_second"] > 0 and j,
            "the pull's progress",
        )
        (lay,) = [x for x in moving["layers"] if x["digest"] == digest_of(layer)]
        assert lay["total"] == len(layer) and lay["eta_seconds"] is None or lay["eta_seconds"] >= 0
        done = wait_for(lambda: (j := jobs(c).get(name)) and j["done"] and j, "the pull's end")
        assert done["status"] == "success" and "error" not in done, done
        assert done["completed"] == done["total"] >= len(layer)
        assert name in [m["name"] for m in c.get("/api/tags").json()["models"]]
        # cancelling: an unknown name is a 404; a running pull ends cancelled
        assert c.request("DELETE", "/api/pulls", json={"model": "nope"}).status_code == 404
        other = b"\x02" * 600_000
        reg.add_model("ns/slow", "v1", [(MODEL_TYPE, other)])
        reg.slow_digest, reg.slow_blob_gets, reg.slow_rate = digest_of(other), 100, 20_000.0
        slow = f"{server.host}/ns/slow:v1"
        c.post("/api/pulls", json={"model": slow, "insecure": True}).raise_for_status()
        wait_for(lambda: (j := jobs(c).get(slow)) and j["completed"] > 0, "the second pull to start")
        assert c.request("DELETE", "/api/pulls", json={"model": slow}).status_code == 200
        ended = wait_for(lambda: (j := jobs(c).get(slow)) and j["done"] and j, "the cancelled pull to end")
        assert ended["status"] == "cancelled" and "cancelled" in ended["error"]
        assert slow not in [m["name"] for m in c.get("/api/tags").json()["models"]]


def test_cancelling_a_stalled_background_pull_ends_it_at_once(
    shared: Daemon, registry: tuple[FakeRegistry, ServerThread]
) -> None:
    """A pull whose registry went silent mid-blob: its cancel ends the job within the progress interval, not when
    the download's read timeout (30 s) gives up."""
    reg, server = registry
    layer = b"\x03" * 600_000
    reg.add_model("ns/stalled", "v1", [(MODEL_TYPE, layer)])
    reg.stall_blob_gets, reg.stall_seconds = 100, 120.0  # half the bytes, then silence
    name = f"{server.host}/ns/stalled:v1"
    with shared.client() as c:
        c.post("/api/pulls", json={"model": name, "insecure": True}).raise_for_status()
        wait_for(lambda: (j := jobs(c).get(name)) and j["completed"] > 0, "the pull's first bytes")
        time.sleep(1.0)  # nothing arrives now
        asked = time.monotonic()
        assert c.request("DELETE", "/api/pulls", json={"model": name}).status_code == 200
        ended = wait_for(lambda: (j := jobs(c).get(name)) and j["done"] and j, "the cancelled pull to end")
        took = time.monotonic() - asked
        assert name not in [m["name"] for m in c.get("/api/tags").json()["models"]]
    assert ended["status"] == "cancelled" and "cancelled" in ended["error"], ended
    assert took < 15, f"the stalled pull ended {took:.1f} s after its cancel"


def test_pull_jobs_table_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table alone: one running job per name, errors before the first step raise and stay listed, a failure
    later is recorded, cancel ends a job at its next step, finished jobs expire."""
    import threading

    from errors import InvalidRequest, RegistryProtocolError
    from registry import pull_jobs
    from registry.pull_jobs import PullJobs

    table = PullJobs()
    go = threading.Event()

    def steady(_stop: threading.Event) -> Iterator[dict[str, Any]]:
        yield {"status": "pulling manifest"}
        for done in range(0, 101, 10):
            go.wait(10)
            yield {"status": "pulling abc", "digest": "sha256:abc", "total": 100, "completed": done}
        yield {"status": "success"}

    job = table.start("m", False, steady)
    assert table.start("m", False, lambda _stop: pytest.fail("a second pull of a running name")) is job
    go.set()
    wait_for(lambda: job.done, "the job to end")
    (listed,) = table.list()
    assert listed["status"] == "success" and listed["completed"] == listed["total"] == 100 and "error" not in listed
    assert listed["layers"][0]["eta_seconds"] == 0.0

    def bad_name(_stop: threading.Event) -> Iterator[dict[str, Any]]:
        raise InvalidRequest("invalid model name")

    with pytest.raises(InvalidRequest):
        table.start("bad", False, bad_name)
    assert {j["model"]: j.get("error") for j in table.list()}["bad"] == "invalid model name"

    def breaks(_stop: threading.Event) -> Iterator[dict[str, Any]]:
        yield {"status": "pulling manifest"}
        raise RegistryProtocolError("the registry hung up")

    broken = table.start("broken", False, breaks)
    wait_for(lambda: broken.done, "the broken job to end")
    assert broken.to_json()["error"] == "the registry hung up"

    go.clear()
    slow = table.start("slow", False, steady)
    assert table.cancel("slow") is slow and table.cancel("absent") is None
    go.set()
    wait_for(lambda: slow.done, "the cancelled job to end")
    assert slow.to_json()["status"] == "cancelled" and "cancelled" in slow.to_json()["error"]

    later = time.time() + pull_jobs.KEEP_FINISHED + 1
    monkeypatch.setattr("registry.pull_jobs.time.time", lambda: later)  # every job has ended: nothing else runs
    assert table.list() == []
