"""``cortiq mtp-probe`` and evals/mtp_probe.py: teacher-forced acceptance bookkeeping
against hand-counted numbers, and the CLI end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine import Engine
from cortiq_engine.acceptance import Acceptance
from evals.mtp_probe import ProbeRequest, default_variants, probe, run_probe
from evals.text_source import TextSpec
from cortiq_engine.convert import convert_checkpoint
from tests.mtp_tiny import save_tiny_mtp


def test_teacher_forced_counts_by_hand():
    r = Acceptance(3)
    r.record_forced([1, 2, 3], [1, 2, 3])  # all right
    r.record_forced([1, 9, 3], [1, 2, 3])  # d2 wrong: chain stops at 1, d3 alone still right
    r.record_forced([9, 2, 3], [1, 2, 3])  # d1 wrong
    r.record_forced([1, 2, 9], [1, 2, 3])
    assert r.alone == [3 / 4, 3 / 4, 3 / 4]
    assert r.chained == [3 / 4, 2 / 4, 1 / 4]
    assert r.tokens_per_round == pytest.approx(1 + 0.75 + 0.5 + 0.25)
    assert r.accept_hist == [1, 1, 1, 1] and r.rounds == 4


def test_live_and_forced_counts_agree():
    """A live speculative round and a teacher-forced one with the same outcome count alike."""
    live, forced = Acceptance(3), Acceptance(3)
    for drafted, accepted, drafts, truth in (
        (3, 1, [1, 9, 3], [1, 2, 3]),
        (2, 2, [4, 5], [4, 5]),
        (3, 0, [0, 0, 0], [1, 2, 3]),
    ):
        live.record(drafted, accepted)
        forced.record_forced(drafts, truth)
    assert (live.drafted, live.accepted, live.accept_hist) == (forced.drafted, forced.accepted, forced.accept_hist)
    assert live.drafted == [3, 3, 2] and live.accepted == [2, 1, 0] and live.tokens_per_round == pytest.approx(2.0)
    assert live.to_json()["acceptance_alone"] is None and forced.alone == [2 / 3, 1 / 3, 1 / 2]


def test_default_variants():
    assert [v.label for v in default_variants(3, 3)] == [
        "independent/pre",
        "independent/post",
        "recursive/pre",
        "recursive/post",
    ]
    assert [v.chain for v in default_variants(1, 1)] == ["independent", "independent"]
    assert [v.chain for v in default_variants(1, 3)] == ["recursive", "recursive"]


@pytest.fixture(scope="module")
def const_model(tmp_path_factory):
    """Draft layers (MiMo names, 3 layers) on a trunk whose lm_head is constant:
    every draft is token 0, so acceptance is countable from the text alone."""
    from safetensors.numpy import load_file, save_file

    root = tmp_path_factory.mktemp("probe")
    src = save_tiny_mtp("mimo", root / "src", n_layers=3)
    w = load_file(str(src / "model.safetensors"))
    w["lm_head.weight"] = np.full_like(w["lm_head.weight"], 0.01)
    save_file(w, str(src / "model.safetensors"))
    path = root / "const.cmf"
    convert_checkpoint(src, path, quant="q8")
    return path


def test_probe_counts_against_the_text(const_model):
    eng = Engine.load(const_model, threads=1, mtp=True)
    stack = eng.drafts
    rng = np.random.default_rng(0)
    ids = [int(x) for x in np.where(rng.random(40) < 0.5, 0, rng.integers(1, 256, 40))]
    K = 3
    res = probe(eng.model, stack, ids, K, default_variants(3, K))
    # Hand count: drafts are all 0; round t checks ids[t+2 .. t+K+1].
    T = len(ids)
    alone = [np.mean([ids[t + 2 + k] == 0 for t in range(T - K - 1)]) for k in range(K)]
    chained = [np.mean([all(ids[t + 2 + i] == 0 for i in range(k + 1)) for t in range(T - K - 1)]) for k in range(K)]
    for _, r in res:
        assert r.rounds == T - K - 1
        assert r.alone == pytest.approx(alone)
        assert r.chained == pytest.approx(chained)
    assert 0 < chained[2] < chained[0] < 1


def test_cli_json_and_table(const_model, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Hi!! yes!!! no! Wow!!!! " * 4)  # "!" is token 0, the constant draft
    runner = CliRunner()
    r = runner.invoke(
        app, ["mtp-probe", str(const_model), "--text", str(text), "--max-tokens", "40", "--json", "--threads", "1"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["draft_layers"] == 3 and doc["depth"] == 3 and doc["tokens"] == 40
    assert [(v["chain"], v["hidden"]) for v in doc["variants"]] == [
        ("independent", "pre"),
        ("independent", "post"),
        ("recursive", "pre"),
        ("recursive", "post"),
    ]
    eng = Engine.load(const_model, threads=1)
    ids = eng.tokenizer.encode(text.read_text(), add_bos=True)[:40]
    zeros = [np.mean([ids[t + 2] == 0 for t in range(40 - 4)])]
    assert doc["variants"][0]["acceptance_alone"][0] == pytest.approx(zeros[0])
    assert 0 < zeros[0] < 1
    r = runner.invoke(
        app,
        [
            "mtp-probe",
            str(const_model),
            "--text",
            str(text),
            "--max-tokens",
            "24",
            "--mtp-chain",
            "recursive",
            "--mtp-hidden",
            "post",
            "--mtp-depth",
            "2",
            "--threads",
            "1",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "recursive" in r.stdout and "tokens/round" in r.stdout and "d1&d2" in r.stdout


def test_cli_errors(const_model, tmp_path):
    runner = CliRunner()
    r = runner.invoke(app, ["mtp-probe", str(const_model), "--mtp", str(tmp_path / "nope.mtp.cmf"), "--threads", "1"])
    assert r.exit_code == 2 and "no such file" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["mtp-probe", str(const_model), "--mtp-chain", "sideways", "--threads", "1"])
    assert r.exit_code == 2 and "sideways" in r.output
    r = runner.invoke(
        app, ["mtp-probe", str(const_model), "--mtp-chain", "independent", "--mtp-depth", "4", "--threads", "1"]
    )
    assert r.exit_code == 2 and "independent" in r.output


def test_run_probe_is_what_the_cli_prints(const_model, tmp_path):
    """The command prints the typed run of ``run_probe``: the same counts, in the same document."""
    text = tmp_path / "t.txt"
    text.write_text("Hi!! yes!!! no! Wow!!!! " * 4)
    run = run_probe(ProbeRequest(const_model, TextSpec(path=str(text)), 30, chain="recursive", threads=1))
    assert [v.label for v, _ in run.results] == ["recursive/pre", "recursive/post"]
    assert run.tokens == 30 and run.depth == 3 and run.thresholds is None and run.saved is None
    r = CliRunner().invoke(
        app,
        ["mtp-probe", str(const_model), "-f", str(text), "--text-tokens", "30", "--mtp-chain", "recursive", "--json"],
    )
    assert r.exit_code == 0, r.output

    def counts(doc):  # the draft and verify times differ from run to run
        return [{k: v for k, v in var.items() if not k.endswith("_ms_per_round")} for var in doc.pop("variants")]

    want, got = run.to_json(), json.loads(r.stdout)
    assert counts(got) == counts(want) and got == want
