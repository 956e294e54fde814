"""The cluster commands on a multi-node Ray cluster made with Ray's own test tool
(``ray.cluster_utils.Cluster``: a head node and a worker node of one CPU each, every
node its own raylet and object store, on this machine). The real CLI joins
it by its address (``--cluster HOST:PORT``, or ``auto`` with ``RAY_ADDRESS``) and its
figures are the one-process figures bit for bit: ppl here, calibrate and imatrix under
faults (a driver killed outright, then ``--resume`` with a worker process killed
mid-run); mtp-probe, quant-sweep, the same faults for ppl and mtp-probe, and a Ray Client
(``ray://``) run are marked slow.

The one-process figures come from this process (typer's runner); every cluster run is a
fresh ``cortiq`` interpreter, as a user runs it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from cortiq_cli.main import app
from evals.cluster import AHEAD_PER_WORKER, IN_FLIGHT, PlanOrder, WindowJournal
from evals.text_source import BUNDLED_TEXT

REPO = Path(__file__).resolve().parents[1]
TEXT = BUNDLED_TEXT.read_text(encoding="utf-8")
runner = CliRunner()
HELD_BOUND = (AHEAD_PER_WORKER + IN_FLIGHT) * 2  # results the driver of two workers may hold at once

# A head and worker nodes of one CPU each: one worker per node at -t 1, so the windows are
# scored on two raylets with two object stores (a head without CPUs would cost a third
# raylet and its agents on this 2-core machine, and test no more).
_NODES = """
import json, sys
from ray.cluster_utils import Cluster
spec = json.loads(sys.argv[1])
store = 80 * 1024 * 1024
head = dict(num_cpus=1, object_store_memory=store, include_dashboard=False, **spec["head"])
cluster = Cluster(initialize_head=True, head_node_args=head)
for _ in range(spec["nodes"]):
    cluster.add_node(num_cpus=1, object_store_memory=store)
