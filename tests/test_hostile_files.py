"""Hostile files and hard stops: each known case, one by one.

Each test reproduces a reported failure (a crash, a traceback, code run from a
pickle, a leftover, a lost result) and checks the one-line error or the fix.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from formats.cmf import MAX_HEADER, CmfFile
from cortiq_engine.convert import convert_checkpoint
from formats.errors import CortiqError
from formats.untrusted_json import loads
from tests.cmf_edit import edit_file, rewrite_directory, rewrite_header_bytes
from tests.tiny import save_tiny

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    src = save_tiny("llama", root / "src")
    out = root / "m.cmf"
    convert_checkpoint(src, out, quant="q8")
    return src, out


def _one_line_error(res, *needles: str) -> str:
    assert res.exit_code not in (0, None), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    err = res.stderr.strip() if res.stderr else res.output.strip()
    # The first engine load on a cold kernel cache announces the compile on its own line.
    err = "\n".join(ln for ln in err.splitlines() if not ln.startswith("compiling kernels for this CPU")).strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in res.output, err
    for n in needles:
        assert n in err, err
    return err


def _header(path: Path) -> dict:
    with CmfFile(path) as f:
        return f.header


def _with_header(src: Path, dst: Path, header: dict) -> Path:
    """A copy of ``src`` whose header is ``header``, checksum recomputed (an attacker's file)."""
    shutil.copy(src, dst)
    hj = json.dumps(header).encode()
    edit_file(dst, lambda d: rewrite_header_bytes(d, hj))
    return dst


# ------------------------------------------------------------------ memory safety


def test_rotary_dim_past_head_dim_is_refused_at_load(tiny, tmp_path):
    """A SIGSEGV case: arch.rotary_dim > head_dim made the rope kernel write out of bounds."""
    _, cmf = tiny
    h = _header(cmf)
    h["arch"]["rotary_dim"] = h["arch"]["head_dim"] * 8
    bad = _with_header(cmf, tmp_path / "r.cmf", h)
    text = tmp_path / "t.txt"
    text.write_text("some text to score " * 10)
    for cmd in (["generate", str(bad), "hi", "-n", "2"], ["ppl", str(bad), "--text", str(text)]):
        _one_line_error(runner.invoke(app, cmd), "rotary_dim=128 exceeds head_dim=16")


def test_partial_rotary_factor_is_refused_at_convert(tiny, tmp_path):
    src, _ = tiny
    bad = tmp_path / "src"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["partial_rotary_factor"] = 8.0
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CortiqError, match="rotary_dim=128 exceeds head_dim=16"):
        convert_checkpoint(bad, tmp_path / "o.cmf")
    assert not (tmp_path / "o.cmf").exists()


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("num_heads", 0, "num_heads is 0"),
        ("num_heads", "4", "num_heads is '4', expected int"),
        ("num_kv_heads", 3, "does not divide"),
        ("rope_theta", -1.0, "rope_theta is -1.0"),
        ("vocab_size", 300, "model.embed_tokens.weight has shape [256, 64], its arch header implies [300, 64]"),
        ("head_dim", 32, "q_proj.weight has shape [64, 64], its arch header implies [128, 64]"),
        ("layer_types", ["full"], "layer_types"),
        ("sliding_window", -5, "sliding_window is -5"),
    ],
)
def test_arch_fields_are_checked_against_types_ranges_and_shapes(tiny, tmp_path, key, value, message):
    _, cmf = tiny
    h = _header(cmf)
    h["arch"][key] = value
    bad = _with_header(cmf, tmp_path / "a.cmf", h)
    _one_line_error(runner.invoke(app, ["generate", str(bad), "hi", "-n", "2"]), message)


