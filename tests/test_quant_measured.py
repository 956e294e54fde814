"""The converter's one-pass q8/q4 encoders: the numpy reference's bytes, the error meter's
sums, written into a tensor's row slices, and a NaN or an infinity showing in the sums."""

from __future__ import annotations

import numpy as np
import pytest

from formats import quant_kernels as fast
from formats.quants import get_dtype, quantize_q4, quantize_q8

F16_MIN_NORMAL = np.float32(2.0**-14)


def _blocks_near_the_f16_edges() -> np.ndarray:
    """Blocks whose candidate scales max|x| / (127..112) straddle f16's smallest normal (the
    q8 search clamps levels only below it), fall to f16 subnormals or zero, or overflow f16."""
    rng = np.random.default_rng(5)
    rows = []
    for m in (
        F16_MIN_NORMAL * 112,  # every candidate just normal or just below
        F16_MIN_NORMAL * 120,
        F16_MIN_NORMAL * 127,
        np.nextafter(F16_MIN_NORMAL * 127, np.float32(0)),
        F16_MIN_NORMAL * 126.9,
        F16_MIN_NORMAL * 2,  # subnormal scales: levels past 127 need the clamp
        np.float32(1e-7),
        np.float32(1e-12),  # scales round to 0
        np.float32(65504 * 112),  # the largest candidates overflow f16
        np.float32(65504 * 127),
        np.float32(3e38),
    ):
        row = rng.standard_normal(128).astype(np.float32)
        row *= m / np.abs(row).max()
        row[::32] = m  # the max of every block
        rows.append(row)
    x = np.stack(rows)
    x[:, 64:96] = np.round(x[:, 64:96] / x[:, 64:65] * 8) / 8 * x[:, 64:65]  # many levels on exact halves
    return x.astype(np.float32)


def _same(a, b) -> bool:
    return all(np.array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8)) for u, v in zip(a, b))


@pytest.mark.parametrize("name", ["q8", "q4"])
def test_measured_encoders_give_the_reference_bytes_and_the_meter_sums(name):
    ref = {"q8": quantize_q8, "q4": quantize_q4}[name]
    measured = getattr(fast, f"quantize_{name}_measured")
    rng = np.random.default_rng(0)
    for x in (
        _blocks_near_the_f16_edges(),
        rng.standard_normal((16, 512)).astype(np.float32),
        rng.integers(-4, 5, (8, 256)).astype(np.float32),
    ):
        with np.errstate(all="ignore"):
            want = ref(x)
            parts, err, refsq = measured(x)
            e, r = get_dtype(name).error(x, parts)
        assert _same(parts, want)
        np.testing.assert_allclose([err, refsq], [e, r], rtol=1e-9)


@pytest.mark.parametrize("name", ["q8", "q4"])
def test_encode_measured_fills_a_row_slice_of_the_tensor_parts(name):
    dt = get_dtype(name)
    x = np.random.default_rng(1).standard_normal((24, 256)).astype(np.float32)
    whole = [np.zeros(p.shape, p.dtype) for p in dt.parts(x.shape)]
    for r0 in range(0, 24, 10):
        into = [w[r0 : r0 + 10] for w in whole]
        got, err, refsq = dt.encode_measured(x[r0 : r0 + 10], None, into)
        assert got is into
        e, r = dt.error(x[r0 : r0 + 10], dt.encode(x[r0 : r0 + 10]))
        assert (err, refsq) == pytest.approx((e, r), rel=1e-9)
    assert _same(whole, dt.encode(x))


@pytest.mark.parametrize("name", ["q8", "q4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_shows_in_the_sum_of_squares(name, bad):
    dt = get_dtype(name)
    assert dt.measures_nonfinite
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    x[2, 37] = bad
    with np.errstate(all="ignore"):
        parts, _, refsq = dt.encode_measured(x)
        assert _same(parts, dt.encode(x))
    assert not np.isfinite(refsq)
