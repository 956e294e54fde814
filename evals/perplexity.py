"""Perplexity of one model, and how far other models' next-token distributions drift from it.

``PerplexityAccumulator.add(block)`` takes the scored rows of every model (the
first is the reference, or the reference comes from a saved ``.cref``) and records,
per scored token, each model's NLL and its drift from the reference (KL both ways,
Δp, top-1 agreement: ``evals.kl``). ``build_reports`` turns them into
``PerplexityReport``s and ``Comparison``s with llama.cpp's statistics
(``llama-perplexity --kl-divergence``); formulas in docs/evals.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from evals.kl import RefRows, RowStats, compare_rows, ref_full
from evals.scoring import Decoder, LogitModel, ScoredBlock, count_scored, iter_scored, scored_text_bytes
from evals.windows import Window
from evals.stats import Z95, MeanEstimate

LN2 = math.log(2.0)


def _exp(x: float) -> float:
    """exp that saturates to inf (a model whose NLL is past 709 nats has an infinite ppl)."""
    return math.exp(x) if x < 709.0 else float("inf")


def _exp_estimate(field: str) -> tuple[property, property, property]:
    """Properties of exp(mean) of the ``MeanEstimate`` named ``field``: the value, its
    delta-method SE (exp(mean) * se) and the exp of the mean's 95% interval."""

    def value(self) -> float:
        return _exp(getattr(self, field).mean)

    def se(self) -> float:
        return value(self) * getattr(self, field).se

    def ci95(self) -> tuple[float, float]:
        lo, hi = getattr(self, field).ci95
        return (_exp(lo), _exp(hi))

    return property(value), property(se), property(ci95)


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
    """Per-position values of every model, one block at a time (memory: a few floats per
    scored token and model, plus one block of logits; never text x vocab).

    ``n_models`` counts the models whose logits each block carries. With ``saved_ref``
    the reference is not among them: every block comes with its ``RefRows`` (from a
    saved reference) and all ``n_models`` are compared against it. Otherwise model 0's
    logits are the reference, in full.
    """

    n_models: int
    saved_ref: bool = False
    nll: list[list[np.ndarray]] = field(default_factory=list)
    rows: list[list[RowStats]] = field(default_factory=list)
    _sum_nll0: float = 0.0
    _count: int = 0

    def __post_init__(self) -> None:
        n = self.n_reports
        self.nll = [[] for _ in range(n)]
        self.rows = [[] for _ in range(n)]

    @property
    def n_reports(self) -> int:
        """Reference first, then every compared model."""
        return self.n_models + 1 if self.saved_ref else self.n_models

    def add(self, block: ScoredBlock, ref: RefRows | None = None) -> None:
        y = block.targets
        if self.saved_ref:
            if ref is None:
                raise ValueError("a saved-reference accumulator needs the block's RefRows")
            others = block.logits
        else:
            ref = ref_full(block.logits[0], y)
            others = block.logits[1:]
        self.nll[0].append(ref.nll)
        self._sum_nll0 += float(ref.nll.sum())
        self._count += len(y)
        for m, z in enumerate(others, start=1):
            st = compare_rows(ref, z, y)
            self.nll[m].append(st.nll)
            self.rows[m].append(st)

    def add_partial(self, part: "WindowPartial") -> None:
        """One window's values, as ``window_partial`` gives them (windows in plan order)."""
        if len(part.nll) != self.n_reports:
            raise ValueError(f"a partial of {len(part.nll)} reports for an accumulator of {self.n_reports}")
        self.nll[0].append(part.nll[0])
        self._sum_nll0 += float(part.nll[0].sum())
        self._count += len(part.nll[0])
        for m in range(1, self.n_reports):
            st = part.rows[m]
            assert st is not None
            self.nll[m].append(st.nll)
            self.rows[m].append(st)

    @property
    def count(self) -> int:
        return self._count

    @property
    def running_ppl(self) -> float:
        return _exp(self._sum_nll0 / self._count) if self._count else float("nan")

    def nll_of(self, m: int) -> np.ndarray:
        return np.concatenate(self.nll[m]) if self.nll[m] else np.zeros(0)

    def stats_of(self, m: int) -> RowStats:
        rs = self.rows[m]
        cat = lambda f, dt: np.concatenate([getattr(r, f) for r in rs]).astype(dt) if rs else np.zeros(0, dt)  # noqa: E731
        return RowStats(
            cat("nll", np.float64),
            cat("kld", np.float64),
            cat("rkld", np.float64),
            cat("dp", np.float64),
            cat("same", bool),
        )


@dataclass
class WindowPartial:
    """One window's per-token values for every report (the reference first): what a
    process scoring a share of the windows hands back, and what ``add_partial`` reduces.
    Concatenating these in plan order gives exactly the arrays ``add`` collects block by
    block, so every figure is the same whichever process scored which window."""

    window: int  # index into the plan
    nll: list[np.ndarray]  # per report, float64 [scored rows]
    rows: list[RowStats | None]  # per report; None for the reference

    @property
    def tokens(self) -> int:
        return len(self.nll[0])


def window_partial(
    window: int, blocks: Sequence[ScoredBlock], n_models: int, refs: Sequence[RefRows] | None = None
) -> WindowPartial:
    """The values of one window's scored blocks; ``refs`` (one per block) for a saved reference."""
    acc = PerplexityAccumulator(n_models, saved_ref=refs is not None)
    for i, block in enumerate(blocks):
        acc.add(block, None if refs is None else refs[i])
    return WindowPartial(
        window,
        [acc.nll_of(m) for m in range(acc.n_reports)],
        [None] + [acc.stats_of(m) for m in range(1, acc.n_reports)],
    )


@dataclass(frozen=True)
class PerplexityReport:
    """One model on one text under one window plan."""

    model: str
    nll: MeanEstimate  # nats per scored token
    tokens_scored: int
    bytes_scored: int

    # the perplexity, its delta-method SE (what llama.cpp prints after +/-) and 95% interval
    ppl, ppl_se, ppl_ci95 = _exp_estimate("nll")

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


# llama.cpp's percentiles (tools/perplexity: KLD and Δp statistics), by name.
KLD_QUANTILES = (
    ("max", 1.0),
    ("p99.9", 0.999),
    ("p99", 0.99),
    ("p95", 0.95),
    ("p90", 0.90),
    ("median", 0.5),
    ("p10", 0.10),
    ("p5", 0.05),
    ("p1", 0.01),
    ("p0.1", 0.001),
    ("min", 0.0),
)
DP_QUANTILES = (
    ("max", 1.0),
    ("p99.9", 0.999),
    ("p99", 0.99),
    ("p95", 0.95),
    ("p90", 0.90),
    ("p75", 0.75),
    ("median", 0.5),
    ("p25", 0.25),
    ("p10", 0.10),
    ("p5", 0.05),
    ("p1", 0.01),
    ("p0.1", 0.001),
    ("min", 0.0),
)


def quantiles(values: np.ndarray, which: Sequence[tuple[str, float]]) -> dict[str, float]:
    """Linear-interpolation percentiles (numpy's default; llama.cpp's ``percentile``)."""
    if not len(values):
        return {k: float("nan") for k, _ in which}
    qs = np.quantile(values, [p for _, p in which])
    return {k: float(v) for (k, _), v in zip(which, qs)}


@dataclass(frozen=True)
class RmsEstimate:
    """sqrt(mean x²) with the delta-method SE llama.cpp prints for RMS Δp."""

    rms: float
    se: float

    @classmethod
    def of(cls, x: np.ndarray) -> "RmsEstimate":
        x = np.asarray(x, np.float64)
        n = len(x)
        if n == 0:
            return cls(float("nan"), float("nan"))
        ms = float(np.mean(x * x))
        rms = math.sqrt(ms)
        if n < 2 or rms == 0:
            return cls(rms, float("nan") if n < 2 else 0.0)
        var_ms = max(float(np.mean(x**4)) - ms * ms, 0.0) / (n - 1)
        return cls(rms, math.sqrt(var_ms) / (2 * rms))


