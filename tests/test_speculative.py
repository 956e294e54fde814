"""Exact speculative greedy decoding: the emitted stream is the plain greedy stream.

Oracle: ``Engine.generate`` (plain one-token decoding) on the same file: the same
token ids, confidences, per-token texts, result text and finish reason. Models:
tiny random llama/qwen3 trunks with draft layers under each family's real names
(tests/mtp_tiny.py), f32 and q8; drafts rigged (a test hook) to be accepted
always, never, or exactly j of K times; and a backbone rigged so the real draft
layers are always right.
"""

from __future__ import annotations

import numpy as np
import pytest

from cortiq_engine import Engine, SamplingConfig, SpeculativeConfig, forward
from cortiq_engine.mtp import make_drafter
from cortiq_engine.convert import convert_checkpoint
from tests.mtp_tiny import save_tiny_mtp

N_PROMPTS = 16
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, quant) -> converted CMF path (its sidecar beside it)."""
    root = tmp_path_factory.mktemp("spec")
    out = {}
    # "mimo_v2": MiMo's drafts on a real MiMo-V2 backbone (sliding layers with sinks,
    # V head width 16 vs Q/K 24, V scale, MoE); "qwen3_next_hybrid": the Qwen3-Next draft
    # (gated attention, MoE) on a real Qwen3-Next backbone (Gated DeltaNet layers, whose
    # state must roll back too). Both trunks built with transformers.
    for key, family, n, trunk in (
        ("deepseek", "deepseek", 1, None),
        ("mimo", "mimo", 3, None),
        ("qwen3_next", "qwen3_next", 1, None),
        ("mimo_v2", "mimo", 3, "mimo_v2_flash"),
        ("qwen3_next_hybrid", "qwen3_next", 1, "qwen3_next"),
    ):
        src = save_tiny_mtp(family, root / key, n_layers=n, trunk=trunk)
        for quant in ("f32", "q8") + (("q4", "f16", "bf16") if key == "deepseek" else ()):
            path = root / f"{key}.{quant}.cmf"
            convert_checkpoint(src, path, quant=quant)
            out[key, quant] = path
    return out


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, 256, size=int(rng.integers(1, 40))))) for _ in range(N_PROMPTS)]


def _load(path, **kw):
    eng = Engine.load(path, threads=1, mtp=True, **kw)
    return eng, eng.drafts


def _spec(eng, prompt, drafter, max_tokens=MAX_TOKENS, **kw):
    return eng.generate(prompt, max_tokens=max_tokens, speculative=drafter, **kw)


def _assert_same(plain, spec):
    assert "mtp" in spec.extra and "mtp" not in plain.extra
    assert spec.token_ids == plain.token_ids
    assert [t.confidence for t in spec.tokens] == [t.confidence for t in plain.tokens]
    assert [t.text for t in spec.tokens] == [t.text for t in plain.tokens]
    assert spec.text == plain.text
    # The token texts add up to the result text (a stop string cuts the result, not the tokens).
    joined = "".join(t.text for t in spec.tokens)
    assert joined == spec.text if spec.finish_reason != "stop_string" else joined.startswith(spec.text)
    assert spec.finish_reason == plain.finish_reason
    assert spec.cache_length == plain.cache_length


_CASES = [
    ("mimo", "independent", 3, "pre"),
    ("mimo", "independent", 3, "post"),
    ("mimo", "recursive", 2, "pre"),
    ("deepseek", "independent", 1, "pre"),
    ("deepseek", "recursive", 3, "post"),
    ("qwen3_next", "recursive", 2, "pre"),
    ("mimo_v2", "independent", 3, "pre"),
    ("mimo_v2", "recursive", 3, "post"),
    ("qwen3_next_hybrid", "independent", 1, "pre"),
    ("qwen3_next_hybrid", "recursive", 3, "pre"),
]


@pytest.mark.parametrize("quant", ["f32", "q8"])
@pytest.mark.parametrize("family,chain,depth,hidden", _CASES)
def test_greedy_equality_many_prompts(models, quant, family, chain, depth, hidden):
    eng, stack = _load(models[family, quant])
    assert stack is not None and stack.num_layers == (3 if family.startswith("mimo") else 1)
    drafted = 0
    for prompt in _prompts():
        plain = eng.generate(prompt, SamplingConfig(), max_tokens=MAX_TOKENS, speculative=False)
        d = make_drafter(eng.model, stack, eng.ctx, depth=depth, chain=chain, hidden=hidden)
        spec = _spec(eng, prompt, d)
        _assert_same(plain, spec)
        st = spec.extra["mtp"]
        drafted += st["drafted"]
        # Every round emits its accepted drafts plus one token of its own.
        assert st["accepted"] + st["rounds"] + st["plain_steps"] + 1 == len(spec.token_ids)
    assert drafted > 0


@pytest.mark.parametrize("family,quant", [("deepseek", "q8"), ("mimo_v2", "f32"), ("qwen3_next_hybrid", "q8")])
def test_greedy_equality_with_an_f16_kv_cache(models, family, quant):
    """An f16 KV cache keeps the contract: a row is rounded once as it enters, so the
    batched verify reads what plain decoding reads (sliding windows with sinks on
    mimo_v2, Gated DeltaNet state beside the cache on qwen3_next_hybrid)."""
    eng, stack = _load(models[family, quant], kv_cache="f16")
    assert eng.model.kv_cache == "f16"
    drafted = 0
    for prompt in _prompts(3)[:8]:
        plain = eng.generate(prompt, SamplingConfig(), max_tokens=MAX_TOKENS, speculative=False)
        spec = _spec(eng, prompt, make_drafter(eng.model, stack, eng.ctx))
        _assert_same(plain, spec)
        drafted += spec.extra["mtp"]["drafted"]
    assert drafted > 0


def _rigged(eng, prompt, j, wrong_offset=1):
    """A draft hook that proposes the true greedy continuation for the first j depths
    and a wrong token after that."""
    plain = eng.generate(prompt, SamplingConfig(), max_tokens=MAX_TOKENS, speculative=False)
    stream = list(prompt) + plain.token_ids
    V = eng.vocab_size

    def override(t, ids, k):
        out = []
        for i in range(k):
            pos = t + 2 + i
            true = stream[pos] if pos < len(stream) else 0
            out.append(true if i < j else (true + wrong_offset) % V)
        return out

    return plain, override


@pytest.mark.parametrize("quant", ["f32", "q8"])
@pytest.mark.parametrize("j", [0, 1, 2, 3])
@pytest.mark.parametrize("family", ["mimo", "mimo_v2"])
def test_rigged_acceptance_exactly_j_of_k(models, quant, j, family):
    eng, stack = _load(models[family, quant])
    K = 3
    for prompt in _prompts(seed=j)[:6]:
        plain, override = _rigged(eng, prompt, j)
        d = make_drafter(eng.model, stack, eng.ctx, depth=K, override=override)
        spec = _spec(eng, prompt, d)
        _assert_same(plain, spec)
        st = spec.extra["mtp"]
        for depth in range(K):
            want = st["depth_drafted"][depth] if depth < j else 0
            assert st["depth_accepted"][depth] == want
        full_rounds = st["depth_drafted"][K - 1]  # rounds with all K drafts
        assert st["accept_histogram"][j] >= full_rounds > 0
        if j == K:
            # All accepted: K+1 tokens per full round.
            assert st["tokens_per_round"] > 2.5
        if j == 0:
            assert st["accepted"] == 0 and st["tokens_per_round"] == 1.0


def test_real_draft_layers_rigged_to_agree(models, tmp_path):
    """A constant lm_head makes every argmax token 0, for the backbone and for the
    real draft layers alike: every draft is accepted, through the real draft path."""
    from safetensors.numpy import load_file, save_file

    src = save_tiny_mtp("mimo", tmp_path / "src", n_layers=3)
    w = load_file(str(src / "model.safetensors"))
    w["lm_head.weight"] = np.full_like(w["lm_head.weight"], 0.01)
    save_file(w, str(src / "model.safetensors"))
    path = tmp_path / "const.cmf"
    convert_checkpoint(src, path, quant="q8")
    eng, stack = _load(path)
    prompt = [5, 6, 7]
    plain = eng.generate(prompt, SamplingConfig(), max_tokens=17, speculative=False)
    spec = _spec(eng, prompt, make_drafter(eng.model, stack, eng.ctx), max_tokens=17)
    _assert_same(plain, spec)
    st = spec.extra["mtp"]
    assert st["acceptance"] == 1.0 and st["rounds"] == 4 and st["tokens_per_round"] == 4.0
    assert st["accept_histogram"] == [0, 0, 0, 4]


@pytest.mark.parametrize("quant", ["f32", "q8"])
@pytest.mark.parametrize("family", ["mimo", "mimo_v2", "qwen3_next_hybrid"])
def test_every_token_enters_the_backbone_cache_once(models, quant, family):
    eng, stack = _load(models[family, quant])
    prompt = _prompts(seed=7)[0]
    for j in (0, 2):
        plain_state = eng.new_state()
        plain = eng.generate(prompt, SamplingConfig(), max_tokens=MAX_TOKENS, speculative=False)
        from cortiq_engine.generate import generate

        generate(
            eng.model,
            eng.tokenizer,
            prompt,
            SamplingConfig(),
            capacity=eng.ctx,
            max_tokens=MAX_TOKENS,
            state=plain_state,
        )
        _, override = _rigged(eng, prompt, j)
        spec_state = eng.new_state()
        d = make_drafter(eng.model, stack, eng.ctx, override=override)
        spec = _spec(eng, prompt, d, state=spec_state)
        _assert_same(plain, spec)
        n = len(prompt) + len(spec.token_ids) - 1
        st = spec.extra["mtp"]
        for pc, sc in zip(plain_state.caches, spec_state.caches):
            assert sc.length == pc.length == n
            # Accepted rows written once; rejected drafts written and rolled back.
            assert sc.writes == n + st["drafted"] - st["accepted"]
            if hasattr(sc, "keys"):
                assert np.array_equal(sc.keys[:, :n], pc.keys[:, :n])
                assert np.array_equal(sc.values[:, :n], pc.values[:, :n])
            else:  # Gated DeltaNet: the recurrent and conv states after the kept rows
                assert np.array_equal(sc.state, pc.state) and np.array_equal(sc.window, pc.window)


@pytest.mark.parametrize("quant", ["f32", "q8", "q4", "f16", "bf16"])
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_batched_verify_is_row_exact(models, quant, kernels):
    eng = Engine.load(models["deepseek", quant], kernels=kernels, threads=1)
    prompt = list(range(40, 60))
    new = [3, 99, 17, 250]
    one = eng.new_state()
    forward(one, prompt)
    rows = np.concatenate([forward(one, [t]) for t in new])
    logits_one = np.concatenate([eng.model.lm_head(eng.model.final_norm(r[None])) for r in rows])
    # The engine's kernel set declares row-exactness for a verify of this length.
    assert len(new) <= eng.kernels.row_exact_rows
    batch = eng.new_state()
    forward(batch, prompt)
    hb = forward(batch, new)
    logits_batch = eng.model.lm_head(eng.model.final_norm(hb))
    assert np.array_equal(hb, rows)
    assert np.array_equal(logits_batch, logits_one)


def test_sampling_is_refused(models):
    from formats.errors import CortiqError

    eng, stack = _load(models["deepseek", "f32"])
    with pytest.raises(CortiqError, match="greedy"):
        eng.generate([1, 2], SamplingConfig(temperature=0.8), speculative=make_drafter(eng.model, stack, eng.ctx))


def test_numpy_kernels_and_a_reused_drafter(models):
    """The reference kernel set is exact too, and one drafter serves several generations."""
    eng, stack = _load(models["mimo", "q8"], kernels="numpy")
    d = make_drafter(eng.model, stack, eng.ctx, chain="recursive", depth=2)
    for prompt in _prompts(seed=11)[:4]:
        plain = eng.generate(prompt, SamplingConfig(), max_tokens=16, speculative=False)
        _assert_same(plain, _spec(eng, prompt, d, max_tokens=16))


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["q8", "f32"])
def test_smollm2_exact_with_random_and_rigged_drafts(smollm2_cmf, english_text, tmp_path, quant):
    """A real model (many near-ties): random draft layers, and drafts rigged to be right
    at depths 1-2 of 3, both give plain greedy decoding token for token."""
    from tests.mtp_tiny import write_random_sidecar

    path = smollm2_cmf(quant)
    side = write_random_sidecar(path, tmp_path / "rand.mtp.cmf", n_layers=3, quant=quant)
    eng = Engine.load(path, threads=1, mtp=side)
    stack = eng.drafts
    words = english_text.split()
    for i in range(4):
        prompt = eng.tokenizer.encode(" ".join(words[300 * i : 300 * i + 40]))
        plain = eng.generate(prompt, SamplingConfig(), max_tokens=24, speculative=False)
        _assert_same(plain, _spec(eng, prompt, make_drafter(eng.model, stack, eng.ctx), max_tokens=24))
        _, override = _rigged_from(plain, prompt, 2, eng.vocab_size)
        spec = _spec(eng, prompt, make_drafter(eng.model, stack, eng.ctx, override=override), max_tokens=24)
        _assert_same(plain, spec)
        assert spec.extra["mtp"]["tokens_per_round"] > 2.0


@pytest.mark.slow
def test_smollm2_exact_with_a_trained_sidecar(smollm2_cmf, english_text, tmp_path):
    """A real model and draft layers trained by mtp-train on its own greedy text (chat
    turns and plain windows, a draft vocabulary): speculative decoding at depths 1-3,
    with and without adaptive depth, is plain greedy token for token, through the
    plain and chat prompts, and the trained drafts are accepted."""
    from cortiq_train.config import TrainConfig
    from cortiq_train.run import train_mtp

    path = smollm2_cmf("q8")
    cfg = TrainConfig(
        layers=3,
        steps=30,
        seq=160,
        batch=2,
        lr=2e-3,
        warmup=3,
        holdout=0.0,
        max_tokens=8 * 160,
        checkpoint_every=0,
        chat=True,
        self_distill=32,
    )
    side = train_mtp(path, english_text, "english", cfg, out=tmp_path / "t.mtp.cmf", draft_vocab=4096).sidecar
    eng = Engine.load(path, threads=1, mtp=side)
    assert eng.drafts.vocab is not None and len(eng.drafts.vocab) == 4096
    words = english_text.split()
    accepted = 0
    for i in range(3):
        text = " ".join(words[500 * i + 4000 : 500 * i + 4040])
        for prompt in (
            eng.tokenizer.encode(text),
            eng.tokenizer.encode(eng.tokenizer.apply_chat_template([{"role": "user", "content": text}]), add_bos=False),
        ):
            plain = eng.generate(prompt, SamplingConfig(), max_tokens=32, ignore_eos=True, speculative=False)
            for depth, th in ((1, 0.0), (3, 0.0), (3, 0.4)):
                spec = eng.generate(
                    prompt, max_tokens=32, ignore_eos=True, speculative=SpeculativeConfig(depth=depth, threshold=th)
                )
                _assert_same(plain, spec)
                accepted += sum(spec.extra["mtp"]["depth_accepted"])
    assert accepted > 0


def _rigged_from(plain, prompt, j, V):
    stream = list(prompt) + plain.token_ids

    def override(t, ids, k):
        return [((stream[t + 2 + i] if t + 2 + i < len(stream) else 0) + (0 if i < j else 1)) % V for i in range(k)]

    return plain, override


def test_deep_recursive_drafts_stay_exact(models):
    """Depth 10 asks for more verify rows than the small-batch kernels take; the round
    caps its drafts so the verify keeps decode's numbers."""
    eng, stack = _load(models["deepseek", "q8"])
    for prompt in _prompts(seed=5)[:3]:
        plain = eng.generate(prompt, SamplingConfig(), max_tokens=MAX_TOKENS, speculative=False)
        spec = _spec(eng, prompt, make_drafter(eng.model, stack, eng.ctx, depth=10))
        _assert_same(plain, spec)
        assert max(i for i, n in enumerate(spec.extra["mtp"]["depth_drafted"]) if n) < eng.kernels.small_n - 1


