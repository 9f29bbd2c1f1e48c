"""A bounded dictionary safe under threads: the launch cache's entries
(cunorm/_engine/launch_cache.py), the loaded kernels (loader.py), torch's wrapped streams
(_interop/torch.py)."""
from __future__ import annotations

import threading


class BoundedCache:
    """A dict of at most ``maxsize`` entries, the oldest dropped first.
    Reads take no lock (a dict read is atomic); writes do."""

    def __init__(self, maxsize: int):
        self.maxsize = maxsize
        self._entries: dict = {}
        self._lock = threading.Lock()
        self.get = self._entries.get

    def put(self, key, value) -> None:
        with self._lock:
            if key not in self._entries:
                while len(self._entries) >= self.maxsize:
                    del self._entries[next(iter(self._entries))]
            self._entries[key] = value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
