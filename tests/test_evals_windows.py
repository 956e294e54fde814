"""Window plans against the loops they imitate, written out plainly."""

from __future__ import annotations

import pytest

from evals.windows import chunk_windows, sliding_windows
from formats.errors import CortiqError


def hf_guide_targets(n: int, ctx: int, stride: int) -> list[list[int]]:
    """The HF perplexity guide's loop: which absolute positions each window's loss covers."""
    out = []
    prev_end = 0
    for begin in range(0, n, stride):
        end = min(begin + ctx, n)
        trg_len = end - prev_end
        labelled = range(end - trg_len, end)  # labels not masked to -100
        out.append([p for p in labelled if p > begin])  # the shift drops the window's first label
        prev_end = end
        if end == n:
            break
    return [t for t in out if t]


@pytest.mark.parametrize(
    "n,ctx,stride", [(100, 16, 8), (100, 16, 16), (101, 16, 5), (17, 16, 8), (16, 16, 4), (5, 16, 8), (2, 4, 1)]
)
def test_sliding_matches_hf_guide(n, ctx, stride):
    ws = sliding_windows(n, ctx, stride)
    got = [list(range(w.targets.start, w.targets.stop)) for w in ws]
    assert got == hf_guide_targets(n, ctx, stride)
    for w in ws:
        assert w.end - w.begin <= ctx
        assert 0 <= w.row_from < w.row_to <= w.end - w.begin - 1
        for p in range(w.targets.start, w.targets.stop):  # tokens of context before each target
            assert p - w.begin >= (ctx - stride if w.begin > 0 else p)
    if stride < ctx:
        flat = [p for t in got for p in t]
        assert flat == list(range(1, n))  # every token but the first, exactly once


def test_sliding_max_scored_caps_tokens():
    ws = sliding_windows(1000, 64, 32, max_scored=100)
    assert sum(w.n_scored for w in ws) == 100
    assert ws[-1].targets.stop == 101


def llama_cpp_chunks(n: int, ctx: int) -> list[list[int]]:
    """tools/perplexity: n // ctx chunks; logits j in [ctx/2, ctx-2] predict token start + j + 1."""
    first = ctx // 2
    return [[i * ctx + j + 1 for j in range(first, ctx - 1)] for i in range(n // ctx)]


@pytest.mark.parametrize("n,ctx", [(100, 16), (64, 16), (63, 16), (1000, 7)])
def test_chunks_match_llama_cpp(n, ctx):
    ws = chunk_windows(n, ctx, bos=5)
    assert [list(range(w.targets.start, w.targets.stop)) for w in ws] == llama_cpp_chunks(n, ctx)
    assert all(w.bos == 5 and w.end - w.begin == ctx for w in ws)


def test_chunks_caps():
    assert len(chunk_windows(1000, 16, max_chunks=3)) == 3
    ws = chunk_windows(1000, 16, max_scored=20)  # 7 per chunk: 7 + 7 + 6
    assert [w.n_scored for w in ws] == [7, 7, 6]


@pytest.mark.parametrize(
    "call,msg",
    [
        (lambda: sliding_windows(1, 16, 8), "at least 2"),
        (lambda: sliding_windows(0, 16, 8), "at least 2"),
        (lambda: sliding_windows(100, 16, 17), "--stride"),
        (lambda: sliding_windows(100, 16, 0), "--stride"),
        (lambda: chunk_windows(10, 16), "at least --ctx=16"),
        (lambda: chunk_windows(1, 16), "at least 2"),
    ],
)
def test_window_errors(call, msg):
    with pytest.raises(CortiqError, match=msg):
        call()
