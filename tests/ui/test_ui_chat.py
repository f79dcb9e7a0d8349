"""The Chat and Running views in headless Chromium against a real daemon: SmolLM2's answer streams in and Stop ends
the generation on the daemon (its slot frees); a thinking-template model's thinking is shown apart from the
answer; a tool call is shown as one; images (chosen, dropped, pasted) reach a vision model (SmolLM2 with the test
projector); a model whose real greedy output holds a <script>, an <img onerror>, javascript: links and remote
images runs nothing and loads nothing; conversations are kept (rename, regenerate, edit and resend); the Running
view lists what /api/ps lists and unloads one. Screenshots: chat.png and running.png in build/ui-screenshots/."""

from __future__ import annotations

import base64
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.compat.conftest import HERMES_TEMPLATE, THINK_TEMPLATE
from tests.conftest import Daemon, start_daemon, stop_daemon
from tests.models import smollm2_path
from tests.ui.conftest import WAIT, CountingServer, Page, assert_inert, create
from tests.ui.models import write_scripted_gguf
from tests.vision import image_bytes, projector_path

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

SMOL = smollm2_path()
if SMOL is None:
    pytest.skip("SmolLM2 is not cached (run scripts/fetch_smollm2.py)", allow_module_level=True)

THOUGHT = ["Weighing", " the", " question", " carefully."]
ANSWER = ["The", " answer", " is", " four."]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = ["<tool_call>", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}', "</tool_call>"]


def hostile_script(remote: CountingServer) -> list[str]:
    return [
        "Here",
        " is",
        " <script>window.__pwned='script'</script>",
        " <img src=x onerror=\"window.__pwned='img'\">",
        " [click](javascript:window.__pwned='link')",
        " <a href=\"javascript:window.__pwned='a'\">tap</a>",
        f" ![remote]({remote.url}/markdown.png)",
        f' <img src="{remote.url}/html.png">',
        f' <iframe src="{remote.url}/frame"></iframe>',
        f" <svg><image href='{remote.url}/svg.png'/></svg>",
        f" [fine]({remote.url}/link)",
        " done",
    ]


@pytest.fixture(scope="module")
def chat_daemon(tmp_path_factory: pytest.TempPathFactory, remote: CountingServer) -> Iterator[Daemon]:
    root = tmp_path_factory.mktemp("ui-chat")
    # prompts in the log: how the test sees that an image reached the model
    d = start_daemon(root / "models", root / "daemon.log", {"CORRAL_LOG_PROMPTS": "true"})
    try:
        assert SMOL is not None
        create(d, "smol", {"model.gguf": SMOL}, parameters={"temperature": 0, "num_predict": 32})
        # a story that runs long enough for Stop to end it (num_predict bounds it if Stop did not)
        create(d, "smol-long", {"model.gguf": SMOL}, parameters={"temperature": 0, "num_predict": 2000})
        create(
            d,
            "vis",
            {"model.gguf": SMOL, "mmproj.gguf": projector_path()},
            parameters={"temperature": 0, "num_predict": 8},
        )
        thinker = write_scripted_gguf(root / "thinker.gguf", [*THOUGHT, "</think>", *ANSWER])
        create(d, "thinker", {"thinker.gguf": thinker}, template=THINK_TEMPLATE)
        caller = write_scripted_gguf(root / "caller.gguf", CALL)
        create(d, "caller", {"caller.gguf": caller}, template=HERMES_TEMPLATE)
        hostile = write_scripted_gguf(root / "hostile.gguf", hostile_script(remote))
        create(d, "hostile", {"hostile.gguf": hostile})
        yield d
    finally:
        stop_daemon(d)


def ps(d: Daemon) -> list[dict[str, Any]]:
    r = httpx.get(d.url + "/api/ps", timeout=30)
    r.raise_for_status()
    return list(r.json()["models"])


def busy_slots(d: Daemon, name: str) -> int:
    """Busy slots of the runner serving ``name`` (models on one base share a runner: ps lists its ``names``)."""
    serving = [m for m in ps(d) if name in (m["name"], m["model"], *m.get("names", []))]
    return sum(bool(s.get("busy")) for m in serving for s in m.get("slots") or [])


def new_chat(page: Page, d: Daemon, model: str) -> None:
    if page.driver.current_url.startswith(d.url + "/ui"):
        page.show("chat")
    else:
        page.open(d, "chat")
    page.click("#new-chat")
    page.select("#chat-model", model)


LAST_ANSWER = "[...document.querySelectorAll('#messages .msg.assistant .answer')].pop()"


