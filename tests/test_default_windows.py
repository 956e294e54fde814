"""``ppl``, ``quant-sweep``, ``calibrate`` and ``imatrix`` plan the same windows by
default (``evals.windows.DEFAULT_MODE``: llama.cpp's chunks), so their figures on one
text and one model agree."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from evals.windows import DEFAULT_MODE
from tests.tiny import save_tiny

runner = CliRunner()
CTX = 64


def run(*args: str) -> dict:
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.stderr or r.output
    return json.loads(r.stdout)


def test_four_commands_score_the_same_default_windows(tmp_path):
    hf = save_tiny("llama", tmp_path / "hf", max_position_embeddings=256)
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 12)
    work = tmp_path / "work"
    common = ("--text", str(text), "--ctx", str(CTX))

    sweep = run(
        "quant-sweep",
        str(hf),
        "--types",
        "f32",
        *common,
        "--decode-tokens",
        "4",
        "--decode-reps",
        "1",
        "--workdir",
        str(work),
        "--keep-files",
    )
    f32 = work / "f32.cmf"
    ppl = run("ppl", str(f32), *common)
    cal = run("calibrate", str(f32), *common)
    im = run("imatrix", str(f32), *common, "-o", str(tmp_path / "im.safetensors"))

    assert DEFAULT_MODE == "chunks"
    settings = ppl["settings"]
    assert settings["mode"] == "chunks" and settings["stride"] is None
    n_chunks = settings["text_tokens"] // CTX
    assert n_chunks >= 2 and settings["windows"] == n_chunks
    (m,) = ppl["models"]
    assert m["tokens_scored"] == n_chunks * (CTX - CTX // 2 - 1)  # the second half of each chunk

    # quant-sweep's f32 row is ppl's figure on the same file, to the last bit
    assert sweep["windows"] == n_chunks and sweep["tokens_scored"] == m["tokens_scored"]
    (row,) = sweep["types"]
    assert row["type"] == "f32" and row["ppl"] == m["ppl"]
    assert sweep["reference"]["nll_mean"] == m["nll_mean"]

    # calibrate scores the same positions (its NLL goes through the temperature features)
    assert cal["settings"]["mode"] == "chunks" and cal["settings"]["windows"] == n_chunks
    assert cal["overall"]["n"] == m["tokens_scored"]
    assert cal["overall"]["nll"] == pytest.approx(m["nll_mean"], rel=1e-6)

    # imatrix runs every token of the same chunks
    assert im["tokens"] == n_chunks * CTX
