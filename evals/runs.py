"""One function per eval command: a typed request in, a typed run out.

``run_ppl``, ``run_calibrate`` and ``run_imatrix`` read the text, load the models, plan
the windows and score them (in this process, or on a Ray cluster through
``evals.cluster``), and return everything the report shows. The CLI parses options into
the request, passes progress callbacks, and renders the run; nothing here prints.

On Ctrl-C during scoring a run keeps the windows done so far (``done < windows``): its
figures are over those windows, and the caller says they are partial.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from evals.calibrate import DEFAULT_FIT_FRACTION, CalibrationReport, calibration_report, split_rows
from evals.calibration import DEFAULT_BINS
from evals.cluster import ClusterAddress, ClusterProgress, ClusterReport
from evals.perplexity import PerplexityAccumulator, PerplexityResult, build_reports, window_partial
from evals.reference import (
    DEFAULT_SAMPLES,
    DEFAULT_TOP_K,
    ReferenceIdentity,
    ReferenceRecorder,
    SavedReference,
    form_name,
    tokenizer_fingerprint,
)
from evals.sweep import REFERENCE_TYPE, SweepResult, run_sweep
from evals.sweep import Event as SweepEvent
from evals.sweep import ScoreProgress as SweepProgress
from evals.scoring import ScoredBlock, count_scored, iter_scored, scored_text_bytes
from evals.text_source import LoadedText, TextSpec, load_text
from evals.tokens import chunk_bos, tokenize_for
from evals.temperature import DEFAULT_T_MAX, DEFAULT_T_MIN, RowFeatures, TemperatureGrid, row_features
from evals.windows import DEFAULT_CTX, Window, WindowSettings, plan_windows, resolve_settings
from formats.errors import CortiqError
from formats.untrusted_json import section

# (tokens scored, tokens to score, the running figure: ppl, or top-1 accuracy)
ScoreProgress = Callable[[int, int, float], None]


@dataclass(frozen=True)
class WindowOptions:
    """The window options as given (None: the default, or a saved reference's)."""

    mode: str | None = None
    ctx: int | None = None
    stride: int | None = None
    max_tokens: int | None = None
    chunks: int | None = None

    def resolve(self, saved: dict[str, Any] | None = None) -> WindowSettings:
        return resolve_settings(self.mode, self.ctx, self.stride, self.max_tokens, self.chunks, saved)


@dataclass(frozen=True)
class EngineOptions:
    """How the models run: tokens per forward block, the KV cache's type, threads (None: all cores)."""

    batch: int = 512
    kv_cache: str = "f32"
    threads: int | None = None


@dataclass(frozen=True)
class ClusterRun:
    """Score on a Ray cluster: where, engine threads per worker (None: the driver's), resume."""

    where: ClusterAddress
    threads: int | None = None
    resume: bool = False
    progress: ClusterProgress | None = field(default=None, compare=False)


def load_engines(paths: list[Path], threads: int | None, ctx: int, kv_cache: str = "f32") -> list[Any]:
    from cortiq_engine import Engine

    return [Engine.load(p, threads=threads, ctx=ctx, kv_cache=kv_cache) for p in paths]


def model_label(path: Path, engine: Any) -> str:
    quant = section(getattr(engine, "header", None) or {}, "quant").get("default")
    return f"{path.name} ({quant})" if quant else path.name


def whole_windows(blocks: Iterator[ScoredBlock], windows: list[Window]) -> Iterator[list[ScoredBlock]]:
    """Group scored blocks by window, yielding a window as soon as all of its rows are
    scored (so a Ctrl-C leaves figures over whole windows)."""
    pending: list[ScoredBlock] = []
    rows = 0
    for b in blocks:
        if pending and b.window != pending[0].window:  # not expected: iter_scored gives every row
            yield pending
            pending, rows = [], 0
        pending.append(b)
        rows += len(b.targets)
        if rows >= windows[b.window].n_scored:
            yield pending
            pending, rows = [], 0


# ------------------------------------------------------------------ ppl


@dataclass(frozen=True)
class PplRequest:
    models: list[Path]
    text: TextSpec = TextSpec()
    windows: WindowOptions = WindowOptions()
    save_ref: Path | None = None
    ref: Path | None = None
    ref_top_k: int = DEFAULT_TOP_K
    ref_samples: int = DEFAULT_SAMPLES
    engine: EngineOptions = EngineOptions()

    def check(self) -> None:
        """The combinations refused before anything is read."""
        if self.ref is not None and self.save_ref is not None:
            raise CortiqError("--ref and --save-ref cannot be combined (save the reference in its own run)")
        if self.save_ref is not None and any(self.save_ref.resolve() == m.resolve() for m in self.models):
            raise CortiqError(f"--save-ref {self.save_ref} is one of the models; give a new file name such as ref.cref")


@dataclass(frozen=True)
class PplRun:
    source: LoadedText
    info: dict[str, Any]  # the report's settings block
    result: PerplexityResult
    paths: list[Path]  # one per report: the saved reference first when there is one
    windows: int
    done: int  # windows scored (fewer after a Ctrl-C)
    cluster: ClusterReport | None = None

    @property
    def partial(self) -> bool:
        return self.done < self.windows

    def to_json(self) -> dict[str, Any]:
        return {
            "text": {"source": self.source.source, "documents": self.source.documents, "bytes": self.source.n_bytes},
            "settings": self.info,
            "models": [dict(r.to_json(), path=str(p)) for r, p in zip(self.result.reports, self.paths)],
            "comparisons": [c.to_json() for c in self.result.comparisons],
        }


def run_ppl(
    req: PplRequest, progress: ScoreProgress | None = None, cluster: ClusterRun | None = None, tool: str = "cortiq ppl"
) -> PplRun:
    """Perplexity of every model on the text, and each one's drift from the reference
    (the first model, or ``req.ref``); with ``req.save_ref`` the first model's rows are
    saved as a reference (only when every window is scored)."""
    req.check()
    if cluster is not None and req.save_ref is not None:
        raise CortiqError("--save-ref runs in one process: save the reference without --cluster")
    saved = SavedReference(req.ref) if req.ref is not None else None
    settings = req.windows.resolve(saved.settings if saved else None)
    source = load_text(req.text)
    engines = load_engines(req.models, req.engine.threads, settings.ctx, req.engine.kv_cache)
    names = [model_label(p, e) for p, e in zip(req.models, engines)]
    tokens = tokenize_for(engines, names, source)
    windows = plan_windows(settings, len(tokens), chunk_bos(engines[0].tokenizer))
    if not windows:
        raise CortiqError("nothing to score: the window plan is empty")
    ident = ReferenceIdentity(
        tokenizer_fingerprint(engines[0].tokenizer, engines[0].vocab_size), source.sha256, int(engines[0].vocab_size)
    )
    if saved is not None:
        saved.check(ident, tokens, windows)
        names = [f"{saved.name} (saved)"] + names
    recorder = None
    if req.save_ref is not None:
        meta = reference_meta(req.models[0], names[0], engines[0], ident, source, settings, tool)
        recorder = ReferenceRecorder(
            req.save_ref,
            tokens=tokens,
            windows=windows,
            vocab_size=int(engines[0].vocab_size),
            top_k=req.ref_top_k,
            samples=req.ref_samples,
            meta=meta,
        )
    creport = None
    try:
        if cluster is not None:
            from evals.cluster import score_ppl

            result, done, creport = score_ppl(
                cluster.where,
                cluster.threads or engines[0].threads,
                req.models,
                settings.ctx,
                req.engine.kv_cache,
                req.engine.batch,
                names,
                tokens,
                windows,
                engines[0].tokenizer,
                saved=saved,
                resume=cluster.resume,
                progress=cluster.progress,
            )
        else:
            result, done = score_partial(
                engines,
                names,
                tokens,
                windows,
                engines[0].tokenizer,
                req.engine.batch,
                progress,
                saved=saved,
                recorder=recorder,
            )
        if recorder is not None:
            if done < len(windows):
                recorder.abort()
            else:
                recorder.commit()
    except BaseException:
        if recorder is not None:
            recorder.abort()
        raise

    info = {
        **settings.to_json(),
        "windows": len(windows),
        "chunk_bos": windows[0].bos if settings.mode == "chunks" else None,
        "text_tokens": int(len(tokens)),
        "reference": (
            {"path": str(req.ref), "form": saved.form, "model": saved.name}
            if saved
            else {"path": str(req.models[0]), "form": "full", "model": names[0]}
        ),
        **(
            {
                "saved_ref": {
                    "path": str(req.save_ref),
                    "form": form_name(recorder.top_k, recorder.samples),
                    "bytes": req.save_ref.stat().st_size,
                }
            }
            if recorder is not None and req.save_ref is not None and done == len(windows)
            else {}
        ),
        # only after a Ctrl-C: the figures cover the first windows_done windows
        **({"partial": True, "windows_done": done} if done < len(windows) else {}),
        **({"cluster": creport.to_json()} if creport is not None else {}),
    }
    paths = ([req.ref] if req.ref is not None else []) + list(req.models)
    return PplRun(source, info, result, paths, len(windows), done, creport)


def reference_meta(
    path: Path,
    label: str,
    engine: Any,
    ident: ReferenceIdentity,
    source: LoadedText,
    settings: WindowSettings,
    tool: str,
) -> dict[str, Any]:
    """The saved reference's identity: checked by --ref, shown by inspect."""
    return {
        "model": {"path": str(path), "label": label, "arch": getattr(getattr(engine, "arch", None), "arch", None)},
        "tokenizer": {
            "fingerprint": ident.tokenizer,
            "vocab_size": ident.vocab_size,
            "bos_id": getattr(engine.tokenizer, "bos_id", None),
            "add_bos": bool(getattr(engine.tokenizer, "add_bos", False)),
        },
        "text": {"sha256": ident.text_sha256, "source": source.source, "bytes": source.n_bytes},
        "settings": settings.to_json(),
        "tool": tool,
    }


def score_partial(
    engines: list[Any],
    names: list[str],
    tokens: Any,
    windows: list[Window],
    decoder: Any,
    chunk: int,
    progress: ScoreProgress | None = None,
    *,
    saved: SavedReference | None = None,
    recorder: ReferenceRecorder | None = None,
) -> tuple[PerplexityResult, int]:
    """Score every model in lockstep; on Ctrl-C, the figures over the windows done so far
    (and how many); with none done the interrupt goes on up."""
    acc = PerplexityAccumulator(len(engines), saved_ref=saved is not None)
    total, done = count_scored(windows), 0
    try:
        for group in whole_windows(iter_scored(engines, tokens, windows, chunk=chunk), windows):
            refs = [saved.next_rows(len(b.targets)) for b in group] if saved is not None else None
            if recorder is not None:
                for block in group:
                    recorder.add(block.logits[0], block.targets)
            acc.add_partial(window_partial(group[0].window, group, len(engines), refs))
            done = group[0].window + 1
            if progress:
                progress(acc.count, total, acc.running_ppl)
    except KeyboardInterrupt:
        if not acc.count:
            raise
    form = saved.form if saved is not None else "full"
    reports, comps = build_reports(acc, names, scored_text_bytes(decoder, tokens, windows[:done]), form)
    return PerplexityResult(reports, comps), done


# ------------------------------------------------------------------ calibrate


@dataclass(frozen=True)
class CalibrateRequest:
    model: Path
    text: TextSpec = TextSpec()
    windows: WindowOptions = WindowOptions()
    bins: int = DEFAULT_BINS
    fit_fraction: float = DEFAULT_FIT_FRACTION
    t_min: float = DEFAULT_T_MIN
    t_max: float = DEFAULT_T_MAX
    engine: EngineOptions = EngineOptions()


@dataclass(frozen=True)
class CalibrateRun:
    source: LoadedText
    report: CalibrationReport
    settings: dict[str, Any]  # the report's settings block
    windows: int
    done: int
    cluster: ClusterReport | None = None

    @property
    def partial(self) -> bool:
        return self.done < self.windows


def run_calibrate(
    req: CalibrateRequest, progress: ScoreProgress | None = None, cluster: ClusterRun | None = None
) -> CalibrateRun:
    """Top-1 confidence against accuracy over the scored tokens, and the temperature fitted
    on the leading ``fit_fraction`` of them; the model is closed when the pass ends."""
    wset = req.windows.resolve()
    grid = TemperatureGrid.make(req.t_min, req.t_max)
    source = load_text(req.text)
    (engine,) = load_engines([req.model], req.engine.threads, req.windows.ctx or DEFAULT_CTX, req.engine.kv_cache)
    name = model_label(req.model, engine)
    tokens = tokenize_for([engine], [name], source)
    windows = plan_windows(wset, len(tokens), chunk_bos(engine.tokenizer))
    total = sum(w.n_scored for w in windows)
    split_rows(total, req.fit_fraction)  # too few tokens: say so before the pass
    creport = None
    try:
        if cluster is not None:
            from evals.cluster import collect_features

            features, done, creport = collect_features(
                cluster.where,
                cluster.threads or engine.threads,
                req.model,
                req.windows.ctx or DEFAULT_CTX,
                req.engine.kv_cache,
                req.engine.batch,
                tokens,
                windows,
                grid,
                resume=cluster.resume,
                progress=cluster.progress,
            )
        else:
            features, done = collect_partial(engine, tokens, windows, grid, chunk=req.engine.batch, progress=progress)
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()  # release the map: --write rewrites the header under it
    report = calibration_report(name, features, grid, req.bins, req.fit_fraction)
    settings = {
        "mode": wset.mode,
        "ctx": req.windows.ctx,
        "stride": wset.stride,
        "chunks": wset.chunks,
        "windows": len(windows),
        "max_tokens": req.windows.max_tokens,
        "text_tokens": int(len(tokens)),
        "t_min": float(grid.temperatures.min()),
        "t_max": float(grid.temperatures.max()),
        "grid_points": grid.n,
        "fit_fraction": req.fit_fraction,
        **({"partial": True, "windows_done": done} if done < len(windows) else {}),
        **({"cluster": creport.to_json()} if creport is not None else {}),
    }
    return CalibrateRun(source, report, settings, len(windows), done, creport)


def collect_partial(
    engine: Any,
    tokens: Any,
    windows: list[Any],
    grid: TemperatureGrid,
    chunk: int,
    progress: ScoreProgress | None = None,
) -> tuple[RowFeatures, int]:
    """The row features of every window in this process (``evals.temperature.row_features``
    of each scored block); on Ctrl-C, those of the windows done so far (and how many);
    with none done the interrupt goes on up."""
    parts: list[RowFeatures] = []
    total, rows, hits, done = count_scored(windows), 0, 0, 0
    try:
        for group in whole_windows(iter_scored([engine], tokens, windows, chunk=chunk), windows):
            for block in group:
                f = row_features(block.logits[0], block.targets, grid)
                parts.append(f)
                rows += len(f)
                hits += int(f.correct.sum())
            done = group[0].window + 1
            if progress:
                progress(rows, total, hits / max(rows, 1))
    except KeyboardInterrupt:
        if not parts:
            raise
    return RowFeatures.concat(parts, grid), done


# ------------------------------------------------------------------ imatrix


@dataclass(frozen=True)
class ImatrixRequest:
    model: Path
    text: TextSpec = TextSpec()
    windows: WindowOptions = WindowOptions()
    threads: int | None = None


@dataclass(frozen=True)
class ImatrixRun:
    source: LoadedText
    means: dict[str, Any]  # weight name -> mean squared input activation per column
    tokens: int  # tokens fed
    cluster: ClusterReport | None = None


def run_imatrix(
    req: ImatrixRequest, progress: Callable[[int, int], None] | None = None, cluster: ClusterRun | None = None
) -> ImatrixRun:
    """Every weight's mean squared input activation per column over every token the windows
    feed (llama-imatrix's collection); ``progress`` gets (tokens fed, tokens to feed).
    A cluster run interrupted before its last window raises KeyboardInterrupt (an imatrix
    of part of the text is never returned)."""
    from cortiq_engine import Engine
    from cortiq_engine.imatrix import collect_imatrix

    settings = req.windows.resolve()
    source = load_text(req.text)
    with Engine.load(req.model, threads=req.threads, ctx=req.windows.ctx or DEFAULT_CTX, warmup=False) as eng:
        ids = tokenize_for([eng], [req.model.name], source)
        bos = chunk_bos(eng.tokenizer)
        engine_threads = eng.threads
    plan = plan_windows(settings, len(ids), bos)
    if cluster is not None:
        from evals.cluster import collect_imatrix as on_cluster

        acc, done, creport = on_cluster(
            cluster.where,
            cluster.threads or engine_threads,
            req.model,
            ids,
            plan,
            resume=cluster.resume,
            progress=cluster.progress,
        )
        if done < len(plan):  # never an imatrix of part of the text
            raise ClusterInterrupted(creport)
        return ImatrixRun(source, acc.means(), acc.tokens, creport)
    fed = [w.fed(ids) for w in plan]
    total, done = sum(len(w) for w in fed), 0

    def step(n: int) -> None:
        nonlocal done
        done += n
        if progress:
            progress(done, total)

    means, tokens = collect_imatrix(req.model, fed, threads=req.threads, progress=step)
    return ImatrixRun(source, means, tokens)


class ClusterInterrupted(KeyboardInterrupt):
    """A cluster pass stopped before its last window (its report says how far it got)."""

    def __init__(self, report: ClusterReport):
        super().__init__()
        self.report = report


# ------------------------------------------------------------------ quant-sweep


@dataclass(frozen=True)
class SweepRequest:
    src: str
    types: list[str]
    text: TextSpec = TextSpec()
    windows: WindowOptions = WindowOptions()
    top_k: int = 64
    samples: int = 64
    decode_tokens: int = 64
    decode_reps: int = 3
    workdir: Path | None = None  # None: a temporary folder, removed afterwards
    keep_files: bool = False
    batch: int = 512
    threads: int | None = None

    def check(self) -> None:
        if self.keep_files and self.workdir is None:
            raise CortiqError("--keep-files needs --workdir (a temporary folder is removed afterwards)")


@dataclass(frozen=True)
class SweepRun:
    source: LoadedText
    settings: WindowSettings
    result: SweepResult
    cluster: dict[str, ClusterReport]  # per type, for a cluster run


def run_quant_sweep(
    req: SweepRequest,
    event: SweepEvent | None = None,
    progress: SweepProgress | None = None,
    cluster: ClusterRun | None = None,
) -> SweepRun:
    """Convert ``src`` to each type, score each against the f32 reference on the same
    windows and time its decode (``evals.sweep.run_sweep``). A cluster run interrupted
    before a type's last window raises ``ClusterInterrupted``: no row of a type is scored
    on part of the windows."""
    req.check()
    settings = req.windows.resolve()
    if cluster is not None and cluster.resume and req.workdir is None:  # journaled by the reference's path
        raise CortiqError("--resume with quant-sweep needs the --workdir of the interrupted run")
    source = load_text(req.text)
    need_ctx = max(settings.ctx, req.decode_tokens + 2)
    creports: dict[str, ClusterReport] = {}

    def load(path: Path) -> Any:
        from cortiq_engine import Engine

        return Engine.load(path, threads=req.threads, ctx=need_ctx)

    def plan(n_tokens: int, bos: int | None) -> list[Window]:
        return plan_windows(settings, n_tokens, bos)

    def remote(kind: str, path: Path, tokens: Any, windows: list[Window], eng: Any, saved: Any) -> Any:
        """One type's scoring on the cluster (its CMF read by the workers at the same path)."""
        from evals.cluster import score_ppl

        assert cluster is not None
        result, done, creport = score_ppl(
            cluster.where,
            cluster.threads or eng.threads,
            [path],
            need_ctx,
            "f32",
            req.batch,
            [REFERENCE_TYPE, kind],
            tokens,
            windows,
            eng.tokenizer,
            saved=saved,
            resume=cluster.resume,
            progress=cluster.progress,
        )
        creports[kind] = creport
        if done < len(windows):
            raise ClusterInterrupted(creport)
        return result

    if req.workdir is not None and req.workdir.exists() and not req.workdir.is_dir():
        raise CortiqError(f"--workdir {req.workdir} is a file")
    folder = (
        contextlib.nullcontext(str(req.workdir))
        if req.workdir is not None
        else tempfile.TemporaryDirectory(prefix="cortiq-sweep-")
    )
    with folder as where:
        result = run_sweep(
            req.src,
            req.types,
            source,
            Path(where),
            load,
            plan,
            top_k=req.top_k,
            samples=req.samples,
            decode_tokens=req.decode_tokens,
            decode_reps=req.decode_reps,
            chunk=req.batch,
            keep_files=req.keep_files,
            settings=settings.to_json(),
            event=event,
            progress=progress,
            remote=remote if cluster is not None else None,
        )
    return SweepRun(source, settings, result, creports)


__all__ = [
    "EngineOptions",
    "SweepRequest",
    "SweepRun",
    "run_quant_sweep",
    "CalibrateRequest",
    "CalibrateRun",
    "ClusterInterrupted",
    "ImatrixRequest",
    "ImatrixRun",
    "collect_partial",
    "run_calibrate",
    "run_imatrix",
    "ClusterRun",
    "PplRequest",
    "PplRun",
    "ScoreProgress",
    "WindowOptions",
    "load_engines",
    "model_label",
    "run_ppl",
    "score_partial",
    "whole_windows",
]
