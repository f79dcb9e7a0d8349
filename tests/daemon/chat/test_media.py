"""Images numbered across a chat, swapped for the media marker in the final prompt, and checked on the way in."""

from __future__ import annotations

import base64

import pytest

from daemon.chat import media
from daemon.chat.types import Message
from errors import InvalidRequest

A, B = base64.b64encode(b"image A").decode(), base64.b64encode(b"image B").decode()


def test_images_are_numbered_across_the_chat_and_sent_in_marker_order() -> None:
    msgs = [
        Message(role="user", content="first", images=(A,)),
        Message(role="assistant", content="ok"),
        Message(role="user", content="compare [img] with this", images=(B, A)),
    ]
    tagged, images = media.number_images(msgs)
    assert [m.content for m in tagged][:2] == ["[img-0]first", "ok"]
    assert tagged[2].content == "[img-2]compare [img-1] with this"
    assert all(not m.images for m in tagged) and images == {0: A, 1: B, 2: A}
    # the oldest message dropped to fit the context: its image goes with it
    prompt, ordered = media.media_prompt("U: [img-2]compare [img-1] with this", images)
    assert prompt == f"U: {media.MEDIA_MARKER}compare {media.MEDIA_MARKER} with this" and ordered == (A, B)


def test_a_typed_marker_or_unknown_tag_is_not_an_image() -> None:
    prompt, ordered = media.media_prompt(f"say {media.MEDIA_MARKER} and [img-9] [img-0]", {0: A})
    assert prompt.count(media.MEDIA_MARKER) == 1 and "[img-9]" in prompt and ordered == (A,)
    assert media.media_prompt("no images [img-0]", {}) == ("no images [img-0]", ())


def test_bad_images_are_clear_400s() -> None:
    with pytest.raises(InvalidRequest, match="not valid base64"):
        media.decode_image("not base64!!", "images[0]")
    with pytest.raises(InvalidRequest, match="empty"):
        media.decode_image("", "images[0]")
    with pytest.raises(InvalidRequest, match="larger than 20 MB"):
        media.decode_image("A" * (media.MAX_IMAGE_BYTES * 2), "images[0]")
    with pytest.raises(InvalidRequest, match="base64 string"):
        media.decode_image(42, "images[0]")
    assert media.decode_image("data:image/png;base64," + A, "x") == b"image A"
