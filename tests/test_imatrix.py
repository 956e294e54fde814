"""``cortiq imatrix`` and ``cortiq convert --imatrix`` on a tiny llama: transformers'
activations are the oracle for the collected energies."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cortiq_cli.main import app
from evals.text_source import BUNDLED_TEXT
from formats.cmf import CmfFile
from formats.errors import CortiqError
from formats.imatrix import TOKENS_KEY, read_imatrix, write_imatrix
from tests.tiny import build_tiny, save_tiny

runner = CliRunner()
DIMS = dict(hidden_size=256, intermediate_size=512, max_position_embeddings=512)  # rows of 256: K-quants fit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from cortiq_engine.convert import convert_checkpoint

    d = tmp_path_factory.mktemp("imatrix")
    hf = save_tiny("llama", d / "hf", **DIMS)
    f32 = d / "tiny-f32.cmf"
    convert_checkpoint(hf, f32, quant="f32")
    return d, hf, f32


def _torch_energy(windows: list[list[int]]) -> dict[str, np.ndarray]:
    """Mean squared input of each Linear over the given token windows, from forward hooks."""
    model = build_tiny("llama", **DIMS)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name):
        def f(_mod, inp):
            x = inp[0].reshape(-1, inp[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + (x * x).sum(0)
            counts[name] = counts.get(name, 0) + x.shape[0]

        return f

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_pre_hook(hook(name + ".weight"))
    with torch.no_grad():
        for w in windows:
            model(torch.tensor([w]))
    return {k: (v / counts[k]).numpy() for k, v in sums.items()}


def test_imatrix_collects_transformers_activation_energy(tiny, tmp_path):
    d, hf, f32 = tiny
    text = tmp_path / "t.txt"
    text.write_text(BUNDLED_TEXT.read_text(encoding="utf-8")[:4000], encoding="utf-8")
    out = tmp_path / "im.safetensors"
    # the default plan: llama.cpp's chunks (BOS over each chunk's first token when the model uses one, as llama-imatrix)
    r = runner.invoke(
        app, ["imatrix", str(f32), "--text", str(text), "--chunks", "2", "--ctx", "128", "-o", str(out), "--json"]
    )
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["tokens"] == 256
    im = read_imatrix(out)
    from cortiq_engine import Engine
    from evals.tokens import chunk_bos

    with Engine.load(f32, warmup=False) as eng:
        ids = eng.tokenizer.encode(text.read_text(encoding="utf-8"), add_bos=True)
        bos = chunk_bos(eng.tokenizer)
    want = _torch_energy([([ids[s]] if bos is None else [bos]) + ids[s + 1 : s + 128] for s in (0, 128)])
    assert set(want) <= set(im.means)  # every Linear (lm_head included)
    for k, v in want.items():
        np.testing.assert_allclose(im.means[k], v, rtol=2e-4, atol=1e-7)
    # refuses to overwrite; -f is --text, as in every text command (it was --force's too)
    r = runner.invoke(app, ["imatrix", str(f32), "-f", str(text), "-o", str(out)])
    assert r.exit_code != 0 and "exists" in r.output
    # --mode sliding with --stride ctx: disjoint windows over the first 300 tokens (299 scored)
    r = runner.invoke(
        app,
        [
            "imatrix",
            str(f32),
            "-f",
            str(text),
            "--mode",
            "sliding",
            "--stride",
            "128",
            "--max-tokens",
            "299",
            "--ctx",
            "128",
            "-o",
            str(out),
            "--force",
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["tokens"] == 300
    sliding = read_imatrix(out)
    for k, v in _torch_energy([ids[s : min(s + 128, 300)] for s in range(0, 300, 128)]).items():
        np.testing.assert_allclose(sliding.means[k], v, rtol=2e-4, atol=1e-7)


def test_convert_with_imatrix_weights_the_error(tiny, tmp_path):
    """With a skewed imatrix the K-quant encoders trade error on unimportant columns
    for error on important ones: the importance-weighted error of every matrix falls."""
    from cortiq_engine.convert import convert_checkpoint

    d, hf, f32 = tiny
    src = CmfFile(f32)
    rng = np.random.default_rng(0)
    names = [n for n in src.names() if n.endswith("proj.weight")]
    means = {n: (rng.random(src.info(n).shape[1]) ** 6 * 50).astype(np.float32) for n in names}
    im_path = tmp_path / "skew.safetensors"
    write_imatrix(im_path, means, 1000)
    plain, weighted = tmp_path / "plain.cmf", tmp_path / "weighted.cmf"
    convert_checkpoint(hf, plain, quant="q4k")
    convert_checkpoint(hf, weighted, quant="q4k", imatrix=im_path)
    a, b = CmfFile(plain), CmfFile(weighted)
    for n in names:
        x = src.tensor_f32(n).astype(np.float64)
        cost = lambda f: float((((f.tensor_f32(n) - x) ** 2) * means[n]).sum())  # noqa: E731
        assert cost(b) < cost(a), n
    # a matrix of another width is a one-line error
    write_imatrix(im_path, {names[0]: np.ones(7, np.float32)}, 1)
    with pytest.raises(CortiqError, match="has 7 columns"):
        convert_checkpoint(hf, tmp_path / "bad.cmf", quant="q4k", imatrix=im_path)


def test_imatrix_file_is_validated(tmp_path):
    from formats.safetensors_writer import SafetensorsStream

    p = tmp_path / "bad.safetensors"
    st = SafetensorsStream(p, [("w", "F32", (3,), 4), (TOKENS_KEY, "I64", (1,), 8)])
    st.write("w", np.array([1.0, -2.0, 0.5], np.float32))
    st.write(TOKENS_KEY, np.array([5], np.int64))
    st.close()
    with pytest.raises(CortiqError, match="negative or non-finite"):
        read_imatrix(p)
    st = SafetensorsStream(p, [("w", "F32", (3,), 4)])
    st.write("w", np.ones(3, np.float32))
    st.close()
    with pytest.raises(CortiqError, match="not a cortiq imatrix"):
        read_imatrix(p)
    with pytest.raises(CortiqError, match="no such imatrix"):
        read_imatrix(tmp_path / "missing.safetensors")
