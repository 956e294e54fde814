"""Fuzzing the CLI with hostile CMF files and sidecars (see tests/fuzz_cmf.py for the
mutations and the properties checked): no traceback, no crash, ``verify`` never
passes a changed file, no command passes a file whose header or directory changed.

CI runs a few hundred cases; ``-m slow`` runs thousands. ``benchmarks/fuzz_cli.py``
runs a fresh corpus through the real CLI in subprocesses.
"""

from __future__ import annotations

import pytest

from tests.fuzz_cmf import Table, build_base, corpus, run_in_process, violations

SEED = 12  # benchmarks/fuzz_cli.py defaults to another seed


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return build_base(tmp_path_factory.mktemp("fuzz_base"))


def _run(bases, tmp_path, seed: int, n: int) -> Table:
    table, bad = Table(), []
    for case in corpus(seed, n, bases):
        outcomes = run_in_process(case, tmp_path / "case")
        for o in outcomes:
            table.add(o)
        bad += violations(case, outcomes)
    assert not bad, f"{len(bad)} violations:\n" + "\n".join(bad[:30]) + "\n" + table.markdown()
    return table


def test_fuzz_cli_ci(bases, tmp_path):
    table = _run(bases, tmp_path, SEED, 250)
    # the corpus reaches every command and both outcomes (the mutator is not vacuous)
    assert table.rows["verify"]["clean"] > 100 and table.rows["generate"]["runs"] > 20 and table.rows["ppl"]["ok"] > 0


@pytest.mark.slow
def test_fuzz_cli_thousands(bases, tmp_path):
    _run(bases, tmp_path, SEED + 1, 3000)


def test_unmutated_files_pass(bases, tmp_path):
    """The base files themselves pass every command (so the clean errors above are the mutations')."""
    from tests.fuzz_cmf import Case

    for b in bases:
        case = Case(f"base-{b.name}", "none", b.name, "main", b.main, b.sidecar, False, False, False)
        assert [o.status for o in run_in_process(case, tmp_path / "case")] == ["ok"] * 4
