"""``cortiq bench``: llama-bench's tests and table, repetitions, thread sweep, RSS,
speculative rows for models with MTP draft layers, ``--json``."""

from __future__ import annotations

import json
import statistics

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine.threads import max_threads
from cortiq_engine.convert import convert_checkpoint

runner = CliRunner()


def _bench(*args):
    return runner.invoke(app, ["bench", *map(str, args)])


def _check_row(row, reps):
    assert row["reps"] == reps == len(row["tok_s"]) == len(row["seconds"])
    assert all(s > 0 for s in row["seconds"])
    assert row["tok_s"] == pytest.approx([row["tokens"] / s for s in row["seconds"]])
    assert row["median_tok_s"] == pytest.approx(statistics.median(row["tok_s"]))
    assert row["min_tok_s"] <= row["median_tok_s"] <= row["max_tok_s"]
    assert row["stddev_tok_s"] == pytest.approx(statistics.stdev(row["tok_s"]))


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from tests.mtp_tiny import save_tiny_mtp

    root = tmp_path_factory.mktemp("bench")
    convert_checkpoint(save_tiny_mtp("mimo", root / "src", n_layers=3), root / "m.cmf", quant="q8")
    return root / "m.cmf"


def test_json_rows_sweep_and_speculative_rows(mtp_model):
    top = max_threads()
    r = _bench(mtp_model, "-p", 16, "-n", 8, "-r", 2, "-t", f"1,{top}", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert (doc["n_prompt"], doc["n_gen"], doc["repetitions"]) == (16, 8, 2)
    tests = [(row["threads"], row["test"]) for row in doc["rows"]]
    assert tests == [(t, name) for t in (1, top) for name in ("pp16", "tg8", "verify4", "tg8+mtp")]
    for row in doc["rows"]:
        _check_row(row, 2)
        assert row["model"] == "m.cmf" and row["quant"] == "q8" and row["mtp_layers"] == 3
        assert row["size_bytes"] == mtp_model.stat().st_size and row["rss_bytes"] > 0
    by = {row["test"]: row for row in doc["rows"] if row["threads"] == 1}
    assert by["pp16"]["tokens"] == 16 and by["tg8"]["tokens"] == 8 and by["verify4"]["tokens"] == 4 * 8
    assert doc["peak_rss_bytes"] > 0
    plain = json.loads(_bench(mtp_model, "-p", 0, "-n", 4, "-r", 1, "--no-mtp", "--json").stdout)
    assert [row["test"] for row in plain["rows"]] == ["tg4"]


def test_markdown_table(mtp_model):
    r = _bench(mtp_model, "-p", 8, "-n", 4, "-r", 2, "-t", 1, "--no-mtp")
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "model",
        "size",
        "params",
        "quant",
        "threads",
        "test",
        "t/s",
    ]
    assert set(lines[1]) <= set("|-:")
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]]
    assert [(c[0], c[3], c[4], c[5]) for c in rows] == [("m.cmf", "q8", "1", "pp8"), ("m.cmf", "q8", "1", "tg4")]
    assert all(" ± " in c[6] and c[1].endswith("MiB") for c in rows)
    assert "RSS" in r.stderr


@pytest.mark.parametrize(
    "args,needle",
    [(["-t", "1,x"], "--threads"), (["-p", "0", "-n", "0"], "nothing to measure"), (["-t", "999"], "--threads 999")],
)
def test_errors_are_one_line(mtp_model, args, needle):
    r = _bench(mtp_model, *args)
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.stderr.startswith("error:") and needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_missing_file(tmp_path):
    r = _bench(tmp_path / "nope.cmf")
    assert r.exit_code == 2 and "no such file" in r.stderr


@pytest.mark.slow
def test_bench_json_on_smollm2(smollm2_cmf):
    path = smollm2_cmf("q8")
    r = _bench(path, "-p", 32, "-n", 8, "-r", 2, "-t", 1, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert [row["test"] for row in doc["rows"]] == ["pp32", "tg8"]  # no draft layers: no speculative rows
    for row in doc["rows"]:
        _check_row(row, 2)
        assert row["threads"] == 1 and row["quant"] == "q8" and row["arch"] == "llama"
        assert row["params"] == 134_515_008 and row["size_bytes"] == path.stat().st_size
        assert row["rss_bytes"] >= path.stat().st_size // 2  # the weights it ran are resident
        assert row["mtp_layers"] == 0
    assert doc["peak_rss_bytes"] >= doc["rows"][0]["rss_bytes"] // 2
