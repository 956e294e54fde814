"""Which draft sources pay on this machine: the measured choice of speculative decoding.

A draft source (the MTP layers, n-gram lookup) helps only when its rounds emit tokens
faster than plain one-token steps. That depends on the text (how often its drafts are
accepted), the model and the machine (what a verify of K+1 rows costs against one
step), so it is measured during the generation itself, not assumed: the decode loop
times every round with ``clock`` and reports it (``record``), and before a source
drafts, ``allow`` says whether it may.

Each source ("lookup", "mtp") and plain decoding ("plain") keep their last ``window``
rounds (tokens emitted, seconds of draft + verify). A source's rate over plain's is
``plain seconds per token / its seconds per token``; a source is switched off when
that falls below ``off_below`` (1.0: slower than plain) after ``min_rounds`` rounds of
each, and back on only when it reaches ``on_above`` (hysteresis: a ratio wandering
around 1.0 does not flip the choice every round); a source switched off is judged
again on the rounds it runs from then on. Every ``probe_every``-th round a
source could take runs the other choice: a source that is off drafts once (so a change
of the text is seen), a source that is on yields to a plain step when plain decoding
has not been timed in the last ``probe_every`` rounds (its figure stays current;
rounds in which no source had drafts are plain steps already and count). A source that
is off is probed less often the more its rounds lose: a probe of a source at rate r
costs about 1/r - 1 plain steps, so it waits (1/r - 1) / ``PROBE_BUDGET`` rounds (at
least ``probe_every``, at most ``MAX_PROBE_EVERY``), which keeps the probes' cost near
``PROBE_BUDGET`` of the decode time whatever the source's rate (a source at 0.4x probed
every 8th round would cost 16 %). The loss counts in proportion to how many rounds it
rests on, n / (n + ``SHRINK_ROUNDS``): a lookup's first rounds are all or nothing (0 or
3 drafts accepted), and two unlucky ones must not keep it off through the loop of
repeated text that follows them.

The choice only decides which tokens get drafted and verified; the verify keeps the
plain sampler's tokens, so the output is the plain greedy output token for token
whatever is switched on or off.

What a result reports (``to_json``): per source its state, rounds, tokens, time and
rate over plain steps (over its own rounds: the tokens per second of the rounds it
drafted against plain steps'), ``overall_speedup`` (every timed round against plain
steps: the decode's estimated speedup) and ``decision``: one line, e.g.
``lookup 1.76x over plain in 17 rounds; mtp off (0.84x over plain in 9 rounds); about
1.31x overall``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

PLAIN = "plain"
# Rounds each choice keeps for its rate: 16 rounds of a 128-token answer is as many as
# a source gets on chat text, and on a machine whose step time wanders 7-12 ms fewer
# than that gives ratios too noisy to choose by.
WINDOW = 16
PROBE_EVERY = 8
MIN_ROUNDS = 2
PROBE_BUDGET = 0.015
MAX_PROBE_EVERY = 128
SHRINK_ROUNDS = 6
OFF_BELOW = 1.0
ON_ABOVE = 1.05


@dataclass
class SourceRate:
    """One choice's rounds: the last ``window`` (tokens, seconds) and the totals."""

    window: int = WINDOW
    on: bool = True
    rounds: int = 0
    tokens: int = 0
    seconds: float = 0.0
    switches: int = 0  # times the choice turned it off or on
    turns: int = 0  # rounds in which it had drafts to offer
    wait: int = 0  # while off: rounds it sat out since it was switched off or last probed
    off_ratio: float | None = None  # its rate over plain when it was switched off
    recent: deque = field(init=False)

    def __post_init__(self) -> None:
        self.recent = deque(maxlen=self.window)

    def add(self, tokens: int, seconds: float) -> None:
        self.recent.append((int(tokens), float(seconds)))
        self.rounds += 1
        self.tokens += int(tokens)
        self.seconds += float(seconds)

    def recent_per_token(self, min_rounds: int) -> float | None:
        tokens = sum(n for n, _ in self.recent)
        if len(self.recent) < min_rounds or tokens == 0:
            return None
        return sum(s for _, s in self.recent) / tokens

    @property
    def per_token(self) -> float | None:
        return self.seconds / self.tokens if self.tokens else None


