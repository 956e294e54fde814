"""How far a model's next-token distributions drift from a reference's, per scored position.

The reference P is seen through ``RefRows``: either its full log-probabilities
(a live reference model, or a saved reference written in full) or a compact form
(a saved ``.cref``: per position its top-k log-probabilities, the log of the mass
outside them, its argmax and its target NLL). ``compare_rows`` gives, per row,

* ``nll``   the model's NLL of the target, −log Q(y)
* ``kld``   KL(P‖Q) = Σ_v P(v) (log P(v) − log Q(v))
* ``rkld``  KL(Q‖P) = Σ_v Q(v) (log Q(v) − log P(v))
* ``dp``    Q(y) − P(y)  (llama.cpp's Δp: negative when the model lost probability on the target)
* ``same``  [argmax Q = argmax P]

From the compact form, each KL is that of the distributions coarse-grained to
(top-k tokens of P, everything else), a lower bound by the data-processing
inequality, plus (when the file holds tail samples) an unbiased sampled estimate of
what the coarse-graining loses: the tails' own divergence. Formulas and measured errors: docs/evals.md.

All arithmetic is float64, over slices of ``SUB_ROWS`` rows so the temporaries stay
a few rows x vocab (Gemma 3's vocabulary is 262,144).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SUB_ROWS = 16
SAMPLE_SEED = 0x6B6C64  # fixed: a saved reference is reproducible


def _log_softmax64(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    s = z - z.max(axis=1, keepdims=True)
    return s - np.log(np.exp(s).sum(axis=1, keepdims=True))


def _argmax_first(z: np.ndarray) -> np.ndarray:
    return np.asarray(z).argmax(axis=1).astype(np.int64)


@dataclass
class RefRows:
    """The reference's view of one block of scored rows."""

    nll: np.ndarray  # float64 [rows]: −log P(y)
    top1: np.ndarray  # int64 [rows]: argmax P (first index on ties)
    logp: np.ndarray | None = None  # float64 or float32 [rows, V]: full log P
    top_ids: np.ndarray | None = None  # int32 [rows, k]: P's k most probable ids, most probable first
    top_logp: np.ndarray | None = None  # float32 [rows, k]: their log P
    tail_logp: np.ndarray | None = None  # float32 [rows]: log of P's mass outside top_ids (−inf when none)
    sample_ids: np.ndarray | None = (
        None  # int32 [rows, m]: ids drawn from P restricted to the tail (systematic sampling)
    )
    sample_logp: np.ndarray | None = None  # float32 [rows, m]: their log P

    @property
    def rows(self) -> int:
        return len(self.nll)

    @property
    def compact(self) -> bool:
        return self.logp is None

    def slice(self, a: int, b: int) -> "RefRows":
        cut = lambda x: None if x is None else x[a:b]  # noqa: E731
        return RefRows(
            self.nll[a:b],
            self.top1[a:b],
            cut(self.logp),
            cut(self.top_ids),
            cut(self.top_logp),
            cut(self.tail_logp),
            cut(self.sample_ids),
            cut(self.sample_logp),
        )


def ref_full(logits: np.ndarray, targets: np.ndarray) -> RefRows:
    """A live reference block: full float64 log-probabilities."""
    rows = np.arange(len(targets))
    logp = _log_softmax64(logits)
    return RefRows(nll=-logp[rows, targets], top1=_argmax_first(logits), logp=logp)


