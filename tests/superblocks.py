"""Shared checks of the super-block dtypes llama.cpp has and gguf-py only decodes
(iq4_xs, q3k): tests/test_iq4_xs.py and tests/test_q3_k.py.

Oracles: gguf-py's ``gguf.quants.dequantize`` (llama.cpp's block layouts in numpy)
for the bytes, float64 math for the kernels and the encoders' errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from cortiq_cli.main import app
from formats.cmf import CmfFile
from formats.gguf_import import unpermute_rope_rows
from formats.quants import DType

runner = CliRunner()


def random_blocks(dt: DType, rows: int, nb: int, seed: int = 0) -> np.ndarray:
    """uint8[rows, nb, block_bytes]: every bit random but the f16 ``d``, a finite scale."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, nb, dt.block_bytes), dtype=np.uint8)
    pos = 0
    for name, t, k in dt.fields:
        size = np.dtype(t).itemsize * k
        if name == "d":
            d = (rng.standard_normal((rows, nb)) * 0.01).astype(np.float16)
            blocks[:, :, pos : pos + size] = d.view(np.uint8).reshape(rows, nb, 2)
        pos += size
    return blocks


def check_ggml_layout(dt: DType, ggml_type) -> None:
    """GGML blocks -> our planar parts -> the same blocks, and our decoding of the parts
    equals gguf-py's dequantization of the blocks, bit for bit."""
    import gguf

    rows, nb = 7, 3
    blocks = random_blocks(dt, rows, nb)
    parts = dt.from_ggml(blocks)
    shape = (rows, nb * dt.block)
    named = dt.named(parts, shape)
    assert np.array_equal(dt.to_ggml(named), blocks)
    assert dt.nbytes(shape) >= blocks.nbytes and dt.block_bytes * 8 / dt.block == dt.bits
    ours = dt.decode(named, shape)
    ref = gguf.quants.dequantize(blocks.reshape(rows, -1), ggml_type).reshape(shape)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


def check_kernels(dt: DType) -> None:
    """The numba dequantization equals the numpy twin bit for bit; the decode matmul
    equals float64 math on the decoded weights, and a row's result does not depend on
    how many input rows (or fused matrices) share the call."""
    from cortiq_engine.kernels.dtype_ops import ops_for

    rng = np.random.default_rng(11)
    rows, cols = 40, 3 * dt.block
    W = rng.standard_normal((rows, cols)).astype(np.float32)
    named = dt.named(dt.encode(W), W.shape)
    kp = tuple(named[n].view(np.uint16) if named[n].dtype == np.float16 else named[n] for n in dt.kernel_parts)
    ops = ops_for(dt.name)
    ref = dt.decode(named, W.shape)
    out = np.full_like(ref, np.nan)
    ops.dequant(kp, 5, 29, out[5:29])
    ops.dequant(kp, 0, 5, out[:5])
    ops.dequant(kp, 29, rows, out[29:])
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))
    X = rng.standard_normal((6, cols)).astype(np.float32)
    # two fused matrices: rows 0..24 and 24..40 of W, written side by side
    top = tuple(p[:24] for p in kp)
    bottom = tuple(p[24:] for p in kp)
    empty = tuple(p[:0] for p in kp)
    fused = tuple((top[k], bottom[k], empty[k]) for k in range(len(kp)))
    got = np.zeros((6, rows), np.float32)
    ops.small(fused, 2, np.array([0, 24, 0], np.int64), X, got)
    want = X.astype(np.float64) @ ref.astype(np.float64).T
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    one = np.zeros((1, rows), np.float32)
    ops.small(fused, 2, np.array([0, 24, 0], np.int64), X[3:4].copy(), one)
    assert np.array_equal(one[0], got[3])


def check_int_kernels(dt: DType) -> None:
    """The integer-activation decode kernels (qdot.py), int8 and int16, AVX2 and VNNI
    forms: the float64 twin (``qdot.qdot_ref``: the same rounded activations, the
    weights decoded in numpy), row-exact, both forms the same bits. Without AVX2 the
    kernel set takes the float kernels, which ``check_kernels`` covers."""
    from cortiq_engine.kernels import qdot
    from cortiq_engine.kernels.fast import NumbaKernels
    from cortiq_engine.weights import Weight

    assert dt.has_int8_kernels
    rng = np.random.default_rng(5)
    cols = 3 * dt.block
    ws = []
    for i, rows in enumerate((50, 17, 33)):
        W = rng.standard_normal((rows, cols)).astype(np.float32)
        named = dt.named(dt.encode(W), W.shape)
        ws.append(
            Weight(
                f"w{i}",
                dt.name,
                rows,
                cols,
                {n: a.view(np.uint16) if a.dtype == np.float16 else a for n, a in named.items()},
            )
        )
    forms = (False, True) if qdot.host_vnni() else (False,)
    for bits in (8, 16):
        results = []
        for vnni in forms:
            ks = NumbaKernels(act_bits=bits, vnni=vnni)
            plan = ks._plans_for(ws)[0][0]
            if not qdot.host_supports():
                assert plan.fn is None
                return
            assert plan.fn is not None and plan.bits == bits
            X = np.random.default_rng(bits).standard_normal((9, cols)).astype(np.float32)
            fast = ks.matmul(ws, X)
            twin = np.concatenate([qdot.qdot_ref(dt.name, w.parts, X, bits) for w in ws], axis=1)
            assert np.abs(fast - twin).max() / np.abs(twin).max() < 2e-6
            for i in (0, 4, 8):
                assert np.array_equal(ks.matmul(ws, X[i : i + 1])[0], fast[i])
            results.append(fast)
        assert all(np.array_equal(r, results[0]) for r in results)


