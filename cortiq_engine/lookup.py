"""Drafts looked up in the sequence itself (n-gram "prompt lookup" decoding).

A model's output often repeats what it has already read or written: a summary
copies phrases of its passage, a small model loops on its own sentences, code
repeats identifiers. When the last n tokens occurred earlier in the sequence
(prompt and output alike), the tokens that followed them then are a draft that
costs no forward pass. This is the idea of prompt-lookup decoding (transformers'
``prompt_lookup_num_tokens``), llama.cpp's ``lookup`` example and vLLM's ``ngram``
speculator; the drafts go through the same row-exact verify as MTP drafts, so the
output is the plain greedy output token for token.

``LookupDrafter`` drafts from the sequence when it finds a match of at least
``ngram[0]`` tokens (the longest n up to ``ngram[1]`` first, the most recent
occurrence of it), and otherwise hands the round to the MTP drafter it wraps
(``mtp``), or proposes nothing (a plain step) when it wraps none. The MTP layers
skip the lookup rounds cheaply: their caches catch up on the rows they missed at
their next draft (``mtp.Drafter._catch_up``), every row entering a cache once.

Why three drafts by default (``DEFAULT_LOOKUP``): with the pending token a round
then verifies 4 rows, one pass of the 4-row kernels; 8 rows (7 drafts) cost about
4 decode steps on SmolLM2 and lost to 3 drafts (docs/performance.md).
Why a 3-token match at least: 2-token matches proposed 30 % more lookup rounds on
held-out prose whose drafts were accepted less (1.7 against 2.0 tokens a round).

Which source drafts a round is measured, not assumed (``decision``, a
``cortiq_engine.spec_decision.SpecDecision``): a round with a lookup match drafts by
lookup while lookup rounds emit tokens faster than plain steps on this machine; a
round without one (or whose lookup is switched off) goes to the MTP layers while
theirs do; otherwise it is a plain step. On SmolLM2's chat answers, for instance, the
MTP layers meet the rounds the lookup leaves them with 36 % acceptance, and a round of
their drafts costs more per token than a plain step (docs/performance.md). The decode
loop reports each round's tokens and time (``observe``); the rounds without any drafts
time plain decoding. Timing only chooses which tokens get verified: the output stays
plain greedy's. The MTP layers' caches catch up at their next draft on the rows of
the rounds they sat out, so a round after a long pause costs them more than usual.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from formats.errors import CortiqError
from formats.sidecar import MAX_LOOKUP_DRAFTS as MAX_LOOKUP, MAX_LOOKUP_NGRAM as MAX_NGRAM
from cortiq_engine.spec_decision import PLAIN, PROBE_EVERY, WINDOW, SpecDecision

if TYPE_CHECKING:
    from cortiq_engine.mtp import Drafter

DEFAULT_LOOKUP = 3
DEFAULT_NGRAM = (3, 5)
GATE_WINDOW = WINDOW  # rounds each choice's rate is measured over (spec_decision)
GATE_PROBE = PROBE_EVERY  # every GATE_PROBE-th round a source could take runs the other choice


class NgramIndex:
    """For each n in [lo, hi]: where the most recent occurrence of every n-gram of a
    growing sequence ended, built incrementally (each new token adds hi - lo + 1 keys).

    The index only ever appends; ``update`` starts over when handed a sequence shorter
    than the one it indexed (a new generation, a conversation's next turn). ``end``
    takes the prefix ids[:end] without copying it (the probe's rounds walk one text)."""

    def __init__(self, lo: int, hi: int):
        if not 1 <= lo <= hi <= MAX_NGRAM:
            raise CortiqError(f"lookup n-gram sizes {lo}..{hi}: need 1 <= min <= max <= {MAX_NGRAM}")
        self.lo, self.hi = lo, hi
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.done = 0

    def clear(self) -> None:
        for table in self.ends.values():
            table.clear()
        self.done = 0

    def update(self, ids: Sequence[int], end: int | None = None) -> None:
        """Index the n-grams of ids[:end] that end before its last token (each has a known
        continuation: the token at the position it ends at)."""
        n_ids = len(ids) if end is None else end
        if n_ids < self.done:
            self.clear()
        for j in range(max(self.done, self.lo), n_ids):
            for n, table in self.ends.items():
                if j >= n:
                    table[tuple(ids[j - n : j])] = j
        self.done = n_ids

    def continuation(self, ids: Sequence[int], k: int, end: int | None = None) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        suffix of ids[:end] found (n from hi down to lo); [] without a match. A match that
        runs into the end of the sequence continues with its own drafts (a loop of
        period p repeats every p tokens)."""
        n_ids = len(ids) if end is None else end
        self.update(ids, n_ids)
        for n in range(min(self.hi, n_ids - 1), self.lo - 1, -1):
            j = self.ends[n].get(tuple(ids[n_ids - n : n_ids]))
            if j is None:
                continue
            out: list[int] = []
            for i in range(k):
                p = j + i
                out.append(int(ids[p]) if p < n_ids else out[p - n_ids])
            return out
        return []


@dataclass
class LookupDrafter:
    """Draft source of a speculative generation (``generate.DraftSource``): lookup
    first, then the wrapped MTP drafter (or nothing). ``lookup``: drafts per lookup
    round; ``ngram``: (min, max) match length. ``capacity`` is the MTP drafter's when
    there is one."""

    capacity: int
    lookup: int = DEFAULT_LOOKUP
    ngram: tuple[int, int] = DEFAULT_NGRAM
    mtp: Drafter | None = None
    gate: bool = True  # choose each round's source by its measured rate (``decision``); False: always draft
    decision: SpecDecision | None = None  # the measured choice (a fresh one unless given; None with gate off)
    last_source: str = field(init=False, default="")
    index: NgramIndex = field(init=False)
    _rows: int = field(init=False, default=0)  # positions noted (the MTP drafter's hist_len without one)

    def __post_init__(self) -> None:
        if not 1 <= self.lookup <= MAX_LOOKUP:
            raise CortiqError(f"lookup drafts must be in 1..{MAX_LOOKUP}, got {self.lookup}")
        self.index = NgramIndex(int(self.ngram[0]), int(self.ngram[1]))
        self.decision = (self.decision or SpecDecision()) if self.gate else None
        if self.mtp is not None:
            self.capacity = self.mtp.capacity

    @property
    def depth(self) -> int:
        return max(self.lookup, self.mtp.depth if self.mtp is not None else 0)

    @property
    def hist_len(self) -> int:
        return self.mtp.hist_len if self.mtp is not None else self._rows

    def reset(self) -> None:
        self.index.clear()
        self._rows = 0
        if self.decision is not None:
            self.decision.reset()  # a new sequence is judged on its own rounds
        if self.mtp is not None:
            self.mtp.reset()

    def keep(self, n: int) -> None:
        if n > self.hist_len:
            raise ValueError(f"keep({n}): the drafter holds {self.hist_len} positions")
        self.index.clear()
        self._rows = n
        if self.mtp is not None:
            self.mtp.keep(n)

    def note(self, first_pos: int, rows: np.ndarray) -> None:
        if self.mtp is not None:
            self.mtp.note(first_pos, rows)
        self._rows = first_pos + rows.shape[0]

    def draft(self, t: int, ids: Sequence[int], depth: int | None = None) -> list[int]:
        """Drafts for positions t+2, ... (``mtp.Drafter.draft``'s contract); ``last_source``
        says which source proposed them."""
        k = min(depth or self.depth, self.depth)
        # The teacher-forced probe passes the true text beyond t+1: the lookup must not see it.
        drafts = self.index.continuation(ids, min(k, self.lookup), end=t + 2)
        if drafts and self._allow("lookup"):
            self.last_source = "lookup"
            return drafts
        if self.mtp is None or not self._allow("mtp"):
            # A plain step: filed under "plain" beside the MTP rounds it stands in for; with
            # lookup alone a plain step is not a source's round (the totals hold it).
            self.last_source = PLAIN if self.mtp is not None and self.gate else ""
            return []
        self.last_source = "mtp"
        return self.mtp.draft(t, ids, min(k, self.mtp.depth))

    def _allow(self, name: str) -> bool:
        return self.decision is None or self.decision.allow(name)

    def observe(self, emitted: int, seconds: float) -> None:
        """The last round emitted ``emitted`` tokens in ``seconds`` (draft and verify)."""
        if self.decision is not None:
            self.decision.record(self.last_source or PLAIN, emitted, seconds)

    def describe(self) -> dict:
        """The settings a result reports (``extra["mtp"]``)."""
        base = (
            self.mtp.describe()
            if self.mtp is not None
            else {"source": "lookup", "chain": None, "hidden": None, "draft_vocab": None, "threshold": None}
        )
        return {
            **base,
            "lookup": self.lookup,
            "lookup_ngram": list(self.ngram),
            "mtp_gate": self.gate and self.mtp is not None,
        }
