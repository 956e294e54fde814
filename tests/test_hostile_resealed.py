"""Inputs from an attacker who recomputes every checksum: each must end in a one-line
``error:`` and exit 2 (or a clean success) quickly, never a traceback, a signal, a
hang or unbounded memory.

Times are only compared with a tiny input's time measured in the same test.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from cortiq_engine.convert import convert_checkpoint
from formats.errors import CortiqError
from tests.tiny import save_tiny

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("resealed")
    src = save_tiny("llama", root / "src")
    out = root / "m.cmf"
    convert_checkpoint(src, out, quant="q8")
    return src, out


def _one_line_error(res, *needles: str, code: int = 2) -> str:
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    err = res.stderr.strip() if res.stderr else res.output.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in res.output, err
    assert res.exit_code == code, (res.exit_code, err)
    for n in needles:
        assert n in err, err
    return err


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ------------------------------------------------------------------ 1. JSON headers in linear time


def _adversarial_headers(size: int) -> dict[str, bytes]:
    n = size // 2
    keys = b"{" + b",".join(b'"k%d":%d' % (i, i) for i in range(size // 16)) + b"}"
    return {
        # an unterminated string of escaped quotes: a backtracking string pattern is quadratic on it
        "escaped-quotes": b'{"a": "' + b'\\"' * n,
        "escaped-quotes-closed": b'{"a": "' + b'\\"' * (n - 8) + b'"}',
        "quotes": b'{"a": [' + b'"",' * (size // 3 - 4) + b'""]}',
        "backslashes": b'{"a": "' + b"\\\\" * (n - 8) + b'"}',
        "deep": b"[" * n + b"]" * n,
        "deep-dict": b'{"a":' * (size // 6) + b"1" + b"}" * (size // 6),
        "many-keys": keys,
        "long-string": b'{"notes": "' + b"x" * size + b'"}',
        "brackets-in-strings": b'{"a": "' + b"[{" * n + b'"}',
    }


def test_adversarial_json_scans_in_linear_time():
    """1 MB headers built to be slow (escaped quotes, deep nesting, many keys, long strings)
    parse or are refused within a generous multiple of the time of a 1 KB one."""
    from formats.untrusted_json import loads

    def run(raw: bytes) -> None:
        try:
            loads(raw, "header")
        except CortiqError as e:
            assert "\n" not in str(e)

    small = _adversarial_headers(1 << 10)
    big = _adversarial_headers(1 << 20)
    for kind in big:
        base = min(_timed(lambda: run(small[kind])) for _ in range(5))
        t = _timed(lambda: run(big[kind]))
        # Linear: about 1,000x the 1 KB time (plus a fixed cost); quadratic would be 10^6x.
        assert t < 20_000 * base + 0.05, (kind, t, base)


def _cmf_with_header(src: Path, dst: Path, hjson: bytes) -> Path:
    from tests.fuzz_cmf import _rebuild

    dst.write_bytes(_rebuild(src.read_bytes(), hjson))
    return dst


def test_adversarial_cmf_header_is_refused_quickly(tiny, tmp_path):
    """Resealed CMF files whose header is 1 MB of the same shapes: inspect answers (a table
    or one line) in a bounded multiple of its time on the intact file."""
    _, cmf = tiny
    base = min(_timed(lambda: runner.invoke(app, ["inspect", str(cmf)])) for _ in range(3))
    for kind, hjson in _adversarial_headers(1 << 20).items():
        bad = _cmf_with_header(cmf, tmp_path / f"{kind}.cmf", hjson)
        t0 = time.perf_counter()
        res = runner.invoke(app, ["inspect", str(bad)])
        t = time.perf_counter() - t0
        if res.exit_code != 0:  # valid JSON that is no model header may still be inspected
            _one_line_error(res)
        assert t < 50 * base + 1.0, (kind, t, base)


def test_adversarial_safetensors_header_is_refused_quickly(tmp_path):
    from formats.imatrix import read_imatrix, write_imatrix

    good = tmp_path / "good.safetensors"
    write_imatrix(good, {"w": np.ones(4, np.float32)}, 3)
    base = min(_timed(lambda: read_imatrix(good)) for _ in range(5))
    for kind, hjson in _adversarial_headers(1 << 20).items():
        p = tmp_path / f"{kind}.safetensors"
        p.write_bytes(struct.pack("<Q", len(hjson)) + hjson)
        t0 = time.perf_counter()
        with pytest.raises(CortiqError) as e:
            read_imatrix(p)
        assert "\n" not in str(e.value)
        assert time.perf_counter() - t0 < 20_000 * base + 0.5, kind


# ------------------------------------------------------------------ 2. tokenizer.json checked first


def with_tokenizer(src: Path, dst: Path, tok: dict | bytes, header_edit=None) -> Path:
    """A copy of CMF ``src`` whose embedded tokenizer.json is ``tok``, written by the real
    writer (every checksum right): what an attacker can make."""
    from formats.cmf import CmfFile, CmfWriter
    from formats.tokenizer_header import TOKENIZER_TENSOR

    raw = tok if isinstance(tok, bytes) else json.dumps(tok).encode()
    with CmfFile(src) as f:
        header = json.loads(json.dumps(f.header))
        if header_edit is not None:
            header_edit(header)
        with CmfWriter(dst, header, force=True) as w:
            for name in f.names():
                if name != TOKENIZER_TENSOR:
                    info = f.info(name)
                    w.add_encoded(name, info.dtype, tuple(info.shape), list(f.tensor_parts(name).values()))
            w.add_bytes(TOKENIZER_TENSOR, raw)
    return dst


def _tokenizer_json(cmf: Path) -> dict:
    from formats.cmf import CmfFile
    from formats.tokenizer_header import TOKENIZER_TENSOR

    with CmfFile(cmf) as f:
        return json.loads(f.raw_bytes(TOKENIZER_TENSOR))


def _edit(tok: dict, path: str, value) -> dict:
    tok = json.loads(json.dumps(tok))
    keys = path.split(".")
    obj = tok
    for k in keys[:-1]:
        obj = obj[k]
    obj[keys[-1]] = value
    return tok


_SPLIT = {"type": "Split", "pattern": {"Regex": "a" * 5000}, "behavior": "Isolated", "invert": False}
_TEMPLATE = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "[X]", "type_id": 0}}],
    "pair": [],
    "special_tokens": {},
}


@pytest.mark.parametrize(
    "path, value, message",
    [
        # the library aborts the process (SIGABRT) allocating this at the first encode
        (
            "padding",
            {
                "strategy": {"Fixed": 10**12},
                "direction": "Right",
                "pad_to_multiple_of": None,
                "pad_id": 0,
                "pad_type_id": 0,
                "pad_token": "x",
            },
            "padding.strategy.Fixed",
        ),
        # the library panics (PanicException, a BaseException) on a special token it cannot find
        ("post_processor", _TEMPLATE, "which special_tokens lacks"),
        # a Precompiled charsmap the library indexes out of bounds
        ("normalizer", {"type": "Precompiled", "precompiled_charsmap": "AAAAAAAA"}, "known normalizers"),
        ("model.type", "Hypothetical", "known models: BPE, WordPiece, Unigram, WordLevel"),
        ("model.merges", [["zz", "qq"]], "'zz', which is not in the vocabulary"),
        ("model.vocab", {"a": -1}, "expected a token id"),
        ("pre_tokenizer", _SPLIT, "5000 characters long"),
        ("pre_tokenizer", {"type": "Sequence", "pretokenizers": [_SPLIT]}, "pre_tokenizer.pretokenizers[0]"),
        ("decoder", {"type": "Strip", "content": " ", "start": 2**40, "stop": 0}, "decoder.start"),
        ("decoder", {"type": "Replace", "pattern": {"String": "x"}, "content": "y" * 10**5}, "decoder.content"),
        (
            "truncation",
            {"max_length": 2**62, "stride": 0, "strategy": "LongestFirst", "direction": "Right"},
            "truncation.max_length",
        ),
        ("pre_tokenizer.type", ["ByteLevel"], "pre_tokenizer.type"),
        ("decoder", {"type": {"text": "ByteLevel"}}, "decoder.type"),
        (
            "post_processor",
            dict(_TEMPLATE, single=[{"SpecialToken": {"id": ["[X]"], "type_id": 0}}]),
            "special_tokens lacks",
        ),
    ],
    ids=[
        "padding-abort",
        "template-panic",
        "precompiled",
        "model-type",
        "merges",
        "vocab-id",
        "split-regex",
        "sequence",
        "strip",
        "replace",
        "truncation",
        "type-list",
        "type-object",
        "special-id-list",
    ],
)
def test_hostile_tokenizer_json_is_refused_before_the_library(tiny, tmp_path, path, value, message):
    _, cmf = tiny
    bad = with_tokenizer(cmf, tmp_path / "t.cmf", _edit(_tokenizer_json(cmf), path, value))
    _one_line_error(runner.invoke(app, ["generate", str(bad), "hi", "-n", "1"]), message)


def test_tokenizer_vocab_size_must_match_the_header(tiny, tmp_path):
    _, cmf = tiny

    def grow(h):
        h["tokenizer"]["vocab_size"] = 300

    bad = with_tokenizer(cmf, tmp_path / "v.cmf", _tokenizer_json(cmf), grow)
    _one_line_error(runner.invoke(app, ["generate", str(bad), "hi", "-n", "1"]), "256 tokens, the header says 300")


def test_tokenizer_json_that_is_not_an_object_or_not_json(tiny, tmp_path):
    _, cmf = tiny
    for i, raw in enumerate([b"[1, 2]", b'{"model": ', b"\xff\xfe"]):
        bad = with_tokenizer(cmf, tmp_path / f"n{i}.cmf", raw)
        _one_line_error(runner.invoke(app, ["generate", str(bad), "hi", "-n", "1"]), "tokenizer.json")


def test_convert_refuses_a_hostile_tokenizer_json(tiny, tmp_path):
    src, _ = tiny
    ck = tmp_path / "ck"
    shutil.copytree(src, ck)
    tok = json.loads((ck / "tokenizer.json").read_text())
    (ck / "tokenizer.json").write_text(json.dumps(_edit(tok, "post_processor", _TEMPLATE)))
    _one_line_error(
        runner.invoke(app, ["convert", str(ck), str(tmp_path / "o.cmf"), "--quant", "q8"]), "which special_tokens lacks"
    )
    assert not (tmp_path / "o.cmf").exists()


def test_lone_surrogates_in_a_prompt_are_replaced(tiny):
    """Bytes that are not UTF-8 in argv reach Python as lone surrogates; the library takes
    only UTF-8 text (a TypeError before)."""
    _, cmf = tiny
    res = runner.invoke(app, ["generate", str(cmf), "caf\udce9 \ud800", "-n", "2"])
    assert res.exit_code == 0 and res.exception is None, res.output


def test_lone_surrogates_through_the_real_cli(tiny):
    _, cmf = tiny
    p = subprocess.run(
        [sys.executable, "-m", "cortiq_cli.main", "generate", str(cmf), b"caf\xe9", "-n", "2"],
        capture_output=True,
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode == 0 and b"Traceback" not in p.stderr, p.stderr[-2000:]


# ------------------------------------------------------------------ 3. chat templates bounded inside one call


def _with_template(cmf: Path, dst: Path, template: str) -> Path:
    from formats.cmf import CmfFile

    with CmfFile(cmf) as f:
        h = json.loads(json.dumps(f.header))
    h["tokenizer"]["chat_template"] = template
    return _cmf_with_header(cmf, dst, json.dumps(h).encode())


_TUPLES = "{% set ns = namespace(t=('a',)) %}{% for i in range(40) %}{% set ns.t = (ns.t, ns.t) %}{% endfor %}"


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ lipsum(10**6) }}", "lipsum paragraphs"),
        ('{{ "x"|center(10**9) }}', "center width"),
        ('{{ "%*s"|format(10**9, "") }}', "'*' width"),
        ('{{ "ab" * 10**9 }}', "repeated string"),
        ("{% for i in range(10**9) %}{% endfor %}", "range() items"),
        ('{{ "x".ljust(10**9) }}', "str.ljust width"),
        ('{{ "{:>999999999}".format(1) }}', "format width"),
        ('{{ "%0999999999d" % 1 }}', "% format width"),
        ('{{ ("x" * 2**20).replace("x", "yy") }}', "str.replace result"),
        ("{{ [1]|batch(10**9, 0)|list }}", "batch size"),
        ('{% set a = "x" * 2**20 %}{{ a ~ a ~ a }}', "concatenation"),
        # a small list of shared references that prints as 4^4 MiB
        (
            '{% set a = ["x" * 2**19] %}{% set b = [a, a, a, a] %}{% set c = [b, b, b, b] %}{{ [c, c, c, c] }}',
            "printed value",
        ),
        # no call at all inside the loops: the loop guard counts iterations
        ('{% set a = "x" * 2**20 %}{% for c in a %}{% for d in a %}{% endfor %}{% endfor %}', "iterations"),
        ("{{ (2**64)**64 }}", "integer power"),
        ('{{ ("<!--" * 200000)|striptags }}', "striptags input"),
        # hashing a tuple of 2^40 shared leaves is one C call: the hard deadline stops it
        (_TUPLES + "{{ {ns.t: 1} }}", "longer than 2 s"),
    ],
    ids=[
        "lipsum",
        "center",
        "printf-star",
        "repeat",
        "range",
        "ljust",
        "format-width",
        "percent-width",
        "replace",
        "batch",
        "concat",
        "shared-refs",
        "loops-without-calls",
        "power",
        "striptags",
        "hash-bomb",
    ],
)
def test_chat_templates_are_bounded_inside_one_call(tiny, tmp_path, template, message):
    """Each is a one-line error within a multiple of a trivial template's time (plus the
    render limit itself)."""
    from cortiq_engine.tokenizer import TEMPLATE_SECONDS

    _, cmf = tiny
    ok = _with_template(cmf, tmp_path / "ok.cmf", "{% for m in messages %}{{ m.content }}{% endfor %}")
    args = ["hi", "--chat", "-n", "1"]
    t0 = time.perf_counter()
    assert runner.invoke(app, ["generate", str(ok), *args]).exit_code == 0
    base = time.perf_counter() - t0
    bad = _with_template(cmf, tmp_path / "t.cmf", template)
    t0 = time.perf_counter()
    err = _one_line_error(runner.invoke(app, ["generate", str(bad), *args]), message)
    assert "chat template of t.cmf" in err
    assert time.perf_counter() - t0 < 5 * base + 2 * TEMPLATE_SECONDS


def test_a_template_render_cannot_grow_this_process(tiny, tmp_path):
    """The render runs in a forked child: whatever it allocates is not this process's."""
    import resource

    _, cmf = tiny
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    bad = _with_template(cmf, tmp_path / "m.cmf", _TUPLES + "{% set s = ns.t|string %}")
    _one_line_error(runner.invoke(app, ["generate", str(bad), "hi", "--chat", "-n", "1"]))
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB


# ------------------------------------------------------------------ 4. only regular files, read or replaced


def _specials(tmp_path: Path) -> dict[str, Path]:
    import socket

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock = tmp_path / "sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(sock))
    s.close()
    out = {"fifo": fifo, "socket": sock, "dev-zero": Path("/dev/zero"), "proc": Path("/proc/self/status")}
    if os.geteuid() == 0:  # a device node of our own (1, 7 is /dev/full): replacing it harms nothing
        node = tmp_path / "full"
        os.mknod(node, 0o666 | __import__("stat").S_IFCHR, os.makedev(1, 7))
        out["device-node"] = node
    return out


def test_special_files_are_refused_as_inputs_at_once(tiny, tmp_path):
    """A FIFO with no writer would block open() and read(); /dev/zero never ends; /proc
    files claim 0 bytes: each is one line, at once."""
    from formats.cref import CrefFile
    from formats.untrusted_json import read_text

    _, cmf = tiny
    base = min(_timed(lambda: runner.invoke(app, ["inspect", str(cmf)])) for _ in range(3))
    for kind, p in _specials(tmp_path).items():
        t0 = time.perf_counter()
        err = _one_line_error(runner.invoke(app, ["inspect", str(p)]))
        assert "regular file" in err or "pseudo-file" in err, (kind, err)
        for fn in (read_text, CrefFile):
            with pytest.raises(CortiqError, match="regular|pseudo-file"):
                fn(p)
        assert time.perf_counter() - t0 < 20 * base + 1.0, kind