class Answer:
    """The last assistant message's ``.answer``, looked up afresh on each use (the page may draw it anew)."""

    def __init__(self, page: Page) -> None:
        self.page = page

    def get_attribute(self, name: str) -> str | None:
        value = self.page.js(f"const a = {LAST_ANSWER}; return a ? a.getAttribute(arguments[0]) : null", name)
        return None if value is None else str(value)

    @property
    def text(self) -> str:
        return str(self.page.js(f"const a = {LAST_ANSWER}; return a ? a.innerText : ''"))


def send(page: Page, text: str) -> Answer:
    """Send a message; the new assistant message's ``.answer``."""
    before = len(page.all("#messages .msg.assistant"))
    page.fill("#chat-input", text)
    page.click("#chat-send")
    page.wait(lambda: len(page.all("#messages .msg.assistant")) > before, what="the answer appears")
    return Answer(page)


def wait_done(page: Page, answer: Answer, timeout: float = WAIT) -> None:
    page.wait(lambda: answer.get_attribute("data-done") == "1", timeout, "the answer is done")


def test_answer_streams(page: Page, chat_daemon: Daemon) -> None:
    new_chat(page, chat_daemon, "smol:latest")
    assert not page.css("#opt-think").is_enabled()  # SmolLM2's own template does not think
    answer = send(page, "Tell me about the sea.")
    seen: list[tuple[str | None, str | None]] = []

    def streamed() -> bool:
        state = (answer.get_attribute("data-updates"), answer.get_attribute("data-done"))
        seen.append(tuple(state))
        return int(state[0] or 0) > 1 and state[1] != "1"

    page.wait(streamed, what=lambda: f"more than one update before the end (seen {seen[-5:]})", poll=0.01)
    wait_done(page, answer)
    text = answer.text
    assert text.strip(), "the answer is empty"
    with chat_daemon.client() as c:  # the same greedy answer the API gives
        r = c.post(
            "/api/chat",
            json={
                "model": "smol",
                "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "stream": False,
            },
        )
    assert " ".join(r.json()["message"]["content"].split())[:40] == " ".join(text.split())[:40]
    assert int(answer.get_attribute("data-updates")) > 1


def test_stop_ends_the_generation_on_the_daemon(page: Page, chat_daemon: Daemon) -> None:
    new_chat(page, chat_daemon, "smol-long:latest")
    answer = send(page, "Write a very long story about a dragon who learns to sail, in many chapters.")
    page.wait(lambda: int(answer.get_attribute("data-updates") or 0) >= 3, what="the story streams")
    assert busy_slots(chat_daemon, "smol-long:latest") == 1, ps(chat_daemon)
    assert answer.get_attribute("data-done") != "1"
    page.click("#chat-stop")
    wait_done(page, answer)
    # the daemon ends the generation: the slot is free again (generous bound: a 2-core machine under load)
    page.wait(lambda: busy_slots(chat_daemon, "smol-long:latest") == 0, what="the slot frees on the daemon")
    words = len(answer.text.split())
    time.sleep(1.0)
    assert len(answer.text.split()) == words  # nothing more arrives
    # the daemon saw the client go and cancelled the request; it never finished (no eval_count in its line)
    log = chat_daemon.log.read_text()
    assert "client disconnected; request cancelled path=/api/chat" in log, log[-3000:]
    (line,) = [ln for ln in log.splitlines() if "path=/api/chat" in ln and "model=smol-long:latest" in ln]
    assert "eval_count=" not in line, line


def test_thinking_shown_apart(page: Page, chat_daemon: Daemon) -> None:
    new_chat(page, chat_daemon, "thinker:latest")
    assert page.css("#opt-think").is_enabled()  # think levels offered for a model that thinks
    answer = send(page, "What is two plus two?")
    wait_done(page, answer)
    msg = page.all("#messages .msg.assistant")[-1]
    thinking = page.js("const t = arguments[0].querySelector('details.thinking'); return t && t.textContent", msg)
    assert thinking and "".join(THOUGHT).strip() in thinking
    assert answer.text.strip() == "".join(ANSWER).strip()
    assert "</think>" not in answer.text and "Weighing" not in answer.text
    page.js("arguments[0].querySelector('details.thinking').open = true", msg)  # collapsible: shown open
    page.screenshot("chat.png")


