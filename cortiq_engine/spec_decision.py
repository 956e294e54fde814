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

A source's rate can be known before it drafts (``Prior``): remembered from earlier
generations on this machine with the same model, draft layers and settings
(``SpecMemory``, a small JSON file in the user cache dir), else for the MTP layers
modelled from the held-out acceptance their sidecar records (``modelled_ratio``). A
source whose prior rate is below ``off_below`` starts off, so its first rounds are
plain steps instead of the rounds that would have learnt it loses, and it is probed
under the probe budget from the first round on, its prior counting as its ``rounds``
of evidence, at least ``PRIOR_ROUNDS`` (a remembered one as many rounds as it rests on,
up to ``MEMORY_ROUNDS``); its first probe waits at least ``MAX_PROBE_EVERY`` rounds,
since a probe (the rows sat out caught up, a verify) costs about 1.5 plain steps, more
than the 3 % a short answer may lose, so short answers decode plain and long ones (or a
chat's turns together) still try it again. A prior at or above ``off_below`` changes
nothing: a source starts on and is measured as it goes.

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

import json
import math
import os
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from formats.errors import CortiqError
from formats.untrusted_json import is_int, read_object

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
# The cost model of a sidecar's prior (``modelled_ratio``), in plain steps: a round of
# the MTP layers costs a step for the pending token, about a quarter of one per draft
# (catching its cache up and scoring the draft head) and a fifth per extra verify row.
# On SmolLM2 q8 a 1-layer sidecar drafting every round ran at 0.77x plain with 4 %
# acceptance: 1.04 tokens for 1.35 steps, 1.45 by this model with its verify rows.
DRAFT_COST = 0.25
ROW_COST = 0.2
# The rounds of evidence a prior counts for in ``probe_interval``'s weight: at least
# PRIOR_ROUNDS (a source known to lose before it drafts is probed at 0.84 of the full
# interval, not at the quarter its first two rounds alone would give: on 96-token answers
# those extra probes of a losing MTP sidecar cost 3-5 % of the decode), a remembered one
# as many as it rests on, capped at MEMORY_ROUNDS so the latest generations keep their say.
PRIOR_ROUNDS = 32
MODELLED_ROUNDS = PRIOR_ROUNDS
MEMORY_ROUNDS = 64


@dataclass(frozen=True)
class Prior:
    """A source's rate over plain decoding known before it drafts: ``ratio``, the
    ``rounds`` of evidence it counts for, ``origin`` "remembered" (earlier generations
    on this machine, ``runs`` of them) or "modelled" (a sidecar's held-out acceptance,
    ``modelled_ratio``)."""

    ratio: float
    rounds: int
    origin: str
    runs: int = 0

    def describe(self) -> str:
        if self.origin == "remembered":
            return f"{self.ratio:.2f}x remembered from {self.runs} run{'s' * (self.runs != 1)} on this machine"
        return f"{self.ratio:.2f}x modelled from the sidecar's held-out acceptance"

    def to_json(self) -> dict:
        return {"ratio": self.ratio, "rounds": self.rounds, "origin": self.origin, "runs": self.runs}


def modelled_ratio(acceptance: Sequence[float], depth: int) -> float:
    """The rate over plain decoding of MTP rounds of ``depth`` drafts whose depths are
    accepted at ``acceptance`` (held-out, per depth): at most 1 + their sum tokens a
    round for 1 + depth * (DRAFT_COST + ROW_COST) steps."""
    d = max(1, min(int(depth), len(acceptance)))
    return (1.0 + sum(float(a) for a in acceptance[:d])) / (1.0 + d * (DRAFT_COST + ROW_COST))


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
    prior: Prior | None = None  # what was known of its rate before it drafted
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
    # Rates known before drafting (see the module doc); a source below off_below starts off.
    priors: Mapping[str, Prior] = field(default_factory=dict)
    # Where the engine remembers this decision's measured rates (``SpecMemory.remember``).
    memory_key: str | None = None
    rates: dict[str, SourceRate] = field(init=False, default_factory=dict)
    since_plain: int = field(init=False, default=0)  # rounds since plain decoding was last timed
    # Each choice's (rounds, tokens, seconds) when the memory last took them: a
    # conversation's decision spans its turns, and each turn adds only its own rounds.
    told: dict[str, tuple[int, int, float]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._start()

    def _start(self) -> None:
        """The sources with a prior enter at once, so the report names them even when
        they never draft."""
        for name in self.priors:
            self._rate(name)

    def _rate(self, name: str) -> SourceRate:
        if name not in self.rates:
            src = SourceRate(self.window, prior=self.priors.get(name))
            if src.prior is not None and src.prior.ratio < self.off_below:
                src.on, src.off_ratio = False, src.prior.ratio
            self.rates[name] = src
        return self.rates[name]

    def _evidence(self, src: SourceRate) -> int:
        """The rounds a source's rate rests on: its own and its prior's."""
        return src.rounds + (max(src.prior.rounds, PRIOR_ROUNDS) if src.prior is not None else 0)

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
            if r is None:
                r = src.off_ratio
                # Started off by its prior and not yet judged: its first probe's rate already
                # counts (a sidecar modelled at 0.77x whose probes, catching up on the rows
                # they sat out, run at 0.55x would otherwise be probed twice as often).
                if src.switches == 0 and src.rounds > 0:
                    r = self.ratio(name, recent=False) or r
            wait = self.probe_interval(r, self._evidence(src))
            if src.switches == 0 and src.rounds == 0 and src.prior is not None:
                wait = max(wait, MAX_PROBE_EVERY)  # started off by its prior: see the module docs
            if src.wait < wait:
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
        self.told.clear()
        self.since_plain = 0
        self._start()

    def untold(self) -> dict[str, tuple[float, int]]:
        """Each source's (rate over plain, rounds) over the rounds since the last call:
        what a memory has not taken yet. Plain steps of those rounds time plain decoding,
        else all of them do."""
        delta = {}
        for name, s in self.rates.items():
            r0, t0, s0 = self.told.get(name, (0, 0, 0.0))
            delta[name] = (s.rounds - r0, s.tokens - t0, s.seconds - s0)
            self.told[name] = (s.rounds, s.tokens, s.seconds)
        plain = delta.get(PLAIN, (0, 0, 0.0))
        whole = self.rates.get(PLAIN)
        plain_per_token = plain[2] / plain[1] if plain[1] else (whole.per_token if whole is not None else None)
        if not plain_per_token:
            return {}
        return {
            name: (plain_per_token * t / s, n)
            for name, (n, t, s) in delta.items()
            if name != PLAIN and n > 0 and t > 0 and s > 0
        }

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
                    prior=s.prior.to_json() if s.prior is not None else None,
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
            # A source that has not drafted is named only when its prior kept it off.
            if name == PLAIN or (s.rounds == 0 and (s.on or s.prior is None)):
                continue
            started = (
                f"started off: {s.prior.describe()}" if s.prior is not None and s.prior.ratio < self.off_below else ""
            )
            if s.rounds == 0:
                parts.append(f"{name} off ({started}; not probed)")
                continue
            r = self.ratio(name, recent=False)
            rate = f"{r:.2f}x over plain" if r is not None else "not yet compared with plain"
            rounds = f"{s.rounds} round{'s' * (s.rounds != 1)}"
            if not s.on:
                parts.append(f"{name} off ({rate} in {rounds}" + (f"; {started})" if started else ")"))
            else:
                judged = self.ratio(name) is not None  # min_rounds of it and of plain steps
                parts.append(
                    f"{name} {rate} in {rounds}"
                    + ("" if judged else ", too few to judge")
                    + (f" ({started}, back on)" if started else "")
                )
        if not parts:
            return "plain decoding (no source drafted)"
        if not any(s.on for n, s in self.rates.items() if n != PLAIN and s.rounds):
            parts.insert(0, "plain decoding")
        overall = self.overall()
        if overall is not None:
            parts.append(f"about {overall:.2f}x overall")
        return "; ".join(parts)


# ------------------------------------------------------------ memory across runs
MEMORY_ENV = "CORTIQ_SPEC_MEMORY"
MEMORY_FORMAT = "cortiq speculation rates"
MEMORY_MAX_BYTES = 1 << 20
MEMORY_ENTRIES = 256  # keys kept, the most recently updated first
MAX_RATIO = 1e6  # a remembered rate outside [1 / MAX_RATIO, MAX_RATIO] is no rate


@dataclass(frozen=True)
class SpecMemory:
    """The sources' measured rates, remembered per machine in the JSON file ``path``
    (``default``: ``$CORTIQ_SPEC_MEMORY``, else ``$XDG_CACHE_HOME/cortiq/speculation.json``,
    ``~/.cache`` without it; set empty, no memory) under a key naming the model, its draft
    layers and the settings (``Engine`` builds it), so a generation starts from what the
    earlier ones measured. The file is untrusted input: a missing, unreadable, corrupt
    or hostile one (wrong types, non-finite or absurd rates, a FIFO, a huge file) is read
    as no memory, entry by entry, without a word; writes go to a temporary file renamed
    over it, and a failed write leaves the old file."""

    path: Path

    @classmethod
    def default(cls, environ: Mapping[str, str] = os.environ) -> "SpecMemory | None":
        env = environ.get(MEMORY_ENV)
        if env is not None:
            return cls(Path(env).expanduser()) if env.strip() else None
        base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return cls(Path(base) / "cortiq" / "speculation.json")

    def _entries(self) -> dict[str, dict]:
        try:
            doc = read_object(self.path, max_bytes=MEMORY_MAX_BYTES)
        except (CortiqError, OSError, ValueError):
            return {}
        entries = doc.get("entries") if doc.get("format") == MEMORY_FORMAT else None
        return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}

    @staticmethod
    def _prior(rec: object) -> Prior | None:
        """A remembered source record, validated: None unless every field is sound."""
        if not isinstance(rec, dict):
            return None
        ratio, rounds, runs = rec.get("ratio"), rec.get("rounds"), rec.get("runs")
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not math.isfinite(ratio):
            return None
        if not 1.0 / MAX_RATIO <= ratio <= MAX_RATIO or not is_int(rounds) or not is_int(runs):
            return None
        if rounds < 1 or runs < 1:
            return None
        return Prior(float(ratio), int(min(rounds, MEMORY_ROUNDS)), "remembered", int(min(runs, 1 << 30)))

    def priors(self, key: str) -> dict[str, Prior]:
        """The remembered rates under ``key``, by source ({} when none)."""
        sources = self._entries().get(key, {}).get("sources")
        if not isinstance(sources, dict):
            return {}
        out = {name: self._prior(rec) for name, rec in sources.items() if name != PLAIN and isinstance(name, str)}
        return {name: p for name, p in out.items() if p is not None}

    def remember(self, key: str, decision: SpecDecision) -> None:
        """Fold what ``decision`` measured since it was last remembered into the entry
        under ``key``: each source's rate over those rounds, averaged with the remembered one by rounds (the remembered
        ones counting at most MEMORY_ROUNDS). Sources that did not draft keep theirs."""
        measured = decision.untold()
        if not measured:
            return
        entries = self._entries()
        old = self.priors(key) if key in entries else {}
        sources = {n: {"ratio": p.ratio, "rounds": p.rounds, "runs": p.runs} for n, p in old.items()}
        for name, (r, n) in measured.items():
            p = old.get(name)
            if p is not None:
                r = (p.ratio * p.rounds + r * n) / (p.rounds + n)
            sources[name] = {
                "ratio": round(r, 4),
                "rounds": min(n + (p.rounds if p else 0), MEMORY_ROUNDS),
                "runs": 1 + (p.runs if p else 0),
            }
        entries[key] = {"updated": time.time(), "sources": sources}
        keep = dict(sorted(entries.items(), key=_updated, reverse=True)[:MEMORY_ENTRIES])
        self._write({"format": MEMORY_FORMAT, "entries": keep})

    def _write(self, doc: dict) -> None:
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, sort_keys=True)
            os.replace(tmp, self.path)
            tmp = None
        except OSError:
            pass  # no memory this time: the next generation measures again
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass


def _updated(item: tuple[str, dict]) -> float:
    t = item[1].get("updated")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) else 0.0
