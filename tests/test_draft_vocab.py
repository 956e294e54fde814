"""The draft vocabulary and adaptive depth: speculative output stays the plain
greedy stream token for token; the draft vocabulary's sub-head scores exactly what the
full lm_head scores at those ids; the sidecar's vocabulary is validated on load (one
line per fault); the chooser picks the right ids of a known text; the counters report
the depth each round chose.

Oracles: plain greedy decoding of the same engine (``Engine.generate(speculative=False)``),
the full lm_head's logits (bit for bit), and a drafter without threshold (the threshold
only cuts its drafts short).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine import Engine, SamplingConfig, SpeculativeConfig
from cortiq_engine.acceptance import Acceptance
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.draft_vocab import choose_draft_vocab, sub_head
from cortiq_engine.mtp import make_drafter
from evals.mtp_probe import ProbeTrace, backbone_hiddens, threshold_table
from formats.cmf import CmfFile, CmfWriter
from formats.errors import CortiqError
from formats.sidecar import DRAFT_VOCAB_TENSOR, copy_with_draft_vocab, draft_vocab_record, sidecar_path
from tests.mtp_tiny import save_tiny_mtp

VOCAB = 256  # the tiny models' vocabulary
MAX_TOKENS = 24


def _prompts(seed: int, n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, VOCAB, size=int(rng.integers(1, 30))))) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(family, quant) -> (model path, its sidecar); MiMo-style 3-layer drafts on a llama
    trunk and on a real MiMo-V2 trunk."""
    root = tmp_path_factory.mktemp("vocab")
    out = {}
    for key, trunk in (("mimo", None), ("mimo_v2", "mimo_v2_flash")):
        src = save_tiny_mtp("mimo", root / key, n_layers=3, trunk=trunk)
        for quant in ("f32", "q8", "q4"):
            path = root / f"{key}.{quant}.cmf"
            convert_checkpoint(src, path, quant=quant)
            out[key, quant] = (path, sidecar_path(path))
    return out


def _with_vocab(side, out, ids):
    ids = np.asarray(ids, dtype=np.int64)
    return copy_with_draft_vocab(side, out, ids, draft_vocab_record(ids, "test", 100), force=True)


# ------------------------------------------------------------------ the chooser
def test_chooser_on_a_known_text():
    # Target tokens (all but the first): 5 x3, 7 x2, 3 x1, 9 x1; id 1 is only the BOS.
    ids = [1, 5, 5, 7, 3, 5, 7, 9]
    assert choose_draft_vocab(ids, 4, 12, always=[2]).tolist() == [2, 5, 7, 3]
    # Ties (3 and 9 once each) go to the lower id; unseen ids fill the rest, lowest first,
    # and the BOS at position 0 counts as unseen.
    assert choose_draft_vocab(ids, 8, 12, always=[11]).tolist() == [11, 5, 7, 3, 9, 0, 1, 2]
    assert choose_draft_vocab(ids, 12, 12).tolist() == [5, 7, 3, 9, 0, 1, 2, 4, 6, 8, 10, 11]
    # An always-id that also occurs is not repeated.
    assert choose_draft_vocab(ids, 3, 12, always=[7, 7]).tolist() == [7, 5, 3]
    for bad in (0, 13):
        with pytest.raises(CortiqError, match="between 1 and the vocab size 12"):
            choose_draft_vocab(ids, bad, 12)
    with pytest.raises(CortiqError, match="outside the vocabulary"):
        choose_draft_vocab([1, 12], 2, 12)


def test_chooser_on_real_text_with_the_tokenizer(tiny):
    """The model's tokenizer: the most frequent target token of a text is first after the
    EOS/special ids, and every special id is in."""
    from cortiq_engine.draft_vocab import vocab_from_text

    eng = Engine.load(tiny["mimo", "f32"][0], threads=1, warmup=False)
    text = "the cat and the dog and the bird. " * 20
    ids, n_tok = vocab_from_text(eng.tokenizer, eng.vocab_size, eng.eos_ids, text, 40)
    toks = eng.tokenizer.encode(text, add_bos=True)
    assert n_tok == len(toks)
    special = [*eng.eos_ids, *eng.tokenizer.special_ids()]
    k = len(dict.fromkeys(special))
    assert ids[:k].tolist() == list(dict.fromkeys(special))
    counts = np.bincount(toks[1:], minlength=eng.vocab_size)
    assert int(ids[k]) == int(np.argmax(np.where(np.isin(np.arange(eng.vocab_size), special), -1, counts)))
    assert set(np.flatnonzero(counts)) <= set(ids.tolist())


# ------------------------------------------------------------------ the sub-head
@pytest.mark.parametrize("quant", ["f32", "q8", "q4"])
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_sub_head_logits_equal_the_full_head(tiny, quant, kernels):
    eng = Engine.load(tiny["mimo", quant][0], threads=1, kernels=kernels)
    rng = np.random.default_rng(3)
    ids = rng.permutation(VOCAB)[:37]
    head = sub_head(eng.model.head, ids)
    assert head.ids.tolist() == sorted(ids.tolist()) and head.weight.dtype == eng.model.head.dtype
    for n in (1, 4):
        x = eng.model.final_norm(rng.standard_normal((n, eng.model.hidden_size)).astype(np.float32))
        full = eng.model.lm_head(x)
        sub = head.logits(eng.kernels, x)
        # float64 oracle: the dequantized rows of those ids times x.
        ref = x.astype(np.float64) @ eng.model.head.dequantize().astype(np.float64)[head.ids].T
        np.testing.assert_allclose(sub, ref, rtol=1e-5, atol=1e-5)
        if kernels == "numba":
            # The compiled kernels compute each output row from its own weight row: bit for bit.
            assert np.array_equal(sub, full[:, head.ids])
        # The argmax maps back to the full id the full head would pick among these ids.
        for r in range(n):
            assert head.full_id(int(np.argmax(sub[r]))) == int(head.ids[np.argmax(full[r, head.ids])])


