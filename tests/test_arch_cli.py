"""Every architecture family through the command line: convert, ppl, calibrate, generate (held
to transformers' greedy tokens), chat (two turns, the plain template), bench."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from tests import arch_tiny

runner = CliRunner()
FAMILIES = [
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "mimo_v2_flash",
    "granite",
    "smollm3",
    "phi3",
    "gpt_oss",
    "glm4_moe",
    "gemma2",
    "olmo2",
    "deepseek_v3",
]
DENSE = ("qwen3_5_text", "granite", "smollm3", "phi3", "gemma2", "olmo2")


def _checkpoint(mt: str, folder):
    """(transformers model, HF folder) of a tiny ``mt`` checkpoint: the family test's own
    configuration where the family has one (caps, latent attention), else arch_tiny's."""
    if mt in ("gemma2", "olmo2"):
        import importlib

        from tests.tiny import build_tiny

        model = build_tiny(mt, **importlib.import_module(f"tests.test_arch_{mt}").TINY)
        return model, arch_tiny.save(model, folder)
    if mt == "deepseek_v3":
        import torch
        import transformers

        from tests.test_arch_deepseek_v3 import save_checkpoint

        src = save_checkpoint(folder)
        return transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval(), src
    model = arch_tiny.build(mt)
    return model, arch_tiny.save(model, folder)


def _run(args: list[str]) -> dict:
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


# Model types that share a module and a configuration shape with one kept here run in the slow
# suite: qwen3_moe and mixtral with qwen2_moe (moe_family, which adds shared experts and a
# dense layer), qwen3_5_moe_text with qwen3_next (the same overrides). Each one's logits stay
# held to transformers' in test_arch_moe / test_arch_qwen3_next.
SAME_PATH_AS_KEPT = ("qwen3_moe", "mixtral", "qwen3_5_moe_text")


@pytest.mark.parametrize(
    "mt", [pytest.param(m, marks=pytest.mark.slow) if m in SAME_PATH_AS_KEPT else m for m in FAMILIES]
)
def test_convert_ppl_calibrate_generate(tmp_path, mt):
    model, src = _checkpoint(mt, tmp_path / "hf")
    out = tmp_path / "m.cmf"
    # f32, so generate can be held to transformers' greedy tokens (q8 is tested per family).
    conv = _run(["convert", str(src), str(out), "--quant", "f32", "--json"])
    assert conv["output"] == str(out) and conv["dtypes"]["f32"]["tensors"] > 0

    ppl = _run(["ppl", str(out), "--ctx", "32", "--max-tokens", "48", "--json"])
    m = ppl["models"][0]
    assert m["tokens_scored"] == 48
    # A random tiny model is near uniform over its 256 byte tokens: far from 1, and finite.
    assert 30 < m["ppl"] < 3000

    cal = _run(["calibrate", str(out), "--ctx", "32", "--max-tokens", "64", "--json"])
    assert cal["tokens_scored"] == 64 and math.isfinite(cal["overall"]["nll"])

    args = ["generate", str(out), "Hello", "--max-tokens", "6", "--json"]
    moe = mt not in DENSE
    gen = _run(args + (["--moe-stats"] if moe else []))
    assert len(gen["token_ids"]) == 6
    # Greedy by default: the same tokens transformers picks.
    from cortiq_engine import Engine

    with Engine.load(out, warmup=False) as eng:
        ids = eng.tokenizer.encode("Hello")
    assert gen["prompt_tokens"] == len(ids)
    prompt_len = len(ids)
    for tok in gen["token_ids"]:
        nxt = int(np.argmax(arch_tiny.torch_logits(model, ids)[-1]))
        assert tok == nxt
        ids.append(nxt)
    r = runner.invoke(app, ["chat", str(out), "--chat-template", "raw", "-n", "4", "--json"], input="Hi\nMore\n")
    assert r.exit_code == 0, r.output
    turns = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(turns) == 2 and all(t["token_ids"] for t in turns), r.stdout
    q4 = tmp_path / "q4.cmf"
    _run(["convert", str(src), str(q4), "--quant", "q4_k_m", "--json"])
    ppl4 = _run(["ppl", str(q4), "--ctx", "32", "--max-tokens", "48", "--json"])["models"][0]
    assert ppl4["tokens_scored"] == 48 and math.isfinite(ppl4["ppl"])
    bench = _run(["bench", str(out), "-p", "8", "-n", "4", "-r", "1", "-t", "1", "--json"])
    assert {r["test"] for r in bench["rows"]} >= {"pp8", "tg4"}, bench["rows"]
    assert all(r["median_tok_s"] > 0 for r in bench["rows"])
    if moe:
        usage = gen["moe_stats"]["layers"]
        k = gen["moe_stats"]["top_k"]
        forwarded = prompt_len + 6 - 1  # the last token is never forwarded
        assert usage and all(sum(row["counts"]) == forwarded * k for row in usage)


def test_moe_stats_table_and_dense_model(tmp_path):
    from rich.console import Console

    from cortiq_cli.moe_stats import moe_stats_json, print_moe_stats
    from formats.arch import ArchConfig, MoeConfig

    arch = ArchConfig(
        "x", 8, 2, 2, 2, 4, 16, 32, 64, moe=MoeConfig(num_experts=40, top_k=2, expert_intermediate_size=8)
    )
    stats = moe_stats_json({1: [0] * 38 + [3, 5]}, arch)
    con = Console(record=True, width=120)
    print_moe_stats(con, stats)
    text = con.export_text()
    assert "2/40" in text and "39×5 38×3" in text and "62.5%" in text  # experts used, busiest first, share
    dense = ArchConfig("x", 8, 2, 2, 2, 4, 16, 32, 64)
    assert moe_stats_json({}, dense) is None
