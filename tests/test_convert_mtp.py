"""MTP draft layers: each naming scheme, the sidecar, and ``check_sidecar``.

The trunks of the MTP families (DeepSeek-V3, MiMo-V2, Qwen3-Next) are not supported
yet, so each test checkpoint is a tiny llama trunk plus MTP tensors written with
safetensors under the family's names, with the family's config keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from formats.cmf import CmfFile
from formats.convert import TOKENIZER_TENSOR, check_sidecar, sidecar_path
from cortiq_engine.convert import convert_checkpoint
from formats.errors import CortiqError
from formats.sidecar import backbone_identity, open_sidecar
from tests.tiny import save_tiny

SCHEMES = ("deepseek", "mimo", "qwen3_next")


def _block(cfg: dict, rng) -> dict[str, np.ndarray]:
    """One llama-shaped transformer block (names relative to the layer)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    shapes = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (nh * hd, h),
        "self_attn.k_proj.weight": (nkv * hd, h),
        "self_attn.v_proj.weight": (nkv * hd, h),
        "self_attn.o_proj.weight": (h, nh * hd),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    return {k: rng.standard_normal(s).astype(np.float32) * 0.05 for k, s in shapes.items()}


def add_mtp(folder: Path, scheme: str, seed: int = 1) -> dict[str, np.ndarray]:
    """Write MTP tensors into ``folder`` under ``scheme``'s names; return them under CMF names."""
    cfg = json.loads((folder / "config.json").read_text())
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    rng = np.random.default_rng(seed)
    n = 3 if scheme == "mimo" else 1
    written: dict[str, np.ndarray] = {}
    expected: dict[str, np.ndarray] = {}
    for k in range(n):
        norm = lambda: (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)  # noqa: E731
        own = {
            "enorm.weight": norm(),
            "hnorm.weight": norm(),
            "eh_proj.weight": rng.standard_normal((h, 2 * h)).astype(np.float32) * 0.05,
            "final_layernorm.weight": norm(),
            **_block(cfg, rng),
        }
        for rest, x in own.items():
            expected[f"model.mtp.layers.{k}.{rest}"] = x
        if scheme == "deepseek":
            p = f"model.layers.{L + k}."
            for rest, x in own.items():
                written[p + ("shared_head.norm.weight" if rest == "final_layernorm.weight" else rest)] = x
            # copies of the trunk's embedding and head that DeepSeek ships per MTP layer
            written[p + "embed_tokens.weight"] = rng.standard_normal((cfg["vocab_size"], h)).astype(np.float32)
            written[p + "shared_head.head.weight"] = rng.standard_normal((cfg["vocab_size"], h)).astype(np.float32)
        elif scheme == "mimo":
            for rest, x in own.items():
                written[f"model.mtp.layers.{k}.{rest}"] = x
        else:
            shared = {
                "enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                "hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
                "eh_proj.weight": "mtp.fc.weight",
                "final_layernorm.weight": "mtp.norm.weight",
            }
            for rest, x in own.items():
                written[shared.get(rest, f"mtp.layers.{k}.{rest}")] = x
    cfg["num_nextn_predict_layers"] = n
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(written, folder / "mtp.safetensors")
    if scheme == "deepseek":  # DeepSeek ships an index; exercise that path too
        from safetensors import safe_open

        wm = {}
        for f in folder.glob("*.safetensors"):
            with safe_open(f, "np") as s:
                wm.update({k: f.name for k in s.keys()})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return expected


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("trunk"))


def _copy_trunk(trunk: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in trunk.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.mark.parametrize("scheme", SCHEMES)
def test_sidecar_split_per_scheme(trunk, tmp_path, scheme):
    src = _copy_trunk(trunk, tmp_path / "src")
    expected = add_mtp(src, scheme)
    out = tmp_path / "m.cmf"
    rep = convert_checkpoint(src, out, quant="f32")
    side = sidecar_path(out)
    assert rep.sidecar == side == tmp_path / "m.mtp.cmf"
    assert rep.mtp_tensors == len(expected)
    with CmfFile(out) as main, CmfFile(side) as sc:
        assert not any(".mtp." in n for n in main.tensors)
        assert set(sc.tensors) == set(expected)
        for name, x in expected.items():
            assert np.array_equal(sc.tensor_f32(name), x), name
        assert TOKENIZER_TENSOR in main.tensors and TOKENIZER_TENSOR not in sc.tensors
        n_layers = 3 if scheme == "mimo" else 1
        assert main.header["mtp"] == {
            "num_layers": n_layers,
            "style": scheme,
            "location": "sidecar",
            "sidecar": "m.mtp.cmf",
        }
        assert main.header["arch"]["mtp"] == {"num_layers": n_layers, "style": scheme}
        assert sc.header["role"] == "mtp_sidecar"
        assert sc.header["backbone"] == backbone_identity(main.header, "m.cmf")
        assert sc.header["backbone"]["fingerprint"] == main.header["source"]["fingerprint"]
        check_sidecar(main.header, sc.header)
        opened = open_sidecar(out, main.header)
        assert opened is not None and set(opened.tensors) == set(expected)
        opened.close()


def test_inline_and_drop(trunk, tmp_path):
    src = _copy_trunk(trunk, tmp_path / "src")
    expected = add_mtp(src, "mimo")
    rep = convert_checkpoint(src, tmp_path / "in.cmf", quant="q8", mtp="inline")
    assert rep.sidecar is None and not sidecar_path(tmp_path / "in.cmf").exists()
    with CmfFile(rep.output) as f:
        assert set(expected) <= set(f.tensors)
        assert f.tensors["model.mtp.layers.2.eh_proj.weight"].dtype == "q8"
        assert f.tensors["model.mtp.layers.2.enorm.weight"].dtype == "f32"
        assert f.header["mtp"]["location"] == "inline"
    rep = convert_checkpoint(src, tmp_path / "drop.cmf", quant="q8", mtp="drop")
    with CmfFile(rep.output) as f:
        assert not any(".mtp." in n for n in f.tensors) and f.header["mtp"]["location"] == "drop"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drop.cmf", "in.cmf", "src"]


def test_check_sidecar_names_every_difference(trunk, tmp_path):
    src = _copy_trunk(trunk, tmp_path / "src")
    add_mtp(src, "deepseek")
    out = convert_checkpoint(src, tmp_path / "m.cmf").output
    with CmfFile(out) as main, CmfFile(sidecar_path(out)) as sc:
        mh, sh = main.header, sc.header
    for key, label in [
        ("arch", "arch"),
        ("hidden_size", "hidden size"),
        ("vocab_size", "vocab size"),
        ("num_layers", "layer count"),
        ("num_heads", "heads"),
        ("num_kv_heads", "KV heads"),
        ("head_dim", "head dim"),
        ("fingerprint", "fingerprint"),
    ]:
        bad = json.loads(json.dumps(sh))
        bad["backbone"][key] = "qwen9" if key == "arch" else ("0123456789abcdef" if key == "fingerprint" else 999)
        with pytest.raises(CortiqError, match=f"does not match its backbone: {label} ") as e:
            check_sidecar(mh, bad)
        assert "\n" not in str(e.value)
    bad = json.loads(json.dumps(sh))
    bad["backbone"].update(hidden_size=1, vocab_size=2)
    with pytest.raises(
        CortiqError, match="hidden size 64 in the backbone, 1 in the sidecar; vocab size 256 in the backbone, 2"
    ):
        check_sidecar(mh, bad)
    with pytest.raises(CortiqError, match="not an MTP sidecar"):
        check_sidecar(mh, mh)


def test_sidecar_from_another_model_is_rejected(tmp_path):
    a = save_tiny("llama", tmp_path / "a", seed=0)
    b = save_tiny("llama", tmp_path / "b", seed=1)  # same geometry, other weights (a "fine-tune")
    c = save_tiny("llama", tmp_path / "c", seed=0, hidden_size=128, num_attention_heads=8, num_key_value_heads=4)
    for d in (a, b, c):
        add_mtp(d, "qwen3_next")
    out = {k: convert_checkpoint(d, tmp_path / f"{k}.cmf").output for k, d in (("a", a), ("b", b), ("c", c))}
    with CmfFile(out["a"]) as fa:
        for other, what in (("b", "fingerprint"), ("c", "hidden size 64 in the backbone, 128 in the sidecar")):
            with CmfFile(sidecar_path(out[other])) as sc:
                with pytest.raises(CortiqError, match=what):
                    check_sidecar(fa.header, sc.header)
        # an impostor put in place of a's own sidecar is caught when it is opened
        os.replace(sidecar_path(out["b"]), sidecar_path(out["a"]))
        with pytest.raises(CortiqError, match=r"a\.mtp\.cmf: MTP sidecar does not match its backbone: fingerprint"):
            open_sidecar(out["a"], fa.header)


def test_fingerprint_ignores_export_dtype_and_quant(tmp_path):
    f32 = save_tiny("llama", tmp_path / "f32", seed=4)
    bf16 = save_tiny("llama", tmp_path / "bf16", seed=4, dtype="bfloat16")
    fps = set()
    for d, q in ((f32, "q8"), (f32, "q4"), (bf16, "f16")):
        with CmfFile(convert_checkpoint(d, tmp_path / f"{d.name}-{q}.cmf", quant=q).output) as f:
            fps.add(f.header["source"]["fingerprint"])
    assert len(fps) == 1


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.mtp.layers.1.enorm.weight"), "missing tensor model.mtp.layers.1.enorm.weight"),
        (
            lambda t: t.__setitem__("model.mtp.layers.0.eh_proj.weight", np.zeros((64, 64), np.float32)),
            r"model.mtp.layers.0.eh_proj.weight has shape \[64, 64\], config.json implies \[64, 128\]",
        ),
        (
            lambda t: t.pop("model.mtp.layers.2.mlp.up_proj.weight"),
            "missing tensor model.mtp.layers.2.mlp.up_proj.weight",
        ),
        (lambda t: [t.pop(k) for k in list(t) if k.startswith("model.mtp.layers.1.")], r"MTP layers \[0, 2\]"),
    ],
    ids=["missing-enorm", "eh_proj-shape", "missing-mlp", "gap"],
)
def test_malformed_mtp_layers(trunk, tmp_path, edit, message):
    src = _copy_trunk(trunk, tmp_path / "src")
    add_mtp(src, "mimo")
    from safetensors.numpy import load_file

    t = load_file(src / "mtp.safetensors")
    edit(t)
    save_file(t, src / "mtp.safetensors")
    with pytest.raises(CortiqError, match=message):
        convert_checkpoint(src, tmp_path / "m.cmf")
    convert_checkpoint(src, tmp_path / "m.cmf", mtp="drop")  # dropping them needs no valid draft layers


