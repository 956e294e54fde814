"""Exact speculative greedy decoding with MTP drafts.

A round starts after the backbone processed positions ..t, with the next token
x_{t+1} chosen but not yet forwarded (pending). It

1. drafts K tokens d_1..d_K with the draft layers (``mtp.Drafter``);
2. verifies ``[x_{t+1}, d_1..d_K]`` in ONE batched backbone forward;
3. walks the K+1 rows: row i's token is chosen by the plain sampler over the
   same history plain decoding would have; while it equals d_{i+1} the next row
   is valid too; the first disagreement (or the row after the last draft) gives
   the round's own token;
4. truncates the rejected rows from the backbone's KV cache (the draft layers
   drop their provisional rows at the next round).

Every token enters the backbone cache exactly once, and the emitted stream is
the plain greedy stream token for token: the drafts only choose which tokens get
verified. That needs the batched verify to give each row exactly the numbers a
single-token decode gives; ``row_exact`` arranges it (see there).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from formats.errors import CortiqError
from cortiq_engine.generate import PREFILL_CHUNK, GenerationResult, TokenEvent, StopStrings, add_logprobs, check_history
from cortiq_engine.model import Model, State, forward
from cortiq_engine.mtp import Drafter
from cortiq_engine.sampling import Sampler, SamplingConfig, token_probability
from cortiq_engine.tokenizer import StreamDecoder, Tokenizer

# Query rows up to which the compiled attention computes each row on its own.
_ROW_EXACT_ATTN = 16


@contextmanager
def row_exact(kernels) -> Iterator[None]:
    """Within the scope, a batched matmul/attention gives every row bit for bit what a
    one-row call gives (decode). BLAS does not promise that: a 1-row and a 4-row f32
    product may differ in the last bits, enough to flip a near-tie argmax. The numba
    small-batch kernels accumulate each row on its own, so they keep the batch; f32
    (BLAS) and large batches go row by row. Overrides live on the kernel object only
    for the scope.
    """
    inner_matmul, inner_attend = kernels.matmul, kernels.attend
    small_n = int(getattr(kernels, "small_n", 0))
    compiled = getattr(kernels, "name", "") == "numba"

    def matmul(ws, X):
        n = X.shape[0]
        if n == 1 or (compiled and n <= small_n and not any(w.kind.native for w in ws)):
            return inner_matmul(ws, X)
        out = np.empty((n, sum(w.rows for w in ws)), np.float32)
        for i in range(n):
            out[i] = inner_matmul(ws, X[i : i + 1].copy())[0]
        return out

    def attend(q, kc, vc, start, window, scale):
        n = q.shape[0]
        if n == 1 or (compiled and n <= _ROW_EXACT_ATTN):
            return inner_attend(q, kc, vc, start, window, scale)
        return np.concatenate([inner_attend(q[i : i + 1].copy(), kc, vc, start + i, window, scale) for i in range(n)])

    kernels.matmul, kernels.attend = matmul, attend
    try:
        yield
    finally:
        del kernels.matmul, kernels.attend


@dataclass
class SpecStats:
    """Counters of one speculative generation."""

    depth: int
    rounds: int = 0  # verify forwards that carried drafts
    plain_steps: int = 0  # forwards without drafts (the token budget or context left no room)
    drafted: int = 0
    accepted: int = 0
    accept_hist: list[int] = field(default_factory=list)  # [a] = rounds that accepted exactly a drafts
    depth_drafted: list[int] = field(default_factory=list)
    depth_accepted: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    chain: str = ""
    hidden: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        self.accept_hist = self.accept_hist or [0] * (self.depth + 1)
        self.depth_drafted = self.depth_drafted or [0] * self.depth
        self.depth_accepted = self.depth_accepted or [0] * self.depth

    def record(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if drafted == 0:
            self.plain_steps += 1
            return
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accept_hist[accepted] += 1
        for d in range(drafted):
            self.depth_drafted[d] += 1
            self.depth_accepted[d] += d < accepted
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s

    @property
    def tokens_per_round(self) -> float:
        """Tokens a round emits: the accepted drafts plus the verify's own token."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def depth_rates(self) -> list[float]:
        return [a / n if n else 0.0 for a, n in zip(self.depth_accepted, self.depth_drafted)]

    def to_json(self) -> dict:
        r = max(self.rounds, 1)
        return {
            "source": self.source,
            "depth": self.depth,
            "chain": self.chain,
            "hidden": self.hidden,
            "rounds": self.rounds,
            "plain_steps": self.plain_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.acceptance,
            "tokens_per_round": self.tokens_per_round,
            "acceptance_per_depth": self.depth_rates(),
            "depth_drafted": self.depth_drafted,
            "depth_accepted": self.depth_accepted,
            "accept_histogram": self.accept_hist,
            "draft_ms_per_round": 1e3 * self.draft_seconds / r,
            "verify_ms_per_round": 1e3 * self.verify_seconds / r,
        }


