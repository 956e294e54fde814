#!/usr/bin/env python3
"""Measure one system in this process; ``bench_engine.py`` starts one of these per system.

A fresh process per system keeps RSS honest (nothing another system loaded is
counted) and pins threads before any library starts its pool. The job arrives as
JSON on stdin; one JSON result line goes to stdout, everything else to stderr.

Every backend does the same work, greedy and without stopping at EOS:

* prefill: the prompt in one forward pass from an empty cache, keeping only the
  last position's logits (as ``generate`` does), then argmax;
* decode: a short prompt, then ``decode_tokens`` new tokens. The first new token
  comes out of the prompt's forward pass, so decode times the remaining
  ``decode_tokens - 1`` single-token steps and its rate is steps / seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Protocol

THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMBA_NUM_THREADS")
BACKENDS = ("transformers", "llama.cpp", "cortiq")
WARMUP_DECODE_TOKENS = 16  # enough to JIT/allocate every decode path; a full run would only cost time


@dataclass
class Job:
    backend: str
    model: str
    threads: int
    prefill_ids: list[int]
    decode_prompt_ids: list[int]
    decode_tokens: int
    warmup: int
    reps: int
    dtype: str = "float32"  # transformers only
    llama_bufts: str = "none"  # llama.cpp only, see LlamaCppBackend


@dataclass
class Result:
    backend: str
    model: str
    load_seconds: float
    rss_base: int  # after imports, before the model
    rss_loaded: int  # right after load
    rss_peak: int  # the process's high-water mark over the whole run
    prefill_tokens: int
    prefill_seconds: list[float]
    decode_steps: int
    decode_seconds: list[float]
    first_prefill_token: int
    decode_token_ids: list[int]
    notes: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)


class Backend(Protocol):
    def prefill(self, ids: list[int]) -> tuple[float, int]:
        """Seconds for the prompt's forward pass, and the greedy next token."""

    def decode(self, ids: list[int], n_new: int) -> tuple[float, int, list[int]]:
        """Seconds for the single-token steps, how many steps, all ``n_new`` greedy tokens."""

    def close(self) -> None: ...


def rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def rss_peak() -> int:
    """This process's RSS high-water mark.

    VmHWM belongs to the address space exec made; ru_maxrss would not do, as Linux
    carries it over from the parent at fork/exec, so a big parent inflates it.
    """
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # not Linux: the best there is


# --- transformers on torch CPU ---------------------------------------------------


class TransformersBackend:
    def __init__(self, folder: str, dtype: str, threads: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        # transformers 5.x renamed past_key_values to cache; older releases know only the first.
        self.cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"

    def _step(self, ids, cache):
        out = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_arg: cache})
        return getattr(out, self.cache_arg), int(out.logits[0, -1].argmax())

    def prefill(self, ids: list[int]) -> tuple[float, int]:
        torch = self.torch
        x = torch.tensor([ids])
        with torch.inference_mode():
            t0 = time.perf_counter()
            _, tok = self._step(x, None)
            return time.perf_counter() - t0, tok

    def decode(self, ids: list[int], n_new: int) -> tuple[float, int, list[int]]:
        torch = self.torch
        with torch.inference_mode():
            cache, tok = self._step(torch.tensor([ids]), None)
            out = [tok]
            t0 = time.perf_counter()
            for _ in range(n_new - 1):
                cache, tok = self._step(torch.tensor([[tok]]), cache)
                out.append(tok)
            return time.perf_counter() - t0, n_new - 1, out

    def close(self) -> None:
        pass

    @staticmethod
    def versions() -> dict[str, str]:
        import torch
        import transformers

        return {"torch": torch.__version__, "transformers": transformers.__version__}


# --- llama.cpp through llama-cpp-python ------------------------------------------


