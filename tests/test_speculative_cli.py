"""``cortiq generate`` with MTP draft layers: picked up beside the model, exact, reported;
a bad sidecar is an error; sampling turns speculation off and says so."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine.convert import convert_checkpoint
from tests.mtp_tiny import save_tiny_mtp

runner = CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_cli")
    src = save_tiny_mtp("mimo", root / "src", n_layers=3)
    path = root / "m.cmf"
    convert_checkpoint(src, path, quant="q8")
    other = save_tiny_mtp("mimo", root / "other", n_layers=3, seed=9)
    convert_checkpoint(other, root / "o.cmf", quant="q8")
    return root, path


def _gen(*args):
    r = runner.invoke(app, ["generate", *map(str, args), "--threads", "1"])
    return r


def test_sidecar_is_picked_up_and_exact(pair):
    _, path = pair
    r = _gen(path, "Hello there", "-n", "20", "--json", "--mtp-compare")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    m = doc["mtp"]
    assert m["source"].endswith("m.mtp.cmf") and m["depth"] == 3 and m["chain"] == "independent"
    assert m["same_tokens_as_plain"] is True and m["speedup"] > 0
    assert m["rounds"] + m["plain_steps"] + m["accepted"] + 1 == len(doc["token_ids"])
    assert sum(m["accept_histogram"]) == m["rounds"] and len(m["acceptance_per_depth"]) == 3
    plain = json.loads(_gen(path, "Hello there", "-n", "20", "--json", "--no-mtp").stdout)
    assert "mtp" not in plain and plain["token_ids"] == doc["token_ids"]
    r = _gen(
        path,
        "Hello there",
        "-n",
        "12",
        "--json",
        "--mtp-depth",
        "2",
        "--mtp-chain",
        "recursive",
        "--mtp-hidden",
        "post",
    )  # no --mtp-compare: no second, plain run
    m = json.loads(r.stdout)["mtp"]
    assert (m["mtp_depth"], m["chain"], m["hidden"]) == (2, "recursive", "post") and "speedup" not in m


def test_closing_table(pair):
    _, path = pair
    r = _gen(path, "Hi", "-n", "6", "--mtp-compare")
    assert r.exit_code == 0, r.output
    for words in ("speculative decoding", "tokens / round", "acceptance per depth", "vs plain decoding", "same tokens"):
        assert words in r.output


def test_sampling_turns_speculation_off(pair):
    _, path = pair
    r = _gen(path, "Hi", "-n", "5", "--json", "--temperature", "0.8", "--seed", "3")
    doc = json.loads(r.stdout)
    assert "mtp" not in doc and "greedy" in doc["mtp_note"]


def test_bad_sidecar_is_an_error_not_a_fallback(pair, tmp_path):
    root, path = pair
    shutil.copy(path, tmp_path / "x.cmf")
    shutil.copy(root / "o.mtp.cmf", tmp_path / "x.mtp.cmf")  # cut from another backbone
    for extra in ([], ["--temperature", "0.8"]):
        r = _gen(tmp_path / "x.cmf", "Hi", "-n", "3", *extra)
        assert r.exit_code == 2 and "fingerprint" in r.output and "--no-mtp" in r.output
        assert "Traceback" not in r.output
    assert _gen(tmp_path / "x.cmf", "Hi", "-n", "3", "--no-mtp").exit_code == 0
    # An explicit sidecar: the right one works wherever it lies.
    r = _gen(tmp_path / "x.cmf", "Hi", "-n", "4", "--json", "--mtp", root / "m.mtp.cmf")
    assert r.exit_code == 0 and json.loads(r.stdout)["mtp"]["source"].endswith("m.mtp.cmf")
    r = _gen(tmp_path / "x.cmf", "Hi", "-n", "3", "--mtp", root / "m.mtp.cmf", "--no-mtp")
    assert r.exit_code == 2 and "contradict" in r.output
