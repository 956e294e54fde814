"""formats.gguf_reader against gguf-py's GGUFReader (the reference parser) on the real
SmolLM2 GGUF and on small files written by gguf-py's GGUFWriter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from formats.errors import CortiqError
from formats.gguf_reader import GgufFile


def _same(a: GgufFile, path: Path) -> int:
    import gguf

    b = gguf.GGUFReader(path)
    keys = [k for k in b.fields if not k.startswith("GGUF.")]
    assert list(a.fields) == keys
    for k in keys:
        assert a.fields[k].contents() == b.fields[k].contents(), k
    assert len(a.tensors) == len(b.tensors)
    for x, y in zip(a.tensors, b.tensors):
        assert (x.name, x.tensor_type, x.shape.tolist(), x.n_elements, x.n_bytes, x.data_offset) == (
            y.name,
            y.tensor_type,
            y.shape.tolist(),
            int(y.n_elements),
            int(y.n_bytes),
            int(y.data_offset),
        )
        assert x.data.dtype == y.data.dtype and x.data.shape == y.data.shape and np.array_equal(x.data, y.data)
    return len(keys)


def test_matches_gguf_py_on_smollm2(smollm2_gguf):
    assert _same(GgufFile(smollm2_gguf), smollm2_gguf) > 20


def test_matches_gguf_py_on_every_value_type(tmp_path: Path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_uint8("t.u8", 7)
    w.add_int16("t.i16", -3)
    w.add_uint64("t.u64", 2**40)
    w.add_float64("t.f64", 0.1)
    w.add_float32("t.f32", 1e-6)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "naïve ☃")
    w.add_array("t.strs", ["a", "", "ü"])
    w.add_array("t.ints", [1, -2, 3])
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor(
        "b",
        gguf.quants.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    w.add_tensor("c", np.ones(5, np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GgufFile(tmp_path / "t.gguf")
    assert _same(f, tmp_path / "t.gguf") >= 9
    assert f.fields["t.strs"].contents() == ["a", "", "ü"] and f.fields["t.bool"].contents() is True


def test_truncated_file_is_an_error(tmp_path: Path, smollm2_gguf):
    data = smollm2_gguf.read_bytes()[:5_000_000]
    (tmp_path / "cut.gguf").write_bytes(data)
    with pytest.raises((CortiqError, ValueError)):
        GgufFile(tmp_path / "cut.gguf")