def test_conversations_kept_renamed_regenerated_and_edited(page: Page, chat_daemon: Daemon) -> None:
    from selenium.webdriver.common.keys import Keys

    new_chat(page, chat_daemon, "thinker:latest")
    page.css("#chat-input").send_keys("First question", Keys.ENTER)  # Enter sends, from the keyboard
    page.wait(lambda: page.all("#messages .msg.assistant .answer[data-done='1']"), what="the first answer")
    titles = [c.text for c in page.all("#conversations .conversation")]
    assert any("First question" in t for t in titles), titles
    # rename it
    (item,) = [c for c in page.all("#conversations .conversation") if "First question" in c.text]
    page.click(f'#conversations .conversation[data-id="{item.get_attribute("data-id")}"] .rename')
    page.wait(lambda: page.js("return document.querySelector('#prompt-dialog').open"), what="the rename dialog opens")
    page.css("#prompt-input").clear()
    page.css("#prompt-input").send_keys("Renamed chat")
    page.click("#prompt-ok")
    page.wait(lambda: any("Renamed chat" in c.text for c in page.all("#conversations .conversation")), what="renamed")
    # regenerate: the answer is asked for again (one assistant message, drawn anew)
    page.click("#messages .msg.assistant .regenerate")
    page.wait(lambda: page.all("#messages .msg.assistant .answer[data-done='1']"), what="the regenerated answer")
    assert len(page.all("#messages .msg.assistant")) == 1
    # edit and resend: the question comes back into the input, the turn after it goes
    page.click("#messages .msg.user .edit")
    page.wait(lambda: page.css("#chat-input").get_attribute("value") == "First question", what="the text to edit")
    assert page.all("#messages .msg") == []
    page.fill("#chat-input", "Second question")
    page.click("#chat-send")
    page.wait(lambda: page.all("#messages .msg.assistant .answer[data-done='1']"), what="the answer to the edit")
    assert [m.text for m in page.all("#messages .msg.user .content")] == ["Second question"]
    # kept in the browser: a reload shows the renamed conversation and its messages
    page.open(chat_daemon, "chat")
    assert any("Renamed chat" in c.text for c in page.all("#conversations .conversation"))
    page.wait(lambda: page.all("#messages .msg.user"), what="the conversation's messages after a reload")
    assert [m.text for m in page.all("#messages .msg.user .content")] == ["Second question"]


def test_two_tabs_keep_each_others_conversations(page: Page, chat_daemon: Daemon) -> None:
    """Two tabs share the browser's store: what one saves (here at the end of an answer that streamed while the
    other tab worked) never undoes the other's conversations, and one deleted in a tab stays deleted."""
    driver = page.driver
    first = driver.current_window_handle

    def titles() -> list[str]:
        return [c.text for c in page.all("#conversations .conversation")]

    new_chat(page, chat_daemon, "thinker:latest")
    wait_done(page, send(page, "Kept from tab A"))
    new_chat(page, chat_daemon, "smol-long:latest")
    long = send(page, "Streamed in tab A")  # streams on while tab B works
    page.wait(lambda: int(long.get_attribute("data-updates") or 0) > 1, what="tab A's answer streams")
    driver.switch_to.new_window("tab")
    try:
        new_chat(page, chat_daemon, "thinker:latest")
        wait_done(page, send(page, "Asked in tab B"))
        (item,) = [c for c in page.all("#conversations .conversation") if "Kept from tab A" in c.text]
        page.click(f'#conversations .conversation[data-id="{item.get_attribute("data-id")}"] .remove')
        page.wait(lambda: page.js("return document.querySelector('#confirm').open"), what="the confirm dialog")
        page.click("#confirm-yes")
        page.wait(lambda: not any("Kept from tab A" in t for t in titles()), what="deleted in tab B")
        driver.switch_to.window(first)
        page.click("#chat-stop")  # tab A's answer ends: tab A saves
        wait_done(page, long)
        page.wait(lambda: any("Asked in tab B" in t for t in titles()), what="tab B's conversation in tab A")
        page.open(chat_daemon, "chat")
        shown = titles()
        assert any("Asked in tab B" in t for t in shown), shown  # not undone by tab A's save
        assert not any("Kept from tab A" in t for t in shown), shown  # not brought back by it
        assert any("Streamed in tab A" in t for t in shown), shown
    finally:
        for handle in driver.window_handles:
            if handle != first:
                driver.switch_to.window(handle)
                driver.close()
        driver.switch_to.window(first)


def test_tool_call_shown_as_such(page: Page, chat_daemon: Daemon) -> None:
    new_chat(page, chat_daemon, "caller:latest")
    page.fill("#chat-tools", json.dumps([WEATHER]))
    answer = send(page, "What is the weather in Paris?")
    wait_done(page, answer)
    msg = page.all("#messages .msg.assistant")[-1]
    calls = msg.find_elements("css selector", ".tool-call")
    assert len(calls) == 1 and "get_weather" in calls[0].text and "Paris" in calls[0].text, msg.text
    assert "<tool_call>" not in msg.text and not answer.text.strip()
    page.fill("#chat-tools", "")


