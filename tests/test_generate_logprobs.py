"""``generate --logprobs N``, ``--prompt-file`` and the peak-RSS figure.

Oracle: the engine's own teacher-forced logits (one batched forward over prompt +
output, an independent code path from decode), log-softmaxed in float64 here.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine.convert import convert_checkpoint
from tests.tiny import save_tiny

from cortiq_engine import Engine, SamplingConfig

runner = CliRunner()
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    out = root / "tiny.cmf"
    convert_checkpoint(save_tiny("llama", root / "hf", max_position_embeddings=128), out, quant="f32")
    return out


def _log_softmax(z):
    z = z.astype(np.float64) - z.max()
    return z - np.log(np.exp(z).sum())


def _check_against_teacher_forcing(eng, prompt_ids, doc, n, atol):
    full = eng.logits(list(prompt_ids) + doc["token_ids"])
    for k, t in enumerate(doc["tokens"]):
        lp = _log_softmax(full[len(prompt_ids) - 1 + k])
        assert t["logprob"] == pytest.approx(lp[t["id"]], abs=atol)
        top = t["top_logprobs"]
        assert len(top) == n
        got = [x["logprob"] for x in top]
        assert got == sorted(got, reverse=True)
        ref = np.sort(lp)[::-1][:n]
        np.testing.assert_allclose(got, ref, atol=atol)
        for x in top:  # each listed token carries its own log-probability and text
            assert x["logprob"] == pytest.approx(lp[x["id"]], abs=atol)
            assert x["text"] == eng.tokenizer.decode([x["id"]])
        assert top[0]["id"] == t["id"]  # greedy: the chosen token is the most likely


def test_logprobs_equal_log_softmax_of_the_logits(tiny):
    eng = Engine.load(tiny)
    r = runner.invoke(app, ["generate", str(tiny), PROMPT, "-n", "8", "--json", "--logprobs", "5"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    _check_against_teacher_forcing(eng, eng.tokenizer.encode(PROMPT), doc, 5, 1e-4)
    assert doc["peak_rss_bytes"] > 0


def test_engine_logprobs_off_by_default_and_sampling_unchanged(tiny):
    eng = Engine.load(tiny)
    ids = eng.tokenizer.encode(PROMPT)
    cfg = SamplingConfig(temperature=0.8, seed=3)
    plain = eng.generate(ids, cfg, max_tokens=6)
    with_lp = eng.generate(ids, cfg, max_tokens=6, logprobs=3)
    assert plain.token_ids == with_lp.token_ids
    assert "logprob" not in plain.tokens[0].to_json()
    assert all(len(t.top_logprobs) == 3 for t in with_lp.tokens)


def test_prompt_file_and_text_listing(tiny, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text(PROMPT, encoding="utf-8")
    a = json.loads(runner.invoke(app, ["generate", str(tiny), "--prompt-file", str(f), "-n", "6", "--json"]).stdout)
    b = json.loads(runner.invoke(app, ["generate", str(tiny), PROMPT, "-n", "6", "--json"]).stdout)
    assert a["token_ids"] == b["token_ids"] and a["prompt"] == PROMPT
    r = runner.invoke(app, ["generate", str(tiny), "-f", str(f), "-n", "4", "--logprobs", "2"])
    assert r.exit_code == 0, r.output
    assert "peak RSS" in r.stderr
    assert len([ln for ln in r.stderr.splitlines() if "|" in ln]) == 4  # one listing line per step


@pytest.mark.parametrize(
    "args,needle",
    [
        (["-f", "missing.txt"], "no such prompt file"),
        ([PROMPT, "-f", "p.txt"], "not both"),
        ([], "no prompt"),
    ],
)
def test_prompt_errors_are_one_line(tiny, tmp_path, args, needle):
    (tmp_path / "p.txt").write_text("x", encoding="utf-8")
    args = [str(tmp_path / a) if a.endswith(".txt") else a for a in args]
    r = runner.invoke(app, ["generate", str(tiny), *args])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.startswith("error:") and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_logprobs_on_smollm2(smollm2_cmf):
    path = smollm2_cmf("q8")
    eng = Engine.load(path)
    prompt = "The capital of France is"
    r = runner.invoke(app, ["generate", str(path), prompt, "-n", "8", "--json", "--logprobs", "5"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    # q8 kernels: a one-row decode and a batched forward round differently in the last bits.
    _check_against_teacher_forcing(eng, eng.tokenizer.encode(prompt), doc, 5, 2e-3)
    assert doc["tokens"][0]["text"] == " Paris"
    assert doc["peak_rss_bytes"] >= path.stat().st_size // 2  # the touched weights are resident