@dataclass
class SpecDecision:
    """The measured per-source choice of one drafter (see the module doc). ``clock``:
    what the decode loop times rounds with (tests hand in a deterministic one)."""

    clock: Callable[[], float] = time.perf_counter
    window: int = WINDOW
    probe_every: int = PROBE_EVERY
    min_rounds: int = MIN_ROUNDS
    off_below: float = OFF_BELOW
    on_above: float = ON_ABOVE
    rates: dict[str, SourceRate] = field(init=False, default_factory=dict)
    since_plain: int = field(init=False, default=0)  # rounds since plain decoding was last timed

    def _rate(self, name: str) -> SourceRate:
        if name not in self.rates:
            self.rates[name] = SourceRate(self.window)
        return self.rates[name]

    def ratio(self, name: str, *, recent: bool = True) -> float | None:
        """Plain seconds per token over ``name``'s (> 1: the source is faster); None
        until both have been timed."""
        src, plain = self.rates.get(name), self.rates.get(PLAIN)
        if src is None or plain is None:
            return None
        a = src.recent_per_token(self.min_rounds) if recent else src.per_token
        b = plain.recent_per_token(self.min_rounds) if recent else plain.per_token
        return b / a if a and b else None

    def allow(self, name: str) -> bool:
        """Whether source ``name``, which has drafts to offer this round, drafts it
        (False: the round is a plain step)."""
        src = self._rate(name)
        src.turns += 1
        r = self.ratio(name)
        if r is not None:
            if src.on and r < self.off_below:
                src.on, src.switches, src.wait, src.off_ratio = False, src.switches + 1, 0, r
                # Its probes are judged on their own: a stretch of slow rounds (the machine
                # busy with something else) then costs the next min_rounds probes, not a
                # window's worth.
                src.recent.clear()
                r = None
            elif not src.on and r >= self.on_above:
                src.on, src.switches = True, src.switches + 1
        if not src.on:
            src.wait += 1
            if src.wait < self.probe_interval(r if r is not None else src.off_ratio, src.rounds):
                return False
            src.wait = 0
            return True
        plain = self.rates.get(PLAIN)
        # Plain decoding is timed early (a source cannot be judged without it) and then
        # whenever its figure is older than probe_every rounds.
        unknown = src.rounds > 0 and (plain is None or len(plain.recent) < self.min_rounds)
        return not (unknown or (src.rounds > 0 and self.since_plain >= self.probe_every))

    def probe_interval(self, ratio: float | None, rounds: int) -> int:
        """Rounds an off source waits between probes, at rate ``ratio`` over plain
        measured over ``rounds`` of its rounds."""
        loss = (1.0 / ratio - 1.0) * rounds / (rounds + SHRINK_ROUNDS) if ratio else 0.0
        return int(min(max(self.probe_every, math.ceil(loss / PROBE_BUDGET)), MAX_PROBE_EVERY))

    def record(self, name: str, tokens: int, seconds: float) -> None:
        """A round of ``name`` (or ``"plain"``) emitted ``tokens`` in ``seconds``."""
        self._rate(name).add(tokens, seconds)
        self.since_plain = 0 if name == PLAIN else self.since_plain + 1

    def reset(self) -> None:
        self.rates.clear()
        self.since_plain = 0

    # ------------------------------------------------------------ report
    def to_json(self) -> dict:
        sources = {}
        for name, s in sorted(self.rates.items()):
            d = {
                "rounds": s.rounds,
                "tokens": s.tokens,
                "seconds": s.seconds,
                "ms_per_token": 1e3 * s.per_token if s.per_token else None,
            }
            if name != PLAIN:
                d.update(
                    on=s.on,
                    switches=s.switches,
                    speedup=self.ratio(name, recent=False),
                    recent_speedup=self.ratio(name),
                )
            sources[name] = d
        return {"sources": sources, "overall_speedup": self.overall(), "decision": self.decision()}

    def overall(self) -> float | None:
        """Every timed round's tokens per second over plain steps' (the whole decode's
        estimated speedup, from this generation's own timings); None before plain is timed."""
        plain = self.rates.get(PLAIN)
        tokens = sum(s.tokens for s in self.rates.values())
        seconds = sum(s.seconds for s in self.rates.values())
        if plain is None or plain.per_token is None or not seconds:
            return None
        return plain.per_token * tokens / seconds

    def decision(self) -> str:
        """One line: each source, on or off, and its measured rate over plain decoding."""
        parts = []
        for name, s in sorted(self.rates.items(), key=lambda kv: (not kv[1].on, kv[0])):
            if name == PLAIN or s.rounds == 0:
                continue
            r = self.ratio(name, recent=False)
            rate = f"{r:.2f}x over plain" if r is not None else "not yet compared with plain"
            rounds = f"{s.rounds} round{'s' * (s.rounds != 1)}"
            if not s.on:
                parts.append(f"{name} off ({rate} in {rounds})")
            else:
                judged = self.ratio(name) is not None  # min_rounds of it and of plain steps
                parts.append(f"{name} {rate} in {rounds}" + ("" if judged else ", too few to judge"))
        if not parts:
            return "plain decoding (no source drafted)"
        if not any(s.on for n, s in self.rates.items() if n != PLAIN and s.rounds):
            parts.insert(0, "plain decoding")
        overall = self.overall()
        if overall is not None:
            parts.append(f"about {overall:.2f}x overall")
        return "; ".join(parts)
