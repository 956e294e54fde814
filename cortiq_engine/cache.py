"""Per-layer caches. A layer's ``make_cache(capacity)`` says which one it needs.

``KVCache`` is preallocated once at its full capacity (the context length):
keys [kv_heads, capacity, head_dim] and values [kv_heads, capacity, v_head_dim],
so each head's rows are contiguous for the attention kernels. ``np.zeros`` maps
untouched pages lazily, so a long context costs memory only as it fills.

Its element type is the engine's ``kv_cache`` (``KV_DTYPES``): f32 by default, or f16
(half the memory, and half the bytes a long-context decode step streams; llama.cpp's
default). A row is rounded to f16 once, as it enters the cache, and every later read of
it sees the same bits, so a speculative verify still equals plain decoding.
"""

from __future__ import annotations

import numpy as np

from formats.errors import CortiqError


KV_DTYPES = {"f32": np.float32, "f16": np.float16}
F16_MAX = float(np.finfo(np.float16).max)


def kv_dtype(name: str) -> type:
    """The numpy type of a ``--kv-cache`` name; an unknown name is a one-line error."""
    if name not in KV_DTYPES:
        raise CortiqError(f"unknown --kv-cache {name!r}; choose one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def check_f16_peak(peak: float) -> None:
    """Refuse rows whose largest |value| an f16 cache would store as inf."""
    if peak > F16_MAX:
        raise CortiqError(f"a key or value of {peak:.3g} exceeds f16's range ({F16_MAX:g}); use --kv-cache f32")


class KVCache:
    def __init__(self, kv_heads: int, head_dim: int, v_head_dim: int, capacity: int, dtype: type = np.float32):
        self.capacity = int(capacity)
        self.keys = np.zeros((kv_heads, self.capacity, head_dim), dtype)
        self.values = np.zeros((kv_heads, self.capacity, v_head_dim), dtype)
        self.length = 0
        # Rows written since creation: every token must enter the cache exactly
        # once, and tests check this counter against the tokens forwarded.
        self.writes = 0

    def free(self) -> int:
        return self.capacity - self.length

    def check_room(self, n: int, *rows: np.ndarray) -> None:
        """Refuse ``n`` new rows the capacity cannot hold, or whose values (``rows``) an
        f16 cache would store as inf: refused rather than silently wrong."""
        if self.length + n > self.capacity:
            raise CortiqError(f"context full: {self.length} + {n} tokens exceed the KV cache of {self.capacity}")
        if self.keys.dtype == np.float16 and n and rows:
            check_f16_peak(max(np.abs(r).max() for r in rows))

    def append(self, k: np.ndarray, v: np.ndarray) -> int:
        """Store n new rows (k [n, kv_heads, d], v [n, kv_heads, dv]); returns their first row."""
        n, start = k.shape[0], self.length
        self.check_room(n, k, v)
        self.keys[:, start : start + n] = k.transpose(1, 0, 2)
        self.values[:, start : start + n] = v.transpose(1, 0, 2)
        return self.claim(n)

    def claim(self, n: int) -> int:
        """Count n rows as written at the end (by ``append``, or by a fused step that
        wrote them itself after ``check_room``); returns their first row."""
        start = self.length
        self.length += n
        self.writes += n
        return start

    def can_truncate(self, n: int) -> bool:
        """A KV cache rolls back to any of its rows."""
        return 0 <= n <= self.length

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