def test_shape_shrunk_with_same_bytes_is_refused(tiny, tmp_path):
    """A [64, 64] matrix relabelled [32, 128] keeps its byte count; the manifest check refuses it."""
    _, cmf = tiny
    bad = tmp_path / "s.cmf"
    shutil.copy(cmf, bad)

    def edit(entries):
        e = next(e for e in entries if e["name"] == "model.layers.0.self_attn.o_proj.weight")
        e["shape"] = [32, 128]

    edit_file(bad, lambda d: rewrite_directory(d, edit))
    _one_line_error(runner.invoke(app, ["generate", str(bad), "hi", "-n", "2"]), "o_proj.weight has shape [32, 128]")


def test_overflowing_shape_is_refused(tiny, tmp_path):
    """A shape whose element count wraps 64 bits to the blob size used to pass verify."""
    _, cmf = tiny
    bad = tmp_path / "o.cmf"
    shutil.copy(cmf, bad)

    def edit(entries):
        e = next(e for e in entries if e["name"] == "model.norm.weight")
        e["shape"] = [2**32, 2**32, 64]

    edit_file(bad, lambda d: rewrite_directory(d, edit))
    _one_line_error(runner.invoke(app, ["verify", str(bad)]), "model.norm.weight has shape")


# ------------------------------------------------------------------ CMF container


def test_changed_header_fails_the_checksum_everywhere(tiny, tmp_path):
    _, cmf = tiny
    bad = tmp_path / "c.cmf"
    shutil.copy(cmf, bad)
    h = _header(cmf)
    h["arch"]["rope_theta"] = 20000.0  # a valid value, but not what was written
    edit_file(bad, lambda d: rewrite_header_bytes(d, json.dumps(h).encode(), seal=False))
    for cmd in (["inspect", str(bad)], ["verify", str(bad)], ["generate", str(bad), "hi"]):
        _one_line_error(runner.invoke(app, cmd), "header checksum mismatch")


def test_swapped_names_and_relabelled_dtype_fail_verify(tiny, tmp_path):
    _, cmf = tiny

    def swap(entries):
        a, b = entries[2], entries[3]
        a["name"], b["name"] = b["name"], a["name"]

    def relabel(entries):
        e = next(e for e in entries if e["dtype"] == "f32")
        e["dtype"] = "bf16"

    for i, fn in enumerate((swap, relabel)):
        bad = tmp_path / f"d{i}.cmf"
        shutil.copy(cmf, bad)
        edit_file(bad, lambda d: rewrite_directory(d, fn, seal=False))
        _one_line_error(runner.invoke(app, ["verify", str(bad)]), "checksum mismatch")


def test_padding_bytes_are_covered_by_verify(tiny, tmp_path):
    _, cmf = tiny
    bad = tmp_path / "p.cmf"
    shutil.copy(cmf, bad)
    with CmfFile(cmf) as f:
        slack = f.preamble.header_offset + f.preamble.header_length + 10
    edit_file(bad, lambda d: d.__setitem__(slack, ord("x")))
    _one_line_error(runner.invoke(app, ["verify", str(bad)]), "header padding was changed")


def test_format_1_files_get_one_clear_line(tiny, tmp_path):
    _, cmf = tiny
    old = tmp_path / "v1.cmf"
    shutil.copy(cmf, old)
    edit_file(
        old, lambda d: d.__setitem__(slice(8, 10), struct.pack("<H", 1)) or d.__setitem__(slice(56, 64), bytes(8))
    )
    _one_line_error(runner.invoke(app, ["inspect", str(old)]), "CMF format 1.0 has no header checksum", "reconvert")


@pytest.mark.parametrize(
    "hjson, message",
    [
        (b'{"a": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested 1001 deep"),
        (b'{"arch": {"num_layers": ' + b"7" * 5000 + b"}}", "integer with 5000 digits"),
        (b'{"x": Infinity}', "Infinity is not a JSON number"),
        (b'{"x": "\xff"}', "not UTF-8"),
    ],
    ids=["deep", "bigint", "infinity", "utf8"],
)
def test_json_bombs_in_a_sealed_header(tiny, tmp_path, hjson, message):
    from tests.fuzz_cmf import _rebuild

    _, cmf = tiny
    bad = tmp_path / "b.cmf"
    bad.write_bytes(_rebuild(cmf.read_bytes(), hjson))
    _one_line_error(runner.invoke(app, ["inspect", str(bad)]), message)


def test_header_length_is_bounded(tiny, tmp_path):
    _, cmf = tiny
    bad = tmp_path / "h.cmf"
    shutil.copy(cmf, bad)
    edit_file(bad, lambda d: d.__setitem__(slice(24, 32), struct.pack("<Q", MAX_HEADER + 1)))
    _one_line_error(runner.invoke(app, ["inspect", str(bad)]), "exceeds its limit")


def test_untrusted_json_parser_limits():
    assert loads(b'{"a": [1, {"b": "[[[["}]}', "t") == {"a": [1, {"b": "[[[["}]}
    with pytest.raises(CortiqError, match="nested 100000 deep"):
        loads(b"[" * 100000 + b"]" * 100000, "t")
    with pytest.raises(CortiqError, match="overflows a double"):
        loads(b"[1e999]", "t")


def test_safetensors_header_nested_deep_is_one_error(tmp_path):
    from formats.safetensors_reader import SafetensorsFile

    h = b'{"a":' * 100000 + b"1" + b"}" * 100000
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h)
    with pytest.raises(CortiqError, match="nested 100000 deep"):
        SafetensorsFile(p)


def test_sidecar_backbone_file_with_a_slash(tiny, tmp_path):
    from tests.mtp_tiny import write_random_sidecar

    _, cmf = tiny
    main = tmp_path / "m.cmf"
    shutil.copy(cmf, main)
    side = write_random_sidecar(main, tmp_path / "m.mtp.cmf", n_layers=1)
    h = _header(side)
    h["backbone"]["file"] = "../../etc/passwd/x"
    _with_header(side, tmp_path / "s2.mtp.cmf", h)
    res = runner.invoke(app, ["inspect", str(tmp_path / "s2.mtp.cmf")])
    assert res.exit_code == 0 and res.exception is None, res.output  # the partner is ignored, not followed


# ------------------------------------------------------------------ checkpoints at convert time


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("config.json", b'{"model_type": "llama", "x": "\xff"}', "not UTF-8"),
        ("tokenizer_config.json", b'{"chat_template": "\xfe"}', "not UTF-8"),
        ("tokenizer.json", b'{"model": 5}', "tokenizers library cannot load it"),
        ("config.json", None, "num_heads is 0"),
    ],
    ids=["config-utf8", "tokcfg-utf8", "tokenizer-model-5", "heads-0"],
)
def test_bad_checkpoint_files_are_one_line_errors(tiny, tmp_path, name, content, message):
    src, _ = tiny
    bad = tmp_path / "src"
    shutil.copytree(src, bad)
    if content is None:
        cfg = json.loads((bad / "config.json").read_text())
        cfg["num_attention_heads"] = 0
        content = json.dumps(cfg).encode()
    (bad / name).write_bytes(content)
    _one_line_error(runner.invoke(app, ["convert", str(bad), str(tmp_path / "o.cmf")]), message)


# ------------------------------------------------------------------ chat templates


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ 1 // 0 }}", "ZeroDivisionError"),
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "range() items"),
        ("{{ 'x' * 100000000 }}", "repeated string"),
        ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "output over"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
        ("{{ raise_exception('no system role') }}", "raised: no system role"),
        ("{% for %}", "syntax error"),
    ],
    ids=["div0", "loop", "bigstring", "bigoutput", "recursion", "raise", "syntax"],
)
def test_chat_templates_are_bounded_and_named(tiny, tmp_path, template, message):
    _, cmf = tiny
    h = _header(cmf)
    h["tokenizer"]["chat_template"] = template
    bad = _with_header(cmf, tmp_path / "t.cmf", h)
    t0 = time.monotonic()
    err = _one_line_error(runner.invoke(app, ["generate", str(bad), "hi", "--chat", "-n", "2"]), message)
    assert "chat template of t.cmf" in err
    assert time.monotonic() - t0 < 60  # bounded (the real bound is 2 s of rendering)


