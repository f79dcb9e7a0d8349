"""Fixtures for the web page's browser tests: Debian's headless ``chromium`` driven by Selenium through Debian's
``chromium-driver`` (never a downloaded browser or driver), a page helper that knows the page's DOM contract
(docs/ui.md), model creation through the daemon's API, and a tiny local HTTP server that counts the requests it gets
(what a remote resource in model output would hit)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO, Daemon
from tests.vision import png_bytes

# Debian's packages (chromium, chromium-driver): found on PATH, else where Debian puts them
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
SCREENSHOTS = REPO / "build" / "ui-screenshots"
WAIT = 60.0  # generous bound for the page to catch up with the daemon on a loaded 2-core machine


def _missing_browser() -> str | None:
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not Path(path).is_file():
            return f"{path} is missing: apt-get install {package} (.ci/run installs it)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed: pip install -e '.[test]'"
    return None


class Page:
    """The page in one headless Chromium, with waits phrased in the page's DOM contract."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    # -- navigation ----------------------------------------------------------------------------------------------
    def open(self, daemon: Daemon, view: str = "models", *, ready: bool = True) -> None:
        if self.driver.current_url.startswith(daemon.url):
            self.driver.get("about:blank")  # a new load, even where only the #view differs
        self.driver.get(f"{daemon.url}/ui#{view}")
        if ready:
            self.wait_ready()

    def show(self, view: str) -> None:
        """Switch view by its nav link, as a user would, and wait for its first data load."""
        if self.js("return location.hash") == f"#{view}":
            self.wait_ready()
            return
        self.js("document.body.dataset.ready = ''")
        self.css(f'a[data-view="{view}"]').click()
        self.wait_ready()

    def wait_ready(self, timeout: float = WAIT) -> None:
        try:
            self.wait(lambda: self.js("return document.body.dataset.ready") == "1", timeout, "the page got ready")
        except AssertionError as e:
            raise AssertionError(f"{e}; the browser's console: {self.console()}") from None

    # -- DOM -----------------------------------------------------------------------------------------------------
    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def css(self, selector: str) -> Any:
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.CSS_SELECTOR, selector)

    def all(self, selector: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return list(self.driver.find_elements(By.CSS_SELECTOR, selector))

    def wait(
        self,
        condition: Callable[[], Any],
        timeout: float = WAIT,
        what: str | Callable[[], str] = "it",
        poll: float = 0.05,
    ) -> Any:
        """Poll ``condition`` until it is truthy (returned) or ``timeout`` passes (an AssertionError naming ``what``,
        called then if it is a callable)."""
        from selenium.common.exceptions import StaleElementReferenceException

        deadline = time.monotonic() + timeout
        while True:
            try:
                value = condition()
            except StaleElementReferenceException:  # the page drew that part anew: look again
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f}s waiting until {what() if callable(what) else what}"
                )
            time.sleep(poll)

    def click(self, selector: str) -> None:
        """Click the element ``selector`` finds, found again if the page redraws it in between."""
        from selenium.common.exceptions import StaleElementReferenceException

        for attempt in range(5):
            try:
                self.css(selector).click()
                return
            except StaleElementReferenceException:
                if attempt == 4:
                    raise
                time.sleep(0.1)

    def fill(self, selector: str, text: str) -> None:
        """Set an input's or textarea's value as typing would (the page listens to input events)."""
        el = self.css(selector)
        self.js(
            "arguments[0].value = arguments[1];"
            "arguments[0].dispatchEvent(new Event('input', {bubbles: true}));"
            "arguments[0].dispatchEvent(new Event('change', {bubbles: true}));",
            el,
            text,
        )

    def select(self, selector: str, value: str) -> None:
        from selenium.webdriver.support.ui import Select

        self.wait(
            lambda: value in [o.get_attribute("value") for o in self.all(f"{selector} option")],
            what=f"{selector} offers {value!r}",
        )
        Select(self.css(selector)).select_by_value(value)

    def screenshot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / name
        # the whole page, not only the window: Chromium's DevTools capture beyond the viewport
        size = self.driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": min(size["height"], 4000), "scale": 1}
        shot = self.driver.execute_cdp_cmd(
            "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}
        )
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def alert_text(self) -> str | None:
        """The text of an open alert/confirm/prompt dialog (None when none is open)."""
        from selenium.common.exceptions import NoAlertPresentException

        try:
            return str(self.driver.switch_to.alert.text)
        except NoAlertPresentException:
            return None

    def console(self) -> list[dict[str, Any]]:
        """The browser console's entries since the last call (Chromium's log)."""
        return list(self.driver.get_log("browser"))


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    """Headless Chromium (Debian's), one per test module; Selenium Manager is kept offline and never asked."""
    reason = _missing_browser()
    if reason:
        pytest.skip(reason)
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager: never fetch a browser or a driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",  # the tests run as root
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-default-apps",
        "--disable-sync",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield Page(driver)
    finally:
        driver.quit()