def ref_topk(logits: np.ndarray, targets: np.ndarray, k: int, samples: int = 0, first_row: int = 0) -> RefRows:
    """The compact form of a reference block (what a ``.cref`` stores), computed sub-block by sub-block.

    ``samples`` tail ids per row are drawn from P restricted to the tail by systematic
    sampling (``samples`` evenly spaced points of its CDF after one uniform offset, seeded
    by the row's index ``first_row + r`` so the draw does not depend on how rows are blocked).
    """
    n, v = logits.shape
    k = min(int(k), v)
    m = int(samples) if k < v else 0
    nll = np.empty(n, np.float64)
    top1 = np.empty(n, np.int64)
    ids = np.empty((n, k), np.int32)
    lps = np.empty((n, k), np.float32)
    tail = np.empty(n, np.float32)
    s_ids = np.zeros((n, m), np.int32)
    s_lps = np.zeros((n, m), np.float32)
    for a in range(0, n, SUB_ROWS):
        b = min(a + SUB_ROWS, n)
        logp = _log_softmax64(logits[a:b])
        r = np.arange(b - a)
        nll[a:b] = -logp[r, targets[a:b]]
        top1[a:b] = _argmax_first(logits[a:b])
        part = np.argpartition(-logp, k - 1, axis=1)[:, :k] if k < v else np.tile(np.arange(v), (b - a, 1))
        part.sort(axis=1)  # ids ascending, so the stable sort below breaks ties by lower id (as argmax does)
        vals = np.take_along_axis(logp, part, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        part = np.take_along_axis(part, order, axis=1)
        vals = np.take_along_axis(vals, order, axis=1)
        ids[a:b] = part
        lps[a:b] = vals
        # The tail mass directly (not 1 − Σ top, which cancels): exact even when it is 1e-12.
        mask = np.ones_like(logp, dtype=bool)
        np.put_along_axis(mask, part, False, axis=1)
        p_tail = np.where(mask, np.exp(logp), 0.0)
        cdf = np.cumsum(p_tail, axis=1)
        t = cdf[:, -1]
        with np.errstate(divide="ignore"):
            tail[a:b] = np.log(t)
        for i in range(b - a if m else 0):
            if t[i] <= 0:
                continue  # no tail: the samples are never used (their weight is T_P = 0)
            u0 = np.random.default_rng([SAMPLE_SEED, first_row + a + i]).random()
            pick = np.searchsorted(cdf[i], (np.arange(m) + u0) / m * t[i], side="right")
            pick = np.minimum(pick, v - 1)
            s_ids[a + i] = pick
            s_lps[a + i] = logp[i, pick]
    if m:
        return RefRows(
            nll=nll, top1=top1, top_ids=ids, top_logp=lps, tail_logp=tail, sample_ids=s_ids, sample_logp=s_lps
        )
    return RefRows(nll=nll, top1=top1, top_ids=ids, top_logp=lps, tail_logp=tail)


@dataclass
class RowStats:
    nll: np.ndarray  # float64 [rows]
    kld: np.ndarray  # float64 [rows]
    rkld: np.ndarray  # float64 [rows]
    dp: np.ndarray  # float64 [rows]
    same: np.ndarray  # bool [rows]


def _xlogy_ratio(a: np.ndarray, log_a: np.ndarray, log_b: np.ndarray) -> np.ndarray:
    """a · (log a − log b), 0 where a = 0."""
    with np.errstate(invalid="ignore"):
        out = a * (log_a - log_b)
    return np.where(a > 0, out, 0.0)


def compare_rows(ref: RefRows, logits: np.ndarray, targets: np.ndarray) -> RowStats:
    """Per-row statistics of the model whose logits are ``logits`` against ``ref``."""
    n = len(targets)
    out = RowStats(np.empty(n), np.empty(n), np.empty(n), np.empty(n), np.empty(n, bool))
    for a in range(0, n, SUB_ROWS):
        b = min(a + SUB_ROWS, n)
        r = ref.slice(a, b)
        logq = _log_softmax64(logits[a:b])
        q = np.exp(logq)
        rows = np.arange(b - a)
        nll = -logq[rows, targets[a:b]]
        out.nll[a:b] = nll
        out.same[a:b] = _argmax_first(logits[a:b]) == r.top1
        out.dp[a:b] = np.exp(-nll) - np.exp(-r.nll)
        if r.logp is not None:
            logp = np.asarray(r.logp, dtype=np.float64)
            p = np.exp(logp)
            d = logp - logq
            out.kld[a:b] = np.einsum("ij,ij->i", p, d)
            out.rkld[a:b] = -np.einsum("ij,ij->i", q, d)
        else:
            assert r.top_ids is not None and r.top_logp is not None and r.tail_logp is not None
            lp = r.top_logp.astype(np.float64)
            # Q's mass outside P's top-k, summed directly (no cancellation).
            ids = r.top_ids.astype(np.int64)
            lq = np.take_along_axis(logq, ids, axis=1)
            qk = np.take_along_axis(q, ids, axis=1)
            np.put_along_axis(q, ids, 0.0, axis=1)
            tail_q = q.sum(axis=1)
            with np.errstate(divide="ignore"):
                log_tq = np.log(tail_q)
            log_tp = r.tail_logp.astype(np.float64)
            tp = np.exp(log_tp)
            kld = (np.exp(lp) * (lp - lq)).sum(axis=1) + _xlogy_ratio(tp, log_tp, log_tq)
            rkld = (qk * (lq - lp)).sum(axis=1) + _xlogy_ratio(tail_q, log_tq, log_tp)
            if r.sample_ids is not None and r.sample_ids.shape[1]:
                # The tails' own divergence, T_P·KL(P_t‖Q_t) and T_Q·KL(Q_t‖P_t), as expectations
                # under P_t of f(ρ) with ρ = Q_t/P_t: f = ρ − 1 − log ρ and ρ log ρ − ρ + 1 (both ≥ 0).
                sl = r.sample_logp.astype(np.float64)
                sq = np.take_along_axis(logq, r.sample_ids.astype(np.int64), axis=1)
                ok = (tp > 0) & (tail_q > 0)
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    log_rho = (sq - log_tq[:, None]) - (sl - log_tp[:, None])
                    rho = np.exp(log_rho)
                    fwd = (rho - 1 - log_rho).mean(axis=1)
                    rev = (rho * log_rho - rho + 1).mean(axis=1)
                kld = kld + np.where(ok, tp * fwd, 0.0)
                rkld = rkld + np.where(ok, tail_q * rev, 0.0)
            out.kld[a:b] = kld
            out.rkld[a:b] = rkld
    # Rounding can leave −1e-17 where the true value is 0; a KL is never negative.
    np.maximum(out.kld, 0.0, out=out.kld)
    np.maximum(out.rkld, 0.0, out=out.rkld)
    return out


__all__ = ["RefRows", "RowStats", "ref_full", "ref_topk", "compare_rows", "SUB_ROWS"]
