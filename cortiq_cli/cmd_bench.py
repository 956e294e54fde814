"""``cortiq bench MODEL.cmf [MODEL2.cmf ...]``: prefill and decode speed, as llama-bench.

The flags are llama-bench's: ``-m`` a model (repeatable), ``-p`` the prompt's length
in tokens, ``-n`` the tokens to generate, ``-r`` repetitions, ``-t`` thread counts.

Rows stream as they are measured, in llama-bench's markdown table (model, size,
params, quant, threads, test, t/s as median ± standard deviation over the
repetitions); ``--threads 1,2`` sweeps thread counts; models with MTP draft layers
get speculative rows (``verifyK``, ``tgN+mtp``). Resident and peak memory per model
go to stderr. ``--json`` prints one JSON document with every sample instead.

No figure includes kernel compilation: a model's load compiles every kernel its tests
run (on a machine that has not run such a model yet; later loads read the on-disk
caches), and each test runs once untimed before its repetitions. The time compiled is
reported apart (a note on stderr; ``compile_seconds`` per row in ``--json``).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from cortiq_cli.common import CompileProgress, err_console, handle_errors, human_bytes, peak_rss_bytes, print_json
from formats.errors import CortiqError

COLUMNS = ("model", "size", "params", "quant", "threads", "test", "t/s")


def parse_threads(spec: str | None) -> list[int | None]:
    """'1,2,4' -> [1, 2, 4]; None -> [None] (every core)."""
    if spec is None:
        return [None]
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise CortiqError(f"--threads {spec!r}: expected positive integers separated by commas, e.g. 1,2,4")
        out.append(int(part))
    return out


def _params(cmf) -> int:
    n = (cmf.header.get("source") or {}).get("parameters")
    if isinstance(n, int) and n > 0:
        return n
    total = 0
    for info in cmf.tensors.values():
        k = 1
        for d in info.shape:
            k *= int(d)
        total += k
    return total


def _human_params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _gib(n: int) -> str:
    """llama-bench's size column: two decimals, in GiB (MiB under one GiB)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


