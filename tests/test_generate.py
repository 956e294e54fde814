"""Generation: the prefill/decode contract, finish reasons, sampling, streaming, the CLI.

A tiny random llama (byte-level tokenizer: one token per byte) keeps these fast;
oracles are transformers' greedy tokens, the engine's own teacher-forced logits
(an independent code path: one batched forward), and hand-computed sampling math.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from formats.cmf import CmfFile, CmfWriter, rewrite_header
from formats.convert import TOKENIZER_TENSOR
from cortiq_engine.convert import convert_checkpoint
from tests.tiny import save_tiny

from cortiq_engine import Engine, SamplingConfig
from cortiq_engine.generate import generate
from cortiq_engine.sampling import Sampler, apply_repetition_penalty, token_probability
from cortiq_engine.tokenizer import StreamDecoder

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    src = save_tiny("llama", root / "hf", max_position_embeddings=128)
    out = root / "tiny.cmf"
    convert_checkpoint(src, out, quant="f32")
    return src, out


@pytest.fixture(scope="module")
def eng(tiny):
    return Engine.load(tiny[1])


def _softmax(z):
    z = z.astype(np.float64) - z.max()
    e = np.exp(z)
    return e / e.sum()


# ------------------------------------------------------------------ the cache contract
def test_every_token_enters_the_cache_once(eng):
    ids = eng.tokenizer.encode(PROMPT)
    st = eng.new_state(64)
    res = generate(eng.model, eng.tokenizer, ids, SamplingConfig(), capacity=64, max_tokens=12, state=st)
    assert len(res.token_ids) == 12 and res.finish_reason == "max_tokens"
    assert st.length == len(ids) + 12 - 1 == res.cache_length
    assert st.forwarded == len(ids) + 12 - 1
    assert all(c.writes == len(ids) + 12 - 1 for c in st.caches)


def test_greedy_equals_teacher_forced_argmax_and_confidence(eng):
    """Each greedy token is the argmax of a fresh one-pass forward over prompt+output so far,
    and its confidence is the softmax probability under those logits."""
    ids = eng.tokenizer.encode(PROMPT)
    res = eng.generate(ids, SamplingConfig(), max_tokens=10)
    full = eng.logits(ids + res.token_ids)
    for k, ev in enumerate(res.tokens):
        row = full[len(ids) - 1 + k]
        assert ev.id == int(np.argmax(row))
        assert ev.confidence == pytest.approx(_softmax(row)[ev.id], rel=1e-4)


def test_greedy_equals_transformers(tiny, eng):
    import torch
    import transformers

    ids = eng.tokenizer.encode(PROMPT)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, num_beams=1)[0, len(ids) :].tolist()
    assert eng.generate(ids, SamplingConfig(), max_tokens=24).token_ids == ref


# ------------------------------------------------------------------ finish reasons
def test_context_full_stops_with_length(tiny):
    small = Engine.load(tiny[1], ctx=24)
    ids = small.tokenizer.encode(PROMPT)  # 19 tokens
    res = small.generate(ids, SamplingConfig(), max_tokens=50)
    # 19 prompt rows + 5 decode rows fill 24; the 6th token is emitted but never forwarded.
    assert res.finish_reason == "length"
    assert len(res.token_ids) == 24 - len(ids) + 1
    assert res.cache_length == 24


def test_evict_keeps_going_with_increasing_positions(tiny):
    small = Engine.load(tiny[1], ctx=24)
    ids = small.tokenizer.encode(PROMPT)
    st = small.new_state(24)
    res = generate(
        small.model, small.tokenizer, ids, SamplingConfig(), capacity=24, max_tokens=40, evict=True, state=st
    )
    assert res.finish_reason == "max_tokens" and len(res.token_ids) == 40
    assert res.evictions >= 2
    assert st.length <= 24
    assert st.position == len(ids) + 40 - 1  # positions never restart


def test_eos_stops(eng):
    ids = eng.tokenizer.encode(PROMPT)
    free = eng.generate(ids, SamplingConfig(), max_tokens=10)
    eos = free.token_ids[4]
    first = free.token_ids.index(eos)
    res = generate(eng.model, eng.tokenizer, ids, SamplingConfig(), capacity=64, max_tokens=10, eos_ids=[eos])
    assert res.finish_reason == "stop"
    assert res.token_ids == free.token_ids[: first + 1]  # the EOS id is reported, its text is not
    assert res.tokens[-1].text == ""


def test_stop_string_cuts_text_and_never_streams_it(eng):
    ids = eng.tokenizer.encode(PROMPT)
    free = eng.generate(ids, SamplingConfig(), max_tokens=30)
    text = free.text
    stop = text[5:8]
    assert len(stop) == 3
    streamed = []
    res = eng.generate(ids, SamplingConfig(), max_tokens=30, stop=["zzzz-never", stop], on_text=streamed.append)
    assert res.finish_reason == "stop_string"
    assert res.text == text[: text.index(stop)]
    assert "".join(streamed) == res.text


def test_on_token_can_cancel(eng):
    seen = []

    def cb(ev):
        seen.append(ev)
        return len(seen) < 3

    res = eng.generate(eng.tokenizer.encode(PROMPT), SamplingConfig(), max_tokens=10, on_token=cb)
    assert res.finish_reason == "cancelled" and len(res.token_ids) == 3 == len(seen)


# ------------------------------------------------------------------ sampling
def test_seed_reproducible(eng):
    ids = eng.tokenizer.encode(PROMPT)
    cfg = SamplingConfig(temperature=1.5, top_k=40, top_p=0.95, seed=7)
    a = eng.generate(ids, cfg, max_tokens=20)
    b = eng.generate(ids, cfg, max_tokens=20)
    c = eng.generate(ids, SamplingConfig(temperature=1.5, top_k=40, top_p=0.95, seed=8), max_tokens=20)
    assert a.token_ids == b.token_ids and a.seed == 7
    assert a.token_ids != c.token_ids


def test_top_k_1_is_greedy(eng):
    ids = eng.tokenizer.encode(PROMPT)
    g = eng.generate(ids, SamplingConfig(), max_tokens=10)
    s = eng.generate(ids, SamplingConfig(temperature=0.8, top_k=1, seed=3), max_tokens=10)
    assert s.token_ids == g.token_ids


def test_repetition_penalty_semantics():
    z = np.array([2.0, -2.0, 1.0, -1.0], np.float32)
    out = apply_repetition_penalty(z, [0, 1, 1], 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, -1.0])


def test_top_p_and_min_p_keep_the_right_tokens():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    z = np.log(p).astype(np.float32)

    def support(cfg, draws=400):
        s = Sampler(cfg)
        return {s(z, []) for _ in range(draws)}

    # top-p 0.75: 0.5 < 0.75 <= 0.8, so the two most likely tokens (HF semantics).
    assert support(SamplingConfig(temperature=1.0, top_p=0.75, seed=0)) == {0, 1}
    # min-p 0.35: keep p >= 0.175 -> tokens 0 and 1.
    assert support(SamplingConfig(temperature=1.0, min_p=0.35, seed=0)) == {0, 1}
    assert support(SamplingConfig(temperature=1.0, seed=0), draws=2000) == {0, 1, 2, 3}


def test_sampling_frequencies_follow_temperature():
    z = np.log(np.array([0.6, 0.3, 0.1])).astype(np.float32)
    s = Sampler(SamplingConfig(temperature=2.0, seed=1))
    counts = np.bincount([s(z, []) for _ in range(6000)], minlength=3) / 6000
    np.testing.assert_allclose(counts, _softmax(z / 2.0), atol=0.03)


def test_calibrated_confidence(tiny, tmp_path):
    path = tmp_path / "cal.cmf"
    shutil.copy(tiny[1], path)
    with CmfFile(path) as f:
        header = dict(f.header)
    header["calibration"] = {"temperature": 1.7}
    rewrite_header(path, header)
    cal = Engine.load(path)
    ids = cal.tokenizer.encode(PROMPT)
    res = cal.generate(ids, SamplingConfig(), max_tokens=4)
    full = cal.logits(ids + res.token_ids)
    for k, ev in enumerate(res.tokens):
        row = full[len(ids) - 1 + k]
        assert ev.confidence == pytest.approx(_softmax(row / 1.7)[ev.id], rel=1e-4)
        assert ev.confidence == pytest.approx(token_probability(row, ev.id, 1.7), rel=1e-6)


# ------------------------------------------------------------------ text
def test_stream_decoder_completes_split_utf8(eng):
    text = "naïve 日本語 😀!"
    ids = eng.tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # byte tokenizer: characters span tokens
    dec = StreamDecoder(eng.tokenizer)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some tokens were held back mid-character


def test_chat_template_renders_like_transformers(eng):
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok = eng.tokenizer
    old = tok.chat_template
    tok.chat_template = template
    try:
        msgs = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"}]
        ours = tok.apply_chat_template(msgs)
        ref = render_jinja_template(
            conversations=[msgs], chat_template=template, add_generation_prompt=True, bos_token=""
        )[0][0]
        assert ours == ref
        tok.chat_template = "{{ raise_exception('no system role') }}"
        from formats.errors import CortiqError

        with pytest.raises(CortiqError, match="no system role"):
            tok.apply_chat_template(msgs)
    finally:
        tok.chat_template = old


# ------------------------------------------------------------------ the CLI
def _run(*args, input=None):
    from cortiq_cli.main import app

    return CliRunner().invoke(app, ["generate", *map(str, args)], input=input)


def test_cli_streams_and_reports(tiny, eng):
    ids = eng.tokenizer.encode(PROMPT)
    ref = eng.generate(ids, SamplingConfig(), max_tokens=16)
    r = _run(tiny[1], PROMPT, "-n", 16)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(ref.text)
    assert "prefill" in r.stderr and "decode" in r.stderr and "max_tokens" in r.stderr


def test_cli_json(tiny, eng):
    r = _run(tiny[1], PROMPT, "-n", 8, "--json", "--temperature", "0.9", "--seed", "5", "--top-k", "20")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    again = eng.generate(eng.tokenizer.encode(PROMPT), SamplingConfig(temperature=0.9, seed=5, top_k=20), max_tokens=8)
    assert d["token_ids"] == again.token_ids
    assert [t["id"] for t in d["tokens"]] == d["token_ids"]
    assert "".join(t["text"] for t in d["tokens"]) == d["text"]
    assert all(0 < t["confidence"] <= 1 for t in d["tokens"])
    for key in ("prompt_tokens", "prefill_tok_s", "decode_tok_s", "finish_reason", "prefill_seconds", "decode_seconds"):
        assert key in d
    assert d["finish_reason"] == "max_tokens" and d["prompt_tokens"] == len(PROMPT)


def test_cli_kv_cache_f16(tiny):
    """--kv-cache f16 decodes on an f16 cache (the engine's f16 greedy tokens) and says
    so in --json; the default is f32."""
    with Engine.load(tiny[1], kv_cache="f16") as e16:
        assert e16.new_state(4).caches[0].keys.dtype == np.float16
        want = e16.generate(e16.tokenizer.encode(PROMPT), SamplingConfig(), max_tokens=12).token_ids
    r = _run(tiny[1], PROMPT, "-n", 12, "--json", "--kv-cache", "f16")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["kv_cache"] == "f16" and d["token_ids"] == want
    assert json.loads(_run(tiny[1], PROMPT, "-n", 2, "--json").stdout)["kv_cache"] == "f32"


def _no_tokenizer_copy(src, dst):
    with CmfFile(src) as f:
        with CmfWriter(dst, f.header) as w:
            for name, info in f.tensors.items():
                if name != TOKENIZER_TENSOR:
                    w.add(name, info.dtype, f.tensor_f32(name))


@pytest.mark.parametrize(
    "case,needle",
    [
        ("empty", "empty prompt"),
        ("not_cmf", "not a CMF file"),
        ("missing", "no such file"),
        ("too_long", "longer than the context"),
        ("no_tokenizer", "no embedded tokenizer"),
        ("bad_threads", "--threads"),
        ("bad_kv_cache", "unknown --kv-cache 'f8'"),
    ],
)
def test_cli_errors_are_one_line(tiny, tmp_path, case, needle):
    model, prompt, extra = tiny[1], PROMPT, []
    if case == "empty":
        prompt = ""
    elif case == "not_cmf":
        model = tmp_path / "x.cmf"
        model.write_bytes(b"GGUF" + b"\0" * 200)
    elif case == "missing":
        model = tmp_path / "nope.cmf"
    elif case == "too_long":
        extra = ["--ctx", "8"]
    elif case == "no_tokenizer":
        model = tmp_path / "notok.cmf"
        _no_tokenizer_copy(tiny[1], model)
    elif case == "bad_threads":
        extra = ["--threads", "999"]
    elif case == "bad_kv_cache":
        extra = ["--kv-cache", "f8"]
    r = _run(model, prompt, *extra)
    assert r.exit_code == 2
    assert "Traceback" not in r.output
    err = r.stderr.strip()
    assert err.startswith("error:") and needle in err
    assert len(err.splitlines()) == 1 or needle in err.splitlines()[0]
