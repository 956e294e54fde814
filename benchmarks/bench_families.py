"""Decode speed of every architecture family per weight byte, against Llama's.

Each family gets a random checkpoint of one size class (hidden 576, 12 layers: the
SmolLM2-135M shape; MoE families with 16 experts of width 384), built with
transformers' own config class, converted to q8 and q4 and timed with
``cortiq bench -p 0 -n N`` in its own process. The figure that compares families of
different shapes is the weight bytes a decode step reads per second: the CMF's tensor
bytes, with routed experts counted at top_k / experts (a token reads only its own)
and the embedding table left out (a step reads one row of it; a tied table still
counts once, as the lm_head). A family whose ratio to Llama's is near 1 runs on the
same kernels at the same pace; one well below it spends time elsewhere.

    python benchmarks/bench_families.py --out /tmp/fam --threads 2 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BASE = dict(
    vocab_size=16384,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=12,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
_MOE = dict(
    n_routed_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=384,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
)
FAMILIES: dict[str, dict] = {
    "llama": {},
    "phi3": {},
    "gemma2": dict(query_pre_attn_scalar=64, sliding_window=512),
    "olmo2": {},
    "granite": dict(
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625, logits_scaling=8.0
    ),
    "smollm3": {},
    "deepseek_v3": dict(
        _MOE,
        q_lora_rank=192,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_key_value_heads=9,
    ),
    "glm4_moe": dict(_MOE, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True),
    "gpt_oss": dict(
        num_local_experts=16,
        num_experts_per_tok=2,
        intermediate_size=384,
        sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 6,
    ),
}


def build(model_type: str, folder: Path) -> Path:
    import torch
    import transformers

    from tests.tiny import write_byte_tokenizer

    if (folder / "config.json").exists():
        return folder
    cfg = transformers.AutoConfig.for_model(model_type, **{**BASE, **FAMILIES[model_type]})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder


def active_bytes(cmf_path: Path) -> int:
    """Weight bytes one decode step reads (see the module doc)."""
    from formats.cmf import CmfFile
    from formats.tokenizer_header import TOKENIZER_TENSOR
    from cortiq_engine.models import read_arch

    with CmfFile(cmf_path) as f:
        arch = read_arch(f)
        frac = arch.moe.top_k / arch.moe.num_experts if arch.moe is not None else 1.0
        total = 0.0
        for name in f.names():
            info = f.info(name)
            if name == TOKENIZER_TENSOR:
                continue
            if name == "model.embed_tokens.weight" and not arch.tie_word_embeddings:
                continue
            total += info.nbytes * (frac if re.search(r"\.mlp\.experts\.\d+\.", name) else 1.0)
    return int(total)


def decode_tok_s(cmf_path: Path, threads: int, n_gen: int, reps: int) -> float:
    cmd = [
        str(Path(sys.executable).parent / "cortiq"),
        "bench",
        str(cmf_path),
        "-p",
        "0",
        "-n",
        str(n_gen),
        "-r",
        str(reps),
        "-t",
        str(threads),
        "--no-mtp",
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = [r for r in json.loads(out)["rows"] if r["test"].startswith("tg")]
    return statistics.median(rows[0]["tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the checkpoints and CMF files (reused)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--quants", default="q8,q4")
    args = ap.parse_args()
    from cortiq_engine.convert import convert_checkpoint

    rows = []
    for mt in args.families.split(","):
        src = build(mt, args.out / mt / "hf")
        for q in args.quants.split(","):
            cmf = args.out / mt / f"{q}.cmf"
            if not cmf.exists():
                convert_checkpoint(src, cmf, quant=q, mtp="drop")
            b = active_bytes(cmf)
            tps = decode_tok_s(cmf, args.threads, args.n_gen, args.reps)
            rows.append(dict(family=mt, quant=q, active_mib=b / 2**20, tok_s=tps, gib_s=b * tps / 2**30))
            print(json.dumps(rows[-1]), flush=True)
    ref = {r["quant"]: r["gib_s"] for r in rows if r["family"] == "llama"}
    print(f"\nload {os.getloadavg()[0]:.2f}; {args.threads} threads, median of {args.reps} x {args.n_gen} tokens")
    print("| family | quant | weight MiB read / token | decode tok/s | GiB/s | vs llama |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rel = r["gib_s"] / ref[r["quant"]] if r["quant"] in ref else float("nan")
        print(
            f"| {r['family']} | {r['quant']} | {r['active_mib']:.1f} | {r['tok_s']:.1f} | {r['gib_s']:.2f} | {rel:.2f} |"
        )


if __name__ == "__main__":
    main()
