"""``cortiq import-gguf``: GGUF -> HF checkpoint folder.

Oracles: transformers loading the GGUF itself (weights, logits, tokenizer), llama.cpp's
own tokenizer (llama-cpp-python), and for tiny synthetic GGUFs written here the way
llama.cpp's converter writes them, the original transformers model they came from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from formats.errors import CortiqError
from cortiq_engine.convert import import_gguf
from formats.gguf_import import unpermute_rope_rows
from tests.tiny import build_tiny

# Both transformers' GGUF tokenizer and llama.cpp agree on these.
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "In 1865, Lewis Carroll published a book of 27,000 words; it cost 7s 6d.",
    "Ünïcödé — naïve café, 日本語のテキスト, emoji 🤖🚀 and Ελληνικά.",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\tand\ttabs\n\nnewlines   ",
    "It's don't we'll they've I'm you'd",
    "def f(x):\n    return x**2  # 1234567890",
]
# Where transformers' GGUF tokenizer, which ignores the "smollm" pre-tokenizer's
# digit split, differs from llama.cpp: only llama.cpp is the oracle here.
DIGIT_EDGE_CASES = ["x² + y³ = z⁴ and ½ ¼ ²³", "Ⅻ ① ٣٤٥ ๑๒"]


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


# ------------------------------------------------------------------ the real model


def test_files_and_config(smollm2_hf: Path, smollm2_gguf: Path):
    from safetensors import safe_open

    from cortiq_engine.models import parse_config

    cfg = json.loads((smollm2_hf / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]) == (49152, 576, 1536)
    heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    assert cfg["num_hidden_layers"] == 30 and heads == (9, 3, 64)
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5 and cfg["tie_word_embeddings"] is True
    arch = parse_config(cfg)
    assert arch.num_kv_heads == 3 and arch.tie_word_embeddings
    with safe_open(smollm2_hf / "model.safetensors", "np") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "lm_head.weight" not in names and len(names) == 2 + 30 * 9
    tcfg = json.loads((smollm2_hf / "tokenizer_config.json").read_text())
    assert (tcfg["bos_token"], tcfg["eos_token"], tcfg["add_bos_token"]) == ("<|im_start|>", "<|im_end|>", False)
    assert "<|im_start|>assistant" in tcfg["chat_template"]
    gen = json.loads((smollm2_hf / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)


def test_tokenizer_matches_gguf_tokenizers(smollm2_hf: Path, smollm2_gguf: Path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(smollm2_hf / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(smollm2_hf)
    ref = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    for text in SENTENCES:
        want = ref(text).input_ids
        assert raw.encode(text).ids == want, text
        assert auto(text).input_ids == want, text
        assert raw.decode(want, skip_special_tokens=False) == text
    # Chat special tokens stay whole, and the chat template renders the same ids.
    assert raw.encode("<|im_start|><|im_end|>").ids == [1, 2]
    msgs = [{"role": "user", "content": "Name a colour."}]
    ours = auto.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    theirs = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ours == theirs and ours[0] == 1


@pytest.mark.llamacpp
def test_tokenizer_matches_llama_cpp(smollm2_hf: Path, smollm2_gguf: Path):
    """llama.cpp's own tokenizer is a second oracle (the bench extra builds it)."""
    import llama_cpp
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(smollm2_hf / "tokenizer.json"))
    lcpp = llama_cpp.Llama(str(smollm2_gguf), vocab_only=True, verbose=False)
    for text in SENTENCES + DIGIT_EDGE_CASES:
        assert raw.encode(text).ids == lcpp.tokenize(text.encode(), add_bos=False, special=True), text