def test_a_full_size_vocabulary_drafts_what_the_full_head_drafts(tiny, tmp_path):
    """Every id in (any order): the drafts, so the acceptance counts, are the full head's."""
    path, side = tiny["mimo", "q8"]
    perm = np.random.default_rng(0).permutation(VOCAB)
    eng = Engine.load(path, threads=1, mtp=_with_vocab(side, tmp_path / "all.mtp.cmf", perm))
    assert eng.drafts.vocab.tolist() == perm.tolist()
    for prompt in _prompts(1, 4):
        # decide=False: the measured decision may switch drafting off on timing, and the counts compared here
        # are the drafts'.
        a = eng.generate(
            prompt, max_tokens=MAX_TOKENS, speculative=SpeculativeConfig(vocab="full", threshold=0, decide=False)
        )
        b = eng.generate(prompt, max_tokens=MAX_TOKENS, speculative=SpeculativeConfig(threshold=0, decide=False))
        assert b.extra["mtp"]["draft_vocab"] == VOCAB and a.extra["mtp"]["draft_vocab"] == "full"
        assert a.token_ids == b.token_ids
        for key in ("depth_drafted", "depth_accepted", "accept_histogram", "depth_histogram"):
            assert a.extra["mtp"][key] == b.extra["mtp"][key]


# ------------------------------------------------------------------ exact output
def _assert_same(plain, spec):
    assert spec.token_ids == plain.token_ids
    assert [t.confidence for t in spec.tokens] == [t.confidence for t in plain.tokens]
    assert spec.text == plain.text and spec.finish_reason == plain.finish_reason
    assert spec.cache_length == plain.cache_length


@pytest.mark.parametrize("quant", ["f32", "q8"])
@pytest.mark.parametrize("family", ["mimo", "mimo_v2"])
def test_greedy_equality_with_a_draft_vocabulary(tiny, tmp_path, quant, family):
    path, side = tiny[family, quant]
    small = np.random.default_rng(5).permutation(VOCAB)[:48]
    eng = Engine.load(path, threads=1, mtp=_with_vocab(side, tmp_path / "v.mtp.cmf", small))
    drafted = 0
    for vocab in (None, 16, "full"):
        for prompt in _prompts(2):
            plain = eng.generate(prompt, max_tokens=MAX_TOKENS, speculative=False)
            spec = eng.generate(prompt, max_tokens=MAX_TOKENS, speculative=SpeculativeConfig(vocab=vocab, threshold=0))
            _assert_same(plain, spec)
            st = spec.extra["mtp"]
            assert st["draft_vocab"] == {None: 48, 16: 16, "full": "full"}[vocab]
            assert st["accepted"] + st["rounds"] + st["plain_steps"] + 1 == len(spec.token_ids)
            drafted += st["drafted"]
    assert drafted > 0
    # The drafts themselves come from the vocabulary: a drafter on the prompt's rows.
    d = make_drafter(eng.model, eng.drafts, 64, head=eng.draft_head(16))
    ids = _prompts(3, 1)[0] + [7, 8]
    d.note(0, backbone_hiddens(eng.model, np.array(ids[:-1])))
    for t in range(len(ids) - 2):
        assert set(d.draft(t, ids[: t + 2])) <= set(small[:16].tolist())


def _probs(eng, family_path, prompt):
    """Each round's draft probabilities along a plain greedy continuation (no threshold)."""
    plain = eng.generate(prompt, max_tokens=MAX_TOKENS, speculative=False)
    ids = list(prompt) + plain.token_ids
    d = make_drafter(eng.model, eng.drafts, len(ids), record_probs=True)
    d.note(0, backbone_hiddens(eng.model, np.array(ids[:-1])))
    out = []
    for t in range(len(prompt) - 1, len(ids) - 2):
        drafts = d.draft(t, ids[: t + 2])
        out.append((t, drafts, list(d.probs)))
    return ids, out


