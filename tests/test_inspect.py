"""``cortiq inspect`` and ``cortiq verify`` through the CLI."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from formats.cmf import CmfFile, rewrite_header
from tests.cmf_edit import reseal
from formats.convert import TOKENIZER_TENSOR, sidecar_path
from cortiq_engine.convert import convert_checkpoint
from tests.test_convert_mtp import add_mtp
from tests.tiny import save_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(main.cmf with a sidecar, a second model's main.cmf with a sidecar) in one folder."""
    root = tmp_path_factory.mktemp("inspect")
    a = save_tiny("llama", root / "a", seed=0)
    b = save_tiny("llama", root / "b", seed=1)
    add_mtp(a, "deepseek")
    add_mtp(b, "deepseek")
    out = root / "out"
    out.mkdir()
    ma = convert_checkpoint(a, out / "a.cmf", quant="q4").output
    mb = convert_checkpoint(b, out / "b.cmf", quant="q8").output
    return ma, mb


def _one_error_line(r, expect: str) -> None:
    assert r.exit_code == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr


def test_inspect_tables(models):
    main, _ = models
    r = runner.invoke(app, ["inspect", str(main)])
    assert r.exit_code == 0, r.stderr
    for text in (
        "architecture",
        "hidden_size",
        "tokenizer",
        "BPE",
        "calibration",
        "not calibrated",
        "fingerprint",
        "converter",
        "q4",
        "sidecar:",
        "a.mtp.cmf",
        "matches",
    ):
        assert text in r.stdout, text
    assert "model.layers.0.self_attn.q_proj.weight" not in r.stdout
    r = runner.invoke(app, ["inspect", str(main), "--tensors"])
    assert "model.layers.0.self_attn.q_proj.weight" in r.stdout


def test_inspect_json_matches_the_file(models):
    main, _ = models
    r = runner.invoke(app, ["inspect", str(main), "--json", "--tensors"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    with CmfFile(main) as f:
        assert d["header"] == f.header
        assert d["tensor_count"] == len(f.tensors) == len(d["tensors"])
        assert d["dtypes"]["q4"]["tensors"] == sum(t.dtype == "q4" for t in f.tensors.values()) == 14
        assert d["dtypes"]["q4"]["bytes"] == sum(t.nbytes for t in f.tensors.values() if t.dtype == "q4")
        assert d["dtypes"]["u8"]["bytes"] == f.tensors[TOKENIZER_TENSOR].nbytes
        by_name = {t["name"]: t for t in d["tensors"]}
        assert by_name["lm_head.weight"]["crc32"] == f"{f.tensors['lm_head.weight'].crc32:08x}"
    with CmfFile(sidecar_path(main)) as sc:
        n, size = len(sc.tensors), sum(t.nbytes for t in sc.tensors.values())
    assert {k: d["partner"][k] for k in ("path", "kind", "valid", "error", "tensors", "bytes")} == {
        "path": str(sidecar_path(main)),
        "kind": "sidecar",
        "valid": True,
        "error": None,
        "tensors": n,
        "bytes": size,
    }
    assert n == 13 and d["partner"]["dtypes"]["q4"]["tensors"] == 8  # enorm, hnorm, final norm + 2 block norms are f32


def test_inspect_shows_the_calibration_temperature(models, tmp_path):
    main, _ = models
    copy = tmp_path / "c.cmf"
    copy.write_bytes(main.read_bytes())
    with CmfFile(copy) as f:
        h = f.header
    h["calibration"] = {"temperature": 1.3125, "method": "nll"}
    rewrite_header(copy, h)
    r = runner.invoke(app, ["inspect", str(copy)])
    assert r.exit_code == 0 and "1.3125" in r.stdout and "nll" in r.stdout
    r = runner.invoke(app, ["inspect", str(copy), "--json"])
    assert json.loads(r.stdout)["header"]["calibration"]["temperature"] == 1.3125


def test_inspect_a_sidecar_finds_its_backbone(models):
    main, _ = models
    r = runner.invoke(app, ["inspect", str(sidecar_path(main)), "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["header"]["role"] == "mtp_sidecar"
    assert d["partner"]["kind"] == "backbone" and d["partner"]["valid"] and d["partner"]["path"] == str(main)


def test_inspect_rejects_a_foreign_sidecar(models, tmp_path):
    a, b = models
    pa = tmp_path / "a.cmf"
    pa.write_bytes(a.read_bytes())
    sidecar_path(pa).write_bytes(sidecar_path(b).read_bytes())
    r = runner.invoke(app, ["inspect", str(pa)])
    _one_error_line(r, "a.mtp.cmf: MTP sidecar does not match its backbone: fingerprint")
    assert "does not match" in r.stdout  # the report itself is still printed
    r = runner.invoke(app, ["verify", str(pa)])
    _one_error_line(r, "fingerprint")


def test_verify_ok_and_corrupt(models, tmp_path):
    main, _ = models
    r = runner.invoke(app, ["verify", str(main)])
    assert r.exit_code == 0, r.stderr
    assert "OK" in r.stdout and "a.mtp.cmf" in r.stdout  # the sidecar is checked as well
    bad = tmp_path / "bad.cmf"
    bad.write_bytes(main.read_bytes())
    with CmfFile(bad) as f:
        targets = [f.tensors[n] for n in ("model.layers.1.mlp.down_proj.weight", "model.norm.weight")]
    data = bytearray(bad.read_bytes())
    for t in targets:
        data[t.offset + t.nbytes // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    r = runner.invoke(app, ["verify", str(bad)])
    _one_error_line(r, "checksum mismatch in")
    assert "model.layers.1.mlp.down_proj.weight" in r.stderr and "model.norm.weight" in r.stderr
    assert "lm_head.weight" not in r.stderr
    r = runner.invoke(app, ["verify", str(bad), "--json"])
    assert r.exit_code == 2
    d = json.loads(r.stdout)
    assert d["ok"] is False and sorted(d["files"][0]["bad"]) == [
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ]


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "magic":
        data[:8] = b"PK\x03\x04abcd"
    elif how == "future":
        data[8:10] = struct.pack("<H", 99)
    elif how == "truncated":
        del data[len(data) // 2 :]
    elif how == "offset":
        diroff, dirlen = struct.unpack("<QQ", data[40:56])
        entries = json.loads(data[diroff : diroff + dirlen])
        entries[3]["offset"] = (len(data) // 64 + 64) * 64
        new = json.dumps(entries).encode()
        data = data[:diroff] + new
        data[48:56] = struct.pack("<Q", len(new))
        reseal(data)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "how, expect",
    [
        ("magic", "not a CMF file"),
        ("future", "newer than this cortiq reads"),
        ("truncated", "truncated CMF file"),
        ("offset", "lies past the end of the data"),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "verify"])
def test_bad_files(models, tmp_path, command, how, expect):
    main, _ = models
    p = tmp_path / "m.cmf"
    p.write_bytes(main.read_bytes())
    _corrupt(p, how)
    _one_error_line(runner.invoke(app, [command, str(p)]), expect)


def test_missing_file(tmp_path):
    _one_error_line(runner.invoke(app, ["inspect", str(tmp_path / "nope.cmf")]), "no such file")
    os.mkdir(tmp_path / "d.cmf")
    _one_error_line(
        runner.invoke(app, ["verify", str(tmp_path / "d.cmf")]), 'is a folder: did you mean "cortiq convert'
    )