class MarkdownTable:
    """llama-bench's output: a markdown table whose rows print as they come."""

    def __init__(self, model_width: int):
        self.widths = (max(model_width, 5), 10, 10, 8, 7, 12, 20)
        self.right = (False, True, True, False, True, True, True)

    def _line(self, cells: tuple[str, ...]) -> str:
        return (
            "| " + " | ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, self.widths, self.right)) + " |"
        )

    def header(self) -> None:
        self._write(self._line(COLUMNS))
        self._write(
            "|"
            + "|".join(("-" * (w + 1) + ":") if r else ("-" * (w + 2)) for w, r in zip(self.widths, self.right))
            + "|"
        )

    def row(self, cells: tuple[str, ...]) -> None:
        self._write(self._line(cells))

    @staticmethod
    def _write(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


@handle_errors
def bench(
    models: Annotated[
        Optional[list[Path]],
        typer.Argument(help="CMF model files; or give -m/--model (repeatable).", show_default=False),
    ] = None,
    model_opts: Annotated[
        Optional[list[Path]],
        typer.Option(
            "--model", "-m", help="A model file (.cmf), as llama-bench takes it (repeatable).", show_default=False
        ),
    ] = None,
    n_prompt: Annotated[
        int, typer.Option("--n-prompt", "-p", min=0, help="Prefill test: this many prompt tokens (0 = skip).")
    ] = 512,
    n_gen: Annotated[
        int, typer.Option("--n-gen", "-n", min=0, help="Decode test: this many generated tokens (0 = skip).")
    ] = 128,
    reps: Annotated[
        int, typer.Option("--repetitions", "-r", min=1, help="Timed repetitions of each test (after one warm-up).")
    ] = 3,
    threads: Annotated[
        Optional[str],
        typer.Option(
            "--threads", "-t", metavar="N,...", help="Thread counts to sweep, comma-separated (default: all cores)."
        ),
    ] = None,
    mtp: Annotated[
        bool, typer.Option("--mtp/--no-mtp", help="Speculative rows (verify, tg+mtp) for models with MTP draft layers.")
    ] = True,
    json_out: Annotated[
        bool, typer.Option("--json", help="One JSON document (every sample) instead of the table.")
    ] = False,
) -> None:
    """Prefill and decode tokens per second of CMF models, in llama-bench's table."""
    import psutil

    from cortiq_engine import Engine
    from cortiq_engine.threads import max_threads, set_threads
    from evals import speed

    models = [*(model_opts or []), *(models or [])]
    if not models:
        raise CortiqError("no model: give MODEL... or -m/--model PATH")
    sweep = parse_threads(threads)
    if n_prompt == 0 and n_gen == 0:
        raise CortiqError("nothing to measure: -p and -n are both 0")
    for m in models:
        if not m.is_file():
            raise CortiqError(f"{m}: no such file")
    table = None if json_out else MarkdownTable(max(len(m.name) for m in models))
    if table is not None:
        table.header()
    proc = psutil.Process()
    docs: list[dict[str, Any]] = []
    for path in models:
        # The context the tests need (room for a verify batch of up to 32 tokens), not the model's.
        eng = Engine.load(
            path,
            threads=sweep[0],
            ctx=speed.needed_context(n_prompt, n_gen, 32),
            mtp=mtp,
            on_warmup=CompileProgress(err_console, bar=not json_out),
        )
        compiled = eng.compile_report.seconds if eng.compile_report is not None else 0.0
        if table is not None:
            err_console.print(
                f"[dim]{path.name}: t/s excludes kernel compilation ("
                + (f"{compiled:.1f} s, at load)" if compiled else "none: the kernels came from the on-disk caches)")
                + "[/]",
                highlight=False,
            )
        stack = eng.drafts
        info = {
            "model": path.name,
            "path": str(path),
            "size_bytes": path.stat().st_size,
            "params": _params(eng.cmf),
            "quant": (eng.header.get("quant") or {}).get("default", "?"),
            "arch": eng.arch.arch,
            "mtp_layers": stack.num_layers if stack is not None else 0,
            "compile_seconds": compiled,
        }
        for n_threads in sweep:
            used = set_threads(n_threads)
            results = []
            spec_rows: dict[int, dict] = {}  # result index -> the measured choice of its drafter
            if n_prompt:
                results.append(speed.prefill(eng, n_prompt, reps))
            if n_gen:
                results.append(speed.decode(eng, n_gen, reps))
            if stack is not None:
                results.append(speed.verify(eng, stack.num_layers + 1, reps))  # the default depth: every layer
                if n_gen:
                    drafter, _ = eng.drafter(True)  # one drafter: its decision reports the last repetition
                    results.append(speed.decode(eng, n_gen, reps, speculative=drafter))
                    if drafter.decision is not None:
                        spec_rows[len(results) - 1] = drafter.decision.to_json()
            for i, r in enumerate(results):
                row = {
                    **info,
                    "threads": used,
                    **r.to_json(),
                    **({"speculative": spec_rows[i]} if i in spec_rows else {}),
                }
                docs.append(row)
                if table is not None:
                    table.row(
                        (
                            info["model"],
                            _gib(info["size_bytes"]),
                            _human_params(info["params"]),
                            str(info["quant"]),
                            str(used),
                            r.test,
                            f"{r.median:.2f} ± {r.stddev:.2f}",
                        )
                    )
                    if i in spec_rows:
                        err_console.print(f"[dim]{r.test}: speculative: {spec_rows[i]['decision']}[/]", highlight=False)
        rss = proc.memory_info().rss
        for row in docs:
            if row["path"] == str(path):
                row["rss_bytes"] = rss
        eng.close()
        if table is not None:
            err_console.print(
                f"[dim]{path.name}: RSS {human_bytes(rss)}, peak RSS so far {human_bytes(max(rss, peak_rss_bytes()))}[/]",
                highlight=False,
            )
    if json_out:
        print_json(
            {
                "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "max_threads": max_threads()},
                "n_prompt": n_prompt,
                "n_gen": n_gen,
                "repetitions": reps,
                "rows": docs,
                "note": "tok_s never includes kernel compilation (compile_seconds, at load)",
                "peak_rss_bytes": peak_rss_bytes(),
            }
        )