# ------------------------------------------------------------------ option values, OS errors


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ctx", "0"], "--ctx"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--temperature", "nan"], "--temperature"),
        (["--seed", "-1"], "--seed must be in 0..2^63-1"),
        (["--ctx", "1000000000000"], "KV cache"),
        (["--top-p", "inf"], "top-p"),
    ],
)
def test_option_values_are_one_line_errors(tiny, args, message):
    _, cmf = tiny
    _one_line_error(runner.invoke(app, ["generate", str(cmf), "hi", *args]), message)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_output_folder(tiny, tmp_path):
    src, _ = tiny
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        _one_line_error(runner.invoke(app, ["convert", str(src), str(ro / "o.cmf")]), "permission denied")
    finally:
        ro.chmod(0o755)


def _limit_file_size() -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000))


def test_a_full_disk_during_convert_is_one_line_and_leaves_nothing(tiny, tmp_path):
    """A file-size limit stands in for a full disk: the write fails with an OSError mid-conversion."""
    src, _ = tiny
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run(
        [sys.executable, "-m", "cortiq_cli.main", "convert", str(src), str(out / "o.cmf"), "--quant", "f32"],
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size,
        timeout=300,
    )
    assert p.returncode == 1, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "File too large" in lines[0], p.stderr
    assert list(out.iterdir()) == []


def test_os_errors_become_one_line(tmp_path):
    """The top-level handler turns an OSError a command cannot foresee into one line (here:
    a sidecar path that is a folder, which open() refuses with EISDIR)."""
    from cortiq_cli.common import _os_error_line

    assert _os_error_line(OSError(28, "No space left on device", "/x/o.cmf")) == "/x/o.cmf: no space left on the device"
    assert _os_error_line(OSError(30, "Read-only file system", "/ro")) == "/ro: the file system is read-only"


def test_same_file_guard(tiny, tmp_path):
    src, _ = tiny
    gguf_like = tmp_path / "m.gguf"
    gguf_like.write_bytes(b"GGUF" + bytes(60))
    _one_line_error(runner.invoke(app, ["convert", str(gguf_like), str(gguf_like), "--force"]), "is the source itself")
    assert gguf_like.read_bytes()[:4] == b"GGUF"
    copy = tmp_path / "src"
    shutil.copytree(src, copy)
    target = copy / "model.safetensors"
    before = target.read_bytes()
    _one_line_error(runner.invoke(app, ["convert", str(copy), str(target), "--force"]), "is the source itself")
    assert target.read_bytes() == before


# ------------------------------------------------------------------ leftovers of a killed conversion


def test_stale_staging_files_are_removed_by_the_next_run(tiny, tmp_path):
    from formats.staging import hold

    src, _ = tiny
    out = tmp_path / "o.cmf"
    stale_file = tmp_path / ".o.cmf.abc123.tmp"
    stale_file.write_bytes(b"x" * 1000)
    stale_dir = tmp_path / ".o.cmf.gguf-xyz"
    (stale_dir / "checkpoint").mkdir(parents=True)
    stale_side = tmp_path / ".o.mtp.cmf.q1w2.tmp"
    stale_side.write_bytes(b"y")
    live = tmp_path / ".o.cmf.live.tmp"
    live.write_bytes(b"z")
    other = tmp_path / ".other.cmf.abc.tmp"
    other.write_bytes(b"w")
    held = hold(live)  # a run still in progress (this process) keeps its file
    convert_checkpoint(src, out, quant="q8")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([".o.cmf.live.tmp", ".other.cmf.abc.tmp", "o.cmf"]), names
    held.release()


