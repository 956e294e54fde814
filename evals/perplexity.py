"""Perplexity of one model, and how far other models' next-token distributions drift from it.

``PerplexityAccumulator.add(block)`` takes the scored rows of every model (the
first is the reference) and records, per scored token:

* NLL_m = logsumexp(z_m) - z_m[y]  for every model m,
* KL(P_0 || P_m) = sum_v P_0(v) (log P_0(v) - log P_m(v))  for m >= 1,
* top-1 agreement [argmax z_0 == argmax z_m].

``report()`` turns them into ``PerplexityReport``s (formulas in docs/evals.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from evals.scoring import Decoder, LogitModel, ScoredBlock, count_scored, iter_scored, scored_text_bytes
from evals.windows import Window
from evals.stats import Z95, MeanEstimate

LN2 = math.log(2.0)


def _exp(x: float) -> float:
    """exp that saturates to inf (a model whose NLL is past 709 nats has an infinite ppl)."""
    return math.exp(x) if x < 709.0 else float("inf")


def log_softmax_rows(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(z - max, logsumexp(z - max)) per row: float32 shifted logits, float64 lse."""
    shifted = z - z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(axis=1, dtype=np.float64))
    return shifted, lse


def kl_rows(shift_p: np.ndarray, lse_p: np.ndarray, shift_q: np.ndarray, lse_q: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row from shifted logits and their logsumexps."""
    logp = shift_p - lse_p[:, None].astype(np.float32)
    logq = shift_q - lse_q[:, None].astype(np.float32)
    p = np.exp(logp)
    # float64 accumulation: the terms are tiny and of both signs.
    kl = np.einsum("ij,ij->i", p.astype(np.float64), (logp - logq).astype(np.float64))
    return np.maximum(kl, 0.0)


@dataclass
class PerplexityAccumulator:
    n_models: int
    nll: list[list[np.ndarray]] = field(default_factory=list)
    kl: list[list[np.ndarray]] = field(default_factory=list)
    agree: list[list[np.ndarray]] = field(default_factory=list)
    _sum_nll0: float = 0.0
    _count: int = 0

    def __post_init__(self) -> None:
        self.nll = [[] for _ in range(self.n_models)]
        self.kl = [[] for _ in range(self.n_models)]
        self.agree = [[] for _ in range(self.n_models)]

    def add(self, block: ScoredBlock) -> None:
        y = block.targets
        rows = np.arange(len(y))
        base = None
        for m, z in enumerate(block.logits):
            shifted, lse = log_softmax_rows(z)
            nll = lse - shifted[rows, y].astype(np.float64)
            self.nll[m].append(nll)
            top = shifted.argmax(axis=1)
            if m == 0:
                base = (shifted, lse, top)
                self._sum_nll0 += float(nll.sum())
                self._count += len(y)
            else:
                assert base is not None
                self.kl[m].append(kl_rows(base[0], base[1], shifted, lse))
                self.agree[m].append(top == base[2])

    @property
    def count(self) -> int:
        return self._count

    @property
    def running_ppl(self) -> float:
        return _exp(self._sum_nll0 / self._count) if self._count else float("nan")

    def arrays(self, m: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
        nll = cat(self.nll[m], np.float64)
        if m == 0:
            return nll, None, None
        return nll, cat(self.kl[m], np.float64), cat(self.agree[m], np.float64)


@dataclass(frozen=True)
class PerplexityReport:
    """One model on one text under one window plan."""

    model: str
    nll: MeanEstimate  # nats per scored token
    tokens_scored: int
    bytes_scored: int

    @property
    def ppl(self) -> float:
        return _exp(self.nll.mean)

    @property
    def ppl_se(self) -> float:
        """Delta-method SE of the perplexity (what llama.cpp prints after +/-)."""
        return self.ppl * self.nll.se

    @property
    def ppl_ci95(self) -> tuple[float, float]:
        lo, hi = self.nll.ci95
        return (_exp(lo), _exp(hi))

    @property
    def bits_per_byte(self) -> float:
        return self.nll.mean * self.tokens_scored / LN2 / self.bytes_scored if self.bytes_scored else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "ppl": self.ppl,
            "ppl_se": self.ppl_se,
            "ppl_ci95": list(self.ppl_ci95),
            "nll_mean": self.nll.mean,
            "nll_se": self.nll.se,
            "nll_ci95": list(self.nll.ci95),
            "tokens_scored": self.tokens_scored,
            "bytes_scored": self.bytes_scored,
            "bits_per_byte": self.bits_per_byte,
        }


@dataclass(frozen=True)
class Comparison:
    """Model m against the reference (model 0) on the same scored tokens."""

    model: str
    reference: str
    log_ratio: MeanEstimate  # mean of NLL_m - NLL_0 per token: ln(ppl_m / ppl_0)
    kl: MeanEstimate  # KL(P_0 || P_m), nats per token
    kl_quantiles: dict[str, float]
    top1: MeanEstimate  # fraction of tokens whose argmax agrees

    @property
    def ppl_ratio(self) -> float:
        return _exp(self.log_ratio.mean)

    @property
    def ppl_ratio_ci95(self) -> tuple[float, float]:
        lo, hi = self.log_ratio.ci95
        return (_exp(lo), _exp(hi))

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "reference": self.reference,
            "ppl_ratio": self.ppl_ratio,
            "ppl_ratio_ci95": list(self.ppl_ratio_ci95),
            "kl_mean": self.kl.mean,
            "kl_se": self.kl.se,
            "kl_quantiles": self.kl_quantiles,
            "top1_agreement": self.top1.mean,
            "top1_agreement_se": self.top1.se,
        }


def build_reports(acc: PerplexityAccumulator, names: list[str], bytes_scored: int) -> tuple[list[PerplexityReport], list[Comparison]]:
    reports, comps = [], []
    nll0, _, _ = acc.arrays(0)
    for m, name in enumerate(names):
        nll, kl, agree = acc.arrays(m)
        reports.append(PerplexityReport(name, MeanEstimate.of(nll), len(nll), bytes_scored))
        if m == 0:
            continue
        assert kl is not None and agree is not None
        q = {k: float(np.quantile(kl, p)) for k, p in (("median", 0.5), ("p90", 0.9), ("p99", 0.99))} if len(kl) else {}
        q["max"] = float(kl.max()) if len(kl) else float("nan")
        comps.append(Comparison(name, names[0], MeanEstimate.of(nll - nll0), MeanEstimate.of(kl), q, MeanEstimate.of(agree)))
    return reports, comps


@dataclass(frozen=True)
class PerplexityResult:
    reports: list[PerplexityReport]
    comparisons: list[Comparison]


ProgressFn = Callable[[int, int, float], None]  # (tokens scored, tokens to score, running ppl of model 0)


def run_perplexity(
    models: Sequence[LogitModel],
    names: list[str],
    tokens: np.ndarray,
    windows: Sequence[Window],
    decoder: Decoder,
    chunk: int = 128,
    progress: ProgressFn | None = None,
) -> PerplexityResult:
    """Score ``windows`` of ``tokens`` with every model in lockstep (model 0 is the reference)."""
    acc = PerplexityAccumulator(len(models))
    total = count_scored(windows)
    for block in iter_scored(models, tokens, windows, chunk=chunk):
        acc.add(block)
        if progress:
            progress(acc.count, total, acc.running_ppl)
    reports, comps = build_reports(acc, names, scored_text_bytes(decoder, tokens, windows))
    return PerplexityResult(reports, comps)


__all__ = ["PerplexityAccumulator", "PerplexityReport", "Comparison", "build_reports", "run_perplexity", "PerplexityResult", "log_softmax_rows", "kl_rows", "Z95"]
