"""SmolLM3 on a tiny random checkpoint (fast, for CI): the engine against transformers'
SmolLM3ForCausalLM with NoPE layers (every second layer), sliding windows on them, attention
biases and tied embeddings; the NoPE layers and the windows are each visible in the logits."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cortiq_engine import Engine, SamplingConfig, forward
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.kernels import get_kernels
from cortiq_engine.models import build_model, parse_config, read_arch
from formats.arch import LAYER_FULL, LAYER_SLIDING
from formats.cmf import CmfFile
from formats.errors import CortiqError
from tests import arch_tiny
from tests.tiny import build_tiny

# Layers 1 and 3 are NoPE and (use_sliding_window) slide over 5 keys; 0 and 2 rotate, full.
TINY = arch_tiny.CONFIGS["smollm3"]


def sharpen(model, factor: float = 12.0):
    """q and k scaled up: the init's scores are near zero, where rotating them or not
    (and which keys a window drops) would hardly move the logits."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(factor)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm3")
    model = sharpen(build_tiny("smollm3", **TINY))
    src = arch_tiny.save(model, root / "hf")
    cmf = root / "s.cmf"
    convert_checkpoint(src, cmf, quant="f32")
    return model, src, cmf


def _config(tiny) -> dict:
    return json.loads((tiny[1] / "config.json").read_text())


def test_arch_parsed_from_config(tiny):
    cfg = _config(tiny)
    assert cfg["no_rope_layers"] == [1, 0, 1, 0]  # transformers' own reading of the interval
    arch = parse_config(cfg)
    assert arch.arch == "smollm3" and arch.attention_bias and arch.tie_word_embeddings
    assert arch.no_rope_layers == [1, 3]
    assert arch.layer_types == [LAYER_FULL, LAYER_SLIDING, LAYER_FULL, LAYER_SLIDING] and arch.sliding_window == 5
    # Without the per-layer lists, the config class's rules derive the same ones.
    derived = parse_config({k: v for k, v in cfg.items() if k not in ("no_rope_layers", "layer_types")})
    assert (derived.no_rope_layers, derived.layer_types) == (arch.no_rope_layers, arch.layer_types)
    plain = parse_config(
        {
            **{k: v for k, v in cfg.items() if k not in ("no_rope_layers", "layer_types")},
            "num_hidden_layers": 8,
            "no_rope_layer_interval": 4,
            "use_sliding_window": False,
        }
    )
    assert plain.no_rope_layers == [3, 7] and plain.layer_types == [LAYER_FULL] * 8 and plain.sliding_window == 0
    # No RoPE base in config.json: SmolLM3's default, not Llama's.
    bare = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_theta")}
    assert parse_config(bare).rope_theta == 2_000_000.0


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(tiny, kernels):
    model, _, cmf = tiny
    ids = arch_tiny.sample_ids(24)  # 24 > the window of 5: the sliding layers forget
    ref = arch_tiny.torch_logits(model, ids)
    with Engine.load(cmf, kernels=kernels) as eng:
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, ref) < 1e-4


def test_nope_layers_and_windows_matter(tiny):
    """The engine with RoPE on every layer, or without the windows, is far from
    transformers: the test above sees both."""
    model, _, cmf = tiny
    ids = arch_tiny.sample_ids(24)
    ref = arch_tiny.torch_logits(model, ids)
    ks = get_kernels("numpy")
    with CmfFile(cmf) as f:
        arch = read_arch(f)
        variants = {
            "rope everywhere": replace(arch, no_rope_layers=[]),
            "no windows": replace(arch, layer_types=[LAYER_FULL] * 4, sliding_window=0),
            "as converted": arch,
        }
        for name, a in variants.items():
            m = build_model(f, a, ks)
            got = m.lm_head(m.final_norm(forward(m.new_state(len(ids)), ids)))
            err = arch_tiny.rel_err(got, ref)
            assert err < 1e-4 if name == "as converted" else err > 5e-3, (name, err)  # 50x the tolerance


def test_greedy_tokens_match_transformers(tiny):
    import torch

    model, _, cmf = tiny
    ids = arch_tiny.sample_ids(8, seed=3)
    with Engine.load(cmf) as eng:
        got = eng.generate(ids, SamplingConfig(temperature=0.0), max_tokens=16, ignore_eos=True).token_ids
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0, 8:].tolist()
    assert got == ref


def test_q8_conversion_stays_close(tiny, tmp_path):
    model, src, _ = tiny
    out = tmp_path / "q8.cmf"
    rep = convert_checkpoint(src, out, quant="q8")
    assert rep.by_dtype["q8"].tensors > 0
    ids = arch_tiny.sample_ids(30)
    with Engine.load(out) as eng:
        assert arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(model, ids)) < 0.05


@pytest.mark.parametrize(
    "change,match",
    [
        ({"mlp_bias": True}, "mlp_bias=true is not supported"),
        ({"no_rope_layers": [1, 0, 1]}, "no_rope_layers is .*a 1 \\(RoPE\\) or 0 \\(NoPE\\) per layer"),
        ({"no_rope_layers": [1, 2, 1, 0]}, "no_rope_layers is"),
        ({"no_rope_layers": None, "no_rope_layer_interval": 0}, "no_rope_layer_interval is 0"),
        (
            {"layer_types": ["full_attention", "chunked_attention", "full_attention", "full_attention"]},
            "layer_types is",
        ),
        ({"sliding_window": None}, "sliding_window is None, the sliding layers need"),
    ],
)
def test_unsupported_or_bad_config_is_refused(tiny, change, match):
    with pytest.raises(CortiqError, match=match):
        parse_config({**_config(tiny), **change})


# ------------------------------------------------------------------ a tiny smollm3 GGUF
@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
def test_gguf_matches_transformers(tmp_path, weight_type):
    """A smollm3 GGUF as llama.cpp's converter writes it (Llama's: q/k rows permuted, no
    key for the NoPE layers, which llama.cpp fixes at every 4th) converts straight to
    the source model: layer 3 of 4 without RoPE, full attention everywhere."""
    from cortiq_engine.convert import import_gguf

    cfg = {
        **TINY,
        "no_rope_layer_interval": 4,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
    }
    src = sharpen(build_tiny("smollm3", **cfg))
    assert src.config.no_rope_layers == [1, 1, 1, 0]
    path = arch_tiny.write_llama_style_gguf(src, tmp_path / "s.gguf", "smollm3", weight_type=weight_type)
    convert_checkpoint(path, tmp_path / "s.cmf", quant="f32")
    ids = arch_tiny.sample_ids(24)
    with Engine.load(tmp_path / "s.cmf") as eng:
        assert eng.model.arch.no_rope_layers == [3] and eng.model.arch.layer_types == [LAYER_FULL] * 4
        err = arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(src, ids))
    assert err < (1e-4 if weight_type == "F32" else 0.05)
    if weight_type == "F32":
        report = import_gguf(path, tmp_path / "hf")
        assert report.model_type == "smollm3" and report.tied_embeddings
        assert parse_config(json.loads((tmp_path / "hf" / "config.json").read_text())).no_rope_layers == [3]
