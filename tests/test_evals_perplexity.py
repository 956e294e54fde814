"""Perplexity, KL and top-1 agreement against transformers, with a torch model behind the engine API."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from evals.perplexity import run_perplexity  # noqa: E402
from evals.scoring import iter_scored  # noqa: E402
from evals.windows import chunk_windows, sliding_windows  # noqa: E402
from tests.tiny import build_tiny  # noqa: E402

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity. "
) * 3


class ByteTokenizer:
    add_bos, bos_id = False, None

    def encode(self, text, add_bos=True):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


class TorchEngine:
    """The engine contract (iter_logits) served by a transformers model: the oracle's own logits."""

    def __init__(self, model):
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.tokenizer = ByteTokenizer()
        self.calls = 0

    def iter_logits(self, ids, chunk=512, sub=None, first=0):
        self.calls += 1
        with torch.no_grad():
            z = self.model(torch.tensor([ids])).logits[0].float().numpy()
        for s in range(first, len(ids), chunk):
            yield s, z[s : s + chunk]


@pytest.fixture(scope="module")
def models():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: threads only add contention
    yield build_tiny("llama", seed=0), build_tiny("llama", seed=1)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokens():
    return np.array(ByteTokenizer().encode(TEXT), dtype=np.int64)


def hf_guide_nll(model, ids, max_length, stride):
    """The loop of the HF perplexity guide, verbatim in spirit: mean NLL over all scored tokens."""
    input_ids = torch.tensor([ids])
    seq_len = input_ids.size(1)
    nll_sum, n_tokens, prev_end = 0.0, 0, 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        trg_len = end - prev_end
        inp = input_ids[:, begin:end]
        target = inp.clone()
        target[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(inp, labels=target).loss
        n_valid = int((target[:, 1:] != -100).sum())
        if n_valid:
            nll_sum += float(loss) * n_valid
            n_tokens += n_valid
        prev_end = end
        if end == seq_len:
            break
    return nll_sum / n_tokens, n_tokens


@pytest.mark.parametrize("ctx,stride", [(64, 32), (64, 64), (100, 17), (512, 512)])
def test_sliding_equals_hf_guide(models, tokens, ctx, stride):
    want, n = hf_guide_nll(models[0], tokens.tolist(), ctx, stride)
    res = run_perplexity(
        [TorchEngine(models[0])], ["a"], tokens, sliding_windows(len(tokens), ctx, stride), ByteTokenizer(), chunk=24
    )
    r = res.reports[0]
    assert r.tokens_scored == n
    assert r.nll.mean == pytest.approx(want, rel=1e-5)
    assert r.ppl == pytest.approx(math.exp(want), rel=1e-5)


def llama_cpp_chunk_nlls(model, ids, n_ctx, bos):
    """tools/perplexity's loop: chunk i = ids[i*n_ctx:(i+1)*n_ctx], first token set to BOS, logits first..n_ctx-2."""
    first = n_ctx // 2
    out = []
    for i in range(len(ids) // n_ctx):
        chunk = list(ids[i * n_ctx : (i + 1) * n_ctx])
        if bos is not None:
            chunk[0] = bos
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([chunk])).logits[0].double(), dim=-1)
        for j in range(first, n_ctx - 1):
            out.append(-float(logp[j, ids[i * n_ctx + j + 1]]))
    return np.array(out)


