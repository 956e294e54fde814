"""The evals runs the eval commands call: one request in, the figures the CLI prints out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine.convert import convert_checkpoint
from evals.runs import (
    CalibrateRequest,
    EngineOptions,
    ImatrixRequest,
    PplRequest,
    WindowOptions,
    run_calibrate,
    run_imatrix,
    run_ppl,
)
from evals.text_source import TextSpec
from formats.errors import CortiqError
from tests.tiny import save_tiny

runner = CliRunner()
WINDOWS = WindowOptions(mode="sliding", ctx=64, stride=32, max_tokens=300)
ARGS = ["--mode", "sliding", "--ctx", "64", "--stride", "32", "--text-tokens", "300", "--threads", "1", "--json"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    out = root / "m.cmf"
    convert_checkpoint(save_tiny("llama", root / "src"), out, quant="q8")
    return out


def _cli(*args: str) -> dict:
    r = runner.invoke(app, list(args))
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_run_ppl_is_what_ppl_prints(tiny: Path) -> None:
    calls: list[tuple[int, int]] = []
    run = run_ppl(
        PplRequest([tiny, tiny], TextSpec(), WINDOWS, engine=EngineOptions(threads=1)),
        progress=lambda done, total, _ppl: calls.append((done, total)),
    )
    assert not run.partial and run.done == run.windows > 1
    assert calls[-1][0] == calls[-1][1] == run.result.reports[0].tokens_scored
    assert run.to_json() == _cli("ppl", str(tiny), str(tiny), *ARGS)


def test_run_calibrate_is_what_calibrate_prints(tiny: Path) -> None:
    run = run_calibrate(CalibrateRequest(tiny, TextSpec(), WINDOWS, engine=EngineOptions(threads=1)))
    doc = _cli("calibrate", str(tiny), *ARGS)
    assert doc["settings"] == run.settings
    assert doc["temperature"] == run.report.to_json()["temperature"]


def test_run_imatrix_counts_every_token_fed(tiny: Path) -> None:
    seen: list[tuple[int, int]] = []
    run = run_imatrix(ImatrixRequest(tiny, TextSpec(), WINDOWS, threads=1), lambda d, t: seen.append((d, t)))
    assert seen[-1] == (run.tokens, run.tokens) and run.means


def test_a_request_refused_before_anything_is_read(tiny: Path) -> None:
    with pytest.raises(CortiqError, match="cannot be combined"):
        run_ppl(PplRequest([tiny], ref=tiny, save_ref=tiny.with_suffix(".cref")))
    with pytest.raises(CortiqError, match="is one of the models"):
        run_ppl(PplRequest([tiny], save_ref=tiny))
