"""``cortiq mtp-train`` on a tiny random llama: the backbone features against
transformers, the loss going down, the sidecar the engine loads, resume, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from typer.testing import CliRunner  # noqa: E402

from cortiq_cli.main import app  # noqa: E402
from cortiq_engine.acceptance import Acceptance  # noqa: E402
from cortiq_train.backbone import open_backbone  # noqa: E402
from cortiq_train.config import TrainConfig  # noqa: E402
from cortiq_train.features import EngineRunner, collect  # noqa: E402
from cortiq_train.run import Callbacks, train_mtp  # noqa: E402
from formats.cmf import CmfFile, CmfWriter  # noqa: E402
from cortiq_engine.convert import convert_checkpoint  # noqa: E402
from formats.errors import CortiqError  # noqa: E402
from formats.sidecar import check_sidecar  # noqa: E402
from formats.tokenizer_header import TOKENIZER_TENSOR  # noqa: E402
from tests.tiny import save_tiny  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TEXT = (REPO / "evals" / "data" / "alice.txt").read_text(encoding="utf-8")[:3000]  # byte tokens: 3000 tokens


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("mtp_train")
    hf = save_tiny("llama", root / "hf")
    cmf = root / "tiny.cmf"
    convert_checkpoint(hf, cmf, quant="f32")
    return hf, cmf


@pytest.fixture(autouse=True)
def numpy_kernels(monkeypatch):
    # The reference kernels: no JIT compile in a short test on a shared machine.
    monkeypatch.setenv("CORTIQ_KERNELS", "numpy")


def small_cfg(**kw) -> TrainConfig:
    base = dict(
        layers=2,
        steps=30,
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
    base.update(kw)
    return TrainConfig(**base)


def test_features_match_transformers(tiny):
    """Pre-norm hidden rows and teacher log-probs of both collectors equal transformers'."""
    import torch

    from cortiq_train.draft_torch import TorchBackbone
    from tests.tiny import build_tiny

    _, cmf = tiny
    bb = open_backbone(cmf, "numpy")
    ids = bb.tokenizer.encode(TEXT[:200])
    hf = build_tiny("llama")
    seen = {}
    hf.model.norm.register_forward_hook(lambda m, inp, out: seen.__setitem__("h", inp[0]))
    with torch.no_grad():
        logits = hf(torch.tensor([ids[:64]])).logits[0].double()
    ref_h = seen["h"][0].numpy()
    ref_lp = torch.log_softmax(logits, -1).numpy()
    for runner in (EngineRunner(bb), TorchBackbone(bb, 64)):
        f = collect(runner, ids[:128], seq=64, topk=5, hidden="pre", holdout=0.5, min_len=4)
        assert list(f.train) == [0] and list(f.held) == [1]
        rel = np.abs(f.hidden[0] - ref_h).max() / np.abs(ref_h).max()
        assert rel < 1e-5
        assert (f.greedy[0] == ref_lp.argmax(-1)).all()
        np.testing.assert_allclose(
            f.top_logp[0], np.take_along_axis(ref_lp, f.top_idx[0].astype(np.int64), -1), atol=1e-4
        )


def test_acceptance_by_hand():
    greedy = np.array([[5, 1, 2, 3, 4, 9]])
    d1 = np.array([[2, 9, 3, 0, 9, -1]])
    d2 = np.array([[3, 4, 0, 9, -1, -1]])
    acc = Acceptance.from_arrays([d1, d2], greedy)
    # depth 1: rows 0..4 compare d1[j] with greedy[j+1] = 1,2,3,4,9 -> hits at j=2 (3), j=4 (9)
    assert acc.alone[0] == pytest.approx(2 / 5) and acc.checked[0] == 5
    # depth 2: rows 0..3 compare d2[j] with greedy[j+2] = 2,3,4,9 -> hits at j=3
    assert acc.alone[1] == pytest.approx(1 / 4)
    # chained over rows 0..3: depth 1 hits {2}; both: none
    assert acc.chained == pytest.approx([1 / 4, 0.0])
    assert acc.tokens_per_round == pytest.approx(1.25)


