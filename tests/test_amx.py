"""Prefill on integer tile products (``cortiq_engine/kernels/amx.py``; AMX tiles, or the
same products on AVX-512 VNNI, or the same block sums on AVX2) against float64 math: the
activation packing (int16 and int8), the 4/5-bit unpackers and AVX2's weight interleave
against their numpy twins, the tile kernels of every unit the host has (q8 on int16, the
unsigned dtypes on int16 and, except on AVX2, int8) and the prefill matmul
(whole tiles of 16 rows on the tiles, a tail on sgemm) against ``qdot.qdot_ref`` at the same
rounding, the two units against each other bit for bit where both exist, and SmolLM2
prefills (q8, q4) on the tiles against the same model's decode kernels (the same
activation rounding) and against sgemm."""

from __future__ import annotations

import numpy as np
import pytest

from cortiq_engine.kernels import amx, qdot
from cortiq_engine.kernels.fast import NumbaKernels
from cortiq_engine.weights import Weight
from formats.quants import get_dtype

UNITS = [u for u, ok in (("amx", amx.host_amx()), ("vnni", amx.host_vnni()), ("avx2", amx.host_avx2())) if ok]
if not UNITS:  # the hardware, not an import: these hosts have no unit to test
    pytest.skip("this CPU has neither AMX-INT8 tiles nor AVX-512 VNNI nor AVX2", allow_module_level=True)

KERNELS = {u: amx.TileKernels(cache_dir=None, unit=u) for u in UNITS}
KERNEL = KERNELS[UNITS[0]]
TILED = amx.TileKernels.DTYPES
FORMS = [(d, b) for d in TILED for b in (16, 8) if any(b in amx.widths(u)[d] for u in UNITS)]
UNIT_FORMS = [(u, d, b) for u in UNITS for d, b in FORMS if b in amx.widths(u)[d]]


def _weight(dtype: str, rows: int, cols: int, seed: int) -> Weight:
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    dt = get_dtype(dtype)
    parts = dt.named(dt.encode(x), (rows, cols))
    parts = {k: np.ascontiguousarray(v.view(np.uint16) if v.dtype == np.float16 else v) for k, v in parts.items()}
    return Weight("w", dtype, rows, cols, parts)


