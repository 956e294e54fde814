"""``cortiq ppl --cluster``: a real Ray cluster of two workers gives the one-process
figures bit for bit (perplexity, NLL and its SE, bits per byte, every KL statistic and
percentile, live or against a saved reference), also when a worker process is killed
mid-run and when the driver is interrupted and resumed; ``cortiq calibrate``,
``imatrix``, ``mtp-probe`` and ``quant-sweep`` on the cluster give their one-process
results (less per-machine timings).

Most runs join one cluster of 2 CPUs that the module starts once (``--cluster HOST:PORT``,
one worker per CPU at ``-t 1``); the killed-worker run starts its own (``local:2``), whose
worker processes are the driver's children. The runs that ``test_cluster_nodes`` repeats on
a multi-node cluster (ppl, calibrate and imatrix bit for bit) are marked slow here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from evals.cluster import ClusterAddress, ModelFingerprint, WindowJournal
from evals.text_source import BUNDLED_TEXT
from formats.errors import CortiqError

REPO = Path(__file__).resolve().parents[1]
TEXT = BUNDLED_TEXT.read_text(encoding="utf-8")
runner = CliRunner()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama (byte tokenizer) as f32 and q8 CMF files, and a text of ~300 windows."""
    from cortiq_engine.convert import convert_checkpoint
    from tests.tiny import save_tiny

    d = tmp_path_factory.mktemp("cluster")
    hf = save_tiny("llama", d / "hf", max_position_embeddings=512)
    out = {}
    for q in ("f32", "q8"):
        out[q] = d / f"tiny-{q}.cmf"
        convert_checkpoint(hf, out[q], quant=q)
    text = d / "t.txt"
    text.write_text(TEXT[:4800], encoding="utf-8")
    return out["f32"], out["q8"], text


_HEAD = """
import sys, ray
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=40)  # a new one, never one running here
print("GCS", ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()  # until the tests close it
ray.shutdown()
"""