@pytest.mark.parametrize("bos", [None, 7])
def test_chunks_equal_llama_cpp_loop(models, tokens, bos):
    want = llama_cpp_chunk_nlls(models[0], tokens.tolist(), 64, bos)
    res = run_perplexity(
        [TorchEngine(models[0])], ["a"], tokens, chunk_windows(len(tokens), 64, bos=bos), ByteTokenizer(), chunk=40
    )
    r = res.reports[0]
    assert r.tokens_scored == len(want) == (len(tokens) // 64) * 31
    assert r.nll.mean == pytest.approx(want.mean(), rel=1e-5)
    # llama.cpp's uncertainty: sqrt((E[x^2] - E[x]^2) / (n - 1)), times ppl
    se = math.sqrt(((want**2).mean() - want.mean() ** 2) / (len(want) - 1))
    assert r.nll.se == pytest.approx(se, rel=1e-4)
    assert r.ppl_se == pytest.approx(math.exp(want.mean()) * se, rel=1e-4)
    lo, hi = r.ppl_ci95
    assert lo == pytest.approx(math.exp(want.mean() - 1.959964 * se), rel=1e-4)
    assert hi == pytest.approx(math.exp(want.mean() + 1.959964 * se), rel=1e-4)


def test_bos_changes_chunk_scores(models, tokens):
    a = llama_cpp_chunk_nlls(models[0], tokens.tolist(), 64, None)
    b = llama_cpp_chunk_nlls(models[0], tokens.tolist(), 64, 7)
    assert abs(a.mean() - b.mean()) > 1e-6  # so the BOS test above is not vacuous


def test_kl_and_top1_against_torch(models, tokens):
    ctx, stride = 80, 40
    windows = sliding_windows(len(tokens), ctx, stride)
    res = run_perplexity([TorchEngine(m) for m in models], ["ref", "other"], tokens, windows, ByteTokenizer(), chunk=32)
    kls, agree, nll0, nll1 = [], [], [], []
    for w in windows:
        ids = torch.tensor([tokens[w.begin : w.end].tolist()])
        with torch.no_grad():
            lp0 = torch.log_softmax(models[0](ids).logits[0].double(), -1)[w.row_from : w.row_to]
            lp1 = torch.log_softmax(models[1](ids).logits[0].double(), -1)[w.row_from : w.row_to]
        y = torch.tensor(tokens[w.targets])
        kls += (lp0.exp() * (lp0 - lp1)).sum(-1).tolist()
        agree += (lp0.argmax(-1) == lp1.argmax(-1)).tolist()
        nll0 += (-lp0[torch.arange(len(y)), y]).tolist()
        nll1 += (-lp1[torch.arange(len(y)), y]).tolist()
    (c,) = res.comparisons
    assert c.kl.mean == pytest.approx(np.mean(kls), rel=1e-4)
    assert c.kl.mean > 0.01
    assert c.top1.mean == pytest.approx(np.mean(agree), abs=1e-12)
    assert 0 < c.top1.mean < 1
    assert c.ppl_ratio == pytest.approx(math.exp(np.mean(nll1) - np.mean(nll0)), rel=1e-5)
    assert res.reports[1].nll.mean == pytest.approx(np.mean(nll1), rel=1e-5)
    assert c.kl_quantiles["max"] == pytest.approx(max(kls), rel=1e-4)


def test_self_comparison_is_zero(models, tokens):
    e = TorchEngine(models[0])
    res = run_perplexity([e, e], ["a", "a"], tokens, sliding_windows(len(tokens), 64, 32), ByteTokenizer())
    (c,) = res.comparisons
    assert c.kl.mean < 1e-7 and c.top1.mean == 1.0 and c.ppl_ratio == pytest.approx(1.0, abs=1e-12)


def test_bits_per_byte(models, tokens):
    res = run_perplexity([TorchEngine(models[0])], ["a"], tokens, sliding_windows(len(tokens), 64, 32), ByteTokenizer())
    r = res.reports[0]
    assert r.bytes_scored == len(tokens) - 1  # one token per byte; every byte but the first is scored
    assert r.bits_per_byte == pytest.approx(r.nll.mean / math.log(2))


def test_blocks_are_bounded_and_aligned(models, tokens):
    eng = TorchEngine(models[0])
    windows = sliding_windows(len(tokens), 100, 30)
    seen = []
    for b in iter_scored([eng], tokens, windows, chunk=16):
        assert b.logits[0].shape == (len(b.targets), 256) and len(b.targets) <= 16
        np.testing.assert_array_equal(b.targets, tokens[b.positions])
        seen += b.positions.tolist()
    assert seen == list(range(1, len(tokens)))
    assert eng.calls == len(windows)


def test_running_progress(models, tokens):
    calls = []
    run_perplexity(
        [TorchEngine(models[0])],
        ["a"],
        tokens,
        sliding_windows(len(tokens), 64, 32),
        ByteTokenizer(),
        chunk=16,
        progress=lambda d, t, p: calls.append((d, t, p)),
    )
    assert calls[-1][0] == calls[-1][1] == len(tokens) - 1
    assert all(a[0] < b[0] for a, b in zip(calls, calls[1:]))
    assert all(math.isfinite(p) and p > 1 for _, _, p in calls)