# -- models through the daemon's API ----------------------------------------------------------------------------
def upload(d: Daemon, path: Path, headers: dict[str, str] | None = None) -> str:
    data = path.read_bytes()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    with d.client(headers=headers or {}) as c:
        if c.head(f"/api/blobs/{digest}").status_code == 200:
            return digest  # already in the store (SmolLM2 under several names)
        r = c.post(f"/api/blobs/{digest}", content=data, timeout=300)
        assert r.status_code in (200, 201), r.text
    return digest


def create(d: Daemon, name: str, files: dict[str, Path], headers: dict[str, str] | None = None, **fields: Any) -> None:
    """``POST /api/create`` with the given GGUF files (uploaded first) and Modelfile fields."""
    body: dict[str, Any] = {
        "model": name,
        "files": {n: upload(d, p, headers) for n, p in files.items()},
        "stream": False,
    }
    body.update(fields)
    with d.client(headers=headers or {}) as c:
        r = c.post("/api/create", json=body, timeout=300)
    assert r.status_code == 200, r.text


def tags(d: Daemon, **headers: str) -> list[str]:
    r = httpx.get(d.url + "/api/tags", headers=headers, timeout=30)
    r.raise_for_status()
    return [m["name"] for m in r.json()["models"]]


# -- untrusted content stayed inert ------------------------------------------------------------------------------
def assert_inert(page: Page, remote: CountingServer, scope: str) -> None:
    """Nothing under ``scope`` can run or load: no script set the marker, no element has an on* handler, a
    javascript: URL, or is a script/frame/embedded document/style/SVG image, no <img> points anywhere but data: or
    blob:, links are http(s)/mailto only, and the "remote" server got no request."""
    assert page.js("return window.__pwned === undefined"), page.js("return String(window.__pwned)")
    handlers = page.js(
        "return [...document.querySelectorAll(arguments[0] + ' *')].flatMap(e => [...e.attributes]"
        ".filter(a => a.name.toLowerCase().startsWith('on')).map(a => e.tagName + ' ' + a.name))",
        scope,
    )
    assert handlers == []
    js_urls = page.all(
        ", ".join(f'{scope} [{attr}^="javascript:" i]' for attr in ("href", "src", "action", "formaction"))
    )
    assert [e.get_attribute("outerHTML")[:200] for e in js_urls] == []
    kinds = ("script", "iframe", "frame", "object", "embed", "style", "link", "svg image", "base", "meta", "form")
    found = page.js(
        "return [...document.querySelectorAll(arguments[0])].map(e => e.outerHTML.slice(0, 200))",
        ", ".join(f"{scope} {k}" for k in kinds),
    )
    assert found == []
    srcs = [
        i.get_attribute("src") or "" for i in page.all(f"{scope} img, {scope} video, {scope} audio, {scope} source")
    ]
    assert all(s.startswith(("data:", "blob:")) for s in srcs), srcs
    links = [a.get_attribute("href") for a in page.all(f"{scope} a[href]")]
    assert all(h.startswith(("http:", "https:", "mailto:")) for h in links), links
    assert remote.hits == []


# -- a local "remote" server ------------------------------------------------------------------------------------
class CountingServer:
    """An HTTP server on 127.0.0.1 that answers every GET with a 1x1 PNG and records each path asked for."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        hits, png = self.hits, png_bytes(1, 1, b"\x00\x00\x00")

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                self.wfile.write(png)

            do_POST = do_GET

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def remote() -> Iterator[CountingServer]:
    s = CountingServer()
    try:
        yield s
    finally:
        s.close()
