"""``formats.convert`` on tiny real HF checkpoints, against torch and ggml as oracles."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT
from gguf import quants as gq

import formats.convert as conv
from formats.quants import quantize_q8
from tests.ggml_oracle import ggml_decode_q8
from formats.cmf import CmfFile, rewrite_header
from formats.convert import TOKENIZER_TENSOR
from cortiq_engine.convert import convert_checkpoint
from formats.errors import CortiqError
from tests.tiny import build_tiny, save_tiny, write_byte_tokenizer


def _state(folder) -> dict[str, np.ndarray]:
    """The checkpoint's tensors as f32 numpy, read by safetensors+torch (the oracle reader)."""
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def _cmf_tensors(path) -> dict[str, np.ndarray]:
    with CmfFile(path) as f:
        return {n: f.tensor_f32(n) for n in f.tensors if n != TOKENIZER_TENSOR}


def test_f32_conversion_is_exact_and_header_complete(llama, tmp_path):
    out = tmp_path / "m.cmf"
    rep = convert_checkpoint(llama, out, quant="f32")
    src = _state(llama)
    got = _cmf_tensors(out)
    assert set(got) == set(src)
    for name, x in src.items():
        assert np.array_equal(got[name], x), name
    with CmfFile(out) as f:
        h = f.header
        assert f.raw_bytes(TOKENIZER_TENSOR) == (llama / "tokenizer.json").read_bytes()
        assert all(f.tensors[n].dtype == "f32" for n in src)
    cfg = json.loads((llama / "config.json").read_text())
    assert h["role"] == "model" and h["format"] == "cmf"
    a = h["arch"]
    assert (a["arch"], a["hidden_size"], a["num_layers"], a["num_heads"], a["num_kv_heads"], a["head_dim"]) == (
        "llama",
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        16,
    )
    assert a["rope_theta"] == 10000.0 and a["norm_eps"] == cfg["rms_norm_eps"] and a["layer_types"] == ["full", "full"]
    assert h["generation_config"] == json.loads((llama / "generation_config.json").read_text())
    assert h["source"]["path"] == str(llama.resolve()) and len(h["source"]["fingerprint"]) == 16
    assert h["source"]["parameters"] == sum(x.size for x in src.values())
    assert h["converter"]["name"] == "cortiq" and h["calibration"] == {"temperature": None}
    assert h["tokenizer"]["tensor"] == TOKENIZER_TENSOR and h["tokenizer"]["vocab_size"] == 256
    assert h["mtp"] is None and rep.sidecar is None
    assert rep.by_dtype["f32"].rms_rel_error == 0.0


@pytest.mark.parametrize("quant, gtype", [("q8", GT.Q8_0), ("q4", GT.Q4_1)])
def test_quantized_matrices_equal_ggml(llama, tmp_path, quant, gtype):
    out = tmp_path / "m.cmf"
    rep = convert_checkpoint(llama, out, quant=quant)
    src = _state(llama)
    errs = {}
    with CmfFile(out) as f:
        for name, x in src.items():
            info = f.tensors[name]
            if x.ndim == 1:
                assert info.dtype == "f32" and np.array_equal(f.tensor_f32(name), x)
                continue
            # q4 keeps embeddings and lm_head at q8, as llama.cpp does for its output tensor
            want = "q8" if quant == "q4" and name in ("model.embed_tokens.weight", "lm_head.weight") else quant
            assert info.dtype == want, name
            # q8: the encoder's bytes read back by ggml's own Q8_0 decoder
            oracle = (
                ggml_decode_q8(*quantize_q8(x))
                if want == "q8"
                else gq.dequantize(gq.quantize(x, gtype), gtype).reshape(x.shape)
            )
            got = f.tensor_f32(name)
            assert np.array_equal(got, oracle), name
            e = errs.setdefault(want, [0.0, 0.0])
            e[0] += float(((got.astype(np.float64) - x) ** 2).sum())
            e[1] += float((x.astype(np.float64) ** 2).sum())
    for dt, (num, den) in errs.items():  # the report's error is the real one
        assert rep.by_dtype[dt].rms_rel_error == pytest.approx(np.sqrt(num / den), rel=1e-9)
    assert rep.by_dtype[quant].rms_rel_error < (0.005 if quant == "q8" else 0.12)


