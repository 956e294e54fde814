"""The speed benchmark harness (benchmarks/): its arithmetic, its worker, its inputs.

The harness must measure the same work on every system, so the worker's greedy
loop is checked against transformers' own ``generate``, the made GGUFs against the
dequantized source, and llama.cpp's greedy tokens against transformers' on them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_engine  # noqa: E402
import bench_worker  # noqa: E402

MIB = 2**20


def _res(prefill_s, decode_s, tokens, rss_loaded=150 * MIB):
    return dict(
        prefill_tokens=512,
        prefill_seconds=prefill_s,
        decode_steps=127,
        decode_seconds=decode_s,
        load_seconds=1.0,
        rss_base=100 * MIB,
        rss_loaded=rss_loaded,
        rss_peak=rss_loaded + MIB,
        decode_token_ids=tokens,
        notes=[],
        versions={},
    )


def _system(name):
    return next(s for s in bench_engine.SYSTEMS if s.name == name)


def test_medians_ratios_agreement_and_targets(tmp_path):
    model = tmp_path / "m.cmf"
    model.write_bytes(b"\0" * 1000)
    rows = [
        # tok/s 256, 128, 512 -> median 256; decode 10, 5, 7.9375 -> median 7.9375
        bench_engine.row_from(
            _system("transformers-f32"), model, _res([2.0, 4.0, 1.0], [12.7, 25.4, 16.0], [5, 6, 7, 8])
        ),
        bench_engine.row_from(_system("llama.cpp-q8_0"), model, _res([1.0], [2.54], [5, 6, 9, 8])),
        bench_engine.row_from(_system("cortiq-q8"), model, _res([0.5, 0.5, 4.0], [1.27, 1.27, 9.0], [5, 6, 7, 8])),
        bench_engine.row_from(_system("cortiq-q4"), model, "worker killed by SIGSEGV: (no output)"),
    ]
    bench_engine.add_comparisons(rows)
    tf, ll, cq8, cq4 = rows
    assert tf.prefill_tok_s == pytest.approx(256.0) and tf.decode_tok_s == pytest.approx(7.9375)
    assert cq8.prefill_tok_s == pytest.approx(1024.0) and cq8.decode_tok_s == pytest.approx(100.0)
    assert cq8.prefill_vs_tf32 == pytest.approx(4.0) and cq8.prefill_vs_llama_q8 == pytest.approx(2.0)
    assert cq8.decode_vs_tf32 == pytest.approx(100 / 7.9375) and cq8.decode_vs_llama_q8 == pytest.approx(2.0)
    assert (tf.agree_tf32, ll.agree_tf32, cq8.agree_tf32) == (4, 2, 4)
    assert cq4.status == "failed" and cq4.decode_vs_tf32 is None and "SIGSEGV" in cq4.error
    assert cq8.file_bytes == 1000

    got = {t.name.split(" (")[0]: t for t in bench_engine.targets(rows)}
    assert [t.ok for t in got.values()] == [True, True, True, True]
    rss = next(t for t in got.values() if "RSS" in t.name)
    assert rss.value == pytest.approx(150.0) and rss.threshold == pytest.approx(200 + 1000 / MIB)

    cq8.rss_loaded = 201 * MIB  # over file + 200 MiB
    cq8.decode_vs_llama_q8 = 0.49
    assert [t.ok for t in bench_engine.targets(rows)] == [True, False, True, False]
    assert [t.ok for t in bench_engine.targets(rows[:2])] == [None] * 4


def test_prompts_are_real_text_of_the_asked_length(tmp_path):
    from tokenizers import Tokenizer

    from tests.tiny import write_byte_tokenizer

    write_byte_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = bench_engine.PROMPT_FILE.read_text()
    for n in (512, len(text) + 100):  # byte tokens: the second one has to repeat the text
        prefill, decode = bench_engine.prompt_ids(tmp_path / "tokenizer.json", n)
        assert len(prefill) == n
        assert tok.decode(prefill[:200]) == text[:200]
    assert "lighthouse keeper" in tok.decode(decode)


def test_peak_rss_is_the_workers_own_not_its_parents():
    """Linux carries ru_maxrss over fork/exec; a big parent must not inflate a worker's peak."""
    import subprocess

    ballast = b"\x01" * (300 * MIB)  # written, so the parent's RSS really grows
    code = f"import sys; sys.path.insert(0, {str(REPO / 'benchmarks')!r}); import bench_worker; print(bench_worker.rss_peak())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert len(ballast) and int(out.stdout) < 150 * MIB


def _tiny_job(folder, **kw):
    base = dict(
        backend="transformers",
        model=str(folder),
        threads=2,
        prefill_ids=list(range(3, 40)),
        decode_prompt_ids=[7, 8, 9, 10],
        decode_tokens=12,
        warmup=1,
        reps=2,
    )
    return {**base, **kw}


def test_worker_greedy_loop_equals_transformers_generate(tmp_path):
    import torch

    from tests.tiny import build_tiny, save_tiny

    folder = save_tiny("llama", tmp_path / "tiny")
    job = bench_worker.Job(**_tiny_job(folder))
    res = bench_worker.run(job)

    model = build_tiny("llama")
    with torch.no_grad():
        want = model.generate(
            torch.tensor([job.decode_prompt_ids]), do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0
        )[0, 4:].tolist()
        first = int(model(torch.tensor([job.prefill_ids])).logits[0, -1].argmax())
    assert res.decode_token_ids == want
    assert res.first_prefill_token == first
    assert res.decode_steps == 11 and len(res.decode_seconds) == len(res.prefill_seconds) == 2
    assert all(s > 0 for s in res.decode_seconds + res.prefill_seconds)
    assert res.notes == []
    assert 0 < res.rss_base <= res.rss_peak and res.rss_loaded <= res.rss_peak


