"""The command line as llama.cpp and MLX-LM users type it, and its manners in a terminal.

One tiny random llama (byte-level tokenizer) keeps this fast. The CLI runs through
typer's runner, and as a real process where a pipe, a signal or an exit code is the
point (``python -m cortiq_cli.main``, as the console script runs it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cortiq_cli.common import LLAMA_CPP_QUANTS, human_bytes, quant_names, resolve_quant
from cortiq_cli.help import cortiq_version
from cortiq_cli.main import COMMANDS, app
from cortiq_engine.convert import convert_checkpoint
from formats.cmf import CmfFile
from formats.errors import CortiqError
from tests.tiny import save_tiny

REPO = Path(__file__).resolve().parents[1]
NAMES = [name for name, _, _ in COMMANDS]
PROMPT = "The quick brown fox"
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("habits")
    hf = save_tiny("llama", root / "hf", max_position_embeddings=128)
    cmf = root / "tiny.cmf"
    convert_checkpoint(hf, cmf, quant="f32")
    return hf, cmf


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


def _json(r) -> dict:
    assert r.exit_code == 0, r.stderr or r.output
    return json.loads(r.stdout)


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", NO_COLOR="1")


def _cortiq(*args) -> list[str]:
    return [sys.executable, "-m", "cortiq_cli.main", *map(str, args)]


def _default_sigint() -> None:
    """SIGINT's default disposition in the child: a test run started in the background
    ignores SIGINT, and a child would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ------------------------------------------------------------------ 1. options
def test_model_and_prompt_as_options_or_positionals(tiny):
    _, cmf = tiny
    want = _json(_run("generate", cmf, PROMPT, "-n", 6, "--json"))["token_ids"]
    for args in (
        ["-m", cmf, "-p", PROMPT],
        ["--model", cmf, PROMPT],
        [cmf, "--prompt", PROMPT],
        ["-p", PROMPT, "-m", cmf],
    ):
        d = _json(_run("generate", *args, "-n", 6, "-c", 64, "-t", 1, "--json"))
        assert d["token_ids"] == want and d["ctx"] == 64 and d["threads"] == 1, args
    r = _run("generate", cmf, PROMPT, "-p", "another", "-n", 2)
    assert r.exit_code == 2 and r.stderr.startswith("error: unexpected extra argument 'another'")


def test_sampling_flags_mean_the_same_in_generate_and_chat(tiny):
    _, cmf = tiny
    flags = [
        "--temp",
        "0.8",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--min-p",
        "0.05",
        "--repeat-penalty",
        "1.1",
        "--seed",
        "3",
    ]
    d = _json(_run("generate", "-m", cmf, "-p", PROMPT, "-n", 5, *flags, "--json"))
    assert d["sampling"] == {
        "temperature": 0.8,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "seed": 3,
    }
    assert _json(_run("generate", cmf, PROMPT, "-n", 5, *flags, "--json"))["token_ids"] == d["token_ids"]  # seeded
    for name in ("generate", "chat"):
        out = _run(name, "-h").stdout
        for row in (
            r"-m, --model PATH",
            r"-n, --max-tokens N",
            r"-c, --ctx N",
            r"-t, --threads N",
            r"--temp, --temperature X",
            r"--top-k N",
            r"--top-p X",
            r"--min-p X",
            r"--repeat-penalty, --repetition-penalty X",
            r"--seed N",
        ):
            assert re.search(rf"^  {re.escape(row)}\b", out, re.M), (name, row)
    bench = _run("bench", "-h").stdout  # llama-bench's: -p prompt tokens, -n tokens to generate
    assert re.search(r"^  -m, --model PATH", bench, re.M) and re.search(r"^  -n, --n-gen N +Decode test", bench, re.M)


def test_chat_and_bench_take_the_model_as_an_option(tiny, tmp_path):
    _, cmf = tiny
    from tests.test_chat import TEMPLATE, _with_template

    chat = _with_template(cmf, tmp_path / "chat.cmf", TEMPLATE)
    r = runner.invoke(app, ["chat", "-m", str(chat), "-n", "4", "--json"], input="hi\n")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[0])["turn"] == 1
    d = _json(_run("bench", "-m", cmf, "-m", cmf, "-p", 8, "-n", 4, "-r", 1, "-t", 1, "--json"))
    assert [row["test"] for row in d["rows"]] == ["pp8", "tg4"] * 2