# ------------------------------------------------------------------ multi-byte UTF-8
CYCLE = "é中😀"  # nine distinct bytes: C3 A9 | E4 B8 AD | F0 9F 98 80


@pytest.fixture(scope="module")
def utf8_model(tmp_path_factory):
    """A byte-level model that greedily cycles through the bytes of CYCLE: the trunk's
    blocks write nothing (o_proj and down_proj zero), so the last hidden row is the
    current token's embedding, and lm_head row next(b) is the embedding of byte b. Its
    random MiMo draft layers are left as they are (mostly rejected)."""
    from safetensors.numpy import load_file, save_file
    from tokenizers import Tokenizer

    root = tmp_path_factory.mktemp("utf8")
    src = save_tiny_mtp("mimo", root / "src", n_layers=3)
    cyc = Tokenizer.from_file(str(src / "tokenizer.json")).encode(CYCLE).ids
    assert len(set(cyc)) == len(cyc) == 9
    w = load_file(str(src / "model.safetensors"))
    for name in w:
        if name.startswith("model.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = np.zeros_like(w[name])
    w["model.norm.weight"] = np.ones_like(w["model.norm.weight"])
    emb = w["model.embed_tokens.weight"]
    head = np.zeros_like(w["lm_head.weight"])
    for a, b in zip(cyc, cyc[1:] + cyc[:1]):
        head[b] = 4 * emb[a] / np.linalg.norm(emb[a])
    w["lm_head.weight"] = head
    save_file(w, str(src / "model.safetensors"))
    path = root / "utf8.cmf"
    convert_checkpoint(src, path, quant="q8")
    return path


def test_multibyte_utf8_texts_are_the_same(utf8_model):
    """Accents, CJK and emoji, cut at every byte boundary: plain and speculative decoding
    (real draft layers, and drafts rigged to be right j of 3 times) give the same ids and
    the same per-token texts, and the texts concatenate to the result text, including the
    bytes of a character the last token leaves unfinished."""
    eng, stack = _load(utf8_model)
    prompt = eng.tokenizer.encode("Hi é", add_bos=False)
    tails = 0
    for n in range(3, 15):
        plain = eng.generate(prompt, max_tokens=n, speculative=False)
        assert "中" in plain.text and plain.text.startswith("中")
        tails += plain.text.endswith("\ufffd")  # the last token stops inside a character
        for j in (None, 0, 2, 3):
            override = None if j is None else _rigged_from(plain, prompt, j, eng.vocab_size)[1]
            spec = _spec(eng, prompt, make_drafter(eng.model, stack, eng.ctx, override=override), max_tokens=n)
            _assert_same(plain, spec)
        # Stop strings cut inside the multi-byte stream the same way.
        stopped = eng.generate(prompt, max_tokens=n, stop=["😀é"], speculative=False)
        _assert_same(stopped, _spec(eng, prompt, make_drafter(eng.model, stack, eng.ctx), max_tokens=n, stop=["😀é"]))
    assert tails >= 6  # 9 bytes per cycle: most budgets end mid-character
    assert "😀" in plain.text and plain.finish_reason == "max_tokens"


@pytest.mark.slow
def test_smollm2_multibyte_texts_are_the_same(smollm2_cmf, tmp_path):
    """SmolLM2 answering in French, Chinese and emoji: plain and speculative decoding
    (random draft layers; drafts rigged right at depths 1-2 of 3) emit the same ids and
    per-token texts, which concatenate to the result text."""
    from tests.mtp_tiny import write_random_sidecar

    path = smollm2_cmf("q8")
    side = write_random_sidecar(path, tmp_path / "rand.mtp.cmf", n_layers=3, quant="q8")
    eng = Engine.load(path, threads=1, mtp=side)
    tok = eng.tokenizer
    multibyte = 0
    for question in (
        "Écris une phrase sur l'été à Paris, en français.",
        "请用中文介绍一下北京。",
        "Give me five emoji about food: 🍕",
    ):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_bos=False)
        plain = eng.generate(prompt, max_tokens=24, speculative=False)
        multibyte += len(plain.text.encode("utf-8")) > len(plain.text)
        _assert_same(plain, _spec(eng, prompt, make_drafter(eng.model, eng.drafts, eng.ctx), max_tokens=24))
        _, override = _rigged_from(plain, prompt, 2, eng.vocab_size)
        _assert_same(
            plain, _spec(eng, prompt, make_drafter(eng.model, eng.drafts, eng.ctx, override=override), max_tokens=24)
        )
    assert multibyte >= 2