def test_force_replaces_only_regular_files(tiny, tmp_path):
    """``--force`` onto a FIFO, socket or device node is refused and leaves it as it was
    (as root, renaming over /dev/full would replace the device node)."""
    import stat as st

    src, cmf = tiny
    for kind, p in _specials(tmp_path).items():
        if kind in ("dev-zero", "proc"):
            continue  # system files: never a test's output
        mode = os.lstat(p).st_mode
        err = _one_line_error(runner.invoke(app, ["convert", str(src), str(p), "--quant", "q8", "--force"]))
        assert "replaces only regular files" in err, err
        assert os.lstat(p).st_mode == mode and not st.S_ISREG(mode), kind
        assert not [q for q in tmp_path.iterdir() if q.name.endswith(".tmp")]
    from formats.imatrix import write_imatrix

    with pytest.raises(CortiqError, match="replaces only regular files"):
        write_imatrix(tmp_path / "fifo", {"w": np.ones(2, np.float32)}, 1)
    # a regular file is still replaced
    out = tmp_path / "o.cmf"
    out.write_bytes(b"old")
    res = runner.invoke(app, ["convert", str(src), str(out), "--quant", "q8", "--force"])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"CORTIQMF"


# ------------------------------------------------------------------ 6. mmap writers reserve their blocks