def test_training_lowers_the_loss_and_the_sidecar_loads(tiny, tmp_path):
    from cortiq_train.engine_drafts import engine_drafts, layer_hidden, load_draft_layers

    _, cmf = tiny
    out = tmp_path / "tiny.mtp.cmf"
    cfg = small_cfg(steps=40)
    r = train_mtp(cmf, TEXT, "alice", cfg, out=out, kernels="numpy")
    first, last = np.mean(r.losses[:5]), np.mean(r.losses[-5:])
    assert last < first - 0.05, (first, last)
    # The written file is a sidecar of this backbone, as the engine checks it.
    main, side = CmfFile(cmf), CmfFile(out)
    check_sidecar(main.header, side.header)
    assert side.header["mtp"]["num_layers"] == 2 and side.header["arch"]["mtp"]["style"] == "mimo"
    assert sorted(n for n in side.names() if n.startswith("model.mtp.layers.1.")) == sorted(
        n.replace(".0.", ".1.", 1) for n in side.names() if n.startswith("model.mtp.layers.0.")
    )
    # The engine's layers on the f32 sidecar draft what torch drafted (held-out windows).
    assert r.held_engine is not None and r.held_torch is not None
    assert r.held_engine.alone == pytest.approx(r.held_torch.alone, abs=0.01)
    assert r.held_engine.tokens_per_round >= 1.0
    # And the engine's rows equal a torch layer loaded with the sidecar's own tensors.
    import torch

    from cortiq_train.draft_torch import TorchBackbone, build_stack

    bb = open_backbone(cmf, "numpy")
    layers = load_draft_layers(out, bb)
    ids = np.array(bb.tokenizer.encode(TEXT[:40]))
    hid = TorchBackbone(bb, 40).hidden(ids)
    k = 1
    n = len(ids) - k - 1
    emb = bb.embed_f32(ids[k + 1 :])
    got = layer_hidden(bb, layers[k], emb, hid[:n])
    stack = build_stack(bb, 2, None, -1, 1.0, 64, 0)
    with torch.no_grad():
        for name, p in stack.layers[k].named_arrays().items():
            p.copy_(torch.tensor(side.tensor_f32(f"model.mtp.layers.{k}.{name}")))
        want = stack.layer_out(k, torch.tensor(emb)[None], torch.tensor(hid[:n])[None])[0].numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    drafts = engine_drafts(bb, layers, ids[None, :32], hid[None, :32])
    assert drafts[0].shape == (1, 32) and (drafts[0][0, :30] >= 0).all()


def test_resume_continues_at_the_saved_step(tiny, tmp_path):
    _, cmf = tiny
    cfg = small_cfg(steps=6, checkpoint_every=3, holdout=0.0)
    full = train_mtp(cmf, TEXT, "alice", cfg, out=tmp_path / "a.mtp.cmf", kernels="numpy", work=tmp_path / "wa")
    assert not (tmp_path / "wa").exists()  # a finished run keeps only its sidecar

    class Stop(Exception):
        pass

    def interrupt(step, total, loss, agree):
        if step == 5:  # after the checkpoint of step 3, before the one of step 6
            raise Stop

    with pytest.raises(Stop):
        train_mtp(
            cmf,
            TEXT,
            "alice",
            cfg,
            out=tmp_path / "b.mtp.cmf",
            kernels="numpy",
            work=tmp_path / "wb",
            callbacks=Callbacks(step=interrupt),
        )
    # A stopped run leaves its checkpoint and rows in the work folder, nothing beside the model.
    assert not (tmp_path / "b.mtp.cmf").exists() and (tmp_path / "wb" / "train.safetensors").is_file()
    assert (tmp_path / "wb" / "features" / "meta.json").is_file()
    resumed = train_mtp(
        cmf, TEXT, "alice", cfg, out=tmp_path / "b.mtp.cmf", kernels="numpy", work=tmp_path / "wb", resume=True
    )
    assert resumed.start_step == 3 and resumed.steps == 6
    assert resumed.losses == pytest.approx(full.losses, rel=1e-6)
    assert not (tmp_path / "wb").exists() and resumed.checkpoint is None
    a, b = CmfFile(tmp_path / "a.mtp.cmf"), CmfFile(tmp_path / "b.mtp.cmf")
    assert a.names() == b.names()
    for name in a.names():
        np.testing.assert_allclose(a.tensor_f32(name), b.tensor_f32(name), rtol=1e-6, atol=1e-7)
    # A resume with other settings is refused, naming them.
    kept = train_mtp(
        cmf, TEXT, "alice", cfg, out=tmp_path / "c.mtp.cmf", kernels="numpy", work=tmp_path / "wc", keep_checkpoint=True
    )
    assert kept.checkpoint == tmp_path / "wc" / "train.safetensors" and kept.checkpoint.is_file()
    with pytest.raises(CortiqError, match="layers"):
        train_mtp(
            cmf,
            TEXT,
            "alice",
            small_cfg(steps=6, checkpoint_every=3, holdout=0.0, layers=1),
            out=tmp_path / "c.mtp.cmf",
            kernels="numpy",
            work=tmp_path / "wc",
            resume=True,
        )


