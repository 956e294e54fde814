"""The immutable ``Model`` (weight views, geometry, layer modules) and the
per-sequence ``State`` (one cache per layer, the next position).

``forward(state, ids)`` is the single entry every caller uses: it embeds the new
tokens, runs every block (each appends the tokens to its cache exactly once) and
returns the pre-final-norm hidden rows; ``model.final_norm`` and ``model.lm_head``
turn any of them into logits. Decode is n = 1, a speculative verify is n = K+1,
prefill is a chunk; the kernels pick their strategy from n.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from formats.arch import ArchConfig
from formats.errors import CortiqError
from cortiq_engine.cache import check_f16_peak
from cortiq_engine.kernels import fused as fused_kernels
from cortiq_engine.layers import Attention, Block, GatedMLP, RMSNorm, SandwichBlock, Step
from cortiq_engine.weights import Weight


@dataclass(frozen=True, eq=False)
class Model:
    arch: ArchConfig
    kernels: Any
    embed: Weight
    blocks: tuple[Any, ...]
    norm: RMSNorm
    head: Weight
    kv_cache: str = "f32"  # the KV caches' element type (cache.KV_DTYPES)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden); Granite: embedding_multiplier)
    logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap) (Gemma 2/3); 0 = none
    logit_divisor: float = 1.0  # logits / this (Granite's logits_scaling)

    @property
    def vocab_size(self) -> int:
        return self.head.rows

    @property
    def hidden_size(self) -> int:
        return self.arch.hidden_size

    def embed_ids(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        x = self.embed.rows_f32(np.asarray(ids, dtype=np.int64))
        if self.embed_scale != 1.0:
            x *= np.float32(self.embed_scale)  # transformers casts the scale to the weights' dtype (f32)
        return x

    def final_norm(self, h: np.ndarray) -> np.ndarray:
        return self.norm(np.ascontiguousarray(h, dtype=np.float32))

    def lm_head(self, h: np.ndarray) -> np.ndarray:
        """Normed hidden rows [n, hidden] -> logits [n, vocab] (f32)."""
        logits = self.kernels.matmul((self.head,), np.ascontiguousarray(h, dtype=np.float32))
        if self.logit_divisor != 1.0:
            logits /= np.float32(self.logit_divisor)
        if self.logit_softcap:
            cap = np.float32(self.logit_softcap)
            logits /= cap
            np.tanh(logits, out=logits)
            logits *= cap
        return logits

    @functools.cached_property
    def fused(self) -> fused_kernels.FusedStack | None:
        """The stack as one compiled decode/verify call, when its blocks and kernels are
        ones ``kernels/fused.py`` computes (``fused_stack``); None: layer by layer."""
        return fused_stack(self)

    def new_state(self, capacity: int) -> "State":
        return State(self, [b.make_cache(capacity, self.kv_cache) for b in self.blocks], capacity)

    def weights(self) -> list[Weight]:
        out = [self.embed, self.head]
        for b in self.blocks:
            out.extend(b.weights())
        return out


@dataclass(eq=False)
class State:
    """One sequence in flight: its caches and the absolute position of the next token.

    ``position`` equals ``length`` until an eviction drops old rows; positions keep
    increasing after that (keys keep their rotary phase), so ``position >= length``.
    """

    model: Model
    caches: list[Any]
    capacity: int
    position: int = 0
    forwarded: int = field(default=0)  # tokens passed through forward(), all calls
    # MoE models: how often each expert was chosen, per layer, over every forwarded position.
    expert_usage: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.caches[0].length if self.caches else 0

    def free(self) -> int:
        return self.capacity - self.length

    def can_truncate(self, n: int) -> bool:
        """Whether every cache can roll back to ``n`` rows (a recurrent state only inside
        its last forward call; a KV cache always)."""
        return all(c.can_truncate(n) for c in self.caches)

    def truncate(self, n: int) -> None:
        """Roll every cache back to its first ``n`` rows (speculative rollback)."""
        drop = self.length - n
        for c in self.caches:
            c.truncate(n)
        self.position -= drop

    def evict(self, keep: int) -> None:
        """Keep only the newest ``keep`` rows in every cache; positions continue."""
        for c in self.caches:
            c.keep_last(keep)


def fused_stack(model: Model) -> fused_kernels.FusedStack | None:
    """``model``'s blocks packed for ``fused_kernels.fused_step``, or None when a block is
    not one it computes or a matmul is not one integer-kernel call."""
    ks = model.kernels
    if model.kv_cache not in ("f32", "f16") or getattr(ks, "int_plans", None) is None or not model.blocks:
        return None
    plans, norms, eps, qk, qk_eps, windows, ropes, rope_of, geo = [], [], [], [], [], [], [], [], set()
    for b in model.blocks:
        if type(b) is Block and b.residual_scale == 1.0:
            ns = (b.attn_norm, b.mlp_norm)
        elif type(b) is SandwichBlock and b.pre_attn is not None and b.pre_ffn is not None:
            ns = (b.pre_attn, b.post_attn, b.pre_ffn, b.post_ffn)
        else:
            return None
        a, m = b.attn, b.mlp
        if type(a) is not Attention or type(m) is not GatedMLP or any(type(n) is not RMSNorm for n in ns):
            return None
        w = a.w
        if (
            w.qkv_bias is not None
            or w.o_bias is not None
            or a.qk_norm_full
            or a.output_gate
            or a.v_scale != 1.0
            or a.rope is None
            or a.call.sinks is not None
            or a.call.softcap
            or a.hd != a.vd
        ):
            return None
        layer = [ks.int_plans(ws) for ws in (*a.projections, *m.projections)]
        if any(p is None for p in layer):
            return None
        plans.append(layer)
        norms.append([n.weight for n in ns])
        eps.append([n.eps for n in ns])
        if w.q_norm is not None:
            qk.append((w.q_norm, w.k_norm))
            qk_eps.append(a.eps)
        windows.append(a.call.window)
        if all(r is not a.rope for r in ropes):
            ropes.append(a.rope)
        rope_of.append(next(i for i, r in enumerate(ropes) if r is a.rope))
        geo.add((a.nh, a.nkv, a.hd, a.call.scale, len(ns), m.gelu, a.rope.rotary_dim))
    if len(geo) != 1 or len(qk) not in (0, len(plans)):
        return None
    nh, nkv, hd, scale, _, gelu, _ = geo.pop()
    fns = ks.attention_loops(hd, hd, model.kv_cache)
    if model.kv_cache == "f16" and not fns[0]:
        return None  # only the IR loops read an f16 cache
    L = len(plans)
    P = max(len(calls) for layer in plans for calls in layer)

    def table(field: str, dtype) -> np.ndarray:
        """[L, 4, P, ...] of a plan field; the calls past a matmul's own repeat its last (never run)."""
        return np.ascontiguousarray(
            [[[getattr(c[min(p, len(c) - 1)], field) for p in range(P)] for c in layer] for layer in plans], dtype
        )

    return fused_kernels.FusedStack(
        fn=table("fn", np.int64),
        addrs=table("addrs", np.int64),
        rows=table("rows", np.int64),
        count=table("count", np.int64),
        offs=table("offs", np.int64),
        qmax=table("qmax", np.int64),
        zmm=table("zmm", np.bool_),
        bits=table("bits", np.int64),
        pwidths=table("width", np.int64),
        nplans=np.array([[len(c) for c in layer] for layer in plans], np.int64),
        widths=np.array([[sum(p.width for p in c) for c in layer] for layer in plans], np.int64),
        norms=np.ascontiguousarray(norms, np.float32),
        eps=np.array(eps, np.float32),
        qk_norms=np.ascontiguousarray(qk, np.float32) if qk else np.zeros((L, 0, 0), np.float32),
        qk_eps=np.array(qk_eps if qk else [0.0] * L, np.float32),
        gelu=bool(gelu),
        windows=np.array(windows, np.int64),
        rope_of=np.array(rope_of, np.int64),
        ropes=tuple(ropes),
        heads=(nh, nkv, hd),
        scale=scale,
        fns=fns,
        keep=tuple(plans),
    )