def test_slicing_does_not_change_a_byte(llama, tmp_path, monkeypatch):
    whole = tmp_path / "whole.cmf"
    convert_checkpoint(llama, whole, quant="q4")
    monkeypatch.setattr(conv, "SLICE_ELEMS", 100)  # one row per slice
    sliced = tmp_path / "sliced.cmf"
    convert_checkpoint(llama, sliced, quant="q4")
    with CmfFile(whole) as a, CmfFile(sliced) as b:
        assert {n: t.crc32 for n, t in a.tensors.items()} == {n: t.crc32 for n, t in b.tensors.items()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_sources(tmp_path, dtype):
    import torch

    src = save_tiny("qwen3", tmp_path / "src", dtype=dtype, head_dim=16)
    st = {}
    from safetensors.torch import load_file

    st = load_file(src / "model.safetensors")
    assert all(v.dtype == getattr(torch, dtype) for v in st.values())
    f32 = _cmf_tensors(convert_checkpoint(src, tmp_path / "f32.cmf", quant="f32").output)
    for name, t in st.items():
        assert np.array_equal(f32[name], t.float().numpy()), name
    same = "bf16" if dtype == "bfloat16" else "f16"
    rep = convert_checkpoint(src, tmp_path / "same.cmf", quant=same)
    assert rep.by_dtype[same].rms_rel_error == 0.0  # a lossless copy, bit for bit
    with CmfFile(rep.output) as f:
        w = "model.layers.0.self_attn.q_proj.weight"
        assert (
            f.tensor_parts(w)["data"].view(np.uint16).tobytes()
            == st[w].contiguous().view(torch.int16).numpy().tobytes()
        )
    q8 = _cmf_tensors(convert_checkpoint(src, tmp_path / "q8.cmf", quant="q8").output)
    x = st["model.layers.1.mlp.down_proj.weight"].float().numpy()
    assert np.array_equal(q8["model.layers.1.mlp.down_proj.weight"], ggml_decode_q8(*quantize_q8(x)))


def test_f32_source_to_half_dtypes_match_torch_casts(llama, tmp_path):
    import torch

    src = _state(llama)
    w = "model.layers.1.self_attn.o_proj.weight"
    t = torch.from_numpy(src[w])
    assert np.array_equal(
        _cmf_tensors(convert_checkpoint(llama, tmp_path / "a.cmf", quant="f16").output)[w], t.half().float().numpy()
    )
    assert np.array_equal(
        _cmf_tensors(convert_checkpoint(llama, tmp_path / "b.cmf", quant="bf16").output)[w],
        t.bfloat16().float().numpy(),
    )


def test_sharded_checkpoint_converts_like_a_single_file(tmp_path):
    model = build_tiny("llama", seed=3)
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="100KB")
    for d in (single, sharded):
        write_byte_tokenizer(d)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) >= 3
    a = convert_checkpoint(single, tmp_path / "a.cmf", quant="q8").output
    b = convert_checkpoint(sharded, tmp_path / "b.cmf", quant="q8").output
    with CmfFile(a) as fa, CmfFile(b) as fb:
        assert {n: (t.dtype, t.shape, t.crc32) for n, t in fa.tensors.items()} == {
            n: (t.dtype, t.shape, t.crc32) for n, t in fb.tensors.items()
        }
        assert fa.header["source"]["fingerprint"] == fb.header["source"]["fingerprint"]


