"""The CMF container: layout, zero-copy reads, checksums, header rewrites, bad files."""

from __future__ import annotations

import json
import os
import struct
import zlib

import numpy as np
import pytest

from formats.cmf import FORMAT_VERSION, HEADER_SLACK, MAGIC, PREAMBLE, CmfFile, CmfWriter, rewrite_header
from formats.errors import CortiqError
from formats.quants import get_dtype
from tests.cmf_edit import edit_file, reseal, rewrite_directory

SHAPES = {"f32": (5, 64), "f16": (7, 32), "bf16": (3, 96), "q8": (9, 64), "q4": (6, 128)}


def _write(path, header=None, **kw):
    rng = np.random.default_rng(0)
    arrays = {f"t.{name}": rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    arrays["norm"] = rng.standard_normal(64).astype(np.float32)
    with CmfWriter(path, header or {"hello": "world"}, **kw) as w:
        for name, x in arrays.items():
            w.add(name, name[2:] if name.startswith("t.") else "f32", x)
        w.add_bytes("blob", b"tokenizer bytes \xf0\x9f\x98\x80")
    return arrays


def _leftovers(folder, keep=()):
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_round_trip_zero_copy_and_aligned(tmp_path):
    path = tmp_path / "m.cmf"
    arrays = _write(path)
    with CmfFile(path) as f:
        assert f.header == {"hello": "world"}
        assert f.version == FORMAT_VERSION
        assert f.data_offset % 64 == 0 and f.data_offset >= PREAMBLE + HEADER_SLACK
        for name, x in arrays.items():
            dtype = f.tensors[name].dtype
            dt = get_dtype(dtype)
            parts = f.tensor_parts(name)
            expected = dt.named(dt.encode(x), x.shape)
            for k, v in parts.items():
                assert v.ctypes.data % 64 == 0, (name, k)  # every part aligned in the map
                assert not v.flags.owndata and not v.flags.writeable  # a view into the read-only map
                assert np.array_equal(v.view(np.uint8), expected[k].view(np.uint8)), (name, k)
            assert np.array_equal(f.tensor_f32(name), dt.decode(expected, x.shape))
        assert f.raw_bytes("blob").decode() == "tokenizer bytes 😀"
        assert all(ok for _, ok in f.verify())
        # the directory checksum is the CRC-32 of the blob bytes
        info = f.tensors["t.q8"]
        assert info.crc32 == zlib.crc32(path.read_bytes()[info.offset : info.offset + info.nbytes])
    assert _leftovers(tmp_path) == ["m.cmf"]


def test_preamble_layout_is_as_documented(tmp_path):
    path = tmp_path / "m.cmf"
    _write(path)
    raw = path.read_bytes()
    magic, major, minor, flags, hoff, hlen, doff, diroff, dirlen, crc = struct.unpack("<8sHHIQQQQQQ", raw[:64])
    assert (magic, major, minor, flags, hoff) == (MAGIC, 2, 0, 0, 64)
    # format 2: the last preamble field is the CRC-32 of preamble[:56] + header JSON + directory JSON
    assert crc == zlib.crc32(raw[:56] + raw[hoff : hoff + hlen] + raw[diroff : diroff + dirlen])
    assert json.loads(raw[hoff : hoff + hlen]) == {"hello": "world"}
    assert raw[hoff + hlen : doff].strip(b" ") == b""
    entries = json.loads(raw[diroff : diroff + dirlen])
    assert diroff + dirlen == len(raw)
    assert [e["name"] for e in entries][:2] == ["t.f32", "t.f16"]
    assert all(e["offset"] % 64 == 0 for e in entries)


def test_file_permissions_follow_umask(tmp_path):
    old = os.umask(0o022)
    try:
        _write(tmp_path / "m.cmf")
    finally:
        os.umask(old)
    assert (tmp_path / "m.cmf").stat().st_mode & 0o777 == 0o644


def test_verify_names_a_corrupted_tensor(tmp_path):
    path = tmp_path / "m.cmf"
    _write(path)
    with CmfFile(path) as f:
        off = f.tensors["t.q4"].offset + 70
    data = bytearray(path.read_bytes())
    data[off] ^= 0xFF
    path.write_bytes(bytes(data))
    with CmfFile(path) as f:
        bad = [i.name for i, ok in f.verify() if not ok]
    assert bad == ["t.q4"]


def test_rewrite_header_in_place_keeps_blobs(tmp_path):
    path = tmp_path / "m.cmf"
    _write(path, {"calibration": {"temperature": None}})
    before = path.stat().st_size
    with CmfFile(path) as f:
        dirs = {n: (t.offset, t.crc32) for n, t in f.tensors.items()}
    rewrite_header(path, {"calibration": {"temperature": 1.234, "method": "nll"}})
    assert path.stat().st_size == before
    with CmfFile(path) as f:
        assert f.header["calibration"]["temperature"] == 1.234
        assert {n: (t.offset, t.crc32) for n, t in f.tensors.items()} == dirs
        assert all(ok for _, ok in f.verify())
    with CmfFile(path) as f:
        assert f.header["calibration"]["method"] == "nll"


def test_rewrite_header_that_outgrows_its_slack(tmp_path):
    path = tmp_path / "m.cmf"
    arrays = _write(path)
    big = {"notes": "x" * (3 * HEADER_SLACK)}
    rewrite_header(path, big)
    with CmfFile(path) as f:
        assert f.header == big
        assert all(t.offset % 64 == 0 for t in f.tensors.values())
        assert all(ok for _, ok in f.verify())
        assert np.array_equal(f.tensor_f32("t.f32"), arrays["t.f32"])
    assert _leftovers(tmp_path) == ["m.cmf"]


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with CmfWriter(tmp_path / "m.cmf", {}) as w:
            w.add("a", "f32", np.zeros((2, 32), np.float32))
            raise RuntimeError("boom")
    with pytest.raises(KeyboardInterrupt):
        with CmfWriter(tmp_path / "m.cmf", {}) as w:
            w.add("a", "q8", np.zeros((2, 32), np.float32))
            raise KeyboardInterrupt
    with pytest.raises(CortiqError, match="duplicate tensor"):
        with CmfWriter(tmp_path / "m.cmf", {}) as w:
            w.add("a", "f32", np.zeros(3, np.float32))
            w.add("a", "f32", np.zeros(3, np.float32))
    assert _leftovers(tmp_path) == []


def test_writer_refuses_existing_output_without_force(tmp_path):
    path = tmp_path / "m.cmf"
    path.write_bytes(b"precious")
    with pytest.raises(CortiqError, match="exists"):
        CmfWriter(path, {})
    assert path.read_bytes() == b"precious"
    with CmfWriter(path, {"v": 2}, force=True):
        pass
    with CmfFile(path) as f:
        assert f.header == {"v": 2}
    with pytest.raises(CortiqError, match="is a folder"):
        CmfWriter(tmp_path, {})


# ------------------------------------------------------------------ bad files


def _mutate(path, fn):
    data = bytearray(path.read_bytes())
    fn(data)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.__setitem__(slice(0, 8), b"GGUF\0\0\0\0"), "not a CMF file"),
        (lambda d: d.__setitem__(slice(8, 10), struct.pack("<H", FORMAT_VERSION + 1)), "newer than this cortiq reads"),
        (lambda d: d.__setitem__(slice(8, 10), struct.pack("<H", 0)), "bad CMF format version"),
        (lambda d: d.__setitem__(slice(32, 40), struct.pack("<Q", 100)), "corrupt CMF preamble"),
        (lambda d: d.__delitem__(slice(len(d) - 50, len(d))), "truncated CMF file"),
        (lambda d: d.__delitem__(slice(30, len(d))), "not a CMF file"),
    ],
    ids=["foreign", "future-major", "version-0", "misaligned", "truncated", "tiny"],
)
def test_bad_files_are_one_line_errors(tmp_path, mutate, message):
    path = tmp_path / "m.cmf"
    _write(path)
    _mutate(path, mutate)
    with pytest.raises(CortiqError, match=message) as e:
        CmfFile(path)
    assert "\n" not in str(e.value)


