"""K-quant dtypes (q6k, q5k, q4k) against real oracles: llama.cpp's own quantizer
(its C library, shipped with llama-cpp-python), gguf-py's decoder, float64 math;
their compiled kernels against their numpy twins."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

from cortiq_engine.kernels import get_kernels
from cortiq_engine.weights import Weight
from formats.errors import CortiqError
from formats.quants import DTYPES, get_dtype
from tests.ggml_oracle import ggml_library_quantize

KQUANTS = [("q6k", GT.Q6_K), ("q5k", GT.Q5_K), ("q4k", GT.Q4_K)]
# every dtype this file brings, with its GGML twin: the K-quants and q4k's fallback q5 (Q5_0)
NEW = KQUANTS + [("q5", GT.Q5_0)]
# q4_0 (Q4_0's bytes) and q5_1 (Q5_1's, q5k's fallback) search their scales: their
# decoders and kernels are checked with the others, their encoders against ggml's below
DECODED = NEW + [("q4_0", GT.Q4_0), ("q5_1", GT.Q5_1)]


def _hard(rows: int = 24, cols: int = 768, seed: int = 0) -> np.ndarray:
    """Gaussian rows plus blocks that stress the searches: zeros, constants, all
    positive, tiny and huge values, exact ties."""
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    x[0, :256] = 0.0
    x[1, :32] = 3.0
    x[1, 256:512] = 2.5
    x[2] *= 1e-5
    x[3, :256] = np.abs(x[3, :256]) + 1
    x[4, :256] = -np.abs(x[4, :256]) - 1
    x[5] *= 1e3
    x[6, :64] = np.arange(64, dtype=np.float32) / 4 - 8
    x[7, 300] = 40.0  # one outlier
    return x


@pytest.mark.llamacpp
@pytest.mark.parametrize("name,gtype", NEW)
def test_encode_is_llama_cpp_byte_for_byte(name, gtype):
    x = _hard()
    dt = get_dtype(name)
    parts = dt.encode(x)
    ours = dt.to_ggml(dt.named(parts, x.shape)).reshape(x.shape[0], -1)
    assert np.array_equal(ours, ggml_library_quantize(x, gtype))


@pytest.mark.parametrize("name,gtype", DECODED)
def test_decode_is_gguf_py_bit_for_bit_and_near_float64(name, gtype):
    x = _hard(seed=1)
    dt = get_dtype(name)
    named = dt.named(dt.encode(x), x.shape)
    ours = dt.decode(named, x.shape)
    blocks = dt.to_ggml(named).reshape(x.shape[0], -1)
    assert np.array_equal(ours, gq.dequantize(blocks, gtype).reshape(x.shape))
    # round trip: GGML blocks -> our parts -> the same bytes
    back = dt.from_ggml(blocks.reshape(x.shape[0], -1, dt.block_bytes))
    assert all(np.array_equal(a, named[n]) for a, (n, _, _) in zip(back, dt.fields))
    # the error the converter reports equals the float64 error of the decoding
    err, ref = dt.error(x, list(named.values()))
    assert err == pytest.approx(float(((ours.astype(np.float64) - x) ** 2).sum()), rel=1e-9)
    assert ref == pytest.approx(float((x.astype(np.float64) ** 2).sum()), rel=1e-9)


def test_bits_per_weight_and_error_ladder():
    x = np.random.default_rng(7).standard_normal((256, 1024)).astype(np.float32)
    errs = {}
    for name, _ in KQUANTS:
        dt = get_dtype(name)
        assert dt.nbytes((4096, 4096)) == pytest.approx(4096 * 4096 * dt.bits / 8, rel=1e-6)
        e, r = dt.error(x, dt.encode(x))
        errs[name] = np.sqrt(e / r)
    assert get_dtype("q4k").bits <= 4.6
    # N(0, 1) relative RMS error: q6k ~1.8%, q5k ~3.6%, q4k ~7.1% (ggml's own figures)
    assert 0.015 < errs["q6k"] < 0.02 < 0.03 < errs["q5k"] < 0.04 < 0.06 < errs["q4k"] < 0.08


@pytest.mark.parametrize("name", [n for n, _ in KQUANTS])
def test_rows_slices_and_shapes(name):
    dt = get_dtype(name)
    x = _hard(rows=13, cols=512, seed=3)
    whole = dt.encode(x)
    pieces = [dt.encode(x[r : r + 4]) for r in range(0, 13, 4)]
    for i, part in enumerate(whole):
        assert np.array_equal(part, np.concatenate([p[i] for p in pieces]))
    assert not dt.supports((4, 288)) and not dt.supports((256,)) and dt.supports((2, 4, 256))
    with pytest.raises(CortiqError, match="divisible by 256"):
        dt.encode(np.zeros((4, 288), np.float32))


def test_importance_weights_lower_the_weighted_error():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    imp = (rng.random(1024) ** 4 * 100).astype(np.float32)  # a few columns matter a lot
    for name, _ in KQUANTS:
        dt = get_dtype(name)
        plain = dt.decode(dt.named(dt.encode(x), x.shape), x.shape)
        weighted = dt.decode(dt.named(list(dt.encode_rows(x, imp)), x.shape), x.shape)
        cost = lambda y: float((((y - x).astype(np.float64) ** 2) * imp).sum())  # noqa: E731
        assert cost(weighted) < 0.97 * cost(plain), name


def _weight(name: str, x: np.ndarray) -> Weight:
    dt = get_dtype(name)
    parts = {k: (v.view(np.uint16) if v.dtype == np.float16 else v) for k, v in dt.named(dt.encode(x), x.shape).items()}
    return Weight(name, name, x.shape[0], x.shape[1], parts)


@pytest.mark.parametrize("name", [n for n, _ in DECODED])
def test_kernels_match_the_numpy_twin_and_float64(name):
    rng = np.random.default_rng(5)
    ws = [_weight(name, rng.standard_normal((r, 512)).astype(np.float32)) for r in (40, 24, 8)]
    fast, ref, default = get_kernels("numba-float"), get_kernels("numpy"), get_kernels("numba")
    # dequantize tile: bit for bit the numpy decoder
    w = ws[0]
    buf = np.empty((w.rows - 5, w.cols), np.float32)
    fast._dequant(w, 5, w.rows, buf)
    assert np.array_equal(buf, w.dequantize(5, w.rows))
    W64 = np.concatenate([v.dequantize().astype(np.float64) for v in ws])
    for n in (1, 3, 8, 40):  # decode sizes and a prefill size (tiles + BLAS)
        X = rng.standard_normal((n, 512)).astype(np.float32)
        want = X.astype(np.float64) @ W64.T
        for ks in (fast, ref):
            got = ks.matmul(ws, X)
            assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max(), (ks.name, n)
        # the default set: int8 activations up to SMALL_N rows (tests/test_qdot.py holds
        # them to their float64 twin), float ones for prefill, or on integer tiles the
        # decode's width (tests/test_amx.py holds those to their float64 twin)
        got = default.matmul(ws, X)
        if n <= 16 or default.tile_bits.get(name) == 8:
            assert not np.array_equal(got, fast.matmul(ws, X))  # the integer kernel is taken
            assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.01, n
        else:
            tol = 1e-4 if name in default.amx_dtypes else 2e-5
            assert np.abs(got - want).max() <= tol * np.abs(want).max(), n


@pytest.mark.parametrize("name", [n for n, _ in DECODED])
def test_decode_matvec_is_row_exact(name):
    """A row's result in a k-row call is bit for bit its result alone."""
    rng = np.random.default_rng(6)
    ws = [
        _weight(name, rng.standard_normal((48, 768)).astype(np.float32)),
        _weight(name, rng.standard_normal((16, 768)).astype(np.float32)),
    ]
    fast = get_kernels("numba")
    X = rng.standard_normal((8, 768)).astype(np.float32)
    together = fast.matmul(ws, X)
    for i in range(8):
        assert np.array_equal(together[i], fast.matmul(ws, X[i : i + 1].copy())[0])


