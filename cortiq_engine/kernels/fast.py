"""The fast kernel set: numba kernels for small batches and dequantization, BLAS for large ones.

Strategy per matmul of n input rows:
- n <= ``small_n`` (decode, short verify batches): the weights are read once,
  block by block, straight from the map (``jit.*_matmul_small``), all fused
  matrices in one parallel launch; f32 too, so decode never leaves numba's pool.
- larger n (prefill): the weights are cut into row slices that the threads of a
  small pool pull one at a time; each slice is dequantized into that thread's
  reused f32 tile (f32 weights are used in place) and multiplied by BLAS running
  single-threaded, so the dequantization cost is shared by all n rows and a thread
  delayed by another process holds up one slice, not half the call.
  Where the CPU has AMX-INT8 (``amx.py``), q8 slices skip the dequantization: their
  quants are multiplied in place on the tile unit by activations rounded to int16 once
  per call (as q8's decode rounds them), 1.2-2.2x the sgemm path per matrix; the 4- and
  5-bit dtypes' slices are unpacked to bytes (a quarter of the f32 tile's writes) and
  take the same tile products plus their min term (int8 activations on request: one
  product a block). Where the CPU has no tile unit but AVX-512 VNNI, the same products
  (bit for bit) run on ``vpdpbusd`` (Zen 4, one thread, 512 rows: q8 1.5-1.8x the sgemm
  path per matrix; q4 on int8 2.0-2.9x); with neither, the same block sums run on AVX2's
  ``vpmaddwd`` (int16 activations only; Zen 3: q8 1.25-1.37x, q4 1.15-1.27x).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping, Sequence

import numba
import numpy as np

from cortiq_engine.cache import KV_DTYPES
from cortiq_engine.kernels import amx, attn_ir, jit, qdot
from cortiq_engine.kernels.dtype_ops import OPS, DtypeOps, ops_for
from cortiq_engine.kernels.reference import (
    ROW_EXACT_ROWS,
    AttentionCall,
    NumpyKernels,
    attend,
    attend_block,
    attention_jobs,
)
from cortiq_engine.weights import Weight
from formats.quants import align_up

# Above this many rows a matmul dequantizes tiles and uses BLAS. Measured on
# SmolLM2 q8, 2 threads: the small-batch kernel wins up to n = 16 for both a layer
# (gate|up 1.0 vs 1.2 ms) and the 49152-row lm_head (17 vs 23 ms); tiles win at 32.
SMALL_N = 16
# Integer width each dtype's decode and verify quantize activations to (qdot.py).
# q8: int16. int8 rounding quadrupled q8's KL to f32 on SmolLM2 (0.00096 -> 0.0040).
# q4: int8 (ggml's vpmaddubsw path): faster, and its rounding is small beside q4's own
# weight error (docs/performance.md, "Activation width per dtype").
# q6k: int16 (15 bits, qdot.QMAX): int8 multiplied its decode KL to f32 by 1.60 on
# SmolLM2 (0.0058 -> 0.0092, llama.cpp Q6_K's own level), int16 by 1.00.
# q4_0, q5, q5_1, q4k, q5k: int8, as ggml's dot products (its Q8_0 / Q8_K activations): KL
# x1.00-1.06 beside the weights' own error, and 1.3x faster than int16 for q4k/q5k.
# iq4_xs, q3k: int8, as ggml's.
# Each dtype's record says its width (``dtype_ops``, ``act_bits``).
ACT_BITS: dict[str, int] = {d: o.act_bits for d, o in OPS.items() if o.act_bits}
# An empty array of each activation width's integer type (``qdot.intdot`` allocates its like).
_ACT_PROTO = {8: np.empty(0, np.int8), 16: np.empty(0, np.int16)}
# Above this many new queries attention goes by blocks of queries and keys
# (``jit.attend_flash``) where the IR loops (attn_ir.py) serve the head size, else
# through BLAS (the reference blocks). A 512-token prefill's attention, a layer on 2
# threads (benchmarks/bench_attention.py): 2.9 ms on SmolLM2's shape (decode's split-K
# loops 3.9, BLAS 6.0), 9.9 on TinyLlama's (18.1, 18.0), 4.5 on Gemma 3 270M's (14.5,
# 6.4); 41 ms at 2,048 tokens on SmolLM2's (86, 64).
SMALL_ATTN = 16
# Weights of a fused matmul from which calls take the zmm bodies (qdot.py) on CPUs whose
# 512-bit instructions slow the clock (Intel): on SmolLM2's small matrices a 4-row verify
# step measured slower with them on Sapphire Rapids (16.1-18.0 vs 14.7-15.5 ms), on its
# 28M-weight lm_head and on every matrix of a 1.1B model faster. AMD Zen 4/5 run them at
# full clock, and every size gains (Zen 5, 2 threads, q4 3072 x 576: 1 row 23.2 -> 18.9 us,
# 4 rows 62.2 -> 36.1; q8 4 rows 60.3 -> 45.9): there the zmm bodies take every matrix.
ZMM_MIN_WEIGHTS = 4 << 20
FULL_CLOCK_ZMM_CPUS = ("znver4", "znver5")


def default_zmm_min_weights() -> int:
    """``ZMM_MIN_WEIGHTS``, or 0 on a CPU that runs 512-bit instructions at full clock."""
    import llvmlite.binding as llvm

    return 0 if llvm.get_host_cpu_name() in FULL_CLOCK_ZMM_CPUS else ZMM_MIN_WEIGHTS


# Matrices one small-batch kernel call can fuse (q|k|v).
FUSE_MAX = 3
# f32 elements of the reused dequantization tile (8 MB): a fused q|k|v or gate|up
# of a small model fits whole; bigger matrices go through in row tiles.
TILE_ELEMS = 1 << 21
# Fused prefill matmuls of fewer weights take sgemm where the tile products run on
# AVX-512 VNNI (amx.py). 0: every size. On an Emerald Rapids VM without AMX (512 rows, 2
# threads, q8, against dequantize + sgemm) SmolLM2's matrices measured 0.77-1.03x when each
# call still copied its result transposed (3.4 ms per 512 x 3072 output) and cut k and v
# into 16-row slices, so this was 4M weights; with the kernels storing in place and the
# sgemm path's spans, a Zen 4 measured 1.5x (q8) and 2.0-2.2x (q4, int8) on SmolLM2's
# matrices, one thread, and whole SmolLM2 prefills 1.18x (q8) and 1.38x (q4).
VNNI_MIN_WEIGHTS = 0
# Prefill sgemm slices take at least this many weight rows (fewer rows, more calls: a
# SmolLM2 q8 prefill ran 170 tok/s with per-weight slices (k and v: 16 rows), 215-220 with
# slices of >= 128 rows across q|k|v; Zen 1 EPYC, docs/performance.md).
MIN_SLICE_ROWS = 128
# The shape of one sgemm run before a process's first prefill matmul. On that EPYC,
# OpenBLAS 0.3.31 ran every sgemm of a process at a third of its speed (256 x 256 x 2048:
# 11 against 35 GFLOP/s, in every thread) until one call of a large enough shape had run
# (512 x 512 x 512 does, 300 x 256 x 2048 does not; why is not known, it was measured):
# a 1.1B q8 prefill went from 10.7 to 20.4 tok/s with this one call (about 10 ms).
BLAS_PRIME = (512, 512, 512)


def _tile_rows(cols: int) -> int:
    """Rows of a prefill tile of at most TILE_ELEMS / 4 f32 (2 MB, stays in L2/L3 while BLAS reads it)."""
    return max(16, (TILE_ELEMS // 4) // max(cols, 1))


@functools.lru_cache(maxsize=256)
def _span_rows(total: int, tile_rows: int, threads: int) -> int:
    """``_spans``' rows per job: about total / (4 threads), a multiple of 16, within
    [MIN_SLICE_ROWS, tile_rows]; then, among the sizes within those bounds, the one whose
    jobs end soonest on quiet threads (rounds of ``threads`` jobs), the nearest in count."""
    most = max(16, tile_rows // 16 * 16)
    least = min(MIN_SLICE_ROWS, most)
    step = max(16, min(most, max(MIN_SLICE_ROWS, -(-total // (4 * threads)))) // 16 * 16)
    if threads < 2 or total <= step:
        return step
    count = -(-total // step)

    def cost(rows: int) -> tuple[int, int]:
        n = -(-total // rows)
        return -(-n // threads) * rows, abs(n - count)

    sizes = {align_up(-(-total // n), 16) for n in range(max(1, count // 2), 2 * count + 1)}  # total / n, up to 16 rows
    return min((r for r in sizes if least <= r <= most), key=cost, default=step)


def _spans(ws: Sequence[Weight], threads: int) -> list[tuple[int, int, list[tuple[Weight, int, int]]]]:
    """The prefill jobs of a fused matmul (sgemm slices and integer tiles alike): runs of
    consecutive output columns that may cross from one weight into the next, each (first
    column, columns, (weight, r0, r1) pieces). At least 4 a thread, so a late thread
    leaves little for the others to wait on, a multiple of 16 rows, at most a tile, and
    never under MIN_SLICE_ROWS unless a tile is smaller (per weight, SmolLM2's k and v,
    192 rows each, were cut into 16-row slices). Within those bounds, the size whose jobs
    quiet threads finish together (``_span_rows``; SmolLM2's q|k|v, 960 rows: 8 jobs of
    128 left one of 2 threads half a job idle, 6 of 160 do not)."""
    total = sum(w.rows for w in ws)
    step = _span_rows(total, _tile_rows(ws[0].cols), threads)
    spans: list[tuple[int, int, list[tuple[Weight, int, int]]]] = []
    cur: list[tuple[Weight, int, int]] = []
    room = step
    for w in ws:
        r = 0
        while r < w.rows:
            take = min(room, w.rows - r)
            cur.append((w, r, r + take))
            r += take
            room -= take
            if room == 0:
                spans.append((len(spans) * step, step, cur))
                cur, room = [], step
    if cur:
        spans.append((len(spans) * step, step - room, cur))
    return spans


def _runs(ws: Sequence[Weight], most: int) -> list[list[Weight]]:
    """Consecutive weights of one dtype and width (at most ``most``), fused into one kernel call."""
    runs: list[list[Weight]] = []
    for w in ws:
        if runs and len(runs[-1]) < most and runs[-1][0].dtype == w.dtype and runs[-1][0].cols == w.cols:
            runs[-1].append(w)
        else:
            runs.append([w])
    return runs


@dataclass(frozen=True)
class _Plan:
    """One fused small-batch kernel call: its weights' padded parts and its kernel."""

    width: int  # output columns: the run's rows
    count: int
    offs: np.ndarray
    parts: list
    ops: DtypeOps
    bits: int  # integer activation width, 0 = the float kernel
    int_parts: tuple | None  # held: ``addrs`` points into these arrays
    fn: object | None  # the compiled integer kernel (qdot.IntDot.fn)
    addrs: np.ndarray | None  # int64[FUSE_MAX, qdot.NPARTS]: each matrix's part addresses
    rows: np.ndarray | None  # int64[FUSE_MAX]: each matrix's rows
    qmax: int  # the activations' largest integer (qdot.qmax)
    zmm: bool  # the kernel's 3- and 4-row bodies read interleaved rows (qdot.IntDot.interleaves)


