"""Gated DeltaNet linear attention (the linear layers of Qwen3-Next and Qwen3.5).

Per layer and position t (heads of width dk / dv; each key head serves
``num_value_heads / num_key_heads`` consecutive value heads):

    q, k, v  = silu(causal_conv1d([q|k|v] projections))   depthwise, kernel K
    q, k     = l2norm(q) / sqrt(dk), l2norm(k)
    g_t      = -exp(A_log) * softplus(a_t + dt_bias)        beta_t = sigmoid(b_t)
    S        = S * exp(g_t)                                  S: [dk, dv] per value head
    S       += k_t (beta_t (v_t - k_t^T S))^T                the delta rule
    o_t      = q_t^T S
    out      = out_proj(rmsnorm(o) * w * silu(z))

as transformers' ``torch_recurrent_gated_delta_rule`` computes it. The recurrence
is the kernel set's ``delta_rule`` (``kernels/reference.py`` in numpy, its compiled
twin in ``kernels/jit.py``). Prefill runs the projections batched and the recurrence
sequentially, position by position, so a batch gives the numbers one-at-a-time
decoding gives.

``LinearAttnCache`` holds the conv window (the last K-1 conv inputs) and the
recurrent state. For speculative rollback it keeps the inputs of the last forward
call (when it was short, as a verify is) and the state before it; ``truncate(n)``
to any length inside that call replays the kept positions from there, which is
exactly the state of never having run the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from formats.arch import LinearAttnConfig
from formats.errors import CortiqError
from cortiq_engine.layers import Step
from cortiq_engine.weights import Weight

# Longest forward call kept for rollback: verifies are a few rows; prefill chunks
# are not rolled back and would cost memory for nothing.
ROLLBACK_ROWS = 64
L2_EPS = 1e-6


# ------------------------------------------------------------------ reference operators
def causal_conv1d(x: np.ndarray, window: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv + SiLU. x [n, C] new inputs; window [K-1, C] the inputs
    before them; w [C, K]. Returns (y [n, C], the new window [K-1, C])."""
    n = x.shape[0]
    kern = w.shape[1]
    full = np.concatenate([window, x], axis=0)  # [K-1+n, C]
    y = np.zeros_like(x)
    for j in range(kern):  # a fixed order: each row's sum is the same whatever n is
        y += full[j : j + n] * w[:, j]
    y = y / (np.float32(1.0) + np.exp(-y))
    new_window = np.ascontiguousarray(full[n:]) if kern > 1 else window
    return y.astype(np.float32), new_window


def l2norm(x: np.ndarray, eps: float = L2_EPS) -> np.ndarray:
    return (x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))).astype(np.float32)


def gated_rms_norm(o: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm(o) * w * silu(z) over the last axis (the norm before the gate)."""
    var = np.mean(o * o, axis=-1, keepdims=True)
    y = o / np.sqrt(var + np.float32(eps)) * w
    return (y * (z / (np.float32(1.0) + np.exp(-z)))).astype(np.float32)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(np.float32(0.0), x).astype(np.float32)


# ------------------------------------------------------------------ the cache
@dataclass
class _LastCall:
    """What ``truncate`` needs to replay a prefix of the last forward call."""

    start: int
    window: np.ndarray
    state: np.ndarray
    conv_in: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: np.ndarray


class LinearAttnCache:
    """Conv window + recurrent state of one linear layer, with ``truncate`` rollback."""

    def __init__(self, conv_dim: int, kernel: int, heads: int, dk: int, dv: int, capacity: int, rule):
        self.capacity = int(capacity)
        # The replay on truncate must run the very code the forward ran (the layer's
        # kernel set's ``delta_rule``), to be exact.
        self.rule = rule
        self.window = np.zeros((kernel - 1, conv_dim), np.float32)
        self.state = np.zeros((heads, dk, dv), np.float32)
        self.length = 0
        self.writes = 0
        self._last: _LastCall | None = None

    def free(self) -> int:
        return self.capacity - self.length

    def advance(self, window: np.ndarray, state: np.ndarray, call: _LastCall) -> None:
        """Commit a forward call of ``call.conv_in.shape[0]`` positions."""
        n = call.conv_in.shape[0]
        if self.length + n > self.capacity:
            raise CortiqError(f"context full: {self.length} + {n} tokens exceed the cache of {self.capacity}")
        self.window, self.state = window, state
        self._last = call if n <= ROLLBACK_ROWS else None
        self.length += n
        self.writes += n

    def can_truncate(self, n: int) -> bool:
        """Whether ``truncate(n)`` can roll the state back (inside the last forward call)."""
        return n == self.length or (self._last is not None and self._last.start <= n <= self.length)

    def truncate(self, n: int) -> None:
        """Roll back to the state after the first ``n`` positions; ``n`` must lie inside
        the last forward call (a speculative verify)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) outside 0..{self.length}")
        if n == self.length:
            return
        last = self._last
        if last is None or n < last.start:
            raise CortiqError(
                f"linear-attention state cannot roll back to {n}: only positions of the last "
                f"forward call (from {last.start if last else self.length}, at most {ROLLBACK_ROWS} rows) can be undone"
            )
        m = n - last.start
        kern = self.window.shape[0] + 1
        full = np.concatenate([last.window, last.conv_in[:m]], axis=0)
        self.window = np.ascontiguousarray(full[full.shape[0] - (kern - 1) :]) if kern > 1 else last.window
        _, self.state = self.rule(last.q[:m], last.k[:m], last.v[:m], last.g[:m], last.beta[:m], last.state)
        self._last = _LastCall(
            last.start,
            last.window,
            last.state,
            last.conv_in[:m],
            last.q[:m],
            last.k[:m],
            last.v[:m],
            last.g[:m],
            last.beta[:m],
        )
        self.length = n

    def keep_last(self, n: int) -> None:
        """Context eviction: the recurrent state summarizes all history and is kept;
        only the length follows the attention caches. Rollback past this is gone."""
        self.length = min(int(n), self.length)
        self._last = None


