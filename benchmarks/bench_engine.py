#!/usr/bin/env python3
"""Engine speed, side by side: cortiq vs transformers (torch CPU) vs llama.cpp.

Every system runs in its own process (``bench_worker.py``) on the same
SmolLM2-135M weights (see ``make_gguf.py``), with the same token ids, the same
thread count, a warm-up and several repetitions. Reported per system: prompt
tok/s for a ``--prompt-tokens`` prompt of real text, decode tok/s over
``--decode-tokens`` greedy tokens (EOS ignored), RSS after load, peak RSS, file
size, ratios against transformers f32 and llama.cpp Q8_0 (and cortiq q4 against
llama.cpp's repacked Q4_0, its fastest Q4_0 on AVX2 / AVX-512), how many greedy
tokens agree with transformers f32 (a broken fast path shows up there), and the load
average as each system starts (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # run as a script: the sibling modules are not a package

from bench_worker import LLAMA_BUFTS, THREAD_ENV  # noqa: E402
from make_gguf import DEFAULT_CACHE, REPO, BenchInputs, make_inputs  # noqa: E402

PROMPT_FILE = HERE / "data" / "prompt.txt"
DECODE_INSTRUCTION = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TF32, LLAMA_Q8, LLAMA_Q4_REPACK = "transformers-f32", "llama.cpp-q8_0", "llama.cpp-q4_0-repack"
MIB = 2**20
RSS_HEADROOM = 200 * MIB


@dataclass(frozen=True)
class System:
    name: str
    backend: str  # bench_worker backend
    artifact: str  # "hf", "gguf:<quant>" or "cmf:<quant>"
    dtype: str = "float32"  # transformers
    llama_bufts: str | None = None  # llama.cpp; None = the --llama-bufts option
    default: bool = True


SYSTEMS = [
    System(TF32, "transformers", "hf", dtype="float32"),
    System("transformers-bf16", "transformers", "hf", dtype="bfloat16"),
    System(LLAMA_Q8, "llama.cpp", "gguf:q8_0"),
    System("llama.cpp-q4_0", "llama.cpp", "gguf:q4_0"),
    System(LLAMA_Q4_REPACK, "llama.cpp", "gguf:q4_0", llama_bufts="repack"),
    System("llama.cpp-q4_1", "llama.cpp", "gguf:q4_1", default=False),
    System("cortiq-q8", "cortiq", "cmf:q8"),
    System("cortiq-q4", "cortiq", "cmf:q4"),
    System("cortiq-f32", "cortiq", "cmf:f32"),
]
SYSTEM_NAMES = [s.name for s in SYSTEMS]


@dataclass
class Row:
    """One system's outcome; speeds are medians over the repetitions."""

    system: str
    status: str  # ok | failed
    error: str = ""
    model: str = ""
    file_bytes: int = 0
    load_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_tok_s: float = 0.0
    prefill_tok_s_all: list[float] = field(default_factory=list)
    decode_steps: int = 0
    decode_tok_s: float = 0.0
    decode_tok_s_all: list[float] = field(default_factory=list)
    rss_base: int = 0
    rss_loaded: int = 0
    rss_peak: int = 0
    prefill_vs_tf32: float | None = None
    decode_vs_tf32: float | None = None
    prefill_vs_llama_q8: float | None = None
    decode_vs_llama_q8: float | None = None
    agree_tf32: int | None = None  # leading greedy decode tokens equal to transformers f32's
    decode_token_ids: list[int] = field(default_factory=list)
    load_average: list[float] = field(default_factory=list)  # 1, 5, 15 minutes, as the system starts
    notes: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)


@dataclass
class Target:
    name: str
    value: float | None
    threshold: float
    ok: bool | None  # None: not measurable in this run


# --- inputs ----------------------------------------------------------------------