_FULL_DISK = r"""
import sys
import numpy as np
from formats.cref import CrefWriter
from formats.errors import CortiqError

out = sys.argv[1]
rows, vocab = 1000, 1000
try:
    with CrefWriter(out, rows=rows, vocab=vocab, top_k=0, tokens=np.zeros(rows + 1, np.int32),
                    windows=np.array([[0, rows + 1, 0, rows, -1]], np.int64), meta={}) as w:
        w.write_rows(0, {"nll": np.zeros(rows), "top1": np.zeros(rows, np.int32),
                         "logp": np.full((rows, vocab), -1.0, np.float32)})
except CortiqError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
"""


def _limit_file_size() -> None:
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))


def test_a_full_disk_under_a_mapped_writer_is_one_line(tmp_path):
    """The .cref writer stores its rows through a memory map of a sparse file: on a full
    disk that was a SIGBUS at the first page stored. Its blocks are reserved first, so the
    disk fills at one call that fails cleanly, and the staging file is removed. As root a
    256 KiB tmpfs is the full disk; otherwise a file-size limit stands in."""
    import subprocess as sp

    folder, mounted = tmp_path / "disk", False
    folder.mkdir()
    if os.geteuid() == 0:
        mounted = (
            sp.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(folder)], capture_output=True).returncode
            == 0
        )
    try:
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        p = sp.run(
            [sys.executable, "-c", _FULL_DISK, str(folder / "r.cref")],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=None if mounted else _limit_file_size,
        )
        assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert len(lines) == 1 and "cannot reserve" in lines[0], p.stderr
        assert list(folder.iterdir()) == []
    finally:
        if mounted:
            sp.run(["umount", str(folder)], check=True)


