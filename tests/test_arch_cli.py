"""Every new architecture through the command line: convert, generate, ppl, calibrate."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from tests import arch_tiny

runner = CliRunner()
FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "mimo_v2_flash", "granite", "smollm3"]
DENSE = ("qwen3_5_text", "granite", "smollm3")


def _run(args: list[str]) -> dict:
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize("mt", FAMILIES)
def test_convert_ppl_calibrate_generate(tmp_path, mt):
    model = arch_tiny.build(mt)
    src = arch_tiny.save(model, tmp_path / "hf")
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
    if moe:
        usage = gen["moe_stats"]["layers"]
        k = gen["moe_stats"]["top_k"]
        forwarded = prompt_len + 6 - 1  # the last token is never forwarded
        assert usage and all(sum(row["counts"]) == forwarded * k for row in usage)


def test_moe_stats_table_and_dense_model(tmp_path):
    from rich.console import Console

    from cortiq_cli.moe_stats import moe_stats_json, print_moe_stats
    from formats.arch import ArchConfig, MoeConfig

    arch = ArchConfig("x", 8, 2, 2, 2, 4, 16, 32, 64, moe=MoeConfig(num_experts=40, top_k=2, expert_intermediate_size=8))
    stats = moe_stats_json({1: [0] * 38 + [3, 5]}, arch)
    con = Console(record=True, width=120)
    print_moe_stats(con, stats)
    text = con.export_text()
    assert "2/40" in text and "39×5 38×3" in text and "62.5%" in text  # experts used, busiest first, share
    dense = ArchConfig("x", 8, 2, 2, 2, 4, 16, 32, 64)
    assert moe_stats_json({}, dense) is None
