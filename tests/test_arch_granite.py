"""Granite 3 on a tiny random checkpoint (fast, for CI): the engine against transformers'
GraniteForCausalLM with every multiplier far from 1 and attention biases, so each
multiplier is visible in the logits (dropping any one of them breaks the match)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from cortiq_engine import Engine, SamplingConfig, forward
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.kernels import get_kernels
from cortiq_engine.models import build_model, parse_config, read_arch
from formats.cmf import CmfFile
from formats.errors import CortiqError
from tests import arch_tiny
from tests.tiny import build_tiny

TINY = arch_tiny.CONFIGS["granite"]  # every multiplier far from 1, attention biases


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("granite")
    model = build_tiny("granite", **TINY)
    src = arch_tiny.save(model, root / "hf")
    cmf = root / "g.cmf"
    convert_checkpoint(src, cmf, quant="f32")
    return model, src, cmf


def _config(tiny) -> dict:
    return json.loads((tiny[1] / "config.json").read_text())


def test_arch_parsed_from_config(tiny):
    arch = parse_config(_config(tiny))
    assert arch.arch == "granite" and arch.attention_bias and arch.tie_word_embeddings
    assert (arch.embedding_scale, arch.residual_scale, arch.attention_scale, arch.logits_scaling) == (
        6.0,
        0.3,
        30.0,
        0.25,
    )
    # An absent multiplier is 1, and the score scale stays 1 (Granite's default), not head_dim**-0.5.
    cfg = {k: v for k, v in _config(tiny).items() if not k.endswith(("multiplier", "logits_scaling"))}
    arch = parse_config(cfg)
    assert (arch.embedding_scale, arch.residual_scale, arch.attention_scale, arch.logits_scaling) == (
        1.0,
        1.0,
        1.0,
        1.0,
    )


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_logits_match_transformers(tiny, kernels):
    model, _, cmf = tiny
    ids = arch_tiny.sample_ids(24)
    ref = arch_tiny.torch_logits(model, ids)
    with Engine.load(cmf, kernels=kernels) as eng:
        got = eng.logits(ids)
    assert arch_tiny.rel_err(got, ref) < 1e-4


def test_every_multiplier_matters(tiny):
    """The engine with any one multiplier left at 1 is far from transformers: the test
    above would see a multiplier the engine ignored."""
    model, _, cmf = tiny
    ids = arch_tiny.sample_ids(24)
    ref = arch_tiny.torch_logits(model, ids)
    ks = get_kernels("numpy")
    with CmfFile(cmf) as f:
        arch = read_arch(f)
        for field in ("embedding_scale", "residual_scale", "attention_scale", "logits_scaling", None):
            m = build_model(f, replace(arch, **{field: 1.0}) if field else arch, ks)
            state = m.new_state(len(ids))
            got = m.lm_head(m.final_norm(forward(state, ids)))
            err = arch_tiny.rel_err(got, ref)
            assert err > 1e-2 if field else err < 1e-4, (field, err)


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
        ({"residual_multiplier": 0}, "residual_multiplier is 0, expected a finite number > 0"),
        ({"attention_multiplier": "x"}, "attention_multiplier is 'x'"),
        ({"logits_scaling": float("inf")}, "logits_scaling is inf"),
    ],
)
def test_unsupported_or_bad_config_is_refused(tiny, change, match):
    with pytest.raises(CortiqError, match=match):
        parse_config({**_config(tiny), **change})


# ------------------------------------------------------------------ a tiny granite GGUF
GGUF_SCALES = {"embedding_scale": 6.0, "residual_scale": 0.3, "logit_scale": 0.25, "attention.scale": 30.0}


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
def test_gguf_matches_transformers(tmp_path, weight_type):
    """A granite GGUF as llama.cpp's converter writes it (q/k rows permuted, the
    multipliers as granite.*_scale keys) converts straight to the source model."""
    src = build_tiny("granite", **{**TINY, "attention_bias": False})
    path = arch_tiny.write_llama_style_gguf(src, tmp_path / "g.gguf", "granite", GGUF_SCALES, weight_type)
    convert_checkpoint(path, tmp_path / "g.cmf", quant="f32")
    ids = arch_tiny.sample_ids(24)
    with Engine.load(tmp_path / "g.cmf") as eng:
        err = arch_tiny.rel_err(eng.logits(ids), arch_tiny.torch_logits(src, ids))
    assert err < (1e-4 if weight_type == "F32" else 0.05)


def test_gguf_import_restores_the_checkpoint(tiny, tmp_path):
    """import-gguf writes the source's config.json multipliers and its exact weights
    (attention biases de-permuted like the weights), which transformers loads."""
    import torch
    from transformers import AutoModelForCausalLM

    from cortiq_engine.convert import import_gguf

    model = tiny[0]
    path = arch_tiny.write_llama_style_gguf(model, tmp_path / "g.gguf", "granite", GGUF_SCALES)
    report = import_gguf(path, tmp_path / "hf")
    assert report.model_type == "granite" and report.tied_embeddings
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert [
        cfg[k] for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    ] == [6.0, 0.3, 30.0, 0.25]
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    want = model.state_dict()
    for name, t in ours.state_dict().items():
        assert torch.equal(t, want[name]), name
    # Without the keys, llama.cpp's defaults: scores by head_dim**-0.5, the rest unscaled.
    bare = arch_tiny.write_llama_style_gguf(model, tmp_path / "b.gguf", "granite")
    import_gguf(bare, tmp_path / "hf_bare")
    cfg = json.loads((tmp_path / "hf_bare" / "config.json").read_text())
    assert [
        cfg[k] for k in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    ] == [1.0, 1.0, 0.25, 1.0]
