"""The Models view in headless Chromium against a real daemon: the list is /api/tags, details open, a pull from a
real local registry (Debian's docker-registry behind a throttling proxy) shows live progress, survives a reload of
the page and ends with the model in the list, and hostile Modelfile metadata (license, template, system, messages)
is shown as text: nothing in it runs or loads; create from a typed Modelfile (with the CLI's line:column errors)
and delete after a confirmation; dark mode follows the system."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import write_tiny_gguf
from tests.registry_pull.conftest import RealRegistry, TCPProxy, start_registry, stop_registry
from tests.registry_pull.test_real_registry import put_model
from tests.ui.conftest import CountingServer, Page, assert_inert, create, tags

pytestmark = pytest.mark.slow


def hostile_html(remote: CountingServer, where: str) -> str:
    return (
        f"<script>window.__pwned = '{where} script'</script>"
        f'<img src="{remote.url}/{where}.png" onerror="window.__pwned = \'{where} img\'">'
        f"[click](javascript:window.__pwned='{where}_link') ![pic]({remote.url}/{where}-md.png) "
        f'<a href="javascript:window.__pwned=1">a</a><iframe src="{remote.url}/{where}-frame"></iframe>'
        f"<style>@import url({remote.url}/{where}.css);</style>"
    )


@pytest.fixture(scope="module")
def models_daemon(tmp_path_factory: pytest.TempPathFactory, remote: CountingServer) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ui-models")
    d = start_daemon(root / "models", root / "daemon.log", {"CORRAL_REGISTRY_AUTH": str(root / "auth.json")})
    try:
        tiny = write_tiny_gguf(root / "tiny.gguf")
        create(d, "tiny", {"tiny.gguf": tiny}, parameters={"temperature": 0.5}, system="be brief")
        create(
            d,
            "meta-hostile",
            {"tiny.gguf": tiny},
            license=hostile_html(remote, "license"),
            system=hostile_html(remote, "system"),
            template="{{ .Prompt }}" + hostile_html(remote, "template"),
            messages=[
                {"role": "user", "content": hostile_html(remote, "message-user")},
                {"role": "assistant", "content": hostile_html(remote, "message-assistant")},
            ],
        )
        yield d
    finally:
        stop_daemon(d)


@pytest.fixture(scope="module")
def local_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RealRegistry, TCPProxy]]:
    r = start_registry(tmp_path_factory.mktemp("ui-registry"))
    proxy = TCPProxy(int(r.host.split(":")[1]))
    try:
        yield r, proxy
    finally:
        proxy.close()
        stop_registry(r)


def test_list_matches_api_tags_and_details_open(page: Page, models_daemon: Daemon, remote: CountingServer) -> None:
    page.open(models_daemon, "models")
    shown = [r.get_attribute("data-model") for r in page.all("#models-table tbody tr[data-model]")]
    assert sorted(shown) == sorted(tags(models_daemon))
    assert {"meta-hostile:latest", "tiny:latest"} <= set(shown)
    page.click('#models-table button.details[data-model="tiny:latest"]')
    page.wait(lambda: page.css("#model-details").is_displayed(), what="the details panel opened")
    assert page.css("#details-title").text == "tiny:latest"
    body = page.js("return document.querySelector('#details-body').textContent")
    assert "be brief" in body and "temperature" in body  # the Modelfile's SYSTEM and PARAMETER are shown
    page.screenshot("models.png")
    # everything the page loaded came from the daemon (no CDN, nothing leaves the machine), without a script error
    urls = page.js("return performance.getEntriesByType('resource').map(e => e.name)")
    assert urls and all(u.startswith(models_daemon.url + "/") for u in urls), urls
    assert [e for e in page.console() if e.get("level") == "SEVERE"] == []


def test_hostile_metadata_is_text(page: Page, models_daemon: Daemon, remote: CountingServer) -> None:
    page.open(models_daemon, "models")
    page.click('#models-table button.details[data-model="meta-hostile:latest"]')
    page.wait(lambda: page.css("#details-title").text == "meta-hostile:latest", what="the details panel opens")
    # open every collapsible block, so that whatever the page renders lazily is rendered
    page.js("document.querySelectorAll('#model-details details').forEach(d => d.open = true)")
    body = page.js("return document.querySelector('#details-body').textContent")
    for where in ("license", "system", "template"):
        assert f"<script>window.__pwned = '{where} script'</script>" in body  # shown, as text
    page.screenshot("models-hostile.png")
    assert_inert(page, remote, "#details-body")
    assert page.alert_text() is None


def test_pull_shows_progress_survives_reload_and_lists_the_model(
    page: Page, models_daemon: Daemon, local_registry: tuple[RealRegistry, TCPProxy], tmp_path: Path
) -> None:
    reg, proxy = local_registry
    # about 12 MB: one download part, so one connection throttled to 2 MB/s: a pull of about six seconds
    blob = write_tiny_gguf(tmp_path / "big.gguf", n_vocab=12000, n_embd=128, n_ff=128).read_bytes()
    put_model(reg.url, "test/big", "v1", blob)
    name = f"{proxy.host}/test/big:v1"
    proxy.rate = 2_000_000
    page.open(models_daemon, "models")
    page.fill("#pull-name", name)
    page.js("document.querySelector('#pull-insecure').checked = true")
    page.click("#pull-button")
    selector = f'#pulls .pull[data-model="{name}"]'

    def state() -> tuple[Any, Any]:
        return page.js(
            "const p = document.querySelector(arguments[0]);"
            "return p ? [p.querySelector('.pull-status').textContent, p.querySelector('progress').value] : null",
            selector,
        ) or (None, None)

    seen: list[tuple[Any, Any]] = []

    def progressed() -> bool:
        s = state()
        if s[0] is not None and (not seen or seen[-1] != s):
            seen.append(s)
        return len({v for _, v in seen if v}) >= 2 and "success" not in str(s[0])

    page.wait(progressed, what=lambda: f"the pull's progress changes before it ends (seen: {seen})", poll=0.02)
    assert any(" / " in str(text) for text, _ in seen), seen  # bytes done / total
    # a reload while the pull goes on in the daemon: the page finds the pull again and follows it
    page.driver.refresh()
    page.wait_ready()
    page.wait(lambda: state()[0] is not None, what="the pull is shown again after a reload")
    proxy.rate = None
    page.wait(lambda: state()[0] == "success", timeout=120, what=lambda: f"the pull succeeds (last: {state()})")
    page.wait(
        lambda: page.all(f'#models-table tbody tr[data-model="{name}"]'),
        what="the pulled model appears in the list",
    )
    assert name in tags(models_daemon)


def test_create_from_a_typed_modelfile_and_its_errors(page: Page, models_daemon: Daemon) -> None:
    page.open(models_daemon, "models")
    page.fill("#create-name", "derived")
    page.fill("#create-modelfile", "FROM tiny\nPARAMETER nonsense 1\n")
    page.click("#create-button")
    status = page.css("#create-status")
    page.wait(lambda: status.text.strip(), what="the create error is shown")
    assert "2:11" in status.text and 'unknown parameter "nonsense"' in status.text, status.text  # as the CLI says it
    assert "derived:latest" not in tags(models_daemon)
    page.fill("#create-modelfile", "FROM tiny\nPARAMETER temperature 0.3\nSYSTEM you are derived\n")
    page.click("#create-button")
    page.wait(lambda: page.all('#models-table tr[data-model="derived:latest"]'), what="the created model is listed")
    assert "success" in status.text, status.text
    with models_daemon.client() as c:
        show = c.post("/api/show", json={"model": "derived"}).json()
    assert show["system"] == "you are derived" and "0.3" in show["parameters"]


def test_delete_asks_first(page: Page, models_daemon: Daemon, tmp_path: Path) -> None:
    create(models_daemon, "doomed", {"doomed.gguf": write_tiny_gguf(tmp_path / "doomed.gguf", seed=7)})
    page.open(models_daemon, "models")
    page.click('#models-table button.delete[data-model="doomed:latest"]')
    page.wait(lambda: page.js("return document.querySelector('#confirm').open"), what="the confirmation opens")
    page.click("#confirm-no")  # not confirmed: kept
    page.wait(lambda: not page.js("return document.querySelector('#confirm').open"), what="the dialog closes")
    assert "doomed:latest" in tags(models_daemon)
    page.click('#models-table button.delete[data-model="doomed:latest"]')
    page.wait(lambda: page.js("return document.querySelector('#confirm').open"), what="the confirmation opens")
    page.click("#confirm-yes")
    page.wait(lambda: not page.all('#models-table tr[data-model="doomed:latest"]'), what="the row goes")
    assert "doomed:latest" not in tags(models_daemon)


def test_dark_mode_follows_the_system(page: Page, models_daemon: Daemon) -> None:
    def luminance() -> float:
        rgb = page.js("return getComputedStyle(document.body).backgroundColor")
        r, g, b = (int(v) for v in rgb[rgb.index("(") + 1 : rgb.index(")")].split(",")[:3])
        return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255

    page.open(models_daemon, "models")
    light = luminance()
    page.driver.execute_cdp_cmd(
        "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
    )
    try:
        page.wait(lambda: luminance() < 0.3, what="the page turns dark")
        assert light > 0.7
        page.screenshot("models-dark.png")
    finally:
        page.driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
