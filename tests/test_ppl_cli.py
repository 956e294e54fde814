"""``cortiq ppl`` end to end on real CMF files: transformers is the oracle."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cortiq_cli.main import app  # noqa: E402
from evals.text_source import BUNDLED_TEXT  # noqa: E402
from tests.tiny import save_tiny  # noqa: E402
from cortiq_engine import Engine  # noqa: E402

runner = CliRunner()
ALICE = BUNDLED_TEXT.read_text(encoding="utf-8")


def cli(*args: str) -> dict:
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.stderr or r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama (byte tokenizer) as HF folder, f32 CMF and q8 CMF, and its transformers model."""
    from cortiq_engine.convert import convert_checkpoint
    from tests.tiny import build_tiny

    d = tmp_path_factory.mktemp("tiny")
    hf = save_tiny("llama", d / "hf", max_position_embeddings=512)
    out = {}
    for q in ("f32", "q8"):
        out[q] = d / f"tiny-{q}.cmf"
        convert_checkpoint(hf, out[q], quant=q)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield out, build_tiny("llama", max_position_embeddings=512)
    torch.set_num_threads(threads)


def torch_windows_nll(model, ids: list[int], ctx: int, stride: int) -> tuple[float, int]:
    """The HF perplexity guide's loop."""
    input_ids = torch.tensor([ids])
    nll_sum, n_tok, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + ctx, len(ids))
        trg_len = end - prev_end
        inp = input_ids[:, begin:end]
        tgt = inp.clone()
        tgt[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(inp, labels=tgt).loss
        n = int((tgt[:, 1:] != -100).sum())
        nll_sum += float(loss) * n
        n_tok += n
        prev_end = end
        if end == len(ids):
            break
    return nll_sum / n_tok, n_tok


def engine_tokens(path: Path, text: str) -> list[int]:
    with Engine.load(path, ctx=8, warmup=False) as e:
        return e.tokenizer.encode(text, add_bos=True)


def test_tiny_sliding_equals_transformers(tiny, tmp_path):
    paths, model = tiny
    text = ALICE[:1500]
    f = tmp_path / "t.txt"
    f.write_text(text)
    ids = engine_tokens(paths["f32"], text)
    want, n = torch_windows_nll(model, ids, 96, 40)
    out = cli("ppl", str(paths["f32"]), "--text", str(f), "--mode", "sliding", "--ctx", "96", "--stride", "40")
    (m,) = out["models"]
    assert m["tokens_scored"] == n == len(ids) - 1
    assert m["nll_mean"] == pytest.approx(want, rel=1e-5)
    assert m["ppl"] == pytest.approx(math.exp(want), rel=1e-5)
    assert m["bytes_scored"] == len(text[1:].encode())  # one token per byte, all but the first scored
    assert m["bits_per_byte"] == pytest.approx(m["nll_mean"] * n / math.log(2) / m["bytes_scored"], rel=1e-12)
    assert m["nll_ci95"][0] < m["nll_mean"] < m["nll_ci95"][1]
    assert out["settings"] == {
        "mode": "sliding",
        "ctx": 96,
        "stride": 40,
        "windows": out["settings"]["windows"],
        "chunk_bos": None,
        "max_tokens": None,
        "chunks": None,
        "text_tokens": len(ids),
        "reference": {"path": str(paths["f32"]), "form": "full", "model": m["model"]},
    }


def test_tiny_chunks_and_comparison(tiny, tmp_path):
    paths, model = tiny
    text = ALICE[:1200]
    f = tmp_path / "t.txt"
    f.write_text(text)
    ids = engine_tokens(paths["f32"], text)
    ctx = 96
    # llama.cpp's loop on transformers logits: no BOS for this vocabulary, second half of each chunk
    nll0 = []
    for i in range(len(ids) // ctx):
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids[i * ctx : (i + 1) * ctx]])).logits[0].double(), -1)
        nll0 += [-float(lp[j, ids[i * ctx + j + 1]]) for j in range(ctx // 2, ctx - 1)]
    out = cli("ppl", str(paths["f32"]), str(paths["q8"]), "--text", str(f), "--ctx", str(ctx), "--mode", "chunks")
    m0, m1 = out["models"]
    assert m0["tokens_scored"] == len(nll0) == (len(ids) // ctx) * (ctx // 2 - 1)
    assert m0["nll_mean"] == pytest.approx(np.mean(nll0), rel=1e-5)
    (c,) = out["comparisons"]
    assert c["ppl_ratio"] == pytest.approx(m1["ppl"] / m0["ppl"], rel=1e-9)
    assert 0 < c["kl_mean"] < 1e-3  # q8 of the same weights: close, not identical
    assert 0.9 < c["top1_agreement"] <= 1.0
    assert abs(m1["nll_mean"] - m0["nll_mean"]) < 0.01


def test_max_tokens_and_dataset_sources(tiny, tmp_path):
    paths, _ = tiny
    rows = [{"body": ALICE[i * 400 : (i + 1) * 400]} for i in range(4)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    a = cli("ppl", str(paths["f32"]), "--text", str(jl), "--column", "body", "--ctx", "64", "--max-tokens", "300")
    assert a["models"][0]["tokens_scored"] == 300
    b = cli(
        "ppl",
        str(paths["f32"]),
        "--dataset",
        "json",
        "--data-files",
        str(jl),
        "--column",
        "body",
        "--ctx",
        "64",
        "--max-tokens",
        "300",
    )
    assert b["models"][0]["nll_mean"] == pytest.approx(a["models"][0]["nll_mean"], rel=1e-9)
    assert a["text"]["documents"] == 4


@pytest.mark.parametrize(
    "args,msg",
    [
        (["/nonexistent/m.cmf"], "no such file"),
        (["{bad}"], "not a CMF file"),
        (["{f32}", "--text", "{one}"], "scoring needs at least 2"),
        (["{f32}", "--text", "{jsonl}", "--column", "nope"], "no column 'nope'"),
        (["{f32}", "--mode", "windows"], "unknown --mode"),
        (["{f32}", "--mode", "sliding", "--ctx", "64", "--stride", "65"], "--stride"),
        (["{f32}", "--stride", "8"], "give --mode sliding"),  # the default plan is chunks
        (["{f32}", "--mode", "chunks", "--stride", "8"], "--stride applies to --mode sliding"),
        (["{f32}", "--dataset", "{missing}"], "could not load"),
    ],
)
def test_one_line_errors(tiny, tmp_path, args, msg):
    paths, _ = tiny
    (tmp_path / "bad.cmf").write_bytes(b"definitely not a model" * 10)
    (tmp_path / "one.txt").write_text("a")
    (tmp_path / "d.jsonl").write_text('{"text": "hello there"}\n')
    subs = {
        "{f32}": str(paths["f32"]),
        "{bad}": str(tmp_path / "bad.cmf"),
        "{one}": str(tmp_path / "one.txt"),
        "{jsonl}": str(tmp_path / "d.jsonl"),
        "{missing}": str(tmp_path / "no_such_dataset_dir"),
    }
    r = runner.invoke(app, ["ppl", *[subs.get(a, a) for a in args], "--max-tokens", "50"])
    assert r.exit_code == 2
    assert r.stderr.startswith("error: ") and msg in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_tables_render(tiny):
    paths, _ = tiny
    r = runner.invoke(app, ["ppl", str(paths["f32"]), str(paths["q8"]), "--ctx", "64", "--max-tokens", "200"])
    assert r.exit_code == 0, r.stderr
    assert (
        "Perplexity" in r.stdout
        and "same top-1" in r.stdout
        and "Mean KLD" in r.stdout
        and "RMS Δp" in r.stdout
        and "bits/byte" in r.stdout
    )


# ------------------------------------------------------------------ the real model


@pytest.mark.slow
def test_smollm2_f32_equals_transformers(smollm2_hf, smollm2_cmf):
    """SmolLM2-135M f32: our ppl equals transformers' on the same windows to 0.1%."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()
    path = smollm2_cmf("f32")
    ids = engine_tokens(path, ALICE)[:1025]
    want, n = torch_windows_nll(model, ids, 256, 128)
    out = cli("ppl", str(path), "--mode", "sliding", "--ctx", "256", "--stride", "128", "--max-tokens", "1024")
    m = out["models"][0]
    assert m["tokens_scored"] == n == 1024
    assert m["ppl"] == pytest.approx(math.exp(want), rel=1e-3)
    assert 5 < m["ppl"] < 60  # a trained model on English prose


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.usefixtures("smollm2_gguf")
def test_smollm2_q8_chunks_match_llama_cpp():
    """benchmarks/ppl_vs_llamacpp.py on two chunks: cortiq q8 vs llama.cpp Q8_0 within 2%, same tokens."""
    import os
    import subprocess
    import sys

    import llama_cpp  # noqa: F401  # the oracle the benchmark runs

    repo = Path(__file__).resolve().parents[1]
    cache = Path(os.environ.get("CORTIQ_TEST_CACHE", repo / ".cortiq-cache")) / "bench"
    proc = subprocess.run(
        [
            sys.executable,
            str(repo / "benchmarks" / "ppl_vs_llamacpp.py"),
            "--chunks",
            "2",
            "--json",
            "--cache-dir",
            str(cache),
        ],
        capture_output=True,
        text=True,
        cwd=repo,
        timeout=3000,
    )
    assert proc.returncode in (0, 1), proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    assert rep["same_tokens"] and rep["tokens_scored"] == 2 * 255
    assert abs(rep["ppl_rel_diff"]) < 0.02, rep
    assert rep["top1_agreement"] > 0.9


def test_saved_reference_matches_the_live_comparison(tiny, tmp_path):
    paths, _ = tiny
    f = tmp_path / "t.txt"
    f.write_text(ALICE[:3000])
    ref = tmp_path / "ref.cref"
    live = cli(
        "ppl",
        str(paths["f32"]),
        str(paths["q8"]),
        "--text",
        str(f),
        "--ctx",
        "128",
        "--mode",
        "chunks",
        "--save-ref",
        str(ref),
        "--ref-top-k",
        "300",
    )  # the byte vocabulary is 256: exact
    assert live["settings"]["saved_ref"]["bytes"] == ref.stat().st_size
    # window options come from the file
    saved = cli("ppl", str(paths["q8"]), "--text", str(f), "--ref", str(ref))
    assert saved["settings"]["mode"] == "chunks" and saved["settings"]["ctx"] == 128
    assert saved["settings"]["reference"]["form"] == "top-256"
    r0, r1 = saved["models"]
    assert r0["nll_mean"] == live["models"][0]["nll_mean"]  # float64 NLLs, bit for bit
    assert r1["nll_mean"] == live["models"][1]["nll_mean"]
    (a,), (b,) = live["comparisons"], saved["comparisons"]
    assert b["kl_mean"] == pytest.approx(a["kl_mean"], rel=1e-3, abs=1e-9)
    assert b["reverse_kl_mean"] == pytest.approx(a["reverse_kl_mean"], rel=1e-3, abs=1e-9)
    assert b["delta_p_rms"] == pytest.approx(a["delta_p_rms"], rel=1e-9)
    assert b["top1_agreement"] == a["top1_agreement"] and b["ppl_ratio"] == pytest.approx(a["ppl_ratio"], rel=1e-12)
    # top-k alone: a lower bound; with tail samples: an estimate of the full value
    small, sampled = tmp_path / "small.cref", tmp_path / "sampled.cref"
    cli(
        "ppl",
        str(paths["f32"]),
        "--text",
        str(f),
        "--ctx",
        "128",
        "--mode",
        "chunks",
        "--save-ref",
        str(small),
        "--ref-top-k",
        "4",
        "--ref-samples",
        "0",
    )
    cli(
        "ppl",
        str(paths["f32"]),
        "--text",
        str(f),
        "--ctx",
        "128",
        "--mode",
        "chunks",
        "--save-ref",
        str(sampled),
        "--ref-top-k",
        "4",
        "--ref-samples",
        "32",
    )
    c = cli("ppl", str(paths["q8"]), "--text", str(f), "--ref", str(small))["comparisons"][0]
    assert c["kl_mean"] <= a["kl_mean"] * (1 + 1e-6) and c["reference_form"] == "top-4"
    e = cli("ppl", str(paths["q8"]), "--text", str(f), "--ref", str(sampled))["comparisons"][0]
    assert e["reference_form"] == "top-4+32" and e["kl_mean"] == pytest.approx(a["kl_mean"], rel=0.05)
    assert abs(e["kl_mean"] - a["kl_mean"]) < abs(c["kl_mean"] - a["kl_mean"])
    assert small.stat().st_size < ref.stat().st_size / 10


def one_line_error(*args: str) -> str:
    r = runner.invoke(app, list(args))
    assert r.exit_code == 2, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    return lines[0]


def test_saved_reference_mismatches_and_corruption(tiny, tmp_path):
    paths, _ = tiny
    f = tmp_path / "t.txt"
    f.write_text(ALICE[:2000])
    ref = tmp_path / "ref.cref"
    cli("ppl", str(paths["f32"]), "--text", str(f), "--ctx", "64", "--save-ref", str(ref))
    g = tmp_path / "other.txt"
    g.write_text(ALICE[:2000].upper())
    assert "another text" in one_line_error("ppl", str(paths["q8"]), "--text", str(g), "--ref", str(ref))
    assert "other windows" in one_line_error(
        "ppl", str(paths["q8"]), "--text", str(f), "--ref", str(ref), "--ctx", "96"
    )
    assert "cannot be combined" in one_line_error(
        "ppl", str(paths["q8"]), "--ref", str(ref), "--save-ref", str(tmp_path / "x.cref")
    )
    assert "is one of the models" in one_line_error("ppl", str(paths["q8"]), "--save-ref", str(paths["q8"]))
    bad = tmp_path / "bad.cref"
    bad.write_bytes(ref.read_bytes()[:-7])
    assert "truncated" in one_line_error("ppl", str(paths["q8"]), "--text", str(f), "--ref", str(bad))
    bad.write_bytes(b"\x80\x04" + b"pickle" * 20)
    assert "not a cortiq reference file" in one_line_error("ppl", str(paths["q8"]), "--ref", str(bad))
    assert "no such reference file" in one_line_error("ppl", str(paths["q8"]), "--ref", str(tmp_path / "missing.cref"))


@pytest.mark.slow
def test_compact_reference_on_smollm2(smollm2_cmf, tmp_path):
    """SmolLM2 q8 against f32: the default compact reference (top-64 + 64 tail samples)
    reproduces the full computation's mean KLD within 5%, top-64 alone falls short."""
    f32, q8 = smollm2_cmf("f32"), smollm2_cmf("q8")
    ref, bound = tmp_path / "ref.cref", tmp_path / "bound.cref"
    common = ("--mode", "chunks", "--ctx", "256", "--chunks", "4")
    live = cli("ppl", str(f32), str(q8), *common, "--save-ref", str(ref))["comparisons"][0]
    cli("ppl", str(f32), *common, "--save-ref", str(bound), "--ref-samples", "0")
    est = cli("ppl", str(q8), "--ref", str(ref))["comparisons"][0]
    low = cli("ppl", str(q8), "--ref", str(bound))["comparisons"][0]
    assert est["reference_form"] == "top-64+64" and low["reference_form"] == "top-64"
    assert est["kl_mean"] == pytest.approx(live["kl_mean"], rel=0.05)
    assert est["reverse_kl_mean"] == pytest.approx(live["reverse_kl_mean"], rel=0.05)
    assert low["kl_mean"] < 0.95 * live["kl_mean"]
    assert est["top1_agreement"] == live["top1_agreement"] and est["delta_p_rms"] == pytest.approx(
        live["delta_p_rms"], rel=1e-9
    )
    assert ref.stat().st_size < 600 * 4 * 1100  # ~1 KB per scored token (f32 log-probs would be 196 KB)