def forward(state: State, ids: Sequence[int] | np.ndarray, layerwise: bool = False) -> np.ndarray:
    """Run new tokens through the model; returns their pre-norm hidden rows [n, hidden].
    ``layerwise``: block by block even where the fused step would run (the same bits)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    n = int(ids.shape[0])
    if n == 0:
        return np.zeros((0, state.model.hidden_size), np.float32)
    if n > state.free():
        raise CortiqError(f"context full: {state.length} + {n} tokens exceed the context of {state.capacity}")
    model = state.model
    x = model.embed_ids(ids)
    step = Step(
        np.arange(state.position, state.position + n, dtype=np.int64),
        expert_usage=state.expert_usage,
        context=state.capacity,
    )
    # The fused step takes the rows the kernels compute one by one (decode, a verify), over
    # KV caches of one length (a forward cut short leaves them apart: block by block then).
    fused = None if layerwise else model.fused
    caches = state.caches
    if fused is not None and n <= model.kernels.row_exact_rows and all(c.length == caches[0].length for c in caches):
        start = caches[0].length
        caches[0].check_room(n)
        peak = fused_kernels.run(fused, x, caches, start, [step.rope_tables(r) for r in fused.ropes])
        check_f16_peak(peak)  # rows past f16's range: refused before any cache counts them
        for c in caches:
            c.claim(n)
    else:
        for block, cache in zip(model.blocks, caches):
            block(x, cache, step)
    state.position += n
    state.forwarded += n
    return x
