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
4 decode steps on SmolLM2 and lost to 3 drafts (docs/performance.md, tenth session).
Why a 3-token match at least: 2-token matches proposed 30 % more lookup rounds on
held-out prose whose drafts were accepted less (1.7 against 2.0 tokens a round).

The MTP gate (``gate``, off by default): once the lookup has taken the rounds where
the text repeats, the MTP layers meet the harder rest, and on some text (SmolLM2's
chat answers: 36 % acceptance) a round of MTP drafts costs more per token than a plain
step (docs/performance.md, tenth session). Rounds without a match therefore go to the
MTP layers or run plain, whichever emitted its tokens in fewer milliseconds over its
last ``GATE_WINDOW`` rounds (``observe``: the decode loop reports each round's tokens
and time); every ``GATE_PROBE``-th such round tries the other. Timing only chooses
which tokens get verified: the output stays plain greedy's. Off by default because
it lost on prose (1.24x against 1.46x ungated, SmolLM2, tenth session) and gained
nothing clear on chat (1.19x against 1.17x): 60-ish gated rounds per 128-token answer
are too few to time reliably on a machine whose step time wanders 7-12 ms, and a plain
round defers the MTP layers' catch-up to the next MTP round, which then looks dearer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from formats.errors import CortiqError
from formats.sidecar import MAX_LOOKUP_DRAFTS as MAX_LOOKUP, MAX_LOOKUP_NGRAM as MAX_NGRAM

if TYPE_CHECKING:
    from cortiq_engine.mtp import Drafter

DEFAULT_LOOKUP = 3
DEFAULT_NGRAM = (3, 5)
# The MTP gate: the last GATE_WINDOW rounds of each choice (MTP drafts, or a plain step)
# give its milliseconds per emitted token; every GATE_PROBE-th round without a lookup
# match takes the choice that is not ahead, so a change of the text or the machine is seen.
GATE_WINDOW = 16
GATE_PROBE = 8


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
    gate: bool = False  # choose per round between MTP drafts and a plain step by their measured cost
    last_source: str = field(init=False, default="")
    index: NgramIndex = field(init=False)
    _rows: int = field(init=False, default=0)  # positions noted (the MTP drafter's hist_len without one)
    _cost: dict[str, deque] = field(init=False)  # "mtp" / "plain" -> recent (tokens, seconds)
    _turn: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if not 1 <= self.lookup <= MAX_LOOKUP:
            raise CortiqError(f"lookup drafts must be in 1..{MAX_LOOKUP}, got {self.lookup}")
        self.index = NgramIndex(int(self.ngram[0]), int(self.ngram[1]))
        self._cost = {"mtp": deque(maxlen=GATE_WINDOW), "plain": deque(maxlen=GATE_WINDOW)}
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
        self._turn = 0
        for seen in self._cost.values():
            seen.clear()
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
        if drafts:
            self.last_source = "lookup"
            return drafts
        if self.mtp is None:
            self.last_source = ""  # a plain step, no source's round
            return []
        if not self._use_mtp():
            self.last_source = "plain"
            return []
        self.last_source = "mtp"
        return self.mtp.draft(t, ids, min(k, self.mtp.depth))

    def _seconds_per_token(self, name: str) -> float | None:
        seen = self._cost[name]
        tokens = sum(n for n, _ in seen)
        return sum(s for _, s in seen) / tokens if len(seen) >= 2 and tokens else None

    def _use_mtp(self) -> bool:
        """The gate: MTP drafts, or a plain step, for a round without a lookup match."""
        if not self.gate:
            return True
        self._turn += 1
        mtp, plain = self._seconds_per_token("mtp"), self._seconds_per_token("plain")
        ahead = mtp is None or plain is None or mtp <= plain
        probe = self._turn % GATE_PROBE == 0
        return ahead != probe

    def observe(self, emitted: int, seconds: float) -> None:
        """The last round emitted ``emitted`` tokens in ``seconds`` (draft and verify)."""
        if self.gate and self.last_source in self._cost:
            self._cost[self.last_source].append((int(emitted), float(seconds)))

    def describe(self) -> dict:
        """The settings a result reports (``extra["mtp"]``)."""
        base = self.mtp.describe() if self.mtp is not None else {
            "source": "lookup", "chain": None, "hidden": None, "draft_vocab": None, "threshold": None}
        return {**base, "lookup": self.lookup, "lookup_ngram": list(self.ngram), "mtp_gate": self.gate and self.mtp is not None}
