"""The immutable ``Model`` (weight views, geometry, layer modules) and the
per-sequence ``State`` (one cache per layer, the next position).

``forward(state, ids)`` is the single entry every caller uses: it embeds the new
tokens, runs every block (each appends the tokens to its cache exactly once) and
returns the pre-final-norm hidden rows; ``model.final_norm`` and ``model.lm_head``
turn any of them into logits. Decode is n = 1, a speculative verify is n = K+1,
prefill is a chunk; the kernels pick their strategy from n.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from formats.arch import ArchConfig
from formats.errors import CortiqError
from cortiq_engine.layers import RMSNorm, Step
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


def forward(state: State, ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Run new tokens through the model; returns their pre-norm hidden rows [n, hidden]."""
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
    for block, cache in zip(model.blocks, state.caches):
        block(x, cache, step)
    state.position += n
    state.forwarded += n
    return x
