"""torch is the optional ``[train]`` extra: the engine never imports it, and
``cortiq mtp-train`` without it is one line naming the extra.

Each check runs in a fresh interpreter where ``import torch`` fails (``sys.modules``
holds None for it, as Python does for a module that cannot be imported), so the
packages are imported as a machine without torch imports them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from cortiq_engine.convert import convert_checkpoint
from tests.tiny import save_tiny

REPO = Path(__file__).resolve().parents[1]
NO_TORCH = "import sys; sys.modules['torch'] = None\n"


def run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", CORTIQ_KERNELS="numpy")
    return subprocess.run(
        [sys.executable, "-c", NO_TORCH + code, *args], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
    )


def test_every_engine_module_imports_without_torch():
    code = (
        "import importlib, pkgutil, cortiq_engine\n"
        "names = sorted(m.name for m in pkgutil.walk_packages(cortiq_engine.__path__, 'cortiq_engine.'))\n"
        "for n in names:\n"
        "    importlib.import_module(n)\n"
        "import cortiq_cli.main, cortiq_train.run, cortiq_train.config\n"
        "assert sys.modules['torch'] is None\n"
        "print(len(names))\n"
    )
    p = run_without_torch(code)
    assert p.returncode == 0, p.stderr
    assert int(p.stdout.strip()) >= 30  # every module of the engine, its models and kernels


def test_engine_source_never_imports_torch():
    hits = [
        f"{f.relative_to(REPO)}:{i + 1}"
        for f in sorted((REPO / "cortiq_engine").rglob("*.py"))
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines())
        if line.strip().startswith(("import torch", "from torch"))
    ]
    assert hits == []


def test_torch_is_an_extra_not_a_dependency():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(d.split("=")[0].split(">")[0].strip() == "torch" for d in project["dependencies"])
    assert any(d.startswith("torch") for d in project["optional-dependencies"]["train"])
    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert "cortiq_train*" in found


@pytest.fixture(scope="module")
def tiny_cmf(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("no_torch")
    cmf = root / "tiny.cmf"
    convert_checkpoint(save_tiny("llama", root / "hf"), cmf, quant="f32")
    return cmf


def test_mtp_train_without_torch_is_one_line(tiny_cmf, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("Some training text. " * 200)
    out = tmp_path / "t.mtp.cmf"
    code = "import sys; from cortiq_cli.main import main; sys.argv[0] = 'cortiq'; main()"
    p = run_without_torch(
        code, "mtp-train", str(tiny_cmf), "--text", str(text), "--steps", "1", "--seq", "32", "--out", str(out)
    )
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), p.stderr
    assert "pip install 'cortiq[train]'" in lines[0]
    assert "Traceback" not in p.stderr and not out.exists()
