"""Inputs from an attacker who recomputes every checksum: each must end in a one-line
``error:`` and exit 2 (or a clean success) quickly, never a traceback, a signal, a
hang or unbounded memory.

Times are only compared with a tiny input's time measured in the same test.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine.convert import convert_checkpoint
from formats.errors import CortiqError
from tests.tiny import save_tiny

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("resealed")
    src = save_tiny("llama", root / "src")
    out = root / "m.cmf"
    convert_checkpoint(src, out, quant="q8")
    return src, out


def _one_line_error(res, *needles: str, code: int = 2) -> str:
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    err = res.stderr.strip() if res.stderr else res.output.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in res.output, err
    assert res.exit_code == code, (res.exit_code, err)
    for n in needles:
        assert n in err, err
    return err


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ------------------------------------------------------------------ 1. JSON headers in linear time

def _adversarial_headers(size: int) -> dict[str, bytes]:
    n = size // 2
    keys = b"{" + b",".join(b'"k%d":%d' % (i, i) for i in range(size // 16)) + b"}"
    return {
        # an unterminated string of escaped quotes: a backtracking string pattern is quadratic on it
        "escaped-quotes": b'{"a": "' + b'\\"' * n,
        "escaped-quotes-closed": b'{"a": "' + b'\\"' * (n - 8) + b'"}',
        "quotes": b'{"a": [' + b'"",' * (size // 3 - 4) + b'""]}',
        "backslashes": b'{"a": "' + b"\\\\" * (n - 8) + b'"}',
        "deep": b"[" * n + b"]" * n,
        "deep-dict": b'{"a":' * (size // 6) + b"1" + b"}" * (size // 6),
        "many-keys": keys,
        "long-string": b'{"notes": "' + b"x" * size + b'"}',
        "brackets-in-strings": b'{"a": "' + b"[{" * n + b'"}',
    }


def test_adversarial_json_scans_in_linear_time():
    """1 MB headers built to be slow (escaped quotes, deep nesting, many keys, long strings)
    parse or are refused within a generous multiple of the time of a 1 KB one."""
    from formats.untrusted_json import loads

    def run(raw: bytes) -> None:
        try:
            loads(raw, "header")
        except CortiqError as e:
            assert "\n" not in str(e)

    small = _adversarial_headers(1 << 10)
    big = _adversarial_headers(1 << 20)
    for kind in big:
        base = min(_timed(lambda: run(small[kind])) for _ in range(5))
        t = _timed(lambda: run(big[kind]))
        # Linear: about 1,000x the 1 KB time (plus a fixed cost); quadratic would be 10^6x.
        assert t < 20_000 * base + 0.05, (kind, t, base)


def _cmf_with_header(src: Path, dst: Path, hjson: bytes) -> Path:
    from tests.fuzz_cmf import _rebuild

    dst.write_bytes(_rebuild(src.read_bytes(), hjson))
    return dst


def test_adversarial_cmf_header_is_refused_quickly(tiny, tmp_path):
    """Resealed CMF files whose header is 1 MB of the same shapes: inspect answers (a table
    or one line) in a bounded multiple of its time on the intact file."""
    _, cmf = tiny
    base = min(_timed(lambda: runner.invoke(app, ["inspect", str(cmf)])) for _ in range(3))
    for kind, hjson in _adversarial_headers(1 << 20).items():
        bad = _cmf_with_header(cmf, tmp_path / f"{kind}.cmf", hjson)
        t0 = time.perf_counter()
        res = runner.invoke(app, ["inspect", str(bad)])
        t = time.perf_counter() - t0
        if res.exit_code != 0:  # valid JSON that is no model header may still be inspected
            _one_line_error(res)
        assert t < 50 * base + 1.0, (kind, t, base)


def test_adversarial_safetensors_header_is_refused_quickly(tmp_path):
    from formats.imatrix import read_imatrix, write_imatrix

    good = tmp_path / "good.safetensors"
    write_imatrix(good, {"w": np.ones(4, np.float32)}, 3)
    base = min(_timed(lambda: read_imatrix(good)) for _ in range(5))
    for kind, hjson in _adversarial_headers(1 << 20).items():
        p = tmp_path / f"{kind}.safetensors"
        p.write_bytes(struct.pack("<Q", len(hjson)) + hjson)
        t0 = time.perf_counter()
        with pytest.raises(CortiqError) as e:
            read_imatrix(p)
        assert "\n" not in str(e.value)
        assert time.perf_counter() - t0 < 20_000 * base + 0.5, kind
