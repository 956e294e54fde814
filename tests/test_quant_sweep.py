"""``cortiq quant-sweep`` on a tiny model: the table's numbers are those ``cortiq ppl``
computes from the same files, temporary files go away, bad types are one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from tests.tiny import save_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("sweep") / "hf", max_position_embeddings=256)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    f = tmp_path_factory.mktemp("text") / "t.txt"
    f.write_text("The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. " * 12)
    return f


def sweep(*args: str) -> dict:
    r = runner.invoke(app, ["quant-sweep", *args, "--json"])
    assert r.exit_code == 0, r.stderr or r.output
    return json.loads(r.stdout)


def test_sweep_matches_ppl_on_the_kept_files(tiny_hf, text, tmp_path):
    work = tmp_path / "work"
    # top-k past the vocabulary (256 byte tokens): the saved reference is exact
    out = sweep(
        str(tiny_hf),
        "--types",
        "f32,q8,q4",
        "--text",
        str(text),
        "--ctx",
        "64",
        "--ref-top-k",
        "1000",
        "--decode-tokens",
        "8",
        "--decode-reps",
        "1",
        "--workdir",
        str(work),
        "--keep-files",
    )
    rows = {r["type"]: r for r in out["types"]}
    assert list(rows) == ["f32", "q8", "q4"]
    assert rows["f32"]["kl_mean"] == 0 and rows["f32"]["ppl_ratio"] == 1 and rows["f32"]["top1_agreement"] == 1
    assert rows["f32"]["bits_per_weight"] == pytest.approx(32.0)
    assert rows["q4"]["bits_per_weight"] < rows["q8"]["bits_per_weight"] < 32
    assert 0 < rows["q8"]["kl_mean"] < rows["q4"]["kl_mean"]
    assert all(r["decode_tok_s"] > 0 for r in rows.values())
    assert out["reference_form"] == "top-256"  # clamped to the vocabulary

    ref = runner.invoke(
        app,
        [
            "ppl",
            str(work / "f32.cmf"),
            str(work / "q8.cmf"),
            str(work / "q4.cmf"),
            "--text",
            str(text),
            "--ctx",
            "64",
            "--mode",
            "chunks",
            "--json",
        ],
    )
    assert ref.exit_code == 0, ref.stderr
    live = {c["model"].split(".")[0]: c for c in json.loads(ref.stdout)["comparisons"]}
    for q in ("q8", "q4"):
        assert rows[q]["file_bytes"] == (work / f"{q}.cmf").stat().st_size
        c = live[q]
        assert rows[q]["kl_mean"] == pytest.approx(
            c["kl_mean"], rel=1e-3, abs=1e-9
        )  # float32 log-probabilities in the file
        assert rows[q]["kl_p99"] == pytest.approx(c["kl_quantiles"]["p99"], rel=1e-3, abs=1e-8)
        assert rows[q]["ppl_ratio"] == pytest.approx(c["ppl_ratio"], rel=1e-9)
        assert rows[q]["top1_agreement"] == c["top1_agreement"]


def test_sweep_cleans_up_and_plots(tiny_hf, text, tmp_path):
    work = tmp_path / "work"
    png = tmp_path / "sweep.png"
    out = sweep(
        str(tiny_hf),
        "--types",
        "q8",
        "--text",
        str(text),
        "--ctx",
        "64",
        "--decode-tokens",
        "4",
        "--decode-reps",
        "1",
        "--workdir",
        str(work),
        "--plot",
        str(png),
    )
    assert [r["type"] for r in out["types"]] == ["q8"]
    assert list(work.iterdir()) == []  # no CMF, no reference left behind
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = runner.invoke(
        app,
        [
            "quant-sweep",
            str(tiny_hf),
            "--types",
            "q8",
            "--text",
            str(text),
            "--ctx",
            "64",
            "--decode-tokens",
            "4",
            "--decode-reps",
            "1",
        ],
    )
    assert r.exit_code == 0, r.stderr
    assert "Quantization sweep" in r.stdout and "bits/weight" in r.stdout and "p99 KLD" in r.stdout


@pytest.mark.parametrize("types,msg", [("q8,nope", "nope"), ("", "empty"), ("q8,q8", "twice")])
def test_bad_types_are_one_line(tiny_hf, text, tmp_path, types, msg):
    r = runner.invoke(
        app,
        [
            "quant-sweep",
            str(tiny_hf),
            "--types",
            types,
            "--text",
            str(text),
            "--ctx",
            "64",
            "--workdir",
            str(tmp_path / "w"),
        ],
    )
    assert r.exit_code == 2
    assert msg in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_close_points_get_labels_that_do_not_overlap():
    from cortiq_cli.cmd_quant_sweep import _label_offsets

    # SmolLM2's sweep: q5km (6.27, 0.0471) and q4km (6.17, 0.0472) sat on one another
    pts = [(8.5, 7.8e-4), (8.12, 4.5e-3), (6.27, 0.0471), (6.17, 0.0472), (5.74, 1e-8), (5.35, 0.259)]
    assert _label_offsets(pts, log=True) == [(4, 4), (4, 4), (4, 4), (4, -8), (4, 4), (4, 4)]
    assert _label_offsets([(6.27, 100.0), (6.17, 100.5), (6.2, 101.0), (8.5, 100.0)], log=False) == [
        (4, 4),
        (4, -8),
        (4, -20),
        (4, 4),
    ]