@pytest.mark.parametrize("quant", ["f32", "q8"])
@pytest.mark.parametrize("family", ["mimo", "mimo_v2"])
def test_adaptive_depth_cuts_drafts_and_stays_exact(tiny, quant, family):
    path, _ = tiny[family, quant]
    eng = Engine.load(path, threads=1, mtp=True)
    prompt = _prompts(4, 1)[0]
    ids, rounds = _probs(eng, path, prompt)
    allp = np.array([p for _, _, ps in rounds for p in ps])
    assert np.all((allp >= 1.0 / VOCAB - 1e-9) & (allp <= 1.0))
    # Thresholds at the probabilities' quartiles: rounds of every depth.
    for th in np.quantile(allp, [0.25, 0.5, 0.75]):
        d = make_drafter(eng.model, eng.drafts, len(ids), threshold=float(th))
        d.note(0, backbone_hiddens(eng.model, np.array(ids[:-1])))
        for t, full, ps in rounds:
            cut = next((i for i, p in enumerate(ps) if p < th), len(ps))
            got = d.draft(t, ids[: t + 2])
            # A skipped layer catches up several rows at once next time, which may round
            # differently; only a probability right at the threshold could flip the cut.
            if all(abs(p - th) > 1e-4 for p in ps[: cut + 1]):
                assert got == full[:cut]
    hist_seen = np.zeros(4, int)
    for th in [0.0, *np.quantile(allp, [0.25, 0.5, 0.75]), 0.999]:
        for prompt in _prompts(6):
            plain = eng.generate(prompt, max_tokens=MAX_TOKENS, speculative=False)
            # MTP alone (lookup=0): the threshold decides every round.
            spec = eng.generate(
                prompt,
                max_tokens=MAX_TOKENS,
                speculative=SpeculativeConfig(threshold=float(th), lookup=0, decide=False),
            )
            _assert_same(plain, spec)
            st = spec.extra["mtp"]
            assert st["threshold"] == pytest.approx(th)
            hist = st["depth_histogram"]
            assert sum(hist) == st["drafting_rounds"]
            # Depth-0 rounds are plain steps; every step emits its accepted drafts + 1.
            assert st["accepted"] + st["rounds"] + st["plain_steps"] + 1 == len(spec.token_ids)
            assert sum(hist[1:]) == st["rounds"]
            assert [sum(hist[k + 1 :]) for k in range(3)] == st["depth_drafted"]
            hist_seen += hist
            if th == 0.0:
                assert hist[0] == 0
            if th == 0.999:
                assert hist[1:] == [0, 0, 0]
    assert np.all(hist_seen > 0)


def test_rigged_drafts_with_vocabulary_and_threshold_accept_what_they_should(tiny, tmp_path):
    """A constant lm_head: every argmax is id 0 with probability 1/|scored ids|; the drafts
    are always right. A vocabulary of 4 ids (0 among them) drafts with p = 1/4: a
    threshold under it keeps full depth, one over it drafts nothing."""
    from safetensors.numpy import load_file, save_file

    src = save_tiny_mtp("mimo", tmp_path / "src", n_layers=3)
    w = load_file(str(src / "model.safetensors"))
    w["lm_head.weight"] = np.full_like(w["lm_head.weight"], 0.01)
    save_file(w, str(src / "model.safetensors"))
    path = tmp_path / "const.cmf"
    convert_checkpoint(src, path, quant="q8")
    side = _with_vocab(sidecar_path(path), tmp_path / "v4.mtp.cmf", [9, 0, 200, 17])
    eng = Engine.load(path, threads=1, mtp=side)
    plain = eng.generate([5, 6, 7], max_tokens=17, speculative=False)
    # MTP alone (lookup=0): every token is id 0, which n-gram lookup would draft too.
    high = eng.generate([5, 6, 7], max_tokens=17, speculative=SpeculativeConfig(threshold=0.2, lookup=0, decide=False))
    _assert_same(plain, high)
    assert high.extra["mtp"]["depth_histogram"] == [0, 0, 0, 4] and high.extra["mtp"]["tokens_per_round"] == 4.0
    low = eng.generate([5, 6, 7], max_tokens=17, speculative=SpeculativeConfig(threshold=0.3, lookup=0, decide=False))
    _assert_same(plain, low)
    # 16 decode steps; the last has no room for a draft (a plain step, not a drafting round).
    assert low.extra["mtp"]["depth_histogram"] == [15, 0, 0, 0] and low.extra["mtp"]["rounds"] == 0
    assert low.extra["mtp"]["plain_steps"] == 16
    full = eng.generate(
        [5, 6, 7], max_tokens=17, speculative=SpeculativeConfig(vocab="full", threshold=0.2, lookup=0, decide=False)
    )
    _assert_same(plain, full)
    assert full.extra["mtp"]["depth_histogram"][0] == 15  # p = 1/256 over the full vocabulary


# ------------------------------------------------------------------ hostile sidecars
def _write(side, out, header_edit=None, tensor=None):
    """A copy of ``side`` with a hand-made draft vocabulary: ``tensor`` = (dtype, array) or
    None, ``header_edit(mtp_section)`` edits the header's mtp record."""
    with CmfFile(side) as cmf:
        header = json.loads(json.dumps(cmf.header))
        if header_edit is not None:
            header_edit(header["mtp"])
        with CmfWriter(out, header, force=True) as w:
            for name in cmf.names():
                info = cmf.info(name)
                w.add_encoded(name, info.dtype, tuple(info.shape), list(cmf.tensor_parts(name).values()))
            if tensor is not None:
                w.add(DRAFT_VOCAB_TENSOR, tensor[0], tensor[1])
    return out


def _rec(size):
    return lambda m: m.__setitem__("draft_vocab", {"size": size, "tensor": DRAFT_VOCAB_TENSOR})


