"""iq4_nl (llama.cpp's IQ4_NL): its bytes against gguf-py, its decoding against float64
math, its float kernels against their numpy twin and float64, its integer kernels
against float64 on every index, its encoder against llama.cpp's
own library and a file llama.cpp's quantizer wrote (the llamacpp marker), GGUF blocks
copied bit for bit, ``cortiq convert --quant iq4_nl``, and iq4_xs falling back to it
where a row is no multiple of 256."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine.convert import convert_checkpoint
from formats.cmf import CmfFile
from formats.iq4_nl import KVALUES_IQ4NL
from formats.quants import get_dtype, resolve_dtype
from tests import superblocks as sb
from tests.tiny import save_tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import kld_vs_llamacpp  # noqa: E402

DT = get_dtype("iq4_nl")
runner = CliRunner()
MATRICES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def test_layout_is_ggml_block_iq4_nl():
    assert DT.block == 32 and DT.block_bytes == 18 and DT.bits == 4.5 and DT.ggml_type == "IQ4_NL"
    assert resolve_dtype("IQ4_NL") is DT and DT.takes_imatrix
    sb.check_ggml_layout(DT, GT.IQ4_NL)


def test_kernels_against_numpy_and_float64():
    sb.check_kernels(DT)


def test_kernels_compute_every_level_exactly():
    """The kernels compute the grid's levels (a rounded fit, no table): each index, exactly."""
    from cortiq_engine.kernels.dtype_ops import ops_for

    ops = ops_for("iq4_nl")
    n = np.arange(16, dtype=np.uint8)
    qs = (n | (15 - n) << 4).reshape(1, 16)  # elements 0..15 get indices 0..15, 16..31 15..0
    d = np.float16(0.5).reshape(1, 1).view(np.uint16)
    want = 0.5 * np.concatenate([KVALUES_IQ4NL, KVALUES_IQ4NL[::-1]]).astype(np.float32)
    out = np.zeros((1, 32), np.float32)
    ops.dequant((d, qs), 0, 1, out)
    assert np.array_equal(out[0], want)
    got = np.zeros((32, 1), np.float32)  # one input row per element: its value alone
    ops.small(((d, d[:0], d[:0]), (qs, qs[:0], qs[:0])), 1, np.zeros(3, np.int64), np.eye(32, dtype=np.float32), got)
    assert np.array_equal(got[:, 0], want)


def test_integer_kernels_against_float64_twin():
    sb.check_int_kernels(DT)


def test_integer_kernels_on_every_index():
    """Random bytes (every index in both nibbles; f16 scales of both signs) through the
    integer decode kernels of 1..16 input rows, both activation widths and both
    dot-product forms, against the float64 twin, each row bit for bit its one-row
    result. 11 blocks a row: one group of 8 and 3 left over (``qdot._gbody``), and an
    all-zero activation block (scale 0)."""
    from cortiq_engine.kernels import qdot
    from cortiq_engine.kernels.fast import NumbaKernels
    from cortiq_engine.weights import Weight

    rows, nb = 37, 11
    shape = (rows, nb * DT.block)
    named = DT.named(DT.from_ggml(sb.random_blocks(DT, rows, nb, seed=3)), shape)
    assert set(np.unique(named["qs"] & 15)) == set(np.unique(named["qs"] >> 4)) == set(range(16))
    parts = {n: a.view(np.uint16) if a.dtype == np.float16 else a for n, a in named.items()}
    w = Weight("w", DT.name, rows, shape[1], parts)
    X = np.random.default_rng(4).standard_normal((16, shape[1])).astype(np.float32)
    X[5, 64:96] = 0
    for bits in (8, 16):
        results = []
        for vnni in (False, True) if qdot.host_vnni() else (False,):
            ks = NumbaKernels(act_bits=bits, vnni=vnni)
            plan = ks._plans_for([w])[0][0]
            if not qdot.host_supports():
                assert plan.fn is None
                return
            assert plan.fn is not None and plan.bits == bits
            ones = np.concatenate([ks.matmul([w], X[i : i + 1]) for i in range(16)])
            for n in (1, 2, 3, 4, 5, 8, 13, 16):
                got = ks.matmul([w], X[:n])
                twin = qdot.qdot_ref(DT.name, named, X[:n], bits)
                assert np.abs(got - twin).max() / np.abs(twin).max() < 2e-6
                assert np.array_equal(got, ones[:n])
            results.append(ones)
        assert all(np.array_equal(r, results[0]) for r in results)