def test_newer_minor_version_is_read(tmp_path):
    path = tmp_path / "m.cmf"
    _write(path)
    _mutate(path, lambda d: reseal(d.__setitem__(slice(10, 12), struct.pack("<H", 7)) or d))
    with CmfFile(path) as f:
        assert f.minor_version == 7 and all(ok for _, ok in f.verify())


def _rewrite_directory(path, fn):
    edit_file(path, lambda raw: rewrite_directory(raw, fn))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda es: es[1].__setitem__("offset", 10**12), "lies past the end of the data"),
        (lambda es: es[1].__setitem__("offset", es[1]["offset"] + 8), "not 64-byte aligned"),
        (lambda es: es[1].__setitem__("shape", [999, 999]), "its shape needs"),
        (lambda es: es[1].__setitem__("dtype", "q3"), "unknown dtype"),
        (lambda es: es[1].pop("crc32"), "corrupt CMF directory entry"),
        (lambda es: es[2].__setitem__("offset", es[1]["offset"]), "overlap"),
    ],
    ids=["offset-past-end", "misaligned", "shape", "dtype", "missing-key", "overlap"],
)
def test_bad_directories_are_one_line_errors(tmp_path, edit, message):
    path = tmp_path / "m.cmf"
    _write(path)
    _rewrite_directory(path, edit)
    with pytest.raises(CortiqError, match=message) as e:
        CmfFile(path)
    assert "\n" not in str(e.value)