_HOSTILE = [
    ("no record", None, ("i32", np.arange(4)), "header record mtp.draft_vocab is missing"),
    ("no tensor", _rec(4), None, f"tensor {DRAFT_VOCAB_TENSOR} is missing"),
    ("not an object", lambda m: m.__setitem__("draft_vocab", [1, 2]), ("i32", np.arange(4)), "expected an object"),
    ("size mismatch", _rec(5), ("i32", np.arange(4)), r"tensor is i32\[4\], expected i32\[5\]"),
    ("size zero", _rec(0), ("i32", np.arange(4)), "size 0 is not between 1 and the vocab size 256"),
    ("size too big", _rec(257), ("i32", np.arange(257)), "size 257 is not between 1 and the vocab size 256"),
    ("size bool", _rec(True), ("i32", np.arange(1)), "size True is not between"),
    ("wrong dtype", _rec(4), ("f32", np.arange(4, dtype=np.float32)), r"tensor is f32\[4\], expected i32\[4\]"),
    ("2-D", _rec(4), ("i32", np.arange(4).reshape(2, 2)), r"tensor is i32\[2, 2\], expected i32\[4\]"),
    ("id too big", _rec(3), ("i32", np.array([1, 256, 3])), r"token id 256 outside the vocabulary 0..255"),
    ("negative id", _rec(3), ("i32", np.array([1, -7, 3])), r"token id -7 outside the vocabulary"),
    ("repeated id", _rec(4), ("i32", np.array([4, 9, 4, 1])), "token id 4 appears twice"),
]


