"""n-gram lookup drafts (cortiq_engine/lookup.py): the index against a brute-force
search, and speculative decoding with lookup drafts (alone, and before MTP layers)
against plain greedy decoding, token for token, on tiny models and on SmolLM2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine import Engine, SamplingConfig, SpeculativeConfig
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.lookup import LookupDrafter, NgramIndex
from formats.errors import CortiqError
from tests.mtp_tiny import save_tiny_mtp

runner = CliRunner()


def brute_continuation(ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The longest suffix (hi down to lo) seen earlier, its latest occurrence, then k
    tokens of what followed, continuing through the drafts themselves."""
    n_ids = len(ids)
    for n in range(hi, lo - 1, -1):
        if n >= n_ids:
            continue
        suffix = ids[n_ids - n :]
        ends = [j for j in range(n, n_ids) if ids[j - n : j] == suffix]
        if ends:
            seq = list(ids)
            for i in range(k):
                seq.append(seq[ends[-1] + i])
            return seq[n_ids:]
    return []


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 3), (2, 4), (3, 5), (4, 4)])
def test_index_matches_brute_force_as_the_sequence_grows(lo, hi):
    rng = np.random.default_rng(lo * 10 + hi)
    for trial in range(6):
        vocab = int(rng.integers(2, 6))  # small vocabularies: matches of every length
        ids = [int(x) for x in rng.integers(0, vocab, size=120)]
        grown, prefix = NgramIndex(lo, hi), NgramIndex(lo, hi)
        hits = 0
        for m in range(1, len(ids) + 1):
            k = int(rng.integers(1, 9))
            want = brute_continuation(ids[:m], k, lo, hi)
            assert grown.continuation(ids[:m], k) == want  # incremental: one index, growing
            assert NgramIndex(lo, hi).continuation(ids[:m], k) == want  # built at once
            assert prefix.continuation(ids, k, end=m) == want  # the prefix by ``end``, uncopied
            hits += bool(want)
        assert hits > 0


def test_a_loop_continues_through_its_own_drafts():
    ids = [7, 1, 2, 3, 1, 2, 3, 1]
    # Suffix [3, 1] ended at position 5 (followed by 2, 3, then the drafts themselves).
    assert NgramIndex(2, 2).continuation(ids, 7) == [2, 3, 1, 2, 3, 1, 2]
    assert NgramIndex(3, 5).continuation([5, 6, 7, 8], 3) == []
    assert NgramIndex(1, 2).continuation([5], 3) == []


def test_a_shorter_sequence_starts_the_index_over():
    idx = NgramIndex(1, 2)
    assert idx.continuation([1, 2, 3, 1], 2) == [2, 3]
    assert idx.continuation([9, 8, 9], 2) == [8, 9]  # not [2, 3]: the old sequence is gone
    assert idx.done == 3


@pytest.mark.parametrize("lo,hi", [(0, 2), (3, 2), (1, 17)])
def test_bad_ngram_sizes_are_refused(lo, hi):
    with pytest.raises(CortiqError, match="lookup n-gram sizes"):
        NgramIndex(lo, hi)


def test_bad_lookup_counts_are_refused():
    for n in (0, 65):
        with pytest.raises(CortiqError, match="lookup drafts must be in 1..64"):
            LookupDrafter(100, n)


def test_the_lookup_never_reads_past_the_known_tokens():
    """The teacher-forced probe hands ``draft`` the true text beyond t+1: the lookup must
    draft from ids[:t+2] only."""
    d = LookupDrafter(64, 3, (1, 2))
    truth = [4, 5, 6, 4, 5, 9, 9, 9, 4, 5, 6]
    for t in range(len(truth) - 2):
        assert d.draft(t, truth) == LookupDrafter(64, 3, (1, 2)).draft(t, truth[: t + 2])
    assert d.draft(2, truth) == [5, 6, 4] and d.last_source == "lookup"  # [.., 4] seen at 0
    assert d.draft(0, [3, 8]) == [] and d.last_source == ""  # no match, no MTP: a plain step


# ------------------------------------------------------------------ generation
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup")
    out = {}
    src = save_tiny_mtp("mimo", root / "src", n_layers=3)
    for quant in ("f32", "q8", "q4"):
        convert_checkpoint(src, root / f"m.{quant}.cmf", quant=quant)
        out[quant] = root / f"m.{quant}.cmf"
    return out


