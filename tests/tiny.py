"""Tiny random-weight HF checkpoints built with transformers' own config classes.

``save_tiny(model_type, folder, **overrides)`` writes config.json, model.safetensors,
generation_config.json and a byte-level tokenizer.json (one token per byte, so any
text round-trips), and returns the folder. Weights are seeded: same call, same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
)


def write_byte_tokenizer(folder: Path, vocab_size: int = 256) -> None:
    """A byte-level BPE with no merges: token id == byte rank, 256 ids used."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


def config_class(model_type: str):
    import transformers

    return transformers.AutoConfig.for_model(model_type).__class__


def build_tiny(model_type: str, seed: int = 0, **overrides: Any):
    """The transformers model (eval mode, f32) for a tiny config of ``model_type``."""
    import torch
    import transformers

    kw = {**BASE, **overrides}
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Random init leaves norms at 1 and biases at 0; perturb them so the test sees them.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def save_tiny(model_type: str, folder: str | Path, seed: int = 0, dtype: str = "float32", **overrides: Any) -> Path:
    import torch

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model = build_tiny(model_type, seed=seed, **overrides)
    if dtype != "float32":
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder
