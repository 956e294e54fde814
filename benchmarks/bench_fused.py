#!/usr/bin/env python3
"""Decode steps through the fused call against the same steps layer by layer, in one process.

    python benchmarks/bench_fused.py MODEL.cmf [--threads 2] [--rounds 5] [--tokens 64] [--rows 1] [--kv-cache f16]

Each round times ``--tokens`` steps of ``--rows`` rows (1: decode; 2-16: a verify's rows)
after a 64-token prompt, once fused and once with ``forward(..., layerwise=True)``,
alternating; the step includes the final norm and the output matrix. Prints the medians,
their ratio and the load average. Both paths give the same bits (tests/test_fused.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from cortiq_engine import Engine
from cortiq_engine.model import forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--kv-cache", default="f32", help="the KV cache's element type (f32 | f16)")
    a = ap.parse_args()
    engine = Engine.load(a.model, threads=a.threads, kv_cache=a.kv_cache)
    model = engine.model
    if model.fused is None:
        print(f"{a.model}: its stack takes the layer-by-layer path only (see kernels/fused.py)")
        return 1
    prompt = list(range(100, 164))

    def ms_per_step(layerwise: bool) -> float:
        state = engine.new_state(64 + a.rows * a.tokens + 1)
        forward(state, prompt)
        t = time.perf_counter()
        for i in range(a.tokens):
            h = forward(state, [1000 + i] * a.rows, layerwise)
            model.lm_head(model.final_norm(h))
        return (time.perf_counter() - t) / a.tokens * 1e3

    ms_per_step(False), ms_per_step(True)  # compile / page in
    load0 = os.getloadavg()[0]
    fused, layers = [], []
    for _ in range(a.rounds):
        fused.append(ms_per_step(False))
        layers.append(ms_per_step(True))
    f, lw = statistics.median(fused), statistics.median(layers)
    print(
        f"{a.model}: {a.rows} row(s) a step, {a.threads} threads, {a.kv_cache} cache, "
        f"median of {a.rounds} rounds of {a.tokens}"
    )
    print(f"  fused       {f:7.3f} ms/step   {np.round(fused, 2).tolist()}")
    print(f"  layerwise   {lw:7.3f} ms/step   {np.round(layers, 2).tolist()}")
    print(f"  layerwise / fused {lw / f:.2f}x; load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
