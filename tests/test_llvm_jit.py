"""The kernels' object cache (``cortiq_engine/kernels/llvm_jit.py``): a second compile
loads the stored object code, a damaged entry is rebuilt rather than loaded, and a
cached kernel computes exactly what a freshly compiled one does."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from cortiq_engine.kernels import llvm_jit, qdot

IR = """
define i64 @mix(i64 %a, i64 %b) nounwind {
entry:
  %m = mul i64 %a, 3
  %s = add i64 %m, %b
  ret i64 %s
}
"""


def _call(compiled: llvm_jit.Compiled, a: int, b: int) -> int:
    return ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64, ctypes.c_int64)(compiled.addrs["mix"])(a, b)


def test_second_compile_loads_the_cache(tmp_path):
    first = llvm_jit.compile_ir(IR, ["mix"], tmp_path, reuse=False)
    entries = list(tmp_path.glob("*.o"))
    assert not first.from_cache and len(entries) == 1
    assert entries[0].read_bytes().startswith(llvm_jit.MAGIC)
    again = llvm_jit.compile_ir(IR, ["mix"], tmp_path, reuse=False)
    assert again.from_cache and _call(again, 5, 7) == 22 == _call(first, 5, 7)
    # another IR text is another entry, never the first one's code
    other = llvm_jit.compile_ir(IR.replace("mul i64 %a, 3", "mul i64 %a, 4"), ["mix"], tmp_path, reuse=False)
    assert not other.from_cache and _call(other, 5, 7) == 27 and len(list(tmp_path.glob("*.o"))) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "empty"])
def test_a_damaged_entry_is_rebuilt(tmp_path, damage):
    llvm_jit.compile_ir(IR, ["mix"], tmp_path, reuse=False)
    (entry,) = tmp_path.glob("*.o")
    data = bytearray(entry.read_bytes())
    if damage == "flip":
        data[-9] ^= 0x40  # inside the object code: the stored digest no longer matches
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "magic":
        data[:4] = b"XXXX"
    else:
        data = bytearray()
    entry.write_bytes(bytes(data))
    rebuilt = llvm_jit.compile_ir(IR, ["mix"], tmp_path, reuse=False)
    assert not rebuilt.from_cache and _call(rebuilt, 2, 1) == 7
    assert llvm_jit.compile_ir(IR, ["mix"], tmp_path, reuse=False).from_cache  # and stored intact again


def test_no_cache_and_an_unwritable_cache(tmp_path):
    assert not llvm_jit.compile_ir(IR, ["mix"], None, reuse=False).from_cache
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    c = llvm_jit.compile_ir(IR, ["mix"], blocker / "kernels", reuse=False)  # cannot be created: compiles anyway
    assert _call(c, 1, 1) == 4 and not c.from_cache
    assert not list(tmp_path.glob("**/*.tmp")) and not list(tmp_path.glob("**/.*.tmp"))


def test_default_cache_dir_follows_the_documented_override(tmp_path):
    assert llvm_jit.default_cache_dir({llvm_jit.CACHE_ENV: str(tmp_path / "k")}) == tmp_path / "k"
    assert llvm_jit.default_cache_dir({llvm_jit.CACHE_ENV: ""}) is None
    assert llvm_jit.default_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "cortiq" / "kernels"


@pytest.mark.skipif(not qdot.host_supports(), reason="the integer kernels need x86-64 AVX2/FMA")
def test_cached_kernels_give_the_same_bits(tmp_path):
    """q8's integer entry and the attention loops loaded from the disk cache compute
    exactly what fresh compiles do."""
    from tests.test_engine_kernels import _weight
    from cortiq_engine.kernels import attn_ir, fast

    ks = fast.NumbaKernels()
    w, _ = _weight("q8", 40, 96)
    x = np.random.default_rng(3).standard_normal((3, 96)).astype(np.float32)
    (plan,), width = ks._plans_for([w])
    ir_text = qdot.module_ir("q8", plan.bits, ks._intdot.vnni, False)
    name = "q8a16_rows"
    outs = []
    for cache in (None, tmp_path, tmp_path):  # fresh, fresh and stored, loaded
        c = llvm_jit.compile_ir(ir_text, [name], cache, reuse=False)
        out = np.empty((3, width), np.float32)
        qdot.intdot(
            c.addrs[name],
            plan.addrs,
            plan.rows,
            plan.count,
            plan.offs,
            x,
            fast._ACT_PROTO[plan.bits],
            plan.qmax,
            False,
            out,
        )
        outs.append((c.from_cache, out))
    assert [f for f, _ in outs] == [False, False, True]
    assert all(np.array_equal(outs[0][1], o) for _, o in outs)

    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, 8, 64)).astype(np.float32)
    kc = rng.standard_normal((2, 600, 64)).astype(np.float32)
    results = []
    for cache in (None, tmp_path, tmp_path):
        c = llvm_jit.compile_ir(attn_ir.module_ir(), attn_ir.AttentionLoops.NAMES, cache, reuse=False)
        fns = np.array([c.addrs[n] for n in attn_ir.AttentionLoops.NAMES], np.int64)
        out = np.empty((3, 8, 64), np.float32)
        from cortiq_engine.kernels import jit

        jit.attend(q, kc, kc, 590, 0, np.float32(0.125), None, out, fns)
        results.append((c.from_cache, out))
    assert [f for f, _ in results] == [False, False, True]
    assert all(np.array_equal(results[0][1], o) for _, o in results)


def test_compiled_code_outlives_its_first_holder():
    """A kernel set's addresses stay valid after the object that compiled them is gone
    (the process keeps compiled modules): a temporary's addresses must not dangle."""
    import gc

    from cortiq_engine.kernels import attn_ir

    addrs = attn_ir.AttentionLoops().addrs
    gc.collect()
    assert (addrs == attn_ir.AttentionLoops().addrs).all()  # the same code, reused
