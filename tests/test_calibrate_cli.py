"""``cortiq calibrate`` end to end on real CMF files: transformers' softmax is the oracle at T = 1."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cortiq_cli.main import app  # noqa: E402
from evals.text_source import BUNDLED_TEXT  # noqa: E402
from formats.cmf import CmfFile  # noqa: E402
from tests.tiny import build_tiny, save_tiny  # noqa: E402
from cortiq_engine import Engine  # noqa: E402

runner = CliRunner()
ALICE = BUNDLED_TEXT.read_text(encoding="utf-8")


UNIGRAM_SHARPNESS = 2.0  # the unigram model's logits are this many times too sharp


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random tiny llama (byte tokenizer), and one whose logits are ~2 x log unigram frequency of Alice.

    The second gets a constant +8 in residual dimension 0 (so the final hidden state is
    ~8 there for every token) and lm_head column 0 = (2/8) log p(byte): its next-token
    distribution is the unigram one made twice too sharp, so the NLL-optimal temperature is ~2.
    """
    from cortiq_engine.convert import convert_checkpoint
    from tests.tiny import write_byte_tokenizer

    d = tmp_path_factory.mktemp("tinycal")
    hf = save_tiny("llama", d / "hf")
    path = d / "tiny.cmf"
    convert_checkpoint(hf, path, quant="f32")

    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(hf / "tokenizer.json")).encode(ALICE).ids
    logp = np.log((np.bincount(ids, minlength=256) + 1) / (len(ids) + 256))
    uni = build_tiny("llama")
    with torch.no_grad():
        uni.model.embed_tokens.weight[:, 0] += 8.0
        uni.model.norm.weight.fill_(1.0)
        uni.lm_head.weight[:, 0] = torch.tensor(logp * UNIGRAM_SHARPNESS / 8.0, dtype=torch.float32)
    uni.save_pretrained(d / "uni")
    write_byte_tokenizer(d / "uni")
    uni_path = d / "uni.cmf"
    convert_checkpoint(d / "uni", uni_path, quant="f32")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield path, build_tiny("llama"), uni_path
    torch.set_num_threads(threads)


def run(*args: str) -> dict:
    r = runner.invoke(app, ["calibrate", *args, "--json"])
    assert r.exit_code == 0, r.stderr or r.output
    return json.loads(r.stdout)


def test_metrics_equal_transformers_softmax(tiny, tmp_path):
    path, model, _ = tiny
    text = ALICE[:1000]
    f = tmp_path / "t.txt"
    f.write_text(text)
    with Engine.load(path, ctx=8, warmup=False) as e:
        ids = e.tokenizer.encode(text)
    ctx, stride = 128, 64
    out = run(
        str(path), "--text", str(f), "--mode", "sliding", "--ctx", str(ctx), "--stride", str(stride), "--bins", "5"
    )
    # the same windows by hand: each target once, context >= ctx - stride
    conf, correct, nll = [], [], []
    prev_end = 1
    for begin in range(0, len(ids), stride):
        end = min(begin + ctx, len(ids))
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([ids[begin:end]])).logits[0].double(), -1)
        for p in range(prev_end, end):
            row = lp[p - begin - 1]
            conf.append(float(row.max().exp()))
            correct.append(int(row.argmax()) == ids[p])
            nll.append(-float(row[ids[p]]))
        prev_end = end
        if end == len(ids):
            break
    conf, correct = np.array(conf), np.array(correct)
    ov = out["overall"]
    assert ov["n"] == len(conf) == len(ids) - 1
    assert ov["confidence"] == pytest.approx(conf.mean(), rel=1e-5)
    assert ov["accuracy"] == pytest.approx(correct.mean(), abs=1e-12)
    assert ov["nll"] == pytest.approx(np.mean(nll), rel=1e-5)
    assert ov["brier"] == pytest.approx(np.mean((conf - correct) ** 2), rel=1e-4)
    counts = [b["count"] for b in out["reliability"]]
    edges = np.linspace(0, 1, 6)
    assert counts == [int(((conf > lo) & (conf <= hi)).sum()) for lo, hi in zip(edges[:-1], edges[1:])]
    assert out["fit_tokens"] + out["eval_tokens"] == len(conf)
    assert len(out["by_temperature"]) == 61
    assert out["written"] is None


