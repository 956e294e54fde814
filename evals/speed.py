"""How fast a model file runs here: llama-bench's tests on the engine's public API.

``pp N``  prefill: N random tokens into an empty cache, with the last row's logits
          (what a prompt costs before the first token).
``tg N``  decode: N single-token steps after a one-token prompt, greedy sampling
          included (what each generated token costs); ``tg N+mtp`` the same with the
          engine's MTP drafts (exact speculative decoding).
``verify K``  a speculative round's verify: K tokens forwarded in one batch against a
          64-token cache and their logits, row-exact as speculative decoding runs it,
          then rolled back (measured only when the model has MTP draft layers).

Each test runs ``reps`` times after one untimed warm-up; a result keeps every
sample's tokens per second, so callers can show the median and the spread. Kernel
compilation is never in a sample: ``Engine.load`` compiles every kernel these tests run
(``Engine.warmup``; its ``compile_report`` says how long that took). Random
tokens (seeded) as llama-bench uses: the timing of a forward does not depend on them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from formats.errors import CortiqError

VERIFY_CONTEXT = 64  # cached tokens a verify batch attends to
VERIFY_ROUNDS = 8  # verify forwards per timed sample (one is too short to time)


@dataclass
class SpeedResult:
    test: str  # "pp512", "tg128", "verify4"
    tokens: int  # tokens per sample
    seconds: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> list[float]:
        return [self.tokens / s if s > 0 else 0.0 for s in self.seconds]

    @property
    def median(self) -> float:
        return statistics.median(self.tok_s) if self.seconds else 0.0

    @property
    def stddev(self) -> float:
        return statistics.stdev(self.tok_s) if len(self.seconds) > 1 else 0.0

    def to_json(self) -> dict:
        s = self.tok_s
        return {
            "test": self.test,
            "tokens": self.tokens,
            "reps": len(s),
            "seconds": self.seconds,
            "tok_s": s,
            "median_tok_s": self.median,
            "mean_tok_s": statistics.fmean(s) if s else 0.0,
            "stddev_tok_s": self.stddev,
            "min_tok_s": min(s, default=0.0),
            "max_tok_s": max(s, default=0.0),
        }


def random_ids(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab_size, size=n).tolist()


def needed_context(n_prompt: int, n_gen: int, verify: int = 0) -> int:
    """The context a run of these tests needs (the engine preallocates it lazily)."""
    return max(n_prompt, n_gen + 1, VERIFY_CONTEXT + verify, 2)


def prefill(engine, n: int, reps: int) -> SpeedResult:
    from cortiq_engine import SamplingConfig

    _check(engine, n)
    ids = random_ids(engine.vocab_size, n)
    engine.generate(ids[: min(n, 32)], SamplingConfig(), max_tokens=1, ignore_eos=True, speculative=False)  # warm-up
    out = SpeedResult(f"pp{n}", n)
    for _ in range(reps):
        out.seconds.append(
            engine.generate(ids, SamplingConfig(), max_tokens=1, ignore_eos=True, speculative=False).prefill_seconds
        )
    return out


def decode(engine, n: int, reps: int, speculative: bool = False) -> SpeedResult:
    """``speculative``: with the engine's MTP drafts (greedy, exact), the tokens per second a user sees."""
    from cortiq_engine import SamplingConfig

    _check(engine, n + 1)
    test = f"tg{n}+mtp" if speculative else f"tg{n}"
    ids = random_ids(engine.vocab_size, 1)
    engine.generate(
        ids, SamplingConfig(), max_tokens=min(n + 1, 4), ignore_eos=True, speculative=speculative
    )  # warm-up
    out = SpeedResult(test, n)
    for _ in range(reps):
        res = engine.generate(ids, SamplingConfig(), max_tokens=n + 1, ignore_eos=True, speculative=speculative)
        if res.decode_steps != n:
            raise CortiqError(f"{test}: decoding stopped after {res.decode_steps} steps ({res.finish_reason})")
        out.seconds.append(res.decode_seconds)
    return out


def verify(engine, k: int, reps: int) -> SpeedResult:
    """Batched forwards of k tokens (a speculative round with k-1 drafts)."""
    from cortiq_engine.model import forward

    _check(engine, VERIFY_CONTEXT + k)
    model = engine.model
    if k > model.kernels.row_exact_rows:
        raise CortiqError(
            f"verify{k}: the {engine.kernels.name} kernels keep batches of at most "
            f"{model.kernels.row_exact_rows} rows row-exact, so speculative decoding never verifies {k}"
        )
    ids = random_ids(engine.vocab_size, VERIFY_CONTEXT + k)
    state = engine.new_state(VERIFY_CONTEXT + k)
    forward(state, ids[:VERIFY_CONTEXT])

    def rounds(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            model.lm_head(model.final_norm(forward(state, ids[VERIFY_CONTEXT:])))
            state.truncate(VERIFY_CONTEXT)
        return time.perf_counter() - t0

    rounds(1)  # warm-up
    out = SpeedResult(f"verify{k}", k * VERIFY_ROUNDS)
    for _ in range(reps):
        out.seconds.append(rounds(VERIFY_ROUNDS))
    return out


def _check(engine, n: int) -> None:
    if n > engine.ctx:
        raise CortiqError(f"a test of {n} tokens needs a context of {n}, the engine has {engine.ctx}")