# ------------------------------------------------------------------ 5. non-finite weights


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_check_finite_names_the_first_bad_weight(bad):
    from formats.finite import check_finite, check_finite_parts
    from formats.quants import get_dtype

    x = np.ones((4, 8), np.float32)
    check_finite("w", x)  # finite: quiet
    big = np.full((4, 8), np.finfo(np.float32).max, np.float32)
    check_finite("w", big)  # large but finite (a sum or a dot product of these overflows)
    x[2, 5] = bad
    with pytest.raises(CortiqError, match=rf"tensor w holds {bad} at row 12, column 5"):
        check_finite("w", x, first_row=10)
    with pytest.raises(CortiqError, match="row 0, column 3"):
        check_finite("v", np.array([1, 2, 3, bad], np.float16))
    parts = get_dtype("q8").encode(np.ones((4, 64), np.float32))
    named = dict(zip([sp.name for sp in get_dtype("q8").parts((4, 64))], parts))
    check_finite_parts("w", named)
    scales = next(k for k, v in named.items() if np.issubdtype(np.asarray(v).dtype, np.floating))
    named[scales] = np.array(named[scales], copy=True)
    named[scales].reshape(-1)[1] = bad
    with pytest.raises(CortiqError, match=rf"tensor w \({scales}\) holds"):
        check_finite_parts("w", named)
    check_finite("ids", np.array([1, 2], np.int32))  # integer tensors hold no NaN