class LlamaCppBackend:
    """``bufts`` picks llama.cpp's weight buffers: ``none`` = plain CPU kernels
    (``use_extra_bufts=False``), ``repack`` = block matrices in CPU_REPACK and no AMX,
    ``default`` = llama.cpp's own choice (AMX first where the CPU has it)."""

    def __init__(self, path: str, threads: int, n_ctx: int, bufts: str = "none") -> None:
        import llama_cpp
        import numpy as np

        self.np = np
        self.llama_cpp = llama_cpp
        with _llama_model_params(bufts):
            self.llm = llama_cpp.Llama(
                model_path=path,
                n_threads=threads,
                n_threads_batch=threads,
                n_ctx=n_ctx,
                n_batch=512,
                n_ubatch=512,
                logits_all=False,
                verbose=False,
            )
        self.n_vocab = self.llm.n_vocab()

    def _eval(self, ids: list[int]) -> int:
        self.llm.eval(ids)
        ptr = self.llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def prefill(self, ids: list[int]) -> tuple[float, int]:
        self.llm.reset()  # the next eval drops the KV cache from position 0
        t0 = time.perf_counter()
        tok = self._eval(ids)
        return time.perf_counter() - t0, tok

    def decode(self, ids: list[int], n_new: int) -> tuple[float, int, list[int]]:
        self.llm.reset()
        tok = self._eval(ids)
        out = [tok]
        t0 = time.perf_counter()
        for _ in range(n_new - 1):
            tok = self._eval([tok])
            out.append(tok)
        return time.perf_counter() - t0, n_new - 1, out

    def close(self) -> None:
        # Free while the module is still alive; interpreter teardown would otherwise raise.
        self.llm.close()

    @staticmethod
    def versions() -> dict[str, str]:
        import llama_cpp

        return {"llama_cpp_python": llama_cpp.__version__}


LLAMA_BUFTS = ("none", "repack", "default")
_REPACK_PATTERN = rb"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight$"


@contextlib.contextmanager
def _llama_model_params(bufts: str):
    """Adjust the model params ``Llama()`` builds, which it exposes no argument for.

    Why: in this llama-cpp-python build the AMX weight buffers that llama.cpp
    prefers on AMX CPUs crash (SIGSEGV) on the first decode for Q8_0, Q4_0 and
    Q4_1 SmolLM2, so the default cannot be measured on such a machine.
    """
    import ctypes

    import llama_cpp.llama_cpp as low

    if bufts == "default":
        yield
        return
    if bufts not in LLAMA_BUFTS:
        raise ValueError(f"unknown llama.cpp buffer mode {bufts!r}; choose one of {', '.join(LLAMA_BUFTS)}")
    keep: list = []  # ctypes objects the params point to must outlive the load

    def params():
        p = original()
        if bufts == "none":
            p.use_extra_bufts = False
        else:

            class Override(ctypes.Structure):
                _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

            table = (Override * 2)(Override(_REPACK_PATTERN, _cpu_extra_buft("CPU_REPACK")), Override(None, None))
            keep.append(table)
            p.tensor_buft_overrides = ctypes.addressof(table)
        return p

    original = low.llama_model_default_params
    low.llama_model_default_params = params
    try:
        yield
    finally:
        low.llama_model_default_params = original


def _cpu_extra_buft(name: str) -> int:
    """The CPU backend's extra buffer type called ``name`` (e.g. CPU_REPACK), as a pointer."""
    import ctypes
    from pathlib import Path

    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    base = ctypes.CDLL(str(lib / "libggml-base.so"))
    ggml = ctypes.CDLL(str(lib / "libggml.so"))
    vp = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.restype, ggml.ggml_backend_dev_by_type.argtypes = vp, [ctypes.c_int]
    base.ggml_backend_dev_backend_reg.restype, base.ggml_backend_dev_backend_reg.argtypes = vp, [vp]
    base.ggml_backend_reg_get_proc_address.restype = vp
    base.ggml_backend_reg_get_proc_address.argtypes = [vp, ctypes.c_char_p]
    base.ggml_backend_buft_name.restype, base.ggml_backend_buft_name.argtypes = ctypes.c_char_p, [vp]
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    reg = base.ggml_backend_dev_backend_reg(dev)
    fn_ptr = base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    get_extra = ctypes.CFUNCTYPE(ctypes.POINTER(vp), vp)(fn_ptr)
    arr = get_extra(dev)
    i = 0
    while arr[i]:
        if base.ggml_backend_buft_name(arr[i]).decode() == name:
            return arr[i]
        i += 1
    raise RuntimeError(f"llama.cpp's CPU backend has no {name} buffer type")


# --- cortiq ----------------------------------------------------------------------


