"""Exact speculative greedy decoding: the emitted stream is the plain greedy stream.

Oracle: ``Engine.generate`` (plain one-token decoding) on the same file. Models:
tiny random llama/qwen3 trunks with draft layers under each family's real names
(tests/mtp_tiny.py), f32 and q8; drafts rigged (a test hook) to be accepted
always, never, or exactly j of K times; and a backbone rigged so the real draft
layers are always right.
"""

from __future__ import annotations

import numpy as np
import pytest

from cortiq_engine import Engine, SamplingConfig, forward
from cortiq_engine.mtp import load_draft_stack, make_drafter
from cortiq_engine.speculative import generate_with_engine, row_exact
from formats.convert import convert_checkpoint
from tests.mtp_tiny import save_tiny_mtp

N_PROMPTS = 10
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(family, quant) -> converted CMF path (its sidecar beside it)."""
    root = tmp_path_factory.mktemp("spec")
    out = {}
    for family, n in (("deepseek", 1), ("mimo", 3), ("qwen3_next", 1)):
        src = save_tiny_mtp(family, root / family, n_layers=n)
        for quant in ("f32", "q8"):
            path = root / f"{family}.{quant}.cmf"
            convert_checkpoint(src, path, quant=quant)
            out[family, quant] = path
    return out


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, 256, size=int(rng.integers(1, 40))))) for _ in range(N_PROMPTS)]


def _load(path):
    eng = Engine.load(path, threads=1)
    return eng, load_draft_stack(eng.cmf, eng.arch, eng.kernels)


def _assert_same(plain, spec):
    assert spec.token_ids == plain.token_ids
    assert [t.confidence for t in spec.tokens] == [t.confidence for t in plain.tokens]
    assert spec.finish_reason == plain.finish_reason
    assert spec.cache_length == plain.cache_length


_FAST = [("mimo", "independent", 3, "pre"), ("deepseek", "recursive", 3, "post")]
_SLOW = [("deepseek", "independent", 1, "pre"), ("mimo", "recursive", 2, "pre"), ("qwen3_next", "recursive", 2, "pre")]
_CASES = [
    pytest.param(q, *case, n, marks=[pytest.mark.slow] if slow else [])
    for q in ("f32", "q8")
    for cases, n, slow in ((_FAST, 4, False), (_FAST, N_PROMPTS, True), (_SLOW, N_PROMPTS, True))
    for case in cases
]


@pytest.mark.parametrize("quant,family,chain,depth,hidden,n_prompts", _CASES)
def test_greedy_equality_many_prompts(models, quant, family, chain, depth, hidden, n_prompts):
    eng, stack = _load(models[family, quant])
    assert stack is not None and stack.num_layers == (3 if family == "mimo" else 1)
    drafted = 0
    for prompt in _prompts(seed=n_prompts)[:n_prompts]:
        plain = eng.generate(prompt, SamplingConfig(), max_tokens=MAX_TOKENS)
        d = make_drafter(eng.model, stack, eng.ctx, depth=depth, chain=chain, hidden=hidden)
        spec = generate_with_engine(eng, prompt, d, max_tokens=MAX_TOKENS)
        _assert_same(plain, spec)
        st = spec.extra["mtp"]
        drafted += st["drafted"]
        # Every round emits its accepted drafts plus one token of its own.
        assert st["accepted"] + st["rounds"] + st["plain_steps"] + 1 == len(spec.token_ids)
    assert drafted > 0


def _rigged(eng, prompt, j, wrong_offset=1):
    """A draft hook that proposes the true greedy continuation for the first j depths
    and a wrong token after that."""
    plain = eng.generate(prompt, SamplingConfig(), max_tokens=MAX_TOKENS)
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
@pytest.mark.parametrize("j", [0, 1, pytest.param(2, marks=pytest.mark.slow), 3])
def test_rigged_acceptance_exactly_j_of_k(models, quant, j):
    eng, stack = _load(models["mimo", quant])
    K = 3
    for prompt in _prompts(seed=j)[:3]:
        plain, override = _rigged(eng, prompt, j)
        d = make_drafter(eng.model, stack, eng.ctx, depth=K, override=override)
        spec = generate_with_engine(eng, prompt, d, max_tokens=MAX_TOKENS)
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
    plain = eng.generate(prompt, SamplingConfig(), max_tokens=17)
    spec = generate_with_engine(eng, prompt, make_drafter(eng.model, stack, eng.ctx), max_tokens=17)
    _assert_same(plain, spec)
    st = spec.extra["mtp"]
    assert st["acceptance"] == 1.0 and st["rounds"] == 4 and st["tokens_per_round"] == 4.0
    assert st["accept_histogram"] == [0, 0, 0, 4]


@pytest.mark.parametrize("quant", ["f32", "q8"])
def test_every_token_enters_the_backbone_cache_once(models, quant):
    eng, stack = _load(models["mimo", quant])
    prompt = _prompts(seed=7)[0]
    for j in (0, 2):
        plain_state = eng.new_state()
        plain = eng.generate(prompt, SamplingConfig(), max_tokens=MAX_TOKENS)
        from cortiq_engine.generate import generate

        generate(eng.model, eng.tokenizer, prompt, SamplingConfig(), capacity=eng.ctx, max_tokens=MAX_TOKENS, state=plain_state)
        _, override = _rigged(eng, prompt, j)
        spec_state = eng.new_state()
        d = make_drafter(eng.model, stack, eng.ctx, override=override)
        spec = generate_with_engine(eng, prompt, d, max_tokens=MAX_TOKENS, state=spec_state)
        _assert_same(plain, spec)
        n = len(prompt) + len(spec.token_ids) - 1
        st = spec.extra["mtp"]
        for pc, sc in zip(plain_state.caches, spec_state.caches):
            assert sc.length == pc.length == n
            # Accepted rows written once; rejected drafts written and rolled back.
            assert sc.writes == n + st["drafted"] - st["accepted"]
            assert np.array_equal(sc.keys[:, :n], pc.keys[:, :n])
            assert np.array_equal(sc.values[:, :n], pc.values[:, :n])


@pytest.mark.parametrize("quant", ["f32", "q8"])
@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_batched_verify_is_row_exact(models, quant, kernels):
    eng = Engine.load(models["deepseek", quant], kernels=kernels, threads=1)
    prompt = list(range(40, 60))
    new = [3, 99, 17, 250]
    one = eng.new_state()
    forward(one, prompt)
    rows = np.concatenate([forward(one, [t]) for t in new])
    logits_one = np.concatenate([eng.model.lm_head(eng.model.final_norm(r[None])) for r in rows])
    batch = eng.new_state()
    forward(batch, prompt)
    with row_exact(eng.kernels):
        hb = forward(batch, new)
        logits_batch = eng.model.lm_head(eng.model.final_norm(hb))
    assert np.array_equal(hb, rows)
    assert np.array_equal(logits_batch, logits_one)
    # The scope leaves the kernel set as it was.
    assert "matmul" not in vars(eng.kernels)


def test_sampling_is_refused(models):
    from formats.errors import CortiqError

    eng, stack = _load(models["deepseek", "f32"])
    with pytest.raises(CortiqError, match="greedy"):
        generate_with_engine(eng, [1, 2], make_drafter(eng.model, stack, eng.ctx), config=SamplingConfig(temperature=0.8))
