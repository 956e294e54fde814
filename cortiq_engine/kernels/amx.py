"""Prefill matmuls as integer tile products: q8 and 4/5-bit weights times int16 activations
(or int8 ones for the 4/5-bit types, on request), on AMX tiles or, where the CPU has none,
the same products on AVX-512 VNNI, or, with neither, the same block sums on AVX2.

Prefill multiplies every weight by hundreds of rows. The portable path (``fast.py``)
dequantizes a slice of the weights to f32 and hands it to single-threaded BLAS, which
peaks near 2 x 16 f32 FMAs a cycle per core. Intel's AMX (Sapphire Rapids and later)
multiplies a 16 x 64 int8 tile by a 64 x 16 one in a single instruction; this module uses
it where the CPU has it and Linux grants the tile state (``arch_prctl``).

The arithmetic is the integer kernels' (``qdot.py``, ggml's ``vec_dot_type``): each input
row is rounded per block of 32 to int16 (``d_x`` = max|x| / 32767, the width q8's decode
uses, so the logits' error stays where the float path has it), and for weight row n and
input row m

    out[m, n] = sum_b  d_w[n, b] * d_x[m, b] * sum_j q_w[n, b, j] * q_x[m, b, j].

AMX has no int16 product, so q_x = 256 * hi + lo (hi signed, lo unsigned bytes) and each
block takes two tile products, ``tdpbssd`` (q_w x hi) and ``tdpbsud`` (q_w x lo), whose
exact int32 sums combine as (hi_sum << 8) + lo_sum (|sum| <= 32 * 127 * 32767 < 2^31).
The block sums are exact integers; each output's float sum runs over the blocks in order,
so a row's result does not depend on the other rows of the call. Prefill results differ
from the f32 path only by the int16 rounding of the activations (bounded in the tests
against ``qdot.qdot_ref``, the float64 twin).

The 4- and 5-bit dtypes (``UNSIGNED``: q4, q4_0, q5, q5_1, q4k, q5k) store unsigned quants
with a scale and a min per block of 32 (see "unsigned quants" below): a slice of their
rows is unpacked to bytes once per call (about 1 ms for 11.5M weights), the products are
``tdpbusd`` / ``tdpbuud`` (A unsigned), and each block adds m_w * s_x. Their decode rounds
activations to int8 (``fast.ACT_BITS``: ggml's choice, its error small beside the weights');
their prefill can too (``pack(X, 8)``: one plane, one product, ``tdpbusd``, a block, the
block sums directly; 1.6-1.8x the int16 form per matrix on a Zen 4, VNNI, one thread, 512
rows), but ``fast.NumbaKernels`` takes that form only when int8 is asked for all
(``CORTIQ_KERNELS=numba-i8``): it changed SmolLM2 q4's answer to the README's demo
question. By default they take the two int16 planes as q8 does. q6k (signed, a scale per
16) stays on the sgemm path.

Layout (one call computes rows r0..r1 of one weight, a multiple of 16, for all inputs):
- A tile (16 weight rows x 32 bytes of block b): read in place from the q8 quants,
  stride = the row's bytes, no copy of the weights; or from the unpacked bytes.
- B tiles (8 rows x 64 bytes: block b of 16 input rows, 4 consecutive bytes of each row
  side by side, the "VNNI" layout): ``pack_x16`` writes them once per matmul, hi and lo
  planes, inputs padded with zero rows to a multiple of 16.
- C tiles (16 weight rows x 16 inputs of int32) go through a 2 KB stack buffer, where 16
  zmm registers of f32 (one per weight row, lanes = inputs) gather the scaled sums.
The output is the matmul's own [inputs, columns] array: each weight row's 16 sums go to
their column by one masked scatter (the padding inputs of the last tile are never
written), where a transposed copy of a [columns, inputs] result took 3.4 ms per 512 x 3072.

Measured (Intel Xeon with AMX; ``benchmarks/bench_amx_prefill.py``, one
thread, 512 rows): 1.0-1.1x the dequantize + sgemm path on SmolLM2's [1536 x 576], 1.2-1.3x
on [576 x 1536], 1.4-1.65x on TinyLlama's [5632 x 2048] and [2048 x 5632], far from the
tile unit's peak. Per-32-block scales take every 16 x 16 block sum out of the tile
registers before the next block, and here a tile load costs about 26 cycles, a tile store
44 and a product 19 (each alone in a loop); int16 needs two products and two stores a
block, so a block's tile work is a serial chain of about 200 cycles for 8,192
multiply-adds (the float work runs one block late, overlapping it). int8 activations
(one product, one store) or bf16 tiles on dequantized weights (sums stay in the tile
across K) would go faster, at an error this path does not add. The unsigned dtypes, one
thread, 512 rows: 1.2-1.6x on TinyLlama's shapes, 0.9-1.1x on SmolLM2's.

The VNNI form (``_vnni_entry_ir``, below): 16 ``vpdpbusd`` per weight row and block on
the same packed activations, the same integer sums and float work. Measured (an
Emerald Rapids VM that hides AMX; 2 threads, 512 rows, q8, with the packing):
1.25-1.32x dequantize + sgemm on TinyLlama's shapes, 0.8-1.0x on SmolLM2's (the block
scaling is 9 vector operations beside every 16 products), so ``fast.py`` gives it only
matmuls of VNNI_MIN_WEIGHTS weights or more.

The AVX2 form (``_avx2_entry_ir``, below; Zen 1-3 and desktop chips without AVX-512): the
same block sums from ``vpmaddwd`` on int16 activations and weights widened to int16, lanes
over weight rows. AVX2 has no multiply-accumulate, so 16 multiply-adds cost two vector
operations, as 8 cost one FMA: the gain over dequantize + sgemm is that the weights are
never dequantized and the sums are exact (measured, Zen 3, one thread, 512 rows, with the
packing and widening: q8 1.25-1.37x, q4 1.15-1.27x per matrix; the kernel alone 63-67
GMAC/s against sgemm's 44).
"""

from __future__ import annotations

import ctypes
import functools
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import njit, prange, types
from llvmlite import ir
from numba.extending import intrinsic

from cortiq_engine.kernels import jit, llvm_jit, qdot
from cortiq_engine.kernels.dtype_ops import OPS, ops_for

QB = 32
TILE = 16  # weight rows and input rows per tile
QMAX16 = qdot.qmax("q8", 16)  # the int16 rounding q8's decode uses
# Activation widths the tiles take and their rounding: int16 (q8's decode rounding; two
# byte planes) and int8 (the 4/5-bit dtypes' decode rounding; one plane, one product).
QMAX = {16: QMAX16, 8: qdot.qmax("q4", 8)}
# Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) lets this process use the tiles.
_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
NEEDED_FEATURES = ("amx-tile", "amx-int8", "avx512f", "f16c")
VNNI_FEATURES = ("avx512f", "avx512bw", "avx512vnni", "f16c")
AVX2_FEATURES = ("avx2", "fma", "f16c")
UNITS = ("amx", "vnni", "avx2")
# The VNNI kernel's weight rows per pass (f32 sums kept across blocks) and integer chains
# per plane and row; measured, one thread, 512 inputs, q8 (GOP/s, best of 7 on the
# Emerald Rapids VM without AMX): 8 rows 1 chain 99-146, 8 rows 2 chains 113-176,
# 16 rows 2 chains 120-188 (a few spills of the 16 activation vectors are cheaper than
# re-reading them for a second pass), 16 rows 4 chains 112-160.
VNNI_PANEL = 16
VNNI_CHAINS = 2


@functools.cache
def _host_has(features: tuple[str, ...]) -> bool:
    """This x86-64 CPU has every one of LLVM's ``features``."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    feats = llvm.get_host_cpu_features()
    return all(feats.get(f, False) for f in features)


def host_vnni() -> bool:
    """The CPU has AVX-512 with VNNI (``vpdpbusd`` on zmm): the tile products' other unit."""
    return _host_has(VNNI_FEATURES)


def host_avx2() -> bool:
    """The CPU has AVX2 with FMA and F16C (``vpmaddwd`` on ymm): the block sums' third unit."""
    return _host_has(AVX2_FEATURES)


def host_unit() -> str | None:
    """The tile unit this process can use: "amx", else "vnni", else "avx2", else None."""
    return "amx" if host_amx() else "vnni" if host_vnni() else "avx2" if host_avx2() else None


@functools.cache
def host_amx() -> bool:
    """The CPU has AMX-INT8 and AVX-512 and the kernel granted this process the tile state
    (asked once; the grant is the process's for its lifetime)."""
    if sys.platform != "linux" or not _host_has(NEEDED_FEATURES):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