cluster.wait_for_nodes()
print("ADDRESS", cluster.address, flush=True)
sys.stdin.read()  # until the tests close it
cluster.shutdown()
"""


def _env(cache: Path | None = None, **extra: str) -> dict[str, str]:
    """This checkout first on the path, the journal under ``cache``, Ray's token
    authentication off (Ray's documented opt-out; every node is on this machine)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    if cache is not None:
        env["CORTIQ_CLUSTER_CACHE"] = str(cache)
    env.update(extra)
    return env


class Nodes:
    """A running ``cluster_utils.Cluster`` in a child process (a head and ``nodes`` more
    nodes; ``head``: the head's further node arguments): its address and process."""

    def __init__(self, nodes: int, head: dict | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _NODES, json.dumps({"nodes": nodes, "head": head or {}})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=_env(),
            text=True,
            start_new_session=True,
        )
        line = ""
        while not line.startswith("ADDRESS "):
            line = self.proc.stdout.readline()
            if not line:
                self.close()
                raise AssertionError("the Ray cluster ended before giving its address")
        self.address = line.split()[1]

    def workers(self, since: float) -> list[psutil.Process]:
        """The WindowScorer processes on the nodes started at ``since`` or later."""
        out = []
        for c in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if "WindowScorer" in " ".join(c.cmdline()) and c.create_time() >= since:
                    out.append(c)
            except psutil.NoSuchProcess:
                pass
        return out

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: the nodes and their workers
            self.proc.wait()


@pytest.fixture(scope="module")
def nodes():
    n = Nodes(1)
    try:
        yield n
    finally:
        n.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama (byte tokenizer) as f32 and q8 CMF files, its HF folder, and a text of ~150 chunks of 32."""
    from cortiq_engine.convert import convert_checkpoint
    from tests.tiny import save_tiny

    d = tmp_path_factory.mktemp("nodes")
    hf = save_tiny("llama", d / "hf", max_position_embeddings=512)
    out = {}
    for q in ("f32", "q8"):
        out[q] = d / f"tiny-{q}.cmf"
        convert_checkpoint(hf, out[q], quant=q)
    text = d / "t.txt"
    text.write_text(TEXT[:4800], encoding="utf-8")
    return {"f32": out["f32"], "q8": out["q8"], "hf": hf, "text": text}


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a backgrounded run inherits SIGINT ignored


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cortiq_cli.main", *args, "--json"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,
    )


def _finish(p: subprocess.Popen) -> dict:
    try:
        out, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise
    assert p.returncode == 0, err
    return json.loads(out)


def _alone(args: list[str]) -> dict:
    """The run without --cluster, in this process."""
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def _records(cache: Path, kind: str) -> int:
    """Windows journaled so far by the run of ``kind`` (0 before its journal exists)."""
    files = list(cache.glob(f"{kind}-*.journal"))
    if not files:
        return 0
    key = files[0].name[len(kind) + 1 : -len(".journal")]
    return len(WindowJournal(files[0], key).index())


def _wait_for(cache: Path, kind: str, p: subprocess.Popen, windows: int) -> None:
    deadline = time.monotonic() + 180
    while _records(cache, kind) < windows:
        assert p.poll() is None, f"the run ended before the test could act on it: {p.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline
        time.sleep(0.02)


# ---------------------------------------------------------------------------- the commands

# Each command: its arguments (a list of them for the cluster runs and the one-process run),
# its journal's name, and how its figures are read from its JSON and its files.


def _ppl(t: dict, out: Path) -> list[str]:
    return [
        "ppl",
        str(t["f32"]),
        str(t["q8"]),
        "--text",
        str(t["text"]),
        "--mode",
        "sliding",
        "-c",
        "32",
        "--stride",
        "16",
        "-t",
        "1",
    ]


def _calibrate(t: dict, out: Path) -> list[str]:
    return ["calibrate", str(t["f32"]), "--text", str(t["text"]), "--mode", "sliding", "-c", "32", "--stride", "16"] + [
        "-t",
        "1",
    ]


def _imatrix(t: dict, out: Path) -> list[str]:
    return ["imatrix", str(t["f32"]), "--text", str(t["text"]), "-c", "32", "-t", "1", "--force", "-o", str(out)]


def _mtp(t: dict, out: Path) -> list[str]:
    return ["mtp-probe", str(t["mtp"]), "--text", str(t["text"]), "--max-tokens", "1200", "--mtp-hidden", "pre"] + [
        "-t",
        "1",
    ]


COMMANDS = {"ppl": _ppl, "calibrate": _calibrate, "imatrix": _imatrix, "mtp-probe": _mtp}


def _figures(kind: str, doc: dict, out: Path) -> tuple[dict, dict | None]:
    """(what must be bit-identical, the cluster report) of one run's JSON and file."""
    if kind in ("ppl", "calibrate"):
        cluster = doc["settings"].pop("cluster", None)
        return doc, cluster
    cluster = doc.pop("cluster", None)
    if kind == "imatrix":
        doc.pop("output")
        return {"json": doc, "file": out.read_bytes()}, cluster  # every f32 mean, bit for bit
    for v in doc["variants"]:
        v.pop("draft_ms_per_round")  # timed, per machine
    return doc, cluster


def _windows(kind: str, alone: dict) -> int:
    if kind == "imatrix":
        return -(-alone["json"]["tokens"] // 32)  # chunks of 32
    if kind == "mtp-probe":
        return -(-alone["variants"][0]["drafting_rounds"] // 32)  # windows of 32 rounds
    return alone["settings"]["windows"]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    """A tiny model with two random MTP draft layers (inline), q8."""
    from cortiq_engine.convert import convert_checkpoint
    from tests.mtp_tiny import save_tiny_mtp

    d = tmp_path_factory.mktemp("nodes-mtp")
    path = d / "mtp.cmf"
    convert_checkpoint(save_tiny_mtp("mimo", d / "src", n_layers=2), path, quant="q8")
    return path


# ---------------------------------------------------------------------------- bit-identity


def test_plan_order_combines_in_window_order_holding_only_early_results():
    """Results in any order, journaled ones read when their turn comes: combined 0, 1, 2...,
    and only results ahead of a missing window held."""
    got, reads = [], []

    def read(i: int, at: str) -> str:
        reads.append(i)
        return at

    order = PlanOrder(7, got.append, journaled={1: "j1", 5: "j5"}, read=read)
    order.advance()
    assert got == [] and reads == [] and order.n_finished == 2
    for i, expect_held, expect_got in (
        (3, 1, []),
        (0, 1, ["r0", "j1"]),  # 1 read from the journal now, not before
        (2, 0, ["r0", "j1", "r2", "r3"]),
        (6, 1, ["r0", "j1", "r2", "r3"]),
        (4, 0, ["r0", "j1", "r2", "r3", "r4", "j5", "r6"]),
    ):
        order.add(i, f"r{i}")
        assert (order.held, got) == (expect_held, expect_got), i
    assert reads == [1, 5] and order.combined == 7 and order.held_max == 2
    with pytest.raises(ValueError):
        order.add(4, "again")


def test_the_report_line_names_workers_nodes_and_hosts(capsys):
    from cortiq_cli.cluster_options import render_report
    from evals.cluster import ClusterReport

    render_report(
        ClusterReport(
            "10.1.2.3:6379", 2, tasks=301, retried=1, resumed=4, tokens=900, seconds=2.0, hosts=["a", "a"], nodes=2
        )
    )
    render_report(ClusterReport("local:1", 1, tasks=3, tokens=10, seconds=1.0, hosts=["a"], nodes=1))
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "cluster 10.1.2.3:6379: 2 workers on 2 nodes (1 host), 301 windows handed out "
        "(1 again after a lost worker, 4 from the journal), 450 tokens/s",
        "cluster local:1: 1 worker on 1 node (1 host), 3 windows handed out "
        "(0 again after a lost worker, 0 from the journal), 10 tokens/s",
    ], out


def test_ppl_on_two_nodes(tiny, nodes, tmp_path):
    """ppl with two models (every KL statistic), joined by HOST:PORT, one worker on each
    node: the one-process figures bit for bit."""
    want, _ = _figures("ppl", _alone(_ppl(tiny, tmp_path)), tmp_path)
    assert want["settings"]["windows"] >= 250 and want["comparisons"][0]["kl_mean"] > 0
    doc = _finish(_start([*_ppl(tiny, tmp_path), "--cluster", nodes.address], _env(tmp_path)))
    got, cluster = _figures("ppl", doc, tmp_path)
    assert got == want  # every float as JSON prints it (repr: round-trips bit for bit)
    assert cluster["workers"] == 2 and cluster["nodes"] == 2 and cluster["address"] == nodes.address, cluster
    assert cluster["tasks"] == want["settings"]["windows"] and cluster["retried"] == 0
    assert 1 <= cluster["held_max"] <= HELD_BOUND, cluster
    assert not list(tmp_path.glob("*.journal"))  # a finished run leaves no journal


@pytest.mark.slow
def test_mtp_probe_on_two_nodes(tiny, mtp_model, nodes, tmp_path):
    t = dict(tiny, mtp=mtp_model)
    want, _ = _figures("mtp-probe", _alone(_mtp(t, tmp_path)), tmp_path)
    got, cluster = _figures(
        "mtp-probe", _finish(_start([*_mtp(t, tmp_path), "--cluster", nodes.address], _env(tmp_path))), tmp_path
    )
    assert got == want and len(want["variants"]) == 2
    assert cluster["workers"] == 2 and cluster["nodes"] == 2 and cluster["tasks"] == _windows("mtp-probe", want)


@pytest.mark.slow
def test_quant_sweep_on_two_nodes(tiny, nodes, tmp_path):
    """Each type's rows against the saved f32 reference: every figure but the timings."""
    args = ["quant-sweep", str(tiny["hf"]), "--types", "q4_0,q8_0", "--text", str(tiny["text"]), "-c", "32"]
    args += ["--max-tokens", "640", "-t", "1", "--decode-tokens", "2", "--decode-reps", "1"]
    # Both in fresh interpreters: the f32 reference pass's thread pools start alike.
    want = _finish(_start(args, _env(tmp_path)))
    got = _finish(_start([*args, "--cluster", nodes.address], _env(tmp_path)))
    reports = got["settings"].pop("cluster")
    for doc in (want, got):
        for row in doc["types"]:
            for k in ("convert_seconds", "decode_tok_s", "decode_tok_s_samples"):
                row.pop(k)
    assert got == want and len(got["types"]) == 2 and all(r["kl_mean"] > 0 for r in got["types"])
    assert all(r["nodes"] == 2 and r["tasks"] == want["windows"] for r in reports.values()), reports


# ---------------------------------------------------------------------------- faults


def _crash_resume_kill(kind: str, args: list[str], nodes: Nodes, cache: Path) -> tuple[int, dict]:
    """The driver (joined by HOST:PORT) killed outright (SIGKILL) after some windows; then
    ``--resume`` (joined by ``auto``, Ray's RAY_ADDRESS naming the cluster), with a worker
    process killed mid-run. (Windows the crashed run journaled, the resumed run's JSON.)"""
    crashed = _start([*args, "--cluster", nodes.address], _env(cache))
    _wait_for(cache, kind, crashed, 12)
    crashed.kill()
    crashed.communicate()
    kept = _records(cache, kind)
    since = time.time()
    resumed = _start([*args, "--cluster", "auto", "--resume"], _env(cache, RAY_ADDRESS=nodes.address))
    _wait_for(cache, kind, resumed, kept + 3)
    workers = nodes.workers(since)
    assert workers, "no worker process of the resumed run found on the nodes"
    os.kill(workers[0].pid, signal.SIGKILL)
    return kept, _finish(resumed)


def _check_faulted(kind: str, tiny: dict, nodes: Nodes, tmp_path: Path) -> None:
    alone_out, cluster_out = tmp_path / "alone.out", tmp_path / "cluster.out"
    want, _ = _figures(kind, _alone(COMMANDS[kind](tiny, alone_out)), alone_out)
    kept, doc = _crash_resume_kill(kind, COMMANDS[kind](tiny, cluster_out), nodes, tmp_path)
    got, cluster = _figures(kind, doc, cluster_out)
    assert got == want
    windows = _windows(kind, want)
    assert 12 <= kept < windows and cluster["resumed"] == kept and cluster["retried"] >= 1, (kept, cluster)
    assert cluster["tasks"] == windows - kept + cluster["retried"], cluster  # nothing counted twice
    assert cluster["address"] == "auto" and cluster["nodes"] == 2 and cluster["held_max"] <= HELD_BOUND, cluster
    assert not list(tmp_path.glob("*.journal"))


@pytest.mark.parametrize("kind", ["calibrate", "imatrix"])
def test_a_crashed_driver_and_a_killed_worker_keep_the_figures(kind, tiny, nodes, tmp_path):
    _check_faulted(kind, tiny, nodes, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ppl", "mtp-probe"])
def test_a_crashed_driver_and_a_killed_worker_keep_the_figures_slow(kind, tiny, mtp_model, nodes, tmp_path):
    _check_faulted(kind, dict(tiny, mtp=mtp_model), nodes, tmp_path)


# ---------------------------------------------------------------------------- Ray Client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ppl_through_ray_client(tiny, tmp_path):
    """``ray://127.0.0.1:PORT``: a head with Ray's client server on the loopback (Ray Client,
    ``cortiq[cluster]``'s ``ray[client]``) and a worker node; the one-process figures."""
    port = _free_port()
    client = Nodes(1, head={"ray_client_server_port": port})
    try:
        want, _ = _figures("ppl", _alone(_ppl(tiny, tmp_path)), tmp_path)
        where = f"ray://127.0.0.1:{port}"
        got, cluster = _figures(
            "ppl", _finish(_start([*_ppl(tiny, tmp_path), "--cluster", where], _env(tmp_path))), tmp_path
        )
        assert got == want and cluster["address"] == where and cluster["workers"] == 2 and cluster["nodes"] == 2
    finally:
        client.close()
