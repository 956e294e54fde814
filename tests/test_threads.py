"""Thread pools: passive waiting by default, affinity-bounded defaults, clean errors.

Each case runs in a fresh interpreter: the OpenMP runtime reads its wait policy
once, when numba starts the pool, and a pool that has started cannot be changed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _py(code: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("OMP_WAIT_POLICY", None)
    e.pop("NUMBA_NUM_THREADS", None)
    e.update(env)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, cwd=REPO, timeout=300)


PROBE = """
import json, os, numba
from cortiq_engine.kernels import jit
from cortiq_engine.threads import set_threads
n = set_threads(None)
print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"), "threads": n,
                  "numba": numba.get_num_threads(), "layer": numba.threading_layer()}))
"""


def test_workers_wait_passively_by_default():
    r = _py(PROBE)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["policy"] == "PASSIVE"
    assert out["threads"] == out["numba"] == min(len(os.sched_getaffinity(0)), os.cpu_count())


def test_user_wait_policy_wins():
    r = _py(PROBE, OMP_WAIT_POLICY="ACTIVE")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["policy"] == "ACTIVE"


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
    r = _py(f"from cortiq_cli.main import main; import sys; sys.argv=['cortiq','generate',{str(path)!r},'hi','-n','2','--threads','999']; main()")
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