def run_cli(*args: str, cache: Path | None = None):
    """The command in-process; ``cache``: its $XDG_CACHE_HOME (where a run's work folder goes)."""
    res = CliRunner().invoke(app, ["mtp-train", *args], env={"XDG_CACHE_HOME": str(cache)} if cache else None)
    return res.exit_code, res.output


def test_cli_trains_and_reports_json(tiny, tmp_path):
    _, cmf = tiny
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "x.mtp.cmf"
    cache = tmp_path / "cache"
    code, output = run_cli(
        str(cmf),
        "--text",
        str(text),
        "--layers",
        "2",
        "--steps",
        "4",
        "--seq",
        "32",
        "--max-tokens",
        "800",
        "--checkpoint-every",
        "2",
        "--out",
        str(out),
        "--json",
        cache=cache,
    )
    assert code == 0, output
    doc = json.loads(output)
    assert doc["steps"] == 4 and len(doc["losses"]) == 4 and doc["sidecar"] == str(out)
    assert len(doc["held_out"]["acceptance_alone"]) == 2 and doc["held_out"]["tokens_per_round"] >= 1.0
    # The engine runs the backbone by default; only the sidecar is written, the work folder is gone.
    assert doc["backbone"] == "engine" and doc["checkpoint"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "t.txt", "x.mtp.cmf"]
    assert [p for p in cache.rglob("*") if not p.is_dir()] == []
    # Real text, not the backbone's own: too few live rounds to measure generate's defaults on.
    assert doc["defaults"]["saved"] is None and "--self-distill" in doc["defaults"]["reason"]
    # Without --force the sidecar is not overwritten.
    code, output = run_cli(str(cmf), "--text", str(text), "--steps", "1", "--seq", "32", "--out", str(out))
    assert code == 2 and "exists" in output


def test_cli_bad_input(tiny, tmp_path):
    _, cmf = tiny
    short = tmp_path / "short.txt"
    short.write_text("hello there")
    cases = [
        ((str(cmf), "--layers", "0"), "--layers must be at least 1"),
        ((str(cmf), "--text", str(short), "--seq", "32"), "too little text"),
        ((str(cmf), "--holdout", "1.5"), "--holdout"),
        ((str(tmp_path / "nope.cmf"),), "no such file"),
        ((str(cmf), "--text", str(short), "--resume", "--out", str(tmp_path / "r.mtp.cmf")), "no checkpoint"),
        ((str(cmf), "--mtp-hidden", "middle"), "--mtp-hidden"),
    ]
    # A model without a tokenizer: the tiny file's tensors minus the tokenizer.
    src = CmfFile(cmf)
    bare = tmp_path / "bare.cmf"
    with CmfWriter(bare, src.header) as w:
        for name in src.names():
            if name != TOKENIZER_TENSOR:
                w.add(name, "f32", src.tensor_f32(name))
    cases.append(((str(bare),), "no tokenizer"))
    for args, msg in cases:
        code, output = run_cli(*args)
        assert code == 2, (args, output)
        assert msg in output and "Traceback" not in output, (args, output)
        assert output.strip().startswith("error:"), output


