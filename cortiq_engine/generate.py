"""The generation loop: chunked prefill, then decode steps; speculative decoding is
the same loop with a drafter.

Contract (from the reference design): every token is forwarded exactly once and
enters the KV cache exactly once. The prompt goes through ``forward`` in chunks;
the next-token logits come from the hidden row of the last forwarded token; each
decode step forwards the freshly chosen token. So after generating g tokens the
cache holds prompt + g - 1 rows (the last token is never forwarded).

With a drafter (a ``DraftSource``: ``cortiq_engine.mtp.Drafter``, the MTP layers, or
``cortiq_engine.lookup.LookupDrafter``, n-gram lookup in the sequence before them;
greedy only) a step first drafts K
tokens d_1..d_K, then forwards ``[x, d_1..d_K]`` (x the pending token) in ONE
row-exact batch (at most the kernel set's ``row_exact_rows``, see
``cortiq_engine/kernels/row_exact.py``): row i's token is chosen by the same
sampler over the same history plain decoding would have; while it equals d_{i+1}
the next row is valid too; the first disagreement (or the row after the last draft)
gives the step's own token, and the rows of rejected drafts are truncated from the
cache. A drafter may propose fewer than K (adaptive depth), even none (a plain step: no
source had drafts, or its measured choice, ``cortiq_engine.spec_decision``, runs the
round plain because the source's rounds lately emitted tokens slower than plain steps). The drafts only choose which tokens get verified, so the emitted stream is
the plain greedy stream token for token. Without a drafter K = 0: plain decoding.

``Emitter`` commits every token, plain or verified alike: its event (confidence,
log-probabilities), the UTF-8 stream, stop strings, callbacks and the finish reason:
``stop`` (an EOS id), ``max_tokens``, ``stop_string`` (a stop string appeared; the
text is cut before it), ``length`` (the context is full and eviction is off),
``cancelled`` (the ``on_token`` callback returned False). With eviction on (plain
decoding only), a full context drops its oldest half and generation goes on;
positions keep increasing, so RoPE phases stay consistent for the kept rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from formats.errors import CortiqError
from cortiq_engine.acceptance import Acceptance
from cortiq_engine.model import Model, State, forward
from cortiq_engine.sampling import Sampler, SamplingConfig, token_probability
from cortiq_engine.threads import DecodeThreads, current_threads
from cortiq_engine.tokenizer import StreamDecoder, Tokenizer

PREFILL_CHUNK = 512
# A verify computes the draft rows' lm_head in a second call, after the first row's, while
# depth 1 has been accepted in fewer than this share of the rounds so far (generate).
SPLIT_HEAD_BELOW = 1 / 3


class DraftSource(Protocol):
    """What the decode loop asks of a drafter (``mtp.Drafter``, ``lookup.LookupDrafter``)."""

    depth: int  # at most this many drafts a round
    capacity: int  # positions it can follow
    last_source: str  # the source of the last round's drafts (counted per source)
    hist_len: int  # positions noted so far

    def reset(self) -> None: ...
    def keep(self, n: int) -> None: ...
    def note(self, first_pos: int, rows: np.ndarray) -> None: ...
    def draft(self, t: int, ids: Sequence[int], depth: int | None = None) -> list[int]: ...
    def observe(self, emitted: int, seconds: float) -> None: ...  # the last round's tokens and time
    # Optional: ``decision``, a ``spec_decision.SpecDecision`` (which sources draft, by
    # their measured rate; its clock times the rounds, its report is extra["speculative"]).
    def describe(self) -> dict: ...


@dataclass
class TokenEvent:
    id: int
    text: str  # this token's piece of the output text ("" while a character is incomplete)
    confidence: float  # softmax probability of this token (calibrated if the file has a temperature)
    # With ``logprobs=N``: log-softmax of the raw logits (T = 1, before any penalty)
    # for this token and the N most likely ones, as OpenAI-style APIs report them.
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None

    def to_json(self) -> dict:
        d = {"id": self.id, "text": self.text, "confidence": self.confidence}
        if self.top_logprobs is not None:
            d["logprob"] = self.logprob
            d["top_logprobs"] = [t.to_json() for t in self.top_logprobs]
        return d


@dataclass(frozen=True)
class TopLogprob:
    id: int
    text: str  # the token's own text (special tokens spelled out)
    logprob: float

    def to_json(self) -> dict:
        return {"id": self.id, "text": self.text, "logprob": self.logprob}


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def add_logprobs(ev: TokenEvent, logits: np.ndarray, n: int, tokenizer: Tokenizer | None) -> None:
    """Fill ``ev.logprob`` and its ``n`` most likely alternatives (ties: lower id first)."""
    lp = log_softmax(logits)
    ev.logprob = float(lp[ev.id])
    n = min(n, lp.size)
    top = np.argpartition(-lp, n - 1)[:n] if n < lp.size else np.arange(lp.size)
    top = top[np.lexsort((top, -lp[top]))]
    ev.top_logprobs = [
        TopLogprob(int(i), tokenizer.decode([int(i)]) if tokenizer is not None else "", float(lp[i])) for i in top
    ]


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    tokens: list[TokenEvent]
    prompt_tokens: int
    finish_reason: str
    prefill_seconds: float
    decode_seconds: float
    seed: int | None = None
    evictions: int = 0
    cache_length: int = 0
    extra: dict = field(default_factory=dict)
    # MoE models: layer -> times each expert was chosen (every forwarded position);
    # not in to_json, ``cortiq generate --moe-stats`` adds it.
    expert_usage: dict[int, list[int]] | None = None
    # Speculative decoding: the drafts' counts (also in JSON as extra["mtp"]).
    acceptance: Acceptance | None = None

    @property
    def decode_steps(self) -> int:
        """Forward passes in the decode phase (the first token comes from prefill)."""
        return max(len(self.token_ids) - 1, 0)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "tokens": [t.to_json() for t in self.tokens],
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": len(self.token_ids),
            "finish_reason": self.finish_reason,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "prefill_tok_s": self.prefill_tok_s,
            "decode_tok_s": self.decode_tok_s,
            "seed": self.seed,
            "evictions": self.evictions,
            **self.extra,
        }


def check_history(state: State | None, history: Sequence[int]) -> None:
    """A cached prefix needs the state that holds exactly it."""
    if history and (state is None or state.length != len(history) or state.position != len(history)):
        have = "no state" if state is None else f"a state of {state.length} rows at position {state.position}"
        raise ValueError(f"history of {len(history)} tokens given with {have}")


def prefill(
    state: State,
    ids: Sequence[int],
    chunk: int = PREFILL_CHUNK,
    on_rows: Callable[[int, np.ndarray], None] | None = None,
) -> np.ndarray:
    """Forward the prompt in chunks; returns the hidden row of its last token [1, hidden].
    ``on_rows(offset, rows)`` sees each chunk's hidden rows (a drafter keeps them)."""
    last = None
    for s in range(0, len(ids), chunk):
        last = forward(state, ids[s : s + chunk])
        if on_rows is not None:
            on_rows(s, last)
    return last[-1:]