def test_n_means_tokens_to_generate_everywhere(tiny):
    _, cmf = tiny
    for cmd, instead in (("mtp-vocab", "--size N"), ("mtp-train", "--steps N")):
        r = _run(cmd, cmf, "-n", 8)
        assert r.exit_code == 2, (cmd, r.output)
        assert r.stderr.strip() == (
            f"error: -n is the number of tokens to generate in cortiq; cortiq {cmd} takes "
            + ("the draft vocabulary's size as --size N" if cmd == "mtp-vocab" else "its optimizer steps as --steps N")
        )
        assert instead in r.stderr
    for cmd in ("ppl", "calibrate", "imatrix", "quant-sweep", "mtp-probe", "mtp-vocab", "mtp-train"):
        out = _run(cmd, "-h").stdout
        assert "--text-tokens N" in out and "--max-tokens" not in out, cmd  # the old spelling still reads, unlisted
    # ... and --max-tokens still bounds the text where it did
    old = _json(_run("ppl", cmf, "--max-tokens", 40, "--ctx", 32, "--json"))
    assert old["settings"]["max_tokens"] == 40 and old["models"][0]["tokens_scored"] == 40
    assert _json(_run("ppl", cmf, "--text-tokens", 40, "--ctx", 32, "--json"))["models"] == old["models"]


# ------------------------------------------------------------------ 2. quant names
def test_llama_cpp_quant_names_resolve_to_the_same_layouts():
    assert {
        k: resolve_quant(k)
        for k in ("q4_0", "q4_1", "q4_k_m", "q4_k_s", "q5_k_m", "q6_k", "q8_0", "f16", "bf16", "f32")
    } == {
        "q4_0": "q4_0",
        "q4_1": "q4",
        "q4_k_m": "q4km",
        "q4_k_s": "q4k",
        "q5_k_m": "q5km",
        "q6_k": "q6k",
        "q8_0": "q8",
        "f16": "f16",
        "bf16": "bf16",
        "f32": "f32",
    }
    assert resolve_quant("Q4_K_M") == "q4km" and resolve_quant("q4") == "q4" and resolve_quant("q4km") == "q4km"
    with pytest.raises(CortiqError, match="unknown --quant 'q2_k'; choose one of q8_0 \\(q8\\)"):
        resolve_quant("q2_k")
    from formats.quants import DTYPES

    # q4 is Q4_1's layout: llama.cpp's q4_1 is it, and q4_0 is Q4_0, not q4
    assert DTYPES["q4"].ggml_type == "Q4_1" and DTYPES["q4_0"].ggml_type == "Q4_0" and DTYPES["q8"].ggml_type == "Q8_0"
    from formats.policy import QUANT_CHOICES

    assert set(quant_names().values()) == set(QUANT_CHOICES)  # every preset has a name, every name a preset
    assert set(LLAMA_CPP_QUANTS) <= set(quant_names())


@pytest.mark.parametrize("name,dtype", [("q4_1", "q4"), ("Q4_0", "q4_0"), ("q8_0", "q8"), ("q4", "q4")])
def test_convert_takes_llama_cpp_names(tiny, tmp_path, name, dtype):
    hf, _ = tiny
    out = tmp_path / "m.cmf"
    rep = _json(_run("convert", hf, out, "--quant", name, "--keep", "lm_head.weight=q8_0", "--json"))
    assert dtype in rep["dtypes"]
    with CmfFile(out) as f:
        matrices = {t.dtype for n, t in f.tensors.items() if n.endswith("proj.weight")}
        assert matrices == {dtype}
        assert f.tensors["lm_head.weight"].dtype == "q8"


def test_quant_sweep_takes_llama_cpp_names(tiny, tmp_path):
    hf, _ = tiny
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    d = _json(
        _run(
            "quant-sweep",
            hf,
            "--types",
            "q8_0,Q4_1",
            "--text",
            text,
            "--ctx",
            64,
            "--decode-tokens",
            2,
            "--decode-reps",
            1,
            "--json",
        )
    )
    assert [r["type"] for r in d["types"]] == ["q8", "q4"]
    r = _run("quant-sweep", hf, "--types", "q8_0,q2_k", "--text", text)
    assert r.exit_code == 2 and r.stderr.startswith("error: unknown --types 'q2_k'; choose one of q8_0 (q8)")


# ------------------------------------------------------------------ 3. --version
def test_version_prints_the_package_version():
    from importlib.metadata import version

    p = subprocess.run(_cortiq("--version"), capture_output=True, text=True, env=_env(), timeout=60)
    assert p.returncode == 0 and p.stdout == f"cortiq {version('cortiq')}\n" == f"cortiq {cortiq_version()}\n"


