"""Prefill matmuls: the tile kernels (``kernels/amx.py``, on AMX, AVX-512 VNNI or AVX2) against dequantize + sgemm.

    python benchmarks/bench_amx_prefill.py [--reps 7] [--dtypes q8,q4,q4k] [--unit amx|vnni|avx2]
    python benchmarks/bench_amx_prefill.py --model MODEL.cmf --text TEXT.txt [--reps 5] [--threads 2] [--unit vnni]

Checks the tile kernels against ``qdot.qdot_ref`` (float64, the same rounding of the
activations: int16 for q8, int8 for the 4/5-bit dtypes, as their decode) and times it, single-threaded, against the portable prefill path
(``fast.NumbaKernels._large`` without AMX: dequantize a slice to f32, single-threaded
OpenBLAS sgemm) on SmolLM2's and TinyLlama's matrix shapes with 512 input rows. Exits
non-zero when the kernel's results are wrong; on a CPU with neither unit it says so.
``--unit``: the tile unit (default the host's: AMX where the tiles are, else VNNI, else AVX2).

``--model``: a whole 512-token prefill of a model, with and without the tiles (two
engines in one process, alternating, median of ``--reps``), and the KL divergence
between the two paths' next-token distributions over the last 64 positions. What the
activations' rounding costs on a whole text is ``cortiq ppl``'s measurement, not this
benchmark's: save the float path's distributions once, then score each kernel set against
them (``ppl`` runs in prefill, so the kernel set picks the prefill path)::

    CORTIQ_KERNELS=numba-float cortiq ppl MODEL.cmf -f TEXT.txt --mode chunks --save-ref float.cref
    cortiq ppl MODEL.cmf -f TEXT.txt --ref float.cref                          # default: int16 tiles
    CORTIQ_KERNELS=numba-i8 cortiq ppl MODEL.cmf -f TEXT.txt --ref float.cref  # int8 tiles

(``--ref`` needs the text it was saved on.)
"""

from __future__ import annotations

import numpy as np

from cortiq_engine.kernels import qdot
from cortiq_engine.kernels.fast import ACT_BITS
from cortiq_engine.kernels.amx import UNITS, TileKernels, host_unit


