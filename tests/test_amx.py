"""q8 prefill on AMX tiles (``cortiq_engine/kernels/amx.py``) against float64 math: the
activation packing against its numpy twin, the tile kernel and the prefill matmul
(whole tiles of 16 rows on the tiles, a tail on sgemm) against ``qdot.qdot_ref`` at the
same int16 rounding, and a SmolLM2 prefill with and without the tiles."""

from __future__ import annotations

import numpy as np
import pytest

from cortiq_engine.kernels import amx, qdot
from cortiq_engine.kernels.fast import NumbaKernels
from cortiq_engine.weights import Weight
from formats.quants import get_dtype

if not amx.host_amx():  # the hardware, not an import: these hosts have no tile unit to test
    pytest.skip("this CPU or kernel offers no AMX-INT8 tiles", allow_module_level=True)

KERNEL = amx.AmxQ8(cache_dir=None)


def _q8(rows: int, cols: int, seed: int) -> Weight:
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    dt = get_dtype("q8")
    parts = dt.named(dt.encode(x), (rows, cols))
    parts = {k: (v.view(np.uint16) if v.dtype == np.float16 else v) for k, v in parts.items()}
    return Weight("w", "q8", rows, cols, parts)


def _x(n: int, cols: int, seed: int) -> np.ndarray:
    """Activations with outliers inside blocks (what SmolLM2's and Gemma's have)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, cols)) * rng.choice([1.0, 40.0], (n, cols), p=[0.97, 0.03])).astype(np.float32)


@pytest.mark.parametrize("n,cols", [(1, 32), (16, 64), (17, 96), (40, 576), (100, 160)])
def test_packing_against_numpy(n, cols):
    X = _x(n, cols, n)
    X[0, :32] = 0.0  # an all-zero block: scale 0, quants 0
    xb, xd = KERNEL.pack(X)
    rb, rd = amx.pack_x16_ref(X)
    assert np.array_equal(xb, rb) and np.array_equal(xd, rd)
    # the planes hold the int16 rounding that decode's q8 kernels use: q = 256 hi + lo
    q, d, _ = qdot.quantize_rows_ref(X, 16, qdot.qmax("q8", 16))
    hi = xb[:, :, 0].reshape(xb.shape[0], xb.shape[1], 8, 16, 4).astype(np.int32)
    lo = xb[:, :, 1].reshape(xb.shape[0], xb.shape[1], 8, 16, 4).view(np.uint8).astype(np.int32)
    back = (256 * hi + lo).transpose(0, 3, 1, 2, 4).reshape(-1, cols)[:n]
    assert np.array_equal(back, q.astype(np.int32))
    assert np.array_equal(xd.transpose(0, 2, 1).reshape(-1, cols // 32)[:n], d)


@pytest.mark.parametrize("rows,cols,n", [(16, 32, 1), (48, 64, 17), (64, 576, 40), (32, 1536, 33)])
def test_tile_kernel_against_float64(rows, cols, n):
    w = _q8(rows, cols, rows + cols)
    X = _x(n, cols, n + 1)
    d, qs = w.kernel_parts()
    xb, xd = KERNEL.pack(X)
    out = np.full((rows, 16 * xb.shape[0]), np.nan, np.float32)
    KERNEL.rows(d, qs, 0, rows, xb, xd, out)
    ref = qdot.qdot_ref("q8", w.parts, X, 16)
    assert np.abs(out[:, :n].T - ref).max() / np.abs(ref).max() < 2e-6
    # a slice of rows writes only its own rows, from row 0 of ``out``
    part = np.full((16, 16 * xb.shape[0]), np.nan, np.float32)
    KERNEL.rows(d, qs, rows - 16, rows, xb, xd, part)
    assert np.abs(part[:, :n].T - ref[:, rows - 16 :]).max() / np.abs(ref).max() < 2e-6
    assert np.isnan(part[:, :n]).sum() == 0


def test_bad_arguments_are_errors_not_reads():
    w = _q8(32, 64, 3)
    d, qs = w.kernel_parts()
    xb, xd = KERNEL.pack(_x(5, 64, 2))
    out = np.zeros((32, 16), np.float32)
    for r0, r1 in ((0, 24), (16, 48), (-16, 16)):
        with pytest.raises(ValueError):
            KERNEL.rows(d, qs, r0, r1, xb, xd, out)
    with pytest.raises(ValueError):  # inputs packed for another width
        KERNEL.rows(d, qs, 0, 32, *KERNEL.pack(_x(5, 96, 2)), out)
    with pytest.raises(ValueError):
        KERNEL.rows(d, qs, 0, 32, xb, xd, np.zeros((16, 16), np.float32))


@pytest.mark.parametrize("rows", [40, 1536 + 8])
def test_prefill_matmul_tiles_and_tail_against_float64(rows):
    """A prefill matmul (n > small_n) of a q8 weight whose rows are not whole tiles, fused
    with an f32 one: tile rows at int16 rounding, the tail and the f32 weight as before."""
    cols, n = 576, 37
    w = _q8(rows, cols, 7)
    x32 = np.random.default_rng(8).standard_normal((24, cols)).astype(np.float32)
    f = Weight("f", "f32", 24, cols, {"data": x32})
    X = _x(n, cols, 9)
    on, off = NumbaKernels(amx_tiles=True), NumbaKernels(amx_tiles=False)
    got, before = on.matmul([w, f], X), off.matmul([w, f], X)
    tiles = rows // 16 * 16
    int16 = qdot.qdot_ref("q8", w.parts, X, 16)
    float64 = X.astype(np.float64) @ w.dequantize().astype(np.float64).T
    scale = np.abs(float64).max()
    assert np.abs(got[:, :tiles] - int16[:, :tiles]).max() / scale < 2e-6
    assert np.abs(got[:, tiles:rows] - float64[:, tiles:]).max() / scale < 2e-6
    assert np.array_equal(got[:, rows:], before[:, rows:])
    # the int16 rounding of the activations is all that separates the two paths
    assert np.abs(got - before).max() / scale < 1e-4


def test_smollm2_prefill_with_and_without_tiles(smollm2_cmf):
    """The same prompt through both paths: the logits differ by the activations' int16
    rounding only (KL ~1e-8 measured), the greedy token is the same."""
    from cortiq_engine.engine import Engine
    from cortiq_engine.model import forward

    z = {}
    for name, flag in (("tiles", True), ("sgemm", False)):
        eng = Engine.load(smollm2_cmf("q8"), threads=2, kernels=NumbaKernels(amx_tiles=flag))
        assert eng.kernels.amx_prefill == flag
        ids = eng.tokenizer.encode("Alice was beginning to get very tired of sitting by her sister on the bank, " * 4)
        h = forward(eng.new_state(256), ids)
        z[name] = eng.model.lm_head(eng.model.final_norm(h[-8:])).astype(np.float64)
    assert not np.array_equal(z["tiles"], z["sgemm"])  # two paths, not one twice
    a, b = (v - v.max(1, keepdims=True) for v in (z["tiles"], z["sgemm"]))
    la, lb = (v - np.log(np.exp(v).sum(1, keepdims=True)) for v in (a, b))
    kl = (np.exp(lb) * (lb - la)).sum(1)
    assert kl.max() < 1e-5
    assert np.array_equal(z["tiles"].argmax(1), z["sgemm"].argmax(1))