# ------------------------------------------------------------------ 4. help
def _assert_plain_help(name: str, out: str) -> None:
    lines = out.splitlines()
    assert lines[0].startswith("Usage: ") and f" {name} [OPTIONS]" in lines[0]
    assert max(len(ln) for ln in lines) <= 80
    assert all(ln == ln.rstrip() for ln in lines)
    assert out.endswith("\n") and not out.endswith("\n\n")  # no blank line after the last one
    assert "\x1b" not in out and not re.search(r"\[/?(bold|dim|red|yellow|green|cyan)\b|\[/\]", out), out
    if name in ("generate", "chat", "ppl", "calibrate"):
        assert "--kv-cache f32|f16" in out
    if name in ("generate", "chat"):
        assert "--mtp-chain independent|recursive" in out and "--mtp-hidden pre|post" in out
    if name in ("ppl", "quant-sweep"):
        assert re.search(r"--mode (sliding\|chunks|chunks\|sliding) ", out)
    if name == "chat":
        assert "--chat-template model|raw" in out
    if name == "convert":
        assert "--mtp sidecar|inline|drop" in out and "-q, --quant TYPE" in out
        assert all(q in " ".join(out.split()) for q in ("q4_k_m (q4km)", "q4_1 (q4)", "q4_0,", "q8_0 (q8)"))