def test_engine_drafter_loads_the_sidecar_and_drafts_the_same(tiny, tmp_path):
    """The speculative decoder's own loader and draft path (cortiq_engine.mtp) read the
    trained sidecar beside the backbone and draft what the trainer's evaluation drafts."""
    from cortiq_engine import mtp
    from cortiq_train.draft_torch import TorchBackbone
    from cortiq_train.engine_drafts import engine_drafts, load_draft_layers

    _, cmf = tiny
    local = tmp_path / "m.cmf"
    local.write_bytes(cmf.read_bytes())
    r = train_mtp(local, TEXT, "alice", small_cfg(steps=5, layers=3, holdout=0.0), kernels="numpy")
    assert r.sidecar == tmp_path / "m.mtp.cmf"
    bb = open_backbone(local, "numpy")
    stack = mtp.load_draft_stack(bb.cmf, bb.arch, bb.model.kernels)
    assert stack is not None and stack.num_layers == 3 and stack.style == "mimo"
    ids = np.array(bb.tokenizer.encode(TEXT[100:148]))
    t_len = len(ids)
    hid = TorchBackbone(bb, t_len).hidden(ids)
    mine = engine_drafts(bb, load_draft_layers(r.sidecar, bb), ids[None], hid[None])
    drafter = mtp.make_drafter(bb.model, stack, t_len)
    assert drafter.chain == "independent"
    drafter.note(0, hid)
    for t in range(t_len - 3 - 1):
        got = drafter.draft(t, list(ids))
        assert got == [int(mine[k][0, t]) for k in range(3)], t


@pytest.mark.slow
def test_smollm2_drafts_learn(smollm2_cmf, english_text, tmp_path):
    """Real backbone: a few steps on real English lower the distillation loss, and the
    held-out depth-1 acceptance beats the untrained layers' (measured the same way)."""
    model = smollm2_cmf("q8")
    cfg = TrainConfig(
        layers=1, steps=12, seq=128, batch=1, lr=1e-3, warmup=2, holdout=0.25, max_tokens=1024, checkpoint_every=0
    )
    untrained = train_mtp(
        model, english_text, "english", TrainConfig(**{**cfg.to_json(), "steps": 0}), out=tmp_path / "u.mtp.cmf"
    )
    trained = train_mtp(model, english_text, "english", cfg, out=tmp_path / "t.mtp.cmf")
    assert np.mean(trained.losses[-3:]) < np.mean(trained.losses[:3])
    assert trained.held_engine.alone[0] > untrained.held_engine.alone[0]


def test_intermediate_width(tiny, tmp_path):
    """--intermediate: a wider draft MLP starts as the backbone's (new units feed zeros to
    down_proj), so untrained drafts are the same; a narrower one keeps the first units."""
    from cortiq_train.engine_drafts import load_draft_layers

    _, cmf = tiny
    runs = {}
    for width in (None, 192, 64):
        out = tmp_path / f"w{width}.mtp.cmf"
        runs[width] = train_mtp(cmf, TEXT, "alice", small_cfg(steps=0, intermediate=width), out=out, kernels="numpy")
        side = CmfFile(out)
        assert side.info("model.mtp.layers.0.mlp.gate_proj.weight").shape == (width or 128, 64)
        assert side.header["mtp"]["ffn_intermediate_sizes"] == [width or 128] * 2
        assert len(load_draft_layers(out, open_backbone(cmf, "numpy"))) == 2
    assert runs[192].held_engine.alone == runs[None].held_engine.alone
    assert runs[192].held_engine.chained == runs[None].held_engine.chained


def test_cli_keep_checkpoint_then_resume(tiny, tmp_path):
    """--keep-checkpoint keeps the work folder (in the cache, keyed by OUT); --resume with
    more --steps continues from it at the saved step, then removes it."""
    from cortiq_train.run import work_dir

    _, cmf = tiny
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out, cache = tmp_path / "k.mtp.cmf", tmp_path / "cache"
    common = (
        str(cmf),
        "--text",
        str(text),
        "--seq",
        "32",
        "--max-tokens",
        "800",
        "--checkpoint-every",
        "1",
        "--out",
        str(out),
        "--no-defaults",
        "--json",
    )
    code, output = run_cli(*common, "--steps", "2", "--keep-checkpoint", cache=cache)
    assert code == 0, output
    work = work_dir(out, {"XDG_CACHE_HOME": str(cache)})
    assert (
        json.loads(output)["checkpoint"] == str(work / "train.safetensors") and (work / "train.safetensors").is_file()
    )
    code, output = run_cli(*common, "--steps", "4", "--resume", cache=cache)
    assert code == 0, output
    doc = json.loads(output)
    assert doc["start_step"] == 2 and doc["steps"] == 4 and len(doc["losses"]) == 4
    assert not work.exists() and out.is_file()