def generate_speculative(
    model: Model,
    tokenizer: Tokenizer | None,
    prompt_ids: Sequence[int],
    drafter: Drafter,
    config: SamplingConfig | None = None,
    *,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    eos_ids: Sequence[int] = (),
    calibration_temperature: float | None = None,
    on_token: Callable[[TokenEvent], bool | None] | None = None,
    on_text: Callable[[str], None] | None = None,
    state: State | None = None,
    logprobs: int = 0,
    history: Sequence[int] = (),
) -> GenerationResult:
    """Greedy generation with MTP drafts; the same tokens, events and finish reasons as
    ``cortiq_engine.generate.generate`` (without eviction: a full context ends with
    ``length``). ``result.extra["mtp"]`` holds the ``SpecStats``. ``history`` as there:
    the drafter must still hold the backbone rows of those positions."""
    config = config or SamplingConfig()
    if not config.greedy:
        raise CortiqError("speculative decoding is exact for greedy decoding only (temperature 0)")
    prompt_ids = [int(i) for i in prompt_ids]
    history = [int(i) for i in history]
    capacity = drafter.capacity
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
    if history:
        drafter.keep(len(history))
    else:
        drafter.reset()
    sampler = Sampler(config)
    decoder = StreamDecoder(tokenizer) if tokenizer is not None else None
    stops = StopStrings(stop)
    eos = set(int(e) for e in eos_ids)
    seen = history + prompt_ids
    ids: list[int] = []
    events: list[TokenEvent] = []
    stats = SpecStats(drafter.depth, chain=drafter.chain, hidden=drafter.hidden, source=drafter.stack.source)

    def emit(tok: int, logits: np.ndarray) -> str | None:
        """Commit one token exactly as plain decoding does; returns a finish reason or None."""
        ids.append(tok)
        seen.append(tok)
        is_eos = tok in eos
        piece = decoder.push(tok) if (decoder is not None and not is_eos) else ""
        ev = TokenEvent(tok, piece, token_probability(logits, tok, calibration_temperature))
        if logprobs > 0:
            add_logprobs(ev, logits, logprobs, tokenizer)
        events.append(ev)
        shown, hit = stops.feed(piece)
        if shown and on_text is not None:
            on_text(shown)
        if on_token is not None and on_token(ev) is False:
            return "cancelled"
        if is_eos:
            return "stop"
        if hit:
            return "stop_string"
        if len(ids) >= max_tokens:
            return "max_tokens"
        return None

    t0 = time.perf_counter()
    h = None
    for s in range(0, len(prompt_ids), PREFILL_CHUNK):  # the plain loop's chunks: same last row
        h = forward(state, prompt_ids[s : s + PREFILL_CHUNK])
        drafter.note(len(history) + s, h)
    logits = model.lm_head(model.final_norm(h[-1:]))[0]
    t1 = time.perf_counter()

    max_verify = int(getattr(model.kernels, "small_n", 0)) or 8
    finish = emit(sampler(logits, seen), logits)
    while finish is None:
        if state.free() == 0:
            finish = "length"
            break
        # A verify batch stays within the kernels' small-batch path (row-exact by construction).
        k = min(drafter.depth, max_tokens - len(ids) - 1, state.free() - 1, max_verify - 1)
        t = state.position - 1
        ta = time.perf_counter()
        drafts = drafter.draft(t, history + prompt_ids + ids, k) if k > 0 else []
        tb = time.perf_counter()
        with row_exact(model.kernels):
            hb = forward(state, [ids[-1], *drafts])
            normed = model.final_norm(hb)
            # The head of row 0 first: the rest is needed only once d1 is accepted.
            rows = model.lm_head(normed[:1])
        used = 0
        for i in range(len(drafts) + 1):
            if i == 1:
                with row_exact(model.kernels):
                    rows = np.concatenate([rows, model.lm_head(normed[1:])])
            tok = sampler(rows[i], seen)
            used = i + 1
            finish = emit(tok, rows[i])
            if finish is not None or i == len(drafts) or tok != drafts[i]:
                break
        # Rows past the last one whose output was used held rejected drafts.
        state.truncate(state.length - (len(drafts) + 1 - used))
        drafter.note(t + 1, hb[:used])
        stats.record(len(drafts), used - 1, tb - ta, time.perf_counter() - tb)
    t2 = time.perf_counter()

    if decoder is not None and finish != "stop_string":
        shown, _ = stops.feed(decoder.flush())
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
        seed=None,
        cache_length=state.length,
        extra={"mtp": stats.to_json()},
        expert_usage={int(k): v.tolist() for k, v in sorted(state.expert_usage.items())} or None,
    )


def generate_with_engine(engine, prompt_ids: Sequence[int], drafter: Drafter, max_tokens: int = 256, **kw) -> GenerationResult:
    """``generate_speculative`` with an ``Engine``'s model, tokenizer, EOS ids and calibration."""
    kw.setdefault("eos_ids", engine.eos_ids)
    return generate_speculative(
        engine.model,
        engine.tokenizer if engine.has_tokenizer else None,
        prompt_ids,
        drafter,
        max_tokens=max_tokens,
        calibration_temperature=engine.calibration_temperature,
        **kw,
    )