@dataclass(frozen=True)
class Comparison:
    """Model m against the reference on the same scored tokens (formulas: docs/evals.md)."""

    model: str
    reference: str
    log_ratio: MeanEstimate  # mean of NLL_m - NLL_0 per token: ln(ppl_m / ppl_0)
    kl: MeanEstimate  # KL(P_0 || P_m), nats per token
    kl_quantiles: dict[str, float]
    top1: MeanEstimate  # fraction of tokens whose argmax agrees
    rkl: MeanEstimate  # KL(P_m || P_0)
    rkl_quantiles: dict[str, float]
    dp: MeanEstimate  # Δp = P_m(y) - P_0(y)
    dp_quantiles: dict[str, float]
    dp_rms: RmsEstimate
    nll_correlation: float  # Pearson correlation of the per-token NLLs (llama.cpp's Cor(ln PPL(Q), ln PPL(base)))
    reference_form: str = "full"  # "full", or "top-K" for a compact saved reference

    # ppl_m / ppl_0, its delta-method SE (llama.cpp's ``Mean PPL(Q)/PPL(base)`` +/-) and 95% interval
    ppl_ratio, ppl_ratio_se, ppl_ratio_ci95 = _exp_estimate("log_ratio")

    @classmethod
    def of(cls, model: str, reference: str, nll_ref: np.ndarray, st: RowStats, form: str = "full") -> "Comparison":
        corr = (
            float(np.corrcoef(st.nll, nll_ref)[0, 1])
            if len(nll_ref) > 1 and np.std(st.nll) > 0 and np.std(nll_ref) > 0
            else float("nan")
        )
        return cls(
            model,
            reference,
            MeanEstimate.of(st.nll - nll_ref),
            MeanEstimate.of(st.kld),
            quantiles(st.kld, KLD_QUANTILES),
            MeanEstimate.of(st.same.astype(np.float64)),
            MeanEstimate.of(st.rkld),
            quantiles(st.rkld, KLD_QUANTILES),
            MeanEstimate.of(st.dp),
            quantiles(st.dp, DP_QUANTILES),
            RmsEstimate.of(st.dp),
            corr,
            form,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "reference": self.reference,
            "reference_form": self.reference_form,
            "tokens": self.kl.n,
            "ppl_ratio": self.ppl_ratio,
            "ppl_ratio_se": self.ppl_ratio_se,
            "ppl_ratio_ci95": list(self.ppl_ratio_ci95),
            "ln_ppl_ratio": self.log_ratio.mean,
            "ln_ppl_ratio_se": self.log_ratio.se,
            "nll_correlation": self.nll_correlation,
            "kl_mean": self.kl.mean,
            "kl_se": self.kl.se,
            "kl_quantiles": self.kl_quantiles,
            "reverse_kl_mean": self.rkl.mean,
            "reverse_kl_se": self.rkl.se,
            "reverse_kl_quantiles": self.rkl_quantiles,
            "top1_agreement": self.top1.mean,
            "top1_agreement_se": self.top1.se,
            "delta_p_mean": self.dp.mean,
            "delta_p_se": self.dp.se,
            "delta_p_quantiles": self.dp_quantiles,
            "delta_p_rms": self.dp_rms.rms,
            "delta_p_rms_se": self.dp_rms.se,
        }


def build_reports(
    acc: PerplexityAccumulator, names: list[str], bytes_scored: int, reference_form: str = "full"
) -> tuple[list[PerplexityReport], list[Comparison]]:
    """``names``: the reference first, then one per compared model (``acc.n_reports`` in all)."""
    reports, comps = [], []
    nll0 = acc.nll_of(0)
    for m, name in enumerate(names):
        nll = acc.nll_of(m)
        reports.append(PerplexityReport(name, MeanEstimate.of(nll), len(nll), bytes_scored))
        if m:
            comps.append(Comparison.of(name, names[0], nll0, acc.stats_of(m), reference_form))
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


__all__ = [
    "PerplexityAccumulator",
    "WindowPartial",
    "window_partial",
    "PerplexityReport",
    "Comparison",
    "RmsEstimate",
    "quantiles",
    "KLD_QUANTILES",
    "DP_QUANTILES",
    "build_reports",
    "run_perplexity",
    "PerplexityResult",
    "log_softmax_rows",
    "kl_rows",
    "Z95",
]