def test_cli_threads_set_the_engine_and_torch_pools(tiny, tmp_path):
    import numba
    import torch

    from cortiq_engine.threads import max_threads

    _, cmf = tiny
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    n = min(2, max_threads())  # tiny matrices alone would put torch on one thread
    code, output = run_cli(
        str(cmf),
        "--text",
        str(text),
        "--steps",
        "1",
        "--seq",
        "32",
        "--max-tokens",
        "400",
        "--out",
        str(tmp_path / "t.mtp.cmf"),
        "--threads",
        str(n),
        "--no-defaults",
        "--json",
        cache=tmp_path / "cache",
    )
    assert code == 0, output
    assert json.loads(output)["threads"] == n
    assert numba.get_num_threads() == n and torch.get_num_threads() == n
    code, output = run_cli(
        str(cmf),
        "--text",
        str(text),
        "--threads",
        "999",
        "--out",
        str(tmp_path / "u.mtp.cmf"),
        cache=tmp_path / "cache",
    )
    assert code == 2 and output.strip().startswith("error: --threads 999") and len(output.strip().splitlines()) == 1


def _rewrite(path: Path, edit) -> None:
    """The checkpoint at ``path`` rewritten through ``edit(tensors, metadata)``."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(str(path), "np") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    body = json.loads(meta["cortiq_mtp_train"])
    edit(tensors, body)
    meta["cortiq_mtp_train"] = json.dumps(body)
    save_file(tensors, str(path), metadata=meta)


def test_resume_checks_the_checkpoint_before_collecting(tiny, tmp_path):
    """A checkpoint whose names, shapes, dtypes or step counts do not fit the run is one
    line, before any backbone row is collected."""
    import shutil

    _, cmf = tiny
    cfg = small_cfg(steps=2, checkpoint_every=1, holdout=0.0)
    good = train_mtp(
        cmf, TEXT, "alice", cfg, out=tmp_path / "g.mtp.cmf", kernels="numpy", work=tmp_path / "g", keep_checkpoint=True
    ).checkpoint
    name = "model.layers.0.eh_proj.weight"

    def bad_shape(t, m):
        t[name] = t[name][:, :-1].copy()

    def bad_dtype(t, m):
        t[name] = t[name].astype(np.float16)

    def missing(t, m):
        del t[name]

    def extra(t, m):
        t["model.layers.9.eh_proj.weight"] = t[name]

    def losses(t, m):
        m["losses"] = m["losses"][:1]

    def counter(t, m):
        t["optim.0.step"] = np.array(7.0, np.float32)

    def past_steps(t, m):
        m["step"], m["losses"] = 5, m["losses"] * 3
        for k in t:
            if k.endswith(".step"):
                t[k] = np.array(5.0, np.float32)

    cases = [
        (bad_shape, r"eh_proj.weight is \[\d+, \d+\] in the checkpoint, \[\d+, \d+\] here"),
        (bad_dtype, "eh_proj.weight is F16 in the checkpoint, F32 here"),
        (missing, "eh_proj.weight is missing"),
        (extra, "layers.9.eh_proj.weight is not a tensor of these draft layers"),
        (losses, "at step 2 but holds 1 losses"),
        (counter, "optim.0.step is 7, the checkpoint's step 2"),
        (past_steps, "at step 5, past --steps 2"),
    ]
    for i, (edit, msg) in enumerate(cases):
        work = tmp_path / f"w{i}"
        work.mkdir()
        shutil.copy(good, work / "train.safetensors")
        _rewrite(work / "train.safetensors", edit)
        phases: list[str] = []
        with pytest.raises(CortiqError, match=msg) as e:
            train_mtp(
                cmf,
                TEXT,
                "alice",
                cfg,
                out=tmp_path / f"r{i}.mtp.cmf",
                kernels="numpy",
                work=work,
                resume=True,
                callbacks=Callbacks(phase=phases.append),
            )
        assert "\n" not in str(e.value) and phases == [] and not (work / "features").exists(), edit.__name__
    # The untouched checkpoint resumes.
    r = train_mtp(
        cmf,
        TEXT,
        "alice",
        small_cfg(steps=3, checkpoint_every=1, holdout=0.0),
        out=tmp_path / "g.mtp.cmf",
        kernels="numpy",
        work=tmp_path / "g",
        resume=True,
    )
    assert r.start_step == 2 and r.steps == 3