def test_tied_embeddings(tmp_path):
    src = save_tiny("llama", tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in _state(src)
    out = convert_checkpoint(src, tmp_path / "t.cmf", quant="q4").output
    with CmfFile(out) as f:
        assert "lm_head.weight" not in f.tensors
        assert f.header["arch"]["tie_word_embeddings"] is True
        assert f.tensors["model.embed_tokens.weight"].dtype == "q8"  # it serves as the output layer too


def test_missing_lm_head_means_tied(tmp_path):
    src = save_tiny("llama", tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    from safetensors.numpy import save_file

    st = _state(src)
    del st["lm_head.weight"]
    save_file(st, src / "model.safetensors")
    with CmfFile(convert_checkpoint(src, tmp_path / "t.cmf", quant="f32").output) as f:
        assert f.header["arch"]["tie_word_embeddings"] is True and "lm_head.weight" not in f.tensors


def test_keep_policy_and_fallback(tmp_path, llama):
    rep = convert_checkpoint(
        llama,
        tmp_path / "k.cmf",
        quant="q4",
        keep=[("lm_head.weight", "f16"), ("model.layers.0.*", "bf16"), ("*norm*", "q8"), ("nothing.*", "f32")],
    )
    with CmfFile(rep.output) as f:
        d = {n: t.dtype for n, t in f.tensors.items()}
    assert d["lm_head.weight"] == "f16"
    assert d["model.embed_tokens.weight"] == "q8"
    assert d["model.layers.0.mlp.up_proj.weight"] == "bf16" and d["model.layers.1.mlp.up_proj.weight"] == "q4"
    assert d["model.layers.0.input_layernorm.weight"] == "f32"  # 1-D always stays f32
    assert rep.unused_keep == ["*norm*=q8", "nothing.*=f32"]
    # a width the quantized layouts cannot block falls back to f16, and is reported
    odd = save_tiny(
        "llama", tmp_path / "odd", hidden_size=48, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    rep = convert_checkpoint(odd, tmp_path / "odd.cmf", quant="q8")
    with CmfFile(rep.output) as f:
        assert f.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == "f16"
        assert f.tensors["model.layers.0.mlp.down_proj.weight"].dtype == "q8"  # its last dim is 96
    assert "model.layers.0.self_attn.q_proj.weight" in rep.fallbacks
    assert "model.layers.0.mlp.down_proj.weight" not in rep.fallbacks


def test_tokenizer_metadata(tmp_path):
    src = save_tiny("llama", tmp_path / "src", eos_token_id=3, bos_token_id=1)
    vocab = json.loads((src / "tokenizer.json").read_text())["model"]["vocab"]
    eos_text = next(t for t, i in vocab.items() if i == 7)
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (src / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": eos_text, "add_bos_token": True})
    )
    with CmfFile(convert_checkpoint(src, tmp_path / "t.cmf").output) as f:
        tok = f.header["tokenizer"]
    assert tok["chat_template"] == template
    assert tok["eos_token_ids"] == [3, 7]  # generation config first, then the tokenizer's eos token
    assert tok["bos_token_id"] == 1 and tok["add_bos_token"] is True and tok["eos_token"] == eos_text


def test_calibration_slot_is_rewritable(llama, tmp_path):
    out = convert_checkpoint(llama, tmp_path / "m.cmf", quant="q8").output
    with CmfFile(out) as f:
        h = f.header
    h["calibration"] = {"temperature": 1.7, "n_tokens": 1000}
    rewrite_header(out, h)
    with CmfFile(out) as f:
        assert f.header["calibration"]["temperature"] == 1.7 and all(ok for _, ok in f.verify())


def test_interrupted_conversion_leaves_nothing(llama, tmp_path):
    out = tmp_path / "m.cmf"
    seen = []

    def stop(name, done, total):
        seen.append(name)
        if len(seen) == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(llama, out, quant="q8", progress=stop)
    assert os.listdir(tmp_path) == []
    # and an existing output survives a failed --force conversion untouched
    out.write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(
            llama, out, quant="q8", force=True, progress=lambda *a: (_ for _ in ()).throw(KeyboardInterrupt)
        )
    assert out.read_bytes() == b"old" and os.listdir(tmp_path) == ["m.cmf"]


def test_progress_counts_source_bytes(llama, tmp_path):
    calls = []
    rep = convert_checkpoint(llama, tmp_path / "m.cmf", progress=lambda n, d, t: calls.append((n, d, t)))
    total = sum(x.nbytes for x in _state(llama).values())
    assert calls[-1][1] == calls[-1][2] == total == rep.source_bytes
    assert all(b[1] >= a[1] for a, b in zip(calls, calls[1:]))


def test_non_finite_and_oversized_values_are_refused(tmp_path):
    from safetensors.numpy import save_file

    src = save_tiny("llama", tmp_path / "src")
    st = _state(src)
    st["model.layers.0.mlp.up_proj.weight"][3, 5] = 1e6  # beyond f16's 65504
    save_file(st, src / "model.safetensors")
    with pytest.raises(CortiqError, match="does not fit f16"):
        convert_checkpoint(src, tmp_path / "a.cmf", quant="f16")
    convert_checkpoint(src, tmp_path / "b.cmf", quant="bf16")  # bf16 has the range
    st["model.layers.0.mlp.up_proj.weight"][3, 5] = np.nan
    save_file(st, src / "model.safetensors")
    with pytest.raises(CortiqError, match=r"up_proj.weight holds nan at row 3, column 5"):
        convert_checkpoint(src, tmp_path / "c.cmf", quant="q8")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.cmf", "src"]


_PEAK_SCRIPT = """
import sys
from cortiq_engine.convert import convert_checkpoint
convert_checkpoint(sys.argv[1], sys.argv[2], quant=sys.argv[3])
status = open("/proc/self/status").read()
print(next(int(l.split()[1]) for l in status.splitlines() if l.startswith("VmHWM:")) * 1024)
"""


def _write_llama(folder, vocab: int, hidden: int, layers: int) -> int:
    """A llama checkpoint written with numpy (no torch in the way); returns its bytes."""
    from safetensors.numpy import save_file

    folder.mkdir()
    rng = np.random.default_rng(0)
    inter = 2 * hidden
    cfg = dict(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    (folder / "config.json").write_text(json.dumps(cfg))
    write_byte_tokenizer(folder)
    t = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,)})
        t.update({p + f"self_attn.{k}_proj.weight": (hidden, hidden) for k in "qkvo"})
        t.update(
            {
                p + "mlp.gate_proj.weight": (inter, hidden),
                p + "mlp.up_proj.weight": (inter, hidden),
                p + "mlp.down_proj.weight": (hidden, inter),
            }
        )
    arrays = {k: rng.standard_normal(s, dtype=np.float32) for k, s in t.items()}
    save_file(arrays, folder / "model.safetensors")
    return sum(a.nbytes for a in arrays.values())


def test_peak_memory_follows_the_largest_tensor_not_the_model(tmp_path):
    """Peak RSS of a converting process, above a process that converted a tiny model,
    stays well under the model's size (the source is streamed a slice at a time)."""
    import subprocess
    import sys

    small = tmp_path / "small"
    _write_llama(small, vocab=256, hidden=64, layers=1)
    big = tmp_path / "big"
    total = _write_llama(big, vocab=32768, hidden=512, layers=8)  # ~200 MB f32, largest tensor 64 MB
    peaks = {}
    for name, src in (("small", small), ("big", big)):
        p = subprocess.run(
            [sys.executable, "-c", _PEAK_SCRIPT, str(src), str(tmp_path / f"{name}.cmf"), "q8"],
            capture_output=True,
            text=True,
            check=True,
        )
        peaks[name] = int(p.stdout.split()[-1])
    grown = peaks["big"] - peaks["small"]
    assert total > 190e6
    # Holding the model would grow by ~218 MB, holding its largest tensor as f32 by ~80 MB.
    assert grown < 0.25 * total, (grown, total)