@pytest.fixture(scope="module")
def head():
    """The address of a Ray cluster of 2 CPUs on this machine, shared by the module's runs."""
    p = subprocess.Popen(
        [sys.executable, "-c", _HEAD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_env(None),
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        line = ""
        while not line.startswith("GCS "):
            line = p.stdout.readline()
            assert line, "the Ray head ended before giving its address"
        yield line.split()[1]
    finally:
        p.stdin.close()
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # its own session: the head and the processes it started
            p.wait()


def _env(cache: Path | None) -> dict[str, str]:
    """The runs' environment: this checkout first on the path, the journal under ``cache``, and
    Ray's token authentication off (Ray's documented opt-out; every run is on this machine)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", RAY_AUTH_MODE="disabled")
    if cache is not None:
        env["CORTIQ_CLUSTER_CACHE"] = str(cache)
    return env


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a backgrounded run inherits SIGINT ignored


def _start(args: list[str], cache: Path) -> subprocess.Popen:
    env = _env(cache)
    return subprocess.Popen(
        [sys.executable, "-m", "cortiq_cli.main", "ppl", *args, "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


def _finish(p: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    return p.returncode, out, err


def _ppl(args: list[str], cache: Path) -> dict:
    code, out, err = _finish(_start(args, cache))
    assert code == 0, err
    return json.loads(out)


def _in_process(args: list[str]) -> dict:
    """A run without --cluster, in this process (no interpreter to start)."""
    r = runner.invoke(app, ["ppl", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _args(tiny, *extra: str) -> list[str]:
    f32, q8, text = tiny
    return [
        str(f32),
        str(q8),
        "--text",
        str(text),
        "--mode",
        "sliding",
        "-c",
        "32",
        "--stride",
        "16",
        "-t",
        "1",
        *extra,
    ]


def _records(cache: Path) -> int:
    """Windows journaled so far (0 before the journal exists)."""
    files = list(cache.glob("ppl-*.journal"))
    if not files:
        return 0
    key = files[0].name[len("ppl-") : -len(".journal")]
    return len(WindowJournal(files[0], key).load())


def _wait_for(cache: Path, p: subprocess.Popen, windows: int) -> None:
    deadline = time.monotonic() + 120
    while _records(cache) < windows:
        assert p.poll() is None, "the run ended before the test could act on it"
        assert time.monotonic() < deadline
        time.sleep(0.02)


def _same_figures(got: dict, want: dict) -> dict:
    """``got`` equals ``want`` exactly, apart from its cluster report (returned)."""
    cluster = got["settings"].pop("cluster")
    assert got == want  # every float compared exactly, as JSON prints them (repr: round-trips bit for bit)
    return cluster


@pytest.fixture(scope="module")
def one_process(tiny):
    return _in_process(_args(tiny))


@pytest.mark.slow  # test_cluster_nodes covers it in the normal suite
def test_two_workers_give_the_one_process_figures_bit_for_bit(tiny, one_process, head, tmp_path):
    assert one_process["settings"]["windows"] >= 250 and one_process["comparisons"][0]["kl_mean"] > 0
    got = _ppl(_args(tiny, "--cluster", head), tmp_path)
    cluster = _same_figures(got, one_process)
    assert cluster["workers"] == 2 and cluster["address"] == head
    assert cluster["tasks"] == one_process["settings"]["windows"] and cluster["retried"] == 0
    assert cluster["tokens_per_s"] > 0
    assert not list(tmp_path.glob("*.journal"))  # a finished run leaves no journal


def test_a_killed_worker_costs_only_its_windows(tiny, tmp_path):
    """Against a saved reference (its rows go out with each window), a worker process killed mid-run."""
    f32, q8, text = tiny
    ref = tmp_path / "f32.cref"
    _in_process(
        [
            str(f32),
            "--text",
            str(text),
            "--mode",
            "sliding",
            "-c",
            "32",
            "--stride",
            "16",
            "-t",
            "1",
            "--save-ref",
            str(ref),
        ]
    )
    args = [str(q8), "--ref", str(ref), "--text", str(text), "-t", "1"]
    alone = _in_process(args)
    assert alone["comparisons"][0]["reference_form"] != "full" and alone["comparisons"][0]["kl_mean"] > 0
    p = _start([*args, "--cluster", "local:2"], tmp_path)
    _wait_for(tmp_path, p, 3)
    workers = [c for c in psutil.Process(p.pid).children(recursive=True) if "WindowScorer" in " ".join(c.cmdline())]
    assert workers, "no worker process found under the run"
    os.kill(workers[0].pid, signal.SIGKILL)
    code, out, err = _finish(p)
    assert code == 0, err
    cluster = _same_figures(json.loads(out), alone)
    assert cluster["retried"] >= 1 and cluster["tasks"] == alone["settings"]["windows"] + cluster["retried"]


def test_an_interrupted_driver_resumes_to_the_same_figures(tiny, one_process, head, tmp_path):
    p = _start(_args(tiny, "--cluster", head), tmp_path)
    _wait_for(tmp_path, p, 5)
    p.send_signal(signal.SIGINT)
    code, out, err = _finish(p)
    assert code == 130, (out, err)
    kept = _records(tmp_path)
    assert kept >= 5 and "--resume" in err, (kept, err)
    partial = json.loads(out)
    assert partial["settings"].get("partial") and partial["settings"]["windows_done"] <= kept, (
        partial["settings"],
        kept,
        err,
    )
    got = _ppl(_args(tiny, "--cluster", head, "--resume"), tmp_path)
    cluster = _same_figures(got, one_process)
    assert cluster["resumed"] == kept and cluster["tasks"] == one_process["settings"]["windows"] - kept


@pytest.mark.slow  # test_cluster_nodes covers it in the normal suite
def test_calibrate_on_two_workers_gives_the_same_report(tiny, head, tmp_path):
    f32, _, text = tiny
    args = [
        "calibrate",
        str(f32),
        "--text",
        str(text),
        "--mode",
        "sliding",
        "-c",
        "32",
        "--stride",
        "16",
        "-t",
        "1",
        "--json",
    ]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    alone = json.loads(r.stdout)
    env = _env(tmp_path)
    p = subprocess.Popen(
        [sys.executable, "-m", "cortiq_cli.main", *args, "--cluster", head],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    code, out, err = _finish(p)
    assert code == 0, err
    cluster = _same_figures(json.loads(out), alone)
    assert cluster["workers"] == 2 and cluster["tasks"] == alone["settings"]["windows"]


def test_cluster_input_errors(tiny, tmp_path):
    f32, _, text = tiny
    for args, msg in (
        (["--cluster", "local:0"], "worker count"),
        (["--cluster", "nowhere"], "give local:N"),
        (["--resume"], "give --cluster too"),
        (["--cluster", "local:1", "--save-ref", str(tmp_path / "r.cref")], "without --cluster"),
    ):
        r = runner.invoke(app, ["ppl", str(f32), "--text", str(text), "-c", "32", *args, "--json"])
        assert r.exit_code == 2 and r.stdout == "" and msg in r.stderr and "Traceback" not in r.stderr, (args, r.output)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_fingerprint_and_journal(tiny, tmp_path):
    f32, q8, _ = tiny
    assert ModelFingerprint.of(f32) == ModelFingerprint.of(f32) != ModelFingerprint.of(q8)
    with pytest.raises(CortiqError, match="not the driver's file"):
        ModelFingerprint.of(f32).check(q8, "here")
    assert (
        ClusterAddress.parse("ray://head:10001").address == "ray://head:10001"
        and ClusterAddress.parse("local:3").local_workers == 3
    )
    import numpy as np

    j = WindowJournal(tmp_path / "x.journal", "k1")
    j.open(keep=False)
    parts = {i: {"nll0": np.arange(3.0) + i, "same1": np.array([True, False, True])} for i in range(3)}
    for i, arrays in parts.items():
        j.append(i, arrays)
    j.close()
    with open(j.path, "ab") as f:
        f.write(b"\x05\x00")  # a record cut short by a crash
    back = WindowJournal(j.path, "k1").load()
    assert sorted(back) == [0, 1, 2] and np.array_equal(back[2]["nll0"], parts[2]["nll0"])
    assert np.array_equal(back[1]["same1"], parts[1]["same1"]) and back[1]["same1"].dtype == bool
    assert WindowJournal(j.path, "another run").load() == {}


def _cli(args: list[str], cache: Path) -> dict:
    """``cortiq ARGS --json`` in a fresh interpreter (a cluster run starts Ray there)."""
    env = _env(cache)
    p = subprocess.Popen(
        [sys.executable, "-m", "cortiq_cli.main", *args, "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )
    code, out, err = _finish(p)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow  # test_cluster_nodes covers it in the normal suite
def test_imatrix_on_two_workers_writes_the_one_process_file(tiny, head, tmp_path):
    f32, _, text = tiny
    args = ["imatrix", str(f32), "--text", str(text), "-c", "32", "--max-tokens", "1200", "-t", "1", "--force"]
    alone = tmp_path / "alone.safetensors"
    r = runner.invoke(app, [*args, "-o", str(alone), "--json"])
    assert r.exit_code == 0, r.output
    got = _cli([*args, "-o", str(tmp_path / "cluster.safetensors"), "--cluster", head], tmp_path)
    assert (tmp_path / "cluster.safetensors").read_bytes() == alone.read_bytes()  # every f32 mean, bit for bit
    assert got["tokens"] == json.loads(r.stdout)["tokens"] > 0
    assert got["cluster"]["workers"] == 2 and got["cluster"]["tasks"] >= 2 and got["cluster"]["retried"] == 0
    assert not list(tmp_path.glob("*.journal"))


def test_imatrix_window_sums_stay_within_f32_rounding_of_running_sums(tiny):
    """Per-window f64 sums added in window order against one running sum over every matmul:
    the saved f32 means differ by at most one unit in the last place."""
    import numpy as np

    from cortiq_engine.imatrix import collect_imatrix, open_recording, run_window

    f32, _, text = tiny
    ids = list(text.read_bytes()[:400])
    windows = [ids[s : s + 40] for s in range(0, len(ids), 40)]
    trunk = open_recording(f32, threads=1)
    try:
        for w in windows:
            run_window(trunk.model, w)  # never taken: the recorder's sums run over all windows
        running = trunk.model.kernels.means()
    finally:
        trunk.cmf.close()
    means, tokens = collect_imatrix(f32, windows, threads=1)
    assert tokens == len(ids) and sorted(means) == sorted(running)
    for name, v in means.items():
        np.testing.assert_array_max_ulp(v, running[name], maxulp=1)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """A tiny model with two random MTP draft layers (inline), q8."""
    from cortiq_engine.convert import convert_checkpoint
    from tests.mtp_tiny import save_tiny_mtp

    d = tmp_path_factory.mktemp("mtp")
    path = d / "mtp.cmf"
    convert_checkpoint(save_tiny_mtp("mimo", d / "src", n_layers=2), path, quant="q8")
    return path


def _without_timing(doc: dict) -> dict:
    """The probe's figures less its per-machine timing (the draft milliseconds) and the cluster report."""
    doc.pop("cluster", None)
    for v in doc["variants"]:
        v.pop("draft_ms_per_round")
    return doc


def test_mtp_probe_on_two_workers_gives_the_same_counts(mtp_model, tiny, head, tmp_path):
    _, _, text = tiny
    args = ["mtp-probe", str(mtp_model), "--text", str(text), "--max-tokens", "100", "--mtp-hidden", "pre", "-t", "1"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    alone = json.loads(r.stdout)
    got = _cli([*args, "--cluster", head], tmp_path)
    cluster = got["cluster"]
    assert _without_timing(got) == _without_timing(alone)
    assert len(alone["variants"]) == 2 and all(v["drafting_rounds"] == 100 - 2 - 1 for v in alone["variants"])
    assert cluster["workers"] == 2 and cluster["tasks"] == 4 and cluster["retried"] == 0  # 97 rounds in windows of 32


def test_probe_windows_replay_the_one_pass(mtp_model):
    """Windows of rounds, each replaying the draft layers' rows before it, give the one
    pass's counts and every draft's probability bit for bit (the cluster's unit of work)."""
    import numpy as np

    from cortiq_engine import Engine
    from cortiq_engine.acceptance import Acceptance
    from evals.mtp_probe import backbone_hiddens, default_variants, probe, probe_window, round_windows

    eng = Engine.load(mtp_model, threads=1, mtp=True)
    ids = [int(x) for x in np.random.default_rng(3).integers(0, 256, 60)]
    variants, head, traces = default_variants(2, 2), eng.draft_head(None), []
    one = probe(eng.model, eng.drafts, ids, 2, variants, head=head, traces=traces)
    hidden = backbone_hiddens(eng.model, np.asarray(ids))
    parts = [
        probe_window(eng.model, eng.drafts, ids, hidden, 2, variants, a, b, head=head, trace=True)
        for a, b in round_windows(len(ids), 2, 16)
    ]
    for i, (_, counts) in enumerate(one):
        merged = Acceptance(2)
        for p in parts:
            merged.merge(p.counts[i])
        assert (merged.drafted, merged.right, merged.accept_hist) == (counts.drafted, counts.right, counts.accept_hist)
        assert np.array_equal(np.concatenate([p.traces[i].probs for p in parts]), traces[i].probs)


def test_quant_sweep_on_two_workers_gives_the_same_rows(tiny, head, tmp_path):
    """Each type scored against the saved f32 reference on the cluster: every figure of its row
    but the timings (conversion, decode) equals the one-process sweep's."""
    f32, _, text = tiny
    hf = f32.parent / "hf"
    args = [
        "quant-sweep",
        str(hf),
        "--types",
        "q4_0",
        "--text",
        str(text),
        "-c",
        "32",
        "--max-tokens",
        "640",
        "-t",
        "1",
        "--decode-tokens",
        "2",
        "--decode-reps",
        "1",
    ]
    # Both in fresh interpreters: the f32 reference pass's BLAS and numba pools start alike
    # (in this process earlier tests leave them set otherwise, which moves f32 sums).
    alone = _cli(args, tmp_path)
    got = _cli([*args, "--cluster", head], tmp_path)
    reports = got["settings"].pop("cluster")
    for doc in (alone, got):
        for row in doc["types"]:
            for k in ("convert_seconds", "decode_tok_s", "decode_tok_s_samples"):
                row.pop(k)
    assert got == alone and [t["type"] for t in got["types"]] == ["q4_0"] and alone["types"][0]["kl_mean"] > 0
    assert reports["q4_0"]["workers"] == 2 and reports["q4_0"]["tasks"] == alone["windows"]


def test_the_other_commands_check_their_cluster_options(tiny, mtp_model, tmp_path):
    f32, _, text = tiny
    for cmd in (
        ["imatrix", str(f32), "-o", str(tmp_path / "m.safetensors")],
        ["mtp-probe", str(mtp_model)],
        ["quant-sweep", str(f32.parent / "hf"), "--types", "q4_0"],
    ):
        for args, msg in ((["--resume"], "give --cluster too"), (["--cluster", "local:0"], "worker count")):
            r = runner.invoke(app, [*cmd, "--text", str(text), *args, "--json"])
            assert r.exit_code == 2 and r.stdout == "" and msg in r.stderr and "Traceback" not in r.stderr, (
                cmd,
                args,
                r.output,
            )
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = runner.invoke(
        app, ["quant-sweep", str(f32.parent / "hf"), "--text", str(text), "--cluster", "local:2", "--resume", "--json"]
    )
    assert r.exit_code == 2 and "needs the --workdir" in r.stderr, (
        r.output
    )  # a run is journaled by its saved reference's path
