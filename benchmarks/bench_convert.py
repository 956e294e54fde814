#!/usr/bin/env python3
"""Conversion throughput and peak memory of ``cortiq convert``.

Builds (once, cached) a random llama checkpoint of at least 500 MB with
tests/tiny.py, or takes ``--src`` (an HF folder or a .gguf file), then converts it
to each ``--quant`` in a child process and reports, per run: source MB/s (the
converter's own clock), wall time of the whole child, and the child's peak RSS
(``wait4``), next to the RSS of a child that only starts the CLI and of one that
has the converter imported and its quantizers compiled ("interpreter"). The target:
peak - interpreter < 1.3 x the largest tensor as f32.

    python benchmarks/bench_convert.py                      # 8-layer 1024-wide llama, f32, ~620 MB
    python benchmarks/bench_convert.py --dtype bfloat16 --layers 20
    python benchmarks/bench_convert.py --src path/to/hf_dir --quant q8 --json
    python benchmarks/bench_convert.py --src model.gguf --quant q8 --quant q4 --quant keep
    python benchmarks/bench_convert.py --src model.gguf --repeat 3   # the median of 3 runs per quant

The converter encodes on every usable core; each run notes the 1-minute load average
it started under (another process's load slows it).
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

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CACHE = REPO / ".cortiq-cache" / "bench-convert"
# A child with what any conversion needs loaded: the CLI, the converter, compiled quantizers.
INTERPRETER = (
    "import numpy as np, gguf, tokenizers, cortiq_cli.main; from cortiq_engine.convert import convert_checkpoint; "
    "from formats.quants import get_dtype; x = np.ones((4, 64), np.float32); "
    "[get_dtype(d).encode(x) for d in ('q8', 'q4', 'f16', 'bf16')]"
)
TARGET_TIMES_LARGEST = 1.3


def build_checkpoint(cache: Path, layers: int, hidden: int, dtype: str) -> Path:
    """The random llama folder, built in a child process (torch would inflate this
    process's RSS, and a forked child's peak RSS starts from its parent's)."""
    folder = cache / f"llama-{layers}x{hidden}-{dtype}"
    if (folder / "config.json").is_file():
        return folder
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=cache))
    overrides = dict(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4 // 32 * 32,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=4096,
    )
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from tests.tiny import save_tiny; "
        f"save_tiny('llama', {str(tmp)!r}, dtype={dtype!r}, **{overrides!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    tmp.rename(folder)
    return folder


def _run(cmd: list[str]) -> tuple[int, float, int, str]:
    """(exit code, wall seconds, peak RSS bytes, stdout) of a child process."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(p.pid, 0)  # this child's own rusage, peak RSS included
        wall = time.perf_counter() - t0
        p.returncode = code = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if code != 0:
            raise SystemExit(f"child failed ({code}): {' '.join(cmd)}\n{err.read()}")
        return code, wall, usage.ru_maxrss * 1024, out.read()


def _prod(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, help="an HF checkpoint folder or a .gguf file (default: build a random llama)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--quant", action="append", help="repeatable; default q8 and q4")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    ap.add_argument("--repeat", type=int, default=1, help="runs per quant; the row is the median by time")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    quants = args.quant or ["q8", "q4"]
    args.cache.mkdir(parents=True, exist_ok=True)

    t0 = time.perf_counter()
    src = args.src or build_checkpoint(args.cache, args.layers, args.hidden, args.dtype)
    build_s = time.perf_counter() - t0
    src_files = [src] if src.is_file() else sorted(src.glob("*.safetensors"))
    src_bytes = sum(f.stat().st_size for f in src_files)
    cli = [sys.executable, "-m", "cortiq_cli.main"]
    _, base_wall, base_rss, _ = _run(cli + ["--help"])
    _, _, ready_rss, _ = _run([sys.executable, "-c", INTERPRETER])
    # One untimed pass so every run reads the source from the page cache alike.
    for f in src_files:
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass
    rows = []
    with tempfile.TemporaryDirectory(dir=args.cache) as tmp:
        for q in quants:
            out = Path(tmp) / f"bench-{q}.cmf"
            runs = []
            for _ in range(max(1, args.repeat)):
                load = os.getloadavg()[0]
                _, wall, rss, stdout = _run(cli + ["convert", str(src), str(out), "--quant", q, "--json", "--force"])
                runs.append((json.loads(stdout)["seconds"], wall, rss, stdout, load))
            median = statistics.median_low([r[0] for r in runs])
            _, wall, rss, stdout, _ = next(r for r in runs if r[0] == median)
            rep = json.loads(stdout)
            largest = max(t["bytes"] for t in rep["tensors"])
            largest_f32 = max(4 * _prod(t["shape"]) for t in rep["tensors"])
            rows.append(
                {
                    "quant": q,
                    "source_mb": rep["source_bytes"] / 1e6,
                    "output_mb": rep["output_bytes"] / 1e6,
                    "convert_s": rep["seconds"],
                    "mb_per_s": rep["mb_per_s"],
                    "wall_s": wall,
                    "peak_rss_mb": rss / 1e6,
                    "cli_baseline_rss_mb": base_rss / 1e6,
                    "largest_output_tensor_mb": largest / 1e6,
                    "interpreter_rss_mb": ready_rss / 1e6,
                    "largest_tensor_f32_mb": largest_f32 / 1e6,
                    "over_interpreter_per_largest_f32": (rss - ready_rss) / largest_f32,
                    "within_target": rss - ready_rss < TARGET_TIMES_LARGEST * largest_f32,
                    "rms_rel_error": {k: v["rms_rel_error"] for k, v in rep["dtypes"].items()},
                    "runs_s": [round(r[0], 2) for r in runs],
                    "load_avg_at_start": [round(r[4], 2) for r in runs],
                }
            )
            out.unlink()
    result = {
        "source": str(src),
        "source_mb": src_bytes / 1e6,
        "build_s": build_s,
        "cpus": os.cpu_count(),
        "load_avg": os.getloadavg(),
        "runs": rows,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"cortiq convert: {src} ({src_bytes / 1e6:.0f} MB, {os.cpu_count()} CPUs, "
        f"load {result['load_avg'][0]:.1f})",
        title_justify="left",
    )
    for col in (
        "quant",
        "MB/s",
        "convert s",
        "runs s (load)",
        "wall s",
        "peak RSS MB",
        "CLI-only RSS MB",
        "interpreter RSS MB",
        "largest tensor f32 MB",
        "(peak - interp.) / largest",
        "output MB",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            r["quant"],
            f"{r['mb_per_s']:.0f}",
            f"{r['convert_s']:.1f}",
            ", ".join(f"{s:.1f} ({ld:.1f})" for s, ld in zip(r["runs_s"], r["load_avg_at_start"])),
            f"{r['wall_s']:.1f}",
            f"{r['peak_rss_mb']:.0f}",
            f"{r['cli_baseline_rss_mb']:.0f}",
            f"{r['interpreter_rss_mb']:.0f}",
            f"{r['largest_tensor_f32_mb']:.1f}",
            f"{r['over_interpreter_per_largest_f32']:.2f}" + ("" if r["within_target"] else " (over 1.3)"),
            f"{r['output_mb']:.0f}",
        )
    Console().print(t)


if __name__ == "__main__":
    main()