def _runner_help(name: str):
    # The runner's output is no terminal, as a pipe is not; the environment is the process test's.
    return runner.invoke(app, [name, "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.mark.parametrize("name", NAMES)
def test_help_off_a_terminal_is_80_columns_of_plain_text(name):
    res = _runner_help(name)
    assert res.exit_code == 0, res.output
    _assert_plain_help(name, res.stdout)


# One real process proves the runner's help is the pipe's, byte for byte but the program name;
# the runner test above covers every command, so the other processes run in the slow suite.
@pytest.mark.parametrize("name", [n if n == "convert" else pytest.param(n, marks=pytest.mark.slow) for n in NAMES])
def test_help_into_a_pipe_is_80_columns_of_plain_text(name):
    p = subprocess.run(
        _cortiq(name, "--help"), capture_output=True, text=True, env={**_env(), "COLUMNS": "200"}, timeout=60
    )
    assert p.returncode == 0, p.stderr
    _assert_plain_help(name, p.stdout)
    usage = "Usage: python -m cortiq_cli.main "
    assert p.stdout.startswith(usage) and p.stdout == _runner_help(name).stdout.replace("Usage: cortiq ", usage, 1)


# ------------------------------------------------------------------ 5. a folder for a file
def test_a_folder_where_a_cmf_file_is_read(tiny, tmp_path):
    hf, cmf = tiny
    for args in (
        ["generate", hf, "hi"],
        ["generate", "-m", hf, "-p", "hi"],
        ["inspect", hf],
        ["verify", hf],
        ["ppl", cmf, hf],
        ["bench", "-m", hf],
        ["chat", hf],
        ["calibrate", hf],
    ):
        r = _run(*args)
        assert r.exit_code == 2, (args, r.output)
        assert r.stderr == f'error: {hf} is a folder: did you mean "cortiq convert {hf} OUT.cmf"?\n', args


# ------------------------------------------------------------------ 6. a closed pipe
def test_a_closed_pipe_ends_generate_quietly(tiny):
    _, cmf = tiny
    p = subprocess.Popen(
        _cortiq("generate", cmf, "-p", "hi", "-n", 100_000_000, "--ignore-eos", "--evict", "--ctx", 64, "-t", 1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
    )
    try:
        first = p.stdout.read(10)  # as `| head -c 10`: read ten bytes, then go away
        p.stdout.close()
        err = p.stderr.read()
        rc = p.wait(timeout=60)
    finally:
        p.kill() if p.poll() is None else None
    assert len(first) == 10
    assert rc == 0 and err == b"", err.decode()


# ------------------------------------------------------------------ 7. Ctrl-C
def test_ctrl_c_in_generate_ends_the_line_and_prints_the_stats(tiny):
    _, cmf = tiny
    p = subprocess.Popen(
        _cortiq("generate", cmf, "hello", "-n", 100_000_000, "--ignore-eos", "--evict", "--ctx", 64, "-t", 1),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        preexec_fn=_default_sigint,
    )
    try:
        got = p.stdout.read(20)  # generation is under way
        time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=60)
    finally:
        p.kill() if p.poll() is None else None
    out = (got + rest).decode("utf-8", "replace")
    err = err.decode()
    assert p.returncode == 130, err
    assert out.endswith("\n") and len(out) > 20
    stats = [ln for ln in err.splitlines() if ln.startswith("prompt ")]
    assert len(stats) == 1, err
    m = re.search(r"decode (\d+) tok, ([\d.]+) tok/s .* finish interrupted", stats[0])
    assert m and int(m.group(1)) >= 20 and float(m.group(2)) > 0, stats[0]
    assert "Traceback" not in err


# ------------------------------------------------------------------ 8. exit codes
def test_exit_codes_follow_the_readme_table(tiny, tmp_path):
    _, cmf = tiny
    readme = (REPO / "README.md").read_text()
    for code, what in ((0, "success"), (1, "runtime failure"), (2, "bad input"), (130, "interrupted")):
        assert re.search(rf"^\| `{code}` \| {what}", readme, re.M), (code, what)
    assert _run("generate", cmf, PROMPT, "-n", 1).exit_code == 0
    assert _run("generate", tmp_path / "nope.cmf", PROMPT).exit_code == 2  # a CortiqError: bad input
    assert _run("generate", cmf, PROMPT, "--top-k", "-1").exit_code == 2  # a bad option value
    assert _run("convert", "x", "y.cmf", "--quant", "q3").exit_code == 2
    bad = tmp_path / "bad.cmf"  # a flipped byte in a tensor: a damaged file is bad input too
    data = bytearray(cmf.read_bytes())
    with CmfFile(cmf) as f:
        t = f.tensors["model.norm.weight"]
    data[t.offset + t.nbytes // 2] ^= 0x01
    bad.write_bytes(bytes(data))
    r = _run("verify", bad)
    assert r.exit_code == 2 and "checksum mismatch" in r.stderr
    # a runtime failure: a chat turn from a script that could not run (its context is full)
    r = runner.invoke(
        app, ["chat", str(cmf), "--chat-template", "raw", "--ctx", "32", "-n", "2", "--json"], input="x" * 60 + "\n"
    )
    assert r.exit_code == 1 and "longer than the context" in r.stderr


# ------------------------------------------------------------------ 9. sizes
def test_sizes_in_binary_units(tiny, tmp_path):
    hf, cmf = tiny
    assert [human_bytes(n) for n in (512, 1536, 3 * 2**20, 5 * 2**30)] == ["512 B", "1.5 KiB", "3.0 MiB", "5.0 GiB"]
    from rich.progress import Progress

    from cortiq_cli.common import BytesColumn

    bar = Progress(BytesColumn(), disable=True)  # the progress bars of convert and verify
    bar.add_task("x", total=5 * 2**20, completed=2**20)
    assert BytesColumn().render(bar.tasks[0]).plain == "1.0 MiB/5.0 MiB"
    outputs = [
        _run("inspect", cmf),
        _run("verify", cmf),
        _run("convert", hf, tmp_path / "m.cmf", "--quant", "q8_0"),
        _run("generate", cmf, PROMPT, "-n", 2),
        _run("bench", cmf, "-p", 8, "-n", 2, "-r", 1, "-t", 1),
    ]
    for r in outputs:
        assert r.exit_code == 0, r.output
        text = r.stdout + r.stderr
        assert re.search(r"\d (KiB|MiB|GiB)\b", text), text
        assert not re.search(r"\d (KB|MB|GB|TB)\b|MB/s", text), text


# ------------------------------------------------------------------ 10. chat without a template
def test_chat_without_a_template(tiny):
    _, cmf = tiny  # converted without a chat template
    r = runner.invoke(app, ["chat", str(cmf), "-n", "4"], input="hi\n")
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip() == (
        f"error: {cmf}: no chat template in the header; use cortiq generate for plain text, "
        "or --chat-template raw for plain 'User: ... Assistant:' turns"
    )
    r = runner.invoke(app, ["chat", str(cmf), "-n", "4", "--chat-template", "raw", "--json"], input="hi\nagain\n")
    assert r.exit_code == 0, r.stderr
    turns = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [t["turn"] for t in turns] == [1, 2] and turns[1]["reused_tokens"] > 0
    warn = r.stderr.strip().splitlines()
    assert len(warn) == 1 and warn[0].startswith("warning: --chat-template raw: plain 'User: ... Assistant:' turns")
    from cortiq_cli.cmd_chat import raw_template
    from cortiq_engine import Engine, SamplingConfig

    with Engine.load(cmf) as eng:  # the raw turn is the greedy continuation of the plain rendering
        ids = eng.tokenizer.encode(raw_template([{"role": "user", "content": "hi"}]))
        want = eng.generate(ids, SamplingConfig(), max_tokens=4, stop=["\nUser:"]).token_ids
    assert turns[0]["token_ids"] == want
    r = runner.invoke(app, ["chat", str(cmf), "--chat-template", "chatml"], input="hi\n")
    assert r.exit_code == 2 and "unknown --chat-template 'chatml'; choose model or raw" in r.stderr
