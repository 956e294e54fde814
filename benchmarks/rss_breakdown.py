#!/usr/bin/env python3
"""Where a loaded model's resident memory goes, stage by stage, in one fresh process.

    python benchmarks/rss_breakdown.py MODEL.cmf [--json]

RSS after each stage: the interpreter and numpy; ``import numba`` (llvmlite's LLVM
library pages, numba's modules); numba's first dispatch of a compiled function (its
typing and target contexts, built on the first call even when the machine code comes
from the on-disk cache); ``Engine.load`` without warmup; the warmup; a first forward
of one token (the weights' pages) and its lm_head. ``file + X`` in
docs/performance.md is the last figure minus the file's size; this splits X into
numba's fixed cost and the engine's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not os.path.exists("/proc/self/statm"):
        print("needs Linux's /proc/self/statm")
        return 1
    stages: list[tuple[str, float]] = [("python + numpy", (__import__("numpy"), rss_mib())[1])]
    import numpy as np

    import numba  # noqa: F401

    stages.append(("import numba", rss_mib()))
    from cortiq_engine.kernels import qdot

    x = np.ones((1, 32), np.float32)
    qdot.quantize_rows(x, np.empty((1, 32), np.int8), np.empty((1, 1), np.float32), np.empty((1, 1), np.float32), 127)
    stages.append(("numba's first dispatch (a cached function)", rss_mib()))
    from cortiq_engine import Engine
    from cortiq_engine.model import forward

    eng = Engine.load(a.model, warmup=False)
    stages.append(("Engine.load (no warmup): tokenizer, model description", rss_mib()))
    eng.warmup()
    stages.append(("warmup: kernels compiled or loaded, one token forwarded", rss_mib()))
    h = forward(eng.new_state(8), [0, 1])
    eng.model.lm_head(eng.model.final_norm(h))
    stages.append(("a 2-token forward and its lm_head", rss_mib()))
    size = os.path.getsize(a.model) / 2**20
    out = {
        "model": a.model,
        "file_mib": size,
        "stages": [{"stage": s, "rss_mib": r} for s, r in stages],
        "over_file_mib": stages[-1][1] - size,
        "numba_fixed_mib": stages[2][1] - stages[0][1],
    }
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    prev = 0.0
    for s, r in stages:
        print(f"{s:58s} {r:7.1f} MiB  (+{r - prev:6.1f})")
        prev = r
    print(
        f"file {size:.1f} MiB; resident over the file {out['over_file_mib']:.1f} MiB, of which numba's import "
        f"and first dispatch {out['numba_fixed_mib']:.1f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