def test_kill_9_during_convert_leaves_nothing_after_the_next_run(tiny, tmp_path):
    src, _ = tiny
    out = tmp_path / "o.cmf"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    killed_with_leftover = False
    for delay in (0.5, 1.0, 2.0, 4.0, 8.0):
        p = subprocess.Popen(
            [sys.executable, "-m", "cortiq_cli.main", "convert", str(src), str(out), "--force", "--quant", "q4"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            if any(x.name.endswith(".tmp") for x in tmp_path.iterdir()):
                time.sleep(min(delay, 0.05))
                break
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait()
        if any(x.name.startswith(".o.cmf.") for x in tmp_path.iterdir()):
            killed_with_leftover = True
            break
    if not killed_with_leftover:
        pytest.skip("the conversion always finished before the kill (machine too fast for this tiny model)")
    convert_checkpoint(src, out, quant="q8", force=True)
    assert sorted(x.name for x in tmp_path.iterdir()) == ["o.cmf"]


# ------------------------------------------------------------------ ppl on a tiny text


def test_ppl_on_two_tokens_prints_no_nan(tiny, tmp_path):
    _, cmf = tiny  # sliding: a chunk needs --ctx tokens, a sliding window two
    text = tmp_path / "hi.txt"
    text.write_text("hi")
    res = runner.invoke(app, ["ppl", str(cmf), "--text", str(text), "--mode", "sliding"])
    assert res.exit_code == 0, res.output
    assert "nan" not in res.output.lower() and "n/a" in res.output
    res = runner.invoke(app, ["ppl", str(cmf), "--text", str(text), "--mode", "sliding", "--json"])
    doc = json.loads(res.stdout)  # strict JSON: no NaN tokens
    assert doc["models"][0]["ppl_ci95"] == [None, None] and math.isfinite(doc["models"][0]["ppl"])


# ------------------------------------------------------------------ Ctrl-C keeps the partial result


class _StopAfter:
    """A logit model that scores like ``engine`` for ``windows`` windows, then is interrupted."""

    def __init__(self, engine, windows: int):
        self.engine, self.left = engine, windows

    def iter_logits(self, ids, chunk=512, first=0):
        if self.left == 0:
            raise KeyboardInterrupt
        self.left -= 1
        yield from self.engine.iter_logits(ids, chunk=chunk, first=first)


def test_ppl_and_calibrate_keep_the_windows_done(tiny):
    from evals.runs import collect_partial, score_partial
    from cortiq_engine import Engine
    from evals.perplexity import run_perplexity
    from evals.temperature import TemperatureGrid
    from evals.windows import sliding_windows

    _, cmf = tiny
    with Engine.load(cmf, threads=1) as eng:
        tokens = np.array(eng.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6))
        windows = sliding_windows(len(tokens), 64, 32, None)
        assert len(windows) >= 4
        res, done = score_partial([_StopAfter(eng, 2)], ["m"], tokens, windows, eng.tokenizer, chunk=16)
        want = run_perplexity([eng], ["m"], tokens, windows[:2], eng.tokenizer, chunk=16)
        assert done == 2
        assert res.reports[0].tokens_scored == want.reports[0].tokens_scored
        assert res.reports[0].ppl == pytest.approx(want.reports[0].ppl, rel=1e-9)
        feats, done = collect_partial(_StopAfter(eng, 3), tokens, windows, TemperatureGrid.make(0.5, 2.0), chunk=16)
        assert done == 3 and len(feats) == sum(w.n_scored for w in windows[:3])
        with pytest.raises(KeyboardInterrupt):  # nothing done: the interrupt goes on
            score_partial([_StopAfter(eng, 0)], ["m"], tokens, windows, eng.tokenizer, chunk=16)


def _default_sigint() -> None:
    """The child gets SIGINT's default disposition: a test run started in the background
    (``pytest &``) ignores SIGINT, and a child inherits that (and keeps it, as Python does)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _communicate(p: subprocess.Popen) -> tuple[str, str]:
    """Its output; a child still running a minute after the interrupt is killed, not left behind."""
    try:
        return p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise


def test_generate_json_prints_the_tokens_so_far_on_ctrl_c(tiny):
    _, cmf = tiny
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    for wait in (6, 12, 24):
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cortiq_cli.main",
                "generate",
                str(cmf),
                "hello",
                "--json",
                "-n",
                "100000000",
                "--ignore-eos",
                "--evict",
                "--ctx",
                "64",
                "--threads",
                "1",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_default_sigint,
        )
        time.sleep(wait)
        p.send_signal(signal.SIGINT)
        out, err = _communicate(p)
        if out.strip():
            doc = json.loads(out)
            assert p.returncode == 130
            assert doc["finish_reason"] == "interrupted" and doc["generated_tokens"] == len(doc["tokens"]) > 0
            assert doc["text"] == "".join(t["text"] for t in doc["tokens"])
            return
        assert "Traceback" not in err, err  # interrupted while loading: one line, no JSON yet
    pytest.fail("generate never got past loading in 42 s")


@pytest.mark.parametrize("entry", ["module", "console script"])
def test_ctrl_c_while_the_libraries_load_is_one_line(tiny, entry):
    """SIGINT in the first second (numpy, numba, typer importing): "interrupted", code 130,
    no import traceback, whether started as ``python -m cortiq_cli.main`` or as the
    ``cortiq`` console script (``cortiq_cli.launch:main``)."""
    _, cmf = tiny
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    start = (
        ["-m", "cortiq_cli.main"]
        if entry == "module"
        else ["-c", "import sys; sys.argv[0] = 'cortiq'; from cortiq_cli.launch import main; main()"]
    )
    reached = 0
    for wait in (0.2, 0.35, 0.5, 0.7, 1.0):
        # a generation that runs until interrupted: the signal never lands after the end
        p = subprocess.Popen(
            [
                sys.executable,
                *start,
                "generate",
                str(cmf),
                "hello",
                "-n",
                "100000000",
                "--ignore-eos",
                "--evict",
                "--ctx",
                "64",
                "--threads",
                "1",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_default_sigint,
        )
        time.sleep(wait)
        p.send_signal(signal.SIGINT)
        out, err = _communicate(p)
        if "init_import_site" in err:  # the interpreter's own start (site-packages' .pth files), before any cortiq code
            continue
        reached += 1
        assert "Traceback" not in err, err
        # 130, or death by the signal itself once Python's own handling has run (the
        # shell reports 130 for both)
        assert p.returncode in (130, -signal.SIGINT), err
        assert err.strip().endswith("interrupted"), err
    assert reached >= 3


# ------------------------------------------------------------------ no pickle


def test_mtp_train_resume_never_unpickles(tiny, tmp_path):
    _, cmf = tiny
    main = tmp_path / "m.cmf"
    shutil.copy(cmf, main)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (tmp_path / "m.mtp.train.pt").write_bytes(pickle.dumps(Evil()))
    text = tmp_path / "t.txt"
    text.write_text("Some training text. " * 200)
    res = runner.invoke(app, ["mtp-train", str(main), "--text", str(text), "--resume", "--steps", "1", "--seq", "32"])
    _one_line_error(res, "no checkpoint", "old pickle checkpoint")
    assert not marker.exists()
    # a pickle under the new name is not a safetensors file: refused before anything runs
    (tmp_path / "m.mtp.train.safetensors").write_bytes(pickle.dumps(Evil()))
    res = runner.invoke(app, ["mtp-train", str(main), "--text", str(text), "--resume", "--steps", "1", "--seq", "32"])
    assert res.exit_code != 0 and not marker.exists()
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
