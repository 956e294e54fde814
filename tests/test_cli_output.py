"""Help and output hygiene: ``--version`` and ``-h`` everywhere, help without type tags
and with ``MODEL PROMPT`` usage, no blank first line, nothing wrapped when stdout is
not a terminal (typer's runner captures output: not a terminal)."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from cortiq_cli.help import cortiq_version
from cortiq_cli.main import COMMANDS, app

runner = CliRunner()
NAMES = [name for name, _, _ in COMMANDS]
LONG_NAME = "SmolLM2-135M-Instruct-a-model-file-name-long-enough-to-wrap-at-eighty-columns.q8.cmf"


def _run(*args: str):
    return runner.invoke(app, list(args))


def test_version_on_the_group_and_every_command():
    assert cortiq_version() != "unknown"
    r = _run("--version")
    assert r.exit_code == 0 and r.stdout == f"cortiq {cortiq_version()}\n"
    for name in NAMES:
        r = _run(name, "--version")
        assert r.exit_code == 0, (name, r.output)
        assert r.stdout == f"cortiq {cortiq_version()}\n"


@pytest.mark.parametrize("name", NAMES)
def test_short_help_on_every_command_without_type_tags(name):
    r = _run(name, "-h")
    assert r.exit_code == 0, r.output
    assert r.stdout == _run(name, "--help").stdout
    assert r.stdout.startswith("Usage: ")
    assert not re.search(r"<(bool|int|str|float|path|list)", r.stdout), r.stdout
    assert "{" not in r.stdout.splitlines()[0]  # usage names arguments MODEL, not {model}
    assert "--version" in r.stdout and "-h, --help" in r.stdout


def test_generate_usage_reads_model_prompt():
    first = _run("generate", "-h").stdout.splitlines()[0]
    assert first.endswith("generate [OPTIONS] [MODEL] [PROMPT]")  # or -m/--model, -p/--prompt, --prompt-file
    out = _run("generate", "-h").stdout
    assert re.search(r"^  -n, --max-tokens N +Generate at most this many tokens\. \[default: 256\]", out, re.M)
    assert re.search(r"^  --json +Print one JSON object", out, re.M)  # a flag: no metavar


def test_usage_errors_name_arguments_in_upper_case():
    r = _run("inspect")
    assert r.exit_code == 2 and "Missing argument 'FILE'" in r.output
    r = _run("generate")  # the model may come as -m: the command itself says what is missing
    assert r.exit_code == 2 and r.stderr.strip() == "error: no model: give MODEL or -m/--model PATH"


def test_group_help_lists_each_command_on_one_line():
    r = _run("-h")
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    for name in NAMES:
        row = [ln for ln in lines if ln.startswith(f"  {name} ")]
        assert len(row) == 1, name
    at = next(i for i, ln in enumerate(lines) if ln.startswith("  mtp-probe "))
    probe = " ".join(ln.strip() for ln in lines[at : at + 3])  # wrapped at 80 columns, under its own column
    assert probe.endswith("(per depth alone and chained).")
    assert all(len(ln) <= 80 for ln in lines)


def test_unwrapped_console_when_not_a_terminal():
    from io import StringIO

    from rich.table import Table

    from cortiq_cli.common import OutputConsole

    buf = StringIO()
    c = OutputConsole(file=buf)
    t = Table()
    t.add_column("model")
    t.add_column("ppl")
    t.add_row(LONG_NAME + " (q8)", "12.3456")
    c.print(t)
    c.print("word " * 40 + "end")
    lines = buf.getvalue().splitlines()
    assert any(LONG_NAME + " (q8)" in ln and "12.3456" in ln for ln in lines)
    assert max(len(ln) for ln in lines) < 250  # natural width, not padded to the console
    assert lines[-1].strip().endswith("end") and lines[-1].startswith("word")


def test_convert_and_verify_start_with_their_first_line(tmp_path):
    from tests.tiny import save_tiny

    src = save_tiny("llama", tmp_path / "hf")
    out = tmp_path / LONG_NAME
    r = _run("convert", str(src), str(out), "--quant", "q8")
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    assert first.strip() and first.startswith(f"{out}  (llama, ")  # the table title: the path whole
    r = _run("verify", str(out))
    assert r.exit_code == 0, r.output
    assert r.output.startswith(f"{out}: ") and r.output.endswith(" OK\n") and r.output.count("\n") == 1


# ------------------------------------------------------------------ real model
@pytest.fixture(scope="module")
def long_named(smollm2_cmf, tmp_path_factory):
    path = tmp_path_factory.mktemp("hygiene") / LONG_NAME
    path.symlink_to(smollm2_cmf("q8"))
    return path


def _box_rows_intact(out: str) -> int:
    """Rows of box tables: a cell wrapped onto a second line leaves blank cells there."""
    rows = [ln for ln in out.splitlines() if ln.startswith("│")]
    for ln in rows:
        cells = ln.strip().strip("│").split("│")
        assert all(c.strip() for c in cells), ln
    return len(rows)


@pytest.mark.slow
def test_piped_inspect_and_verify(long_named):
    r = _run("inspect", str(long_named))
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[0].startswith(str(long_named))  # the path whole, first line
    assert _box_rows_intact(r.output) >= 3  # dtype table: q8, u8, f32
    r = _run("verify", str(long_named))
    assert r.exit_code == 0, r.output
    assert r.output == f"{long_named}: 273 tensors, 137.9 MiB OK\n"  # no blank line before it, no wrap


@pytest.mark.slow
def test_piped_ppl_and_calibrate(long_named, smollm2_cmf):
    short = smollm2_cmf("q8")
    r = _run("ppl", str(long_named), str(short), "--max-tokens", "160", "-c", "128", "-t", "1")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    row = [ln for ln in lines if f"{LONG_NAME} (q8)" in ln and "Against" not in ln]
    assert len(row) == 1 and re.search(r"\d+\.\d{4} +\d+\.\d+–\d+\.\d+", row[0]), r.output
    # The comparison table is narrower than its title: the title still stays whole.
    assert f"Against {LONG_NAME} (q8)" in [ln.strip() for ln in lines]
    assert r.output.strip().splitlines()[0].startswith("text ")  # no blank line first
    r = _run("calibrate", str(long_named), "--max-tokens", "160", "-c", "128", "-t", "1")
    assert r.exit_code == 0, r.output
    first = r.output.splitlines()[0]
    assert first.startswith("text ") and first.endswith(f"model {LONG_NAME} (q8)")
    assert _box_rows_intact(r.output) >= 10 + 7  # ten reliability bins, seven metrics
