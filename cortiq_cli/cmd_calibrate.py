"""``cortiq calibrate``: how well a model's top-1 confidence matches its accuracy, and the temperature that fixes it."""

from __future__ import annotations

import dataclasses
import datetime as _dt
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table
from rich.text import Text

from cortiq_cli import cluster_options as copt
from cortiq_cli import text_options as opt
from cortiq_cli.options import OptionGroup, option_groups
from cortiq_cli.eval_run import cluster_run, interrupted, scoring_bars
from cortiq_cli.common import check_plot, console, handle_errors, print_json
from evals.calibrate import DEFAULT_FIT_FRACTION, CalibrationReport
from evals.calibration import DEFAULT_BINS, Bin, CalibrationMetrics
from evals.runs import CalibrateRequest, EngineOptions, WindowOptions, run_calibrate
from evals.temperature import DEFAULT_T_MAX, DEFAULT_T_MIN
from evals.text_source import LoadedText, TextSpec
from evals.windows import DEFAULT_CTX
from formats.errors import CortiqError

CAL_PANEL = "Calibration"
_BAR_WIDTH = 40


@dataclass(frozen=True)
class FitArgs(OptionGroup):
    """The reliability bins and the temperature fit: ``CalibrateRequest``'s fields of these names."""

    bins: Annotated[
        int,
        typer.Option("--bins", min=1, help="Reliability bins (equal-width and equal-mass).", rich_help_panel=CAL_PANEL),
    ] = DEFAULT_BINS
    fit_fraction: Annotated[
        float,
        typer.Option(
            "--fit-fraction",
            help="Leading share of the scored tokens used to fit the temperature; the rest evaluates it.",
            rich_help_panel=CAL_PANEL,
        ),
    ] = DEFAULT_FIT_FRACTION
    t_min: Annotated[
        float, typer.Option("--t-min", help="Lowest temperature of the grid.", rich_help_panel=CAL_PANEL)
    ] = DEFAULT_T_MIN
    t_max: Annotated[
        float, typer.Option("--t-max", help="Highest temperature of the grid.", rich_help_panel=CAL_PANEL)
    ] = DEFAULT_T_MAX

    def request(self, model: Path, text: TextSpec, windows: WindowOptions, engine: EngineOptions) -> CalibrateRequest:
        """The run's request; the fit fraction is checked here, before the (long) pass."""
        if not 0 < self.fit_fraction < 1:
            raise CortiqError(f"--fit-fraction must be between 0 and 1 (got {self.fit_fraction})")
        return CalibrateRequest(model, text, windows, engine=engine, **dataclasses.asdict(self))


@handle_errors
@option_groups
def calibrate(
    model: Annotated[Path, typer.Argument(help="CMF model file.", show_default=False)],
    text_opts: opt.BoundedTextArgs = opt.BoundedTextArgs(),
    ctx: opt.Ctx = DEFAULT_CTX,
    window_opts: opt.WindowArgs = opt.WindowArgs(),
    fit_opts: FitArgs = FitArgs(),
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Also draw the reliability diagram to this PNG (needs matplotlib).",
            rich_help_panel=CAL_PANEL,
        ),
    ] = None,
    write: Annotated[
        bool,
        typer.Option(
            "--write", help="Store the fitted temperature in the model's CMF header.", rich_help_panel=CAL_PANEL
        ),
    ] = False,
    engine_opts: opt.EngineArgs = opt.EngineArgs(),
    json_out: opt.Json = False,
    cluster_opts: opt.ClusterArgs = opt.ClusterArgs(),
) -> None:
    """Reliability table and diagram, ECE (equal-width and equal-mass), MCE, Brier, NLL, and a fitted temperature."""
    windows = window_opts.options(ctx, text_opts.max_tokens)
    request = fit_opts.request(model, text_opts.spec(), windows, engine_opts.options())
    check_plot(plot)
    where = cluster_opts.where()
    with scoring_bars(json_out, where is not None, "top-1 acc", ".3f") as (progress, cluster_progress):
        run = run_calibrate(request, progress, cluster_run(where, cluster_opts, cluster_progress))
    report, source, settings, creport, done = run.report, run.source, run.settings, run.cluster, run.done
    if done < run.windows and write:
        write = False  # never store a temperature fitted on an interrupted pass
    if not json_out:
        render(report, source, settings)  # before --write, which may refuse the fit
        if creport is not None:
            copt.render_report(creport)
    if creport is not None and done < run.windows:
        copt.note_interrupted()
    written = None
    if write:  # the run has closed the model's map: the header may change under it
        written = write_temperature(model, report, source, settings)
    if plot is not None:
        draw_png(report, plot)

    if json_out:
        print_json(
            {
                "text": {"source": source.source, "documents": source.documents, "bytes": source.n_bytes},
                "settings": settings,
                "path": str(model),
                **report.to_json(),
                "written": written,
                "plot": str(plot) if plot else None,
            }
        )
        if done < run.windows:
            interrupted(done, run.windows)
        return
    if done < run.windows:
        interrupted(done, run.windows)
    if written:
        console.print(f"[green]wrote[/] calibration.temperature = {report.temperature:.4f} into {model}")
    if plot is not None:
        console.print(f"[green]wrote[/] {plot}")


