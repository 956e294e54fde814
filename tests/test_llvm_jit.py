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
    first = llvm_jit.compile_ir(IR, ["mix"], tmp_path)
    entries = list(tmp_path.glob("*.o"))
    assert not first.from_cache and len(entries) == 1
    assert entries[0].read_bytes().startswith(llvm_jit.MAGIC)
    again = llvm_jit.compile_ir(IR, ["mix"], tmp_path)
    assert again.from_cache and _call(again, 5, 7) == 22 == _call(first, 5, 7)
    # another IR text is another entry, never the first one's code
    other = llvm_jit.compile_ir(IR.replace("mul i64 %a, 3", "mul i64 %a, 4"), ["mix"], tmp_path)
    assert not other.from_cache and _call(other, 5, 7) == 27 and len(list(tmp_path.glob("*.o"))) == 2


@pytest.mark.parametrize("damage", ["flip", "truncate", "magic", "empty"])
def test_a_damaged_entry_is_rebuilt(tmp_path, damage):
    llvm_jit.compile_ir(IR, ["mix"], tmp_path)
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
    rebuilt = llvm_jit.compile_ir(IR, ["mix"], tmp_path)
    assert not rebuilt.from_cache and _call(rebuilt, 2, 1) == 7
    assert llvm_jit.compile_ir(IR, ["mix"], tmp_path).from_cache  # and stored intact again


def test_no_cache_and_an_unwritable_cache(tmp_path):
    assert not llvm_jit.compile_ir(IR, ["mix"], None).from_cache
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    c = llvm_jit.compile_ir(IR, ["mix"], blocker / "kernels")  # cannot be created: compiles anyway
    assert _call(c, 1, 1) == 4 and not c.from_cache
    assert not list(tmp_path.glob("**/*.tmp")) and not list(tmp_path.glob("**/.*.tmp"))


def test_default_cache_dir_follows_the_documented_override(tmp_path):
    assert llvm_jit.default_cache_dir({llvm_jit.CACHE_ENV: str(tmp_path / "k")}) == tmp_path / "k"
    assert llvm_jit.default_cache_dir({llvm_jit.CACHE_ENV: ""}) is None
    assert llvm_jit.default_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "cortiq" / "kernels"


@pytest.mark.skipif(not qdot.host_supports(), reason="the integer kernels need x86-64 AVX2/FMA")
def test_cached_kernels_give_the_same_bits(tmp_path):
    """An integer kernel and the attention loops from the cache against fresh compiles."""
    from tests.test_engine_kernels import _weight
    from cortiq_engine.kernels.fast import NumbaKernels

    w, _ = _weight("q8", 40, 96)
    x = np.random.default_rng(3).standard_normal((3, 96)).astype(np.float32)
    q = np.random.default_rng(4).standard_normal((3, 8, 64)).astype(np.float32)
    kc = np.random.default_rng(5).standard_normal((2, 300, 64)).astype(np.float32)
    outs = []
    for _ in range(2):  # the first compiles and stores, the second loads
        ks = NumbaKernels(kernel_cache=tmp_path)
        outs.append((ks.matmul([w], x), ks.attend(q, kc, kc, 290, 0, 0.125)))
    assert len(list(tmp_path.glob("*.o"))) == 2  # q8's entry and the attention loops
    fresh = NumbaKernels(kernel_cache=None)
    want = (fresh.matmul([w], x), fresh.attend(q, kc, kc, 290, 0, 0.125))
    for got in outs:
        assert all(np.array_equal(g, e) for g, e in zip(got, want))