def test_subprocess_worker_reports_results_and_failures(tmp_path):
    from tests.tiny import save_tiny

    folder = save_tiny("llama", tmp_path / "tiny")
    job = _tiny_job(folder, decode_tokens=4, warmup=0, reps=1)
    out = bench_engine.run_system(_system("transformers-f32"), folder, job, timeout=300)
    assert isinstance(out, dict), out
    assert len(out["decode_token_ids"]) == 4 and out["decode_steps"] == 3
    assert out["versions"]["torch"]

    missing = tmp_path / "missing.cmf"
    err = bench_engine.run_system(_system("cortiq-q8"), missing, dict(job, model=str(missing)), timeout=300)
    assert isinstance(err, str) and err.startswith("worker exit 1:")


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.usefixtures("smollm2_gguf")
def test_made_ggufs_hold_the_source_weights_and_decode_like_transformers():
    """F32 GGUF == dequantized source exactly; llama.cpp on it decodes as transformers does on the HF folder."""
    import gguf
    import llama_cpp
    import make_gguf
    import numpy as np
    from tests.conftest import cache_root

    paths = make_gguf.make_inputs(cache_root() / "bench")
    src, f32 = gguf.GGUFReader(paths.source), gguf.GGUFReader(paths.f32_gguf)
    by_name = {t.name: t for t in f32.tensors}
    assert len(by_name) == len(src.tensors)
    for t in src.tensors[:12]:  # the Q8_0 embedding, Q4_1 matrices and F32 norms
        out = by_name[t.name]
        assert out.tensor_type == gguf.GGMLQuantizationType.F32
        np.testing.assert_array_equal(np.asarray(out.data), gguf.dequantize(t.data, t.tensor_type))
    assert f32.fields["tokenizer.ggml.merges"].contents() == src.fields["tokenizer.ggml.merges"].contents()
    types = {t.tensor_type.name for t in gguf.GGUFReader(paths.q8_0_gguf).tensors}
    assert types == {"F32", "Q8_0"}

    # The benchmark's token ids are llama.cpp's own tokenization of the prompt text.
    prefill, decode_prompt = bench_engine.prompt_ids(paths.hf_dir / "tokenizer.json", 512)
    vocab = llama_cpp.Llama(model_path=str(paths.f32_gguf), vocab_only=True, verbose=False)
    text = bench_engine.PROMPT_FILE.read_text()
    assert vocab.tokenize(text.encode(), add_bos=False, special=False)[:512] == prefill
    vocab.close()

    common = dict(
        threads=2, prefill_ids=prefill[:64], decode_prompt_ids=decode_prompt, decode_tokens=24, warmup=0, reps=1
    )
    tf = bench_worker.run(bench_worker.Job(backend="transformers", model=str(paths.hf_dir), **common))
    ll = bench_worker.run(bench_worker.Job(backend="llama.cpp", model=str(paths.f32_gguf), **common))
    q8 = bench_worker.run(bench_worker.Job(backend="llama.cpp", model=str(paths.q8_0_gguf), **common))
    assert ll.first_prefill_token == tf.first_prefill_token
    assert bench_engine.common_prefix(ll.decode_token_ids, tf.decode_token_ids) >= 16
    assert bench_engine.common_prefix(q8.decode_token_ids, tf.decode_token_ids) >= 4


@pytest.mark.parametrize("accept", [0.0, 0.7, 1.0])
def test_rigged_drafts_keep_greedy_output_through_the_decode_loop(tmp_path, accept):
    """benchmarks/spec_rigged.py's drafter meets the decode loop's drafter protocol
    (``generate.DraftSource``): the speculative tokens are the plain greedy ones, and at
    acceptance 1 every draft is accepted."""
    import spec_rigged

    from cortiq_engine.convert import convert_checkpoint
    from cortiq_engine.engine import Engine
    from cortiq_engine.generate import generate
    from cortiq_engine.sampling import SamplingConfig
    from tests.tiny import save_tiny

    cmf = tmp_path / "m.cmf"
    convert_checkpoint(save_tiny("llama", tmp_path / "tiny"), cmf, quant="q8")
    eng = Engine.load(cmf, ctx=128)
    ids = [5, 17, 33, 9, 60]
    plain = eng.generate(ids, max_tokens=24, ignore_eos=True, speculative=False)
    rig = spec_rigged.RiggedDrafter(list(ids) + list(plain.token_ids), 3, accept, eng.ctx, seed=1)
    spec = generate(eng.model, eng.tokenizer, ids, SamplingConfig(), capacity=eng.ctx, max_tokens=24, drafter=rig)
    assert spec.token_ids == plain.token_ids
    acc = spec.extra["mtp"]
    assert acc["source"] == "rigged" and acc["mtp_depth"] == 3
    if accept == 1.0:
        assert spec.acceptance.accepted[0] == spec.acceptance.drafted[0] > 0
    if accept == 0.0:
        assert sum(spec.acceptance.accepted) == 0
