"""The generation loop: chunked prefill, then one position per decode step.

Contract (from the reference design): every token is forwarded exactly once and
enters the KV cache exactly once. The prompt goes through ``forward`` in chunks;
the next-token logits come from the hidden row of the last forwarded token; each
decode step forwards only the freshly sampled token. So after generating g
tokens the cache holds prompt + g - 1 rows (the last token is never forwarded).

Finish reasons: ``stop`` (an EOS id), ``max_tokens``, ``stop_string`` (a stop
string appeared; the text is cut before it), ``length`` (the context is full and
eviction is off), ``cancelled`` (the ``on_token`` callback returned False).
With eviction on, a full context drops its oldest half and generation goes on;
positions keep increasing, so RoPE phases stay consistent for the kept rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from formats.errors import CortiqError
from cortiq_engine.model import Model, State, forward
from cortiq_engine.sampling import Sampler, SamplingConfig, token_probability
from cortiq_engine.tokenizer import StreamDecoder, Tokenizer

PREFILL_CHUNK = 512


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


def prefill(state: State, ids: Sequence[int], chunk: int = PREFILL_CHUNK) -> np.ndarray:
    """Forward the prompt in chunks; returns the hidden row of its last token [1, hidden]."""
    last = None
    for s in range(0, len(ids), chunk):
        last = forward(state, ids[s : s + chunk])
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
) -> GenerationResult:
    """Generate up to ``max_tokens`` tokens after ``prompt_ids`` (see the module doc).

    ``history``: the tokens ``state`` already holds (a conversation's cached prefix,
    see ``cortiq_engine.session``); only ``prompt_ids`` are forwarded, and the
    repetition penalty and the context check see history + prompt.

    ``on_token`` sees every token as it is chosen (return False to stop);
    ``on_text`` receives printable text as it becomes final (UTF-8 completed,
    stop strings held back), for streaming to a terminal. ``logprobs`` > 0 adds each
    step's top-``logprobs`` log-probabilities to the token events.
    """
    prompt_ids = [int(i) for i in prompt_ids]
    history = [int(i) for i in history]
    if not prompt_ids:
        raise CortiqError("empty prompt: nothing to generate from")
    check_history(state, history)
    if len(history) + len(prompt_ids) > capacity:
        raise CortiqError(f"prompt has {len(history) + len(prompt_ids)} tokens, longer than the context of {capacity} (raise --ctx)")
    if max_tokens < 1:
        raise CortiqError(f"max tokens must be >= 1, got {max_tokens}")
    bad = [i for i in prompt_ids if not 0 <= i < model.vocab_size]
    if bad:
        raise CortiqError(f"prompt token id {bad[0]} outside the vocabulary (0..{model.vocab_size - 1})")
    state = state or model.new_state(capacity)
    sampler = Sampler(config)
    decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
    stops = StopStrings(stop)
    eos = set(int(e) for e in eos_ids)
    seen = history + prompt_ids

    t0 = time.perf_counter()
    h = prefill(state, prompt_ids)
    logits = model.lm_head(model.final_norm(h))[0]
    t1 = time.perf_counter()

    ids: list[int] = []
    events: list[TokenEvent] = []
    finish = "max_tokens"
    evictions = 0
    while True:
        tok = sampler(logits, seen)
        conf = token_probability(logits, tok, calibration_temperature)
        ids.append(tok)
        seen.append(tok)
        is_eos = tok in eos
        piece = decoder.push(tok) if (decoder is not None and not is_eos) else ""
        ev = TokenEvent(tok, piece, conf)
        if logprobs > 0:
            add_logprobs(ev, logits, logprobs, tokenizer)
        events.append(ev)
        shown, hit = stops.feed(piece)
        if shown and on_text is not None:
            on_text(shown)
        if on_token is not None and on_token(ev) is False:
            finish = "cancelled"
            break
        if is_eos:
            finish = "stop"
            break
        if hit:
            finish = "stop_string"
            break
        if len(ids) >= max_tokens:
            break
        if state.free() == 0:
            if not evict:
                finish = "length"
                break
            state.evict(max(state.capacity // 2, 1))
            evictions += 1
        logits = model.lm_head(model.final_norm(forward(state, [tok])))[0]
    t2 = time.perf_counter()

    if decoder is not None and finish != "stop_string":
        tail = decoder.flush()
        if tail:
            # Bytes of an unfinished character: they belong to the last text token, so
            # the token texts still concatenate to the result text.
            carrier = next((e for e in reversed(events) if e.id not in eos), None)
            if carrier is not None:
                carrier.text += tail
            shown, _ = stops.feed(tail)
            if shown and on_text is not None:
                on_text(shown)
    rest = stops.finish()
    if rest and on_text is not None:
        on_text(rest)
    return GenerationResult(
        token_ids=ids,
        text=stops.text,
        tokens=events,
        prompt_tokens=len(prompt_ids),
        finish_reason=finish,
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        seed=None if config.greedy else sampler.seed,
        evictions=evictions,
        cache_length=state.length,
        expert_usage={int(k): v.tolist() for k, v in sorted(state.expert_usage.items())} or None,
    )
