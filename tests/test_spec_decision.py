"""The measured choice of draft sources (cortiq_engine/spec_decision.py): a source whose
rounds emit tokens slower than plain steps is switched off, one that is faster stays on,
and the output is the plain greedy output either way.

Rounds are timed on an injected clock: each reading advances it by one unit, and the
rigged draft hook adds half a unit per draft (what verifying its row costs), so a plain
step takes 1 unit, a round of 3 drafts 2.5: always rejected it emits 1 token (slower
than plain), always accepted 4 (faster). No wall-clock time is asserted."""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine import Engine, SpeculativeConfig
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.lookup import LookupDrafter
from cortiq_engine.mtp import make_drafter
from cortiq_engine.spec_decision import (
    MAX_PROBE_EVERY,
    MEMORY_ENV,
    MIN_ROUNDS,
    PROBE_BUDGET,
    PROBE_EVERY,
    SHRINK_ROUNDS,
    SpecDecision,
)
from tests.mtp_tiny import save_tiny_mtp

runner = CliRunner()
DEPTH = 3
TOKENS = 64
PROMPTS = ([5, 9, 17, 3, 88, 41], [200, 7, 7, 31, 64, 12, 9, 150, 2, 77])


class Clock:
    """Advances one unit per reading; ``charge`` adds the cost of work done in between."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now

    def charge(self, units: float) -> None:
        self.now += units


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("decision")
    path = root / "m.q8.cmf"
    convert_checkpoint(save_tiny_mtp("mimo", root / "src", n_layers=DEPTH), path, quant="q8")
    return path


def _rigged(clock: Clock, truth: list[int], right: bool, calls: list[int]):
    """A draft hook: the true continuation (right) or a wrong token at every depth; it
    charges the clock half a unit per draft and notes the position of each round."""

    def hook(t, ids, k):
        calls.append(t)
        clock.charge(0.5 * k)
        out = []
        for i in range(k):
            pos = t + 2 + i
            good = truth[pos] if pos < len(truth) else 0
            out.append(good if right else (good + 1) % 256)
        return out

    return hook


def _same(plain, spec) -> None:
    assert spec.token_ids == plain.token_ids
    assert [t.confidence for t in spec.tokens] == [t.confidence for t in plain.tokens]
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
    assert spec.cache_length == plain.cache_length


def _run(eng, prompt, right: bool):
    plain = eng.generate(prompt, max_tokens=TOKENS, ignore_eos=True, speculative=False)
    clock, calls = Clock(), []
    hook = _rigged(clock, list(prompt) + plain.token_ids, right, calls)
    d = make_drafter(eng.model, eng.drafts, eng.ctx, depth=DEPTH, override=hook, decision=SpecDecision(clock=clock))
    spec = eng.generate(prompt, max_tokens=TOKENS, ignore_eos=True, speculative=d)
    _same(plain, spec)
    return spec, calls


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_source_always_rejected_is_switched_off_and_the_output_is_plain(tiny, prompt):
    eng = Engine.load(tiny, threads=1, mtp=True)
    spec, calls = _run(eng, prompt, right=False)
    mtp = spec.extra["speculative"]["sources"]["mtp"]
    assert mtp["on"] is False and mtp["switches"] == 1
    assert 0.35 < mtp["speedup"] <= 0.5  # 1 token in 2.5 units (the last rounds draft fewer) against 1 in 1
    # Off after its first MIN_ROUNDS rounds (and the plain steps timed between them); at
    # 0.4x a probe costs 1.5 plain steps, so probes wait dozens of rounds.
    assert calls[1] - calls[0] == MIN_ROUNDS + 1 and MIN_ROUNDS < len(calls) <= MIN_ROUNDS + 2
    assert calls[2] - calls[1] == SpecDecision().probe_interval(0.4, MIN_ROUNDS) > 2 * PROBE_EVERY
    line = spec.extra["speculative"]["decision"]
    assert line.startswith("plain decoding; mtp off (0.") and f"x over plain in {mtp['rounds']} rounds)" in line
    # Its rounds cost 1.5 plain steps each: the whole decode a little slower than plain.
    assert 0.9 < spec.extra["speculative"]["overall_speedup"] < 1.0 and line.endswith("x overall")


def test_a_source_too_new_to_judge_says_so():
    dec = SpecDecision(clock=lambda: 0.0)
    dec.record("plain", 1, 1.0)
    dec.record("plain", 1, 1.0)
    dec.allow("lookup")
    dec.record("lookup", 1, 2.0)  # one round at 0.5x: not yet MIN_ROUNDS
    assert dec.decision() == "lookup 0.50x over plain in 1 round, too few to judge; about 0.75x overall"
    assert SpecDecision().decision() == "plain decoding (no source drafted)"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_source_always_accepted_stays_on(tiny, prompt):
    eng = Engine.load(tiny, threads=1, mtp=True)
    spec, calls = _run(eng, prompt, right=True)
    src = spec.extra["speculative"]["sources"]
    assert src["mtp"]["on"] is True and src["mtp"]["switches"] == 0
    assert 1.4 < src["mtp"]["speedup"] <= 4 / 2.5  # 4 tokens in 2.5 units (the last rounds draft fewer)
    # Plain steps only to time plain decoding: the first MIN_ROUNDS, then one when its
    # figure is PROBE_EVERY rounds old.
    assert src["plain"]["rounds"] <= MIN_ROUNDS + len(calls) // PROBE_EVERY
    assert spec.acceptance.acceptance == 1.0
    line = spec.extra["speculative"]["decision"]
    assert line.startswith("mtp 1.") and f"x over plain in {src['mtp']['rounds']} rounds" in line and "off" not in line
    assert 1.2 < spec.extra["speculative"]["overall_speedup"] < src["mtp"]["speedup"]


def test_lookup_and_mtp_share_one_choice(tiny):
    """Behind lookup drafts the MTP rounds are judged apart: rigged rejected they go off,
    while the lookup keeps drafting (its own rate is measured on the same clock)."""
    eng = Engine.load(tiny, threads=1, mtp=True)
    prompt = [11, 12, 13, 14] * 4 + [40, 41]
    plain = eng.generate(prompt, max_tokens=TOKENS, ignore_eos=True, speculative=False)
    clock, calls = Clock(), []
    hook = _rigged(clock, list(prompt) + plain.token_ids, False, calls)
    mtp = make_drafter(eng.model, eng.drafts, eng.ctx, depth=DEPTH, override=hook)
    d = LookupDrafter(eng.ctx, 3, (1, 3), mtp=mtp, decision=SpecDecision(clock=clock))
    spec = eng.generate(prompt, max_tokens=TOKENS, ignore_eos=True, speculative=d)
    _same(plain, spec)
    sources = spec.extra["speculative"]["sources"]
    assert sources["mtp"]["on"] is False
    assert spec.extra["mtp"]["by_source"]["plain"]["drafting_rounds"] > 0
    if "lookup" in sources:  # lookup drafts cost the clock nothing here: never slower than plain
        assert sources["lookup"]["on"] is True


def test_hysteresis_and_probes():
    """Off below plain's rate, back on only at ON_ABOVE; an off source drafts every
    PROBE_EVERY-th round it could when it loses little, less often the more it loses."""
    dec = SpecDecision(clock=lambda: 0.0)
    for _ in range(MIN_ROUNDS):
        dec.record("plain", 1, 1.0)
    assert dec.allow("lookup") is True  # not yet measured: it drafts
    for _ in range(MIN_ROUNDS):
        dec.record("lookup", 1, 1.02)  # 0.98x
    allowed = [dec.allow("lookup") for _ in range(2 * PROBE_EVERY)]
    assert sum(allowed) == 2 and dec.rates["lookup"].on is False
    for _ in range(dec.window):
        dec.record("lookup", 1, 1 / 1.03)  # 1.03x: above plain, below ON_ABOVE
    dec.allow("lookup")
    assert dec.rates["lookup"].on is False
    for _ in range(dec.window):
        dec.record("lookup", 1, 1 / 1.1)
    dec.record("plain", 1, 1.0)  # plain decoding timed lately: no plain step due
    assert dec.allow("lookup") is True and dec.rates["lookup"].on is True
    for _ in range(dec.window):
        dec.record("lookup", 1, 1 / 0.99)  # 0.99x: off again
    dec.allow("lookup")
    assert dec.rates["lookup"].on is False and dec.rates["lookup"].switches == 3
    assert sum(dec.allow("lookup") for _ in range(4 * PROBE_EVERY - 1)) == 4  # 0.99x: every 8th round
    for _ in range(dec.window):
        dec.record("lookup", 1, 2.0)  # 0.5x: a probe costs a plain step
    n = dec.rates["lookup"].rounds
    allowed = [dec.allow("lookup") for _ in range(3 * MAX_PROBE_EVERY)]
    every = math.ceil(n / (n + SHRINK_ROUNDS) / PROBE_BUDGET)  # (1 / 0.5 - 1) / PROBE_BUDGET, shrunk
    assert [i for i, a in enumerate(allowed) if a][:2] == [every - 1, 2 * every - 1]
    assert dec.probe_interval(0.1, 1000) == MAX_PROBE_EVERY and dec.probe_interval(1.2, 5) == PROBE_EVERY
    assert dec.probe_interval(0.5, 2) < dec.probe_interval(0.5, 20)  # few rounds: probed sooner


def test_the_json_and_the_line_carry_the_decision(tiny, tmp_path):
    path = str(tiny)
    args = ["generate", path, "la la la la la la la la", "-n", "24", "--ignore-eos"]
    env = {MEMORY_ENV: str(tmp_path / "speculation.json")}  # a first run: nothing remembered
    r = runner.invoke(app, [*args, "--json"], env=env)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    spec = doc["speculative"]
    assert (
        set(spec) == {"sources", "overall_speedup", "decision"}
        and isinstance(spec["decision"], str)
        and spec["decision"]
    )
    for name, s in spec["sources"].items():
        assert s["rounds"] > 0 and s["tokens"] > 0
        if name != "plain":
            assert isinstance(s["on"], bool) and name in spec["decision"]
    plain = json.loads(runner.invoke(app, [*args, "--json", "--no-mtp", "--lookup", "0"], env=env).stdout)
    assert "speculative" not in plain and plain["token_ids"] == doc["token_ids"]
    line = runner.invoke(app, args, env=env)
    assert line.exit_code == 0 and "speculative: " in line.output  # its own run: its own figures
    bench = runner.invoke(app, ["bench", path, "-p", "0", "-n", "8", "-r", "1", "--json"])
    assert bench.exit_code == 0, bench.output
    rows = {row["test"]: row for row in json.loads(bench.stdout)["rows"]}
    assert "speculative" not in rows["tg8"] and rows["tg8+mtp"]["speculative"]["decision"]


def test_decide_off_drafts_every_round(tiny):
    eng = Engine.load(tiny, threads=1, mtp=True)
    d, _ = eng.drafter(SpeculativeConfig(decide=False))
    assert isinstance(d, LookupDrafter) and d.decision is None
    res = eng.generate(PROMPTS[0], max_tokens=16, ignore_eos=True, speculative=d)
    assert "speculative" not in res.extra and "plain" not in res.extra["mtp"].get("by_source", {})


def test_a_source_switched_off_by_a_slow_stretch_comes_back_after_two_probes():
    """Its probes are judged on their own, not diluted by the rounds that switched it off."""
    dec = SpecDecision(clock=lambda: 0.0)
    for _ in range(MIN_ROUNDS):
        dec.record("plain", 1, 1.0)
    dec.allow("lookup")
    for _ in range(dec.window):
        dec.record("lookup", 1, 1 / 0.95)  # a slow stretch: 0.95x
    dec.record("plain", 1, 1.0)
    assert dec.allow("lookup") is False and dec.rates["lookup"].on is False
    rounds = 0
    while not dec.rates["lookup"].on:
        rounds += 1
        if dec.allow("lookup"):
            dec.record("lookup", 2, 1.0)  # 2x again
        else:
            dec.record("plain", 1, 1.0)
    assert rounds == MIN_ROUNDS * PROBE_EVERY
