"""What every command shares: consoles, the error boundary, JSON output."""

from __future__ import annotations

import errno
import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Callable, TypeVar

import numpy as np
import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.progress import ProgressColumn
from rich.table import Table
from rich.text import Text

from typer._click import exceptions as click_exc  # typer vendors click; its errors live here
from typer.core import TyperGroup

from cortiq_cli import launch
from formats.errors import CortiqError

# Width when the output is not a terminal: wide enough that no line, path or table
# cell is ever wrapped (tables still render at their natural width).
UNWRAPPED_WIDTH = 100_000


class OutputConsole(Console):
    """A rich console that wraps to the terminal, and not at all when redirected:
    ``cortiq inspect m.cmf > out.txt`` keeps every path and table cell on one line."""

    @property
    def size(self) -> ConsoleDimensions:
        size = Console.size.fget(self)
        return size if self.is_terminal else ConsoleDimensions(UNWRAPPED_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)


console = OutputConsole()
err_console = OutputConsole(stderr=True)


def print_table(out: Console, table: Table) -> None:
    """Print ``table``; a title wider than the table (a long path) goes on its own line
    above it, where rich would wrap it at the table's width."""
    title = table.title
    if isinstance(title, str):
        text = out.render_str(title, style="table.title")
        if text.cell_len > out.measure(table).maximum:
            table.title = None
            out.print(text, highlight=False)
    out.print(table)


F = TypeVar("F", bound=Callable[..., Any])


# Exit codes (README's table): 0 done, 1 a runtime failure (the OS, memory, a failed
# check), 2 bad input the user can fix (a CortiqError, a bad option), 130 Ctrl-C.
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    """Print a one-line error and exit non-zero (2: bad input, unless ``code`` says otherwise)."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _os_error_line(e: OSError) -> str:
    """Disk full, read-only folder, permission denied, ...: what failed and where."""
    reason = {
        errno.ENOSPC: "no space left on the device",
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied",
        errno.EDQUOT: "disk quota exceeded",
    }.get(e.errno or -1)
    where = e.filename if e.filename is not None else None
    text = reason or e.strerror or str(e)
    return f"{where}: {text}" if where else text


class OneLineErrors(TyperGroup):
    """The CLI's top-level error boundary: usage errors (a bad option value) and the
    failures no command can turn into a ``CortiqError`` itself (the OS refusing a write,
    a recursion or memory limit) become one line on stderr and a non-zero exit."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click_exc.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help())
            if standalone_mode:
                sys.exit(0)
            raise typer.Exit(0)
        except click_exc.UsageError as e:
            where = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
            _one_line(f"{e.format_message()}{where}", e.exit_code, standalone_mode)
        except click_exc.ClickException as e:
            _one_line(e.format_message(), e.exit_code, standalone_mode)
        except typer.Abort:
            _one_line("interrupted", EXIT_INTERRUPTED, standalone_mode)
        except BrokenPipeError:
            _quiet_after_closed_pipe()
            if standalone_mode:
                sys.exit(0)
            raise typer.Exit(0)
        except OSError as e:
            _one_line(_os_error_line(e), 1, standalone_mode)
        except RecursionError:
            _one_line("input nested too deeply to process (recursion limit)", 1, standalone_mode)
        except MemoryError:
            _one_line("out of memory", 1, standalone_mode)
        except ArithmeticError as e:
            # compiled kernels raise on a division by zero only when the numbers went
            # non-finite: damaged weights (cortiq verify names them)
            _one_line(
                f"numeric error ({type(e).__name__}) - non-finite values; run cortiq verify on the model",
                1,
                standalone_mode,
            )
        else:
            if not standalone_mode:
                return rv
            sys.exit(rv if isinstance(rv, int) else 0)


def _one_line(message: str, code: int, standalone_mode: bool) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    if standalone_mode:
        sys.exit(code)
    raise typer.Exit(code)


