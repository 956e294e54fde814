"""Files the command line reads by path are untrusted: a chat session file (``chat
--load``), a prompt file and a text file that are a FIFO, a device or too deep a JSON
document are one line and exit 2, at once, in a real process (a FIFO must not block)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cortiq_engine.convert import convert_checkpoint
from tests.tiny import save_tiny

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def cmf(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    hf = save_tiny("llama", root / "hf", max_position_embeddings=128)
    cfg = {"chat_template": TEMPLATE}
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = root / "tiny.cmf"
    convert_checkpoint(hf, out, quant="f32")
    return out


def _cortiq(*args, stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "cortiq_cli.main", *map(str, args)],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    return path


def _one_line(p: subprocess.CompletedProcess, *words: str) -> None:
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), p.stderr
    assert all(w in lines[0] for w in words), lines[0]


def test_chat_load_of_a_fifo_or_a_device(cmf, fifo):
    _one_line(_cortiq("chat", cmf, "--load", fifo, "-n", "2", stdin="hi\n"), "FIFO")
    _one_line(_cortiq("chat", cmf, "--load", "/dev/zero", "-n", "2", stdin="hi\n"), "character device")


def test_chat_load_of_a_too_deep_document(cmf, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    _one_line(_cortiq("chat", cmf, "--load", deep, "-n", "2", stdin="hi\n"))


def test_prompt_and_text_files_that_are_not_regular_files(cmf, fifo):
    _one_line(_cortiq("generate", cmf, "--prompt-file", fifo, "-n", "2"), "FIFO")
    _one_line(_cortiq("ppl", cmf, "--text", "/dev/zero"), "character device")


def test_chat_save_is_atomic_and_never_replaces_a_fifo(cmf, tmp_path, fifo):
    """``/save`` writes beside the target and renames: a FIFO target is refused, and
    nothing is left behind; a regular target gets the whole conversation."""
    p = _cortiq("chat", cmf, "-n", "2", "--json", stdin=f"hi\n/save {fifo}\n/save {tmp_path / 'c.json'}\n")
    assert "is a FIFO" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.json", "pipe"]
    doc = json.loads((tmp_path / "c.json").read_text())
    assert [m["role"] for m in doc][-2:] == ["user", "assistant"] and doc[-2]["content"] == "hi"
