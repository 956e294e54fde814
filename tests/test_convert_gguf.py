"""``cortiq convert FILE.gguf``: tensor by tensor from the GGUF's map, no temporary folder.

The oracle for the streamed route is the route it replaced: ``import_gguf`` into an f32
HF folder, then the same converter over that folder (with the GGUF's blocks for the
block copies). Both must give the same CMF file, byte for byte."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from formats.cmf import CmfFile
from cortiq_engine.convert import convert_checkpoint
from cortiq_engine.models import FAMILIES
from formats.convert import KEEP, KEEP_FALLBACK, QuantPolicy, SliceEncoder, _convert, _Run
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
    assert os.listdir(out) == ["m.cmf"]  # nothing staged beside it
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


REPO = Path(__file__).resolve().parent.parent
# A tiny llama GGUF whose matrices are stored in every block type gguf-py writes: the
# llama q/k rows are permuted (row gathers), Q8_0/Q4_1 are block-copied to q8/q4.
TINY_QTYPES = {
    "model.embed_tokens.weight": "Q4_1",
    "lm_head.weight": "Q8_0",
    "model.layers.0.self_attn.q_proj.weight": "Q8_0",
    "model.layers.0.self_attn.k_proj.weight": "Q4_1",
    "model.layers.0.self_attn.v_proj.weight": "Q5_0",
    "model.layers.0.self_attn.o_proj.weight": "Q4_0",
    "model.layers.0.mlp.gate_proj.weight": "Q5_1",
    "model.layers.0.mlp.up_proj.weight": "F16",
    "model.layers.1.self_attn.q_proj.weight": "Q4_1",
    "model.layers.1.self_attn.k_proj.weight": "Q8_0",
    "model.layers.1.mlp.down_proj.weight": "Q8_0",
}


def convert_through_hf_folder(src: Path, out: Path, folder: Path, quant: str) -> Path:
    """The route the streamed conversion replaced: GGUF -> f32 HF folder -> CMF."""
    from formats.checkpoint import open_checkpoint
    from cortiq_engine.convert import import_gguf, read_gguf
    from formats.gguf_import import source_blocks

    import_gguf(src, folder)
    ck = open_checkpoint(folder)
    ck.origin = str(src)
    policy = QuantPolicy(KEEP_FALLBACK if quant == KEEP else quant, [])
    try:
        with SliceEncoder(1) as encoder:
            run = _Run(policy, "sidecar", False, None, quant == KEEP, False)
            _convert(ck, out, FAMILIES, run, encoder, source_format="gguf", blocks=source_blocks(read_gguf(src)))
    finally:
        ck.close()
    return out


@pytest.fixture(scope="module")
def tiny_quantized_gguf(tmp_path_factory) -> Path:
    from tests.test_gguf_import import TINY, write_tiny_gguf

    model = build_tiny("llama", **dict(TINY, tie_word_embeddings=False))
    return write_tiny_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny-q.gguf", "llama", qtypes=TINY_QTYPES)


@pytest.mark.parametrize("quant", ["q8", "q4", KEEP, "f32", "bf16"])
def test_streamed_gguf_equals_the_hf_folder_route_byte_for_byte(tiny_quantized_gguf, tmp_path, quant):
    src = tiny_quantized_gguf
    direct = tmp_path / "out" / "direct.cmf"
    direct.parent.mkdir()
    seen: list[list[str]] = []
    rep = convert_checkpoint(
        src, direct, quant=quant, progress=lambda *_: seen.append(sorted(os.listdir(direct.parent)))
    )
    # While it ran, the only thing beside the output was the writer's own staging file.
    assert seen and all(
        len(names) == 1 and names[0].startswith(".direct.cmf.") and names[0].endswith(".tmp") for names in seen
    ), seen[:3]
    assert not any((direct.parent / n).is_dir() for names in seen for n in names if (direct.parent / n).exists())
    assert os.listdir(direct.parent) == ["direct.cmf"]
    old = convert_through_hf_folder(src, tmp_path / "old.cmf", tmp_path / "hf", quant)
    assert direct.read_bytes() == old.read_bytes()
    # Blocks are copied exactly where the chosen dtype has the source's layout.
    chosen = {t.name: t.dtype for t in rep.tensors}
    from formats.quants import DTYPES

    layout = {dt.ggml_type: name for name, dt in DTYPES.items() if dt.ggml_type}  # q8, q4, q5, q6k, q5k, q4k
    assert sorted(rep.block_copied) == sorted(n for n, t in TINY_QTYPES.items() if layout.get(t) == chosen[n])
    assert rep.block_copied or quant in ("f32", "bf16")


def test_gguf_checkpoint_reads_the_import_values(tiny_quantized_gguf):
    """Row slices of any size, samples and whole tensors: the dequantized, de-permuted
    values ``import_gguf`` writes (``dequantized``), element for element."""
    from cortiq_engine.convert import read_gguf
    from formats.gguf_import import GgufCheckpoint, dequantized

    model = read_gguf(tiny_quantized_gguf)
    ck = GgufCheckpoint(model)
    for p in model.tensors:
        want = dequantized(model, p)
        assert ck.shape(p.name) == want.shape and ck.source_dtype(p.name) == "F32"
        assert np.array_equal(ck.tensor(p.name), want), p.name
        for max_elems in (1, 100, 1 << 20):
            got = np.concatenate(list(ck.iter_f32_rows(p.name, max_elems)))
            assert np.array_equal(got.reshape(want.shape), want), (p.name, max_elems)
        flat = want.reshape(-1)
        idx = np.linspace(0, flat.size - 1, num=min(64, flat.size)).astype(np.int64)
        assert np.array_equal(ck.sample_f32(p.name), flat[idx]), p.name


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["q4", KEEP])
def test_gemma3_streamed_equals_the_hf_folder_route(gemma3_gguf, tmp_path, quant):
    """K-quants (Q4_K, Q6_K, Q5_0...), Gemma's stored 1 + w norms, a 262k vocabulary."""
    a = convert_checkpoint(gemma3_gguf, tmp_path / "direct.cmf", quant=quant).output
    b = convert_through_hf_folder(gemma3_gguf, tmp_path / "old.cmf", tmp_path / "hf", quant)
    assert a.read_bytes() == b.read_bytes()


