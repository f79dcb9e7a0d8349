"""``cogito``: Deep Cogito's models, DeepSeek-shaped (``</think>`` closing thinking the prompt opened, calls as
``function<｜tool▁sep｜>NAME`` and a fenced JSON block); they do not think when tools are offered, and the tool outputs
they echo between ``<｜tool▁outputs▁begin｜>`` and ``<｜tool▁outputs▁end｜>`` are dropped."""

from __future__ import annotations

from daemon.chat.parsers.base import register
from daemon.chat.parsers.deepseek import DeepSeekParser


@register("cogito")
class CogitoParser(DeepSeekParser):
    def __init__(self) -> None:
        super().__init__(thinking=True, drop_outputs=True, think_with_tools=False)
