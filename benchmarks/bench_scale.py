#!/usr/bin/env python3
"""Speed at a real model size: a random-weight Llama of TinyLlama-1.1B's shape.

SmolLM2-135M fits in the last-level cache's neighbourhood; a 1.1B model does not,
so decode there is what users of 1-8B models see. This benchmark:

1. writes an F32 GGUF of a Llama with TinyLlama's shape (hidden 2048, 22 layers,
   32 heads, 4 KV heads, FFN 5632) and SmolLM2's tokenizer (vocab 49152), random
   weights (std 0.02, seeded; speed does not depend on the values);
2. quantizes it with llama.cpp to Q8_0 / Q4_0 and with ``cortiq convert`` to q8 / q4,
   and imports it into an f32 transformers folder (``cortiq import-gguf``);
3. runs every system in its own process, same thread count, in one run: cortiq q8 / q4,
   llama.cpp Q8_0, Q4_0 on its plain CPU kernels and Q4_0 repacked (CPU_REPACK: the
   interleaved layout llama.cpp copies Q4_0 into at load on AVX2 / AVX-512, its fastest
   Q4_0), transformers f32;
   prefill (512 tokens), greedy decode (128), RSS (``bench_worker.py``); the verify
   cost of 1/2/4/8 rows after a 64-token prompt (median of 9, the speculative
   decoder's batched check; cortiq through its row-exact path); decode after 2,048
   tokens of context against decode after 64 (alternating rounds of 8 steps in one
   process, the median of the rounds' ratios); and decode beside a CPU-bound
   neighbour process. Each system's load average is recorded as it starts.

    python benchmarks/bench_scale.py --threads 2 --reps 3 [--systems A,B] [--json] [--out report.json]

Files (about 11 GB) go to ``.cortiq-cache/scale/`` and are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_engine import System, prompt_ids, row_from, run_system, worker_env  # noqa: E402
from make_gguf import REPO, bundled_gguf, llama_quantize  # noqa: E402

SHAPE = dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, ctx=4096)
CACHE = REPO / ".cortiq-cache" / "scale"
STEM = "tinyllama-shape-random"
VERIFY_ROWS = (1, 2, 4, 8)


def log(msg: str) -> None:
    print(f"[bench_scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- inputs -----------------------------------------------------------------------


def write_random_gguf(dst: Path, seed: int = 0) -> None:
    """SmolLM2's tokenizer keys, TinyLlama's shape, random F32 weights."""
    import gguf
    import numpy as np

    src = gguf.GGUFReader(bundled_gguf())
    h, L, nh, nkv, ffn = (SHAPE[k] for k in ("hidden", "layers", "heads", "kv_heads", "ffn"))
    hd = h // nh
    tmp = dst.with_name(dst.name + ".tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key.startswith("llama."):
            continue
        if key == "general.file_type":
            w.add_uint32(key, 0)
            continue
        vtype = field.types[0]
        w.add_key_value(
            key, field.contents(), vtype, sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        )
    w.add_context_length(SHAPE["ctx"])
    w.add_embedding_length(h)
    w.add_block_count(L)
    w.add_feed_forward_length(ffn)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> "np.ndarray":
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).astype(np.float32)

    ones = np.ones(h, np.float32)
    w.add_tensor("token_embd.weight", rand(vocab, h))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", rand(vocab, h))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones)
        w.add_tensor(p + "attn_q.weight", rand(h, h))
        w.add_tensor(p + "attn_k.weight", rand(nkv * hd, h))
        w.add_tensor(p + "attn_v.weight", rand(nkv * hd, h))
        w.add_tensor(p + "attn_output.weight", rand(h, h))
        w.add_tensor(p + "ffn_norm.weight", ones)
        w.add_tensor(p + "ffn_gate.weight", rand(ffn, h))
        w.add_tensor(p + "ffn_up.weight", rand(ffn, h))
        w.add_tensor(p + "ffn_down.weight", rand(h, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)


def build(cache: Path, threads: int, hf: bool = True) -> dict[str, Path]:
    cache.mkdir(parents=True, exist_ok=True)
    f32 = cache / f"{STEM}-f32.gguf"
    paths = {
        "gguf:q8_0": cache / f"{STEM}-q8_0.gguf",
        "gguf:q4_0": cache / f"{STEM}-q4_0.gguf",
        "cmf:q8": cache / f"{STEM}-q8.cmf",
        "cmf:q4": cache / f"{STEM}-q4.cmf",
        "hf": cache / f"{STEM}-hf",
    }
    if not f32.is_file():
        log(f"writing {f32.name} (4.4 GB)")
        write_random_gguf(f32)
    for quant in ("q8_0", "q4_0"):
        if not paths[f"gguf:{quant}"].is_file():
            log(f"llama.cpp quantize -> {quant}")
            llama_quantize(f32, paths[f"gguf:{quant}"], quant, threads=threads)
    for quant in ("q8", "q4"):
        out = paths[f"cmf:{quant}"]
        if not out.is_file():
            log(f"cortiq convert -> {quant}")
            cmd = [sys.executable, "-m", "cortiq_cli.main", "convert", str(f32), str(out), "--quant", quant]
            subprocess.run(cmd, check=True, cwd=REPO, env=worker_env(threads), stdout=subprocess.DEVNULL)
    if hf and not (paths["hf"] / "config.json").is_file():
        from cortiq_engine.convert import import_gguf

        log("import -> f32 transformers folder (4.4 GB)")
        import_gguf(f32, paths["hf"], dtype="f32", force=True)
    return paths


# --- workers (this script re-run as a child process) ---------------------------------


def _median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# Decode steps per timed round of the long-context comparison, and rounds (x reps).
CTX_STEPS = 8


def _context_ratio(decode_at: dict[int, Any], rounds: int) -> dict[str, float]:
    """Decode at 64 and at 2,048 tokens of context in alternating rounds of CTX_STEPS
    tokens each, in one process: a neighbour's load or the host's bandwidth moves
    both sides of a round alike (timed minutes apart, the ratio moved 0.56-0.86).
    ``decode_at[ctx](k)`` decodes step k at that context and rolls back after the last."""
    speeds: dict[int, list[float]] = {64: [], 2048: []}
    for fn in decode_at.values():
        for k in range(CTX_STEPS):
            fn(k)  # warm: compile, page in
    for _ in range(rounds):
        for ctx, fn in decode_at.items():
            t0 = time.perf_counter()
            for k in range(CTX_STEPS):
                fn(k)
            speeds[ctx].append(CTX_STEPS / (time.perf_counter() - t0))
    ratios = [b / a for a, b in zip(speeds[64], speeds[2048])]
    return {
        "decode_64_tok_s": statistics.median(speeds[64]),
        "decode_2k_tok_s": statistics.median(speeds[2048]),
        "decode_2k_over_64": statistics.median(ratios),
    }


def worker_cortiq(model: str, threads: int, ids: list[int], long_ids: list[int], reps: int) -> dict[str, Any]:
    from cortiq_engine import Engine
    from cortiq_engine.model import forward

    eng = Engine.load(model, threads=threads or None)
    state = eng.new_state(4096)
    forward(state, ids[:64])
    verify = {}
    for k in VERIFY_ROWS:

        def step(k=k):
            # Row-exact as a verify runs: within the kernel set's declared row_exact_rows.
            assert k <= eng.model.kernels.row_exact_rows
            forward(state, ids[64 : 64 + k])
            state.truncate(64)

        step()
        verify[k] = _median_seconds(step, reps)
    state.truncate(64)
    out: dict[str, Any] = {"verify_seconds": verify}
    # The long-context ratio with the default f32 KV cache, then with an f16 one (llama.cpp's
    # default cache type, which its figures use): the same file mapped by a second engine.
    for kv, suffix in (("f32", ""), ("f16", "_f16")):
        if kv != "f32":
            eng = Engine.load(model, threads=threads or None, kv_cache=kv)
        short_state = eng.new_state(4096)
        forward(short_state, ids[:64])
        long_state = eng.new_state(4096)
        forward(long_state, long_ids)
        decode_at = {}
        for ctx, st in ((64, short_state), (len(long_ids), long_state)):

            def one(k: int, st=st, ctx=ctx) -> None:
                forward(st, [ids[k]])  # one decode step; the token's identity does not change its cost
                if k == CTX_STEPS - 1:
                    st.truncate(ctx)

            decode_at[64 if ctx == 64 else 2048] = one
        out.update({k + suffix: v for k, v in _context_ratio(decode_at, 3 * reps).items()})
        del short_state, long_state
    return out


def worker_llama(
    model: str, threads: int, ids: list[int], long_ids: list[int], reps: int, bufts: str = "none"
) -> dict[str, Any]:
    import llama_cpp
    from bench_worker import _llama_model_params

    # The buffers the system's prefill and decode use (bench_worker._llama_model_params): plain CPU
    # kernels or CPU_REPACK; the AMX ones llama.cpp prefers on AMX CPUs crash this build.
    def make():
        with _llama_model_params(bufts):
            return llama_cpp.Llama(
                model_path=model,
                n_threads=threads,
                n_threads_batch=threads,
                n_ctx=4096,
                n_batch=512,
                n_ubatch=512,
                logits_all=True,
                verbose=False,
            )

    llm = make()
    llm.eval(ids[:64])
    verify = {}
    for k in VERIFY_ROWS:

        def step(k=k):
            llm.eval(ids[64 : 64 + k])  # logits for every row, as a verify needs
            llm.n_tokens = 64  # the next eval drops the cache past 64

        step()
        verify[k] = _median_seconds(step, reps)

    llm.n_tokens = 64
    # a second context over the same mapped weights holds the 2,048-token cache
    long_llm = make()
    long_llm.eval(long_ids)
    decode_at = {}
    for ctx, m in ((64, llm), (2048, long_llm)):
        base = m.n_tokens

        def one(k: int, m=m, base=base) -> None:
            m.eval([ids[k]])
            if k == CTX_STEPS - 1:
                m.n_tokens = base  # the next eval drops the cache past the prompt

        decode_at[ctx] = one
    out = {"verify_seconds": verify, **_context_ratio(decode_at, 3 * reps)}
    long_llm.close()
    llm.close()
    return out


def run_worker(
    system: System, model: Path, threads: int, ids: list[int], long_ids: list[int], reps: int
) -> dict[str, Any] | str:
    job = {
        "backend": system.backend,
        "bufts": system.llama_bufts or "none",
        "model": str(model),
        "threads": threads,
        "ids": ids,
        "long_ids": long_ids,
        "reps": reps,
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--worker"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        env=worker_env(threads),
        cwd=REPO,
    )
    if proc.returncode != 0:
        return "worker failed: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the run --------------------------------------------------------------------------


class Hog:
    """A CPU-bound neighbour (about one core), like a build or a browser tab."""

    def __enter__(self) -> "Hog":
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(1.0)
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.wait()


SYSTEMS = [
    System("cortiq-q8", "cortiq", "cmf:q8"),
    System("cortiq-q4", "cortiq", "cmf:q4"),
    System("llama.cpp-q8_0", "llama.cpp", "gguf:q8_0", llama_bufts="none"),
    System("llama.cpp-q4_0", "llama.cpp", "gguf:q4_0", llama_bufts="none"),
    System("llama.cpp-q4_0-repack", "llama.cpp", "gguf:q4_0", llama_bufts="repack"),
    System("transformers-f32", "transformers", "hf"),
]
# Backends timed for prefill and decode only: no row-exact verify or cache rollback to time.
NO_VERIFY = {"transformers"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of prefill/decode (verify: 3x this)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--cache-dir", type=Path, default=CACHE)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: engine,verify,busy")
    ap.add_argument(
        "--systems",
        default=",".join(s.name for s in SYSTEMS),
        help=f"comma-separated subset, in run order (default: all of {', '.join(s.name for s in SYSTEMS)})",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        job = json.loads(sys.stdin.read())
        args = (job["model"], job["threads"], job["ids"], job["long_ids"], job["reps"])
        if job["backend"] == "cortiq":
            print(json.dumps(worker_cortiq(*args)))
        else:
            print(json.dumps(worker_llama(*args, bufts=job["bufts"])))
        return 0
    skip = set(filter(None, a.skip.split(",")))
    by_name = {s.name: s for s in SYSTEMS}
    wanted = [x.strip() for x in a.systems.split(",") if x.strip()]
    unknown = [x for x in wanted if x not in by_name]
    if unknown or not wanted:
        print(
            f"error: --systems: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(by_name)}",
            file=sys.stderr,
        )
        return 2
    systems = [by_name[x] for x in wanted]
    paths = build(a.cache_dir, a.threads, hf=any(s.artifact == "hf" for s in systems))
    tok_json = a.cache_dir / "tokenizer.json"
    if not tok_json.is_file():
        from cortiq_engine import Engine

        with Engine.load(paths["cmf:q8"], warmup=False) as e:
            tok_json.write_bytes(e.cmf.raw_bytes("__tokenizer__/tokenizer.json"))
    prefill, decode_prompt = prompt_ids(tok_json, max(a.prompt_tokens, 2048))
    report: dict[str, Any] = {"shape": SHAPE, "threads": a.threads, "load_before": os.getloadavg(), "systems": {}}
    for s in systems:
        model = paths[s.artifact]
        size = sum(p.stat().st_size for p in model.glob("*.safetensors")) if model.is_dir() else model.stat().st_size
        entry: dict[str, Any] = {"file_bytes": size, "load_average": os.getloadavg()}
        if "engine" not in skip:
            log(f"{s.name}: prefill/decode (load {os.getloadavg()[0]:.1f})")
            job = {
                "threads": a.threads,
                "prefill_ids": prefill[: a.prompt_tokens],
                "decode_prompt_ids": decode_prompt,
                "decode_tokens": a.decode_tokens,
                "warmup": 1,
                "reps": a.reps,
                "llama_bufts": s.llama_bufts or "none",
            }
            row = row_from(s, model, run_system(s, model, job, 3600))
            entry.update(
                prefill_tok_s=row.prefill_tok_s,
                decode_tok_s=row.decode_tok_s,
                rss_loaded=row.rss_loaded,
                rss_peak=row.rss_peak,
                error=row.error,
            )
            if "busy" not in skip and s.backend not in NO_VERIFY:
                log(f"{s.name}: decode beside a busy process")
                with Hog():
                    job_busy = dict(job, prefill_ids=prefill[:64], reps=a.reps)
                    busy = row_from(s, model, run_system(s, model, job_busy, 3600))
                entry["busy_decode_tok_s"] = busy.decode_tok_s
        if "verify" not in skip and s.backend not in NO_VERIFY:
            log(f"{s.name}: verify rows and long-context decode (load {os.getloadavg()[0]:.1f})")
            res = run_worker(s, model, a.threads, prefill, prefill[:2048], 3 * a.reps)
            if isinstance(res, str):
                entry["verify_error"] = res
            else:
                v = {int(k): t for k, t in res["verify_seconds"].items()}
                entry["verify_ms"] = {k: 1e3 * t for k, t in v.items()}
                entry["verify_ratio"] = {k: v[k] / v[1] for k in v}
                entry["decode_2k_over_64"] = res["decode_2k_over_64"]
                if "decode_2k_over_64_f16" in res:
                    entry["decode_2k_over_64_f16"] = res["decode_2k_over_64_f16"]
        report["systems"][s.name] = entry
        if a.out:
            a.out.write_text(json.dumps(report, indent=2) + "\n")
    report["load_after"] = os.getloadavg()
    sy = report["systems"]

    def ratio(x: str, y: str, key: str) -> float | None:
        u, v = sy.get(x, {}).get(key), sy.get(y, {}).get(key)
        return u / v if u and v else None

    report["ratios"] = {
        "q8 decode / llama.cpp Q8_0": ratio("cortiq-q8", "llama.cpp-q8_0", "decode_tok_s"),
        "q4 decode / llama.cpp Q4_0": ratio("cortiq-q4", "llama.cpp-q4_0", "decode_tok_s"),
        "q4 decode / llama.cpp Q4_0 repacked": ratio("cortiq-q4", "llama.cpp-q4_0-repack", "decode_tok_s"),
        "q4 decode / q8 decode": ratio("cortiq-q4", "cortiq-q8", "decode_tok_s"),
        "q8 prefill / llama.cpp Q8_0": ratio("cortiq-q8", "llama.cpp-q8_0", "prefill_tok_s"),
        "q4 prefill / llama.cpp Q4_0 repacked": ratio("cortiq-q4", "llama.cpp-q4_0-repack", "prefill_tok_s"),
        "q8 prefill / transformers f32": ratio("cortiq-q8", "transformers-f32", "prefill_tok_s"),
        "q8 decode / transformers f32": ratio("cortiq-q8", "transformers-f32", "decode_tok_s"),
        "q8 busy decode / llama.cpp Q8_0 busy": ratio("cortiq-q8", "llama.cpp-q8_0", "busy_decode_tok_s"),
    }
    if a.out:
        a.out.write_text(json.dumps(report, indent=2) + "\n")
    if a.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"load before {report['load_before']}, after {report['load_after']}; threads {a.threads}")
    print(
        f"{'system':22s} {'load':>5s} {'prefill':>8s} {'decode':>8s} {'busy':>8s} {'2k/64':>6s} {'(f16)':>6s}"
        "  verify 2/4/8 rows vs 1   RSS MiB"
    )
    for name, e in sy.items():
        vr = e.get("verify_ratio", {})
        f16 = f"{e['decode_2k_over_64_f16']:6.2f}" if "decode_2k_over_64_f16" in e else f"{'-':>6s}"
        print(
            f"{name:22s} {e['load_average'][0]:5.2f} {e.get('prefill_tok_s', 0):8.1f} {e.get('decode_tok_s', 0):8.2f} {e.get('busy_decode_tok_s', 0):8.2f} "
            f"{e.get('decode_2k_over_64', 0):6.2f} {f16}  {vr.get(2, 0):.2f} / {vr.get(4, 0):.2f} / {vr.get(8, 0):.2f}"
            f"        {e.get('rss_loaded', 0) / 2**20:.0f} (file {e['file_bytes'] / 2**20:.0f})"
        )
    for name, e in sy.items():
        for key in ("error", "verify_error"):
            if e.get(key):
                print(f"  {name}: {key.replace('_', ' ')}: {e[key]}")
    for k, v in report["ratios"].items():
        print(f"  {k}: {v:.2f}x" if v else f"  {k}: n/a")
    return 0


if __name__ == "__main__":
    sys.exit(main())