class CortiqBackend:
    """Through the public API: ``Engine.load`` and ``generate`` with its own timings.

    The engine times what the other backends time: ``prefill_seconds`` is the prompt
    pass plus the last row's logits, ``decode_seconds`` the single-token steps after it
    (sampling and detokenization included, as a user pays for them).
    """

    def __init__(self, path: str, threads: int) -> None:
        from cortiq_engine import Engine, SamplingConfig

        self.engine = Engine.load(path, threads=threads or None)  # 0: the default, as a user runs it
        self.greedy = SamplingConfig(temperature=0.0)

    def _generate(self, ids: list[int], n: int):
        # plain decoding: the peers decode without drafts
        return self.engine.generate(ids, self.greedy, max_tokens=n, ignore_eos=True, speculative=False)

    def prefill(self, ids: list[int]) -> tuple[float, int]:
        res = self._generate(ids, 1)
        return float(res.prefill_seconds), int(res.token_ids[0])

    def decode(self, ids: list[int], n_new: int) -> tuple[float, int, list[int]]:
        res = self._generate(ids, n_new)
        toks = [int(t) for t in res.token_ids]
        return float(res.decode_seconds), len(toks) - 1, toks

    def close(self) -> None:
        self.engine.close()

    @staticmethod
    def versions() -> dict[str, str]:
        from importlib.metadata import version

        return {"cortiq": version("cortiq")}


# --- the run ---------------------------------------------------------------------


def open_backend(job: Job) -> tuple[Backend, dict[str, str]]:
    if job.backend == "transformers":
        return TransformersBackend(job.model, job.dtype, job.threads), TransformersBackend.versions()
    if job.backend == "llama.cpp":
        n_ctx = max(len(job.prefill_ids), len(job.decode_prompt_ids) + job.decode_tokens) + 16
        return LlamaCppBackend(job.model, job.threads, n_ctx, job.llama_bufts), LlamaCppBackend.versions()
    if job.backend == "cortiq":
        return CortiqBackend(job.model, job.threads), CortiqBackend.versions()
    raise ValueError(f"unknown backend {job.backend!r}; choose one of {', '.join(BACKENDS)}")


def _import_backend_libs(backend: str) -> None:
    """Import the heavy libraries first, so rss_base holds them and rss_loaded - rss_base is the model."""
    mods = {"transformers": ("torch", "transformers"), "llama.cpp": ("llama_cpp",), "cortiq": ("cortiq_engine",)}
    for m in mods.get(backend, ()):
        __import__(m)


def run(job: Job) -> Result:
    _import_backend_libs(job.backend)
    base = rss_now()
    t0 = time.perf_counter()
    backend, versions = open_backend(job)
    load_s = time.perf_counter() - t0
    loaded = rss_now()
    notes: list[str] = []
    try:
        for _ in range(job.warmup):
            backend.prefill(job.prefill_ids)
            backend.decode(job.decode_prompt_ids, min(WARMUP_DECODE_TOKENS, job.decode_tokens))
        prefill_s, decode_s = [], []
        first_tok, tokens, steps = -1, [], 0
        for rep in range(job.reps):
            sec, tok = backend.prefill(job.prefill_ids)
            prefill_s.append(sec)
            sec, steps, toks = backend.decode(job.decode_prompt_ids, job.decode_tokens)
            decode_s.append(sec)
            if rep == 0:
                first_tok, tokens = tok, toks
            elif toks != tokens:
                notes.append(f"rep {rep}: greedy tokens differ from rep 0")
        if len(tokens) != job.decode_tokens:
            notes.append(f"stopped after {len(tokens)} of {job.decode_tokens} new tokens")
    finally:
        backend.close()
    return Result(
        backend=job.backend,
        model=job.model,
        load_seconds=load_s,
        rss_base=base,
        rss_loaded=loaded,
        rss_peak=rss_peak(),
        prefill_tokens=len(job.prefill_ids),
        prefill_seconds=prefill_s,
        decode_steps=steps,
        decode_seconds=decode_s,
        first_prefill_token=first_tok,
        decode_token_ids=tokens,
        notes=notes,
        versions=versions,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Run one benchmark job (JSON on stdin: backend, model, threads, prefill_ids, "
        "decode_prompt_ids, decode_tokens, warmup, reps, dtype) and print one JSON result line. "
        "Started by bench_engine.py; set the thread environment variables before starting it.",
    )
    ap.parse_args(argv)
    job = Job(**json.load(sys.stdin))
    missing = [v for v in THREAD_ENV if os.environ.get(v) != str(job.threads)]
    if missing:
        print(f"warning: {', '.join(missing)} not set to {job.threads}", file=sys.stderr)
    result = run(job)
    sys.stdout.write(json.dumps(asdict(result)) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
