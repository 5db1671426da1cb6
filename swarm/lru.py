"""A bounded mapping that forgets its least recently used entries first.

For caches of what costs public-key work (pairwise keys, agreement secrets, verified key
bindings): keys come from other peers, so a flood of fresh ones must only evict, never grow the
cache, while the peers in use stay in it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``size`` entries; a hit or a put makes an entry the most recent (a membership
    test does not). Values are never None: :meth:`get` answers None for a missing key. Safe to
    share between threads."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> None:
        if value is None:
            raise ValueError("an LRU holds no None values")
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)
