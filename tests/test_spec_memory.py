"""What the measured choice of draft sources knows before a source drafts
(cortiq_engine/spec_decision.py: ``Prior``, ``SpecMemory``, ``modelled_ratio``): a
source known to lose starts off and is probed under the probe budget from its first
round; the rates one generation measured are remembered per machine for the next, in a
file that is untrusted input; a sidecar's held-out acceptance models a prior when
nothing is remembered. The output stays the plain greedy output throughout."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine import Engine, SpeculativeConfig
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.spec_decision import (
    DRAFT_COST,
    MEMORY_ENV,
    MEMORY_FORMAT,
    MAX_PROBE_EVERY,
    MEMORY_MAX_BYTES,
    MEMORY_ROUNDS,
    MIN_ROUNDS,
    PRIOR_ROUNDS,
    ROW_COST,
    Prior,
    SpecDecision,
    SpecMemory,
    modelled_ratio,
)
from formats.errors import CortiqError
from formats.sidecar import MAX_HELD_OUT_DEPTH, read_held_out
from tests.mtp_tiny import save_tiny_mtp

runner = CliRunner()
PROMPT = [5, 9, 17, 3, 88, 41, 5, 9, 17, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    path = root / "m.q8.cmf"
    convert_checkpoint(save_tiny_mtp("mimo", root / "src", n_layers=2), path, quant="q8")
    return path


def _plain_timed(dec: SpecDecision, n: int = MIN_ROUNDS) -> None:
    for _ in range(n):
        dec.record("plain", 1, 1.0)


def test_a_source_known_to_lose_starts_off_and_is_probed_under_the_budget():
    prior = Prior(0.5, 8, "remembered", 2)
    dec = SpecDecision(clock=lambda: 0.0, priors={"mtp": prior})
    # Named before it drafts: the report says why no MTP round ran.
    assert (
        dec.decision()
        == "plain decoding; mtp off (started off: 0.50x remembered from 2 runs on this machine; not probed)"
    )
    assert dec.to_json()["sources"]["mtp"]["prior"] == {"ratio": 0.5, "rounds": 8, "origin": "remembered", "runs": 2}
    _plain_timed(dec)
    every = dec.probe_interval(0.5, PRIOR_ROUNDS)  # a prior counts as PRIOR_ROUNDS rounds at least
    assert every > dec.probe_interval(0.5, MIN_ROUNDS)
    # Its first probe waits MAX_PROBE_EVERY rounds at least (a probe costs more than a short
    # answer may lose), the later ones the budget's interval.
    first = max(every, MAX_PROBE_EVERY)
    allowed = [dec.allow("mtp") for _ in range(first)]
    assert [i for i, a in enumerate(allowed) if a] == [first - 1]
    dec.record("mtp", 1, 2.0)
    later = dec.probe_interval(0.5, 1 + PRIOR_ROUNDS)
    assert later < MAX_PROBE_EVERY
    allowed = [dec.allow("mtp") for _ in range(later)]
    assert [i for i, a in enumerate(allowed) if a] == [later - 1]
    line = dec.decision()
    assert line.startswith("plain decoding; mtp off (0.50x over plain in 1 round; started off: 0.50x remembered")


def test_a_prior_at_plain_speed_or_better_changes_nothing():
    for ratio in (1.0, 1.7):
        dec = SpecDecision(clock=lambda: 0.0, priors={"lookup": Prior(ratio, 40, "remembered", 1)})
        assert dec.allow("lookup") is True and dec.rates["lookup"].on is True
        assert dec.decision() == "plain decoding (no source drafted)"


def test_a_losing_prior_comes_back_on_when_its_probes_win():
    dec = SpecDecision(clock=lambda: 0.0, priors={"lookup": Prior(0.9, 64, "remembered", 5)})
    _plain_timed(dec)
    rounds = 0
    while not dec.rates["lookup"].on:
        rounds += 1
        assert rounds < 200
        if dec.allow("lookup"):
            dec.record("lookup", 3, 1.0)  # 3x: the text changed
        else:
            dec.record("plain", 1, 1.0)
    assert dec.rates["lookup"].rounds == MIN_ROUNDS + 1  # back on at the round after its MIN_ROUNDS-th probe
    assert "back on" in dec.decision()


def test_modelled_ratio():
    assert modelled_ratio([0.115], 1) == pytest.approx(1.115 / (1 + DRAFT_COST + ROW_COST))
    assert modelled_ratio([0.9, 0.8, 0.7], 2) == pytest.approx(2.7 / (1 + 2 * (DRAFT_COST + ROW_COST)))
    assert modelled_ratio([0.115], 3) == modelled_ratio([0.115], 1)  # no deeper than it was measured
    assert modelled_ratio([0.115], 1) < 1.0 < modelled_ratio([0.8], 1)


def test_the_memory_remembers_per_key_and_counts_each_round_once(tmp_path):
    mem = SpecMemory(tmp_path / "deep" / "speculation.json")
    assert mem.priors("k") == {}
    dec = SpecDecision(clock=lambda: 0.0)
    _plain_timed(dec, 4)  # 1 s a token
    dec.record("mtp", 1, 2.0)
    dec.record("mtp", 1, 2.0)  # 0.5x over 2 rounds
    mem.remember("k", dec)
    assert mem.priors("k") == {"mtp": Prior(0.5, 2, "remembered", 1)} and mem.priors("other") == {}
    # A conversation's next turn: only its own rounds are added.
    dec.record("mtp", 2, 2.0)  # 1.0x over 1 round
    mem.remember("k", dec)
    p = mem.priors("k")["mtp"]
    assert p.runs == 2 and p.rounds == 3 and p.ratio == pytest.approx((0.5 * 2 + 1.0) / 3, abs=1e-4)
    mem.remember("k", dec)  # nothing new: nothing changes
    assert mem.priors("k")["mtp"] == p
    # The evidence is capped: the latest generations keep their say.
    for _ in range(MEMORY_ROUNDS):
        dec.record("mtp", 1, 1.0)
    mem.remember("k", dec)
    assert mem.priors("k")["mtp"].rounds == MEMORY_ROUNDS
    doc = json.loads(mem.path.read_text())
    assert doc["format"] == MEMORY_FORMAT and set(doc["entries"]) == {"k"}
    assert not [f for f in mem.path.parent.iterdir() if f != mem.path]  # no temporary file left


@pytest.mark.parametrize(
    "content",
    [
        b"\x00\xff not json",
        b"[1, 2]",
        b'{"format": "something else", "entries": {"k": {"sources": {"mtp": {"ratio": 0.5, "rounds": 3, "runs": 1}}}}}',
        b'{"format": "cortiq speculation rates", "entries": []}',
        b'{"format": "cortiq speculation rates", "entries": {"k": {"sources": {"mtp": {"ratio": NaN, "rounds": 3, "runs": 1}}}}}',
        b'{"format": "cortiq speculation rates", "entries": {"k": {"sources": {"mtp": {"ratio": 1e9, "rounds": 3, "runs": 1}}}}}',
        b'{"format": "cortiq speculation rates", "entries": {"k": {"sources": {"mtp": {"ratio": 0.5, "rounds": -3, "runs": 1}}}}}',
        b'{"format": "cortiq speculation rates", "entries": {"k": {"sources": {"mtp": {"ratio": "0.5", "rounds": 3, "runs": 1}}}}}',
        b'{"format": "cortiq speculation rates", "entries": {"k": {"sources": {"mtp": {"ratio": true, "rounds": 3, "runs": 1}}}}}',
        b'{"format": "cortiq speculation rates", "entries": {"k": {"sources": ["mtp"]}}}',
        b'{"format": "cortiq speculation rates", "entries": {"k": 7}}',
        b"[" * 100_000,
        b'{"format": "cortiq speculation rates", "entries": {"k": {"sources": {"mtp": {"ratio": 0.5, "rounds": 1'
        + b"0" * 5000
        + b', "runs": 1}}}}}',
    ],
)
def test_a_corrupt_or_hostile_memory_is_no_memory(tmp_path, content):
    path = tmp_path / "speculation.json"
    path.write_bytes(content)
    mem = SpecMemory(path)
    assert mem.priors("k") == {}
    dec = SpecDecision(clock=lambda: 0.0)
    _plain_timed(dec)
    dec.record("lookup", 2, 1.0)
    mem.remember("k", dec)  # replaces it with a sound file
    assert mem.priors("k") == {"lookup": Prior(2.0, 1, "remembered", 1)}


def test_a_memory_that_is_no_regular_file_is_no_memory(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MEMORY_MAX_BYTES + 1))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    folder = tmp_path / "folder.json"
    folder.mkdir()
    dec = SpecDecision(clock=lambda: 0.0)
    _plain_timed(dec)
    dec.record("lookup", 2, 1.0)
    for path in (big, fifo, folder, tmp_path / "missing" / "x.json"):
        mem = SpecMemory(path)
        assert mem.priors("k") == {}  # a FIFO does not block the read
        mem.remember("k", dec)  # never raises; a folder stays a folder
    assert folder.is_dir()
    blocked = tmp_path / "file"
    blocked.write_text("")
    SpecMemory(blocked / "x.json").remember("k", dec)  # its folder cannot be made: no memory, no error


def test_the_memory_path_and_its_override():
    assert SpecMemory.default({MEMORY_ENV: ""}) is None
    assert (
        SpecMemory.default({MEMORY_ENV: "/a/b.json"}).path == SpecMemory(__import__("pathlib").Path("/a/b.json")).path
    )
    assert str(SpecMemory.default({"XDG_CACHE_HOME": "/c"}).path) == "/c/cortiq/speculation.json"


def test_read_held_out_validates_the_record():
    assert read_held_out({}) is None and read_held_out({"trained": {"held_out": {}}}) is None
    assert read_held_out({"trained": {"held_out": {"acceptance_per_depth": [0.1, 1]}}}) == (0.1, 1.0)
    for bad in (
        {"trained": 3},
        {"trained": {"held_out": "x"}},
        {"trained": {"held_out": {"acceptance_per_depth": 0.5}}},
        {"trained": {"held_out": {"acceptance_per_depth": []}}},
        {"trained": {"held_out": {"acceptance_per_depth": [1.5]}}},
        {"trained": {"held_out": {"acceptance_per_depth": [math.nan]}}},
        {"trained": {"held_out": {"acceptance_per_depth": [True]}}},
        {"trained": {"held_out": {"acceptance_per_depth": [0.1] * (MAX_HELD_OUT_DEPTH + 1)}}},
    ):
        with pytest.raises(CortiqError):
            read_held_out(bad)


def test_the_engine_starts_from_the_sidecar_then_from_memory_and_stays_plain(tiny, tmp_path):
    eng = Engine.load(tiny, threads=1, mtp=True)
    plain = eng.generate(PROMPT, max_tokens=40, ignore_eos=True, speculative=False)
    cfg = SpeculativeConfig(lookup=0)
    # Nothing known: the MTP layers start on.
    d, _ = eng.drafter(cfg)
    assert d.decision.priors == {} and d.decision.rates == {}
    # A weak sidecar's held-out acceptance: modelled below plain, it starts off.
    eng.drafts = dataclasses.replace(eng.drafts, held_out=(0.05, 0.01))
    d, _ = eng.drafter(cfg)
    prior = d.decision.priors["mtp"]
    assert prior.origin == "modelled" and prior.ratio == pytest.approx(modelled_ratio((0.05, 0.01), d.depth))
    assert d.decision.rates["mtp"].on is False and d.decision.memory_key is None
    res = eng.generate(PROMPT, max_tokens=40, ignore_eos=True, speculative=cfg)
    assert res.token_ids == plain.token_ids and res.text == plain.text
    assert "started off: " in res.extra["speculative"]["decision"]
    # With a memory, what one generation measured is where the next starts.
    eng.drafts = dataclasses.replace(eng.drafts, held_out=None)
    eng.spec_memory = SpecMemory(tmp_path / "speculation.json")
    first = eng.generate(PROMPT, max_tokens=40, ignore_eos=True, speculative=cfg)
    d, _ = eng.drafter(cfg)
    assert d.decision.priors["mtp"].origin == "remembered" and d.decision.priors["mtp"].runs == 1
    measured = first.extra["speculative"]["sources"]["mtp"]
    assert d.decision.priors["mtp"].rounds == min(measured["rounds"], MEMORY_ROUNDS)
    second = eng.generate(PROMPT, max_tokens=40, ignore_eos=True, speculative=cfg)
    assert first.token_ids == second.token_ids == plain.token_ids
    assert second.extra["speculative"]["sources"]["mtp"]["prior"]["origin"] == "remembered"
    # Other settings are another key: lookup before the MTP layers starts knowing nothing of them.
    d, _ = eng.drafter(SpeculativeConfig(lookup=3))
    assert d.decision.priors == {}


def test_generate_remembers_across_runs_and_ignores_a_corrupt_memory(tiny, tmp_path):
    mem = tmp_path / "speculation.json"
    env = {MEMORY_ENV: str(mem)}
    line_args = ["generate", str(tiny), "la la la la la la la la", "-n", "24", "--ignore-eos", "-t", "1"]
    args = [*line_args, "--json"]
    plain = json.loads(runner.invoke(app, [*args, "--no-mtp", "--lookup", "0"], env=env).stdout)
    assert not mem.exists()  # plain decoding measures no source
    first = runner.invoke(app, args, env=env)
    assert first.exit_code == 0, first.output
    assert mem.is_file() and json.loads(mem.read_text())["format"] == MEMORY_FORMAT
    second = json.loads(runner.invoke(app, args, env=env).stdout)
    sources = second["speculative"]["sources"]
    assert any((s.get("prior") or {}).get("origin") == "remembered" for s in sources.values())
    assert second["token_ids"] == json.loads(first.stdout)["token_ids"] == plain["token_ids"]
    mem.write_bytes(b"{\x00 garbage")
    third = runner.invoke(app, line_args, env=env)  # the one stderr line, no traceback
    assert third.exit_code == 0 and "speculative: " in third.output and "Traceback" not in third.output
    off = runner.invoke(app, args, env={MEMORY_ENV: ""})
    assert off.exit_code == 0 and json.loads(off.stdout)["token_ids"] == plain["token_ids"]
