#!/usr/bin/env python3
"""The raw integer multiply-add throughput of one core's vector unit, the ceiling prefill works under.

    python benchmarks/unit_peak.py [--unit vnni|avx2] [--seconds 0.3]

One compiled loop (LLVM IR for this CPU) of twelve independent accumulator chains of the
instruction the prefill tiles run on, operands in registers, no memory traffic: on AVX-512
VNNI ``vpdpbusd`` (int8: 64 multiply-adds a zmm instruction) and ``vpdpwssd`` (int16: 32),
on AVX2 ``vpmaddwd`` + ``vpaddd`` (int16: 16 a ymm instruction pair). An op is a multiply
or an add, so a multiply-add is two, as GFLOP/s counts them. ``bench_amx_prefill.py``
prints each prefill matrix's achieved ops/s beside this peak. AMX tiles (``tdpbssd``) are
not measured here: this benchmark runs only the units it can check on its host.
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from cortiq_engine.kernels import llvm_jit
from cortiq_engine.kernels.amx import host_unit

CHAINS = 12
# unit, activation bits -> (vector type, the accumulate step's IR template, multiply-adds per step)
_STEPS = {
    ("vnni", 8): (
        "<16 x i32>",
        "call <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> {a}, <16 x i32> %x, <16 x i32> %y)",
        64,
    ),
    ("vnni", 16): (
        "<16 x i32>",
        "call <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32> {a}, <16 x i32> %x, <16 x i32> %y)",
        32,
    ),
}
_DECLS = """
declare <16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32>, <16 x i32>, <16 x i32>)
declare <16 x i32> @llvm.x86.avx512.vpdpwssd.512(<16 x i32>, <16 x i32>, <16 x i32>)
declare <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16>, <16 x i16>)
"""


def _module(unit: str, bits: int) -> tuple[str, int]:
    """The loop's IR and its multiply-adds per iteration."""
    lines = [_DECLS, "define void @peak(i64 %iters, i8* %xp, i8* %out) {", "entry:"]
    if unit == "avx2":
        ty, macs = "<8 x i32>", 16
        lines += [
            "  %xv = bitcast i8* %xp to <16 x i16>*",
            "  %x = load <16 x i16>, <16 x i16>* %xv, align 1",
            "  %y = add <16 x i16> %x, %x",
        ]
    else:
        ty, step, macs = _STEPS[(unit, bits)]
        lines += [
            f"  %xv = bitcast i8* %xp to {ty}*",
            f"  %x = load {ty}, {ty}* %xv, align 1",
            f"  %y = add {ty} %x, %x",
        ]
    lines += ["  br label %loop", "loop:", "  %i = phi i64 [0, %entry], [%i1, %loop]"]
    for c in range(CHAINS):
        lines.append(f"  %a{c} = phi {ty} [zeroinitializer, %entry], [%b{c}, %loop]")
    for c in range(CHAINS):
        if unit == "avx2":
            lines.append(f"  %p{c} = call <8 x i32> @llvm.x86.avx2.pmadd.wd(<16 x i16> %x, <16 x i16> %y)")
            lines.append(f"  %b{c} = add <8 x i32> %a{c}, %p{c}")
        else:
            lines.append(f"  %b{c} = " + step.format(a=f"%a{c}"))
    lines += [
        "  %i1 = add i64 %i, 1",
        "  %more = icmp ult i64 %i1, %iters",
        "  br i1 %more, label %loop, label %exit",
        "exit:",
    ]
    acc = "%b0"
    for c in range(1, CHAINS):
        lines.append(f"  %s{c} = add {ty} {acc}, %b{c}")
        acc = f"%s{c}"
    lines += [f"  %o = bitcast i8* %out to {ty}*", f"  store {ty} {acc}, {ty}* %o, align 1", "  ret void", "}"]
    return "\n".join(lines), CHAINS * macs


def peak_ops(unit: str, bits: int, seconds: float = 0.3) -> float:
    """Integer ops/s (2 per multiply-add) of one core running ``unit``'s ``bits``-bit step."""
    ir_text, macs = _module(unit, bits)
    compiled = llvm_jit.compile_ir(ir_text, ["peak"])
    fn = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p)(compiled.addrs["peak"])
    x = np.full(16, 0x01010101, np.int32)
    out = np.zeros(16, np.int32)
    iters = 1 << 16
    while True:
        t = time.perf_counter()
        fn(iters, x.ctypes.data, out.ctypes.data)
        dt = time.perf_counter() - t
        if dt >= seconds:
            return 2.0 * macs * iters / dt
        iters *= 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unit", choices=("vnni", "avx2"), help="default: the host's (VNNI where it has AVX-512 VNNI)")
    ap.add_argument("--seconds", type=float, default=0.3)
    a = ap.parse_args()
    host = host_unit()
    unit = a.unit or ("avx2" if host == "avx2" else "vnni" if host in ("vnni", "amx") else None)
    if unit is None:
        print("this CPU has neither AVX-512 VNNI nor AVX2: nothing to measure")
        return 0
    for bits in (8, 16) if unit == "vnni" else (16,):
        print(f"{unit} int{bits}: {peak_ops(unit, bits, a.seconds) / 1e9:.0f} G ops/s on one core")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
