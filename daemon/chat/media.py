"""Images in a chat, pure: each numbered once across the whole conversation, written into the text as ``[img-N]``
where the template puts the message (so dropping old messages to fit the context drops their images too), then,
in the final prompt, each tag swapped for the media marker the runner's projector looks for, with the images sent
in the order their markers appear."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from daemon.chat.types import Message
from daemon.templates import prompt as prompts
from errors import InvalidRequest

#: the marker libmtmd replaces with an image's embeddings (mtmd_default_marker(); the runner checks it is the same)
MEDIA_MARKER = "<__media__>"
#: the largest image accepted, decoded (a 24-megapixel JPEG is about 12 MB): larger ones get a 400 before decoding
MAX_IMAGE_BYTES = 20 * 1024 * 1024
_TAG = re.compile(r"\[img-(\d+)\]")


def decode_image(data: Any, where: str) -> bytes:
    """An image from the API (base64 text), checked: valid base64 and at most MAX_IMAGE_BYTES."""
    if isinstance(data, (bytes, bytearray)):
        raw = bytes(data)
    elif isinstance(data, str):
        text = data.strip()
        if text.startswith("data:") and "," in text:  # a data URL where plain base64 was expected
            text = text.split(",", 1)[1]
        if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 8:
            raise InvalidRequest(f"{where} is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB; send a smaller image")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(f"{where} is not valid base64: send the image file's bytes base64-encoded") from None
    else:
        raise InvalidRequest(f"{where} must be a base64 string")
    if not raw:
        raise InvalidRequest(f"{where} is empty")
    if len(raw) > MAX_IMAGE_BYTES:
        raise InvalidRequest(f"{where} is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MB; send a smaller image")
    return raw


def number_images(messages: Sequence[Message]) -> tuple[list[Message], dict[int, str]]:
    """The messages with their images written in as ``[img-N]`` tags (N across the whole chat) and the images
    (checked, base64) by N."""
    images: dict[int, str] = {}
    for i, m in enumerate(messages):
        for j, data in enumerate(m.images):
            raw = decode_image(data, f"messages[{i}].images[{j}]")
            images[len(images)] = base64.b64encode(raw).decode()
    if not images:
        return list(messages), images
    return [dataclasses.replace(m, images=()) for m in prompts.tag_images(messages)], images


def media_prompt(prompt: str, images: Mapping[int, str]) -> tuple[str, tuple[str, ...]]:
    """The prompt with each ``[img-N]`` of a known image swapped for the media marker, and the images in marker
    order. A marker the text already held (a user typing it) is defused, so the images and markers always match."""
    if not images:
        return prompt, ()
    ordered: list[str] = []
    safe = prompt.replace(MEDIA_MARKER, MEDIA_MARKER.replace("__", "_ _", 1))

    def swap(m: re.Match[str]) -> str:
        n = int(m.group(1))
        if n not in images:
            return m.group(0)
        ordered.append(images[n])
        return MEDIA_MARKER

    return _TAG.sub(swap, safe), tuple(ordered)
