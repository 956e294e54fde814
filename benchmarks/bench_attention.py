"""Attention kernel timings: the LLVM IR loops (``kernels/attn_ir.py``) against numba's.

    python benchmarks/bench_attention.py [--heads 32 --kv-heads 4 --head-dim 64 --ctx 2048 --layers 22]

For one decode row and a 4-row verify at ``--ctx`` keys: ``jit.attend`` with the IR
loops and with numba's loops, alternating, median of ``--reps`` calls; "hot" repeats
one layer's cache (it stays in L2/L3), "cold" cycles through ``--layers`` caches with
a pass over 60 MB between them, as a decode step's weights evict the caches. Then a
512-token prefill chunk through the engine's kernel set (IR loops vs the BLAS blocks).
Prints one JSON line per figure; never asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()

    from cortiq_engine.kernels import attn_ir, jit
    from cortiq_engine.kernels.fast import NumbaKernels

    rng = np.random.default_rng(0)
    cap = a.ctx + 64
    shape = (a.kv_heads, cap, a.head_dim)
    caches = [(rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32))
              for _ in range(a.layers)]
    evict = np.ones(60_000_000 // 4, np.float32)
    ir, plain = attn_ir.AttentionLoops().addrs, np.zeros(3, np.int64)
    scale = np.float32(a.head_dim**-0.5)
    print(json.dumps({"loadavg": os.getloadavg(), "shape": vars(a), "ir_available": bool(ir.any())}))
    for n in (1, 4):
        q = rng.standard_normal((n, a.heads, a.head_dim)).astype(np.float32)
        out = np.empty_like(q)
        start = a.ctx - n
        for mode in ("hot", "cold"):
            times: dict[str, list[float]] = {"ir": [], "numba": []}
            reps = a.reps if mode == "hot" else max(3, a.reps // 40)
            for rep in range(reps + 1):
                for name, fns in (("ir", ir), ("numba", plain)):
                    if mode == "hot":
                        kc, vc = caches[0]
                        t = time.perf_counter()
                        jit.attend(q, kc, vc, start, 0, scale, None, out, fns)
                        dt = time.perf_counter() - t
                    else:
                        dt = 0.0
                        for layer, (kc, vc) in enumerate(caches):
                            if layer % 4 == 0:
                                evict[::16].sum()
                            t = time.perf_counter()
                            jit.attend(q, kc, vc, start, 0, scale, None, out, fns)
                            dt += time.perf_counter() - t
                        dt /= len(caches)
                    if rep:  # the first round compiles and warms
                        times[name].append(dt)
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(json.dumps({"rows": n, "caches": mode, "ir_ms": round(med["ir"], 4), "numba_ms": round(med["numba"], 4),
                              "speedup": round(med["numba"] / med["ir"], 2)}))
    # a prefill chunk through the kernel set: the IR loops, then the BLAS blocks
    n = 512
    q = rng.standard_normal((n, a.heads, a.head_dim)).astype(np.float32)
    kc, vc = caches[0]
    with_ir, without = NumbaKernels(), NumbaKernels(attn_loops=False)
    times = {"ir": [], "blas": []}
    for rep in range(6):
        for name, ks in (("ir", with_ir), ("blas", without)):
            t = time.perf_counter()
            ks.attend(q, kc, vc, 0, 0, scale)
            if rep:
                times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(json.dumps({"prefill_rows": n, "ir_ms": round(med["ir"], 3), "blas_ms": round(med["blas"], 3),
                      "speedup": round(med["blas"] / med["ir"], 2), "loadavg_end": os.getloadavg()}))


if __name__ == "__main__":
    main()