# ------------------------------------------------------------------ the layer
@dataclass(frozen=True, eq=False)
class LinearAttnWeights:
    in_proj: tuple[Weight, ...]  # (qkvz, ba) fused, or (qkv, z, b, a) split
    conv: np.ndarray  # [conv_dim, K] f32
    A_log: np.ndarray  # [hv]
    dt_bias: np.ndarray  # [hv]
    norm: np.ndarray  # [dv] (the gated norm scales by w, not 1 + w)
    out_proj: Weight


class GatedDeltaNet:
    """The linear-attention token mixer; same call signature as ``layers.Attention``."""

    def __init__(self, kernels, la: LinearAttnConfig, w: LinearAttnWeights, norm_eps: float):
        self.ks = kernels
        self.la = la
        self.w = w
        self.eps = float(norm_eps)
        self.hk, self.hv = la.num_key_heads, la.num_value_heads
        self.dk, self.dv = la.key_head_dim, la.value_head_dim
        self.kd, self.vd = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.kd + self.vd
        self._A = (-np.exp(w.A_log.astype(np.float32))).astype(np.float32)

    def make_cache(self, capacity: int, kv: str = "f32") -> LinearAttnCache:
        # ``kv``: a KV cache's element type; the recurrent state stays f32 (it accumulates)
        return LinearAttnCache(
            self.conv_dim, self.la.conv_kernel, self.hv, self.dk, self.dv, capacity, self.ks.delta_rule
        )

    def weights(self) -> list[Weight]:
        return [*self.w.in_proj, self.w.out_proj]

    def _split(self, proj: np.ndarray, n: int):
        """Projections -> (conv inputs [n, conv_dim], z [n, hv, dv], b [n, hv], a [n, hv])."""
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        if self.la.fused_projection:
            r = hv // hk
            width = 2 * dk + 2 * r * dv
            qkvz = proj[:, : hk * width].reshape(n, hk, width)
            ba = proj[:, hk * width :].reshape(n, hk, 2 * r)
            q = qkvz[:, :, :dk].reshape(n, self.kd)
            k = qkvz[:, :, dk : 2 * dk].reshape(n, self.kd)
            v = qkvz[:, :, 2 * dk : 2 * dk + r * dv].reshape(n, self.vd)
            z = qkvz[:, :, 2 * dk + r * dv :].reshape(n, hv, dv)
            b, a = ba[:, :, :r].reshape(n, hv), ba[:, :, r:].reshape(n, hv)
            return np.concatenate([q, k, v], axis=1), z, b, a
        c = self.conv_dim
        mixed = np.ascontiguousarray(proj[:, :c])
        z = proj[:, c : c + self.vd].reshape(n, hv, dv)
        b = proj[:, c + self.vd : c + self.vd + hv]
        a = proj[:, c + self.vd + hv :]
        return mixed, z, b, a

    def __call__(self, x: np.ndarray, cache: LinearAttnCache, step: Step) -> np.ndarray:
        ks, n = self.ks, x.shape[0]
        mixed, z, b, a = self._split(ks.matmul(self.w.in_proj, x), n)
        y, window = causal_conv1d(mixed, cache.window, self.w.conv)
        q = l2norm(y[:, : self.kd].reshape(n, self.hk, self.dk)) * np.float32(self.dk**-0.5)
        k = l2norm(y[:, self.kd : 2 * self.kd].reshape(n, self.hk, self.dk))
        v = np.ascontiguousarray(y[:, 2 * self.kd :].reshape(n, self.hv, self.dv))
        beta = (np.float32(1.0) / (np.float32(1.0) + np.exp(-b))).astype(np.float32)
        g = (self._A * softplus(a + self.w.dt_bias)).astype(np.float32)
        o, state = ks.delta_rule(q, k, v, g, beta, cache.state)
        cache.advance(window, state, _LastCall(cache.length, cache.window, cache.state, mixed, q, k, v, g, beta))
        o = gated_rms_norm(o, np.ascontiguousarray(z), self.w.norm, self.eps)
        return ks.matmul((self.w.out_proj,), o.reshape(n, self.vd))