def _x(n: int, cols: int, seed: int) -> np.ndarray:
    """Activations with outliers inside blocks (what SmolLM2's and Gemma's have)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, cols)) * rng.choice([1.0, 40.0], (n, cols), p=[0.97, 0.03])).astype(np.float32)


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("n,cols", [(1, 32), (16, 64), (17, 96), (40, 576), (100, 160)])
def test_packing_against_numpy(n, cols, bits):
    X = _x(n, cols, n)
    X[0, :32] = 0.0  # an all-zero block: scale 0, quants 0
    p = KERNEL.pack(X, bits)
    xb, xd = p.xb, p.xd
    assert p.bits == bits and p.n == n and xb.shape[2] == (2 if bits == 16 else 1)
    rb, rd, rs = amx.pack_x16_ref(X, bits)
    assert np.array_equal(xb, rb) and np.array_equal(xd, rd) and np.array_equal(p.xs, rs)
    # the planes hold the rounding decode's kernels use (int16: q8's, q = 256 hi + lo;
    # int8: the 4/5-bit dtypes')
    q, d, s = qdot.quantize_rows_ref(X, bits, qdot.qmax("q8" if bits == 16 else "q4", bits))
    hi = xb[:, :, 0].reshape(xb.shape[0], xb.shape[1], 8, 16, 4).astype(np.int32)
    if bits == 16:
        lo = xb[:, :, 1].reshape(xb.shape[0], xb.shape[1], 8, 16, 4).view(np.uint8).astype(np.int32)
        hi = 256 * hi + lo
    back = hi.transpose(0, 3, 1, 2, 4).reshape(-1, cols)[:n]
    assert np.array_equal(back, q.astype(np.int32))
    assert np.array_equal(xd.transpose(0, 2, 1).reshape(-1, cols // 32)[:n], d)
    assert np.array_equal(p.xs.transpose(0, 2, 1).reshape(-1, cols // 32)[:n], s)


@pytest.mark.parametrize("dtype", amx.UNSIGNED)
def test_unpackers_against_numpy(dtype):
    """Every bit pattern: quants, fifth bits and K-quant scales drawn as random bytes, not
    from an encoder (the f16 scales as random finite values)."""
    rows, cols = 48, 512
    rng = np.random.default_rng(len(dtype))
    parts = {}
    for part in get_dtype(dtype).parts((rows, cols)):
        if part.dtype.kind == "f":
            parts[part.name] = rng.standard_normal(part.shape).astype(np.float16).view(np.uint16)
            continue
        raw = rng.integers(0, 256, (rows, part.shape[1] * part.dtype.itemsize), dtype=np.uint8)
        parts[part.name] = raw.view(part.dtype)
    ref = amx.unpack_ref(dtype, parts)
    assert ref.max() == (31 if "5" in dtype else 15)
    out = np.full((rows - 16, cols), 255, np.uint8)
    amx.unpack_quants(dtype, parts, 16, rows, out)
    assert np.array_equal(out, ref[16:])
    # the unpacked quants are what the dtype's decoder multiplies: d_w * q + m_w
    dw, mw = amx.block_scales(dtype, parts, 0, rows)
    nb = cols // 32
    back = (dw[:, :, None] * ref.reshape(rows, nb, 32).astype(np.float32) + mw[:, :, None]).reshape(rows, cols)
    dec = get_dtype(dtype).decode(parts, (rows, cols))
    assert np.abs(back - dec).max() <= 1e-6 * np.abs(dec).max()


SHAPES = [(16, 32, 1), (48, 64, 17), (64, 576, 40), (32, 1536, 33), (32, 512, 20)]


@pytest.mark.parametrize(
    "unit,dtype,bits,rows,cols,n",
    [(u, d, b, *s) for u, d, b in UNIT_FORMS for s in SHAPES if get_dtype(d).supports(s[:2])],
)  # K-quants: cols % 256
def test_tile_kernel_against_float64(unit, dtype, bits, rows, cols, n):
    KERNEL = KERNELS[unit]
    w = _weight(dtype, rows, cols, rows + cols)
    X = _x(n, cols, n + 1)
    x = KERNEL.prepare(X, bits)
    # the result lands in place in a [inputs, columns] output, at its column offset
    out = np.full((n, rows + 8), np.nan, np.float32)
    KERNEL.rows(dtype, w.parts, cols, 0, rows, x, out, None, 8)
    ref = qdot.qdot_ref(dtype, w.parts, X, bits)
    assert np.isnan(out[:, :8]).all()
    assert np.abs(out[:, 8:] - ref).max() / np.abs(ref).max() < 2e-6
    # a slice of rows writes only its own columns, and no padding input of the last tile
    part = np.full((n, 40), np.nan, np.float32)
    KERNEL.rows(
        dtype, w.parts, cols, rows - 16, rows, x, part, np.empty(KERNEL.scratch_bytes(dtype, 16, cols), np.uint8), 24
    )
    assert np.abs(part[:, 24:] - ref[:, rows - 16 :]).max() / np.abs(ref).max() < 2e-6
    assert np.isnan(part[:, :24]).all()
    # int8 activations: the same block sums the decode kernels take (qdot_ref at 8 bits),
    # not int16's, so the rounding is what the width says it is
    if bits == 8:
        assert np.abs(out[:, 8:] - qdot.qdot_ref(dtype, w.parts, X, 16)).max() / np.abs(ref).max() > 1e-4


@pytest.mark.skipif(len(UNITS) < 2, reason="one unit on this host: nothing to compare")
# only the forms two or more units run (AVX2 has no int8): each case compares something
@pytest.mark.parametrize("dtype,bits", [(d, b) for d, b in FORMS if sum(b in amx.widths(u)[d] for u in UNITS) >= 2])
def test_the_units_agree_bit_for_bit(dtype, bits):
    """The VNNI and AVX2 forms compute the tile products' exact block sums and the same float work."""
    cols = 512
    w = _weight(dtype, 48, cols, 5)
    X = _x(37, cols, 6)
    outs = []
    for unit in UNITS:
        if bits not in amx.widths(unit)[dtype]:
            continue
        out = np.zeros((37, 48), np.float32)
        KERNELS[unit].rows(dtype, w.parts, cols, 0, 48, KERNELS[unit].prepare(X, bits), out)
        outs.append(out)
    assert len(outs) >= 2
    for other in outs[1:]:
        assert np.array_equal(outs[0], other)


