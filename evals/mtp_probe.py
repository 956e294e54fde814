"""Teacher-forced MTP acceptance: what each draft depth would propose at every position
of a real text, given the true previous tokens, against the true next tokens.

For a round starting after position t (the backbone has seen ids[..t], the next
token ids[t+1] is known), depth d drafts the token for t+d+1. Reported per depth:

- *alone*: P(d_k == ids[t+k+1]);
- *chained*: P(d_1..d_k all right) — the rate at which a speculative round would
  accept at least k drafts if the backbone's greedy choice were the text;
- expected tokens per round = 1 + sum_k chained_k.

The drafts come from ``cortiq_engine.mtp.Drafter.draft``, the very path
speculative decoding calls; only the ids it reads go past the pending token. The
counts go into ``cortiq_engine.acceptance.Acceptance``, the counter speculative
decoding and the trainer report, so the figures compare one to one (draft time is
per round; a teacher-forced round has no verify).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from formats.errors import CortiqError
from cortiq_engine.acceptance import Acceptance


@dataclass(frozen=True)
class Variant:
    chain: str  # "independent" | "recursive"
    hidden: str  # "pre" | "post"

    @property
    def label(self) -> str:
        return f"{self.chain}/{self.hidden}"


def default_variants(num_layers: int, depth: int) -> list[Variant]:
    """Every meaningful chaining at this depth, with both hidden readings."""
    chains = []
    if depth <= num_layers:
        chains.append("independent")
    if depth > 1 or not chains:
        chains.append("recursive")
    return [Variant(c, h) for c in chains for h in ("pre", "post")]


def backbone_hiddens(model, ids: np.ndarray, chunk: int = 256) -> np.ndarray:
    """Pre-final-norm hidden rows of every position of a fresh sequence [len(ids), hidden]."""
    from cortiq_engine.model import forward

    state = model.new_state(len(ids))
    out = np.empty((len(ids), model.hidden_size), np.float32)
    for s in range(0, len(ids), chunk):
        out[s : s + chunk] = forward(state, ids[s : s + chunk])
    return out


def probe(
    model,
    stack,
    ids: Sequence[int],
    depth: int,
    variants: Sequence[Variant],
    progress: Callable[[int], None] | None = None,
) -> list[tuple[Variant, Acceptance]]:
    """Teacher-forced acceptance of each variant over ``ids`` (``progress(1)`` per position per variant)."""
    from cortiq_engine.mtp import make_drafter

    ids = np.asarray(ids, dtype=np.int64)
    T = len(ids)
    if depth < 1:
        raise CortiqError(f"MTP depth must be >= 1, got {depth}")
    if T < depth + 2:
        raise CortiqError(f"the text has {T} tokens; probing depth {depth} needs at least {depth + 2}")
    hidden = backbone_hiddens(model, ids)
    id_list = [int(i) for i in ids]
    results = []
    for v in variants:
        drafter = make_drafter(model, stack, T, depth=depth, chain=v.chain, hidden=v.hidden)
        drafter.note(0, hidden)
        counts = Acceptance(depth)
        # Round starts t whose every depth has a true token: t + depth + 1 <= T - 1.
        for t in range(T - depth - 1):
            t0 = time.perf_counter()
            drafts = drafter.draft(t, id_list, depth)
            counts.record_forced(drafts, id_list[t + 2 : t + 2 + depth], time.perf_counter() - t0)
            if progress is not None:
                progress(1)
        results.append((v, counts))
    return results