def _readonly(a: np.ndarray) -> np.ndarray:
    v = np.ascontiguousarray(a).view()
    v.flags.writeable = False
    return v


class NumbaKernels(NumpyKernels):
    name = "numba"

    @property
    def row_exact_rows(self) -> int:
        """Up to this many rows, matmul (the small-batch kernels) and attend (the
        compiled kernel) compute every row on its own: a k-row call gives each row
        bit for bit its one-row result. Beyond it BLAS batches the rows."""
        return min(self.small_n, SMALL_ATTN)

    def __init__(
        self,
        small_n: int = SMALL_N,
        act_bits: int | Mapping[str, int] | None = None,
        vnni: bool | None = None,
        zmm: bool | None = None,
        zmm_min_weights: int | None = None,
        attn_loops: bool | None = None,
        kernel_cache: Path | None | str = "default",
        amx_tiles: bool | None = None,
        tile_unit: str | None = None,
        vnni_min_weights: int = VNNI_MIN_WEIGHTS,
    ):
        self.small_n = small_n
        # Decode/verify attention's inner loops in LLVM IR (attn_ir.py; default where the
        # CPU has AVX2/FMA); False keeps numba's loops (same math, other rounding).
        self._attn = attn_ir.AttentionLoops(attn_loops, kernel_cache)
        # The same loops reading an f16 cache (``--kv-cache f16``), compiled on first use.
        self._attn_f16: attn_ir.AttentionLoops | None = None
        self._attn_args = (attn_loops, kernel_cache)
        # Quantized dtypes decode and verify on integer activations (qdot.py) where the
        # CPU has AVX2: ``act_bits`` per dtype (default ACT_BITS), or one width for all;
        # a width 0, a width the dtype has no kernel for, or no AVX2 keeps the float kernels.
        widths = dict(
            ACT_BITS
            if act_bits is None
            else act_bits
            if isinstance(act_bits, Mapping)
            else {k: int(act_bits) for k in ACT_BITS}
        )
        # ``vnni``: the integer kernels' VNNI form (default where the CPU has it; same results).
        # ``zmm``: calls on AVX-512 VNNI bodies (default where the CPU has it; same results).
        # ``zmm_min_weights``: the smallest fused matmul that takes them (default
        # ``default_zmm_min_weights()``).
        # ``kernel_cache``: the compiled IR's object cache (llvm_jit.py; default
        # $CORTIQ_KERNEL_CACHE or ~/.cache/cortiq/kernels, None: compile every time).
        self._intdot = qdot.compile_intdot(vnni, zmm, kernel_cache) if any(widths.values()) else None
        self.zmm_min_weights = default_zmm_min_weights() if zmm_min_weights is None else zmm_min_weights
        self.act_bits = {k: v for k, v in widths.items() if v} if self._intdot is not None else {}
        # Prefill on integer tile products (amx.py; default where the CPU offers AMX-INT8
        # tiles or AVX-512 VNNI) for the dtypes that decode on integer activations; False:
        # dequantized slices and sgemm, float activations. ``tile_bits``: the activations'
        # width, int16 by default for every dtype (the logits stay within ~1e-8 KL of float
        # activations). int8 tiles (one product a block instead of two: the 4/5-bit dtypes'
        # prefill 1.6-1.8x faster per matrix on a Zen 4) only when one width is asked for all
        # (``act_bits`` 8, CORTIQ_KERNELS=numba-i8): on SmolLM2 q4 they moved the README
        # demo's first token from "The" (0.152 vs 0.140) to "L" (0.127 vs 0.113), and its
        # answer to "What is the capital of France?" from Paris to a loop.
        # ``tile_unit``: "amx", "vnni" (the same products, bit for bit, on AVX-512 VNNI
        # where the CPU has no tile unit or a VM hides it) or "avx2" (the same block sums on
        # vpmaddwd, int16 activations only); default the host's (amx.host_unit).
        # ``vnni_min_weights``: the smallest fused matmul that takes the VNNI unit.
        one_width = act_bits is not None and not isinstance(act_bits, Mapping)
        unit = amx.host_unit() if tile_unit is None else tile_unit
        wanted = {d: self.act_bits[d] if one_width else 16 for d in amx.TileKernels.DTYPES if self.act_bits.get(d)}
        tiled = {d: b for d, b in wanted.items() if unit is not None and b in amx.widths(unit)[d]}
        can_tile = bool(tiled)
        if amx_tiles and not can_tile:
            raise ValueError(
                "integer tile prefill needs AMX-INT8 tiles, AVX-512 VNNI or AVX2, and integer activations "
                "(int16 on AVX2)"
            )
        use = can_tile if amx_tiles is None else amx_tiles
        self._amx = amx.TileKernels(kernel_cache, unit) if use else None
        self.tile_bits: dict[str, int] = tiled if use else {}  # dtype -> the tiles' activation width
        self.vnni_min_weights = vnni_min_weights
        # Per-thread scratch for dequantized tiles, reused so prefill matmuls do not
        # page-fault a fresh buffer per call.
        self._tiles = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._blas_primed = False  # BLAS_PRIME has run (it acts on the whole process)
        # Fused kernel calls per weight list (the entry keeps the weights, so an id is never reused).
        self._plan_cache: dict[tuple[int, ...], tuple[tuple[Weight, ...], list[_Plan], int]] = {}
        self._pads: dict[tuple, np.ndarray] = {}

    # ------------------------------------------------------------ matmul
    def matmul(self, ws: Sequence[Weight], X: np.ndarray) -> np.ndarray:
        X = np.ascontiguousarray(X, dtype=np.float32)
        n = X.shape[0]
        if n > self.small_n:
            out = np.empty((n, sum(w.rows for w in ws)), np.float32)
            self._large(ws, X, out)
            return out
        plans, width = self._plans_for(ws)
        out = np.empty((n, width), np.float32)
        c0 = 0
        for plan in plans:
            # The kernel writes a contiguous [n, width] block.
            tgt = out if len(plans) == 1 else np.empty((n, plan.width), np.float32)
            self._small(plan, X, tgt)
            if tgt is not out:
                out[:, c0 : c0 + plan.width] = tgt
            c0 += plan.width
        return out

    def _plans_for(self, ws: Sequence[Weight]) -> tuple[list["_Plan"], int]:
        """The fused kernel calls of a matmul over ``ws``, built once per weight list:
        a decode step makes ~150 small calls, and rebuilding their arguments each time
        cost about a third of a call's Python time."""
        key = tuple(id(w) for w in ws)
        hit = self._plan_cache.get(key)
        if hit is not None:
            return hit[1], hit[2]
        plans = [self._plan(run) for run in _runs(ws, FUSE_MAX)]
        width = sum(p.width for p in plans)
        self._plan_cache[key] = (tuple(ws), plans, width)  # the entry keeps the weights: ids stay unique
        return plans, width

    def _plan(self, run: list[Weight]) -> "_Plan":
        count, offs, parts = self._small_args(run)
        ops = ops_for(run[0].dtype)
        bits = self.act_bits.get(ops.dtype, 0)
        if bits not in qdot.WIDTHS.get(ops.dtype, ()):
            bits = 0  # no integer kernel of this width for this dtype: the float one
        # The integer kernels (qdot.WIDTHS names the dtypes and widths they exist for)
        # take the dtype's kernel parts in ``DType.kernel_parts`` order.
        int_parts = tuple(parts) if bits else None
        # The zmm bodies from zmm_min_weights (see ZMM_MIN_WEIGHTS).
        zmm = sum(w.rows * w.cols for w in run) >= self.zmm_min_weights
        fn = self._intdot.fn(ops.dtype, bits, zmm) if bits else None
        addrs = rows = None
        if fn is not None:
            addrs = np.zeros((FUSE_MAX, qdot.NPARTS), np.int64)
            for k, part in enumerate(int_parts):
                for m in range(count):
                    addrs[m, k] = part[m].ctypes.data
            rows = np.array([w.rows for w in run] + [0] * (FUSE_MAX - count), np.int64)
        bits = bits if fn is not None else 0
        return _Plan(
            sum(w.rows for w in run),
            count,
            offs,
            parts,
            ops,
            bits,
            int_parts,
            fn,
            addrs,
            rows,
            qdot.qmax(ops.dtype, bits) if bits else 0,
            bool(bits) and self._intdot.interleaves(ops.dtype, bits, zmm),
        )

    def _large(self, ws: Sequence[Weight], X: np.ndarray, out: np.ndarray) -> None:
        """Prefill: row slices of the weights, each dequantized into a per-thread tile
        and multiplied by single-threaded BLAS, pulled one at a time by the pool's
        threads. A thread that another process holds off its core delays only the
        slice it has, not a fixed half of every call (BLAS's own static split did:
        prefill fell 4-5x beside a busy process)."""
        if not self._blas_primed:
            m, n, k = BLAS_PRIME
            np.matmul(np.zeros((m, k), np.float32), np.zeros((k, n), np.float32))
            self._blas_primed = True
        threads = numba.get_num_threads()
        if any(w.dtype in self.amx_dtypes for w in ws) and (
            self._amx.unit == "amx" or sum(w.rows * w.cols for w in ws) >= self.vnni_min_weights
        ):
            self._large_amx(ws, X, out, threads)
            return

        def work(span: tuple[int, int, list[tuple[Weight, int, int]]]) -> None:
            col, n, pieces = span
            w, r0, r1 = pieces[0]
            if len(pieces) == 1 and w.kind.native:
                W = w.parts["data"][r0:r1]
            else:
                W = self._tile_buf(n, w.cols)
                at = 0
                for v, a, b in pieces:
                    if v.kind.native:
                        W[at : at + b - a] = v.parts["data"][a:b]
                    else:
                        self._dequant(v, a, b, W[at : at + b - a])
                    at += b - a
            np.matmul(X, W.T, out=out[:, col : col + n])

        self._pull(work, _spans(ws, threads), threads)

    def _large_amx(self, ws: Sequence[Weight], X: np.ndarray, out: np.ndarray, threads: int) -> None:
        """Prefill on integer tile products for the tiled dtypes: the fused rows in the
        sgemm path's spans (``_spans``: fewer, larger jobs; per weight, SmolLM2's k and v
        were 16-row slices whose per-call setup outweighed their products), each piece's
        whole tiles of 16 rows on activations packed once for the call; a piece's tail of
        < 16 rows, and the other dtypes, take sgemm."""
        cols0 = np.cumsum([0] + [w.rows for w in ws])
        col_of = {id(w): int(c) for w, c in zip(ws, cols0)}
        # the activations once per width the call's tiled dtypes take
        packs = {
            b: self._amx.prepare(X, b)
            for b in sorted({self.tile_bits[w.dtype] for w in ws if w.dtype in self.tile_bits})
        }

        def piece(w: Weight, r0: int, r1: int) -> None:
            col = col_of[id(w)]
            if w.dtype in self.tile_bits and r1 - r0 >= amx.TILE:
                t1 = r0 + (r1 - r0) // amx.TILE * amx.TILE
                need = self._amx.scratch_bytes(w.dtype, t1 - r0, w.cols)
                scratch = self._amx_scratch(need) if need else None
                self._amx.rows(w.dtype, w.parts, w.cols, r0, t1, packs[self.tile_bits[w.dtype]], out, scratch, col + r0)
                if t1 == r1:
                    return
                r0 = t1
            if w.kind.native:
                np.matmul(X, w.parts["data"][r0:r1].T, out=out[:, col + r0 : col + r1])
                return
            buf = self._tile_buf(r1 - r0, w.cols)
            self._dequant(w, r0, r1, buf)
            np.matmul(X, buf.T, out=out[:, col + r0 : col + r1])

        def work(span: tuple[int, int, list[tuple[Weight, int, int]]]) -> None:
            for w, r0, r1 in span[2]:
                piece(w, r0, r1)

        self._pull(work, _spans(ws, threads), threads)

    def _pull(self, work, jobs: Sequence, threads: int) -> None:
        """Run ``work`` on every job: in this thread when there is one thread or one job,
        else pulled one at a time by the pool's threads."""
        if threads <= 1 or len(jobs) == 1:
            for job in jobs:
                work(job)
            return
        for _ in self._executor(threads).map(work, jobs):
            pass

    def _executor(self, threads: int) -> ThreadPoolExecutor:
        if self._pool is None or self._pool_size != threads:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="cortiq-prefill")
            self._pool_size = threads
        return self._pool

    @property
    def amx_dtypes(self) -> frozenset[str]:
        """The dtypes whose prefill matmuls run on integer tile products."""
        return frozenset(self.tile_bits)

    @property
    def amx_prefill(self) -> bool:
        """Whether prefill matmuls of some dtype (``amx_dtypes``) run on integer tile
        products (activations at ``tile_bits``; AMX tiles, AVX-512 VNNI or AVX2, ``tile_unit``)."""
        return bool(self.amx_dtypes)

    @property
    def tile_unit(self) -> str | None:
        """The unit prefill's tile products run on ("amx", "vnni", "avx2"), None without them."""
        return self._amx.unit if self._amx is not None else None

    def _scratch(self, name: str, size: int, dtype, least: int = 0) -> np.ndarray:
        """This thread's reused buffer ``name`` of at least ``size`` elements (grown when
        short, so prefill matmuls do not page-fault a fresh buffer per call)."""
        buf = getattr(self._tiles, name, None)
        if buf is None or buf.size < size:
            buf = np.empty(max(size, least), dtype)
            setattr(self._tiles, name, buf)
        return buf

    def _amx_scratch(self, size: int) -> np.ndarray:
        """This thread's buffer of unpacked 4/5-bit quants (and AVX2's widened quants)."""
        return self._scratch("quants", size, np.uint8)

    def _tile_buf(self, rows: int, cols: int) -> np.ndarray:
        """This thread's dequantization scratch."""
        return self._scratch("buf", rows * cols, np.float32, TILE_ELEMS // 4)[: rows * cols].reshape(rows, cols)

    def _small(self, plan: "_Plan", X: np.ndarray, out: np.ndarray) -> None:
        if plan.fn is None:
            plan.ops.small(plan.parts, plan.count, plan.offs, X, out)
            return
        # Decode/verify on integer activations: X quantized once per call, inside it.
        qdot.intdot(
            plan.fn, plan.addrs, plan.rows, plan.count, plan.offs, X, _ACT_PROTO[plan.bits], plan.qmax, plan.zmm, out
        )

    def _small_args(self, run: list[Weight]) -> tuple[int, np.ndarray, list[tuple[np.ndarray, ...]]]:
        """(count, row offsets, part 3-tuples padded with empty arrays) for a fused run."""
        if len(run) > FUSE_MAX:
            raise ValueError(f"at most {FUSE_MAX} matrices fuse into one kernel call")
        # Read-only views (map views are read-only; making every member read-only gives a
        # tuple one numba type), made once per plan.
        views = [tuple(_readonly(a) for a in w.kernel_parts()) for w in run]
        parts = []
        for k in range(len(views[0])):
            real = [v[k] for v in views]
            parts.append(tuple(real) + (self._pad(real[0]),) * (FUSE_MAX - len(real)))
        ends = [0]
        for w in run:
            ends.append(ends[-1] + w.rows)
        ends += [ends[-1]] * (FUSE_MAX + 1 - len(ends))
        return len(run), np.array(ends, np.int64), parts

    def _pad(self, like: np.ndarray) -> np.ndarray:
        key = (like.dtype.str, like.shape[1:])
        pad = self._pads.get(key)
        if pad is None:
            pad = self._pads[key] = _readonly(np.zeros((0,) + like.shape[1:], like.dtype))
        return pad

    @staticmethod
    def _dequant(w: Weight, r0: int, r1: int, buf: np.ndarray) -> None:
        ops_for(w.dtype).dequant(w.kernel_parts(), r0, r1, buf)

    # ------------------------------------------------------------ elementwise
    def rms_norm(self, x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        out = np.empty_like(x)
        jit.rms_norm(x, w, np.float32(eps), out)
        return out

    def add_rms_norm(self, x: np.ndarray, delta: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        out = np.empty_like(x)
        jit.add_rms_norm(x, delta, w, np.float32(eps), out)
        return out

    def silu_mul(self, gu: np.ndarray) -> np.ndarray:
        out = np.empty((gu.shape[0], gu.shape[1] // 2), np.float32)
        if gu.shape[0] > self.small_n:
            # prefill: rows in parallel on a vectorized exp (numba's np.exp is a libm call)
            jit.glu_rows(gu, out, False)
        else:
            jit.silu_mul(gu, out)
        return out

    def gelu_tanh_mul(self, gu: np.ndarray) -> np.ndarray:
        out = np.empty((gu.shape[0], gu.shape[1] // 2), np.float32)
        if gu.shape[0] <= self.small_n:
            jit.glu_small(gu, out, True)
        else:
            jit.glu_rows(gu, out, True)
        return out

    def rope(self, x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> None:
        jit.rope(x, cos, sin)

    def _loops(self, dtype) -> attn_ir.AttentionLoops:
        """The attention loops that read a cache of this element type (f32 or f16)."""
        if dtype == np.float32:
            return self._attn
        if self._attn_f16 is None:
            self._attn_f16 = attn_ir.AttentionLoops(*self._attn_args, kv="f16")
        return self._attn_f16

    def attend(self, q, kc, vc, start: int, call: AttentionCall | int, scale=None, sinks=None) -> np.ndarray:
        call = AttentionCall.of(call, scale, sinks)
        if call.softcap:  # the compiled routes have no cap
            return attend(q, kc, vc, start, call, ROW_EXACT_ROWS)
        out = np.empty((q.shape[0], q.shape[1], vc.shape[2]), np.float32)
        n, d, dv = q.shape[0], q.shape[2], vc.shape[2]
        fns = self._loops(kc.dtype).for_dims(d, dv)
        if not (kc.flags.c_contiguous and vc.flags.c_contiguous):
            fns = np.zeros_like(fns)  # the IR loops address rows by a C layout
        if n > SMALL_ATTN and fns[3]:
            self._attend_flash(np.ascontiguousarray(q), kc, vc, start, call, out, fns)
            return out
        if kc.dtype != np.float32 and not (n <= SMALL_ATTN and fns[0]):
            # An f16 cache where the IR loops do not serve: the rows the queries see, widened
            # (exact), through the f32 routes below: the same results, a copy's cost.
            hi = start + n
            kc, vc = kc[:, :hi].astype(np.float32), vc[:, :hi].astype(np.float32)
            fns = self._attn.for_dims(d, dv) if kc.flags.c_contiguous else np.zeros_like(fns)
        if n > SMALL_ATTN:
            # Prefill without the IR loops: the reference blocks (query block x KV head), pulled by the pool's threads.
            qs = q * np.float32(call.scale)
            jobs = attention_jobs(q.shape[0], kc.shape[0])
            self._pull(lambda job: attend_block(qs, kc, vc, start, call, out, *job), jobs, numba.get_num_threads())
            return out
        if kc.dtype == np.float16:  # numba has no f16 arrays: the IR loops read the bits
            kc, vc = kc.view(np.uint16), vc.view(np.uint16)
        jit.attend(np.ascontiguousarray(q), kc, vc, start, call.window, np.float32(call.scale), call.sinks, out, fns)
        return out

    def _attend_flash(
        self, q: np.ndarray, kc: np.ndarray, vc: np.ndarray, start: int, call: AttentionCall, out: np.ndarray, fns
    ) -> None:
        """A prefill's attention (``jit.attend_flash``): the keys its queries see, transposed
        once for every job, and one worker per thread pulling the jobs, heaviest first."""
        n, d = q.shape[0], q.shape[2]
        kvh = kc.shape[0]
        hi = start + n
        window = call.window
        k0 = max(0, start - window + 1) if window > 0 else 0  # the first query's oldest key
        keys = hi - k0
        kt = np.empty((kvh, d, align_up(keys, 16) + 16), np.float32)  # + 16: a key block's last columns
        kt[:, :, :keys] = kc[:, k0:hi].transpose(0, 2, 1)  # an f16 cache widens here (exact)
        kt[:, :, keys:] = 0.0
        if vc.dtype != np.float32:
            vc = vc[:, :hi].astype(np.float32)  # the rows the jobs read, widened once per call
        step = jit.FLASH_QUERIES
        jobs = np.array(
            [(i0, min(n, i0 + step), g) for i0 in reversed(range(0, n, step)) for g in range(kvh)], np.int64
        ).reshape(-1, 3)
        counter = np.zeros(1, np.int64)
        threads = min(numba.get_num_threads(), len(jobs))
        scale = np.float32(call.scale)
        self._pull(
            lambda _: jit.attend_flash(q, kt, k0, vc, start, window, scale, call.sinks, out, jobs, counter, fns),
            range(threads),
            threads,
        )

    # ------------------------------------------------------------ linear attention
    def delta_rule(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray, state: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        S = np.array(state, dtype=np.float32, copy=True)
        o = np.empty(v.shape, np.float32)
        c = np.ascontiguousarray
        jit.delta_rule(
            c(q, np.float32), c(k, np.float32), c(v, np.float32), c(g, np.float32), c(beta, np.float32), S, o
        )
        return o, S

    # ------------------------------------------------------------ fused steps
    def int_plans(self, ws: Sequence[Weight]) -> "list[_Plan] | None":
        """The integer-kernel calls a small matmul over ``ws`` makes (one per run of one
        dtype), or None when one runs on the float kernels (``kernels/fused.py`` takes
        only integer calls)."""
        plans, _ = self._plans_for(ws)
        return plans if all(p.fn is not None for p in plans) else None

    def attention_loops(self, d: int, dv: int, kv: str = "f32") -> np.ndarray:
        """The IR loops ``attend`` gives a decode over a ``kv`` (f32 | f16) cache of these
        head sizes (zeros: none)."""
        return self._loops(KV_DTYPES[kv]).for_dims(d, dv)

    # ------------------------------------------------------------ compile ahead
    def warmup(self, ws: Sequence[Weight]) -> None:
        """Compile (or load from numba's cache) the tile kernels for these dtypes."""
        seen = set()
        for w in ws:
            if w.dtype in seen or w.kind.native:
                continue
            seen.add(w.dtype)
            self._dequant(w, 0, 1, self._tile_buf(1, w.cols))
