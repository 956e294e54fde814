"""The architecture registry (``cortiq_engine.models``): every family's manifest is what
the converter writes for a tiny transformers checkpoint of that family (trunk and MTP
layers), an unknown model_type is one line naming the supported ones, and a family is
found by the file that exports it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.models import FAMILIES, Registry, parse_config, read_arch
from cortiq_engine.models import base, blocks, gemma3, moe_family
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.manifest import mtp_layer_indices
from formats.tokenizer_header import TOKENIZER_TENSOR
from tests import arch_tiny
from tests.mtp_tiny import save_tiny_mtp
from tests.tiny import build_tiny, save_tiny

GEMMA3 = dict(
    vocab_size=256,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=24,
    query_pre_attn_scalar=24,
    sliding_window=6,
    layer_types=None,
    tie_word_embeddings=True,
    max_position_embeddings=256,
)
# (case, how to build its checkpoint): one per model_type, and the three MTP naming schemes.
CASES = (
    [(mt, "tiny") for mt in ("llama", "mistral", "qwen2", "qwen3")]
    + [(mt, "arch_tiny") for mt in arch_tiny.CONFIGS]
    + [("gemma3_text", "gemma3"), ("deepseek", "mtp"), ("qwen3_next", "mtp"), ("mimo", "mtp")]
    + [("gemma2", "tiny"), ("olmo2", "tiny")]
    + [("glm4_moe", "mtp")]
    + [("deepseek_v3", "deepseek_v3"), ("deepseek_v3", "mtp"), ("kimi_k2", "deepseek_v3")]
)
MTP_TRUNKS = {"deepseek": None, "qwen3_next": "qwen3_next", "mimo": "mimo_v2_flash"}


def _checkpoint(case: str, kind: str, folder):
    if kind == "tiny":
        return save_tiny(case, folder)
    if kind == "arch_tiny":
        return arch_tiny.save(arch_tiny.build(case), folder)
    if kind == "gemma3":
        return arch_tiny.save(build_tiny("gemma3_text", **GEMMA3), folder)
    if case in ("deepseek_v3", "kimi_k2"):  # latent attention; its release's MTP layer with the "mtp" kind
        from tests.test_arch_deepseek_v3 import save_checkpoint

        return save_checkpoint(folder, case, mtp=kind == "mtp")
    if case == "glm4_moe":  # its release's MTP layer: DeepSeek names around a routed block
        return arch_tiny.add_deepseek_mtp_layer(arch_tiny.save(arch_tiny.build(case), folder / "trunk"), folder / "mtp")
    return save_tiny_mtp(case, folder, n_layers=1 if case == "qwen3_next" else 2, trunk=MTP_TRUNKS[case])


@pytest.mark.parametrize("case,kind", CASES, ids=[f"{k}-{c}" for c, k in CASES])
def test_manifest_is_what_the_converter_writes(case, kind, tmp_path):
    src = _checkpoint(case, kind, tmp_path / "hf")
    out = tmp_path / "m.cmf"
    convert_checkpoint(src, out, quant="f32", mtp="inline")
    with CmfFile(out) as f:
        written = {n: tuple(f.info(n).shape) for n in f.names() if n != TOKENIZER_TENSOR}
        arch = read_arch(f)
    family = FAMILIES.for_arch(arch.arch)
    mtp = mtp_layer_indices(written)
    assert (len(mtp) > 0) == (kind == "mtp")
    m = family.manifest(arch, mtp)
    # Every required tensor is written, and nothing is written that the family does not read.
    assert set(m.required) <= set(written), sorted(set(m.required) - set(written))[:5]
    assert set(written) <= m.names(), sorted(set(written) - m.names())[:5]
    for name, shape in written.items():
        want = m.required.get(name, m.optional.get(name))
        assert len(want) == len(shape) and all(w is None or w == s for w, s in zip(want, shape)), (name, shape, want)


def test_every_family_is_covered_by_a_round_trip_case():
    cfg_types = {c for c, k in CASES if k != "mtp"}
    assert cfg_types == set(FAMILIES.supported_model_types())
    assert {f.name for f in FAMILIES.families} == {
        "llama",
        "moe_family",
        "qwen3_next",
        "mimo_v2",
        "gemma3",
        "gemma2",
        "olmo2",
        "granite",
        "smollm3",
        "glm4_moe",
        "deepseek_v3",
        "gpt_oss",
        "phi3",
    }


def test_unknown_model_type_is_one_line_naming_the_supported_ones(tmp_path):
    supported = FAMILIES.supported_model_types()
    with pytest.raises(CortiqError) as e:
        parse_config({"model_type": "gpt_neox", "hidden_size": 8})
    msg = str(e.value)
    assert "\n" not in msg and "'gpt_neox'" in msg and all(mt in msg for mt in supported), msg
    # The converter says the same before it writes anything.
    src = save_tiny("llama", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(
        CortiqError,
        match=r"unsupported architecture 'gpt_neox' .*supported: .*gemma3_text, .*llama.*; see docs/architectures.md",
    ):
        convert_checkpoint(src, tmp_path / "m.cmf")
    assert not (tmp_path / "m.cmf").exists()
    with pytest.raises(CortiqError, match="cannot run architecture 'gpt2'"):
        FAMILIES.for_arch("gpt2")


def test_a_model_type_has_one_family():
    llama = FAMILIES.for_model_type("llama")
    with pytest.raises(ValueError, match="'llama' is claimed by families llama and llama"):
        Registry((llama, llama))
    for f in FAMILIES.families:
        assert all(FAMILIES.for_model_type(mt) is f for mt in f.model_types)
        assert all(FAMILIES.for_arch(a) is f for a in f.archs)


def test_a_family_is_its_module():
    """Every ``Family`` field but the name has a module name, and a module's names fill it
    (the pre-norm pieces where it defines none)."""
    fields = {f.name for f in dataclasses.fields(base.Family)} - {"name"}
    assert set(base.FAMILY_NAMES) == fields
    g = FAMILIES.for_model_type("gemma3_text")
    assert g.name == "gemma3" and g.manifest is gemma3.manifest and g.build is gemma3.build
    assert g.gguf == (gemma3.GGUF,) and g.computes == gemma3.COMPUTES and g.activations == blocks.GEGLU_ACTIVATIONS
    assert g.draft_layer is blocks.dense_draft_layer and g.archs == ("gemma3",)
    m = FAMILIES.for_model_type("mixtral")
    assert m.name == "moe_family" and m.build is blocks.prenorm_model and m.sanitize is moe_family.SANITIZE
    assert m.draft_layer is blocks.routed_draft_layer and m.gguf == ()
    # The helper modules define no PARSERS, so they are no family.
    assert not hasattr(base, "PARSERS") and not hasattr(blocks, "PARSERS")
