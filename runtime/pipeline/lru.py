"""A bounded per-run cache whose entries are taken out while in use."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class TakeOut(Generic[K, V]):
    """:meth:`take` removes the entry it returns, :meth:`put` puts one (back): two tasks of
    the same run on one process never share an entry. Least recently put goes first when
    more than ``capacity`` are held; ``capacity`` 0 holds nothing. Thread-safe."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: K) -> V | None:
        with self._lock:
            return self._entries.pop(key, None)

    def put(self, key: K, value: V) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._entries[key] = value
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
