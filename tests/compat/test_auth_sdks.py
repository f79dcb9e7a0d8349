"""API keys through the official SDKs: each sends its key its own way (OpenAI: Authorization: Bearer;
Anthropic: x-api-key); a wrong key is the SDK's AuthenticationError, the right one gets through (the SDKs refuse
to send an empty key; a missing key is tested with raw requests in tests/daemon/test_auth.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon

KEY = "corral-test-key-4f9a"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp: Path = tmp_path_factory.mktemp("keyed")
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_API_KEY": KEY})
    try:
        yield d
    finally:
        stop_daemon(d)


def test_openai_sdk_needs_the_key(keyed: Daemon) -> None:
    for wrong in ("not-the-key", KEY + "x"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key=wrong, max_retries=0).models.list()
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert list(good.models.list()) == []
    with pytest.raises(openai.NotFoundError):  # past the door: the model is what is missing
        good.chat.completions.create(model="absent", messages=[{"role": "user", "content": "x"}])


def test_anthropic_sdk_needs_the_key(keyed: Daemon) -> None:
    msg = {"model": "absent", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    for wrong in ("not-the-key", KEY + "x"):
        with pytest.raises(anthropic.AuthenticationError) as info:
            anthropic.Anthropic(base_url=keyed.url, api_key=wrong, max_retries=0).messages.create(**msg)  # type: ignore[arg-type]
        assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0).messages.create(**msg)  # type: ignore[arg-type]
    assert KEY not in keyed.log.read_text()  # the key never reaches the log