@pytest.mark.parametrize("label,edit,tensor,message", _HOSTILE, ids=[h[0] for h in _HOSTILE])
def test_hostile_draft_vocabulary_is_one_line(tiny, tmp_path, label, edit, tensor, message):
    path, side = tiny["mimo", "q8"]
    bad = _write(side, tmp_path / "bad.mtp.cmf", edit, tensor)
    with pytest.raises(CortiqError, match=message) as e:
        Engine.load(path, threads=1, mtp=bad, warmup=False)
    assert "\n" not in str(e.value) and "bad.mtp.cmf" in str(e.value)
    r = CliRunner().invoke(app, ["generate", str(path), "hi", "--mtp", str(bad), "--max-tokens", "2"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert len([ln for ln in r.output.strip().splitlines() if ln.strip()]) == 1


def test_vocab_options_refuse_what_the_sidecar_cannot_give(tiny, tmp_path):
    path, side = tiny["mimo", "q8"]
    eng = Engine.load(path, threads=1, mtp=True)
    with pytest.raises(CortiqError, match="no draft vocabulary; add one with `cortiq mtp-vocab"):
        eng.generate([1, 2], max_tokens=3, speculative=SpeculativeConfig(vocab=8))
    eng = Engine.load(path, threads=1, mtp=_with_vocab(side, tmp_path / "v.mtp.cmf", np.arange(10)))
    with pytest.raises(CortiqError, match="has 10 ids"):
        eng.generate([1, 2], max_tokens=3, speculative=SpeculativeConfig(vocab=11))
    with pytest.raises(CortiqError, match=r"threshold must be in \[0, 1\)"):
        eng.generate([1, 2], max_tokens=3, speculative=SpeculativeConfig(threshold=1.5))
    r = CliRunner().invoke(
        app, ["generate", str(path), "hi", "--mtp", str(tmp_path / "v.mtp.cmf"), "--mtp-vocab", "lots"]
    )
    assert r.exit_code != 0 and "--mtp-vocab 'lots': give a number of ids or full" in r.output


# ------------------------------------------------------------------ the mtp-vocab command
def test_mtp_vocab_command_adds_replaces_and_removes(tiny, tmp_path):
    path, side = tiny["mimo", "q8"]
    text = tmp_path / "t.txt"
    text.write_text("one two three two three three " * 30)
    out = tmp_path / "with.mtp.cmf"
    r = CliRunner().invoke(
        app, ["mtp-vocab", str(path), "--text", str(text), "--size", "20", "--out", str(out), "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["draft_vocab"] == 20 and doc["sidecar"] == str(out)
    eng = Engine.load(path, threads=1, mtp=out)
    assert eng.drafts.vocab.size == 20
    # The draft layers are the sidecar's byte for byte; only the vocabulary is new.
    with CmfFile(side) as a, CmfFile(out) as b:
        assert set(b.names()) == set(a.names()) | {DRAFT_VOCAB_TENSOR}
        for n in a.names():
            assert a.raw_bytes(n) == b.raw_bytes(n)
        assert b.header["mtp"]["draft_vocab"]["size"] == 20
    plain = eng.generate([3, 4, 5], max_tokens=12, speculative=False)
    _assert_same(plain, eng.generate([3, 4, 5], max_tokens=12))
    # Refuses to overwrite without --force; rewrites in place without --out; --size 0 removes it.
    r = CliRunner().invoke(app, ["mtp-vocab", str(path), "--text", str(text), "--size", "8", "--out", str(out)])
    assert r.exit_code != 0 and "exists (use --force" in r.output
    r = CliRunner().invoke(app, ["mtp-vocab", str(path), "--mtp", str(out), "--text", str(text), "--size", "8"])
    assert r.exit_code == 0, r.output
    assert Engine.load(path, threads=1, mtp=out, warmup=False).drafts.vocab.size == 8
    r = CliRunner().invoke(app, ["mtp-vocab", str(path), "--mtp", str(out), "--size", "0"])
    assert r.exit_code == 0, r.output
    assert Engine.load(path, threads=1, mtp=out, warmup=False).drafts.vocab is None
    r = CliRunner().invoke(
        app, ["mtp-vocab", str(path), "--text", str(text), "--size", "999", "--out", str(tmp_path / "x.mtp.cmf")]
    )
    assert r.exit_code != 0 and "between 1 and the vocab size 256" in r.output


# ------------------------------------------------------------------ counters and the threshold table
def test_acceptance_depth_histogram_and_merge():
    a = Acceptance(3)
    a.record(3, 2, 0.003, 0.010)
    a.record(1, 0, 0.001, 0.008)
    a.record(0, 0, 0.001, 0.007)  # the first draft was below the threshold
    a.record(0, 0, tried=False)  # no room for drafts
    j = a.to_json()
    assert j["depth_histogram"] == [1, 1, 0, 1] and j["drafting_rounds"] == 3 and j["plain_steps"] == 2
    assert j["rounds"] == 2 and j["depth_drafted"] == [2, 1, 1] and j["depth_accepted"] == [1, 1, 0]
    assert j["tokens_per_round"] == pytest.approx(1 + 2 / 3) and j["mean_depth"] == pytest.approx(4 / 3)
    assert j["draft_ms_per_round"] == pytest.approx(5 / 3) and j["verify_ms_per_round"] == pytest.approx(25 / 3)
    b = Acceptance(3)
    b.record_forced([4, 5], [4, 6, 7])  # a round cut at depth 2: depth 3 not checked
    a.merge(b)
    assert a.depth_hist == [1, 1, 1, 1] and a.checked == [1, 1, 0] and a.right == [1, 0, 0]


def test_threshold_table_replays_rounds_with_the_cost_model():
    # Two rounds of depth 2: (p .9 right, p .2 right), (p .1 wrong, p .8 wrong).
    tr = ProbeTrace(np.array([[0.9, 0.2], [0.1, 0.8]]), np.array([[True, True], [False, False]]))
    rows = {
        r.threshold: r
        for r in threshold_table(tr, draft_ms=1.0, verify_ms=[10.0, 12.0, 14.0], candidates=(0.0, 0.15, 0.5, 0.95))
    }
    # 0: both rounds draft 2 (cost 2 + 14 each), tokens 3 + 1.
    assert rows[0.0].ms_per_token == pytest.approx(32 / 4) and rows[0.0].mean_depth == 2
    # 0.15: round 1 keeps 2 (16, 3 tokens); round 2 stops at its first draft (1 + 10, 1 token).
    assert rows[0.15].ms_per_token == pytest.approx(27 / 4) and rows[0.15].mean_depth == 1
    # 0.5: round 1 keeps 1 (2 + 12, 2 tokens); round 2 as before.
    assert rows[0.5].ms_per_token == pytest.approx(25 / 3) and rows[0.5].tokens_per_step == 1.5
    # 0.95: nothing kept, each step computed one draft and decoded plainly.
    assert rows[0.95].ms_per_token == pytest.approx(11.0) and rows[0.95].speedup == pytest.approx(10 / 11)


def test_mtp_probe_reports_vocab_threshold_and_the_threshold_table(tiny, tmp_path):
    path, side = tiny["mimo", "q8"]
    v = _with_vocab(side, tmp_path / "v.mtp.cmf", np.arange(64))
    text = tmp_path / "t.txt"
    text.write_text("a quick brown fox jumps over the lazy dog " * 5)
    r = CliRunner().invoke(
        app,
        [
            "mtp-probe",
            str(path),
            "--mtp",
            str(v),
            "--text",
            str(text),
            "--max-tokens",
            "40",
            "--mtp-chain",
            "independent",
            "--mtp-hidden",
            "pre",
            "--choose-threshold",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["draft_vocab"] == 64 and len(doc["verify_ms_by_rows"]) == 4
    var = doc["variants"][0]
    assert var["depth_histogram"] == [0, 0, 0, var["drafting_rounds"]] and var["drafting_rounds"] == 40 - 3 - 1
    assert [t["threshold"] for t in var["thresholds"]][0] == 0.0
    assert var["thresholds"][0]["tokens_per_step"] == pytest.approx(var["tokens_per_round"])
    r = CliRunner().invoke(
        app,
        [
            "mtp-probe",
            str(path),
            "--mtp",
            str(v),
            "--text",
            str(text),
            "--max-tokens",
            "40",
            "--mtp-chain",
            "independent",
            "--mtp-hidden",
            "pre",
            "--mtp-threshold",
            "0.999",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    var = json.loads(r.output)["variants"][0]
    assert var["depth_histogram"][0] == var["drafting_rounds"] and var["rounds"] == 0


def test_generate_json_reports_the_depth_histogram(tiny, tmp_path):
    path, side = tiny["mimo", "q8"]
    v = _with_vocab(side, tmp_path / "v.mtp.cmf", np.arange(64))
    r = CliRunner().invoke(
        app,
        [
            "generate",
            str(path),
            "hello there",
            "--mtp",
            str(v),
            "--max-tokens",
            "12",
            "--ignore-eos",
            "--mtp-vocab",
            "32",
            "--mtp-threshold",
            "0",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    m = json.loads(r.output)["mtp"]
    assert m["draft_vocab"] == 32 and m["threshold"] == 0.0
    # Rounds the measured decision turned plain still count as drafting rounds of depth 0.
    assert sum(m["depth_histogram"]) == m["drafting_rounds"] >= m["rounds"] and "mean_depth" in m


@pytest.mark.slow
def test_smollm2_exact_with_a_draft_vocabulary_and_adaptive_depth(smollm2_cmf, english_text, tmp_path):
    """A real model (49,152 ids, many near-ties), random draft layers with a vocabulary of
    4,096 ids chosen from English text: the sub-head's logits are the full head's at those
    ids, and speculative decoding with it, with and without a threshold, is plain greedy."""
    from cortiq_engine.draft_vocab import vocab_from_text
    from tests.mtp_tiny import write_random_sidecar

    path = smollm2_cmf("q8")
    side = write_random_sidecar(path, tmp_path / "rand.mtp.cmf", n_layers=3, quant="q8")
    eng = Engine.load(path, threads=1, mtp=side)
    ids, _ = vocab_from_text(eng.tokenizer, eng.vocab_size, eng.eos_ids, english_text, 4096)
    v = _with_vocab(side, tmp_path / "v.mtp.cmf", ids)
    eng = Engine.load(path, threads=1, mtp=v)
    head = eng.draft_head()
    assert head.size == 4096 and eng.drafts.vocab.tolist() == ids.tolist()
    x = eng.model.final_norm(np.random.default_rng(0).standard_normal((2, eng.model.hidden_size)).astype(np.float32))
    assert np.array_equal(head.logits(eng.kernels, x), eng.model.lm_head(x)[:, head.ids])
    words = english_text.split()
    for i in range(3):
        prompt = eng.tokenizer.encode(" ".join(words[400 * i : 400 * i + 40]))
        plain = eng.generate(prompt, SamplingConfig(), max_tokens=24, speculative=False)
        for th in (0.0, 0.01, 0.2):
            spec = eng.generate(prompt, max_tokens=24, speculative=SpeculativeConfig(threshold=th))
            _assert_same(plain, spec)
            assert spec.extra["mtp"]["draft_vocab"] == 4096


def test_i32_dtype_round_trips_and_refuses_floats(tmp_path):
    from formats.quants import get_dtype

    i32 = get_dtype("i32")
    assert not i32.matrix and i32.bits == 32.0
    a = np.array([0, -5, 2**31 - 1, 49151], dtype=np.int64)
    (part,) = i32.encode(a)
    assert part.dtype == np.dtype("<i4") and np.array_equal(i32.decode({"data": part}, a.shape), a)
    with pytest.raises(CortiqError, match="i32 holds integers"):
        i32.encode(np.zeros(3, np.float32))
    with pytest.raises(CortiqError, match="out of the 32-bit range"):
        i32.encode(np.array([2**31]))


def test_write_sidecar_stores_a_draft_vocabulary(tiny, tmp_path):
    """The trainer's writer (``mtp-train --draft-vocab``): the vocabulary and its record
    land in the sidecar, and the engine reads them back."""
    from cortiq_train.export import write_sidecar

    path, side = tiny["mimo", "f32"]
    with CmfFile(side) as s, CmfFile(path) as m:
        tensors = {n: s.tensor_f32(n) for n in s.names() if n.startswith("model.mtp.layers.")}
        main_header = m.header
    ids = np.array([7, 3, 250, 0, 42])
    out = write_sidecar(
        tmp_path / "t.mtp.cmf",
        main_header,
        path.name,
        tensors,
        quant="f32",
        hidden="pre",
        trained={"text": "test"},
        draft_vocab=(ids, draft_vocab_record(ids, "test", 99)),
    )
    eng = Engine.load(path, threads=1, mtp=out)
    assert eng.drafts.vocab.tolist() == ids.tolist() and eng.draft_head().size == 5
    with CmfFile(out) as f:
        assert f.header["mtp"]["draft_vocab"] == {
            "size": 5,
            "tensor": DRAFT_VOCAB_TENSOR,
            "order": "most useful first",
            "text": "test",
            "tokens": 99,
        }
    plain = eng.generate([1, 2, 3], max_tokens=8, speculative=False)
    _assert_same(plain, eng.generate([1, 2, 3], max_tokens=8, speculative=SpeculativeConfig(threshold=0)))


# ------------------------------------------------------------------ measured defaults (mtp.defaults)
def _defaults(rec):
    return lambda m: m.__setitem__("defaults", rec)


_BAD_DEFAULTS = [
    ("not an object", [1, 0.2], "expected an object"),
    ("depth zero", {"depth": 0, "threshold": 0.2}, "depth 0 is not between 1 and the 3 draft layer"),
    ("depth past the layers", {"depth": 4, "threshold": 0.2}, "depth 4 is not between 1 and the 3"),
    ("depth bool", {"depth": True, "threshold": 0.2}, "depth True is not between"),
    ("depth missing", {"threshold": 0.2}, "depth None is not between"),
    ("threshold one", {"depth": 1, "threshold": 1.0}, r"threshold 1.0 is not a number in \[0, 1\)"),
    ("threshold text", {"depth": 1, "threshold": "0.2"}, "threshold '0.2' is not a number"),
    ("threshold negative", {"depth": 1, "threshold": -0.1}, "threshold -0.1 is not a number"),
    (
        "with_lookup not an object",
        {"depth": 1, "threshold": 0.2, "with_lookup": [3]},
        "with_lookup is list, expected an object",
    ),
    (
        "with_lookup lookup zero",
        {"depth": 1, "threshold": 0.2, "with_lookup": {"lookup": 0, "ngram": [3, 5], "depth": 1, "threshold": 0}},
        r"with_lookup.lookup 0 is not an integer in 1..64",
    ),
    (
        "with_lookup lookup huge",
        {"depth": 1, "threshold": 0.2, "with_lookup": {"lookup": 10**12, "ngram": [3, 5], "depth": 1, "threshold": 0}},
        "with_lookup.lookup 1000000000000 is not",
    ),
    (
        "with_lookup ngram reversed",
        {"depth": 1, "threshold": 0.2, "with_lookup": {"lookup": 3, "ngram": [5, 3], "depth": 1, "threshold": 0}},
        r"with_lookup.ngram \[5, 3\] is not \[min, max\]",
    ),
    (
        "with_lookup ngram text",
        {"depth": 1, "threshold": 0.2, "with_lookup": {"lookup": 3, "ngram": "3:5", "depth": 1, "threshold": 0}},
        "with_lookup.ngram '3:5' is not",
    ),
    (
        "with_lookup depth past the layers",
        {"depth": 1, "threshold": 0.2, "with_lookup": {"lookup": 3, "ngram": [3, 5], "depth": 9, "threshold": 0}},
        "with_lookup.depth 9 is not between 1 and the 3",
    ),
    (
        "with_lookup threshold nan",
        {
            "depth": 1,
            "threshold": 0.2,
            "with_lookup": {"lookup": 3, "ngram": [3, 5], "depth": 1, "threshold": float("nan")},
        },
        "NaN is not a JSON number",
    ),  # refused by the header parser already
]


@pytest.mark.parametrize("label,rec,message", _BAD_DEFAULTS, ids=[b[0] for b in _BAD_DEFAULTS])
def test_hostile_measured_defaults_are_one_line(tiny, tmp_path, label, rec, message):
    path, side = tiny["mimo", "q8"]
    bad = _write(side, tmp_path / "bad.mtp.cmf", _defaults(rec))
    with pytest.raises(CortiqError, match=message) as e:
        Engine.load(path, threads=1, mtp=bad, warmup=False)
    assert "\n" not in str(e.value) and "bad.mtp.cmf" in str(e.value)


def test_measured_defaults_drive_generate_unless_told(tiny, tmp_path):
    """write_defaults records depth and threshold; an unset --mtp-depth / --mtp-threshold
    takes them, explicit values win, a chosen --mtp-vocab falls back to every layer and the
    engine's threshold; output stays plain greedy's; a new draft vocabulary drops them."""
    from cortiq_engine.mtp import DEFAULT_THRESHOLD
    from formats.sidecar import write_defaults

    path, side = tiny["mimo", "q8"]
    mine = tmp_path / "m.mtp.cmf"
    _with_vocab(side, mine, np.arange(40)[::-1])
    write_defaults(mine, {"depth": 2, "threshold": 0.05, "text": "test"})
    with CmfFile(mine) as f:
        assert f.header["mtp"]["defaults"] == {"depth": 2, "threshold": 0.05, "text": "test"}
        assert f.header["mtp"]["draft_vocab"]["size"] == 40  # the vocabulary stays
    eng = Engine.load(path, threads=1, mtp=mine)
    both, _ = eng.drafter(None)  # n-gram lookup first (3 drafts), then the MTP layers
    d = both.mtp
    assert (both.lookup, both.depth) == (3, 3)
    assert (d.depth, d.threshold, d.head.label) == (2, 0.05, 40)
    d = eng.drafter(SpeculativeConfig(depth=3))[0].mtp
    assert (d.depth, d.threshold) == (3, 0.05)
    d = eng.drafter(SpeculativeConfig(threshold=0.0, lookup=0))[0]
    assert (d.depth, d.threshold) == (2, 0.0)
    d = eng.drafter(SpeculativeConfig(vocab="full"))[0].mtp
    assert (d.depth, d.threshold) == (3, DEFAULT_THRESHOLD)
    plain = eng.generate([5, 6, 7], max_tokens=MAX_TOKENS, speculative=False)
    spec = eng.generate([5, 6, 7], max_tokens=MAX_TOKENS)
    _assert_same(plain, spec)
    assert spec.extra["mtp"]["mtp_depth"] == 2 and spec.extra["mtp"]["threshold"] == 0.05
    _with_vocab(mine, tmp_path / "v.mtp.cmf", np.arange(30))
    with CmfFile(tmp_path / "v.mtp.cmf") as f:
        assert "defaults" not in f.header["mtp"]  # measured with another vocabulary


def test_lookup_rounds_and_the_setting_measured_with_lookup():
    """lookup_rounds finds the rounds n-gram lookup drafts and what a verify accepts of
    them; with_lookup_setting walks the rounds as a live decode would, lookup rounds
    first, the MTP layers' trace under each setting otherwise."""
    from evals.mtp_probe import lookup_rounds, with_lookup_setting

    toks = np.array([5, 6, 7, 8, 5, 6, 7, 9, 1, 2])
    # Round t drafts after tokens[:t+2]; a 3-gram match exists when tokens[t-1..t+1] == [5, 6, 7].
    hit, n, acc = lookup_rounds(toks, list(range(8)), 3, (3, 3))
    assert hit.tolist() == [False] * 5 + [True, False, False]
    assert n[5] == 3 and acc[5] == 0  # drafts [8, 5, 6] against the text's 9
    hit, n, acc = lookup_rounds(toks, [5], 3, (3, 3), greedy=np.array([0, 0, 0, 0, 0, 0, 8, 5, 0, 0]))
    assert acc.tolist() == [1]  # greedy after ..7 is 8 (right); the text then says 9, not greedy: stop
    # Six rounds at t = 0..5 of one window, depth 1, every draft right at p 0.9: a live
    # decode walks t = 0, 2, 4 (2 tokens a round, 1 + 11 ms each): 6 ms a token.
    trace = ProbeTrace(np.full((6, 1), 0.9), np.ones((6, 1), bool))
    keys = [(0, t) for t in range(6)]
    verify, none = [10.0, 11.0, 13.0, 15.0], np.zeros(6, bool)
    rec = with_lookup_setting(trace, none, np.zeros(6, np.int64), np.zeros(6, np.int64), keys, 1.0, verify, 3, (3, 5))
    assert (rec["depth"], rec["rounds"], rec["lookup_rounds"]) == (1, 3, 0) and rec["threshold"] < 0.9
    assert rec["modelled_speedup"] == pytest.approx(10 / 6, abs=1e-4)
    # A lookup round at t = 2 (3 drafts, all accepted: 4 tokens for a 4-row verify of 15 ms):
    # the walk is t = 0 (12 ms, 2 tokens), t = 2 (15 ms, 4 tokens), then past the window.
    looked = np.arange(6) == 2
    rec = with_lookup_setting(trace, looked, np.full(6, 3), np.full(6, 3), keys, 1.0, verify, 3, (3, 5))
    assert (rec["rounds"], rec["lookup_rounds"], rec["tokens_per_round"]) == (2, 1, 3.0)
    assert rec["modelled_speedup"] == pytest.approx(10 / (27 / 6), abs=1e-4)
    # Drafts the layers get wrong: drafting nothing (threshold above 0.9) is fastest.
    wrong = ProbeTrace(np.full((6, 1), 0.5), np.zeros((6, 1), bool))
    assert (
        with_lookup_setting(wrong, none, np.zeros(6, np.int64), np.zeros(6, np.int64), keys, 1.0, verify, 3, (3, 5))[
            "threshold"
        ]
        > 0.5
    )


def test_best_setting_is_the_least_modelled_time_over_depths():
    """best_setting replays every depth's leading columns under every threshold: the
    brute-force minimum of threshold_table over depths."""
    from evals.mtp_probe import best_setting

    rng = np.random.default_rng(3)
    probs = rng.random((200, 3))
    right = rng.random((200, 3)) < np.array([0.7, 0.35, 0.1])
    trace = ProbeTrace(probs, right)
    verify = [10.0, 11.0, 14.0, 18.0]
    d, row = best_setting(trace, 0.8, verify)
    brute = min(
        (
            (k, r)
            for k in (1, 2, 3)
            for r in threshold_table(ProbeTrace(probs[:, :k], right[:, :k]), 0.8, verify[: k + 1])
        ),
        key=lambda kr: kr[1].ms_per_token,
    )
    assert (d, row) == brute
    # a cheap deep verify makes depth 3 worth it; an expensive one depth 1
    assert best_setting(ProbeTrace(np.ones((50, 3)), np.ones((50, 3), bool)), 0.1, [10, 10.5, 11, 11.5])[0] == 3
    assert (
        best_setting(
            ProbeTrace(np.ones((50, 3)), np.ones((50, 3), bool) & [True, False, False]), 0.1, [10, 11, 30, 40]
        )[0]
        == 1
    )


def test_probe_save_needs_choose_threshold(tiny, tmp_path):
    path, side = tiny["mimo", "q8"]
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 20)
    r = CliRunner().invoke(app, ["mtp-probe", str(path), "-f", str(text), "--save"])
    assert r.exit_code != 0 and "Traceback" not in r.output and "--choose-threshold" in r.output


def test_probe_save_records_defaults_in_the_sidecar(tiny, tmp_path):
    path, side = tiny["mimo", "q8"]
    mine = tmp_path / "p.mtp.cmf"
    _with_vocab(side, mine, np.arange(64))
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat and the dog sat on the log. " * 20)
    r = CliRunner().invoke(
        app,
        [
            "mtp-probe",
            str(path),
            "-f",
            str(text),
            "--mtp",
            str(mine),
            "--max-tokens",
            "64",
            "--choose-threshold",
            "--save",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    saved = json.loads(r.output)["saved"]
    with CmfFile(mine) as f:
        rec = f.header["mtp"]["defaults"]
    assert rec["depth"] == saved["depth"] and rec["threshold"] == saved["threshold"] and 1 <= rec["depth"] <= 3
    eng = Engine.load(path, threads=1, mtp=mine, warmup=False)
    d = eng.drafter(None)[0].mtp  # lookup drafts first by default: the with_lookup setting
    wl = rec["with_lookup"]
    assert (wl["lookup"], wl["ngram"], d.depth, d.threshold) == (3, [3, 5], wl["depth"], wl["threshold"])
    assert len(rec["verify_ms_by_rows"]) == 4
    d = eng.drafter(SpeculativeConfig(lookup=0))[0]
    assert (d.depth, d.threshold) == (rec["depth"], rec["threshold"])
    shown = CliRunner().invoke(
        app,
        [
            "mtp-probe",
            str(path),
            "-f",
            str(text),
            "--mtp",
            str(mine),
            "--max-tokens",
            "64",
            "--choose-threshold",
            "--save",
        ],
    )
    assert shown.exit_code == 0 and "with n-gram lookup drafting first (--lookup 3, the default)" in shown.output
