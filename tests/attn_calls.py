"""Calls of ``attn_ir``'s compiled entries on numpy arrays, for the tests that hold them
against float64 math (``test_attn_ir.py``) and against each other (``test_kv_f16.py``)."""

from __future__ import annotations

from numba import njit

from cortiq_engine.kernels import attn_ir


@njit
def scores(addr, g, q, k, m, scale, s):
    attn_ir.call_scores(addr, g, q.ctypes.data, k.ctypes.data, m, q.shape[1], scale, s.ctypes.data, s.shape[1])


@njit
def values(addr, g, p, v, m, o):
    attn_ir.call_values(addr, g, p.ctypes.data, v.ctypes.data, m, v.shape[1], o.ctypes.data, p.shape[1], o.shape[1])


@njit
def softmax(addr, s, m, res):
    attn_ir.call_softmax(addr, s.ctypes.data, m, res.ctypes.data)


@njit
def gemm(addr, a, b, c, rows, cols, depth, acc):
    attn_ir.call_gemm(
        addr, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1], c.ctypes.data, c.shape[1], rows, cols, depth, acc
    )
