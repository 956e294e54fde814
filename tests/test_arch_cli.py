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
FAMILIES = ["qwen2_moe", "qwen3_moe", "mixtral", "qwen3_next", "qwen3_5_text", "mimo_v2_flash"]


def _commands() -> set[str]:
    return {c.name for c in app.registered_commands}


def _run(args: list[str]) -> dict:
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.mark.parametrize("mt", FAMILIES)
def test_convert_ppl_calibrate_generate(tmp_path, mt):
    model = arch_tiny.build(mt)
    src = arch_tiny.save(model, tmp_path / "hf")
    out = tmp_path / "m.cmf"
    conv = _run(["convert", str(src), str(out), "--quant", "q8", "--json"])
    assert conv["output"] == str(out) and conv["dtypes"]["q8"]["tensors"] > 0

    ppl = _run(["ppl", str(out), "--ctx", "32", "--max-tokens", "48", "--json"])
    m = ppl["models"][0]
    assert m["tokens_scored"] == 48
    # A random tiny model is near uniform over its 256 byte tokens: far from 1, and finite.
    assert 30 < m["ppl"] < 3000

    cal = _run(["calibrate", str(out), "--ctx", "32", "--max-tokens", "64", "--json"])
    assert cal["tokens_scored"] == 64 and math.isfinite(cal["overall"]["nll"])

    if "generate" not in _commands():
        pytest.skip("cortiq generate is not built yet")
    args = ["generate", str(out), "Hello", "--max-tokens", "6", "--json"]
    moe = mt in ("qwen2_moe", "qwen3_moe", "mixtral", "qwen3_next", "mimo_v2_flash")
    gen = _run(args + (["--moe-stats"] if moe else []))
    assert len(gen["token_ids"]) == 6
    # Greedy by default: the same tokens transformers picks.
    ids = list(b"Hello")
    for tok in gen["token_ids"]:
        nxt = int(np.argmax(arch_tiny.torch_logits(model, ids)[-1]))
        assert tok == nxt
        ids.append(nxt)
    if moe:
        usage = gen["moe_stats"]["layers"]
        k = gen["moe_stats"]["top_k"]
        forwarded = len(b"Hello") + 6 - 1  # the last token is never forwarded
        assert usage and all(sum(row["counts"]) == forwarded * k for row in usage)