@pytest.mark.parametrize("rows,cols", [(16, 32), (48, 96), (32, 576)])
def test_avx2_interleave_and_rows_against_numpy(rows, cols):
    rng = np.random.default_rng(rows + cols)
    for src in (
        rng.integers(-128, 128, (rows, cols), dtype=np.int8),
        rng.integers(0, 32, (rows, cols), dtype=np.uint8),
    ):
        assert np.array_equal(amx.interleave16(src), amx.interleave16_ref(src))
    X = _x(7, cols, 3)
    X[1, :32] = 0.0
    x = amx.pack_rows(X)
    q, d, s = qdot.quantize_rows_ref(X, 16, amx.QMAX16)
    assert x.n == 7 and x.xq.shape[0] % amx.AVX2_INPUTS == 0 and not x.xq[7:].any()
    assert np.array_equal(x.xq[:7], q) and np.array_equal(x.xd[:7], d) and np.array_equal(x.xs[:7], s)


@pytest.mark.parametrize("bits,factor", [(16, 32768), (8, 128)])
def test_vnni_block_sums_against_numpy(bits, factor):
    rng = np.random.default_rng(4)
    q = rng.integers(-128, 128, (24, 96), dtype=np.int8)
    assert np.array_equal(amx.block_sums(q, bits), factor * q.astype(np.int32).reshape(24, 3, 32).sum(2))
    u = rng.integers(0, 32, (16, 64), dtype=np.uint8)
    assert np.array_equal(amx.block_sums(u, bits), factor * u.astype(np.int32).reshape(16, 2, 32).sum(2))


def test_unknown_unit_is_an_error():
    with pytest.raises(ValueError, match="tile unit"):
        amx.TileKernels(cache_dir=None, unit="sme")


@pytest.mark.parametrize("unit", UNITS)
@pytest.mark.parametrize("dtype", ["q8", "q4"])
def test_bad_arguments_are_errors_not_reads(unit, dtype):
    KERNEL = KERNELS[unit]
    w = _weight(dtype, 32, 64, 3)
    x = KERNEL.prepare(_x(5, 64, 2))
    out = np.zeros((5, 32), np.float32)
    for r0, r1 in ((0, 24), (16, 48), (-16, 16)):
        with pytest.raises(ValueError):
            KERNEL.rows(dtype, w.parts, 64, r0, r1, x, out)
    with pytest.raises(ValueError):  # inputs packed for another width
        KERNEL.rows(dtype, w.parts, 64, 0, 32, KERNEL.prepare(_x(5, 96, 2)), out)
    for bad, col in (
        (np.zeros((16, 32), np.float32), 0),
        (np.zeros((5, 31), np.float32), 0),
        (out, 1),
        (out, -1),
        (np.zeros((5, 64), np.float64), 0),
        (np.zeros((32, 5), np.float32).T, 0),
    ):
        with pytest.raises(ValueError):  # an output that cannot hold the columns, or not f32 rows
            KERNEL.rows(dtype, w.parts, 64, 0, 32, x, bad, None, col)
    if dtype == "q8" or unit == "avx2":
        with pytest.raises(ValueError):  # q8 has no int8-activation tile kernel, AVX2 none at all
            KERNEL.rows(dtype, w.parts, 64, 0, 32, amx.TileKernels.pack(_x(5, 64, 2), 8), out)
    with pytest.raises(ValueError):
        KERNEL.prepare(_x(5, 64, 2), 4)
    other = amx.pack_rows(_x(5, 64, 2)) if unit != "avx2" else amx.TileKernels.pack(_x(5, 64, 2))
    with pytest.raises(ValueError):  # inputs laid out for another unit
        KERNEL.rows(dtype, w.parts, 64, 0, 32, other, out)
    with pytest.raises(ValueError):  # the parts of a wider weight than ``cols`` says
        KERNEL.rows(dtype, w.parts, 32, 0, 32, KERNEL.prepare(_x(5, 32, 2)), out)
    short = dict(w.parts, qs=w.parts["qs"][:16])
    with pytest.raises(ValueError):
        KERNEL.rows(dtype, short, 64, 0, 32, x, out)
    if KERNEL.scratch_bytes(dtype, 32, 64):
        with pytest.raises(ValueError):  # scratch too small for the unpacked (or widened) quants
            KERNEL.rows(dtype, w.parts, 64, 0, 32, x, out, np.empty(KERNEL.scratch_bytes(dtype, 32, 64) - 1, np.uint8))
    with pytest.raises(ValueError):  # no tile kernel for this dtype
        KERNEL.rows("q6k", _weight("q6k", 16, 256, 1).parts, 256, 0, 16, KERNEL.prepare(_x(5, 256, 2)), out)


