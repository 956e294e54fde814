"""Decode speed of quantized dtypes per weight byte, against q4k's.

A random Llama whose every row is a multiple of 256 (hidden 1,024, FFN 2,048, 8
layers, vocabulary 8,192: 101M weights), so each file is its dtype throughout but for
the embedding and output matrices (the 3-5-bit presets keep them at q6k), is converted
to each dtype and timed with ``cortiq bench -p 0 -n N -r R`` in its own process (the
installed command: PYTHONPATH selects another checkout), the dtypes alternating round
after round (a busy neighbour then weighs on every dtype alike). "Weight bytes a step"
are the CMF's tensor bytes without the embedding table (``bench_families.active_bytes``);
"per weight byte" is the bytes a step reads per second over the first dtype's, "per
token" its tokens per second over the first dtype's. Both ratios are also taken within
each round, whose median is the figure to trust on a shared machine; every round prints
its load average.

``--cpu-time`` times the same decode in this process on one thread by the CPU time
it spends (``time.process_time``), the tokens per second of a core that is never taken
away: on a machine whose load exceeds its cores, wall-clock rounds measure the
scheduler more than the kernels.

    python benchmarks/bench_dtype_decode.py --out /tmp/dtypes --quants q4k,iq4_xs,q3k,q8 --rounds 5
    python benchmarks/bench_dtype_decode.py --out /tmp/dtypes --quants q4k,iq4_xs,q3k --rounds 9 --cpu-time
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_families import active_bytes, decode_tok_s  # noqa: E402

SHAPE = dict(vocab=8192, hidden=1024, layers=8)


def build(folder: Path) -> Path:
    """The random checkpoint (tests.test_convert's numpy-written Llama), once."""
    from tests.test_convert import _write_llama

    if not (folder / "config.json").exists():
        _write_llama(folder, **SHAPE)
    return folder


def cpu_timer(cmfs: dict[str, Path], n_gen: int):
    """A function of a dtype giving its decode tokens per CPU second on one thread (one
    generate call of ``n_gen`` tokens after a one-token prompt), the engines loaded once."""
    import time

    from cortiq_engine import Engine, SamplingConfig
    from cortiq_engine.threads import set_threads

    set_threads(1)
    engines = {q: Engine.load(path) for q, path in cmfs.items()}
    for e in engines.values():
        e.generate([1], SamplingConfig(), max_tokens=4, ignore_eos=True)  # warm-up

    def tok_s(q: str) -> float:
        t = time.process_time()
        engines[q].generate([1], SamplingConfig(), max_tokens=n_gen + 1, ignore_eos=True)
        return (n_gen + 1) / (time.process_time() - t)

    return tok_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the checkpoint and CMF files (reused)")
    ap.add_argument("--quants", default="q4k,iq4_xs,q3k,q8", help="dtypes, the first the reference")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=64)
    ap.add_argument("--cpu-time", action="store_true", help="tokens per CPU second on one thread, in this process")
    args = ap.parse_args()
    from cortiq_engine.convert import convert_checkpoint

    args.out.mkdir(parents=True, exist_ok=True)
    src = build(args.out / "src")
    quants = args.quants.split(",")
    cmfs, nbytes = {}, {}
    for q in quants:
        cmfs[q] = args.out / f"{q}.cmf"
        if not cmfs[q].exists():
            convert_checkpoint(src, cmfs[q], quant=q)
        nbytes[q] = active_bytes(cmfs[q])
    ref = quants[0]
    if args.cpu_time:
        timer = cpu_timer(cmfs, args.n_gen)
    else:

        def timer(q: str) -> float:
            return decode_tok_s(cmfs[q], args.threads, args.n_gen, args.reps)

    tok_s: dict[str, list[float]] = {q: [] for q in quants}
    for rnd in range(args.rounds):
        for q in quants:
            tok_s[q].append(timer(q))
        row = {q: round(tok_s[q][-1], 1) for q in quants}
        print(json.dumps(dict(round=rnd, load=round(os.getloadavg()[0], 2), tok_s=row)), flush=True)

    def per_byte(q: str, i: int) -> float:
        return (tok_s[q][i] * nbytes[q]) / (tok_s[ref][i] * nbytes[ref])

    how = (
        f"1 thread, CPU time, median of {args.rounds} alternating rounds x {args.n_gen} tokens"
        if args.cpu_time
        else f"{args.threads} threads, median of {args.rounds} alternating rounds x {args.reps} reps x {args.n_gen} tokens"
    )
    print(f"\n{how}; load now {os.getloadavg()[0]:.2f}")
    print(
        f"| type | weight MB a step | tok/s | GB/s | per weight byte vs {ref} | per token vs {ref} |"
        " per weight byte, median of rounds |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for q in quants:
        t = statistics.median(tok_s[q])
        t_ref = statistics.median(tok_s[ref])
        in_rounds = statistics.median(per_byte(q, i) for i in range(args.rounds))
        print(
            f"| {q} | {nbytes[q] / 1e6:.1f} | {t:.1f} | {nbytes[q] * t / 1e9:.2f} |"
            f" {(t * nbytes[q]) / (t_ref * nbytes[ref]):.2f} | {t / t_ref:.2f} | {in_rounds:.2f} |"
        )


if __name__ == "__main__":
    main()
