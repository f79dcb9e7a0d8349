"""A least-recently-used cache bounded by bytes, for parsed templates (Go: :data:`daemon.templates.prompt.GO_CACHE`;
Jinja: :data:`daemon.templates.jinja.JINJA_CACHE`): a request may bring its own template, so the caches are bounded
by what the entries take, not by how many there are."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class ByteBoundedCache(Generic[K, V]):
    """A least-recently-used cache bounded by the total size of its entries in bytes (``size_of(key, value)``,
    an estimate), not by their count: an entry larger than the whole bound is built and returned but not kept.
    Thread-safe; values are built one at a time, so concurrent misses cannot multiply the memory building takes."""

    def __init__(self, max_bytes: int, size_of: Callable[[K, V], int]) -> None:
        self.max_bytes, self.size_of = max_bytes, size_of
        self.size = 0
        self._entries: collections.OrderedDict[K, tuple[V, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._make_lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def _lookup(self, key: K) -> tuple[bool, V | None]:
        with self._lock:
            hit = self._entries.get(key)
            if hit is None:
                return False, None
            self._entries.move_to_end(key)
            return True, hit[0]

    def get(self, key: K, make: Callable[[K], V]) -> V:
        """The cached value for ``key``, made with ``make(key)`` on a miss (exceptions pass through, uncached)."""
        found, value = self._lookup(key)
        if found:
            return value  # type: ignore[return-value]
        with self._make_lock:
            found, value = self._lookup(key)
            if found:
                return value  # type: ignore[return-value]
            made = make(key)
        size = self.size_of(key, made)
        if size > self.max_bytes:
            return made
        with self._lock:
            if key not in self._entries:
                self._entries[key] = (made, size)
                self.size += size
            while self.size > self.max_bytes:
                _, (_, old) = self._entries.popitem(last=False)
                self.size -= old
        return made

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.size = 0