def main() -> int:
    import argparse
    import time

    from cortiq_engine.kernels.dtype_ops import ops_for
    from cortiq_engine.threads import set_threads
    from formats.quants import get_dtype

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model", help="time a whole prefill of this CMF model instead")
    ap.add_argument("--text", help="the prompt text for --model (its first 512 tokens)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="q8", help="comma-separated weight dtypes for the per-matrix timings")
    ap.add_argument("--unit", choices=UNITS, help="the tile unit (default the host's)")
    ap.add_argument(
        "--vnni-min-weights",
        type=int,
        default=None,
        help="with --model: the smallest fused matmul the VNNI unit takes (default the host's)",
    )
    a = ap.parse_args()
    unit = a.unit or host_unit()
    if unit is None:
        print("this CPU has neither AMX-INT8 tiles nor AVX-512 VNNI nor AVX2: nothing to measure")
        return 0
    if a.model:
        return model_prefill(a.model, a.text, a.reps, a.threads, unit, a.vnni_min_weights)
    set_threads(1)
    kern = TileKernels(cache_dir=None, unit=unit)
    rng = np.random.default_rng(0)
    bad = False
    peaks: dict[int, float | None] = {}
    for dtype in a.dtypes.split(","):
        ops = ops_for(dtype)
        dt = get_dtype(dtype)
        for rows, cols, n in ((1536, 576, 512), (576, 1536, 512), (5632, 2048, 512), (2048, 5632, 512)):
            if not dt.supports((rows, cols)):
                continue
            W = rng.standard_normal((rows, cols)).astype(np.float32)
            X = (rng.standard_normal((n, cols)) * rng.choice([1.0, 30.0], (n, cols), p=[0.98, 0.02])).astype(np.float32)
            parts = {
                k: np.ascontiguousarray(v.view(np.uint16) if v.dtype == np.float16 else v)
                for k, v in dt.named(dt.encode(W), (rows, cols)).items()
            }
            kparts = tuple(parts[k] for k in dt.kernel_parts)
            # the width the engine's decode takes, where the unit has it (AVX2: int16 only)
            bits = ACT_BITS[dtype] if ACT_BITS[dtype] in kern.widths[dtype] else 16
            res = np.empty((n, rows), np.float32)
            tile = np.empty((rows, cols), np.float32)
            scratch = np.empty(kern.scratch_bytes(dtype, rows, cols), np.uint8)

            def tiles() -> None:
                kern.rows(dtype, parts, cols, 0, rows, kern.prepare(X, bits), res, scratch)

            def sgemm() -> None:
                ops.dequant(kparts, 0, rows, tile)
                np.matmul(X, tile.T, out=res)

            tiles()
            ref = qdot.qdot_ref(dtype, parts, X, bits=bits)
            err = float(np.abs(res - ref).max() / np.abs(ref).max())
            bad |= err > 1e-5
            times = {}
            for name, f in (("tiles", tiles), ("sgemm", sgemm)) * 2:
                f()
                ts = []
                for _ in range(a.reps):
                    t = time.perf_counter()
                    f()
                    ts.append(time.perf_counter() - t)
                times[name] = float(np.median(ts))
            achieved = 2.0 * rows * cols * n / times["tiles"]
            peak = peaks.setdefault(bits, unit_peak(unit, bits))
            gap = f"; {achieved / 1e9:.0f} G ops/s = {achieved / peak:.0%} of the unit's int{bits} peak" if peak else ""
            print(
                f"{dtype} [{rows} x {cols}] x {n} rows, int{bits}: {unit} {1e3 * times['tiles']:.2f} ms, dequantize + sgemm "
                f"{1e3 * times['sgemm']:.2f} ms, {times['sgemm'] / times['tiles']:.2f}x; max error {err:.1e} of max |out|{gap}"
            )
    return 1 if bad else 0


def unit_peak(unit: str, bits: int) -> float | None:
    """One core's raw int``bits`` ops/s on ``unit`` (benchmarks/unit_peak.py); None for AMX
    tiles, which that benchmark does not measure."""
    if unit == "amx":
        return None
    from unit_peak import peak_ops

    return peak_ops(unit, bits)


def model_prefill(path: str, text: str | None, reps: int, threads: int, unit: str, vnni_min: int | None = None) -> int:
    import os
    import time

    from cortiq_engine.engine import Engine
    from cortiq_engine.kernels.fast import NumbaKernels
    from cortiq_engine.model import forward

    extra = {} if vnni_min is None else {"vnni_min_weights": vnni_min}
    engs = {
        name: Engine.load(path, threads=threads, kernels=NumbaKernels(amx_tiles=flag, tile_unit=unit, **extra))
        for name, flag in (("tiles", True), ("sgemm", False))
    }
    words = open(text, encoding="utf-8").read() if text else "The history of Rome " * 400
    ids = engs["tiles"].tokenizer.encode(words)[:512]
    print(f"load average {os.getloadavg()[0]:.2f}; {len(ids)} tokens, {threads} threads, tiles on {unit}")
    times: dict[str, list[float]] = {k: [] for k in engs}
    logp = {}
    for _ in range(reps):
        for name, eng in engs.items():
            t = time.perf_counter()
            h = forward(eng.new_state(len(ids)), ids)
            times[name].append(time.perf_counter() - t)
            logp[name] = _logp(eng, h[-64:])
    med = {k: float(np.median(v)) for k, v in times.items()}
    kl = float((np.exp(logp["sgemm"]) * (logp["sgemm"] - logp["tiles"])).sum(axis=1).mean())
    same = float((logp["sgemm"].argmax(1) == logp["tiles"].argmax(1)).mean())
    print(
        f"prefill {len(ids)}: tiles {len(ids) / med['tiles']:.0f} tok/s, sgemm {len(ids) / med['sgemm']:.0f} tok/s, "
        f"{med['sgemm'] / med['tiles']:.2f}x; KL(sgemm || tiles) {kl:.2e}, same top-1 {same:.3f}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    return 0


def _logp(eng, h: np.ndarray) -> np.ndarray:
    """Next-token log-probabilities of hidden rows ``h`` (float64)."""
    z = eng.model.lm_head(eng.model.final_norm(h)).astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


if __name__ == "__main__":
    raise SystemExit(main())