def check_llama_cpp_bytes(dt: DType, ggml_type) -> None:
    """Our encoder's blocks equal llama.cpp's own library's (``ggml_quantize_chunk``), with
    and without an imatrix, on normal, heavy-tailed and mostly-zero rows."""
    from tests.ggml_oracle import ggml_library_quantize

    rng = np.random.default_rng(0)
    shape = (16, 1024)
    cases = [
        rng.standard_normal(shape),
        rng.standard_t(3, shape) * 0.02,
        rng.standard_normal(shape) * (rng.random(shape) < 0.1),
    ]
    imp = (rng.random(shape[1]) ** 3 * 10 + 0.01).astype(np.float32)
    for x in cases:
        x = x.astype(np.float32)
        for im in (None, imp):
            ours = dt.to_ggml(dt.named(dt.encode(x, im), x.shape)).reshape(shape[0], -1)
            assert np.array_equal(ours, ggml_library_quantize(x, ggml_type, im))


def relative_rms(dt: DType, x: np.ndarray, importance: np.ndarray | None = None) -> float:
    """sqrt(sum (w e^2) / sum (w x^2)) in float64 of x encoded by ``dt`` (w = importance or 1)."""
    named = dt.named(dt.encode(x, importance), x.shape)
    e = dt.decode(named, x.shape).astype(np.float64) - x.astype(np.float64)
    w = np.ones(x.shape[-1]) if importance is None else importance.astype(np.float64)
    return float(np.sqrt((e * e * w).sum() / (x.astype(np.float64) ** 2 * w).sum()))


def weighted_rms_of_plain(dt: DType, x: np.ndarray, importance: np.ndarray) -> float:
    """``relative_rms`` weighted by ``importance`` of the encoding made without it."""
    named = dt.named(dt.encode(x), x.shape)
    e = dt.decode(named, x.shape).astype(np.float64) - x.astype(np.float64)
    w = importance.astype(np.float64)
    return float(np.sqrt((e * e * w).sum() / (x.astype(np.float64) ** 2 * w).sum()))


# ---------------------------------------------------------------- a GGUF with these blocks


def write_gguf_with(path: Path, ggml_type_name: str, dt: DType, tmp: Path) -> tuple[Path, dict[str, str]]:
    """A tiny llama GGUF as llama.cpp writes it, every matrix whose rows fit ``dt`` stored
    as ``ggml_type_name`` blocks (our encoder's: gguf-py has no encoder for the type).
    Returns the path and {GGUF tensor name: HF name} of those matrices."""
    import gguf

    from tests.test_gguf_import import TINY, write_tiny_gguf
    from tests.tiny import build_tiny

    model = build_tiny("llama", **dict(TINY, hidden_size=256, intermediate_size=512, head_dim=64))
    plain = write_tiny_gguf(model, tmp / "plain.gguf", "llama")
    reader = gguf.GGUFReader(plain)
    w = gguf.GGUFWriter(str(path), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(name, field.contents(), field.types[0], sub)
    stored: dict[str, str] = {}
    qt = gguf.GGMLQuantizationType[ggml_type_name]
    for t in reader.tensors:
        x = np.array(t.data, dtype=np.float32).reshape(tuple(int(s) for s in reversed(t.shape)))
        if x.ndim == 2 and dt.supports(x.shape):
            blocks = dt.to_ggml(dt.named(dt.encode(x), x.shape))
            w.add_tensor(t.name, blocks.reshape(x.shape[0], -1), raw_dtype=qt)
            stored[t.name] = ""
        else:
            w.add_tensor(t.name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, stored


def check_gguf_keep(dtype_name: str, ggml_type_name: str, dt: DType, tmp: Path) -> Path:
    """``cortiq convert X.gguf --quant keep`` copies the blocks: the CMF parts are the GGUF's
    bytes, their values gguf-py's dequantization. Returns the CMF path."""
    import gguf

    src, stored = write_gguf_with(tmp / f"tiny-{dtype_name}.gguf", ggml_type_name, dt, tmp)
    assert len(stored) >= 7  # q, k, v, o, gate, up, down of each layer (the embeddings too)
    out = tmp / f"keep-{dtype_name}.cmf"
    r = runner.invoke(app, ["convert", str(src), str(out), "--quant", "keep", "--json"])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    tensors = {t.name: t for t in gguf.GGUFReader(src).tensors}
    heads = {"attn_q": 4, "attn_k": 2}  # TINY's heads, llama.cpp's permuted q/k rows
    with CmfFile(out) as f:
        checked = 0
        for gname in stored:
            t = tensors[gname]
            hname = _hf_name(gname)
            assert f.info(hname).dtype == dtype_name, (gname, f.info(hname).dtype)
            rows = f.info(hname).shape[0]
            blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1, dt.block_bytes)
            ref = gguf.quants.dequantize(t.data, t.tensor_type)
            kind = gname.split(".")[-2]
            if kind in heads:
                blocks = unpermute_rope_rows(blocks, heads[kind])
                ref = unpermute_rope_rows(ref, heads[kind])
            assert np.array_equal(dt.to_ggml(f.tensor_parts(hname)), blocks)
            assert np.array_equal(f.tensor_f32(hname), ref)
            checked += 1
        assert checked == len(stored)
    assert len(rep["block_copied"]) == len(stored)
    return out


def _hf_name(gname: str) -> str:
    from tests.test_gguf_import import _HF_TO_GGUF, _TOP

    for hf, g in _TOP.items():
        if g == gname:
            return hf
    _, layer, module, kind = gname.split(".")
    hf_module = next(m for m, g in _HF_TO_GGUF.items() if g == module)
    return f"model.layers.{layer}.{hf_module}.{kind}"
