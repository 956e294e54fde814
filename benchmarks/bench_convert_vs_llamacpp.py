#!/usr/bin/env python3
"""``cortiq convert`` beside ``llama-quantize`` on one F32 GGUF: wall time and peak RSS.

For each pair (cortiq quant, llama.cpp type) the two tools run alternately, ``--repeat``
times each, on the same threads count; each run notes the 1-minute load average it
started under. The row is the median run of each tool and their ratio.

    python benchmarks/bench_convert_vs_llamacpp.py --src model-f32.gguf \\
        --llama-quantize llama.cpp/build/bin/llama-quantize --pair q8=Q8_0 --pair q4_0=Q4_0 --repeat 3

cortiq encodes on every usable core; ``--threads`` pins both tools to that many cores
(``taskset``-style affinity) and passes the count to llama-quantize.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(cmd: list[str], cpus: set[int]) -> tuple[float, int, float, float]:
    """(wall seconds, peak RSS bytes, user seconds, system seconds) of a child on ``cpus``;
    exits on failure."""
    with tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=lambda: os.sched_setaffinity(0, cpus)
        )
        _, status, usage = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise SystemExit(f"failed: {' '.join(cmd)}\n{err.read()[-2000:]}")
        return wall, usage.ru_maxrss * 1024, usage.ru_utime, usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, required=True, help="an F32 (or F16/BF16) GGUF")
    ap.add_argument("--llama-quantize", type=Path, required=True)
    ap.add_argument("--pair", action="append", help="cortiq quant = llama.cpp type, e.g. q8=Q8_0 (repeatable)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="folder for the outputs (default: beside the source)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    pairs = [p.split("=", 1) for p in (args.pair or ["q8=Q8_0", "q4_0=Q4_0"])]
    cpus = set(sorted(os.sched_getaffinity(0))[: args.threads])
    folder = args.out or args.src.parent
    for f in [args.src]:  # one untimed read: both tools start from the page cache
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    rows = []
    with tempfile.TemporaryDirectory(dir=folder, prefix=".bench-convert-") as tmp:
        for quant, gtype in pairs:
            out_cmf, out_gguf = Path(tmp) / "out.cmf", Path(tmp) / "out.gguf"
            cortiq = [sys.executable, "-m", "cortiq_cli.main", "convert", str(args.src), str(out_cmf)]
            cortiq += ["--quant", quant, "--force"]
            llama = [str(args.llama_quantize), str(args.src), str(out_gguf), gtype, str(args.threads)]
            runs: dict[str, list[tuple[float, int, float, float, float]]] = {"cortiq": [], "llama": []}
            for _ in range(args.repeat):
                for name, cmd in (("cortiq", cortiq), ("llama", llama)):
                    load = os.getloadavg()[0]
                    wall, rss, user, system = _run(cmd, cpus)
                    runs[name].append((wall, rss, load, user, system))
                    out_cmf.unlink(missing_ok=True)
                    out_gguf.unlink(missing_ok=True)
            med = {k: statistics.median_low(r[0] for r in v) for k, v in runs.items()}
            pick = {k: next(r for r in v if r[0] == med[k]) for k, v in runs.items()}
            rows.append(
                {
                    "cortiq": quant,
                    "llama_cpp": gtype,
                    "cortiq_s": med["cortiq"],
                    "llama_s": med["llama"],
                    "ratio": med["cortiq"] / med["llama"],
                    "cortiq_rss_mib": pick["cortiq"][1] / 2**20,
                    "llama_rss_mib": pick["llama"][1] / 2**20,
                    # user and system CPU seconds of the median run: what the wall time cost
                    "cortiq_cpu_s": (pick["cortiq"][3], pick["cortiq"][4]),
                    "llama_cpu_s": (pick["llama"][3], pick["llama"][4]),
                    "runs": {k: [(round(r[0], 2), round(r[2], 2)) for r in v] for k, v in runs.items()},
                }
            )
    result = {"source": str(args.src), "threads": args.threads, "rows": rows, "command": " ".join(sys.argv)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for r in rows:
        cu, cs = r["cortiq_cpu_s"]
        lu, ls = r["llama_cpu_s"]
        print(
            f"{r['cortiq']:>6} vs {r['llama_cpp']:<5} cortiq {r['cortiq_s']:6.1f} s {r['cortiq_rss_mib']:5.0f} MiB "
            f"(cpu {cu:.1f} user + {cs:.1f} sys) | llama-quantize {r['llama_s']:6.1f} s {r['llama_rss_mib']:5.0f} MiB "
            f"(cpu {lu:.1f} + {ls:.1f}) | ratio {r['ratio']:.2f} | runs (s, load) {r['runs']}"
        )


if __name__ == "__main__":
    main()
