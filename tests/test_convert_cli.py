"""``cortiq convert`` through the CLI: reports, and every bad input as a one-line error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from typer.testing import CliRunner

from cortiq_cli.main import app
from formats.cmf import CmfFile
from tests.tiny import save_tiny

runner = CliRunner()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_tiny("llama", tmp_path_factory.mktemp("llama"))


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def assert_clean_failure(result, out_dir: Path, expect: str, allowed=()) -> None:
    """Exit 2 (bad input), exactly one 'error:' line on stderr naming the problem, no traceback, nothing written."""
    assert result.exit_code == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expect in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(allowed)


def test_convert_prints_a_table_and_json(llama, tmp_path):
    r = runner.invoke(app, ["convert", str(llama), str(tmp_path / "m.cmf"), "--quant", "q4"])
    assert r.exit_code == 0, r.stderr
    for word in ("q4", "q8", "f32", "RMS rel. error", "MiB/s"):
        assert word in r.stdout
    r = runner.invoke(app, ["convert", str(llama), str(tmp_path / "j.cmf"), "--json", "--keep", "lm_head.weight=f16"])
    assert r.exit_code == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["output"] == str(tmp_path / "j.cmf") and rep["dtypes"]["f16"]["tensors"] == 1
    assert 0.004 < rep["dtypes"]["q8"]["rms_rel_error"] < 0.0055
    assert rep["source_bytes"] == sum(x.nbytes for x in load_file(llama / "model.safetensors").values())


def test_force(llama, tmp_path):
    out = tmp_path / "m.cmf"
    out.write_bytes(b"not yet a model")
    r = runner.invoke(app, ["convert", str(llama), str(out)])
    assert_clean_failure(r, tmp_path, "exists (use --force to overwrite)", allowed=["m.cmf"])
    assert out.read_bytes() == b"not yet a model"
    r = runner.invoke(app, ["convert", str(llama), str(out), "--force"])
    assert r.exit_code == 0, r.stderr
    with CmfFile(out) as f:
        assert f.header["arch"]["arch"] == "llama"


def _without(name):
    def edit(folder: Path) -> None:
        t = load_file(folder / "model.safetensors")
        del t[name]
        save_file(t, folder / "model.safetensors")

    return edit


def _reshape(name, shape):
    def edit(folder: Path) -> None:
        t = load_file(folder / "model.safetensors")
        t[name] = np.zeros(shape, np.float32)
        save_file(t, folder / "model.safetensors")

    return edit


def _config(**changes):
    def edit(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.update(changes)
        (folder / "config.json").write_text(json.dumps(cfg))

    return edit


def _remove(name):
    return lambda folder: (folder / name).unlink()


def _corrupt_safetensors(folder: Path) -> None:
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    "edit, expect",
    [
        (_remove("config.json"), "missing config.json"),
        (_remove("tokenizer.json"), "missing tokenizer.json"),
        (_remove("model.safetensors"), "no *.safetensors weights"),
        (
            _without("model.layers.1.mlp.up_proj.weight"),
            "checkpoint is missing tensor model.layers.1.mlp.up_proj.weight",
        ),
        (
            _reshape("model.layers.0.self_attn.k_proj.weight", (16, 64)),
            "tensor model.layers.0.self_attn.k_proj.weight has shape [16, 64], config.json implies [32, 64]",
        ),
        (_config(model_type="gpt_neo"), "unsupported architecture 'gpt_neo'"),
        (_config(hidden_act="gelu"), "activation 'gelu' is not supported"),
        (_corrupt_safetensors, "truncated"),
    ],
    ids=[
        "no-config",
        "no-tokenizer",
        "no-weights",
        "missing-tensor",
        "misshapen",
        "unknown-arch",
        "activation",
        "truncated-weights",
    ],
)
def test_bad_checkpoints(llama, tmp_path, edit, expect):
    src = _copy(llama, tmp_path / "src")
    edit(src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    r = runner.invoke(app, ["convert", str(src), str(out_dir / "m.cmf")])
    assert_clean_failure(r, out_dir, expect)


def test_unknown_architecture_lists_the_supported_ones(llama, tmp_path):
    src = _copy(llama, tmp_path / "src")
    _config(model_type="gpt_neo")(src)
    r = runner.invoke(app, ["convert", str(src), str(tmp_path / "m.cmf")])
    assert r.exit_code == 2
    for name in ("llama", "mistral", "qwen2", "qwen3"):
        assert name in r.stderr.split("supported:")[1]


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--quant", "q3"], "unknown --quant 'q3'"),
        (["--keep", "lm_head.weight"], "expected PATTERN=DTYPE"),
        (["--keep", "lm_head.weight=q2"], "unknown dtype 'q2'"),
        (["--mtp", "maybe"], "unknown --mtp 'maybe'"),
    ],
)
def test_bad_options(llama, tmp_path, args, expect):
    r = runner.invoke(app, ["convert", str(llama), str(tmp_path / "m.cmf"), *args])
    assert_clean_failure(r, tmp_path, expect)


def test_bad_paths(llama, tmp_path):
    r = runner.invoke(app, ["convert", str(tmp_path / "nowhere"), str(tmp_path / "m.cmf")])
    assert_clean_failure(r, tmp_path, "no such checkpoint folder")
    r = runner.invoke(app, ["convert", str(llama), str(tmp_path / "no" / "m.cmf")])
    assert_clean_failure(r, tmp_path, "output folder")
    r = runner.invoke(app, ["convert", str(llama), str(tmp_path)])
    assert_clean_failure(r, tmp_path, "is a folder")
    (tmp_path / "x.gguf").write_bytes(b"this is not a gguf file at all")
    r = runner.invoke(app, ["convert", str(tmp_path / "x.gguf"), str(tmp_path / "m.cmf")])
    assert_clean_failure(r, tmp_path, "not a GGUF file", allowed=["x.gguf"])


def test_hub_id_offline_is_one_line(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "NO_COLOR": "1"}
    out = tmp_path / "out"
    out.mkdir()
    p = subprocess.run(
        [sys.executable, "-m", "cortiq_cli.main", "convert", "cortiq-test/no-such-model", str(out / "m.cmf")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "cortiq-test/no-such-model" in lines[0] and "hub" in lines[0], p.stderr
    assert "Traceback" not in p.stderr and list(out.iterdir()) == []


def test_ctrl_c_exits_130_and_leaves_nothing(llama, tmp_path, monkeypatch):
    import cortiq_cli.cmd_convert as cmd
    import cortiq_engine.convert as conv

    real = conv.convert_checkpoint

    def interrupted(*a, **kw):
        def progress(name, done, total):
            if done > total // 2:
                raise KeyboardInterrupt

        return real(*a, **{**kw, "progress": progress})

    monkeypatch.setattr(cmd, "convert_checkpoint", interrupted)
    r = runner.invoke(app, ["convert", str(llama), str(tmp_path / "m.cmf")])
    assert r.exit_code == 130 and "interrupted" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def _help(*cmd: str) -> str:
    r = runner.invoke(app, [*cmd, "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"}, terminal_width=400)
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())


def test_convert_help_lists_every_quant_including_keep():
    from formats.policy import QUANT_CHOICES

    quant_help = _help("convert").split("--quant", 1)[1].split("--keep", 1)[0]
    for q in (*QUANT_CHOICES, "keep"):
        assert f" {q}" in quant_help, q


@pytest.mark.parametrize("cmd", ["ppl", "calibrate"])
def test_text_help_lists_the_bundled_corpora(cmd):
    from evals.text_source import BUNDLED_CORPORA

    text_help = _help(cmd).split("--text", 1)[1].split("--config", 1)[0]
    assert set(BUNDLED_CORPORA) >= {"alice", "hamlet", "sonnets"}
    for name in BUNDLED_CORPORA:
        assert name in text_help, name
