"""Per-layer caches. A layer's ``make_cache(capacity)`` says which one it needs.

``KVCache`` is preallocated once at its full capacity (the context length):
keys [kv_heads, capacity, head_dim] and values [kv_heads, capacity, v_head_dim],
so each head's rows are contiguous for the attention kernels. ``np.zeros`` maps
untouched pages lazily, so a long context costs memory only as it fills.
"""

from __future__ import annotations

import numpy as np

from formats.errors import CortiqError


class KVCache:
    def __init__(self, kv_heads: int, head_dim: int, v_head_dim: int, capacity: int):
        self.capacity = int(capacity)
        self.keys = np.zeros((kv_heads, self.capacity, head_dim), np.float32)
        self.values = np.zeros((kv_heads, self.capacity, v_head_dim), np.float32)
        self.length = 0
        # Rows written since creation: every token must enter the cache exactly
        # once, and tests check this counter against the tokens forwarded.
        self.writes = 0

    def free(self) -> int:
        return self.capacity - self.length

    def append(self, k: np.ndarray, v: np.ndarray) -> int:
        """Store n new rows (k [n, kv_heads, d], v [n, kv_heads, dv]); returns their first row."""
        n = k.shape[0]
        if self.length + n > self.capacity:
            raise CortiqError(f"context full: {self.length} + {n} tokens exceed the KV cache of {self.capacity}")
        start = self.length
        self.keys[:, start : start + n] = k.transpose(1, 0, 2)
        self.values[:, start : start + n] = v.transpose(1, 0, 2)
        self.length += n
        self.writes += n
        return start

    def truncate(self, n: int) -> None:
        """Roll back to the first ``n`` rows (a rejected speculative draft)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) outside 0..{self.length}")
        self.length = n

    def keep_last(self, n: int) -> None:
        """Drop all but the newest ``n`` rows (context eviction). Keys keep the
        rotary positions they were written with, so relative positions stay right."""
        n = min(n, self.length)
        if n < self.length:
            lo = self.length - n
            self.keys[:, :n] = self.keys[:, lo : self.length].copy()
            self.values[:, :n] = self.values[:, lo : self.length].copy()
        self.length = n