@pytest.mark.parametrize(
    "unit,dtype,width",
    [
        (u, d, w)
        for u in UNITS
        for d, w in (("q8", None), ("q4", None), ("q5", None), ("q4k", None), ("q4", 8), ("q4k", 8))
        if (w or 16) in amx.widths(u)[d]
    ],
)
@pytest.mark.parametrize("rows", [40, 1536 + 8])
def test_prefill_matmul_tiles_and_tail_against_float64(unit, dtype, width, rows):
    """A prefill matmul (n > small_n) of a weight whose rows are not whole tiles, fused
    with an f32 one: tile rows at int16 rounding by default, at int8 when one width of 8
    is asked for all (CORTIQ_KERNELS=numba-i8); the tail and the f32 weight as before."""
    cols, n = 512, 37
    w = _weight(dtype, rows, cols, 7)
    x32 = np.random.default_rng(8).standard_normal((24, cols)).astype(np.float32)
    f = Weight("f", "f32", 24, cols, {"data": x32})
    X = _x(n, cols, 9)
    on = NumbaKernels(act_bits=width, amx_tiles=True, tile_unit=unit, vnni_min_weights=0)
    off = NumbaKernels(amx_tiles=False)
    assert on.tile_unit == unit and off.tile_unit is None
    got, before = on.matmul([w, f], X), off.matmul([w, f], X)
    tiles = rows // 16 * 16
    assert dtype in on.amx_dtypes and not off.amx_dtypes
    bits = on.tile_bits[dtype]
    assert bits == (width or 16)
    rounded = qdot.qdot_ref(dtype, w.parts, X, bits)
    float64 = X.astype(np.float64) @ w.dequantize().astype(np.float64).T
    scale = np.abs(float64).max()
    assert np.abs(got[:, :tiles] - rounded[:, :tiles]).max() / scale < 2e-6
    assert np.abs(got[:, tiles:rows] - float64[:, tiles:]).max() / scale < 2e-6
    # the f32 weight in its own sgemm slices (the path without tiles runs slices across
    # the fused weights, so its sums may be ordered otherwise)
    f64 = X.astype(np.float64) @ x32.astype(np.float64).T
    assert np.abs(got[:, rows:] - f64).max() / np.abs(f64).max() < 2e-6
    # the rounding of the activations is all that separates the two paths
    assert np.abs(got - before).max() / scale < (1e-4 if bits == 16 else 2e-2)


@pytest.mark.parametrize("unit", UNITS)
def test_int8_tiles_only_when_one_width_is_asked_for(unit):
    """By default every tiled dtype prefills on int16 (int8 tiles moved SmolLM2 q4's answer
    to the README's demo question); act_bits=8 (numba-i8) gives the 4/5-bit dtypes int8
    tiles and q8, which has no int8 tile kernel, none; AVX2 has no int8 tiles: sgemm then."""
    default = NumbaKernels(amx_tiles=True, tile_unit=unit)
    assert set(default.tile_bits.values()) == {16} and "q4" in default.tile_bits
    assert default.act_bits["q4"] == 8  # decode stays on int8
    if unit == "avx2":
        assert not NumbaKernels(act_bits=8, tile_unit=unit).amx_prefill
        with pytest.raises(ValueError, match="int16 on AVX2"):
            NumbaKernels(act_bits=8, amx_tiles=True, tile_unit=unit)
        return
    narrow = NumbaKernels(act_bits=8, amx_tiles=True, tile_unit=unit)
    assert "q8" not in narrow.tile_bits and set(narrow.tile_bits.values()) == {8}