def handle_errors(fn: F) -> F:
    """The boundary where bad input becomes a one-line message instead of a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        launch.release()  # from here Ctrl-C is a KeyboardInterrupt the command cleans up after
        from cortiq_engine.kernels import interrupts

        interrupts.hold_during_numba_compiles()  # ...delivered after a compile, never lost inside one
        try:
            return fn(*args, **kwargs)
        except CortiqError as e:
            fail(str(e))
        except KeyboardInterrupt:
            err_console.print("[bold red]interrupted[/]")
            raise typer.Exit(EXIT_INTERRUPTED)
        except BrokenPipeError:
            # the reader went away (``cortiq generate ... | head``): what it wanted, it has
            _quiet_after_closed_pipe()
            raise typer.Exit(0)

    return wrapper  # type: ignore[return-value]


def _quiet_after_closed_pipe() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush at exit finds no closed
    pipe to complain about (as ``yes | head`` ends: quietly)."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):  # a captured stdout (tests) has no descriptor
        pass


def check_plot(path: Path | None) -> None:
    """--plot, before a long run: matplotlib is installed and the image's folder exists."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CortiqError("--plot needs matplotlib: pip install 'cortiq[plot]'") from None
    if not path.parent.is_dir():
        raise CortiqError(f"--plot: folder {path.parent} does not exist")


def print_json(obj: Any) -> None:
    """Machine output: one JSON document on stdout, nothing else (strict JSON: a
    non-finite number, such as the interval of a single scored token, is null)."""
    sys.stdout.write(json.dumps(_finite(obj), ensure_ascii=False, default=_json_default, allow_nan=False) + "\n")
    sys.stdout.flush()