def test_registry_names_the_new_types():
    assert {"q6k", "q5k", "q4k", "q5", "q5_1"} <= set(DTYPES)
    assert [get_dtype(n).ggml_type for n, _ in NEW] == [g.name for _, g in NEW]


@pytest.mark.slow
def test_gemma3_q4_k_m_blocks_are_kept_bit_for_bit(gemma3_gguf, gemma3_hf, tmp_path):
    """``--quant keep`` on Gemma 3 270M's Q4_K_M file: Q4_K, Q6_K, Q5_0 and Q8_0 blocks
    are copied, and each tensor decodes to exactly what gguf-py dequantizes (the HF
    import's f32 values)."""
    from formats.cmf import CmfFile
    from cortiq_engine.convert import convert_checkpoint
    from formats.safetensors_reader import SafetensorsFile

    out = tmp_path / "g.cmf"
    report = convert_checkpoint(gemma3_gguf, out, quant="keep")
    assert {"q4k", "q6k", "q5", "q8"} <= set(report.by_dtype)
    assert all(report.by_dtype[d].rms_rel_error == 0.0 for d in ("q4k", "q6k", "q5", "q8"))
    hf = SafetensorsFile(next(gemma3_hf.glob("*.safetensors")))
    with CmfFile(out) as f:
        seen = set()
        for name in f.names():
            info = f.info(name)
            if len(info.shape) == 2 and info.dtype in ("q4k", "q6k", "q5") and info.dtype not in seen:
                seen.add(info.dtype)
                assert np.array_equal(f.tensor_f32(name), hf.f32(name).reshape(info.shape)), name
    assert seen == {"q4k", "q6k", "q5"}


# ---------------------------------------------------------------- q4_0 and the q5 imatrix search


@pytest.mark.llamacpp
def test_q4_0_ggml_reference_is_llama_cpp_byte_for_byte():
    from formats.quants import quantize_q4_0_ggml

    x = _hard()
    dt = get_dtype("q4_0")
    d, qs = quantize_q4_0_ggml(x)
    ours = dt.to_ggml({"d": d, "qs": qs}).reshape(x.shape[0], -1)
    assert np.array_equal(ours, ggml_library_quantize(x, GT.Q4_0))
    assert np.array_equal(ours, gq.quantize(x, GT.Q4_0))