# ------------------------------------------------------------ activations
@njit(parallel=True, cache=True, nogil=True)
def pack_x16(X, xb, xd, xs, qmax):
    """X f32[n, cols] -> xb int8[tiles, nb, planes, 8, 64] (B tiles), xd f32[tiles, nb, 16]
    (the block scales) and xs f32[tiles, nb, 16] (d_x * the block's quant sum, the min
    term's factor); byte 4 * m + j of row k4 of a plane is element 4 * k4 + j of block b of
    input 16 * t + m. Two planes: the int16 rounding at ``qmax`` (q8 decode's), plane 0 its
    high bytes, plane 1 its low bytes. One plane: the int8 rounding (``qmax`` 127, the 4/5-bit
    dtypes' decode rounding) itself. Padding inputs get zeros; the rounding is
    ``qdot.quantize_rows``."""
    n, cols = X.shape
    tiles = xb.shape[0]
    two = xb.shape[2] == 2
    nb = cols // QB
    for t in prange(tiles):
        i0 = t * TILE
        m_n = min(TILE, n - i0)
        if m_n < TILE:  # the last tile's padding inputs
            xb[t] = 0
            xd[t] = np.float32(0.0)
            xs[t] = np.float32(0.0)
        xq = np.empty((m_n, cols), np.int16)
        rd = np.empty((m_n, nb), np.float32)
        rs = np.empty((m_n, nb), np.float32)
        qdot.quantize_rows(X[i0 : i0 + m_n], xq, rd, rs, qmax)
        for m in range(m_n):
            for b in range(nb):
                xd[t, b, m] = rd[m, b]
                xs[t, b, m] = rs[m, b]
                for k in range(QB):
                    q = np.int32(xq[m, b * QB + k])
                    if two:
                        xb[t, b, 0, k >> 2, 4 * m + (k & 3)] = np.int8(q >> 8)
                        # the low byte's bits as int8 (the tile op reads them unsigned)
                        xb[t, b, 1, k >> 2, 4 * m + (k & 3)] = np.int8(((q & 255) ^ 128) - 128)
                    else:
                        xb[t, b, 0, k >> 2, 4 * m + (k & 3)] = np.int8(q)


def pack_x16_ref(X: np.ndarray, bits: int = 16) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy twin of ``pack_x16`` (the rounding: ``qdot.quantize_rows_ref``)."""
    n, cols = X.shape
    nb, tiles = cols // QB, (n + TILE - 1) // TILE
    qv, dv, sv = qdot.quantize_rows_ref(X, bits, QMAX[bits])
    q = np.zeros((tiles * TILE, nb, QB), np.int32)
    q[:n] = qv.reshape(n, nb, QB)
    d = np.zeros((2, tiles * TILE, nb), np.float32)
    d[0, :n], d[1, :n] = dv, sv
    if bits == 16:
        planes = np.stack([(q >> 8).astype(np.int8), (q & 255).astype(np.uint8).view(np.int8)])  # [2, rows, nb, 32]
    else:
        planes = q.astype(np.int8)[None]
    k = planes.shape[0]
    # [planes, tiles, 16 m, nb, 8 k4, 4 j] -> [tiles, nb, planes, k4, m, j]
    p = planes.reshape(k, tiles, TILE, nb, QB // 4, 4).transpose(1, 3, 0, 4, 2, 5)
    sc = np.ascontiguousarray(d.reshape(2, tiles, TILE, nb).transpose(0, 1, 3, 2))
    return np.ascontiguousarray(p).reshape(tiles, nb, k, QB // 4, 4 * TILE), sc[0], sc[1]


# ------------------------------------------------------------ unsigned quants
# The 4- and 5-bit dtypes store unsigned quants q (0..15, 0..31) with a per-block scale
# and min: value = d_w * q + m_w (q4_0 and q5 derive m_w = -8 d_w, -16 d_w; q4k and q5k
# have one (d * sc, -dmin * m) pair per group of 32, the same form). A slice of their rows
# is unpacked once into a uint8 scratch [rows, cols] (the A tiles, read with stride cols,
# reused by every 16 inputs of the call), and
#     out[m, n] = sum_b  d_w[n, b] * d_x[m, b] * sum_j q[n, b, j] * q_x[m, b, j]  +  m_w[n, b] * s_x[m, b]
# with s_x = d_x * sum_j q_x (exact: the min times the rounded activations' block sum).
UNSIGNED = tuple(d for d, o in OPS.items() if o.tiles and o.tile_unpacked)


# byte value -> its 8 bits spread to bit 4 of 8 bytes (a fifth bit per element)
_SPREAD = np.array([sum(((v >> i) & 1) << (8 * i + 4) for i in range(8)) for v in range(256)], np.uint64)


@njit(cache=True, nogil=True)
def _unpack_nibbles(src, qh, out, spread):
    """Eight bytes at a time (``unpack_nibbles``): src uint64[blocks * 2], qh uint32[blocks]
    or empty, out uint64[blocks * 4]."""
    low = np.uint64(0x0F0F0F0F0F0F0F0F)
    fifth = qh.size > 0
    for b in range(src.size // 2):
        for k in range(2):
            v = src[2 * b + k]
            lo = v & low
            hi = (v >> np.uint64(4)) & low
            if fifth:
                h = np.uint64(qh[b])
                lo |= spread[(h >> np.uint64(8 * k)) & np.uint64(255)]
                hi |= spread[(h >> np.uint64(16 + 8 * k)) & np.uint64(255)]
            out[4 * b + k] = lo
            out[4 * b + 2 + k] = hi


@njit(cache=True, nogil=True)
def _unpack_k4(src, qh, out):
    """Eight bytes at a time (``unpack_k4``): src uint64[supers * 16], qh uint64[supers * 4]
    or empty, out uint64[supers * 32]."""
    low = np.uint64(0x0F0F0F0F0F0F0F0F)
    bit0 = np.uint64(0x0101010101010101)
    fifth = qh.size > 0
    for s in range(src.size // 16):
        for k in range(4):
            for i in range(4):
                v = src[16 * s + 4 * k + i]
                lo = v & low
                hi = (v >> np.uint64(4)) & low
                if fifth:
                    h = qh[4 * s + i]
                    lo |= ((h >> np.uint64(2 * k)) & bit0) << np.uint64(4)
                    hi |= ((h >> np.uint64(2 * k + 1)) & bit0) << np.uint64(4)
                out[32 * s + 8 * k + i] = lo
                out[32 * s + 8 * k + 4 + i] = hi


def _u64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint64)


def unpack_nibbles(qs: np.ndarray, qh: np.ndarray | None, r0: int, r1: int, out: np.ndarray) -> None:
    """q4 / q4_0 (``qh`` None) and q5 / q5_1 quants of rows r0..r1 -> out uint8[r1 - r0, cols]:
    element j of a block is the low nibble of byte j, j + 16 the high nibble, plus bit j
    of the block's ``qh`` word as bit 4."""
    h = np.zeros(0, np.uint32) if qh is None else np.ascontiguousarray(qh[r0:r1]).reshape(-1)
    _unpack_nibbles(_u64(qs[r0:r1]), h, out.reshape(-1).view(np.uint64), _SPREAD)


def unpack_k4(qs: np.ndarray, qh: np.ndarray | None, r0: int, r1: int, out: np.ndarray) -> None:
    """q4k (``qh`` None) and q5k quants of rows r0..r1 -> out uint8[r1 - r0, cols]: per
    super-block of 256, group 2k is the low nibbles of bytes 32k..32k+31, group 2k+1 their
    high nibbles; q5k's bit g of qh[l] is bit 4 of element l of group g."""
    h = np.zeros(0, np.uint64) if qh is None else _u64(qh[r0:r1])
    _unpack_k4(_u64(qs[r0:r1]), h, out.reshape(-1).view(np.uint64))