def _finite(o: Any) -> Any:
    if isinstance(o, np.ndarray):
        o = o.tolist()
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o) if np.isfinite(o) else None
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def human_bytes(n: float) -> str:
    """Sizes in one family, powers of 1024 with their binary names (KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


class BytesColumn(ProgressColumn):
    """A progress bar's bytes done / total, and its speed, in KiB/MiB/GiB (rich's own
    columns count in powers of 1000, kB and MB)."""

    def render(self, task: Any) -> Text:
        done = human_bytes(task.completed)
        text = f"{done}/{human_bytes(task.total)}" if task.total is not None else done
        speed = task.finished_speed or task.speed
        return Text(text + (f" {human_bytes(speed)}/s" if speed else ""), style="progress.download")


def mib_per_s(n_bytes: float, seconds: float) -> str:
    rate = n_bytes / 2**20 / max(seconds, 1e-9)
    return f"{rate:.0f} MiB/s" if rate >= 10 else f"{rate:.1f} MiB/s"


# ------------------------------------------------------------------ quant names
# llama.cpp's type names (llama-quantize's ftypes, lower case) -> cortiq's --quant presets.
# q4 has Q4_1's block layout, so llama.cpp's q4_1 is cortiq's q4; q4_0 is its own type.
LLAMA_CPP_QUANTS: dict[str, str] = {
    "q8_0": "q8",
    "q6_k": "q6k",
    "q5_k_m": "q5km",
    "q5_k_s": "q5k",
    "q5_0": "q5",
    "q4_k_m": "q4km",
    "q4_k_s": "q4k",
    "q4_1": "q4",
    "q4_0": "q4_0",
    "iq4_xs": "iq4_xs",
    "iq4_nl": "iq4_nl",
    "q3_k_s": "q3k",
    "f16": "f16",
    "bf16": "bf16",
    "f32": "f32",
}
KEEP_QUANT = "keep"  # convert: the source's blocks where CMF has the layout


def quant_names() -> dict[str, str]:
    """Every --quant name this build takes -> its preset: llama.cpp's first, then the
    presets llama.cpp has no name for."""
    from formats.policy import QUANT_CHOICES

    names = {k: v for k, v in LLAMA_CPP_QUANTS.items() if v in QUANT_CHOICES}
    names.update({q: q for q in QUANT_CHOICES if q not in names.values()})
    return names


def quant_names_help() -> str:
    """The --quant names, llama.cpp's first, each with cortiq's short name in brackets."""
    return ", ".join(k if v == k else f"{k} ({v})" for k, v in quant_names().items())


def resolve_quant(name: str, *, option: str = "--quant", allow_keep: bool = True) -> str:
    """A --quant name as llama.cpp (Q4_K_M, q8_0) or cortiq (q4km, q8) spells it -> the preset."""
    from formats.policy import QUANT_ALIASES, QUANT_CHOICES

    key = name.strip().lower()
    preset = quant_names().get(key) or QUANT_ALIASES.get(key) or (key if key in QUANT_CHOICES else None)
    if preset is not None:
        return preset
    if allow_keep and key == KEEP_QUANT:
        return key
    raise CortiqError(
        f"unknown {option} {name!r}; choose one of {quant_names_help()}" + (f", {KEEP_QUANT}" if allow_keep else "")
    )


# The KV cache's element type, for every command that runs a model over a context.
KvCache = Annotated[
    str,
    typer.Option(
        "--kv-cache",
        metavar="f32|f16",
        help="KV cache element type: f32 (default), or f16: half the memory and half the bytes a "
        "long-context decode step reads (llama.cpp's default); each key and value rounded once as it is stored.",
        rich_help_panel="Context",
    ),
]


class CompileProgress:
    """Renders ``Engine.load``'s warm-up (``WarmupEvent``): when the kernels are about to be
    compiled for this CPU, one line on stderr, and on a terminal a transient progress bar
    over the warm-up's steps naming each kernel as it compiles (redirected, the line alone).
    ``status``: a spinner to stop while the bar shows (one live display at a time)."""

    def __init__(self, console: Console, status: Any = None, bar: bool = True) -> None:
        self.console = console
        self.status = status
        self.bar = bar and console.is_terminal
        self.progress: Any = None
        self.task: Any = None
        self.step = ""
        self.kernels = 0  # compiles started so far

    def __call__(self, ev: Any) -> None:
        if ev.kind == "cold" and self.progress is None:
            if self.status is not None:
                self.status.stop()
                self.status = None
            self.console.print(f"compiling kernels for this CPU (once, ~{ev.estimate:.0f} s)", highlight=False)
            if self.bar:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                self.progress = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TimeElapsedColumn(),
                    console=self.console,
                    transient=True,
                )
                self.progress.start()
                self.task = self.progress.add_task(self.step or "compiling", total=ev.total)
            else:
                self.progress = False  # announced; nothing more to draw
        elif ev.kind == "step":
            self.step = ev.name
            if self.progress:
                self.progress.update(self.task, completed=ev.done, description=ev.name)
        elif ev.kind == "kernel" and self.progress:
            self.kernels += 1
            self.progress.update(self.task, description=f"{self.step}: kernel {self.kernels}, {escape(ev.name)}")
        elif ev.kind == "done" and self.progress:
            self.progress.update(self.task, completed=ev.total)
            self.progress.stop()


def load_engine(
    model: Any,
    *,
    threads: int | None,
    ctx: int | None,
    quiet: bool = False,
    mtp: Any = False,
    kv_cache: str = "f32",
    **load: Any,
) -> Any:
    """``Engine.load`` with a spinner on a terminal (redirected, none: rich's live
    display would leave a blank line in the output), and ``CompileProgress`` when it
    compiles kernels (the one line even when ``quiet``)."""
    from cortiq_engine import Engine

    kw = dict(threads=threads, ctx=ctx, mtp=mtp, kv_cache=kv_cache, **load)
    if quiet or not err_console.is_terminal:
        return Engine.load(model, on_warmup=CompileProgress(err_console, bar=not quiet), **kw)
    with err_console.status(f"loading {getattr(model, 'name', model)}", spinner="dots") as status:
        return Engine.load(model, on_warmup=CompileProgress(err_console, status), **kw)


def compile_note(report: Any) -> str:
    """The line saying what load compiled, kept apart from the speeds ("" when nothing)."""
    if report is None or not report.seconds:
        return ""
    return (
        f"kernels compiled for this CPU in {report.seconds:.1f} s at load (once; the on-disk caches serve "
        f"later runs), not counted in the speeds"
    )


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (what mlx_lm prints as peak memory)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def read_prompt(prompt: str | None, prompt_file: Any) -> str:
    """The prompt from the argument, stdin ('-') or ``--prompt-file``."""
    if prompt_file is not None:
        if prompt is not None:
            raise CortiqError("give a PROMPT (or -p) or --prompt-file, not both")
        from formats.untrusted_json import read_text

        return read_text(prompt_file, what="prompt file")
    if prompt is None:
        raise CortiqError("no prompt: give PROMPT or -p/--prompt TEXT ('-' reads stdin), or --prompt-file PATH")
    return sys.stdin.read() if prompt == "-" else prompt