class StopStrings:
    """Finds stop strings in the growing text and holds back a possible prefix of one,
    so streamed output never shows part of a stop string."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.hit = False

    def feed(self, piece: str) -> tuple[str, bool]:
        """Add a piece; returns (text safe to show now, stopped)."""
        if self.hit:
            return "", True
        self.text += piece
        if self.stops:
            lo = max(0, len(self.text) - len(piece) - self.hold)
            hits = [i for i in (self.text.find(s, lo) for s in self.stops) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.hit = True
                return self._release(len(self.text)), True
        return self._release(len(self.text) - self._held()), False

    def _held(self) -> int:
        """Length of the longest tail of the text that starts some stop string."""
        for k in range(min(self.hold, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out = self.text[self.sent : upto]
        self.sent = upto
        return out

    def finish(self) -> str:
        return self._release(len(self.text))


class Emitter:
    """Commits chosen tokens, one at a time, for plain and speculative decoding alike:
    the token event, the UTF-8 stream (an unfinished character's bytes go to the last
    text token, so the token texts always concatenate to the result text), stop strings,
    the callbacks and the finish reason."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        seen: list[int],
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
        eos_ids: Sequence[int] = (),
        calibration_temperature: float | None = None,
        logprobs: int = 0,
        on_token: Callable[[TokenEvent], bool | None] | None = None,
        on_text: Callable[[str], None] | None = None,
    ):
        self.tokenizer = tokenizer
        self.seen = seen  # history + prompt + output: what the sampler and the drafter read
        self.max_tokens = max_tokens
        self.decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
        self.stops = StopStrings(stop)
        self.eos = set(int(e) for e in eos_ids)
        self.calibration_temperature = calibration_temperature
        self.logprobs = logprobs
        self.on_token = on_token
        self.on_text = on_text
        self.ids: list[int] = []
        self.events: list[TokenEvent] = []

    def _show(self, piece: str) -> bool:
        shown, hit = self.stops.feed(piece)
        if shown and self.on_text is not None:
            self.on_text(shown)
        return hit

    def emit(self, tok: int, logits: np.ndarray) -> str | None:
        """Commit one token chosen from ``logits``; returns a finish reason, or None to go on."""
        self.ids.append(tok)
        self.seen.append(tok)
        is_eos = tok in self.eos
        piece = self.decoder.push(tok) if (self.decoder is not None and not is_eos) else ""
        ev = TokenEvent(tok, piece, token_probability(logits, tok, self.calibration_temperature))
        if self.logprobs > 0:
            add_logprobs(ev, logits, self.logprobs, self.tokenizer)
        self.events.append(ev)
        hit = self._show(piece)
        if self.on_token is not None and self.on_token(ev) is False:
            return "cancelled"
        if is_eos:
            return "stop"
        if hit:
            return "stop_string"
        if len(self.ids) >= self.max_tokens:
            return "max_tokens"
        return None

    def close(self, finish: str) -> str:
        """Flush the stream at the end; returns the result text."""
        if self.decoder is not None and finish != "stop_string":
            tail = self.decoder.flush()
            if tail:
                # Bytes of an unfinished character: they belong to the last text token, so
                # the token texts still concatenate to the result text.
                carrier = next((e for e in reversed(self.events) if e.id not in self.eos), None)
                if carrier is not None:
                    carrier.text += tail
                self._show(tail)
        rest = self.stops.finish()
        if rest and self.on_text is not None:
            self.on_text(rest)
        return self.stops.text