@pytest.mark.slow
@pytest.mark.llamacpp
def test_gemma3_tokenizer_matches_llama_cpp(gemma3_gguf: Path):
    """Gemma's user-defined tokens (whitespace runs up to 31 spaces, HTML tags) match
    whole and longest first, as in SentencePiece and llama.cpp: 54 spaces are 31 + 23
    (a BPE over the runs would give 16 + 16 + 22; the bundled texts have such runs).
    llama.cpp is the oracle here, as above (the bench extra builds it)."""
    import llama_cpp
    from tokenizers import Tokenizer

    from evals.text_source import BUNDLED_CORPORA
    from cortiq_engine.convert import read_gguf

    ours = Tokenizer.from_str(read_gguf(gemma3_gguf).tokenizer.tokenizer_json)
    lcpp = llama_cpp.Llama(str(gemma3_gguf), vocab_only=True, verbose=False)
    texts = SENTENCES + ["to\n" + " " * 54 + "sea", "a" + " " * 40 + "b<table>", "x\n\n\n   y  \t z"]
    texts += [path.read_text(encoding="utf-8") for path, _ in BUNDLED_CORPORA.values()]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False).ids == lcpp.tokenize(
            text.encode(), add_bos=False, special=True
        ), text[:80]


def test_greedy_chat_answer_is_sensible(smollm2_hf: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_hf)
    model = AutoModelForCausalLM.from_pretrained(smollm2_hf).eval()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_logits_match_transformers_gguf_loader(smollm2_hf: Path, smollm2_gguf: Path, english_text: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = AutoModelForCausalLM.from_pretrained(smollm2_hf, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    ref_sd = ref.state_dict()
    for name, w in ours.state_dict().items():
        assert torch.allclose(w, ref_sd[name], rtol=0, atol=1e-6), name
    tok = AutoTokenizer.from_pretrained(smollm2_hf)
    start = english_text.index("Alice was beginning") if "Alice was beginning" in english_text else 0
    ids = tok(english_text[start : start + 600], return_tensors="pt").input_ids[:, :128]
    with torch.no_grad():
        a, b = ours(ids).logits[0].numpy(), ref(ids).logits[0].numpy()
    assert _rel(a, b) <= 1e-4


# ------------------------------------------------------------------ tiny GGUFs written like llama.cpp

_HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
TINY = dict(vocab_size=258, head_dim=16)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF rotary halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_tokens() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|s|>", "<|e|>"]


def write_tiny_gguf(
    model,
    path: Path,
    arch: str,
    rope_freqs: np.ndarray | None = None,
    tokenizer_model: str = "gpt2",
    vocab: tuple[list[str], list[str], str] | None = None,  # (tokens, merges, pre); default: bytes only
    qtypes: dict[str, str] | None = None,  # HF name -> GGML type its matrix is stored in (gguf-py quantizes)
) -> Path:
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    toks, merges, pre = vocab or (byte_tokens(), [], "default")
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(toks)
    w.add_token_types([1] * (len(toks) - 2) + [3, 3])  # the last two are control tokens
    if merges:
        w.add_token_merges(merges)
    w.add_bos_token_id(len(toks) - 2)
    w.add_eos_token_id(len(toks) - 1)
    w.add_chat_template("{% for m in messages %}<|s|>{{ m['content'] }}<|e|>{% endfor %}")
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        x = t.detach().numpy().astype(np.float32)
        if name in _TOP:
            gname = _TOP[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{_HF_TO_GGUF[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                x = llama_cpp_permute(x, cfg.num_attention_heads)
            if arch == "llama" and module == "self_attn.k_proj":
                x = llama_cpp_permute(x, cfg.num_key_value_heads)
        qtype = (qtypes or {}).get(name)
        if qtype is None:
            w.add_tensor(gname, x)
        else:
            qt = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gname, gguf.quants.quantize(x, qt), raw_dtype=qt)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _logits(model, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_unpermute_is_the_inverse_of_llama_cpp_permute():
    # One head of size 8: HF rows [0..7] are stored as pairs (0,4) (1,5) (2,6) (3,7).
    rows = np.arange(8.0)[:, None]
    assert llama_cpp_permute(rows, 1).ravel().tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    w = np.random.default_rng(0).normal(size=(3 * 16, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


@pytest.mark.parametrize(
    "arch,overrides",
    # Qwen3's head size is not hidden/heads (and transformers' GGUF loader assumes 128).
    [("llama", {}), ("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {"head_dim": 128})],
    ids=["llama", "llama-tied", "qwen2", "qwen3"],
)
def test_tiny_gguf_round_trip(tmp_path: Path, arch: str, overrides: dict):
    import torch
    from transformers import AutoModelForCausalLM

    src = build_tiny(arch, **{**TINY, **overrides})
    gguf_path = write_tiny_gguf(src, tmp_path / "tiny.gguf", arch)
    report = import_gguf(gguf_path, tmp_path / "hf")
    assert report.tied_embeddings == bool(overrides.get("tie_word_embeddings"))
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    src_sd, ours_sd = src.state_dict(), ours.state_dict()
    assert set(ours_sd) == set(src_sd)
    for name in src_sd:
        assert torch.equal(ours_sd[name], src_sd[name]), name
    ids = [256, *b"Hello, tiny model!"]
    assert np.array_equal(_logits(ours, ids), _logits(src, ids))
    # transformers' own GGUF loader reads the same file to the same weights.
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).eval()
    ref_sd = ref.state_dict()
    for name in src_sd:
        assert torch.equal(ours_sd[name], ref_sd[name]), name
    # The byte tokenizer with its two control tokens.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    toks = byte_tokens()
    assert tok.encode("<|s|>hi<|e|>").ids == [256, toks.index("h"), toks.index("i"), 257]


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    src = build_tiny("llama", **TINY, rope_parameters={"rope_theta": 10000.0, **scaling})
    # llama.cpp's converter: per-frequency divisors from the same four numbers.
    inv = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
    wavelen = 2 * np.pi / inv
    smooth = np.clip((64 / wavelen - 1.0) / (4.0 - 1.0), 0, 1)
    freqs = 1.0 / ((1 - smooth) / 8.0 + smooth)
    assert ((freqs > 1) & (freqs < 8)).sum() == 2  # two frequencies fall in the blended band
    import_gguf(write_tiny_gguf(src, tmp_path / "t.gguf", "llama", rope_freqs=freqs), tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["rope_scaling"] == scaling
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = list(range(40, 140))  # past original_max_position_embeddings
    assert _rel(_logits(ours, ids), _logits(src, ids)) < 1e-5


@pytest.fixture(scope="module")
def trained_bpe(english_text: str) -> tuple[list[str], list[str]]:
    """A small byte-level BPE trained here on English: (tokens, merges)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=alphabet, show_progress=False)
    corpus = english_text[:60000] + " 1234567 12,345.678 2024-05-01 THEY'RE WE'LL it's"
    bpe.train_from_iterator([corpus[i : i + 1000] for i in range(0, len(corpus), 1000)], trainer)
    data = json.loads(bpe.to_str())["model"]
    tokens = [t for t, _ in sorted(data["vocab"].items(), key=lambda kv: kv[1])]
    return tokens + ["<|s|>", "<|e|>"], [" ".join(m) if isinstance(m, list) else m for m in data["merges"]]


@pytest.mark.llamacpp
@pytest.mark.parametrize("pre", ["default", "gpt-2", "falcon", "smollm", "llama-bpe", "qwen2"])
def test_pre_tokenizers_match_llama_cpp(tmp_path: Path, trained_bpe, pre: str):
    """The same vocabulary under each ``tokenizer.ggml.pre`` name: the imported
    tokenizer.json must split and merge exactly as llama.cpp does."""
    import llama_cpp
    from tokenizers import Tokenizer

    tokens, merges = trained_bpe
    src = build_tiny("llama", **{**TINY, "vocab_size": len(tokens)})
    gguf_path = write_tiny_gguf(src, tmp_path / "t.gguf", "llama", vocab=(tokens, merges, pre))
    import_gguf(gguf_path, tmp_path / "hf")
    ours = Tokenizer.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    lcpp = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
    texts = (
        SENTENCES
        + DIGIT_EDGE_CASES
        + [
            "Alice said 1234567 times: 12,345.678 on 2024-05-01!!",
            "THEY'RE here, WE'LL see; it's   fine\n\n\tok $5+3<=8 ^~| `x`",
            "<|s|>Down the Rabbit-Hole<|e|>",
        ]
    )
    for text in texts:
        ids = lcpp.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text, add_special_tokens=False).ids == ids, (pre, text)
        # With special tokens: BOS exactly when llama.cpp adds one (llama-3 family by default).
        assert ours.encode(text).ids == lcpp.tokenize(text.encode(), add_bos=True, special=True), (pre, text)


@pytest.mark.parametrize("factor", [8.0, 32.0])  # Llama 3.1, Llama 3.2
def test_llama3_parameters_from_real_sized_rope_freqs(factor: float):
    from formats.gguf_import import _llama3_from_rope_freqs

    inv = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    smooth = np.clip((8192 * inv / (2 * np.pi) - 1.0) / 3.0, 0, 1)
    freqs = (1.0 / ((1 - smooth) / factor + smooth)).astype(np.float32)
    got = _llama3_from_rope_freqs(freqs.astype(np.float64), 500000.0, 128, None)
    assert got == {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}  # fmt: skip
    with pytest.raises(CortiqError, match="rope_freqs"):
        _llama3_from_rope_freqs(freqs.astype(np.float64) ** 1.1, 500000.0, 128, None)


def test_bf16_weights(tmp_path: Path):
    import torch
    from safetensors.torch import load_file

    src = build_tiny("llama", **TINY)
    import_gguf(write_tiny_gguf(src, tmp_path / "t.gguf", "llama"), tmp_path / "hf", dtype="bf16")
    sd = load_file(tmp_path / "hf" / "model.safetensors")
    w = sd["model.layers.0.mlp.up_proj.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, src.state_dict()["model.layers.0.mlp.up_proj.weight"].to(torch.bfloat16))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_sentencepiece_tokenizer_is_refused_before_writing(tmp_path: Path):
    write_tiny_gguf(build_tiny("llama", **TINY), tmp_path / "spm.gguf", "llama", tokenizer_model="llama")
    with pytest.raises(CortiqError, match="tokenizer model 'llama' is not supported"):
        import_gguf(tmp_path / "spm.gguf", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spm.gguf"]


def test_failure_mid_write_leaves_nothing_and_keeps_the_old_folder(tmp_path: Path, monkeypatch):
    import formats.gguf_import as gi

    gguf_path = write_tiny_gguf(build_tiny("llama", **TINY), tmp_path / "t.gguf", "llama")
    real, calls = gi.dequantized, []

    def failing(model, p):
        calls.append(p.name)
        if len(calls) == 5:
            raise OSError("disk full")
        return real(model, p)

    monkeypatch.setattr(gi, "dequantized", failing)
    with pytest.raises(OSError, match="disk full"):
        import_gguf(gguf_path, tmp_path / "new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.gguf"]
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("mine")
    calls.clear()
    with pytest.raises(OSError, match="disk full"):
        import_gguf(gguf_path, tmp_path / "old", force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "t.gguf"]
    assert (tmp_path / "old" / "keep.txt").read_text() == "mine"


# ------------------------------------------------------------------ the CLI


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "cortiq_cli.main", "import-gguf", *map(str, args)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(build_tiny("llama", **TINY), tmp_path_factory.mktemp("g") / "tiny.gguf", "llama")


def _bad_inputs(tmp: Path, good: Path) -> dict[str, tuple[Path, str]]:
    import gguf

    data = good.read_bytes()
    (tmp / "text.gguf").write_text("hello, I am not a GGUF\n")
    (tmp / "head.gguf").write_bytes(data[:200])
    (tmp / "cut.gguf").write_bytes(data[: len(data) - 1000])
    w = gguf.GGUFWriter(str(tmp / "bert.gguf"), "bert")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {
        "not-gguf": (tmp / "text.gguf", "not a GGUF file"),
        "truncated-header": (tmp / "head.gguf", "truncated"),
        "truncated-data": (tmp / "cut.gguf", "truncated"),
        "architecture": (tmp / "bert.gguf", "unsupported GGUF architecture 'bert'"),
        "missing": (tmp / "nope.gguf", "no such file"),
    }


@pytest.mark.parametrize("case", ["not-gguf", "truncated-header", "truncated-data", "architecture", "missing"])
def test_cli_bad_input_is_one_line_and_leaves_nothing(tmp_path: Path, tiny_gguf: Path, case: str):
    inp, message = _bad_inputs(tmp_path, tiny_gguf)[case]
    before = sorted(p.name for p in tmp_path.iterdir())
    r = _cli(inp, tmp_path / "out")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no OUT_DIR, no temp folder


def test_cli_existing_output_needs_force(tmp_path: Path, tiny_gguf: Path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    r = _cli(tiny_gguf, out)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {out} exists (use --force to overwrite)"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    r = _cli(tiny_gguf, out, "--force", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["architecture"] == "llama" and report["vocab_size"] == 258 and report["tied_embeddings"] is False
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_cli_table(tmp_path: Path, tiny_gguf: Path):
    r = _cli(tiny_gguf, tmp_path / "hf")
    assert r.returncode == 0, r.stderr
    assert "tiny llama" in r.stdout and "258 tokens" in r.stdout and "F32 x" in r.stdout


def test_deepseek_v3_pre_tokenizer_splits_as_llama_cpp():
    """llama.cpp's deepseek-v3 splitting (LLAMA_VOCAB_PRE_TYPE_DEEPSEEK3_LLM): digits in
    threes, CJK/kana runs apart, then the letters/punctuation pattern; what DeepSeek-V3's
    own tokenizer.json does with the same three Split steps before its byte-level step."""
    from formats.gguf_tokenizer import PRE_TOKENIZERS, _pre_tokenizer

    pre = PRE_TOKENIZERS["deepseek-v3"]
    pieces = [w for w, _ in _pre_tokenizer(pre.regexes).pre_tokenize_str("Hello, world! 1234567 你好世界 ok.\n\n  x")]
    space, nl = "\u0120", "\u010a"
    assert pieces == [
        "Hello",
        ",",
        space + "world",
        "!",
        space,
        "123",
        "456",
        "7",
        space,
        "ä½łå¥½ä¸ĸçķĮ",
        space + "ok",
        "." + nl + nl,
        space,
        space + "x",
    ]
    assert not pre.clean_spaces


@pytest.mark.parametrize(
    "key,value",
    [
        ("llama.attention.value_length", "sixteen"),
        ("llama.rope.dimension_count", [4, 4]),
        ("llama.feed_forward_length", "128"),
        ("llama.block_count", 2.5),
    ],
)
def test_retyped_metadata_is_one_line(tmp_path, key, value):
    """A GGUF whose metadata value has the wrong type (an attacker recomputes nothing
    here: GGUF has no checksums) is one CortiqError naming it, never a traceback."""
    import gguf

    from cortiq_engine.convert import read_gguf
    from formats.errors import CortiqError
    from tests.tiny import build_tiny

    src = write_tiny_gguf(build_tiny("llama", **TINY), tmp_path / "t.gguf", "llama")
    reader = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(tmp_path / "r.gguf"), "llama")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        v = value if name == key else field.contents()
        vtype = field.types[0] if name != key else None
        if isinstance(v, list):
            w.add_array(name, v)
        elif vtype is not None:
            w.add_key_value(name, v, vtype)
        elif isinstance(v, str):
            w.add_string(name, v)
        elif isinstance(v, float):
            w.add_float32(name, v)
        else:
            w.add_uint32(name, v)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CortiqError) as e:
        read_gguf(tmp_path / "r.gguf")
    assert "\n" not in str(e.value) and (key.split(".", 1)[1] in str(e.value) or "bad value" in str(e.value)), str(
        e.value
    )