def _prompts(seed: int) -> list[list[int]]:
    """Prompts that repeat themselves (so lookups match) and random ones."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(8):
        base = [int(x) for x in rng.integers(0, 256, size=int(rng.integers(2, 8)))]
        out.append(base * 4 if i % 2 == 0 else [int(x) for x in rng.integers(0, 256, size=20)])
    return out


def _same(plain, spec):
    assert spec.token_ids == plain.token_ids
    assert [t.confidence for t in spec.tokens] == [t.confidence for t in plain.tokens]
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
    assert spec.cache_length == plain.cache_length


@pytest.mark.parametrize("quant", ["f32", "q8", "q4"])
@pytest.mark.parametrize("with_mtp", [False, True])
def test_lookup_drafts_give_the_plain_greedy_tokens(tiny, quant, with_mtp):
    eng = Engine.load(tiny[quant], threads=1, mtp=with_mtp)
    # Rounds the measured choice runs plain instead of drafting are filed under "plain".
    cfg = SpeculativeConfig(lookup=3, ngram=(1, 3), threshold=0.0 if with_mtp else None)
    totals = {"lookup": [0, 0], "mtp": [0, 0], "plain": [0, 0]}
    for prompt in _prompts(seed=3):
        plain = eng.generate(prompt, max_tokens=40, ignore_eos=True, speculative=False)
        spec = eng.generate(prompt, max_tokens=40, ignore_eos=True, speculative=cfg)
        _same(plain, spec)
        m = spec.extra["mtp"]
        assert m["lookup"] == 3 and m["lookup_ngram"] == [1, 3]
        assert (m["chain"] is not None) == with_mtp
        # Every step emits its accepted drafts plus one token.
        assert m["accepted"] + m["rounds"] + m["plain_steps"] + 1 == len(spec.token_ids)
        for name, sub in m.get("by_source", {}).items():
            totals[name][0] += sub["drafted"]
            totals[name][1] += sub["accepted"]
        assert sum(s["drafting_rounds"] for s in m.get("by_source", {}).values()) <= m["drafting_rounds"]
    lk = totals["lookup"]
    assert lk[0] > 0 and 0 < lk[1] <= lk[0]  # lookups drafted, some accepted
    assert (totals["mtp"][0] > 0) == with_mtp  # rounds without a match went to the MTP layers


def test_every_token_enters_the_cache_once_with_lookup_drafts(tiny):
    eng = Engine.load(tiny["q8"], threads=1, mtp=True)
    prompt = [11, 12, 13, 14] * 5
    plain_state, spec_state = eng.new_state(), eng.new_state()
    from cortiq_engine.generate import generate

    plain = generate(
        eng.model, eng.tokenizer, prompt, SamplingConfig(), capacity=eng.ctx, max_tokens=30, state=plain_state
    )
    drafter, _ = eng.drafter(SpeculativeConfig(lookup=4, ngram=(1, 4), threshold=0.0))
    spec = eng.generate(prompt, max_tokens=30, speculative=drafter, state=spec_state)
    _same(plain, spec)
    n = len(prompt) + len(spec.token_ids) - 1
    st = spec.extra["mtp"]
    assert st["by_source"]["lookup"]["drafted"] > 0
    for pc, sc in zip(plain_state.caches, spec_state.caches):
        assert sc.length == pc.length == n
        assert sc.writes == n + st["drafted"] - st["accepted"]  # rejected drafts written and rolled back
        assert np.array_equal(sc.keys[:, :n], pc.keys[:, :n]) and np.array_equal(sc.values[:, :n], pc.values[:, :n])
    # The MTP layers caught up on the rows of the lookup rounds: their caches hold every
    # committed row once, as after MTP-only decoding.
    mtp = drafter.mtp
    assert mtp.hist_len == n and all(c <= n for c in mtp.committed)


def test_the_policy_of_lookup(tiny):
    plain_eng = Engine.load(tiny["q8"], threads=1)  # no draft layers
    # greedy decoding drafts by lookup alone by default, with the same tokens as plain
    default = plain_eng.generate([1, 2, 1, 2], max_tokens=12, ignore_eos=True)
    assert default.extra["mtp"]["source"] == "lookup" and default.extra["mtp"]["lookup"] == 3
    plain = plain_eng.generate([1, 2, 1, 2], max_tokens=12, ignore_eos=True, speculative=False)
    assert "mtp" not in plain.extra and plain.token_ids == default.token_ids
    assert "mtp" not in plain_eng.generate([1, 2, 1, 2], max_tokens=6, speculative=SpeculativeConfig(lookup=0)).extra
    alone = plain_eng.generate([1, 2, 1, 2], max_tokens=6, speculative=SpeculativeConfig(lookup=2))
    assert alone.extra["mtp"]["source"] == "lookup" and alone.extra["mtp"]["lookup"] == 2
    grams = plain_eng.generate([1, 2, 1, 2], max_tokens=6, speculative=SpeculativeConfig(ngram=(2, 4)))
    assert grams.extra["mtp"]["lookup_ngram"] == [2, 4]
    with pytest.raises(CortiqError, match="no MTP draft layers"):
        plain_eng.generate([1, 2], max_tokens=4, speculative=SpeculativeConfig(lookup=2, depth=2))
    with pytest.raises(CortiqError, match="no MTP draft layers"):  # True asks for the draft layers
        plain_eng.generate([1, 2], max_tokens=4, speculative=True)
    with pytest.raises(CortiqError, match="no lookup drafts: drop --lookup 0"):
        plain_eng.generate([1, 2], max_tokens=4, speculative=SpeculativeConfig(lookup=0, ngram=(2, 4)))
    # sampling: the default falls back to plain decoding silently; an explicit lookup gets a note
    quiet = plain_eng.generate([1, 2], SamplingConfig(temperature=0.7), max_tokens=4)
    assert "mtp" not in quiet.extra and not quiet.extra.get("mtp_note")
    sampled = plain_eng.generate(
        [1, 2], SamplingConfig(temperature=0.7), max_tokens=4, speculative=SpeculativeConfig(lookup=2)
    )
    assert "mtp" not in sampled.extra and "greedy" in sampled.extra["mtp_note"]  # as with MTP layers: a note
    eng = Engine.load(tiny["q8"], threads=1, mtp=True)
    both, _ = eng.drafter(None)
    assert isinstance(both, LookupDrafter) and both.lookup == 3 and both.mtp is not None  # on by default with layers
    alone, _ = eng.drafter(SpeculativeConfig(lookup=0))
    assert not isinstance(alone, LookupDrafter) and alone.depth == 3  # the MTP layers alone


def test_cli_lookup_alone_and_its_errors(tiny):
    path = str(tiny["q8"])
    # --no-mtp: the sidecar beside the model stays unloaded; --lookup N drafts alone.
    args = ["generate", path, "la la la la la la", "-n", "24", "--ignore-eos", "--json", "--no-mtp"]
    r = runner.invoke(app, [*args, "--lookup", "3", "--lookup-ngram", "1:3", "--mtp-compare"])
    assert r.exit_code == 0, r.output
    m = json.loads(r.stdout)["mtp"]
    assert m["source"] == "lookup" and m["same_tokens_as_plain"] is True and "lookup" in m["by_source"]
    plain = json.loads(runner.invoke(app, args).stdout)
    assert "mtp" not in plain and plain["token_ids"] == json.loads(r.stdout)["token_ids"]
    gated = runner.invoke(
        app, ["generate", path, "la la la la la la", "-n", "16", "--ignore-eos", "--json", "--mtp-gate"]
    )
    assert gated.exit_code == 0 and json.loads(gated.stdout)["mtp"]["mtp_gate"] is True
    assert json.loads(gated.stdout)["token_ids"] == json.loads(r.stdout)["token_ids"][:16]
    table = runner.invoke(app, ["generate", path, "la la la la la la", "-n", "12", "--ignore-eos", "--lookup", "2"])
    assert table.exit_code == 0 and "lookup 2 (3-5-grams)" in table.output and "lookup rounds" in table.output
    for bad, needle in (
        (["--lookup-ngram", "5:2"], "--lookup-ngram '5:2'"),
        (["--lookup-ngram", "x"], "--lookup-ngram 'x'"),
        (["--lookup", "2", "--mtp-depth", "2", "--no-mtp"], "--no-mtp and --mtp-depth contradict"),
        (["--no-mtp", "--lookup-ngram", "2:4"], "no lookup drafts: add --lookup N"),
        (["--lookup", "0", "--lookup-ngram", "2:4"], "--lookup 0 and --lookup-ngram contradict"),
        (["--no-mtp", "--lookup", "2", "--lookup-ngram", "2:40"], "lookup n-gram sizes 2..40"),
    ):
        r = runner.invoke(app, ["generate", path, "la la", "-n", "4", *bad])
        assert r.exit_code != 0 and needle in r.output and "Traceback" not in r.output
        assert len(r.output.strip().splitlines()) == 1, r.output


def test_smollm2_lookup_alone_is_exact_and_drafts(smollm2_cmf, english_text):
    """A real model: its greedy text repeats itself, so lookup drafts are accepted."""
    eng = Engine.load(smollm2_cmf("q8"), threads=2, mtp=False)
    paras = [p for p in english_text.split("\n\n") if len(p) > 300][:2]
    accepted = 0
    for p in paras:
        ids = eng.tokenizer.encode(p[:300])
        plain = eng.generate(ids, max_tokens=64, ignore_eos=True, speculative=False)
        spec = eng.generate(ids, max_tokens=64, ignore_eos=True, speculative=SpeculativeConfig(lookup=3))
        _same(plain, spec)
        accepted += spec.extra["mtp"]["by_source"]["lookup"]["accepted"]
    assert accepted > 0


class _StubMtp:
    """Stands in for the MTP drafter: always drafts [7]."""

    depth, capacity, hist_len = 1, 100, 0

    def draft(self, t, ids, depth=None):
        return [7]

    def reset(self):
        pass


def test_the_mtp_gate_follows_the_measured_cost():
    """Rounds without a lookup match go to MTP drafts or a plain step by their recent ms per
    token; every GATE_PROBE-th such round tries the other choice."""
    from cortiq_engine.lookup import GATE_PROBE

    d = LookupDrafter(100, 3, (3, 5), mtp=_StubMtp(), gate=True)
    ids = [1, 2]  # no match: every round is the gate's

    def run(n, mtp_cost, plain_cost):
        chosen = []
        for _ in range(n):
            drafts = d.draft(0, ids)
            chosen.append(d.last_source)
            # MTP rounds emit 2 tokens in mtp_cost s; plain steps 1 token in plain_cost s.
            d.observe(2, mtp_cost) if drafts else d.observe(1, plain_cost)
        return chosen

    first = run(GATE_PROBE * 4, mtp_cost=3.0, plain_cost=1.0)  # MTP: 1.5 s a token, plain 1.0
    assert first[0] == "mtp" and "plain" in first  # MTP until plain steps were measured
    late = first[GATE_PROBE * 2 :]
    assert late.count("mtp") <= len(late) // GATE_PROBE and late.count("plain") == len(late) - late.count("mtp")
    d.reset()
    fast = run(GATE_PROBE * 4, mtp_cost=1.0, plain_cost=1.0)  # MTP: 0.5 s a token
    assert fast[GATE_PROBE * 2 :].count("plain") == GATE_PROBE * 2 // GATE_PROBE
    off = LookupDrafter(100, 3, (3, 5), mtp=_StubMtp())  # the default: no gate
    assert all(off.draft(0, ids) == [7] for _ in range(3 * GATE_PROBE))


def test_gated_generation_is_exact_and_reports_plain_rounds(tiny):
    eng = Engine.load(tiny["q8"], threads=1, mtp=True)
    for prompt in _prompts(seed=9)[:4]:
        plain = eng.generate(prompt, max_tokens=48, ignore_eos=True, speculative=False)
        spec = eng.generate(
            prompt, max_tokens=48, ignore_eos=True, speculative=SpeculativeConfig(threshold=0.0, mtp_gate=True)
        )
        _same(plain, spec)
        m = spec.extra["mtp"]
        assert m["mtp_gate"] is True
        steps = sum(sub["drafting_rounds"] for sub in m["by_source"].values())
        assert steps == m["drafting_rounds"]  # every round filed under lookup, mtp or plain
