"""Thread pools: short spinning by default, affinity-bounded defaults, an adaptive
decode thread count, clean errors.

Each case runs in a fresh interpreter: the OpenMP runtime reads its wait policy
once, when numba starts the pool, and a pool that has started cannot be changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cortiq_engine.threads import DEFAULT_SPINCOUNT, DecodeThreads
from tests.conftest import REPO


def _py(code: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("OMP_WAIT_POLICY", None)
    e.pop("GOMP_SPINCOUNT", None)
    e.pop("NUMBA_NUM_THREADS", None)
    e.update(env)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=REPO, timeout=300)


PROBE = """
import json, os, numba
from cortiq_engine.kernels import jit
from cortiq_engine.threads import set_threads
n = set_threads(None)
print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"), "spin": os.environ.get("GOMP_SPINCOUNT"), "threads": n,
                  "numba": numba.get_num_threads(), "layer": numba.threading_layer()}))
"""


def test_workers_spin_briefly_by_default():
    r = _py(PROBE)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["policy"] is None and out["spin"] == DEFAULT_SPINCOUNT
    assert out["threads"] == out["numba"] == min(len(os.sched_getaffinity(0)), os.cpu_count())


def test_user_wait_policy_wins():
    r = _py(PROBE, OMP_WAIT_POLICY="ACTIVE")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["policy"] == "ACTIVE" and out["spin"] is None  # a wait policy, not our spin count
    r = _py(PROBE, GOMP_SPINCOUNT="7")
    assert json.loads(r.stdout.strip().splitlines()[-1])["spin"] == "7"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two usable cores to narrow to one")
def test_default_threads_follow_cpu_affinity():
    # taskset-style narrowing before anything starts: the default is the usable cores, not all cores.
    code = "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n" + PROBE
    r = _py(code)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["threads"] == out["numba"] == 1


def test_explicit_threads_out_of_range_is_one_line_error(smollm2_cmf):
    path = smollm2_cmf("q8")
    r = _py(
        f"from cortiq_cli.main import main; import sys; sys.argv=['cortiq','generate',{str(path)!r},'hi','-n','2','--threads','999']; main()"
    )
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "--threads 999" in lines[0] and "Traceback" not in r.stderr


def test_missing_threading_layer_is_one_line_error(smollm2_cmf):
    path = smollm2_cmf("q8")
    r = _py(
        f"from cortiq_cli.main import main; import sys; sys.argv=['cortiq','generate',{str(path)!r},'hi','-n','2']; main()",
        NUMBA_THREADING_LAYER="no_such_layer",
    )
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in r.stderr
    assert len(lines) == 1 and "threading layer (no_such_layer)" in lines[0], r.stderr


class FakeMachine:
    """A clock whose decode steps cost what ``cost(n, step)`` says, and a thread setter
    that records what the engine would run on."""

    def __init__(self, cost):
        self.cost, self.now, self.n, self.steps, self.sets = cost, 0.0, 2, 0, []

    def clock(self) -> float:
        return self.now

    def set_count(self, n: int) -> None:
        self.sets.append(n)
        self.n = n

    def run(self, tuner: DecodeThreads, steps: int, key: int = 1) -> list[int]:
        chosen = []
        for _ in range(steps):
            with tuner.step(key) as n:
                assert n == self.n  # the pool runs what the tuner says
                self.now += self.cost(n, self.steps)
            assert self.n == tuner.top  # restored for prefill after every step
            chosen.append(n)
            self.steps += 1
        return chosen


def _tuner(machine: FakeMachine, adaptive: bool = True) -> DecodeThreads:
    return DecodeThreads(2, adaptive, set_count=machine.set_count, clock=machine.clock)


def test_busy_core_moves_decode_to_one_thread():
    # A 2-thread step waits for the thread on the busy core: 3x slower than one thread.
    m = FakeMachine(lambda n, i: 0.03 if n == 2 else 0.01)
    chosen = m.run(_tuner(m), 200)
    assert chosen[:4] == [2, 2, 2, 2] and chosen.count(1) >= 180


def test_probe_steps_of_varying_rows_still_decide():
    """Speculative decoding's steps forward 1..4 rows (keys): a probe whose last step has
    a key it met once decides on that one time (it raised IndexError)."""
    m = FakeMachine(lambda n, i: 0.03 if n == 2 else 0.01)
    tuner = _tuner(m)
    chosen = []
    for i in range(200):
        chosen += m.run(tuner, 1, key=1 + (i * 7 % 11) % 4)
    assert chosen.count(1) >= 150


def test_quiet_machine_keeps_every_core_and_probes_rarely():
    m = FakeMachine(lambda n, i: 0.01 if n == 2 else 0.016)
    chosen = m.run(_tuner(m), 600)
    # Probes double their interval while they lose: 3 steps at 4, 21, 54, 119, 248, 505.
    assert chosen.count(1) <= 18 and chosen[-50:].count(2) == 50


def test_neighbour_that_comes_and_goes_is_followed():
    busy = lambda i: 300 <= i < 600  # noqa: E731
    m = FakeMachine(lambda n, i: (0.03 if n == 2 else 0.01) if busy(i) else (0.01 if n == 2 else 0.016))
    chosen = m.run(_tuner(m), 1200)
    assert chosen[250:300].count(2) == 50
    assert chosen[560:600].count(1) >= 38  # found within one probe interval
    assert chosen[1100:].count(2) >= 96


def test_noise_within_the_margin_does_not_flip_the_count():
    m = FakeMachine(lambda n, i: 0.010 if n == 2 else 0.0095)  # one thread 5% faster: below the 10% margin
    chosen = m.run(_tuner(m), 300)
    assert chosen.count(2) >= 285


def test_fixed_threads_never_change():
    m = FakeMachine(lambda n, i: 0.03 if n == 2 else 0.01)
    assert set(m.run(_tuner(m, adaptive=False), 100)) == {2} and m.sets == []


def test_adaptive_decode_gives_the_same_tokens(smollm2_cmf):
    # Thread counts change how rows are split among threads, never a row's arithmetic.
    code = f"""
import json
from cortiq_engine.engine import Engine
from cortiq_engine.threads import DecodeThreads
out = {{}}
for name, threads in (("one", 1), ("auto", None)):
    eng = Engine.load({str(smollm2_cmf("q8"))!r}, threads=threads, ctx=256)
    if threads is None:
        # Every probe wins: the count flips every other step, so both decode many tokens.
        eng.decode_threads = DecodeThreads(eng.threads, interval=1, max_interval=1, margin=2.0)
    res = eng.generate(eng.tokenizer.encode("The history of Rome"), max_tokens=40, ignore_eos=True)
    out[name] = {{"ids": res.token_ids, "steps": res.extra["decode_threads"]["steps"]}}
print(json.dumps(out))
"""
    r = _py(code)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["one"]["ids"] == out["auto"]["ids"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert out["auto"]["steps"].get("1", 0) >= 10 and out["auto"]["steps"].get("2", 0) >= 10
