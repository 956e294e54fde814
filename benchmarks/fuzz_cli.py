"""Fuzz the cortiq CLI with a fresh corpus of hostile CMF files and sidecars.

    python benchmarks/fuzz_cli.py --seed 2026 --cases 3000
    python benchmarks/fuzz_cli.py --resealed --seed 2027 --cases 3000

``--resealed`` makes only mutants whose every checksum is recomputed (the preamble CRC,
and each changed tensor's CRC in the directory): CMF header fields retyped, tokenizer.json
structure mutations (components, model, merges, padding, added tokens, raw bytes), hostile
chat templates, tensor bytes changed, chat session files for ``chat --load``, header and
arch edits. Each command runs under a memory cap (``--mem-gb``, RLIMIT_AS) and a time limit
(``--timeout``); a MemoryError that escapes counts as a memory blow-up.

Makes ``--cases`` mutated files (``tests/fuzz_cmf.py``: byte flips, truncations, header
and directory edits with and without a recomputed checksum, arch geometry edits,
JSON bombs, shape edits, foreign files; main files and sidecars of q8/q4/f32 tiny
models) and runs ``inspect``, ``verify``, ``generate`` and ``ppl`` on each, then prints
the table of outcomes per command and every violated property.

Commands run in worker processes outside this one (``--worker`` mode: the real
``cortiq`` app, one command at a time, results on a private pipe), so a crash is a
worker killed by a signal and a hang is a worker that does not answer in
``--timeout`` seconds; the worker is then restarted. Every ``--exec-every``-th case
also runs each command as a fresh ``python -m cortiq_cli.main`` process, the exact
user path (slower: one interpreter start per command), tallied in a second table.
Exit status 1 when any property is violated.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fuzz_cmf import (  # noqa: E402
    Outcome,
    Table,
    build_base,
    case_commands,
    command_args,
    command_input,
    corpus,
    needs_open,
    resealed_corpus,
    violations,
    write_case,
)


# ------------------------------------------------------------------ worker side


def worker(fd: int) -> None:
    """Read one JSON argument list per stdin line, run it, answer on ``fd``."""
    import typer
    from typer.testing import CliRunner

    from cortiq_cli.main import app
    from tests.fuzz_cmf import _invoke

    cli = typer.main.get_command(app)
    runner = CliRunner()
    out = os.fdopen(fd, "w")
    for line in sys.stdin:
        req = json.loads(line)
        code, exc = _invoke(runner, cli, req["args"], req.get("input"))
        detail = f"{type(exc).__name__}: {str(exc)[:160]}" if exc is not None else ""
        out.write(
            json.dumps(
                {"code": code, "traceback": exc is not None, "memory": isinstance(exc, MemoryError), "detail": detail}
            )
            + "\n"
        )
        out.flush()


def _limit_memory(gb: float) -> None:
    import resource

    if gb > 0:
        n = int(gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (n, n))


# ------------------------------------------------------------------ parent side


class Worker:
    def __init__(self, timeout: float, mem_gb: float = 0.0):
        self.timeout = timeout
        self.mem_gb = mem_gb
        self.proc: subprocess.Popen | None = None
        self.rfd = -1

    def start(self) -> None:
        r, w = os.pipe()
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(w)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(w,),
            env=env,
            text=True,
            preexec_fn=(lambda: _limit_memory(self.mem_gb)) if self.mem_gb else None,
        )
        os.close(w)
        self.rfd = r
        self._buf = b""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            os.close(self.rfd)
            self.proc = None

    def run(self, command: str, args: list[str], input: str | None = None) -> Outcome:
        if self.proc is None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"args": args, "input": input}) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        deadline = time.monotonic() + self.timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.rfd], [], [], max(left, 0))
            if not ready:
                self.stop()
                return Outcome(command, "hang", f"no answer in {self.timeout:g} s")
            chunk = os.read(self.rfd, 65536)
            if not chunk:  # the worker died
                rc = self.proc.wait()
                self.stop()
                return Outcome(command, "crash" if rc < 0 else "traceback", f"worker exit {rc}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        r = json.loads(line)
        if r.get("memory"):
            self.stop()  # a worker that ran out of memory may be left in any state
            return Outcome(command, "memory", r["detail"])
        if r["traceback"]:
            return Outcome(command, "traceback", r["detail"])
        return Outcome(command, "ok" if r["code"] == 0 else "clean")


def run_fresh(command: str, args: list[str], timeout: float, input: str | None = None, mem_gb: float = 0.0) -> Outcome:
    """One command as its own ``python -m cortiq_cli.main`` process (the user's path)."""
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    try:
        p = subprocess.run(
            [sys.executable, "-m", "cortiq_cli.main", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            errors="replace",
            input=input or "",
            preexec_fn=(lambda: _limit_memory(mem_gb)) if mem_gb else None,
        )
    except subprocess.TimeoutExpired:
        return Outcome(command, "hang")
    if p.returncode < 0:
        return Outcome(command, "crash", f"signal {-p.returncode}")
    if "Traceback (most recent call last)" in p.stderr:
        last = p.stderr.strip().splitlines()[-1][:160]
        return Outcome(command, "memory" if last.startswith("MemoryError") else "traceback", last)
    return Outcome(command, "ok" if p.returncode == 0 else "clean")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=2026, help="corpus seed (tests/test_fuzz.py uses 12 and 13)")
    ap.add_argument("--cases", type=int, default=3000)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a command counts as a hang")
    ap.add_argument("--exec-every", type=int, default=50, help="also run every Nth case as fresh processes (0 = never)")
    ap.add_argument("--json", type=Path, default=None, help="write the tables and violations here too")
    ap.add_argument("--resealed", action="store_true", help="only mutants with every checksum recomputed")
    ap.add_argument("--mem-gb", type=float, default=4.0, help="address-space cap of each command (RLIMIT_AS; 0 = none)")
    ap.add_argument("--seconds", type=float, default=0.0, help="stop making cases after this many seconds (0 = none)")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker)
        return 0

    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="cortiq-fuzz-") as tmp:
        root = Path(tmp)
        bases = build_base(root / "base")
        table, fresh, bad = Table(), Table(), []
        kinds: dict[str, int] = {}
        w = Worker(a.timeout, a.mem_gb)
        cases = resealed_corpus(a.seed, a.cases, bases) if a.resealed else corpus(a.seed, a.cases, bases)
        done = 0
        t_cases = time.time()
        try:
            for i, case in enumerate(cases):
                if a.seconds and time.time() - t_cases > a.seconds:
                    break
                done += 1
                kinds[case.kind] = kinds.get(case.kind, 0) + 1
                main_path = write_case(case, root / "case")
                outcomes: list[Outcome] = []
                for command in case_commands(case):
                    if needs_open(command) and not (outcomes[0].status == "ok" or case.target == "sidecar"):
                        continue  # the file does not open: the others stop where inspect did
                    outcomes.append(w.run(command, command_args(command, main_path), command_input(command)))
                for o in outcomes:
                    table.add(o)
                v = violations(case, outcomes)
                if a.exec_every and i % a.exec_every == 0:
                    fo = [
                        run_fresh(
                            o.command, command_args(o.command, main_path), a.timeout, command_input(o.command), a.mem_gb
                        )
                        for o in outcomes
                    ]
                    for o in fo:
                        fresh.add(o)
                    v += [f"(fresh process) {x}" for x in violations(case, fo)]
                    v += [
                        f"{case.id} {x.command}: fresh process {y.status}, worker {x.status}"
                        for x, y in zip(outcomes, fo)
                        if x.status != y.status
                    ]
                bad += [f"{x} | {case.note}" for x in v]
                if (i + 1) % 500 == 0:
                    print(
                        f"{i + 1} cases, {len(bad)} violations, {time.time() - t0:.0f} s", file=sys.stderr, flush=True
                    )
        finally:
            w.stop()
    a.cases = done
    print(
        f"seed {a.seed}: {a.cases} files ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}), {time.time() - t0:.0f} s\n"
    )
    print(table.markdown())
    if fresh.rows:
        print(f"\nfresh `python -m cortiq_cli.main` processes, every {a.exec_every}th case:\n")
        print(fresh.markdown())
    print(f"\n{len(bad)} violations")
    for b in bad[:50]:
        print("  " + b)
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "seed": a.seed,
                    "cases": a.cases,
                    "resealed": a.resealed,
                    "kinds": kinds,
                    "table": table.rows,
                    "fresh": fresh.rows,
                    "violations": bad,
                    "totals": {k: table.total(k) + fresh.total(k) for k in ("traceback", "crash", "hang", "memory")},
                    "seconds": round(time.time() - t0, 1),
                },
                indent=1,
            )
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