def test_vnni_takes_only_matmuls_of_vnni_min_weights():
    """Below the size where the VNNI form beats sgemm a matmul is the sgemm path's, bit for bit."""
    if "vnni" not in UNITS:
        pytest.skip("no AVX-512 VNNI on this host")
    w = _weight("q8", 64, 512, 11)
    X = _x(40, 512, 12)
    off = NumbaKernels(amx_tiles=False).matmul([w], X)
    small = NumbaKernels(tile_unit="vnni", vnni_min_weights=64 * 512 + 1).matmul([w], X)
    tiled = NumbaKernels(tile_unit="vnni", vnni_min_weights=64 * 512).matmul([w], X)
    assert np.array_equal(small, off)
    assert not np.array_equal(tiled, off)
    assert np.abs(tiled - qdot.qdot_ref("q8", w.parts, X, 16)).max() / np.abs(off).max() < 2e-6


# Every unit's tiles meet SmolLM2 once (q8) and both quants meet the host's first unit; the
# other units' q4 runs are slow (their q4 tiles stay checked against float64 above).
@pytest.mark.parametrize(
    "unit,quant",
    [
        pytest.param(u, q, marks=pytest.mark.slow) if (q == "q4" and u != UNITS[0]) else (u, q)
        for q in ("q8", "q4")
        for u in UNITS
    ],
)
def test_smollm2_prefill_with_and_without_tiles(smollm2_cmf, unit, quant):
    """One prompt three ways: in one chunk on the tiles, in chunks of 16 rows on the decode
    kernels, and in one chunk on sgemm (float activations). q8: tiles and decode both round
    to int16 and agree to the float order of their sums. q4 (int16 tiles, int8 decode): the
    tiles stay within ~1e-8 KL of sgemm, while int8 rounding differs from either by ~2e-3
    (a last-bit difference upstream can move an activation to the next of 255 levels)."""
    from cortiq_engine.engine import Engine
    from cortiq_engine.model import forward

    z = {}
    for name, flag in (("tiles", True), ("rows", True), ("sgemm", False)):
        kernels = NumbaKernels(amx_tiles=flag, tile_unit=unit if flag else None, vnni_min_weights=0)
        eng = Engine.load(smollm2_cmf(quant), threads=2, kernels=kernels)
        assert eng.kernels.amx_prefill == flag and (quant in eng.kernels.amx_dtypes) == flag
        ids = eng.tokenizer.encode("Alice was beginning to get very tired of sitting by her sister on the bank, " * 4)
        st = eng.new_state(256)
        step = eng.kernels.small_n if name == "rows" else len(ids)
        h = np.concatenate([forward(st, ids[s : s + step]) for s in range(0, len(ids), step)])
        z[name] = eng.model.lm_head(eng.model.final_norm(h[-8:])).astype(np.float64)

    def kl(p_, q_):
        a, b = (v - v.max(1, keepdims=True) for v in (p_, q_))
        la, lb = (v - np.log(np.exp(v).sum(1, keepdims=True)) for v in (a, b))
        return (np.exp(la) * (la - lb)).sum(1).max()

    assert not np.array_equal(z["tiles"], z["sgemm"])  # two paths, not one twice
    assert kl(z["sgemm"], z["tiles"]) < 1e-5
    assert np.array_equal(z["tiles"].argmax(1), z["sgemm"].argmax(1))
    if quant == "q8":
        assert kl(z["rows"], z["tiles"]) < 1e-6
        assert np.array_equal(z["tiles"].argmax(1), z["rows"].argmax(1))
    else:
        assert kl(z["rows"], z["tiles"]) < 2e-2