def unpack_ref(dtype: str, parts: dict[str, np.ndarray]) -> np.ndarray:
    """numpy twin of the unpackers: every row's unsigned quants, uint8 [rows, cols]."""
    qs = np.asarray(parts["qs"])
    rows = qs.shape[0]
    if ops_for(dtype).k4_scales:
        n = qs.size // 128
        q = (qs.reshape(n, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & np.uint8(15)
        q = q.reshape(n, 8, 32)
        if "qh" in parts:
            h = np.asarray(parts["qh"]).reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = q | ((h & np.uint8(1)) << np.uint8(4))
        return q.reshape(rows, -1)
    nb = qs.shape[1] // 16
    p = qs.reshape(rows, nb, 16)
    q = np.concatenate([p & 15, p >> 4], axis=2)
    if "qh" in parts:
        bits = (np.asarray(parts["qh"]).reshape(rows, nb, 1) >> np.arange(32, dtype=np.uint32)) & 1
        q = q | (bits.astype(np.uint8) << np.uint8(4))
    return q.reshape(rows, nb * QB)


def _f16(a: np.ndarray) -> np.ndarray:
    """A stored f16 part (f16 or its uint16 bits) as f32."""
    return (a if a.dtype == np.float16 else a.view(np.float16)).astype(np.float32)


def block_scales(dtype: str, parts: dict[str, np.ndarray], r0: int, r1: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(d_w, m_w) of rows r0..r1 per block of 32, f32 [rows, nb] (m_w None for q8), the
    f32 values the dtype's decoder multiplies by (``formats.quants``)."""
    k = ops_for(dtype)
    if not k.tiles:
        raise ValueError(f"no AMX prefill for {dtype}")
    d = _f16(np.asarray(parts["d"][r0:r1]))
    if not k.tile_unpacked:
        return d, None
    if k.nibbles and k.roles[1] is not None:
        return d, _f16(np.asarray(parts["m"][r0:r1]))
    if k.zero:  # the zero point decode's kernels derive the min from
        return d, d * np.float32(-k.zero)
    if k.k4_scales:
        from formats.quants import _k4_scale_min

        rows, ns = d.shape
        sc, mn = _k4_scale_min(np.ascontiguousarray(parts["scales"][r0:r1]).reshape(rows * ns, 12))
        dmin = _f16(np.asarray(parts["dmin"][r0:r1]))
        dw = d.reshape(rows * ns, 1) * sc
        mw = -(dmin.reshape(rows * ns, 1) * mn)
        return dw.reshape(rows, ns * 8), mw.reshape(rows, ns * 8)
    raise ValueError(f"no AMX prefill for {dtype}")


def unpack_quants(dtype: str, parts: dict[str, np.ndarray], r0: int, r1: int, out: np.ndarray) -> None:
    """The unsigned quants of rows r0..r1 into ``out`` uint8[r1 - r0, cols]."""
    k = ops_for(dtype)
    if k.tiles and k.tile_unpacked and k.nibbles:
        unpack_nibbles(parts["qs"], parts.get("qh"), r0, r1, out)
    elif k.tiles and k.tile_unpacked and k.k4_scales:
        unpack_k4(parts["qs"], parts.get("qh"), r0, r1, out)
    else:
        raise ValueError(f"no AMX prefill for {dtype}")


# ------------------------------------------------------------ LLVM IR
# ``_store_rows``' one intrinsic, declared by both units' modules.
_SCATTER_DECL = "declare void @llvm.masked.scatter.v16f32.v16p0(<16 x float>, <16 x ptr>, i32 immarg, <16 x i1>)\n"
_DECLS = (
    """
declare void @llvm.x86.ldtilecfg(i8*)
declare void @llvm.x86.tilerelease()
declare void @llvm.x86.tilezero(i8 immarg)
declare void @llvm.x86.tileloadd64(i8 immarg, i8*, i64)
declare void @llvm.x86.tilestored64(i8 immarg, i8*, i64)
declare void @llvm.x86.tdpbssd(i8 immarg, i8 immarg, i8 immarg)
declare void @llvm.x86.tdpbsud(i8 immarg, i8 immarg, i8 immarg)
declare void @llvm.x86.tdpbusd(i8 immarg, i8 immarg, i8 immarg)
declare void @llvm.x86.tdpbuud(i8 immarg, i8 immarg, i8 immarg)
declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)
"""
    + _SCATTER_DECL
)
# The entries, one per (weights, activation width): signed weights (q8) on int16
# activations, unsigned unpacked quants with a min term on int16 or int8 activations.
FORMS = (("q8", 16), ("u8", 16), ("u8", 8))
ENTRIES = {f: f"amx_{f[0]}a{f[1]}" for f in FORMS}
# (hi product, lo product) per weight sign: A signed or unsigned bytes, B's high plane
# signed, its low plane unsigned.
_PRODUCTS = {"q8": ("tdpbssd", "tdpbsud"), "u8": ("tdpbusd", "tdpbuud")}
# Tiles: 0/1 the hi/lo C sums, 2 the weights (A), 3/4 the hi/lo activations (B).
_CFG_TILES = ((0, TILE, 64), (1, TILE, 64), (2, TILE, QB), (3, QB // 4, 64), (4, QB // 4, 64))


def tile_config() -> np.ndarray:
    """The 64-byte ``ldtilecfg`` operand: palette 1, each tile's rows and bytes per row."""
    cfg = np.zeros(64, np.uint8)
    cfg[0] = 1
    colsb, rows = cfg[16:32].view(np.uint16), cfg[48:56]
    for t, r, c in _CFG_TILES:
        colsb[t], rows[t] = c, r
    return cfg


def module_ir() -> str:
    """Every entry (``_entry_ir``)."""
    return "\n".join([_DECLS] + [_entry_ir(form) for form in ENTRIES])


def _entry_ir(form: tuple[str, int]) -> str:
    """``ENTRIES[form](wq, wdt, wmt, xb, xd, xs, out, r0, r1, nb, tiles, cols, cfg, ostride, nin)``:
    out[m, n - r0] (rows ``ostride`` floats apart, the first ``nin`` inputs: ``_store_rows``)
    for weight rows n in r0..r1 (a multiple of 16 apart) and every packed input; ``wdt``
    (and for "u8" ``wmt``, the mins, times ``xs``) is the slice's weight scales as f32
    [(r1 - r0) / 16][nb][16] (``panel``).

    Tile loads and stores cost 25-45 cycles each here, and a block's tiles are reused by
    the next block, so the AMX work of one block is a serial chain of about 200 cycles.
    The float work on a block's sums (about 150 cycles) is therefore done one block late,
    from the other of two stack buffers: it overlaps the next block's tile chain instead
    of following it (a 2048 x 5632 q8 matmul of 512 rows: 340 -> about 200 cycles a block).
    int8 activations (one plane) take the high plane's product alone: its sums are the block sums."""
    L: list[str] = []
    a = L.append
    kind, bits = form
    two = bits == 16
    hi_op, lo_op = _PRODUCTS[kind]
    a(
        f"define void @{ENTRIES[form]}(i8* %wq, float* %wdt, float* %wmt, i8* %xb, float* %xd, float* %xs, float* %out, "
        "i64 %r0, i64 %r1, i64 %nb, i64 %tiles, i64 %cols, i8* %cfg, i64 %ostride, i64 %nin) nounwind {"
    )
    a("entry:")
    for k in range(2):
        a(f"  %bufh{k} = alloca [256 x i32], align 64")
        a(f"  %bufl{k} = alloca [256 x i32], align 64")
        a(f"  %bh8_{k} = bitcast [256 x i32]* %bufh{k} to i8*")
        a(f"  %bl8_{k} = bitcast [256 x i32]* %bufl{k} to i8*")
        a(f"  %bh_{k} = bitcast [256 x i32]* %bufh{k} to <16 x i32>*")
        a(f"  %bl_{k} = bitcast [256 x i32]* %bufl{k} to <16 x i32>*")
    a("  %pstride = mul i64 %nb, 16")
    a("  call void @llvm.x86.ldtilecfg(i8* %cfg)")
    _skip_empty(a)
    a("panel:")
    a("  %p = phi i64 [%r0, %entry], [%pnext, %tdone]")
    a("  %wrow = mul i64 %p, %cols")
    a("  %prow = sub i64 %p, %r0")
    a("  %pi = udiv i64 %prow, 16")
    a("  %wdpanel = mul i64 %pi, %pstride")
    a("  br label %tile")

    def amx_block(tag: str, b: str, k: int) -> None:
        """Tile work of block ``b`` into buffer pair ``k``."""
        a("  call void @llvm.x86.tilezero(i8 0)")
        if two:
            a("  call void @llvm.x86.tilezero(i8 1)")
        a(f"  %wo{tag} = add i64 %wrow, {_mul(b, 32, tag, a)}")
        a(f"  %wp{tag} = getelementptr i8, i8* %wq, i64 %wo{tag}")
        a(f"  call void @llvm.x86.tileloadd64(i8 2, i8* %wp{tag}, i64 %cols)")
        a(f"  %tbb{tag} = add i64 %tb, {b}")
        a(f"  %xo{tag} = mul i64 %tbb{tag}, {512 * (2 if two else 1)}")
        a(f"  %xph{tag} = getelementptr i8, i8* %xb, i64 %xo{tag}")
        a(f"  call void @llvm.x86.tileloadd64(i8 3, i8* %xph{tag}, i64 64)")
        a(f"  call void @llvm.x86.{hi_op}(i8 0, i8 2, i8 3)")
        a(f"  call void @llvm.x86.tilestored64(i8 0, i8* {_sel(tag, 'bh8', k, 'i8*', a)}, i64 64)")
        if two:
            a(f"  %xpl{tag} = getelementptr i8, i8* %xph{tag}, i64 512")
            a(f"  call void @llvm.x86.tileloadd64(i8 4, i8* %xpl{tag}, i64 64)")
            a(f"  call void @llvm.x86.{lo_op}(i8 1, i8 2, i8 4)")
            a(f"  call void @llvm.x86.tilestored64(i8 1, i8* {_sel(tag, 'bl8', k, 'i8*', a)}, i64 64)")

    def post(tag: str, b: str, k: str, accs: list[str]) -> list[str]:
        """Block ``b``'s sums from buffer pair ``k``, scaled into ``accs``; the new names."""
        a(f"  %tbp{tag} = add i64 %tb, {b}")
        a(f"  %xdo{tag} = mul i64 %tbp{tag}, 16")
        a(f"  %xdp{tag} = getelementptr float, float* %xd, i64 %xdo{tag}")
        a(f"  %xdpv{tag} = bitcast float* %xdp{tag} to <16 x float>*")
        a(f"  %xdv{tag} = load <16 x float>, <16 x float>* %xdpv{tag}, align 4")
        if kind == "u8":
            a(f"  %xsp{tag} = getelementptr float, float* %xs, i64 %xdo{tag}")
            a(f"  %xspv{tag} = bitcast float* %xsp{tag} to <16 x float>*")
            a(f"  %xsv{tag} = load <16 x float>, <16 x float>* %xspv{tag}, align 4")
        a(f"  %wdo{tag} = add i64 %wdpanel, {_mul(b, 16, tag + 'w', a)}")
        bh = _sel(tag, "bh", k, "<16 x i32>*", a)
        bl = _sel(tag, "bl", k, "<16 x i32>*", a) if two else None
        out = []
        for r in range(TILE):
            a(f"  %hp{tag}{r} = getelementptr <16 x i32>, <16 x i32>* {bh}, i64 {r}")
            a(f"  %h{tag}{r} = load <16 x i32>, <16 x i32>* %hp{tag}{r}, align 64")
            if two:
                a(f"  %lp{tag}{r} = getelementptr <16 x i32>, <16 x i32>* {bl}, i64 {r}")
                a(f"  %l{tag}{r} = load <16 x i32>, <16 x i32>* %lp{tag}{r}, align 64")
                a(f"  %hs{tag}{r} = shl <16 x i32> %h{tag}{r}, {splat('i32', 8)}")
                a(f"  %s{tag}{r} = add <16 x i32> %hs{tag}{r}, %l{tag}{r}")
            sums = f"%s{tag}{r}" if two else f"%h{tag}{r}"
            a(f"  %wdi{tag}{r} = add i64 %wdo{tag}, {r}")
            out.append(_scaled(a, kind, f"{tag}{r}", sums, f"%xdv{tag}", f"%xsv{tag}", f"%wdi{tag}{r}", accs[r]))
        return out

    # tile t: block 0's tiles, then blocks 1..nb-1 each with the float work of the one before
    a("tile:")
    a("  %t = phi i64 [0, %panel], [%tnext, %bdone]")
    a("  %tb = mul i64 %t, %nb")
    amx_block("z", "0", 0)
    a("  %one = icmp sgt i64 %nb, 1")
    a("  br i1 %one, label %blk, label %bdone")
    a("blk:")
    a("  %b = phi i64 [1, %tile], [%bnext, %blk]")
    accs = [f"%acc{r}" for r in range(TILE)]
    phi_at = len(L)
    a("  %par = and i64 %b, 1")
    a("  %pprev = xor i64 %par, 1")
    a("  %bprev = sub i64 %b, 1")
    amx_block("m", "%b", "%par")
    new = post("q", "%bprev", "%pprev", accs)
    _loop_end(a, "b", 1, "%nb", "blk", "bdone")
    L[phi_at:phi_at] = [
        f"  {accs[r]} = phi <16 x float> [zeroinitializer, %tile], [{new[r]}, %blk]" for r in range(TILE)
    ]
    a("bdone:")
    for r in range(TILE):
        a(f"  %e{r} = phi <16 x float> [zeroinitializer, %tile], [{new[r]}, %blk]")
    a("  %blast = sub i64 %nb, 1")
    a("  %plast = and i64 %blast, 1")
    _store_rows(a, post("e", "%blast", "%plast", [f"%e{r}" for r in range(TILE)]))
    _end_entry(a, ("t", "%tiles", "tile"), ("p", 16, "%r1"), "  call void @llvm.x86.tilerelease()")
    return "\n".join(L)


# ------------------------------------------------------------ the same products on AVX-512 VNNI
# Where a CPU has no tile unit but AVX-512 VNNI (Ice Lake and later Xeons, Zen 4, and VMs
# that hide AMX), ``vpdpbusd`` computes the same block sums from the same packed
# activations: lane m of a zmm is input m of a B tile, its four bytes the four of row k4,
# and the weights' four bytes of that k4 are broadcast from the quants in place (no copy).
# vpdpbusd multiplies unsigned by signed bytes, so the activations take the unsigned side:
# the low plane already is, the high plane is flipped to hi + 128 (xor 0x80), and
#     (hi_sum << 8) + lo_sum = (sum w * (hi + 128) << 8) + lo_sum - 32768 * sum w
# with the weights' block sums (``block_sums``) precomputed per slice. The 4- and 5-bit
# dtypes' unpacked quants (0..31) are the same numbers read as signed bytes. Every block
# sum is the exact integer the tile products give, and the float work after it is the
# same operations in the same order, so the two units' results are bit for bit equal.
# int8 activations (one plane) are flipped the same way: sum w * (x + 128) - 128 * sum w.
VNNI_ENTRIES = {f: f"vnni_{f[0]}a{f[1]}" for f in FORMS}
# The correction's factor per activation width: 2^15 (the high plane, shifted by 8), 2^7.
SUM_FACTOR = {16: 32768, 8: 128}


@njit(cache=True, nogil=True)
def _block_sums(q, out, factor):
    """out[r, b] = factor * the sum of bytes 32 b .. 32 b + 31 of row r (int8 or uint8 rows)."""
    rows, nb = out.shape
    for r in range(rows):
        for b in range(nb):
            s = np.int32(0)
            for j in range(QB):
                s += np.int32(q[r, QB * b + j])
            out[r, b] = s * np.int32(factor)


def block_sums(q: np.ndarray, bits: int = 16) -> np.ndarray:
    """SUM_FACTOR[bits] x each block's sum of a slice's quants [rows, cols] (int8 q8 or the
    unpacked uint8), int32 [rows, cols / 32]: the VNNI kernel's correction for the flipped
    activations (|sum| <= 32 * 255, so 2^15 times it fits int32)."""
    out = np.empty((q.shape[0], q.shape[1] // QB), np.int32)
    _block_sums(q, out, SUM_FACTOR[bits])
    return out


def vnni_module_ir() -> str:
    """Every VNNI entry (``_vnni_entry_ir``)."""
    decls = (
        "declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <16 x i32>, <16 x i32>)\n"
        "declare <16 x float> @llvm.fma.v16f32(<16 x float>, <16 x float>, <16 x float>)\n" + _SCATTER_DECL
    )
    return "\n".join([decls] + [_vnni_entry_ir(form) for form in VNNI_ENTRIES])


def _vnni_entry_ir(form: tuple[str, int]) -> str:
    """``VNNI_ENTRIES[form](wq, wdt, wmt, wsc, xb, xd, xs, out, r0, r1, nb, tiles, cols, ostride, nin)``:
    ``ENTRIES[form]``'s result, with ``wsc`` the slice's ``block_sums`` laid out as
    ``wdt`` (``panel``). Per pass of VNNI_PANEL weight rows and 16 inputs, one block's
    16 activation vectors (8 for int8) are loaded once and each row takes 16 vpdpbusd
    (hi and lo planes, 8 groups of 4 bytes; int8: 8) with its weight bytes broadcast
    from memory."""
    L: list[str] = []
    a = L.append
    kind, bits = form
    two = bits == 16
    planes = (("hr", 0), ("l", 512)) if two else (("hr", 0),)
    P = VNNI_PANEL
    if TILE % P:  # ``rows`` hands whole tiles of 16 rows; a pass must never run past them
        raise ValueError(f"VNNI_PANEL {P} must divide {TILE}")
    a(
        f"define void @{VNNI_ENTRIES[form]}(i8* %wq, float* %wdt, float* %wmt, i32* %wsc, i8* %xb, float* %xd, "
        "float* %xs, float* %out, i64 %r0, i64 %r1, i64 %nb, i64 %tiles, i64 %cols, i64 %ostride, i64 %nin) nounwind {"
    )
    a("entry:")
    a("  %pstride = mul i64 %nb, 16")
    for r in range(P):
        a(f"  %cr{r} = mul i64 %cols, {r}")
    _skip_empty(a)
    a("panel:")
    a("  %p = phi i64 [%r0, %entry], [%pnext, %tdone]")
    a("  %prow = sub i64 %p, %r0")
    a("  %pi = udiv i64 %prow, 16")
    a("  %po = urem i64 %prow, 16")
    a("  %pb0 = mul i64 %pi, %pstride")
    a("  %pbase = add i64 %pb0, %po")
    a("  %wrow = mul i64 %p, %cols")
    a("  br label %tile")
    a("tile:")
    a("  %t = phi i64 [0, %panel], [%tnext, %bdone]")
    a("  %tb = mul i64 %t, %nb")
    a("  br label %blk")
    a("blk:")
    a("  %b = phi i64 [0, %tile], [%bnext, %blk]")
    phi_at, new = len(L), []  # the sums' phis go here once their new names are known
    a("  %tbb = add i64 %tb, %b")
    a(f"  %xo = mul i64 %tbb, {512 * len(planes)}")
    a("  %xph = getelementptr i8, i8* %xb, i64 %xo")
    for k in range(QB // 4):
        for plane, off in planes:
            a(f"  %{plane}p{k} = getelementptr i8, i8* %xph, i64 {off + 64 * k}")
            a(f"  %{plane}pv{k} = bitcast i8* %{plane}p{k} to <16 x i32>*")
            a(f"  %{plane}{k} = load <16 x i32>, <16 x i32>* %{plane}pv{k}, align 1")
        a(f"  %h{k} = xor <16 x i32> %hr{k}, {splat('i32', -2139062144)}")  # 0x80808080: hi + 128
    a("  %xdo = mul i64 %tbb, 16")
    a("  %xdp = getelementptr float, float* %xd, i64 %xdo")
    a("  %xdpv = bitcast float* %xdp to <16 x float>*")
    a("  %xdv = load <16 x float>, <16 x float>* %xdpv, align 4")
    if kind == "u8":
        a("  %xsp = getelementptr float, float* %xs, i64 %xdo")
        a("  %xspv = bitcast float* %xsp to <16 x float>*")
        a("  %xsv = load <16 x float>, <16 x float>* %xspv, align 4")
    a("  %b32 = mul i64 %b, 32")
    a("  %wb = add i64 %wrow, %b32")
    a("  %b16 = mul i64 %b, 16")
    a("  %sidx = add i64 %pbase, %b16")
    for r in range(P):
        a(f"  %wo{r} = add i64 %wb, %cr{r}")
        a(f"  %wp{r} = getelementptr i8, i8* %wq, i64 %wo{r}")
        a(f"  %wi{r} = bitcast i8* %wp{r} to i32*")
        # two chains per plane (even and odd groups): half the latency chain a block
        hh, ll = ["zeroinitializer"] * VNNI_CHAINS, ["zeroinitializer"] * VNNI_CHAINS
        for k in range(QB // 4):
            c = k % VNNI_CHAINS
            a(f"  %wkp{r}_{k} = getelementptr i32, i32* %wi{r}, i64 {k}")
            a(f"  %wk{r}_{k} = load i32, i32* %wkp{r}_{k}, align 1")
            a(f"  %wki{r}_{k} = insertelement <16 x i32> undef, i32 %wk{r}_{k}, i32 0")
            a(f"  %wks{r}_{k} = shufflevector <16 x i32> %wki{r}_{k}, <16 x i32> undef, <16 x i32> zeroinitializer")
            a(
                f"  %hh{r}_{k} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {hh[c]}, <16 x i32> %h{k}, <16 x i32> %wks{r}_{k})"
            )
            hh[c] = f"%hh{r}_{k}"
            if two:
                a(
                    f"  %ll{r}_{k} = call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {ll[c]}, <16 x i32> %l{k}, <16 x i32> %wks{r}_{k})"
                )
                ll[c] = f"%ll{r}_{k}"
        for c in range(1, VNNI_CHAINS):
            a(f"  %hj{r}_{c} = add <16 x i32> {hh[0]}, {hh[c]}")
            hh[0] = f"%hj{r}_{c}"
            if two:
                a(f"  %lj{r}_{c} = add <16 x i32> {ll[0]}, {ll[c]}")
                ll[0] = f"%lj{r}_{c}"
        if two:
            a(f"  %hs{r} = shl <16 x i32> {hh[0]}, {splat('i32', 8)}")
            a(f"  %s0{r} = add <16 x i32> %hs{r}, {ll[0]}")
        flipped = f"%s0{r}" if two else hh[0]
        a(f"  %ci{r} = add i64 %sidx, {r}")
        a(f"  %s{r} = sub <16 x i32> {flipped}, {_bcast(a, f'c{r}', 'i32', '%wsc', f'%ci{r}')}")
        new.append(_scaled(a, kind, str(r), f"%s{r}", "%xdv", "%xsv", f"%ci{r}", f"%acc{r}"))
    _loop_end(a, "b", 1, "%nb", "blk", "bdone")
    L[phi_at:phi_at] = [f"  %acc{r} = phi <16 x float> [zeroinitializer, %tile], [{new[r]}, %blk]" for r in range(P)]
    a("bdone:")
    _store_rows(a, new)
    _end_entry(a, ("t", "%tiles", "tile"), ("p", P, "%r1"))
    return "\n".join(L)


# ------------------------------------------------------------ the same block sums on AVX2
# Where a CPU has neither tiles nor AVX-512 (Zen 1-3, most desktop chips), ``vpmaddwd``
# multiplies 16 int16 pairs into 8 int32 sums, exact for int16 activations times weights
# widened to int16: the block sums are the integers the tile products give, and the float
# work on them is ``_scaled``'s operations in the same order, so the three units agree bit
# for bit. The lanes are weight rows here, not inputs: the weights of a slice are widened
# once per call (``interleave16``: 16 rows x 2 elements side by side, a ymm of 8 rows' pair
# per load, reused by every input), each input's pair of int16 activations is broadcast
# from its quantized row (``pack_rows``: the rounding decode uses, no B-tile layout), and a
# pass's results are 16 consecutive columns of the output row: plain stores, where AVX2
# has no scatter. int16 activations only (the default width; int8 tiles stay VNNI/AMX's).
AVX2_ENTRIES = {"q8": "avx2_q8a16", "u8": "avx2_u8a16"}
# Inputs per pass (each with 2 ymm of int32 sums per 16 weight rows). Kernel alone, one
# thread, 512 inputs, q8, Zen 3 (GMAC/s; OpenBLAS sgemm on f32 weights: 44): 2 inputs 57-61,
# 3: 64-65, 4: 63-67, 5: 62-65, 6: 59-63.
AVX2_INPUTS = 4


@dataclass(frozen=True)
class Rows16:
    """One matmul's activations for the AVX2 unit: rounded to int16 per block of 32
    (``qdot.quantize_rows``), rows padded with zeros to a multiple of AVX2_INPUTS."""

    xq: np.ndarray  # int16 [groups * AVX2_INPUTS, cols]
    xd: np.ndarray  # f32 [groups * AVX2_INPUTS, nb]
    xs: np.ndarray  # f32 [groups * AVX2_INPUTS, nb]
    n: int  # the real inputs
    bits: int = 16

    @property
    def groups(self) -> int:
        return self.xq.shape[0] // AVX2_INPUTS


@njit(parallel=True, cache=True, nogil=True)
def _pack_rows(X, xq, xd, xs, qmax):
    n = X.shape[0]
    chunks = (n + 63) // 64
    for c in prange(chunks):
        i0 = c * 64
        i1 = min(n, i0 + 64)
        qdot.quantize_rows(X[i0:i1], xq[i0:i1], xd[i0:i1], xs[i0:i1], qmax)


def pack_rows(X: np.ndarray) -> Rows16:
    """``X`` f32 [n, cols] rounded to int16 per block of 32 at q8 decode's ``qmax``."""
    n, cols = X.shape
    padded = -(-n // AVX2_INPUTS) * AVX2_INPUTS
    xq = np.zeros((padded, cols), np.int16)
    xd = np.zeros((padded, cols // QB), np.float32)
    xs = np.zeros((padded, cols // QB), np.float32)
    if n:
        _pack_rows(np.ascontiguousarray(X, np.float32), xq, xd, xs, QMAX16)
    return Rows16(xq, xd, xs, n)


@njit(cache=True, nogil=True)
def _interleave16(src, out):
    rows, cols = src.shape
    for p in range(rows // TILE):
        for b in range(cols // QB):
            for j in range(QB // 2):
                for r in range(TILE):
                    out[p, b, j, r, 0] = np.int16(src[TILE * p + r, QB * b + 2 * j])
                    out[p, b, j, r, 1] = np.int16(src[TILE * p + r, QB * b + 2 * j + 1])


@intrinsic
def _call_avx2(typingctx, addr, w, wdt, wmt, xq, xd, xs, out, panels, nb, groups, cols, ostride, nin):
    """An ``_avx2_entry_ir`` entry at ``addr``: its 7 pointers and 6 counts as int64."""
    return types.void(*([types.int64] * 14)), llvm_jit.call_by_address([ir.IntType(64)] * 13)


@njit(cache=True, nogil=True)
def _avx2_slice(fn, unsigned, src, fill, d16, m16, zero, r0, w16, wdt, wmt, xq, xd, xs, out, col, nin):
    """One prefill job of the "avx2" unit in one call without the GIL. With ``fill``, the
    scales of the slice's rows r0.. (f16 bits ``d16`` [rows, nb]; for the ``unsigned``
    dtypes the mins, ``m16``, or ``-zero * d`` when ``zero``) into ``panel``'s layout
    (``wdt``, ``wmt`` f32 [passes, nb, 16]; without, the caller filled them); the quants
    ``src`` (the slice's rows: q8's int8 or the unpacked uint8) widened by
    ``_interleave16`` into ``w16``; then the entry ``fn``. Under two threads the same
    steps as separate Python calls waited for each other's GIL (SmolLM2's q|k|v prefill
    matmul: 1.8 of 6.9 ms summed over the threads outside the kernel, 0.3 on one thread)."""
    rows, cols = src.shape
    nb = cols // QB
    if fill:
        for p in range(rows // TILE):
            for b in range(nb):
                for r in range(TILE):
                    dv = jit.f16_to_f32(d16[r0 + TILE * p + r, b])
                    wdt[p, b, r] = dv
                    if unsigned and zero != 0:
                        wmt[p, b, r] = dv * np.float32(-zero)
                    elif unsigned:
                        wmt[p, b, r] = jit.f16_to_f32(m16[r0 + TILE * p + r, b])
    _interleave16(src, w16)
    _call_avx2(
        fn,
        w16.ctypes.data,
        wdt.ctypes.data,
        wmt.ctypes.data if unsigned else 0,
        xq.ctypes.data,
        xd.ctypes.data,
        xs.ctypes.data,
        out.ctypes.data + 4 * col,
        rows // TILE,
        nb,
        xq.shape[0] // AVX2_INPUTS,
        cols,
        out.shape[1],
        nin,
    )


def interleave16(src: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A slice's quants [rows, cols] (int8 q8 or the unpacked uint8; rows a multiple of 16)
    widened to int16 [rows / 16, nb, 16 pairs, 16 rows, 2]: the pair (2 j, 2 j + 1) of
    block b of the 16 rows of a pass side by side."""
    rows, cols = src.shape
    shape = (rows // TILE, cols // QB, QB // 2, TILE, 2)
    if out is None:
        out = np.empty(shape, np.int16)
    _interleave16(src, out)
    return out


def interleave16_ref(src: np.ndarray) -> np.ndarray:
    """numpy twin of ``interleave16``."""
    rows, cols = src.shape
    w = src.astype(np.int16).reshape(rows // TILE, TILE, cols // QB, QB // 2, 2)
    return np.ascontiguousarray(w.transpose(0, 2, 3, 1, 4))


def avx2_module_ir() -> str:
    """Every AVX2 entry (``_avx2_entry_ir``)."""
    decls = (
        "declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)\n"
        "declare <8 x float> @llvm.fma.v8f32(<8 x float>, <8 x float>, <8 x float>)\n"
    )
    return "\n".join([decls] + [_avx2_entry_ir(kind) for kind in AVX2_ENTRIES])


def _avx2_entry_ir(kind: str) -> str:
    """``AVX2_ENTRIES[kind](w16, wdt, wmt, xq, xd, xs, out, panels, nb, groups, cols, ostride, nin)``:
    out[m, 16 p + r] (rows ``ostride`` floats apart, inputs m < ``nin``) for the ``panels``
    passes of 16 weight rows of an ``interleave16`` slice and every input of a ``Rows16``
    (``groups`` x AVX2_INPUTS rows of ``cols`` int16); ``wdt`` (and for "u8" ``wmt``, the
    mins, times ``xs``) the slice's scales as ``panel`` lays them out. Per pass and group of
    inputs, each block's 16 pairs take 2 ymm loads of weights and one broadcast per input,
    and 2 ``vpmaddwd`` + 2 adds per input."""
    L: list[str] = []
    a = L.append
    M = AVX2_INPUTS
    i32x8 = "<8 x i32>"
    f32x8 = "<8 x float>"
    a(
        f"define void @{AVX2_ENTRIES[kind]}(i16* %w, float* %wdt, float* %wmt, i16* %xq, float* %xd, float* %xs, "
        "float* %out, i64 %panels, i64 %nb, i64 %groups, i64 %cols, i64 %ostride, i64 %nin) nounwind {"
    )
    a("entry:")
    # the f32 sums live in a stack buffer, the registers hold the int32 sums and operands
    # (as phis, 8 f32 vectors beside 8 int32 ones spilled: 42-55 -> 62-67 GMAC/s, Zen 3)
    a(f"  %fbuf = alloca [{2 * M} x <8 x float>], align 32")
    a("  %e0 = icmp sle i64 %panels, 0")
    a("  %e1 = icmp sle i64 %groups, 0")
    a("  %e2 = icmp sle i64 %nb, 0")
    a("  %e01 = or i1 %e0, %e1")
    a("  %skip = or i1 %e01, %e2")
    a("  %pstride = mul i64 %nb, 16")
    a(f"  %wstride = mul i64 %nb, {QB * TILE}")
    a("  br i1 %skip, label %exit, label %panel")
    a("panel:")
    a("  %p = phi i64 [0, %entry], [%pnext, %gdone]")
    a("  %wpan = mul i64 %p, %wstride")
    a("  %dpan = mul i64 %p, %pstride")
    a("  %ocol = mul i64 %p, 16")
    a("  br label %group")
    a("group:")
    a("  %g = phi i64 [0, %panel], [%gnext, %stored]")
    a(f"  %m0 = mul i64 %g, {M}")
    for i in range(M):
        a(f"  %m{i}_ = add i64 %m0, {i}")
        a(f"  %xr{i} = mul i64 %m{i}_, %cols")
        a(f"  %dr{i} = mul i64 %m{i}_, %nb")
    for k in range(2 * M):
        a(f"  %fa{k} = getelementptr [{2 * M} x <8 x float>], [{2 * M} x <8 x float>]* %fbuf, i64 0, i64 {k}")
        a(f"  store <8 x float> zeroinitializer, <8 x float>* %fa{k}, align 32")
    a("  br label %blk")
    a("blk:")
    a("  %b = phi i64 [0, %group], [%bnext, %blk]")
    new = {}
    a(f"  %wb0 = mul i64 %b, {QB * TILE}")
    a("  %wb = add i64 %wpan, %wb0")
    a(f"  %xb = mul i64 %b, {QB}")
    iacc: dict[tuple[int, int], str] = {}
    for j in range(QB // 2):
        for h in range(2):
            a(f"  %wo{j}_{h} = add i64 %wb, {32 * j + 16 * h}")
            a(f"  %wp{j}_{h} = getelementptr i16, i16* %w, i64 %wo{j}_{h}")
            a(f"  %wv{j}_{h} = bitcast i16* %wp{j}_{h} to <16 x i16>*")
            a(f"  %w{j}_{h} = load <16 x i16>, <16 x i16>* %wv{j}_{h}, align 2")
        for i in range(M):
            t = f"{j}_{i}"
            a(f"  %xo{t} = add i64 %xr{i}, %xb")
            a(f"  %xo2{t} = add i64 %xo{t}, {2 * j}")
            a(f"  %xp{t} = getelementptr i16, i16* %xq, i64 %xo2{t}")
            a(f"  %xpi{t} = bitcast i16* %xp{t} to i32*")
            a(f"  %x{t} = load i32, i32* %xpi{t}, align 2")
            a(f"  %xi{t} = insertelement {i32x8} undef, i32 %x{t}, i32 0")
            a(f"  %xsp{t} = shufflevector {i32x8} %xi{t}, {i32x8} undef, <8 x i32> zeroinitializer")
            a(f"  %xw{t} = bitcast {i32x8} %xsp{t} to <16 x i16>")
            for h in range(2):
                a(f"  %pm{t}_{h} = call {i32x8} @llvm.x86.avx2.pmadd.wd(<16 x i16> %w{j}_{h}, <16 x i16> %xw{t})")
                if (i, h) in iacc:
                    a(f"  %ia{t}_{h} = add {i32x8} {iacc[i, h]}, %pm{t}_{h}")
                    iacc[i, h] = f"%ia{t}_{h}"
                else:
                    iacc[i, h] = f"%pm{t}_{h}"
    # the block's scales (and mins) of the pass's 16 weight rows, the same for every input
    a("  %db = mul i64 %b, 16")
    for h in range(2):
        a(f"  %dw{h} = load {f32x8}, {f32x8}* {_f32x8_at(a, f'dw{h}', '%wdt', '%dpan', '%db', 8 * h)}, align 4")
        if kind == "u8":
            a(f"  %mw{h} = load {f32x8}, {f32x8}* {_f32x8_at(a, f'mw{h}', '%wmt', '%dpan', '%db', 8 * h)}, align 4")
    for i in range(M):
        a(f"  %dxi{i} = add i64 %dr{i}, %b")
        xdv = _bcast8(a, f"xd{i}", "%xd", f"%dxi{i}")
        xsv = _bcast8(a, f"xs{i}", "%xs", f"%dxi{i}") if kind == "u8" else None
        for h in range(2):
            t = f"{i}_{h}"
            # _scaled's operations in its order: sitofp, d_x * d_w, fma, then the min term
            a(f"  %f{t} = sitofp {i32x8} {iacc[i, h]} to {f32x8}")
            a(f"  %sc{t} = fmul {f32x8} {xdv}, %dw{h}")
            a(f"  %acc{t} = load {f32x8}, {f32x8}* %fa{2 * i + h}, align 32")
            a(f"  %n{t} = call {f32x8} @llvm.fma.v8f32({f32x8} %f{t}, {f32x8} %sc{t}, {f32x8} %acc{t})")
            if kind == "u8":
                a(f"  %nm{t} = call {f32x8} @llvm.fma.v8f32({f32x8} %mw{h}, {f32x8} {xsv}, {f32x8} %n{t})")
                new[i, h] = f"%nm{t}"
            else:
                new[i, h] = f"%n{t}"
    for i in range(M):
        for h in range(2):
            a(f"  store {f32x8} {new[i, h]}, {f32x8}* %fa{2 * i + h}, align 32")
    _loop_end(a, "b", 1, "%nb", "blk", "bdone")
    a("bdone:")
    a("  br label %st0")
    for i in range(M):  # the padding inputs of the last group are never written
        nxt = f"st{i + 1}" if i + 1 < M else "stored"
        a(f"st{i}:")
        a(f"  %in{i} = icmp slt i64 %m{i}_, %nin")
        a(f"  br i1 %in{i}, label %do{i}, label %{nxt}")
        a(f"do{i}:")
        a(f"  %orow{i} = mul i64 %m{i}_, %ostride")
        for h in range(2):
            o = _f32x8_at(a, f"o{i}_{h}", "%out", f"%orow{i}", "%ocol", 8 * h)
            a(f"  store {f32x8} {new[i, h]}, {f32x8}* {o}, align 4")
        a(f"  br label %{nxt}")
    a("stored:")
    _end_entry(a, ("g", "%groups", "group"), ("p", 1, "%panels"))
    return "\n".join(L)


def _loop_end(a, var: str, step: int, bound: str, loop: str, done: str) -> None:
    """The back edge of the loop over ``%var``: step it, then on to ``loop`` while it is
    below ``bound``, else to ``done``."""
    a(f"  %{var}next = add i64 %{var}, {step}")
    a(f"  %{var}more = icmp slt i64 %{var}next, {bound}")
    a(f"  br i1 %{var}more, label %{loop}, label %{done}")


def _end_entry(a, inner: tuple[str, str, str], panels: tuple[str, int, str], *last: str) -> None:
    """An entry's close: the back edges of its inner loop (variable, bound, loop label)
    and of its panel loop (variable, step, bound), then ``last`` and the return."""
    var, bound, loop = inner
    _loop_end(a, var, 1, bound, loop, f"{var}done")
    a(f"{var}done:")
    _loop_end(a, panels[0], panels[1], panels[2], "panel", "exit")
    a("exit:")
    for line in last:
        a(line)
    a("  ret void")
    a("}")


def _f32x8_at(a, name: str, ptr: str, *terms: str | int) -> str:
    """A ``<8 x float>*`` to ``ptr[sum of terms]`` (a float*; the terms i64 values or
    constants); its IR name."""
    idx = terms[0]
    for k, term in enumerate(terms[1:]):
        a(f"  %{name}i{k} = add i64 {idx}, {term}")
        idx = f"%{name}i{k}"
    a(f"  %{name}p = getelementptr float, float* {ptr}, i64 {idx}")
    a(f"  %{name}v = bitcast float* %{name}p to <8 x float>*")
    return f"%{name}v"


def _bcast8(a, name: str, ptr: str, idx: str) -> str:
    """``ptr[idx]`` (a float*) in all 8 lanes; the vector's IR name."""
    a(f"  %{name}p = getelementptr float, float* {ptr}, i64 {idx}")
    a(f"  %{name} = load float, float* %{name}p, align 4")
    a(f"  %{name}i = insertelement <8 x float> undef, float %{name}, i32 0")
    a(f"  %{name}s = shufflevector <8 x float> %{name}i, <8 x float> undef, <8 x i32> zeroinitializer")
    return f"%{name}s"


def _skip_empty(a) -> None:
    """Both kernels' entry: straight to ``exit`` when there are no rows, inputs or blocks."""
    a("  %none = icmp sge i64 %r0, %r1")
    a("  %not = icmp sle i64 %tiles, 0")
    a("  %nob = icmp sle i64 %nb, 0")
    a("  %skip0 = or i1 %none, %not")
    a("  %skip = or i1 %skip0, %nob")
    a("  br i1 %skip, label %exit, label %panel")


def _bcast(a, name: str, ty: str, ptr: str, idx: str) -> str:
    """``ptr[idx]`` (``ptr`` a ``ty``*) in all 16 lanes; the vector's IR name."""
    a(f"  %{name}p = getelementptr {ty}, {ty}* {ptr}, i64 {idx}")
    a(f"  %{name} = load {ty}, {ty}* %{name}p, align 4")
    a(f"  %{name}i = insertelement <16 x {ty}> undef, {ty} %{name}, i32 0")
    a(f"  %{name}s = shufflevector <16 x {ty}> %{name}i, <16 x {ty}> undef, <16 x i32> zeroinitializer")
    return f"%{name}s"


def _scaled(a, kind: str, tag: str, s: str, xdv: str, xsv: str, idx: str, acc: str) -> str:
    """``acc`` + float(block sums ``s``) * (d_x * d_w[idx]), + m_w[idx] * s_x for "u8": a
    block's float work, one text for both units (their results agree bit for bit because
    it is the same operations in the same order); the new sums' IR name."""
    a(f"  %f{tag} = sitofp <16 x i32> {s} to <16 x float>")
    a(f"  %sc{tag} = fmul <16 x float> {xdv}, {_bcast(a, f'dw{tag}', 'float', '%wdt', idx)}")
    a(
        f"  %n{tag} = call <16 x float> @llvm.fma.v16f32(<16 x float> %f{tag}, <16 x float> %sc{tag}, <16 x float> {acc})"
    )
    if kind != "u8":
        return f"%n{tag}"
    mws = _bcast(a, f"mw{tag}", "float", "%wmt", idx)
    a(f"  %nm{tag} = call <16 x float> @llvm.fma.v16f32(<16 x float> {mws}, <16 x float> {xsv}, <16 x float> %n{tag})")
    return f"%nm{tag}"


def _store_rows(a, sums: list[str]) -> None:
    """Row r of the pass (``%prow`` + r) of tile ``%t``: its 16 inputs' sums ``sums[r]``
    into column ``%prow`` + r of ``%out`` (rows ``%ostride`` floats apart), one masked
    scatter per row: the result lands in the matmul's [inputs, columns] layout (a
    transposed copy in numpy cost 3.4 ms per 512 x 3072 output) and the padding inputs
    of the last tile (16 t + m >= ``%nin``) are never written."""
    iota = "<" + ", ".join(f"i64 {m}" for m in range(TILE)) + ">"
    a("  %ot = mul i64 %t, 16")
    a("  %oti = insertelement <16 x i64> undef, i64 %ot, i32 0")
    a("  %ots = shufflevector <16 x i64> %oti, <16 x i64> undef, <16 x i32> zeroinitializer")
    a(f"  %om = add <16 x i64> %ots, {iota}")
    a("  %nini = insertelement <16 x i64> undef, i64 %nin, i32 0")
    a("  %nins = shufflevector <16 x i64> %nini, <16 x i64> undef, <16 x i32> zeroinitializer")
    a("  %omask = icmp slt <16 x i64> %om, %nins")
    a("  %osi = insertelement <16 x i64> undef, i64 %ostride, i32 0")
    a("  %oss = shufflevector <16 x i64> %osi, <16 x i64> undef, <16 x i32> zeroinitializer")
    a("  %orows = mul <16 x i64> %om, %oss")
    for r, v in enumerate(sums):
        a(f"  %oc{r} = add i64 %prow, {r}")
        a(f"  %oci{r} = insertelement <16 x i64> undef, i64 %oc{r}, i32 0")
        a(f"  %ocs{r} = shufflevector <16 x i64> %oci{r}, <16 x i64> undef, <16 x i32> zeroinitializer")
        a(f"  %oidx{r} = add <16 x i64> %orows, %ocs{r}")
        a(f"  %optr{r} = getelementptr float, ptr %out, <16 x i64> %oidx{r}")
        a(
            f"  call void @llvm.masked.scatter.v16f32.v16p0(<16 x float> {v}, <16 x ptr> %optr{r}, i32 4, <16 x i1> %omask)"
        )


def splat(ty: str, v) -> str:
    """A 16-lane IR vector constant of ``v``."""
    return "<" + ", ".join([f"{ty} {v}"] * 16) + ">"


def _mul(v: str, c: int, tag: str, a) -> str:
    """``v`` * ``c`` as an IR value (``v`` a name or a literal)."""
    if not v.startswith("%"):
        return str(int(v) * c)
    a(f"  %mul{tag}{c} = mul i64 {v}, {c}")
    return f"%mul{tag}{c}"


def _sel(tag: str, base: str, k, ty: str, a) -> str:
    """Buffer ``base`` of pair ``k`` (0, 1 or an i64 parity value)."""
    if isinstance(k, int):
        return f"%{base}_{k}"
    a(f"  %c{tag}{base} = icmp eq i64 {k}, 0")
    a(f"  %s{tag}{base} = select i1 %c{tag}{base}, {ty} %{base}_0, {ty} %{base}_1")
    return f"%s{tag}{base}"


def panel(a: np.ndarray, dtype=np.float32) -> np.ndarray:
    """Per-block values of a slice [rows, nb], as the kernels read them: [rows / 16][nb][16]."""
    rows, nb = a.shape
    return np.ascontiguousarray(a.reshape(rows // TILE, TILE, nb).transpose(0, 2, 1), dtype)


@dataclass(frozen=True)
class Packed:
    """One matmul's activations in the B-tile layout (``pack_x16``)."""

    xb: np.ndarray  # int8 [tiles, nb, planes, 8, 64]: 2 planes int16, 1 plane int8
    xd: np.ndarray  # f32 [tiles, nb, 16]
    xs: np.ndarray  # f32 [tiles, nb, 16]
    n: int  # the real inputs (the last tile's others are padding)

    @property
    def tiles(self) -> int:
        return self.xb.shape[0]

    @property
    def bits(self) -> int:
        """The activations' integer width: 16 (two byte planes) or 8."""
        return 16 if self.xb.shape[2] == 2 else 8


_PROTO = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 7, *[ctypes.c_int64] * 5, ctypes.c_void_p, *[ctypes.c_int64] * 2)
_VNNI_PROTO = ctypes.CFUNCTYPE(None, *[ctypes.c_void_p] * 8, *[ctypes.c_int64] * 7)


def widths(unit: str) -> dict[str, tuple[int, ...]]:
    """Activation widths per dtype on ``unit`` (``prepare``'s ``bits``): int16 for q8,
    int16 or int8 for the unsigned dtypes; int16 only on "avx2"."""
    eight = () if unit == "avx2" else (8,)
    return {d: (16, *eight) if o.tile_unpacked else (16,) for d, o in OPS.items() if o.tiles}


class TileKernels:
    """The compiled prefill kernels (one set per kernel set; the machine code is
    ``llvm_jit``'s, shared by the process) for q8 on int16 activations and the unsigned
    4/5-bit dtypes (``UNSIGNED``) on int16 or int8 ones (``widths``), on one ``unit``:
    "amx" (the tile unit) or "vnni" (the same products on AVX-512 VNNI; the same results
    bit for bit). Calls release the GIL (ctypes), so the prefill pool's threads run
    slices side by side."""

    DTYPES = tuple(d for d, o in OPS.items() if o.tiles)

    def __init__(self, cache_dir: Path | None | str = "default", unit: str = "amx") -> None:
        if unit == "amx" and not host_amx():
            raise ValueError("this CPU or kernel offers no AMX-INT8 tiles")
        if unit == "vnni" and not host_vnni():
            raise ValueError("this CPU has no AVX-512 VNNI")
        if unit == "avx2" and not host_avx2():
            raise ValueError("this CPU has no AVX2 with FMA and F16C")
        if unit not in UNITS:
            raise ValueError(f"tile unit {unit!r}: one of {', '.join(UNITS)}")
        self.unit = unit
        self.widths = widths(unit)
        cache = llvm_jit.default_cache_dir() if cache_dir == "default" else cache_dir
        if unit == "amx":
            self._compiled = llvm_jit.compile_ir(module_ir(), list(ENTRIES.values()), cache)
            self._fns = {f: _PROTO(self._compiled.addrs[name]) for f, name in ENTRIES.items()}
        elif unit == "vnni":
            self._compiled = llvm_jit.compile_ir(vnni_module_ir(), list(VNNI_ENTRIES.values()), cache)
            self._fns = {f: _VNNI_PROTO(self._compiled.addrs[name]) for f, name in VNNI_ENTRIES.items()}
        else:
            self._compiled = llvm_jit.compile_ir(avx2_module_ir(), list(AVX2_ENTRIES.values()), cache)
            # addresses, not ctypes functions: ``_avx2_slice`` calls them from numba without the GIL
            self._fns = {(k, 16): self._compiled.addrs[name] for k, name in AVX2_ENTRIES.items()}
        self._cfg = tile_config()

    def prepare(self, X: np.ndarray, bits: int = 16) -> Packed | Rows16:
        """The activations of one matmul as this unit reads them: B tiles (``pack``) for
        "amx" and "vnni", int16 rows (``pack_rows``) for "avx2"."""
        if self.unit != "avx2":
            return self.pack(X, bits)  # which checks the width
        if bits != 16:
            raise ValueError(f"the avx2 products take int16 activations, not {bits} bits")
        return pack_rows(X)

    def scratch_bytes(self, dtype: str, rows: int, cols: int) -> int:
        """The bytes of ``rows``' ``scratch`` for a slice of ``rows`` x ``cols``: the unsigned
        dtypes' unpacked quants, and for "avx2" the int16 interleave after them."""
        unpacked = rows * cols if ops_for(dtype).tile_unpacked else 0
        return unpacked + (2 * rows * cols + 8 * rows * (cols // QB) if self.unit == "avx2" else 0)

    @staticmethod
    def pack(X: np.ndarray, bits: int = 16) -> Packed:
        """The activations of one matmul in the B-tile layout (``pack_x16``), rounded to
        ``bits`` (16 or 8) per block of 32."""
        if bits not in QMAX:
            raise ValueError(f"tile activations are int16 or int8, not {bits} bits")
        n, cols = X.shape
        tiles = (n + TILE - 1) // TILE
        xb = np.empty((tiles, cols // QB, 2 if bits == 16 else 1, QB // 4, 4 * TILE), np.int8)
        xd = np.empty((tiles, cols // QB, TILE), np.float32)
        xs = np.empty((tiles, cols // QB, TILE), np.float32)
        pack_x16(np.ascontiguousarray(X, np.float32), xb, xd, xs, QMAX[bits])
        return Packed(xb, xd, xs, n)

    def rows(
        self,
        dtype: str,
        parts: dict[str, np.ndarray],
        cols: int,
        r0: int,
        r1: int,
        x: Packed | Rows16,
        out: np.ndarray,
        scratch: np.ndarray | None = None,
        col: int = 0,
    ) -> None:
        """out[:, col : col + r1 - r0] = the prepared inputs (``prepare``) times weight rows
        r0..r1 (``dtype``'s stored ``parts``, a [rows, cols] weight, C-contiguous); ``out``
        f32 [inputs, width], C-contiguous (a matmul's output: the kernels write it in place);
        (r1 - r0) % 16 == 0. ``scratch``: uint8 of at least ``scratch_bytes`` for the
        unsigned dtypes' unpacked quants and the AVX2 unit's widened ones (allocated when None)."""
        from formats.quants import get_dtype

        if dtype not in self.DTYPES:
            raise ValueError(f"no AMX prefill for {dtype}")
        if x.bits not in self.widths[dtype]:
            raise ValueError(f"no tile kernel for {dtype} on int{x.bits} activations")
        if isinstance(x, Rows16) != (self.unit == "avx2"):
            raise ValueError(f"the {self.unit} unit's inputs come from its own prepare()")
        dt = get_dtype(dtype)
        rows = parts[dt.kernel_parts[0]].shape[0]
        nb = cols // QB
        for part in dt.parts((rows, cols)):
            arr = parts.get(part.name)
            if (
                arr is None
                or arr.shape != part.shape
                or arr.dtype.itemsize != part.dtype.itemsize
                or not arr.flags.c_contiguous
            ):
                raise ValueError(f"amx: {dtype} part {part.name} is not {part.dtype}{list(part.shape)}")
        x_cols = x.xq.shape[1] if isinstance(x, Rows16) else x.xb.shape[1] * QB
        if (r1 - r0) % TILE or not 0 <= r0 <= r1 <= rows or x_cols != cols or cols % QB:
            raise ValueError(f"amx rows {r0}..{r1} of a [{rows}, {cols}] weight, {x_cols}-column inputs")
        if (
            out.ndim != 2
            or out.shape[0] != x.n
            or not 0 <= col <= out.shape[1] - (r1 - r0)
            or out.dtype != np.float32
            or not out.flags.c_contiguous
        ):
            raise ValueError(f"amx output {out.shape} for columns {col}..{col + r1 - r0} of {x.n} inputs")
        need = self.scratch_bytes(dtype, r1 - r0, cols)
        if scratch is None:
            scratch = np.empty(need, np.uint8)
        if scratch.dtype != np.uint8 or scratch.size < need or not scratch.flags.c_contiguous:
            raise ValueError(f"amx scratch needs {need} bytes")
        if self.unit == "avx2":  # one ``_avx2_slice`` call
            k = ops_for(dtype)
            weights = self._avx2_weights(dtype, parts, cols, r0, r1, scratch)
            _avx2_slice(self._fns[(k.tile_form, x.bits)], k.tile_unpacked, *weights, x.xq, x.xd, x.xs, out, col, x.n)
            return
        dw, mw = block_scales(dtype, parts, r0, r1)
        wdt = panel(dw)
        k = ops_for(dtype)
        if not k.tile_unpacked:
            a, a0, a1, wmt, used = parts["qs"], r0, r1, None, 0
        else:
            used = (r1 - r0) * cols
            a = scratch.reshape(-1)[:used].reshape(r1 - r0, cols)
            unpack_quants(dtype, parts, r0, r1, a)
            a0, a1, wmt = 0, r1 - r0, panel(mw)
        fn = self._fns[(k.tile_form, x.bits)]
        wm = None if wmt is None else wmt.ctypes.data
        dst = out.ctypes.data + 4 * col
        head = (a.ctypes.data, wdt.ctypes.data, wm)
        inputs = (x.xb.ctypes.data, x.xd.ctypes.data, x.xs.ctypes.data, dst, a0, a1, nb, x.tiles, cols)
        if self.unit == "amx":  # the tile configuration before the output's stride
            fn(*head, *inputs, self._cfg.ctypes.data, out.shape[1], x.n)
        else:  # the VNNI entry also takes the weight blocks' sums
            wsc = panel(block_sums(a[a0:a1], x.bits), np.int32)
            fn(*head, wsc.ctypes.data, *inputs, out.shape[1], x.n)

    @staticmethod
    def _avx2_weights(
        dtype: str, parts: dict[str, np.ndarray], cols: int, r0: int, r1: int, scratch: np.ndarray
    ) -> tuple:
        """``_avx2_slice``'s weight arguments (``src`` to ``wmt``) for rows r0..r1 (checked by
        ``rows``), laid out in ``scratch``, after the unsigned dtypes' unpacking and, for
        q4k/q5k, their scales (``block_scales``)."""
        rows, nb = r1 - r0, cols // QB
        buf = scratch.reshape(-1)
        k = ops_for(dtype)
        unpacked = rows * cols if k.tile_unpacked else 0
        w16 = buf[unpacked : unpacked + 2 * rows * cols].view(np.int16).reshape(rows // TILE, nb, QB // 2, TILE, 2)
        at = unpacked + 2 * rows * cols
        wdt = buf[at : at + 4 * rows * nb].view(np.float32).reshape(rows // TILE, nb, TILE)
        wmt = buf[at + 4 * rows * nb : at + 8 * rows * nb].view(np.float32).reshape(rows // TILE, nb, TILE)
        d16 = parts["d"].view(np.uint16)
        m16, zero, src, fill = d16, 0, parts["qs"][r0:r1], True
        if k.tile_unpacked:
            src = buf[:unpacked].reshape(rows, cols)
            unpack_quants(dtype, parts, r0, r1, src)
            if k.k4_scales:  # per-32 scales from the 6-bit packed ones, here in numpy
                dw, mw = block_scales(dtype, parts, r0, r1)
                wdt[...], wmt[...], fill = panel(dw), panel(mw), False
            elif "m" in parts:
                m16 = parts["m"].view(np.uint16)
            else:
                zero = k.zero
        return src, fill, d16, m16, zero, r0, w16, wdt, wmt
