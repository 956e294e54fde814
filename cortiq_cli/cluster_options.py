"""The options that send an eval's windows to a Ray cluster (``--cluster``, ``--cluster-threads``,
``--resume``), their checks, and the lines under a cluster run's figures."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cortiq_cli.common import console, err_console
from evals.cluster import INSTALL_HINT, ClusterAddress, ClusterReport, journal_dir, ray_available
from formats.errors import CortiqError

CLUSTER_PANEL = "Cluster"

Cluster = Annotated[
    Optional[str],
    typer.Option(
        "--cluster",
        metavar="ADDRESS",
        help="Score the windows on a Ray cluster, with the same figures as one process: local:N (N workers on this machine), auto (the cluster `ray start` runs here), HOST:PORT of its head, or ray://HOST:PORT (Ray Client).",
        rich_help_panel=CLUSTER_PANEL,
    ),
]
# The figures are bit-identical to a one-process run with as many engine threads as each
# worker has: a prefill's f32 products are split by thread count.
ClusterThreads = Annotated[
    Optional[int],
    typer.Option(
        "--cluster-threads",
        min=1,
        help="Engine threads (and Ray CPUs) per worker (default: --threads, or this machine's cores); the figures equal a one-process run with --threads set to it.",
        rich_help_panel=CLUSTER_PANEL,
    ),
]
Resume = Annotated[
    bool,
    typer.Option(
        "--resume",
        help=f"With --cluster: keep the windows an interrupted run of the same models, text and plan journaled (under ${'{'}CORTIQ_CLUSTER_CACHE{'}'} or ~/.cache/cortiq/cluster) and score the rest.",
        rich_help_panel=CLUSTER_PANEL,
    ),
]


def check(cluster: str | None, resume: bool) -> ClusterAddress | None:
    """The parsed address (None without --cluster); a one-line error, exit 2, without Ray."""
    if cluster is None:
        if resume:
            raise CortiqError("--resume continues a --cluster run; give --cluster too")
        return None
    where = ClusterAddress.parse(cluster)
    if not ray_available():
        err_console.print(f"error: --cluster needs Ray, which is not installed: {INSTALL_HINT}", highlight=False)
        raise typer.Exit(2)
    return where


def note_interrupted() -> None:
    err_console.print(
        f"the finished windows are journaled under {journal_dir()}: the same command with --resume continues",
        highlight=False,
    )


def render_report(report: ClusterReport) -> None:
    """One line under the tables: where the windows ran and how fast."""
    rate = (
        f"{report.tokens_per_s:,.0f} tokens/s"
        if report.tokens_per_s == report.tokens_per_s
        else "nothing left to score"
    )
    hosts, nodes = len(set(report.hosts)), report.nodes
    console.print(
        f"cluster {report.address}: {report.workers} worker{'s' if report.workers != 1 else ''} on {nodes} node{'s' if nodes != 1 else ''} "
        f"({hosts} host{'s' if hosts != 1 else ''}), {report.tasks} windows handed out"
        f" ({report.retried} again after a lost worker, {report.resumed} from the journal), {rate}",
        highlight=False,
    )


__all__ = [
    "Cluster",
    "ClusterThreads",
    "Resume",
    "check",
    "note_interrupted",
    "render_report",
    "CLUSTER_PANEL",
]