def test_image_reaches_the_vision_model(page: Page, chat_daemon: Daemon, tmp_path: Path) -> None:
    picture = tmp_path / "picture.png"
    picture.write_bytes(image_bytes(0))
    new_chat(page, chat_daemon, "vis:latest")
    page.css("#chat-image").send_keys(str(picture))
    page.wait(lambda: page.all("#chat-images img"), what="the image is attached")
    # a second one dropped onto the message box, and a third pasted into it (then removed again)
    for kind in ("drop", "paste"):
        page.js(
            "const bytes = Uint8Array.from(atob(arguments[0]), c => c.charCodeAt(0));"
            "const dt = new DataTransfer();"
            "dt.items.add(new File([bytes], arguments[1] + '.png', {type: 'image/png'}));"
            "const input = document.querySelector('#chat-input');"
            "input.dispatchEvent(arguments[1] === 'drop'"
            "  ? new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true})"
            "  : new ClipboardEvent('paste', {clipboardData: dt, bubbles: true, cancelable: true}));",
            base64.b64encode(image_bytes(1 if kind == "drop" else 2)).decode(),
            kind,
        )
    page.wait(lambda: len(page.all("#chat-images img")) == 3, what="three images are attached")
    page.all("#chat-images button")[-1].click()
    page.wait(lambda: len(page.all("#chat-images img")) == 2, what="one image is removed")
    answer = send(page, "Describe this picture.")
    wait_done(page, answer)
    assert not page.all("#messages .msg.assistant .msg-error"), answer.text
    # the daemon's log line for that request: its prompt carried the two images' tags, and 64 embeddings for each
    lines = [ln for ln in chat_daemon.log.read_text().splitlines() if "model=vis:latest" in ln and "prompt=" in ln]
    assert lines, chat_daemon.log.read_text()[-3000:]
    assert "[img-0]" in lines[-1] and "[img-1]" in lines[-1] and "[img-2]" not in lines[-1], lines[-1]
    (count,) = re.findall(r"prompt_eval_count=(\d+)", lines[-1])
    assert int(count) > 2 * 64, lines[-1]
    # and the conversation shows the picture sent (a data: URL: the user's own image, nothing remote)
    shown = [i.get_attribute("src") for i in page.all("#messages .msg.user img")]
    assert shown and shown[-1].startswith("data:image/"), page.css("#messages .msg.user").get_attribute("outerHTML")


def test_hostile_output_runs_and_loads_nothing(page: Page, chat_daemon: Daemon, remote: CountingServer) -> None:
    page.console()  # forget what came before
    new_chat(page, chat_daemon, "hostile:latest")
    answer = send(page, "Say something.")
    wait_done(page, answer)
    text = answer.text
    assert "Here is" in text and "done" in text  # the reply is there...
    assert "window.__pwned" in page.js("return document.querySelector('#messages').textContent")  # ...as text
    time.sleep(1.0)  # anything that was going to load has had time to try
    assert_inert(page, remote, "#messages")
    page.driver.refresh()  # and the conversation drawn again from localStorage
    page.wait_ready()
    assert_inert(page, remote, "#messages")
    assert f"{remote.url}/link" in [a.get_attribute("href") for a in page.all("#messages a[href]")]  # Markdown works
    refused = [e for e in page.console() if "Content Security Policy" in e.get("message", "")]
    assert refused == []  # the sanitiser let nothing through for the CSP to refuse
    assert page.alert_text() is None


def test_running_view_lists_what_is_loaded(page: Page, chat_daemon: Daemon) -> None:
    loaded = sorted(m["name"] for m in ps(chat_daemon))
    assert loaded  # the chats above loaded models
    page.open(chat_daemon, "running")
    page.wait(lambda: len(page.all("#running-table tr[data-model]")) == len(loaded), what="the running rows")
    shown = sorted(r.get_attribute("data-model") for r in page.all("#running-table tr[data-model]"))
    assert shown == loaded
    assert page.all("#running-table .ram-bar")
    assert page.css("#hardware").text.strip()
    page.screenshot("running.png")
    # Unload now: the model leaves /api/ps and the table
    gone = loaded[0]
    page.click(f'#running-table button.unload[data-model="{gone}"]')
    page.wait(lambda: gone not in [m["name"] for m in ps(chat_daemon)], what=f"{gone} is unloaded")
    page.wait(lambda: not page.all(f'#running-table tr[data-model="{gone}"]'), what=f"{gone}'s row goes")