def test_the_engine_owns_the_policy(models):
    """``Engine.load(mtp=...)`` loads the drafts; ``generate(speculative=...)`` decides."""
    from formats.errors import CortiqError

    path = models["mimo", "q8"]
    plain_eng = Engine.load(path, threads=1)  # mtp=False: no draft layers, lookup drafts alone
    assert plain_eng.drafts is None and plain_eng.generate([1, 2, 3], max_tokens=4).extra["mtp"]["source"] == "lookup"
    assert "mtp" not in plain_eng.generate([1, 2, 3], max_tokens=4, speculative=False).extra
    with pytest.raises(CortiqError, match="no MTP draft layers"):
        plain_eng.generate([1, 2, 3], max_tokens=4, speculative=True)
    eng, stack = _load(path)
    plain = eng.generate([1, 2, 3], max_tokens=12, speculative=False)
    auto = eng.generate([1, 2, 3], max_tokens=12)  # draft layers loaded, greedy: speculative
    _assert_same(plain, auto)
    assert auto.extra["mtp"]["depth"] == 3 and auto.extra["mtp"]["chain"] == "independent"
    deep = eng.generate(
        [1, 2, 3], max_tokens=12, speculative=SpeculativeConfig(depth=2, chain="recursive", hidden="post")
    )
    _assert_same(plain, deep)
    assert (deep.extra["mtp"]["mtp_depth"], deep.extra["mtp"]["chain"], deep.extra["mtp"]["hidden"]) == (
        2,
        "recursive",
        "post",
    )
    # n-gram lookup drafts first by default (3 a round), so a round drafts up to 3; lookup=0: MTP alone.
    assert (deep.extra["mtp"]["depth"], deep.extra["mtp"]["lookup"]) == (3, 3)
    alone = eng.generate([1, 2, 3], max_tokens=12, speculative=SpeculativeConfig(depth=2, chain="recursive", lookup=0))
    _assert_same(plain, alone)
    assert (
        alone.extra["mtp"]["depth"] == 2
        and "lookup" not in alone.extra["mtp"]
        and "by_source" not in alone.extra["mtp"]
    )
    sampled = eng.generate([1, 2, 3], SamplingConfig(temperature=0.8, seed=1), max_tokens=4)
    assert "mtp" not in sampled.extra and "greedy" in sampled.extra["mtp_note"]
    assert "evict" in eng.generate([1, 2, 3], max_tokens=4, evict=True).extra["mtp_note"]
    with pytest.raises(CortiqError, match="greedy"):
        eng.generate([1, 2, 3], SamplingConfig(temperature=0.8), max_tokens=4, speculative=True)
