"""``cortiq chat`` on the real SmolLM2-135M-Instruct: a three-turn conversation through
stdin keeps the KV cache (the second turn forwards only its own tokens) and answers
exactly as ``cortiq generate`` does on the same rendered conversation; Ctrl-C stops an
answer and the chat goes on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine import Engine

pytestmark = pytest.mark.slow
runner = CliRunner()
SYSTEM = "You are a helpful assistant."
TURNS = ["What is the capital of France?", "And of Germany?", "Thank you!"]
N = 24


def test_three_turns_reuse_the_cache_and_equal_generate(smollm2_cmf, tmp_path):
    path = smollm2_cmf("q8")
    r = runner.invoke(
        app, ["chat", str(path), "--json", "-n", str(N), "--system", SYSTEM], input="\n".join(TURNS) + "\n"
    )
    assert r.exit_code == 0, r.output
    docs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [d["user"] for d in docs] == TURNS

    tok = Engine.load(path, warmup=False).tokenizer
    messages = [{"role": "system", "content": SYSTEM}]
    prev_cache: list[int] = []
    for k, (user, d) in enumerate(zip(TURNS, docs)):
        messages.append({"role": "user", "content": user})
        rendered = tok.apply_chat_template(messages)
        ids = tok.encode(rendered, add_bos=False)
        assert d["conversation_tokens"] == len(ids)
        if k == 0:
            assert d["reused_tokens"] == 0 and d["forwarded_tokens"] == len(ids)
        else:
            # The whole earlier conversation and answer come from the cache (ChatML renders
            # the answer back to the same tokens); only this turn's own tokens are forwarded.
            assert d["reused_tokens"] == len(prev_cache) and ids[: len(prev_cache)] == prev_cache
            own = tok.encode(f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n", add_bos=False)
            assert d["forwarded_tokens"] == len(ids) - len(prev_cache) == len(own)
        assert d["prompt_tokens"] == d["forwarded_tokens"]
        # The same answer as generate on the rendered conversation (greedy).
        f = tmp_path / f"turn{k}.txt"
        f.write_text(rendered, encoding="utf-8")
        g = runner.invoke(app, ["generate", str(path), "--prompt-file", str(f), "-n", str(N), "--json"])
        assert g.exit_code == 0, g.output
        gd = json.loads(g.stdout)
        assert gd["prompt_tokens"] == len(ids)
        assert d["token_ids"] == gd["token_ids"] and d["text"] == gd["text"]
        messages.append({"role": "assistant", "content": d["text"]})
        prev_cache = ids + d["token_ids"][:-1]
    assert "Paris" in docs[0]["text"]


def test_ctrl_c_stops_the_answer_not_the_chat(smollm2_cmf):
    path = smollm2_cmf("q8")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "cortiq_cli.main", "chat", str(path), "-n", "400", "-t", "1"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdin.write(b"Write a very long story about a dragon.\nSay hi.\n")
    proc.stdin.close()
    first = proc.stdout.read(1)  # the answer is streaming: interrupt it
    assert first
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    proc.stdout.read()
    err = proc.stderr.read()
    proc.wait(timeout=300)
    assert proc.returncode == 0, err.decode()
    stats = [ln for ln in err.decode().splitlines() if ln.startswith("cached")]
    assert len(stats) == 2, err.decode()
    assert stats[0].endswith("stopped") and not stats[1].endswith("stopped")
    answer_tokens = int(stats[0].split("answer ")[1].split()[0])
    assert 0 < answer_tokens < 400
    assert int(stats[1].split()[1]) > 0  # the second turn still reused the cache