# ------------------------------------------------------------------ header


def calibration_header(report: CalibrationReport, source: LoadedText, settings: dict[str, Any]) -> dict[str, Any]:
    """``header["calibration"]``: the temperature plus what it was fitted on (read by generate and inspect)."""
    return {
        "temperature": round(report.temperature, 6),
        "method": "temperature scaling: T minimising the NLL of the next token",
        "text": source.source,
        "fit_tokens": report.fit_tokens,
        "eval_tokens": report.eval_tokens,
        "mode": settings["mode"],
        "ctx": settings["ctx"],
        "stride": settings["stride"],
        "nll_before": report.before.nll,
        "nll_after": report.after.nll,
        "ece_before": report.before.ece,
        "ece_after": report.after.ece,
        "bins": report.n_bins,
        "fitted_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "tool": f"cortiq calibrate {_version()}",
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cortiq")
    except PackageNotFoundError:
        return "unknown"


def write_temperature(
    path: Path, report: CalibrationReport, source: LoadedText, settings: dict[str, Any]
) -> dict[str, Any]:
    from formats.cmf import CmfFile, rewrite_header

    if report.fit.at_edge:
        raise CortiqError(
            f"the fitted temperature {report.temperature:.4g} lies at the edge of the grid "
            f"[{settings['t_min']:.4g}, {settings['t_max']:.4g}]; widen --t-min/--t-max before --write"
        )
    with CmfFile(path) as f:
        header = dict(f.header)
    header["calibration"] = calibration_header(report, source, settings)
    rewrite_header(path, header)
    return header["calibration"]


# ------------------------------------------------------------------ terminal


def render(report: CalibrationReport, source: LoadedText, settings: dict[str, Any]) -> None:
    console.print(
        f"[bold]text[/] {source.source}: {settings['text_tokens']:,} tokens  [bold]scored[/] {report.overall.n:,} "
        f"({_how(settings)})  [bold]model[/] {report.model}",
        highlight=False,
    )
    console.print(reliability_table(report.reliability, "Reliability (T = 1, all scored tokens)"))
    console.print(reliability_diagram(report.reliability, width=max(10, min(_BAR_WIDTH, console.width - 48))))
    console.print(summary_table(report))
    if report.fit.at_edge:
        console.print(
            f"[yellow]warning:[/] the NLL is lowest at the edge of the temperature grid (T = {report.temperature:.4g}); "
            "widen --t-min/--t-max",
            highlight=False,
        )


def _how(settings: dict[str, Any]) -> str:
    how = f"{settings['mode']}, ctx {settings['ctx']}"
    return how + (f", stride {settings['stride']}" if settings["stride"] is not None else "")


def reliability_table(bins: list[Bin], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("confidence", justify="left")
    t.add_column("count", justify="right")
    t.add_column("mean conf", justify="right")
    t.add_column("accuracy", justify="right")
    t.add_column("gap", justify="right")
    for b in bins:
        if b.count == 0:
            t.add_row(f"({b.lo:.2f}, {b.hi:.2f}]", "0", "–", "–", "–", style="dim")
            continue
        t.add_row(
            f"({b.lo:.2f}, {b.hi:.2f}]",
            f"{b.count:,}",
            f"{b.confidence:.4f}",
            f"{b.accuracy:.4f}",
            Text(f"{b.gap:+.4f}", style=_gap_style(b.gap)),
        )
    return t


def _gap_style(gap: float) -> str:
    g = abs(gap)
    return "green" if g < 0.05 else "yellow" if g < 0.15 else "red"


def reliability_diagram(bins: list[Bin], width: int = _BAR_WIDTH) -> Text:
    """One row per bin: a bar as long as the accuracy, a ┃ where the mean confidence is."""
    out = Text()
    out.append(
        "Reliability diagram: bar = accuracy, ┃ = mean confidence (calibrated: the bar ends at ┃)\n", style="bold"
    )
    for b in reversed(bins):
        out.append(f" {b.lo:.2f}–{b.hi:.2f} │", style="dim")
        if b.count == 0:
            out.append(" " * width + "│\n")
            continue
        cells = [" "] * width
        filled = b.accuracy * width
        full = int(filled)
        for i in range(full):
            cells[i] = "█"
        if full < width and filled - full >= 0.5:
            cells[full] = "▌"
        mark = min(int(b.confidence * width), width - 1)
        style = _gap_style(b.gap)
        for i, c in enumerate(cells):
            if i == mark:
                out.append("┃", style="bold white")
            else:
                out.append(c, style=style)
        out.append(f"│ n={b.count:<7,} acc {b.accuracy:.3f} conf {b.confidence:.3f}\n", style="dim")
    return out


def summary_table(report: CalibrationReport) -> Table:
    t = Table(
        title=f"Temperature scaling: T = {report.temperature:.4f}",
        caption=f"fitted on the first {report.fit_tokens:,} scored tokens, held out: the last {report.eval_tokens:,}",
        title_justify="left",
        caption_justify="left",
    )
    t.add_column("metric")
    t.add_column("all, T = 1", justify="right")
    t.add_column("held-out, T = 1", justify="right")
    t.add_column(f"held-out, T = {report.temperature:.3f}", justify="right", style="cyan")
    rows: list[tuple[str, str]] = [
        ("accuracy (top-1)", "accuracy"),
        ("mean confidence", "confidence"),
        ("ECE (equal-width)", "ece"),
        ("ECE (equal-mass)", "ece_mass"),
        ("MCE", "mce"),
        ("Brier (top-1)", "brier"),
        ("NLL (nats/token)", "nll"),
    ]
    for label, key in rows:
        t.add_row(label, *(f"{getattr(m, key):.4f}" for m in (report.overall, report.before, report.after)))
    return t


# ------------------------------------------------------------------ png


def draw_png(report: CalibrationReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not path.parent.is_dir():
        raise CortiqError(f"--plot: folder {path.parent} does not exist")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.6), sharey=True)
    panels: list[tuple[Any, list[Bin], CalibrationMetrics, str]] = [
        (axes[0], report.reliability, report.overall, "T = 1, all scored tokens"),
        (axes[1], report.reliability_after, report.after, f"T = {report.temperature:.3f}, held-out tokens"),
    ]
    for ax, bins, m, title in panels:
        width = bins[0].hi - bins[0].lo
        full = [b for b in bins if b.count]
        ax.bar(
            [b.lo for b in full],
            [b.accuracy for b in full],
            width=width,
            align="edge",
            color="#4c72b0",
            edgecolor="white",
        )
        over = [b for b in full if b.gap > 0]
        under = [b for b in full if b.gap <= 0]
        ax.bar(
            [b.lo for b in over],
            [b.gap for b in over],
            bottom=[b.accuracy for b in over],
            width=width,
            align="edge",
            color="#dd8452",
            alpha=0.5,
            edgecolor="#dd8452",
        )
        ax.bar(
            [b.lo for b in under],
            [-b.gap for b in under],
            bottom=[b.confidence for b in under],
            width=width,
            align="edge",
            facecolor="none",
            hatch="///",
            edgecolor="#55a868",
        )
        ax.plot([0, 1], [0, 1], "k--", lw=1)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("top-1 confidence")
        ax.set_title(f"{title}\nECE {m.ece:.4f}  MCE {m.mce:.4f}  NLL {m.nll:.4f}", fontsize=10)
    axes[0].set_ylabel("accuracy")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    axes[0].legend(
        handles=[
            Patch(facecolor="#4c72b0", label="accuracy"),
            Patch(facecolor="#dd8452", alpha=0.5, edgecolor="#dd8452", label="over-confident by"),
            Patch(facecolor="none", hatch="///", edgecolor="#55a868", label="under-confident by"),
            Line2D([0], [0], color="k", ls="--", lw=1, label="calibrated"),
        ],
        loc="upper left",
        fontsize=8,
    )
    fig.suptitle(f"Reliability: {report.model}", fontsize=11)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise CortiqError(f"--plot: cannot write {path} ({e.strerror})") from None
    finally:
        plt.close(fig)
