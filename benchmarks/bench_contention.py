#!/usr/bin/env python3
"""Decode speed on a desktop that is not idle: each system alone, then beside a busy neighbour.

A user's machine runs other programs. This benchmark measures greedy decode
tok/s (``bench_worker.py``: one fresh process per system, warm-up, repetitions,
median) twice per system: on the machine as it is ("quiet"), and while a
CPU-bound neighbour process (``while True: pass``, not pinned) uses about one
core ("busy"). The load average is printed before every scenario, since these
machines are shared.

Systems (same SmolLM2 weights and token ids as ``bench_engine.py``):

* ``cortiq-q8``            the default: no ``--threads``; the decode thread count adapts
                           by measuring, idle OpenMP workers spin briefly then sleep
* ``cortiq-q8-t1``         ``--threads 1``
* ``cortiq-q8-t2``         ``--threads 2`` (fixed: no adapting)
* ``cortiq-q8-passive``    the default with ``OMP_WAIT_POLICY=PASSIVE`` (the previous default)
* ``llama.cpp-q8_0`` (+ ``-t1``) when llama-cpp-python is installed

Ratios printed: busy default / quiet 1-thread (target >= 0.5), cortiq / llama.cpp
Q8_0 both busy (target >= 1.0), and each system's busy / quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_engine import ensure_cmf, prompt_ids, worker_env  # noqa: E402
from make_gguf import DEFAULT_CACHE, input_paths, make_inputs, write_hf_dir  # noqa: E402


@dataclass(frozen=True)
class Variant:
    name: str
    backend: str
    artifact: str  # "cmf:q8" or "gguf:q8_0"
    threads: int  # 0: the system's default
    env: tuple[tuple[str, str], ...] = ()


VARIANTS = [
    Variant("cortiq-q8", "cortiq", "cmf:q8", 0),
    Variant("cortiq-q8-t1", "cortiq", "cmf:q8", 1),
    Variant("cortiq-q8-t2", "cortiq", "cmf:q8", 2),
    Variant("cortiq-q8-passive", "cortiq", "cmf:q8", 0, (("OMP_WAIT_POLICY", "PASSIVE"),)),
    Variant("llama.cpp-q8_0", "llama.cpp", "gguf:q8_0", 2),
    Variant("llama.cpp-q8_0-t1", "llama.cpp", "gguf:q8_0", 1),
]


@dataclass
class Measure:
    variant: str
    scenario: str
    decode_tok_s: float = 0.0
    decode_tok_s_all: list[float] = field(default_factory=list)
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    error: str = ""


def busy_neighbour() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def run_one(v: Variant, model: Path, job: dict[str, Any], timeout: float) -> dict[str, Any] | str:
    env = worker_env(v.threads or os.cpu_count() or 1)
    if v.threads == 0:  # the default: no thread variables at all, as a user runs it
        for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS"):
            env.pop(k, None)
    env.update(dict(v.env))
    payload = dict(job, backend=v.backend, model=str(model), threads=v.threads)
    try:
        proc = subprocess.run(
            [sys.executable, str(HERE / "bench_worker.py")],
            input=json.dumps(payload),
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return f"exit {proc.returncode}: {lines[-1][:200] if lines else ''}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", help="comma-separated subset (default: all whose backend is installed)")
    ap.add_argument(
        "--reps", type=int, default=5, help="timed repetitions per measurement; median reported (default 5)"
    )
    ap.add_argument("--decode-tokens", type=int, default=64, help="greedy tokens per repetition (default 64)")
    ap.add_argument(
        "--rounds", type=int, default=2, help="quiet/busy rounds; a variant's figure is the median over rounds"
    )
    ap.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    args = ap.parse_args(argv)

    have_llama = True
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        have_llama = False
    variants = [v for v in VARIANTS if have_llama or v.backend != "llama.cpp"]
    if args.variants:
        want = args.variants.split(",")
        variants = [v for v in VARIANTS if v.name in want]
    if have_llama:
        paths = make_inputs(args.cache_dir, threads=2)
    else:  # cortiq only: the HF folder the CMF is converted from is all it needs
        paths = input_paths(args.cache_dir)
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        if not (paths.hf_dir / "config.json").is_file():
            write_hf_dir(paths.source, paths.hf_dir)
    cmf = args.cache_dir / "smollm2-135m-q8.cmf"
    err = ensure_cmf(cmf, paths.hf_dir, "q8", False)
    if err:
        print(err, file=sys.stderr)
        return 1
    _, decode_prompt = prompt_ids(paths.hf_dir / "tokenizer.json", 16)
    job = dict(
        prefill_ids=decode_prompt,
        decode_prompt_ids=decode_prompt,
        decode_tokens=args.decode_tokens,
        warmup=1,
        reps=args.reps,
    )

    measures: list[Measure] = []
    for rnd in range(args.rounds):
        for scenario in ("quiet", "busy"):
            hog = busy_neighbour() if scenario == "busy" else None
            try:
                time.sleep(0.5)
                for v in variants:
                    model = cmf if v.artifact.startswith("cmf") else paths.gguf(v.artifact.split(":")[1])
                    m = Measure(v.name, scenario, load_before=os.getloadavg())
                    res = run_one(v, model, job, args.timeout)
                    if isinstance(res, str):
                        m.error = res
                    else:
                        rates = [res["decode_steps"] / s for s in res["decode_seconds"]]
                        m.decode_tok_s, m.decode_tok_s_all = statistics.median(rates), rates
                    measures.append(m)
                    print(
                        f"round {rnd + 1} {scenario:5} {v.name:20} load {m.load_before[0]:.2f}  "
                        f"{m.error or f'{m.decode_tok_s:7.1f} tok/s  (reps {[round(r, 1) for r in m.decode_tok_s_all]})'}",
                        flush=True,
                    )
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()

    def med(name: str, scenario: str) -> float | None:
        xs = [m.decode_tok_s for m in measures if m.variant == name and m.scenario == scenario and not m.error]
        return statistics.median(xs) if xs else None

    print("\nmedian decode tok/s over rounds")
    print(f"{'system':22} {'quiet':>8} {'busy':>8} {'busy/quiet':>10}")
    table = {}
    for v in variants:
        q, b = med(v.name, "quiet"), med(v.name, "busy")
        table[v.name] = {"quiet": q, "busy": b}
        ratio = f"{b / q:10.2f}" if q and b else f"{'-':>10}"
        print(f"{v.name:22} {q or 0:8.1f} {b or 0:8.1f} {ratio}")
    ratios = {}
    if med("cortiq-q8", "busy") and med("cortiq-q8-t1", "quiet"):
        ratios["busy_default_over_quiet_1thread"] = med("cortiq-q8", "busy") / med("cortiq-q8-t1", "quiet")
    if med("cortiq-q8", "busy") and med("llama.cpp-q8_0", "busy"):
        ratios["cortiq_over_llama_q8_both_busy"] = med("cortiq-q8", "busy") / med("llama.cpp-q8_0", "busy")
    if med("cortiq-q8", "quiet") and med("llama.cpp-q8_0", "quiet"):
        ratios["cortiq_over_llama_q8_quiet"] = med("cortiq-q8", "quiet") / med("llama.cpp-q8_0", "quiet")
    for k, val in ratios.items():
        print(f"{k}: {val:.2f}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "measures": [asdict(m) for m in measures],
                    "table": table,
                    "ratios": ratios,
                    "config": vars(args) | {"cache_dir": str(args.cache_dir), "out": str(args.out)},
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
