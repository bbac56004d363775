"""The reference model of `detdata.datasets.rowgroups.GroupSlots`: a plain LRU of decoded row
groups bounded by count and by bytes. Tests drive both with the same requests and
require the same evictions (an independent reference, kept out of the package)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from detdata.datasets.rowgroups import Group


class RowGroupCache:
    """LRU of decoded row groups bounded by count and by bytes (the reference contract
    that `GroupSlots`, the cache `TableRows` uses, follows).

    ``put`` evicts least recently used groups until both ``len(self) <=
    max_groups`` and ``self.nbytes <= max_bytes``; a single group larger than
    ``max_bytes`` is not cached at all. ``max_groups == 0`` disables caching.
    """

    def __init__(self, max_groups: int, max_bytes: int) -> None:
        self.max_groups = max_groups
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[tuple[int, int], Group] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[tuple[int, int]]:
        """Cached (shard, group) keys, least recently used first."""
        with self._lock:
            return list(self._items)

    def get(self, key: tuple[int, int]) -> Group | None:
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
            return item

    def put(self, key: tuple[int, int], item: Group) -> None:
        if self.max_groups == 0 or item.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.nbytes -= old.nbytes
            self._items[key] = item
            self.nbytes += item.nbytes
            while len(self._items) > self.max_groups or self.nbytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.nbytes -= evicted.nbytes