def test_round_trip_against_float64():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 1024)).astype(np.float32)
    named = DT.named(DT.encode(x), x.shape)
    # the decoding is d * grid level, computed in float64 from the raw parts
    d = named["d"].astype(np.float64).reshape(32, -1, 1)
    qs = named["qs"].reshape(32, -1, 16)
    q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(32, -1, 32)  # element j low nibble, j + 16 high
    want = (d * KVALUES_IQ4NL.astype(np.float64)[q]).reshape(x.shape)
    got = DT.decode(named, x.shape)
    assert np.array_equal(got, want.astype(np.float32))
    # N(0, 1): the non-linear grid beats q4_0's linear one at the same 4.5 bits, and
    # sits just above iq4_xs (the same grid, 6-bit scales under one f16)
    err = sb.relative_rms(DT, x)
    assert 0.05 < err < sb.relative_rms(get_dtype("q4_0"), x)
    assert err < sb.relative_rms(get_dtype("iq4_xs"), x)
    # each block's scale is the best of its searched ones: by the encoder's measure, the
    # error weighted by x^2, no worse than the plain max-abs scale's, block by block
    b = x.reshape(32, -1, 32).astype(np.float64)
    mx = np.take_along_axis(b, np.abs(b).argmax(axis=2)[:, :, None], axis=2)
    d0 = (mx / -127).astype(np.float16).astype(np.float64)
    lv = KVALUES_IQ4NL.astype(np.float64)
    plain = d0 * lv[np.abs(b[..., None] / d0[..., None] - lv).argmin(axis=-1)]
    ours = got.reshape(b.shape).astype(np.float64)
    werr = [(b * b * (y - b) ** 2).sum(axis=2) for y in (ours, plain)]
    assert (werr[0] <= werr[1] * 1.0001).mean() > 0.99
    # zeros encode as zeros; rows are independent
    z = np.zeros((2, 64), np.float32)
    assert not DT.decode(DT.named(DT.encode(z), z.shape), z.shape).any()
    both = DT.encode(x)
    halves = [DT.encode(x[:10]), DT.encode(x[10:])]
    assert all(np.array_equal(a, np.concatenate([h0, h1])) for a, h0, h1 in zip(both, *halves))


def test_imatrix_lowers_the_weighted_error():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 512)).astype(np.float32)
    imp = (rng.random(512) ** 6 * 100).astype(np.float32)  # a few columns matter most
    assert sb.relative_rms(DT, x, imp) < sb.weighted_rms_of_plain(DT, x, imp)


@pytest.mark.llamacpp
def test_encoder_is_llama_cpp_byte_for_byte():
    sb.check_llama_cpp_bytes(DT, GT.IQ4_NL)


def test_gguf_blocks_copy_bit_for_bit_and_run(tmp_path):
    from cortiq_engine import Engine, forward

    out = sb.check_gguf_keep("iq4_nl", "IQ4_NL", DT, tmp_path)
    ids = np.random.default_rng(2).integers(0, 256, 10)
    logits = {}
    for k in ("numba", "numba-float", "numpy"):
        eng = Engine.load(out, kernels=k)
        st = eng.new_state(32)
        h = np.concatenate([forward(st, ids[:8])] + [forward(st, ids[i : i + 1]) for i in range(8, 10)])
        logits[k] = eng.model.lm_head(eng.model.final_norm(h))
    scale = np.abs(logits["numpy"]).max()
    assert np.abs(logits["numba-float"] - logits["numpy"]).max() <= 1e-4 * scale
    # decode rounds activations to int8 per block of 32 (qdot.py), as for iq4_xs
    rel = np.linalg.norm(logits["numba"] - logits["numpy"]) / np.linalg.norm(logits["numpy"])
    assert rel <= 3e-2


