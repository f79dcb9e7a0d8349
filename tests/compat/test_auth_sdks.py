"""API keys through the official SDKs, which send them as ``Authorization: Bearer`` or ``x-api-key`` depending on
the SDK and its version (the daemon takes either): a missing or wrong key is the SDK's AuthenticationError, the
right one gets through. The SDKs always send the key they were given, so a missing key is made by omitting their
auth headers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from tests.conftest import Daemon, start_daemon, stop_daemon

KEY = "corral-test-key-4f9a"


def no_key(omit: type) -> dict[str, object]:
    """Per-request headers that make an SDK send no key at all (each SDK has its own ``Omit``)."""
    return {"Authorization": omit(), "X-Api-Key": omit()}


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp: Path = tmp_path_factory.mktemp("keyed")
    d = start_daemon(tmp / "models", tmp / "daemon.log", {"CORRAL_API_KEY": KEY})
    try:
        yield d
    finally:
        stop_daemon(d)


def test_openai_sdk_needs_the_key(keyed: Daemon) -> None:
    keyless = openai.OpenAI(base_url=keyed.url + "/v1", api_key="unsent", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as missing:
        keyless.models.list(extra_headers=no_key(openai.Omit))
    assert "API key is required" in missing.value.message
    for wrong in ("not-the-key", KEY + "x"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key=wrong, max_retries=0).models.list()
    good = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert list(good.models.list()) == []
    with pytest.raises(openai.NotFoundError):  # past the door: the model is what is missing
        good.chat.completions.create(model="absent", messages=[{"role": "user", "content": "x"}])


def test_anthropic_sdk_needs_the_key(keyed: Daemon) -> None:
    msg = {"model": "absent", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    keyless = anthropic.Anthropic(base_url=keyed.url, api_key="unsent", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as missing:
        keyless.messages.create(**msg, extra_headers=no_key(anthropic.Omit))  # type: ignore[arg-type]
    assert "API key is required" in missing.value.message
    for wrong in ("not-the-key", KEY + "x"):
        with pytest.raises(anthropic.AuthenticationError) as info:
            anthropic.Anthropic(base_url=keyed.url, api_key=wrong, max_retries=0).messages.create(**msg)  # type: ignore[arg-type]
        assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=keyed.url, api_key=KEY, max_retries=0).messages.create(**msg)  # type: ignore[arg-type]
    with pytest.raises(anthropic.NotFoundError):  # the key in x-api-key alone, as Anthropic's own API takes it
        keyless.messages.create(**msg, extra_headers={"Authorization": anthropic.Omit(), "X-Api-Key": KEY})  # type: ignore[arg-type]
    assert KEY not in keyed.log.read_text()  # the key never reaches the log