def test_fit_recovers_sharpness_and_write_stores_it(tiny, tmp_path):
    import shutil

    _, _, uni = tiny
    copy = tmp_path / "m.cmf"
    shutil.copy(uni, copy)
    before = CmfFile(copy)
    old_header = dict(before.header)
    n_tensors = len(before.tensors)
    before.close()
    out = run(str(copy), "--max-tokens", "4000", "--mode", "sliding", "--ctx", "64", "--stride", "64", "--write")
    assert out["temperature"] == pytest.approx(UNIGRAM_SHARPNESS, rel=0.1)
    assert out["after"]["nll"] < out["before"]["nll"] and out["after"]["ece"] < out["before"]["ece"]
    with CmfFile(copy) as f:
        cal = f.header["calibration"]
        assert cal["temperature"] == pytest.approx(out["temperature"], rel=1e-6)
        assert cal == out["written"]
        assert cal["fit_tokens"] == out["fit_tokens"] and cal["text"].startswith("alice")
        assert {k: v for k, v in f.header.items() if k != "calibration"} == {
            k: v for k, v in old_header.items() if k != "calibration"
        }
        assert len(f.tensors) == n_tensors and all(ok for _, ok in f.verify())
    with Engine.load(copy, ctx=8, warmup=False) as e:
        assert e.calibration_temperature == pytest.approx(out["temperature"], rel=1e-6)


def test_plot_and_terminal_report(tiny, tmp_path):
    path, _, _ = tiny
    png = tmp_path / "rel.png"
    r = runner.invoke(app, ["calibrate", str(path), "--max-tokens", "300", "--ctx", "64", "--plot", str(png)])
    assert r.exit_code == 0, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for words in ("Reliability", "ECE (equal-mass)", "MCE", "Brier", "Temperature scaling", "┃"):
        assert words in r.stdout


def test_plot_without_matplotlib(tiny, tmp_path, monkeypatch):
    path, _, _ = tiny
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    r = runner.invoke(app, ["calibrate", str(path), "--max-tokens", "50", "--plot", str(tmp_path / "x.png")])
    assert r.exit_code == 2 and r.stderr.strip() == "error: --plot needs matplotlib: pip install 'cortiq[plot]'"


@pytest.mark.parametrize(
    "args,msg",
    [
        (["/nonexistent/m.cmf"], "no such file"),
        (["{bad}"], "not a CMF file"),
        (["{model}", "--text", "{one}"], "scoring needs at least 2"),
        (["{model}", "--text", "{csv}", "--column", "nope"], "no column 'nope' (available: text, n)"),
        (["{model}", "--fit-fraction", "1.5"], "--fit-fraction"),
        (["{model}", "--plot", "/nonexistent/dir/x.png"], "does not exist"),
        (["{model}", "--t-min", "2", "--t-max", "3"], "temperature range"),
        (["{model}", "--max-tokens", "1"], "at least 2"),
        (["{model}", "--max-tokens", "50", "--write"], "edge of the grid"),
    ],
)
def test_one_line_errors(tiny, tmp_path, args, msg):
    path, _, _ = tiny
    (tmp_path / "bad.cmf").write_bytes(b"\0" * 100)
    (tmp_path / "one.txt").write_text("a")
    (tmp_path / "d.csv").write_text("text,n\nhello,1\n")
    subs = {
        "{model}": str(path),
        "{bad}": str(tmp_path / "bad.cmf"),
        "{one}": str(tmp_path / "one.txt"),
        "{csv}": str(tmp_path / "d.csv"),
    }
    r = runner.invoke(app, ["calibrate", *[subs.get(a, a) for a in args]])
    assert r.exit_code == 2, r.stdout
    assert r.stderr.startswith("error: ") and msg in r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