@pytest.mark.llamacpp
def test_llama_cpp_file_copies_bit_for_bit(tmp_path):
    """llama.cpp's quantizer writes an IQ4_NL file of a tiny llama; ``--quant keep`` copies
    its IQ4_NL blocks, and cortiq's encoder writes the same blocks from the F32 file."""
    import gguf

    from formats.gguf_import import unpermute_rope_rows
    from tests.test_gguf_import import TINY, write_tiny_gguf
    from tests.tiny import build_tiny

    model = build_tiny("llama", **dict(TINY, hidden_size=96, intermediate_size=160, head_dim=24))
    f32 = write_tiny_gguf(model, tmp_path / "f32.gguf", "llama")
    nl = tmp_path / "iq4_nl.gguf"
    kld_vs_llamacpp.quantize(f32, nl, "iq4_nl", threads=1)
    for name, src, how in (("keep", nl, ["--quant", "keep"]), ("ours", f32, ["--quant", "f32", "--keep", "*=iq4_nl"])):
        r = runner.invoke(app, ["convert", str(src), str(tmp_path / f"{name}.cmf"), *how])
        assert r.exit_code == 0, r.stderr
    stored = [t for t in gguf.GGUFReader(nl).tensors if t.tensor_type == GT.IQ4_NL]
    assert len(stored) >= 7
    with CmfFile(tmp_path / "keep.cmf") as kept, CmfFile(tmp_path / "ours.cmf") as ours:
        for t in stored:
            hname = sb._hf_name(t.name)
            rows = kept.info(hname).shape[0]
            blocks = np.asarray(t.data, dtype=np.uint8).reshape(rows, -1, DT.block_bytes)
            kind = t.name.split(".")[-2]
            if kind in ("attn_q", "attn_k"):
                blocks = unpermute_rope_rows(blocks, {"attn_q": 4, "attn_k": 2}[kind])
            for f in (kept, ours):
                assert f.info(hname).dtype == "iq4_nl"
                assert np.array_equal(DT.to_ggml(f.tensor_parts(hname)), blocks), (t.name, f)


def test_convert_writes_the_dtype_and_runs(tmp_path):
    """``--quant iq4_nl``, llama.cpp's IQ4_NL mix: the layers' matrices iq4_nl (two layers
    and two query heads per KV head: no Q5_K site), the embeddings q6k's (q8 where a row is
    no multiple of 256, its fallback)."""
    src = save_tiny("llama", tmp_path / "m", hidden_size=96, intermediate_size=160, head_dim=24)
    how = ["--quant", "iq4_nl", "--json"]
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "m.cmf"), *how])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    chosen = {t["name"]: t["dtype"] for t in rep["tensors"]}
    assert {chosen[f"model.layers.{i}.{m}.weight"] for i in (0, 1) for m in MATRICES} == {"iq4_nl"}
    assert chosen["lm_head.weight"] == "q8" and chosen["model.layers.0.input_layernorm.weight"] == "f32"
    assert 0.05 < rep["dtypes"]["iq4_nl"]["rms_rel_error"] < 0.09
    r = runner.invoke(app, ["generate", str(tmp_path / "m.cmf"), "-p", "hello", "-n", "4", "--json"])
    assert r.exit_code == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 4


def test_iq4_xs_falls_back_to_iq4_nl_where_rows_are_576_wide(tmp_path):
    src = save_tiny(
        "llama",
        tmp_path / "m",
        hidden_size=576,
        intermediate_size=512,
        head_dim=64,
        num_attention_heads=9,
        num_key_value_heads=3,
    )
    rep = convert_checkpoint(src, tmp_path / "m.cmf", quant="iq4_xs")
    chosen = {t.name: t.dtype for t in rep.tensors}
    # 512 input columns: IQ4_XS's super-blocks; 576: its fallback, IQ4_NL
    assert chosen["model.layers.0.mlp.down_proj.weight"] == "iq4_xs"
    for m in MATRICES[:-1]:
        assert chosen[f"model.layers.0.{m}.weight"] == "iq4_nl", m
    assert chosen["lm_head.weight"] == "q8"  # q6k's fallback, as llama.cpp's output tensor
    assert 0.05 < rep.by_dtype["iq4_nl"].rms_rel_error < 0.09
