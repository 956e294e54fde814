"""KL-divergence statistics against a float64 numpy computation on random logits, the
compact reference against the full one, and the .cref file as untrusted input."""

from __future__ import annotations

import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from evals.kl import compare_rows, ref_full, ref_topk
from evals.perplexity import DP_QUANTILES, KLD_QUANTILES, PerplexityAccumulator, build_reports
from evals.reference import ReferenceIdentity, ReferenceRecorder, SavedReference
from evals.scoring import ScoredBlock
from evals.windows import Window
from formats.cref import CrefFile
from formats.errors import CortiqError

V = 500


def random_pair(
    rows: int, seed: int, noise: float = 0.3, scale: float = 3.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reference logits, a perturbed model's, and targets drawn from the reference."""
    rng = np.random.default_rng(seed)
    z0 = (rng.standard_normal((rows, V)) * scale).astype(np.float32)
    z1 = (z0 + noise * rng.standard_normal((rows, V))).astype(np.float32)
    p = np.exp((z0 - z0.max(1, keepdims=True)).astype(np.float64))
    p /= p.sum(1, keepdims=True)
    y = np.array([rng.choice(V, p=row) for row in p], np.int64)
    return z0, z1, y


def oracle(z0: np.ndarray, z1: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Everything in float64, straight from the definitions."""
    a, b = z0.astype(np.float64), z1.astype(np.float64)
    lp = a - np.log(np.exp(a - a.max(1, keepdims=True)).sum(1, keepdims=True)) - a.max(1, keepdims=True)
    lq = b - np.log(np.exp(b - b.max(1, keepdims=True)).sum(1, keepdims=True)) - b.max(1, keepdims=True)
    p, q = np.exp(lp), np.exp(lq)
    r = np.arange(len(y))
    return {
        "nll0": -lp[r, y],
        "nll1": -lq[r, y],
        "kld": (p * (lp - lq)).sum(1),
        "rkld": (q * (lq - lp)).sum(1),
        "dp": q[r, y] - p[r, y],
        "same": a.argmax(1) == b.argmax(1),
    }


def llama_percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's ``percentile``: sort, then interpolate linearly at fraction * (n - 1)."""
    v = np.sort(values)
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    pos = fraction * (len(v) - 1)
    i = int(pos)
    f = pos - i
    return float((1 - f) * v[i] + f * v[min(i + 1, len(v) - 1)])


def test_row_statistics_match_float64():
    z0, z1, y = random_pair(70, 0)
    want = oracle(z0, z1, y)
    ref = ref_full(z0, y)
    got = compare_rows(ref, z1, y)
    np.testing.assert_allclose(ref.nll, want["nll0"], rtol=1e-12)
    np.testing.assert_allclose(got.nll, want["nll1"], rtol=1e-12)
    np.testing.assert_allclose(got.kld, want["kld"], rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(got.rkld, want["rkld"], rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(got.dp, want["dp"], rtol=1e-9, atol=1e-15)
    assert np.array_equal(got.same, want["same"]) and 0 < got.same.mean() < 1
    assert want["kld"].mean() > 0.01 and not np.allclose(want["kld"], want["rkld"])  # the two directions differ


def test_comparison_statistics_match_llama_cpp_definitions():
    z0, z1, y = random_pair(300, 1)
    want = oracle(z0, z1, y)
    acc = PerplexityAccumulator(2)
    for a in range(0, 300, 37):  # uneven blocks: the statistics must not depend on them
        b = min(a + 37, 300)
        acc.add(ScoredBlock(0, np.arange(a, b), y[a:b], [z0[a:b], z1[a:b]]))
    reports, (c,) = build_reports(acc, ["ref", "q"], bytes_scored=1000)
    n = len(y)
    d = want["nll1"] - want["nll0"]
    # llama.cpp: Mean ln(PPL(Q)/PPL(base)) and its uncertainty from the paired sums
    assert c.log_ratio.mean == pytest.approx(d.mean(), rel=1e-12)
    assert c.log_ratio.se == pytest.approx(math.sqrt((np.mean(d * d) - d.mean() ** 2) / (n - 1)), rel=1e-9)
    assert c.ppl_ratio == pytest.approx(math.exp(d.mean()), rel=1e-12)
    assert c.ppl_ratio_se == pytest.approx(math.exp(d.mean()) * c.log_ratio.se, rel=1e-12)
    assert c.nll_correlation == pytest.approx(np.corrcoef(want["nll0"], want["nll1"])[0, 1], rel=1e-9)
    k = want["kld"]
    assert c.kl.mean == pytest.approx(k.mean(), rel=1e-9)
    assert c.kl.se == pytest.approx(math.sqrt((np.mean(k * k) - k.mean() ** 2) / (n - 1)), rel=1e-6)
    for key, frac in KLD_QUANTILES:
        assert c.kl_quantiles[key] == pytest.approx(llama_percentile(k, frac), rel=1e-9), key
    assert c.rkl.mean == pytest.approx(want["rkld"].mean(), rel=1e-9)
    dp = want["dp"]
    assert c.dp.mean == pytest.approx(dp.mean(), rel=1e-9, abs=1e-15)
    for key, frac in DP_QUANTILES:
        assert c.dp_quantiles[key] == pytest.approx(llama_percentile(dp, frac), rel=1e-9, abs=1e-15), key
    ms = np.mean(dp**2)
    assert c.dp_rms.rms == pytest.approx(math.sqrt(ms), rel=1e-9)
    # llama.cpp: RMS Δp uncertainty from Σ Δp² and Σ Δp⁴ by the delta method
    assert c.dp_rms.se == pytest.approx(math.sqrt((np.mean(dp**4) - ms * ms) / (n - 1)) / (2 * math.sqrt(ms)), rel=1e-6)
    s = want["same"].mean()
    assert c.top1.mean == pytest.approx(s, abs=1e-15)
    assert c.top1.se == pytest.approx(math.sqrt(s * (1 - s) / (n - 1)), rel=1e-9)
    assert reports[0].nll.mean == pytest.approx(want["nll0"].mean(), rel=1e-12)
    assert set(c.to_json()) >= {
        "kl_mean",
        "kl_se",
        "kl_quantiles",
        "reverse_kl_mean",
        "delta_p_rms",
        "delta_p_quantiles",
        "top1_agreement",
        "top1_agreement_se",
        "ppl_ratio",
        "ppl_ratio_ci95",
    }


def test_identical_models_have_zero_divergence():
    z0, _, y = random_pair(40, 2)
    st = compare_rows(ref_full(z0, y), z0, y)
    assert st.kld.max() == 0 and st.rkld.max() == 0 and st.dp.max() == 0 and st.same.all()
    # The compact form keeps float32 log-probabilities: its floor is float32 rounding.
    st = compare_rows(ref_topk(z0, y, 8), z0, y)
    assert st.kld.max() < 1e-7 and st.rkld.max() < 1e-7 and st.same.all()


def test_compact_reference_against_full():
    z0, z1, y = random_pair(120, 3, noise=0.2, scale=4.0)
    want = oracle(z0, z1, y)
    full = compare_rows(ref_full(z0, y), z1, y)
    # Every id kept: the compact form is exact.
    allk = compare_rows(ref_topk(z0, y, V), z1, y)
    np.testing.assert_allclose(allk.kld, want["kld"], rtol=1e-4, atol=2e-7)  # float32 log-probabilities
    np.testing.assert_allclose(allk.rkld, want["rkld"], rtol=1e-4, atol=2e-7)
    prev = 0.0
    for k in (4, 16, 64, 256):
        st = compare_rows(ref_topk(z0, y, k), z1, y)
        # coarse-graining never increases a KL (data-processing inequality) ...
        assert np.all(st.kld <= full.kld + 2e-7) and np.all(st.rkld <= full.rkld + 2e-7)
        # ... and more ids kept is closer
        assert st.kld.mean() >= prev - 1e-12
        prev = st.kld.mean()
        # the target's probability, top-1 and NLL do not depend on k
        np.testing.assert_allclose(st.dp, full.dp, rtol=1e-6, atol=1e-9)
        assert np.array_equal(st.same, full.same)
    assert prev == pytest.approx(full.kld.mean(), rel=0.02)


def test_sampled_tail_estimate_is_unbiased():
    """With tail samples the compact form estimates the full KLs, not a lower bound: a
    high-entropy reference (most of P's mass outside the top 8) shows the difference."""
    z0, z1, y = random_pair(400, 4, noise=0.2, scale=1.5)
    want = oracle(z0, z1, y)
    bound = compare_rows(ref_topk(z0, y, 8), z1, y)
    assert bound.kld.mean() < 0.5 * want["kld"].mean()  # the coarse-grained KL misses most of it
    for m in (16, 64):
        st = compare_rows(ref_topk(z0, y, 8, m), z1, y)
        assert st.kld.mean() == pytest.approx(want["kld"].mean(), rel=0.03)
        assert st.rkld.mean() == pytest.approx(want["rkld"].mean(), rel=0.03)
        assert np.all(st.kld >= bound.kld - 1e-12)  # the tail term is never negative
        # per token the estimate is close too, and closer with more samples
        err = np.abs(st.kld - want["kld"]).mean() / want["kld"].mean()
        assert err < (0.25 if m == 16 else 0.12)
    # the draw depends on the row index, not on how the rows are blocked
    a = ref_topk(z0, y, 8, 16, first_row=100)
    b = ref_topk(z0[50:], y[50:], 8, 16, first_row=150)
    np.testing.assert_array_equal(a.sample_ids[50:], b.sample_ids)


def test_topk_ties_keep_argmax_first():
    z = np.zeros((2, 10), np.float32)
    z[0, [3, 7]] = 5.0
    r = ref_topk(z, np.array([0, 1]), 3)
    assert r.top_ids[0, 0] == 3 == r.top1[0] and r.top_ids[1, 0] == 0 == r.top1[1]
    assert math.exp(r.tail_logp[0]) == pytest.approx(7 / (2 * math.exp(5) + 8), rel=1e-6)


# ----------------------------------------------------------------- the .cref file


def write_ref(
    path: Path, top_k: int, rows_per_block: int = 25, samples: int = 0
) -> tuple[np.ndarray, list[Window], np.ndarray, np.ndarray]:
    """A 3-window plan over 130 tokens, saved from random reference logits."""
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, V, 130)
    windows = [Window(0, 50, 0, 49), Window(40, 90, 9, 49), Window(80, 130, 9, 49, bos=1)]
    n = sum(w.n_scored for w in windows)
    z0, _, _ = random_pair(n, 6)
    y = np.concatenate([tokens[w.targets] for w in windows])
    rec = ReferenceRecorder(
        path,
        tokens=tokens,
        windows=windows,
        vocab_size=V,
        top_k=top_k,
        samples=samples,
        meta={
            "model": {"label": "m"},
            "tokenizer": {"fingerprint": "abc"},
            "text": {"sha256": "t", "source": "s"},
            "settings": {"mode": "sliding", "ctx": 50},
        },
    )
    for a in range(0, n, rows_per_block):
        rec.add(z0[a : a + rows_per_block], y[a : a + rows_per_block])
    rec.commit()
    return tokens, windows, z0, y


@pytest.mark.parametrize("top_k,samples", [(0, 0), (16, 0), (16, 8)])
def test_cref_round_trip(tmp_path, top_k, samples):
    p = tmp_path / "r.cref"
    tokens, windows, z0, y = write_ref(p, top_k, samples=samples)
    ref = SavedReference(p)
    ref.check(ReferenceIdentity("abc", "t", V), tokens, windows)
    assert ref.windows() == windows and ref.form == {0: "full", 16: "top-16"}[top_k] + (
        f"+{samples}" if samples else ""
    )
    got = [ref.next_rows(n) for n in (30, 60, len(y) - 90)]
    nll = np.concatenate([g.nll for g in got])
    np.testing.assert_array_equal(nll, ref_full(z0, y).nll)  # float64, bit for bit
    want = ref_topk(z0, y, top_k, samples) if top_k else ref_full(z0, y)
    if top_k:
        np.testing.assert_array_equal(np.concatenate([g.top_ids for g in got]), want.top_ids)
        np.testing.assert_array_equal(np.concatenate([g.top_logp for g in got]), want.top_logp)
    if samples:  # written in blocks of 25 rows, drawn here in one: the same draw
        np.testing.assert_array_equal(np.concatenate([g.sample_ids for g in got]), want.sample_ids)
        np.testing.assert_array_equal(np.concatenate([g.sample_logp for g in got]), want.sample_logp)
    if not top_k:
        np.testing.assert_array_equal(np.concatenate([g.logp for g in got]), want.logp.astype(np.float32))
    size = p.stat().st_size
    per_row = 8 + 4 + (top_k * 8 + 4 + samples * 8 if top_k else V * 4)
    assert len(y) * per_row < size < len(y) * per_row + 130 * 4 + 3 * 40 + 8 * 64 + 4096


def test_cref_mismatches_are_one_line_errors(tmp_path):
    p = tmp_path / "r.cref"
    tokens, windows, _, _ = write_ref(p, 8)
    ref = SavedReference(p)
    cases = [
        (ReferenceIdentity("abc", "other", V), tokens, windows, "another text"),
        (ReferenceIdentity("xyz", "t", V), tokens, windows, "another tokenizer"),
        (ReferenceIdentity("abc", "t", V + 1), tokens, windows, "another tokenizer"),
        (
            ReferenceIdentity("abc", "t", V),
            np.r_[tokens[:-1], (tokens[-1] + 1) % V],
            windows,
            "tokenizes the text differently",
        ),
        (ReferenceIdentity("abc", "t", V), tokens, windows[:2], "other windows"),
    ]
    for ident, toks, wins, msg in cases:
        with pytest.raises(CortiqError, match=msg) as e:
            ref.check(ident, toks, wins)
        assert "\n" not in str(e.value)


def rewrite_header(p: Path, edit) -> None:
    """Edit the header JSON of ``p`` and give it a valid checksum (so the deeper checks run)."""
    raw = bytearray(p.read_bytes())
    hoff, hlen = struct.unpack_from("<QQ", raw, 16)
    h = json.loads(raw[hoff : hoff + hlen])
    edit(h)
    hjson = json.dumps(h).encode()
    head = bytes(raw[:16]) + struct.pack("<QQ", hoff, len(hjson))
    crc = zlib.crc32(hjson, zlib.crc32(head)) & 0xFFFFFFFF
    out = head + struct.pack("<I", crc) + bytes(raw[36:hoff]) + hjson
    p.write_bytes(out)


def set_array_bytes(p: Path, name: str, values: np.ndarray, row: int = 0) -> None:
    """Overwrite one value of an array and fix its CRC: only the value checks can catch it."""
    raw = bytearray(p.read_bytes())
    hoff, hlen = struct.unpack_from("<QQ", raw, 16)
    e = json.loads(raw[hoff : hoff + hlen])["arrays"][name]
    a = np.frombuffer(raw, dtype=e["dtype"], count=int(np.prod(e["shape"])), offset=e["offset"]).copy()
    a[row : row + len(values)] = values
    raw[e["offset"] : e["offset"] + e["nbytes"]] = a.tobytes()
    p.write_bytes(bytes(raw))
    rewrite_header(p, lambda h: h["arrays"][name].update(crc32=zlib.crc32(a.tobytes()) & 0xFFFFFFFF))


CORRUPTIONS = {
    "empty": (lambda p: p.write_bytes(b""), "not a cortiq reference file"),
    "magic": (lambda p: p.write_bytes(b"GGUF" + p.read_bytes()[4:]), "not a cortiq reference file"),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:-10]), "corrupt or truncated"),
    "header bit": (lambda p: p.write_bytes(p.read_bytes()[:-5] + b"X" + p.read_bytes()[-4:]), "checksum"),
    "array bit": (lambda p: p.write_bytes(p.read_bytes()[:200] + b"\xff" + p.read_bytes()[201:]), "checksum mismatch"),
    "version": (lambda p: p.write_bytes(p.read_bytes()[:8] + b"\x09\x00" + p.read_bytes()[10:]), "version"),
    "rows": (lambda p: rewrite_header(p, lambda h: h.update(rows=10**15)), "rows"),
    "shape": (lambda p: rewrite_header(p, lambda h: h["arrays"]["nll"].update(shape=[3])), "array nll"),
    "offset": (lambda p: rewrite_header(p, lambda h: h["arrays"]["nll"].update(offset=10**12)), "offset"),
    "overlap": (
        lambda p: rewrite_header(
            p,
            lambda h: h["arrays"]["nll"].update(
                offset=h["arrays"]["tokens"]["offset"], crc32=h["arrays"]["tokens"]["crc32"]
            ),
        ),
        "nll",
    ),
    "meta": (lambda p: rewrite_header(p, lambda h: h.update(meta=[1])), "meta"),
    "json": (lambda p: rewrite_header(p, lambda h: h.update(top_k="8")), "top_k"),
    "samples": (lambda p: rewrite_header(p, lambda h: h.update(tail_samples=3)), "arrays"),
    "window": (lambda p: set_array_bytes(p, "windows", np.array([0, 999, 0, 49, -1])), "window 0"),
    "token": (lambda p: set_array_bytes(p, "tokens", np.array([V + 5])), "outside the vocabulary"),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupt_cref_is_one_line_error(tmp_path, name):
    p = tmp_path / "r.cref"
    write_ref(p, 8)
    corrupt, msg = CORRUPTIONS[name]
    corrupt(p)
    with pytest.raises(CortiqError, match=msg) as e:
        SavedReference(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


@pytest.mark.parametrize(
    "array,value,msg",
    [
        ("top_ids", [V], "top_ids"),
        ("sample_ids", [-3], "sample_ids"),
        ("sample_logp", [np.inf], "sample_logp"),
        ("top_logp", [np.nan], "top_logp"),
        ("top_logp", [3.0], "top_logp"),
        ("nll", [np.inf], "nll"),
        ("tail_logp", [np.nan], "tail_logp"),
        ("top1", [-1], "top1"),
    ],
)
def test_bad_values_are_caught_when_read(tmp_path, array, value, msg):
    p = tmp_path / "r.cref"
    write_ref(p, 8, samples=4)
    set_array_bytes(p, array, np.array(value), row=3)
    f = CrefFile(p)
    f.block(4, 20)  # the rows without the bad value read fine
    with pytest.raises(CortiqError, match=msg) as e:
        f.block(0, 20)
    assert "\n" not in str(e.value)


def test_interrupted_write_leaves_nothing(tmp_path):
    p = tmp_path / "r.cref"
    rec = ReferenceRecorder(p, tokens=np.arange(10), windows=[Window(0, 10, 0, 9)], vocab_size=V, top_k=4, meta={})
    rec.add(np.zeros((3, V), np.float32), np.zeros(3, np.int64))
    rec.abort()
    assert list(tmp_path.iterdir()) == []