# ------------------------------------------------------------------ 7. data sets never run code


def test_a_dataset_folder_with_a_loading_script_is_refused(tiny, tmp_path):
    """datasets >= 4 runs no loading scripts (pyproject requires it): a folder whose script
    would write a file is one line, and the file is never written."""
    import datasets

    assert int(datasets.__version__.split(".")[0]) >= 4
    _, cmf = tiny
    folder = tmp_path / "evil"
    folder.mkdir()
    sentinel = tmp_path / "ran"
    (folder / "evil.py").write_text(
        "import pathlib, datasets\n"
        f"pathlib.Path({str(sentinel)!r}).write_text('ran')\n"
        "class Evil(datasets.GeneratorBasedBuilder):\n"
        "    def _info(self): return datasets.DatasetInfo(features=datasets.Features({'text': datasets.Value('string')}))\n"
        "    def _split_generators(self, dl): return [datasets.SplitGenerator(name='train')]\n"
        "    def _generate_examples(self): yield 0, {'text': 'hello ' * 50}\n"
    )
    err = _one_line_error(runner.invoke(app, ["ppl", str(cmf), "--dataset", str(folder), "--split", "train"]))
    assert "script" in err, err
    assert not sentinel.exists()


# ------------------------------------------------------------------ 8. resealing fuzz, CI-sized


def test_resealed_fuzz_ci(tmp_path):
    """A fixed-seed corpus of resealed mutants (every checksum recomputed: header fields
    retyped, tokenizer.json mutated, hostile chat templates, tensor bytes, chat session
    files) through the real CLI in worker processes under a 4 GB address-space cap: no
    traceback, signal, hang or memory blow-up. The long run is the same tool with
    ``--cases 3000``."""
    out = tmp_path / "fuzz.json"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "fuzz_cli.py"),
            "--resealed",
            "--seed",
            "31",
            "--cases",
            "400",
            "--seconds",
            "20",
            "--exec-every",
            "0",
            "--timeout",
            "60",
            "--mem-gb",
            "4",
            "--json",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.exists(), p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["totals"] == {"traceback": 0, "crash": 0, "hang": 0, "memory": 0}, p.stdout[-3000:]
    assert r["violations"] == [], r["violations"][:20]
    assert p.returncode == 0, p.stdout[-3000:]
    # not vacuous: the corpus reached several kinds, and both outcomes
    assert len(r["kinds"]) >= 5 and r["cases"] >= 20, r["kinds"]
    rows = r["table"]
    assert rows["inspect"]["ok"] > 0 and sum(x["clean"] for x in rows.values()) > 0


def test_lone_surrogates_in_a_template_and_a_chat_file(tiny, tmp_path):
    _, cmf = tiny
    m = _with_template(cmf, tmp_path / "s.cmf", "{% for m in messages %}{{ m.content }}\ud800{% endfor %}")
    res = runner.invoke(app, ["generate", str(m), "hi \udcff", "--chat", "-n", "1"])
    assert res.exit_code == 0 and res.exception is None, res.output
    session = tmp_path / "s.json"
    session.write_bytes(b'[{"role": "user", "content": "caf\\udce9 \\ud800"}]')
    res = runner.invoke(app, ["chat", str(m), "--load", str(session), "-n", "1"], input="hi\n")
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output


def test_templates_render_under_an_address_space_cap(tiny):
    """The render child lowers its limits below those in force (it may not raise a hard
    limit): under a 4 GB cap a template still renders."""
    _, cmf = tiny
    code = (
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
        "from cortiq_engine.tokenizer import render_template, TemplateLimits\n"
        "print(render_template('{{ 6 * 7 }}', TemplateLimits()))\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "42", p.stderr[-2000:]