def prompt_ids(tokenizer_json: Path, n_prefill: int) -> tuple[list[int], list[int]]:
    """The prefill prompt (real text, cut to ``n_prefill`` tokens) and the short chat prompt for decode."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    text = PROMPT_FILE.read_text()
    ids = tok.encode(text, add_special_tokens=False).ids
    while len(ids) < n_prefill:  # longer prompts than the file repeat it
        ids = ids + tok.encode("\n\n" + text, add_special_tokens=False).ids
    chat = f"<|im_start|>user\n{DECODE_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    return ids[:n_prefill], tok.encode(chat, add_special_tokens=False).ids


def artifact_path(system: System, inputs: BenchInputs, hf_dir: Path, cache: Path) -> Path:
    kind, _, quant = system.artifact.partition(":")
    if kind == "hf":
        return hf_dir
    if kind == "gguf":
        return inputs.gguf(quant)
    return inputs.cmf(quant)


def artifact_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return path.stat().st_size if path.exists() else 0


def ensure_cmf(out: Path, hf_dir: Path, quant: str, reconvert: bool) -> str | None:
    """Convert with ``cortiq convert`` unless a CMF newer than the converter exists; an error or None."""
    # Stale when the converter or the source checkpoint changed after it was written.
    sources = [*(REPO / "formats").glob("*.py"), hf_dir / "config.json", *hf_dir.glob("*.safetensors")]
    newest_source = max((p.stat().st_mtime for p in sources if p.exists()), default=0.0)
    if out.is_file() and not reconvert and out.stat().st_mtime >= newest_source:
        return None
    log(f"cortiq convert {hf_dir.name} -> {out.name} --quant {quant}")
    cmd = [sys.executable, "-m", "cortiq_cli.main", "convert", str(hf_dir), str(out), "--quant", quant, "--force"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        return "cortiq convert failed: " + _last_line(proc.stderr or proc.stdout)
    return None


# --- running one system ------------------------------------------------------------


def worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in THREAD_ENV:
        env[var] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_system(system: System, model: Path, job: dict[str, Any], timeout: float) -> dict[str, Any] | str:
    """The worker's result dict, or a one-line error."""
    payload = dict(job, backend=system.backend, model=str(model), dtype=system.dtype)
    cmd = [sys.executable, str(HERE / "bench_worker.py")]
    try:
        proc = subprocess.run(
            cmd,
            input=json.dumps(payload),
            capture_output=True,
            text=True,
            env=worker_env(job["threads"]),
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    if proc.returncode != 0:
        why = f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
        return f"worker {why}: {_last_line(proc.stderr)}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else "(no output)"


def row_from(system: System, model: Path, res: dict[str, Any] | str) -> Row:
    row = Row(system=system.name, status="ok", model=str(model), file_bytes=artifact_bytes(model))
    if isinstance(res, str):
        row.status, row.error = "failed", res
        return row
    pre = [res["prefill_tokens"] / s for s in res["prefill_seconds"]]
    dec = [res["decode_steps"] / s for s in res["decode_seconds"]] if res["decode_steps"] > 0 else []
    row.load_seconds = res["load_seconds"]
    row.prefill_tokens, row.decode_steps = res["prefill_tokens"], res["decode_steps"]
    row.prefill_tok_s_all, row.decode_tok_s_all = pre, dec
    row.prefill_tok_s = statistics.median(pre) if pre else 0.0
    row.decode_tok_s = statistics.median(dec) if dec else 0.0
    row.rss_base, row.rss_loaded, row.rss_peak = res["rss_base"], res["rss_loaded"], res["rss_peak"]
    row.decode_token_ids, row.notes, row.versions = res["decode_token_ids"], res["notes"], res["versions"]
    return row


# --- numbers across systems --------------------------------------------------------


def _ratio(a: float, b: float) -> float | None:
    return a / b if a > 0 and b > 0 else None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def add_comparisons(rows: list[Row]) -> None:
    """Ratios against the two baselines and greedy agreement with transformers f32, in place."""
    ok = {r.system: r for r in rows if r.status == "ok"}
    tf32, llq8 = ok.get(TF32), ok.get(LLAMA_Q8)
    for r in ok.values():
        if tf32:
            r.prefill_vs_tf32 = _ratio(r.prefill_tok_s, tf32.prefill_tok_s)
            r.decode_vs_tf32 = _ratio(r.decode_tok_s, tf32.decode_tok_s)
            r.agree_tf32 = common_prefix(r.decode_token_ids, tf32.decode_token_ids)
        if llq8:
            r.prefill_vs_llama_q8 = _ratio(r.prefill_tok_s, llq8.prefill_tok_s)
            r.decode_vs_llama_q8 = _ratio(r.decode_tok_s, llq8.decode_tok_s)


def targets(rows: list[Row], system: str = "cortiq-q8") -> list[Target]:
    """The speed goals for cortiq q8; ``ok`` is None when a needed row is missing."""
    r = next((x for x in rows if x.system == system and x.status == "ok"), None)

    def t(name: str, value: float | None, threshold: float, higher_is_better: bool = True) -> Target:
        if value is None:
            return Target(name, None, threshold, None)
        return Target(name, value, threshold, value >= threshold if higher_is_better else value <= threshold)

    rss_limit = (r.file_bytes + RSS_HEADROOM) / MIB if r else 0.0
    return [
        t(f"{system} decode / {TF32} decode", r.decode_vs_tf32 if r else None, 1.5),
        t(f"{system} decode / {LLAMA_Q8} decode", r.decode_vs_llama_q8 if r else None, 0.5),
        t(f"{system} prefill / {TF32} prefill", r.prefill_vs_tf32 if r else None, 1.0),
        t(f"{system} RSS after load, MiB (<= file + 200 MiB)", r.rss_loaded / MIB if r else None, rss_limit, False),
    ]


def machine_info() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


# --- rendering ---------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def render(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    # Piped output would wrap at 80 columns; a report file should keep its rows whole.
    console = Console() if sys.stdout.isatty() else Console(width=150)
    cfg = report["config"]
    table = Table(
        title=f"SmolLM2-135M, {cfg['threads']} threads, median of {cfg['reps']} "
        f"(prefill {cfg['prompt_tokens']} tok, decode {cfg['decode_tokens']} tok)",
        title_justify="left",
    )
    for col in (
        "system",
        "prefill tok/s",
        "x tf32",
        "x llama q8",
        "decode tok/s",
        "x tf32",
        "x llama q8",
        "RSS load",
        "RSS peak",
        "file",
        "agree",
        "load",
    ):
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in report["systems"]:
        if r["status"] != "ok":
            table.add_row(r["system"], f"[red]failed: {r['error']}[/]", *[""] * 10)
            continue
        table.add_row(
            r["system"],
            f"{r['prefill_tok_s']:.1f}",
            _x(r["prefill_vs_tf32"]),
            _x(r["prefill_vs_llama_q8"]),
            f"{r['decode_tok_s']:.1f}",
            _x(r["decode_vs_tf32"]),
            _x(r["decode_vs_llama_q8"]),
            f"{r['rss_loaded'] / MIB:.0f} MiB",
            f"{r['rss_peak'] / MIB:.0f} MiB",
            f"{r['file_bytes'] / MIB:.0f} MiB",
            "-" if r["agree_tf32"] is None else f"{r['agree_tf32']}/{len(r['decode_token_ids'])}",
            f"{r['load_average'][0]:.2f}" if r.get("load_average") else "-",
        )
    console.print(table)
    speeds = {r["system"]: r for r in report["systems"] if r["status"] == "ok"}
    if "cortiq-q4" in speeds and LLAMA_Q4_REPACK in speeds:
        q4, rp = speeds["cortiq-q4"], speeds[LLAMA_Q4_REPACK]
        console.print(
            f"cortiq-q4 / {LLAMA_Q4_REPACK}: decode {_x(_ratio(q4['decode_tok_s'], rp['decode_tok_s']))}, "
            f"prefill {_x(_ratio(q4['prefill_tok_s'], rp['prefill_tok_s']))}",
            highlight=False,
        )
    tt = Table(title="Targets", title_justify="left")
    for col in ("target", "measured", "threshold", "met"):
        tt.add_column(col, justify="left" if col == "target" else "right")
    for t in report["targets"]:
        met = "n/a" if t["ok"] is None else ("[green]yes[/]" if t["ok"] else "[red]no[/]")
        val = "-" if t["value"] is None else f"{t['value']:.2f}"
        tt.add_row(t["name"], val, f"{t['threshold']:.2f}", met)
    console.print(tt)
    la = report["load_average"]
    if max(la["before"][0], la["after"][0]) > cfg["threads"]:
        console.print(
            "[bold yellow]warning:[/] the machine was busy (load average above the thread count): "
            "these figures are noisy; rerun on a quiet machine"
        )
    console.print(
        f"load average before {la['before'][0]:.2f}, after {la['after'][0]:.2f} on {report['machine']['logical_cpus']} "
        f"CPUs ({report['machine']['cpu']}); agree = leading greedy decode tokens equal to {TF32}'s",
        highlight=False,
    )
    for r in report["systems"]:
        for note in r.get("notes", []):
            console.print(f"note: {r['system']}: {note}", highlight=False)


# --- main --------------------------------------------------------------------------


def build_report(head: dict[str, Any], rows: list[Row], load_before: tuple[float, ...]) -> dict[str, Any]:
    add_comparisons(rows)
    return {
        **head,
        "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
        "systems": [asdict(r) for r in rows],
        "targets": [asdict(t) for t in targets(rows)],
    }


def parse_systems(spec: str | None) -> list[System]:
    if not spec:
        return [s for s in SYSTEMS if s.default]
    by_name = {s.name: s for s in SYSTEMS}
    out = []
    for name in (x.strip() for x in spec.split(",") if x.strip()):
        if name not in by_name:
            sys.exit(f"error: unknown system {name!r}; choose from {', '.join(SYSTEM_NAMES)}")
        out.append(by_name[name])
    if not out:
        sys.exit("error: --systems names no system")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Measure prompt and decode speed and memory of cortiq, transformers and llama.cpp on "
        "SmolLM2-135M, each system in its own process. Makes its inputs on first use (see make_gguf.py).",
        epilog=f"systems: {', '.join(SYSTEM_NAMES)} (by default all but "
        f"{', '.join(s.name for s in SYSTEMS if not s.default)})",
    )
    ap.add_argument("--systems", help="comma-separated subset, in run order (default: all default systems)")
    ap.add_argument("--threads", type=int, default=2, help="threads for every system (default: 2)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions; the median is reported (default: 3)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds (default: 1)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prefill prompt length (default: 512)")
    ap.add_argument("--decode-tokens", type=int, default=128, help="greedy tokens to generate (default: 128)")
    ap.add_argument(
        "--llama-bufts",
        choices=LLAMA_BUFTS,
        default="none",
        help="llama.cpp weight buffers: none = plain CPU kernels (default; llama.cpp's AMX buffers "
        "crash in this build), repack = CPU_REPACK for block matrices, default = llama.cpp's choice",
    )
    ap.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help=f"inputs and CMF files (default: {DEFAULT_CACHE})"
    )
    ap.add_argument("--source", type=Path, help="another GGUF to benchmark (e.g. Gemma 3 270M); default SmolLM2-135M")
    ap.add_argument(
        "--hf-dir",
        type=Path,
        help="transformers checkpoint to use instead of the one make_gguf.py writes "
        "(e.g. the folder `cortiq import-gguf` makes); also the source of the cortiq CMFs",
    )
    ap.add_argument("--reconvert", action="store_true", help="re-run `cortiq convert` even if the CMFs are fresh")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed per system (default: 1800)")
    ap.add_argument("--json", action="store_true", help="print only the JSON report on stdout")
    ap.add_argument("--out", type=Path, help="also write the JSON report to this file (rewritten after every system)")
    ap.add_argument("--show", type=Path, metavar="REPORT", help="render a saved JSON report and exit")
    args = ap.parse_args(argv)
    if args.show:
        render(json.loads(args.show.read_text()))
        return 0
    if args.reps < 1 or args.prompt_tokens < 1 or args.decode_tokens < 2 or args.threads < 1:
        sys.exit("error: --reps, --prompt-tokens and --threads must be >= 1, --decode-tokens >= 2")
    systems = parse_systems(args.systems)

    inputs = make_inputs(args.cache_dir, source=args.source, threads=args.threads)
    hf_dir = args.hf_dir or inputs.hf_dir
    if not (hf_dir / "tokenizer.json").is_file():
        sys.exit(f"error: {hf_dir} has no tokenizer.json")
    prefill, decode_prompt = prompt_ids(hf_dir / "tokenizer.json", args.prompt_tokens)
    job = dict(
        threads=args.threads,
        prefill_ids=prefill,
        decode_prompt_ids=decode_prompt,
        decode_tokens=args.decode_tokens,
        warmup=args.warmup,
        reps=args.reps,
    )

    load_before = os.getloadavg()
    head = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else None,
        "config": {
            "threads": args.threads,
            "reps": args.reps,
            "warmup": args.warmup,
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "llama_bufts": args.llama_bufts,
            "hf_dir": str(hf_dir),
            "prompt_file": str(PROMPT_FILE),
            "decode_prompt_tokens": len(decode_prompt),
        },
        "machine": machine_info(),
        "inputs": json.loads(inputs.manifest.read_text()),
    }
    rows: list[Row] = []
    for system in systems:
        model = artifact_path(system, inputs, hf_dir, args.cache_dir)
        error = None
        if system.artifact.startswith("cmf:"):
            error = ensure_cmf(model, hf_dir, system.artifact.split(":")[1], args.reconvert)
        load = os.getloadavg()
        if error is None:
            log(f"{system.name}: {model.name} (load {load[0]:.2f})")
            t0 = time.perf_counter()
            bufts = system.llama_bufts or args.llama_bufts
            res = run_system(system, model, dict(job, llama_bufts=bufts), args.timeout)
            log(f"{system.name}: {'done' if isinstance(res, dict) else res} ({time.perf_counter() - t0:.0f} s)")
        else:
            log(f"{system.name}: {error}")
            res = error
        rows.append(row_from(system, model, res))
        rows[-1].load_average = list(load)
        report = build_report(head, rows, load_before)
        if args.out:  # after every system, so a long run that dies still leaves its figures
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        render(report)
    return 0 if any(r.status == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
