"""With CORRAL_API_KEY set, the page (served without the key, like /) asks for the key on the first 401 and shows
no data before it has one; a wrong key is refused and asked for again; the right key makes every view work, is
kept for the browser session only (sessionStorage, never localStorage) and survives a reload."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import write_tiny_gguf
from tests.ui.conftest import Page, create, tags

pytestmark = pytest.mark.slow

KEY = "ui-test-key-0123456789"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ui-apikey")
    d = start_daemon(root / "models", root / "daemon.log", {"CORRAL_API_KEY": KEY})
    try:
        tiny = write_tiny_gguf(root / "tiny.gguf")
        create(d, "tiny", {"tiny.gguf": tiny}, headers={"Authorization": f"Bearer {KEY}"})
        yield d
    finally:
        stop_daemon(d)


def dialog_open(page: Page) -> bool:
    return bool(page.js("return document.querySelector('#apikey-dialog').open"))


def rows(page: Page) -> list[str]:
    return [r.get_attribute("data-model") for r in page.all("#models-table tbody tr[data-model]")]


def enter_key(page: Page, key: str) -> None:
    page.css("#apikey-input").clear()
    page.css("#apikey-input").send_keys(key)
    page.click("#apikey-save")


def test_page_asks_for_the_key_and_works_only_after_it(page: Page, keyed: Daemon) -> None:
    assert httpx.get(keyed.url + "/api/tags", timeout=30).status_code == 401  # the daemon wants the key
    page.open(keyed, "models", ready=False)
    page.wait(lambda: dialog_open(page), what="the key dialog opens")
    assert rows(page) == []  # nothing shown without the key
    enter_key(page, "not-the-key")
    page.wait(lambda: dialog_open(page) and page.css("#apikey-error").is_displayed(), what="the wrong key is refused")
    assert rows(page) == []
    enter_key(page, KEY)
    page.wait_ready()
    assert not dialog_open(page)
    assert rows(page) == tags(keyed, Authorization=f"Bearer {KEY}") == ["tiny:latest"]
    for view in ("running", "chat"):
        page.show(view)
        assert not dialog_open(page)
    assert page.js("return sessionStorage.getItem('corral.apikey')") == KEY
    stored = page.js("return Object.keys(localStorage).map(k => localStorage.getItem(k)).join('\\n')")
    assert KEY not in stored  # kept for the browser session only
    page.open(keyed, "models")  # a reload in the same tab: the session keeps the key
    assert not dialog_open(page) and rows(page) == ["tiny:latest"]