def _block_sse(dt, x, parts) -> np.ndarray:
    """float64 squared error of each block of 32 of ``x`` encoded as ``parts``."""
    y = dt.decode(dt.named(list(parts), x.shape), x.shape).astype(np.float64)
    return ((y - x.astype(np.float64)) ** 2).reshape(x.shape[0], -1, 32).sum(axis=2)


@pytest.mark.llamacpp
def test_q5_1_ggml_reference_is_llama_cpp_byte_for_byte():
    from formats.quants import quantize_q5_1_ggml

    x = _hard()
    dt = get_dtype("q5_1")
    d, m, qh, qs = quantize_q5_1_ggml(x)
    ours = dt.to_ggml({"d": d, "m": m, "qh": qh, "qs": qs}).reshape(x.shape[0], -1)
    assert np.array_equal(ours, gq.quantize(x, GT.Q5_1))
    assert np.array_equal(ours, ggml_library_quantize(x, GT.Q5_1))


@pytest.mark.parametrize("weighted", [False, True])
def test_q5_1_search_is_never_worse_than_ggml_in_any_block(weighted):
    """q5_1's search keeps ggml's reference (d, m) among its candidates: per block, its
    squared error (importance-weighted with an imatrix) is never above the reference
    encoding's, and clearly below it overall."""
    from formats.quants import quantize_q5_1_ggml

    dt = get_dtype("q5_1")
    for seed in (0, 1):
        x = _hard(seed=seed)
        if weighted:
            imp = (np.random.default_rng(seed).random(x.shape[1]) ** 2 * 10 + 0.01).astype(np.float32)
            sigma2 = (x.astype(np.float32) ** 2).mean(axis=1, keepdims=True)
            w = (imp[None, :] * np.sqrt(sigma2 + x * x)).astype(np.float64)
        else:
            imp, w = None, np.ones(x.shape)
        w = w.reshape(x.shape[0], -1, 32)

        def cost(parts):
            y = dt.decode(dt.named(list(parts), x.shape), x.shape).astype(np.float64)
            return (((y - x) ** 2).reshape(x.shape[0], -1, 32) * w).sum(axis=2)

        ours, ggml = cost(dt.encode(x, imp)), cost(quantize_q5_1_ggml(x))
        assert (ours <= ggml * (1 + 1e-9) + 1e-30).all()
        assert ours[8:].sum() < 0.9 * ggml[8:].sum()


def test_q4_0_search_is_never_worse_than_ggml_in_any_block():
    from formats.quants import quantize_q4_0_ggml

    dt = get_dtype("q4_0")
    for seed in (0, 1, 2):
        x = _hard(seed=seed)
        ours = _block_sse(dt, x, dt.encode(x))
        ggml = _block_sse(dt, x, quantize_q4_0_ggml(x))
        assert (ours <= ggml * (1 + 1e-12) + 1e-30).all()
        # and clearly better overall on Gaussian rows (measured: relative RMS 8.7% -> 8.2%)
        assert ours[8:].sum() < 0.92 * ggml[8:].sum()
    assert get_dtype("q4_0").bits == 4.5
    assert dt.nbytes((4096, 4096)) == 4096 * 4096 * 9 // 16


@pytest.mark.llamacpp
@pytest.mark.parametrize("name,gtype", [("q4_0", GT.Q4_0), ("q5", GT.Q5_0), ("q5_1", GT.Q5_1)])
def test_block32_imatrix_search_beats_llama_cpps_own(name, gtype):
    """With an imatrix, q4_0 / q5 / q5_1 weight their search as ggml's quantize_q4_0 /
    q5_0 / q5_1 do; the importance-weighted error is below llama.cpp's own imatrix
    quantizer's, and below the unweighted encoding's."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((64, 1024)).astype(np.float32)
    imp = (rng.random(1024) ** 4 * 100).astype(np.float32)
    dt = get_dtype(name)
    cost = lambda y: float((((y - x).astype(np.float64) ** 2) * imp).sum())  # noqa: E731
    ours = cost(dt.decode(dt.named(list(dt.encode(x, imp)), x.shape), x.shape))
    plain = cost(dt.decode(dt.named(list(dt.encode(x)), x.shape), x.shape))
    lib = cost(gq.dequantize(ggml_library_quantize(x, gtype, imp), gtype).reshape(x.shape))
    # measured: q4_0 0.97x and 0.84x, q5 0.92x and 0.71x, q5_1 0.99x and 0.60x
    assert ours < lib and ours < 0.9 * plain
    # rows encode independently: slices give the same bytes
    whole = dt.encode(x, imp)
    pieces = [dt.encode(x[r : r + 24], imp) for r in range(0, 64, 24)]
    for i, part in enumerate(whole):
        assert np.array_equal(part, np.concatenate([p[i] for p in pieces]))