def test_extra_layers_without_mtp_config_are_an_error(trunk, tmp_path):
    src = _copy_trunk(trunk, tmp_path / "src")
    add_mtp(src, "deepseek")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["num_nextn_predict_layers"]
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CortiqError, match="num_hidden_layers=2.*num_nextn_predict_layers"):
        convert_checkpoint(src, tmp_path / "m.cmf")


def test_existing_sidecar_needs_force_and_interrupt_leaves_neither(trunk, tmp_path):
    src = _copy_trunk(trunk, tmp_path / "src")
    add_mtp(src, "deepseek")
    out = tmp_path / "m.cmf"
    sidecar_path(out).write_bytes(b"old sidecar")
    with pytest.raises(CortiqError, match=r"m\.mtp\.cmf exists"):
        convert_checkpoint(src, out)
    assert not out.exists()
    sidecar_path(out).unlink()

    def stop(name, done, total):
        if ".mtp." in name:  # the main file is complete by now; the sidecar is half written
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(src, out, progress=stop)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    convert_checkpoint(src, out)
    sizes = (out.stat().st_size, sidecar_path(out).stat().st_size)
    convert_checkpoint(src, out, quant="q4", force=True)
    assert (out.stat().st_size, sidecar_path(out).stat().st_size) != sizes
