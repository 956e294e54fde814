"""``cortiq convert FILE.gguf``: through ``formats.gguf_import`` into a temporary folder."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from formats.cmf import CmfFile
from cortiq_engine.convert import convert_checkpoint
from tests.tiny import build_tiny

runner = CliRunner()


def test_tiny_gguf_converts_to_the_original_weights(tmp_path):
    from tests.test_gguf_import import TINY, write_tiny_gguf

    model = build_tiny("llama", **TINY)
    src = write_tiny_gguf(model, tmp_path / "tiny.gguf", "llama")
    out = tmp_path / "out"
    out.mkdir()
    r = runner.invoke(app, ["convert", str(src), str(out / "m.cmf"), "--quant", "f32", "--json"])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["source"] == str(src.resolve())
    assert os.listdir(out) == ["m.cmf"]  # the temporary checkpoint folder is gone
    with CmfFile(out / "m.cmf") as f:
        assert f.header["source"]["format"] == "gguf" and f.header["source"]["path"] == str(src.resolve())
        assert f.header["tokenizer"]["chat_template"].startswith("{% for m in messages %}")
        for name, t in model.state_dict().items():
            assert np.array_equal(f.tensor_f32(name), t.numpy()), name  # Q/K un-permuted back to HF order


@pytest.mark.slow
def test_smollm2_gguf_equals_import_then_convert(smollm2_gguf, smollm2_hf, tmp_path):
    a = convert_checkpoint(smollm2_gguf, tmp_path / "direct.cmf", quant="q8")
    b = convert_checkpoint(smollm2_hf, tmp_path / "two-step.cmf", quant="q8")
    with CmfFile(a.output) as fa, CmfFile(b.output) as fb:
        assert {n: t.crc32 for n, t in fa.tensors.items()} == {n: t.crc32 for n, t in fb.tensors.items()}
        assert fa.header["source"]["fingerprint"] == fb.header["source"]["fingerprint"]
        assert fa.header["arch"]["tie_word_embeddings"] is True and "lm_head.weight" not in fa.tensors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["direct.cmf", "two-step.cmf"]
    assert a.by_dtype["q8"].rms_rel_error < 0.0055