def _child_peak_rss(code: str) -> int:
    """Peak RSS in bytes of a child Python running ``code`` (its own rusage)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, p.stderr.read().decode()[-2000:]
    return usage.ru_maxrss * 1024


# The interpreter a conversion needs: the CLI and converter imported, the quantizers compiled.
INTERPRETER = (
    "import numpy as np, gguf, tokenizers, cortiq_cli.main; from cortiq_engine.convert import convert_checkpoint; "
    "from formats.quants import get_dtype; x = np.ones((4, 64), np.float32); "
    "[get_dtype(d).encode(x) for d in ('q8', 'q4', 'f16', 'bf16')]"
)


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["q8", "q4"])
def test_smollm2_gguf_peak_memory_is_one_tensor(smollm2_gguf, tmp_path, quant):
    """Peak memory below 1.3x the largest tensor (as f32) plus the interpreter (it was the
    whole f32 model through a temporary folder)."""
    from cortiq_engine.convert import read_gguf

    largest = max(int(np.prod(t.shape)) for t in read_gguf(smollm2_gguf).tensors) * 4
    base = _child_peak_rss(INTERPRETER)
    out = tmp_path / "m.cmf"
    peak = _child_peak_rss(f"{INTERPRETER}; convert_checkpoint({str(smollm2_gguf)!r}, {str(out)!r}, quant={quant!r})")
    assert out.is_file()
    assert peak - base < 1.3 * largest, (peak / 2**20, base / 2**20, largest / 2**20)


@pytest.mark.slow
def test_kill_9_during_gguf_convert_leaves_nothing_under_the_final_name(smollm2_gguf, tmp_path):
    out = tmp_path / "o.cmf"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.Popen(
        [sys.executable, "-m", "cortiq_cli.main", "convert", str(smollm2_gguf), str(out), "--quant", "f32"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    staging: list[Path] = []
    while time.monotonic() < deadline and p.poll() is None and not staging:
        staging = [x for x in tmp_path.iterdir() if x.name.startswith(".o.cmf.")]
        time.sleep(0.02)
    assert staging and p.poll() is None, "the conversion finished before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not out.exists()  # nothing under the final name, only the dead run's staging file
    assert all(x.name.startswith(".o.cmf.") and x.name.endswith(".tmp") for x in tmp_path.iterdir())
    convert_checkpoint(smollm2_gguf, out, quant="q4")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["o.cmf"]  # the next run removed it
