"""Errors that name the remedy: a model without draft layers points to ``cortiq
mtp-train``; a missing optional extra names the pip command that installs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine.convert import convert_checkpoint
from tests.tiny import save_tiny

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("remedy")
    out = root / "plain.cmf"
    convert_checkpoint(save_tiny("llama", root / "hf"), out, quant="f32")
    return out


@pytest.mark.parametrize("cmd", [["mtp-probe", "--max-tokens", "40"], ["generate", "Hi", "--mtp-depth", "2"]])
def test_no_draft_layers_points_to_mtp_train(plain, cmd):
    args = [cmd[0], str(plain), *cmd[1:]]
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "Traceback" not in r.output
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:")
    assert "no MTP draft layers" in err and f"cortiq mtp-train {plain}" in err and "--mtp PATH" in err


def _without(module: str, *argv: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter where ``import module`` fails, as without the extra."""
    code = f"import sys; sys.modules[{module!r}] = None; from cortiq_cli.main import main; sys.argv = ['cortiq', *sys.argv[1:]]; main()"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, timeout=300)


def test_missing_torch_names_the_train_extra(plain, tmp_path):
    r = _without("torch", "mtp-train", str(plain), "--steps", "1", "--out", str(tmp_path / "s.mtp.cmf"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "error: mtp-train needs torch: pip install 'cortiq[train]'"


def test_missing_matplotlib_names_the_plot_extra(plain, tmp_path):
    r = _without("matplotlib", "calibrate", str(plain), "--plot", str(tmp_path / "x.png"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == "error: --plot needs matplotlib: pip install 'cortiq[plot]'"