def generate(
    model: Model,
    tokenizer: Tokenizer | None,
    prompt_ids: Sequence[int],
    config: SamplingConfig,
    *,
    capacity: int,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    eos_ids: Sequence[int] = (),
    evict: bool = False,
    calibration_temperature: float | None = None,
    on_token: Callable[[TokenEvent], bool | None] | None = None,
    on_text: Callable[[str], None] | None = None,
    state: State | None = None,
    logprobs: int = 0,
    history: Sequence[int] = (),
    drafter: DraftSource | None = None,
    threads: DecodeThreads | None = None,
) -> GenerationResult:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids`` (see the module doc).

    ``history``: the tokens ``state`` already holds (a conversation's cached prefix,
    see ``cortiq_engine.session``); only ``prompt_ids`` are forwarded, and the
    repetition penalty and the context check see history + prompt. A ``drafter``
    must still hold the backbone rows of those positions.

    ``on_token`` sees every token as it is chosen (return False to stop);
    ``on_text`` receives printable text as it becomes final (UTF-8 completed,
    stop strings held back), for streaming to a terminal. ``logprobs`` > 0 adds each
    step's top-``logprobs`` log-probabilities to the token events. ``drafter``:
    speculative decoding; ``result.extra["mtp"]`` holds its ``Acceptance`` counts and
    ``result.extra["speculative"]`` its decision (which sources drafted, their measured
    rate over plain steps, one line saying so) when the drafter carries one.
    ``threads`` picks each decode step's thread count (``result.extra["decode_threads"]``).
    """
    prompt_ids = [int(i) for i in prompt_ids]
    history = [int(i) for i in history]
    if not prompt_ids:
        raise CortiqError("empty prompt: nothing to generate from")
    check_history(state, history)
    if len(history) + len(prompt_ids) > capacity:
        raise CortiqError(
            f"prompt has {len(history) + len(prompt_ids)} tokens, longer than the context of {capacity} (raise --ctx)"
        )
    if max_tokens < 1:
        raise CortiqError(f"max tokens must be >= 1, got {max_tokens}")
    bad = [i for i in prompt_ids if not 0 <= i < model.vocab_size]
    if bad:
        raise CortiqError(f"prompt token id {bad[0]} outside the vocabulary (0..{model.vocab_size - 1})")
    counts = None
    if drafter is not None:
        if not config.greedy:
            raise CortiqError("speculative decoding is exact for greedy decoding only (temperature 0)")
        if evict:
            raise CortiqError("speculative decoding does not evict: a full context ends the generation")
        if drafter.capacity < capacity:
            raise CortiqError(f"the drafter holds {drafter.capacity} positions, the context is {capacity}")
        if history:
            drafter.keep(len(history))
        else:
            drafter.reset()
        counts = Acceptance(drafter.depth)
    state = state or model.new_state(capacity)
    sampler = Sampler(config)
    out = Emitter(
        tokenizer,
        history + prompt_ids,
        max_tokens=max_tokens,
        stop=stop,
        eos_ids=eos_ids,
        calibration_temperature=calibration_temperature,
        logprobs=logprobs,
        on_token=on_token,
        on_text=on_text,
    )
    note = None if drafter is None else (lambda offset, rows: drafter.note(len(history) + offset, rows))

    t0 = time.perf_counter()
    h = prefill(state, prompt_ids, on_rows=note)
    logits = model.lm_head(model.final_norm(h))[0]
    t1 = time.perf_counter()

    # A verify batch stays within the rows the kernel set declares row-exact.
    max_verify = model.kernels.row_exact_rows
    # Drafters the engine builds carry their measured choice of sources (``spec_decision``);
    # rounds are timed on its clock, which tests make deterministic. Other drafters
    # (benchmarks' rigged ones) are timed on the wall clock and report no choice.
    decision = getattr(drafter, "decision", None)
    clock = decision.clock if decision is not None else time.perf_counter
    threads = threads or DecodeThreads(current_threads(), adaptive=False)
    evictions = 0
    finish = out.emit(sampler(logits, out.seen), logits)
    while finish is None:
        if state.free() == 0:
            if not evict:
                finish = "length"
                break
            state.evict(max(state.capacity // 2, 1))
            evictions += 1
        t = state.position - 1  # the last forwarded position; out.ids[-1] is pending
        k = (
            0
            if drafter is None
            else min(drafter.depth, max_tokens - len(out.ids) - 1, state.free() - 1, max_verify - 1)
        )
        with threads.step(k + 1):
            ta = time.perf_counter()
            ca = clock() if k > 0 else 0.0
            drafts = drafter.draft(t, out.seen, k) if k > 0 else []
            tb = time.perf_counter()
            hb = forward(state, [out.ids[-1], *drafts])
            normed = model.final_norm(hb)
            # One head call for every row reads the lm_head's weights once; the head of row 0
            # alone first spares the draft rows' head when draft 1 is rejected, at the price
            # of a second pass over the weights when it is not (a 1.1B q4 rigged round: 54 vs
            # 49 ms). So the split is taken only while depth 1 has been accepted in under a
            # third of the rounds. Rows are row-exact either way: same tokens.
            split = len(drafts) > 0 and counts.accepted[0] < SPLIT_HEAD_BELOW * counts.drafted[0]
            rows = model.lm_head(normed[:1] if split else normed)
            used = 0
            for i in range(len(drafts) + 1):
                if i == 1 and split:
                    rows = np.concatenate([rows, model.lm_head(normed[1:])])
                tok = sampler(rows[i], out.seen)
                used = i + 1
                finish = out.emit(tok, rows[i])
                if finish is not None or i == len(drafts) or tok != drafts[i]:
                    break
        if drafter is not None:
            # Rows past the last one whose output was used held rejected drafts.
            state.truncate(state.length - (len(drafts) + 1 - used))
            drafter.note(t + 1, hb[:used])
            tc = time.perf_counter()
            counts.record(len(drafts), used - 1, tb - ta, tc - tb, tried=k > 0, source=drafter.last_source)
            if k > 0:
                drafter.observe(used, clock() - ca)
    t2 = time.perf_counter()

    text = out.close(finish)
    extra = {"decode_threads": threads.to_json()}
    if drafter is not None:
        extra["mtp"] = {**drafter.describe(), **counts.to_json()}
        if decision is not None:
            extra["speculative"] = decision.to_json()
    return GenerationResult(
        token_ids=out.ids,
        text=text,
        tokens=out.events,
        prompt_tokens=len(prompt_ids),
        finish_reason=finish,
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        seed=None if config.greedy else sampler.seed,
        evictions=evictions,
        cache_length=state.length,
        extra=extra,
        expert_usage={int(k): v.tolist() for k, v in sorted(state.expert_usage.items())} or None,
        acceptance=counts,
    )
